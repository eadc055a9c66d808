"""Typed configuration: one dataclass per section, veRL's dotted key names, validated at start-up.

    hybridflow train data.train_files=~/data/gsm8k/train.parquet actor_rollout_ref.rollout.n=8 \\
        algorithm.adv_estimator=grpo trainer.total_training_steps=100

Defaults live in these dataclasses (``hybridflow/config/*.yaml`` files are presets merged on top). Unknown keys fail
with the closest valid key; inconsistent batch sizes fail with the numbers to change — before any worker starts.

Batch-size semantics (as in veRL):
  * ``data.train_batch_size``: prompts per training step; the step trains on ``train_batch_size * rollout.n`` responses.
  * ``actor.ppo_mini_batch_size``: prompts per optimizer step (so ``ppo_mini_batch_size * rollout.n`` responses);
    one training step makes ``train_batch_size / ppo_mini_batch_size * ppo_epochs`` optimizer steps.
  * ``*_micro_batch_size_per_gpu``: rows per forward/backward on one rank (gradient accumulation inside a mini-batch),
    or, with ``use_dynamic_bsz``, a token budget ``ppo_max_token_len_per_gpu`` per micro-batch instead.
"""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and what to change."""


# ----------------------------------------------------------------------------------------------------- sections
@dataclass
class CustomClsConfig:
    """veRL's data.custom_cls: a dataset class of the user's (data/custom_dataset.py), built with veRL's signature."""

    path: str | None = None  # a Python file
    name: str | None = None  # the class in it (a torch.utils.data.Dataset)


@dataclass
class DataConfig:
    train_files: Any = None  # path or list of paths (parquet / jsonl); None = the built-in task
    val_files: Any = None
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 32
    # veRL's DAPO key: prompts per generation batch (None: train_batch_size); another size needs
    # algorithm.filter_groups.enable (trainer/dynamic_sampling.py), which fills a step from several such batches
    gen_batch_size: int | None = None
    val_batch_size: int | None = None  # None: the whole validation set in one batch
    val_max_samples: int = -1  # -1: all
    filter_overlong_prompts: bool = True
    # veRL's key: processes that render and tokenize the prompts (data/parallel_prompts.py; 1: in the driver)
    filter_overlong_prompts_workers: int = 1
    # veRL's DataLoader processes: none here (batches are slices of the rows tokenized before the first step), so
    # only 0 is taken (verl_model_keys.py)
    dataloader_num_workers: int = 0
    truncation: str = "error"  # error | left | right
    shuffle: bool = True
    seed: int = 1
    reward_fn_key: str = "data_source"
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    return_raw_chat: bool = False  # veRL's key; true: each prompt's chat messages ride along (non-tensor raw_prompt)
    trust_remote_code: bool = False  # veRL's key: refused for a tokenizer with code of its own (verl_model_keys.py)
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)


@dataclass
class FusedKernelOptions:
    """veRL's ``model.fused_kernel_options``: which implementation computes the fused log-probs / entropy."""

    impl_backend: Any = "torch"  # torch (or veRL's None): hybridflow's path is torch code; triton is refused


@dataclass
class ModelConfig:
    path: str | None = None  # None = the shipped base model of the built-in task
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = True
    trust_remote_code: bool = False  # veRL's key: refused for a model folder with code of its own (verl_model_keys.py)


@dataclass
class PolicyModelConfig(ModelConfig):
    """actor_rollout_ref.model: ModelConfig plus veRL's LoRA keys (engines/lora.py); the critic has no LoRA here."""

    lora_rank: int = 0  # 0: full fine-tuning; > 0: PEFT LoRA adapters, the reference is the adapter-less base
    lora_alpha: float = 16
    target_modules: Any = "all-linear"  # "all-linear" or a list of module names, e.g. [q_proj, v_proj]
    lora_dropout: float = 0.0
    exclude_modules: Any = None  # None, a list of module names, or a regex
    # veRL's keys (trainer/verl_model_keys.py): attributes set on the actor's, ref's and rollout's transformers config
    override_config: dict = field(default_factory=dict)
    # veRL's key. Log-probs and entropy always come from the response positions' hidden states in chunks of rows;
    # true: the actor's backward recomputes each chunk's [chunk, vocab] logits instead of keeping every chunk's
    # (engines/hf_model.py logits_checkpointing: memory for one more head matmul; docs/benchmarks.md)
    use_fused_kernels: bool = False
    fused_kernel_options: FusedKernelOptions = field(default_factory=FusedKernelOptions)
    # true: actor and ref pack each micro-batch's rows into one row with per-row attention (engines/packing.py)
    # instead of bucketing them by length; no padding is computed at all. null (default): packed wherever it applies
    # (engines/fsdp_engine.py why_not_packed: not with tensor/sequence parallelism, batch_invariant, a padded forward,
    # or sliding-window / soft-capped attention; the critic follows the same rule); false: always bucketed
    use_sequence_packing: bool | None = None
    # veRL's keys: a saved PEFT adapter folder LoRA starts from (engines/lora_adapter.py; needs lora_rank = its r),
    # and use_shm: the model folder copied to /dev/shm once, loaded from there, removed at exit (trainer/shm_model.py)
    lora_adapter_path: str | None = None
    use_shm: bool = False
    # veRL's key: the dtype actor and reference load their weights in where fsdp_config.model_dtype is unset
    torch_dtype: str | None = None
    # true: actor, ref and the native rollout round alike, so the rollout's fp32 log-probs are the training
    # engine's bit for bit (zero train-inference mismatch; engines/batch_invariant.py); costs rollout speed
    batch_invariant: bool = False


@dataclass
class OptimSection:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    warmup_style: str | None = None  # veRL's older name for lr_scheduler_type
    min_lr_ratio: float = 0.0
    total_training_steps: int = -1  # filled in by the trainer


@dataclass
class MixedPrecisionSection:
    """veRL's fsdp_config.mixed_precision; its param_dtype is fsdp_config.param_dtype (trainer/verl_keys.py)."""

    reduce_dtype: str = "fp32"  # the dtype gradients are reduce-scattered in across ranks: fp32 | bf16
    buffer_dtype: str = "fp32"  # the model's floating buffers (e.g. RoPE's inv_freq): fp32 | bf16


@dataclass
class FSDPSection:
    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: int = -1
    param_dtype: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights)
    # veRL's key: the dtype the weights are loaded and kept in; null: model.torch_dtype (actor/ref), else fp32.
    # bf16: weights, grads and optimizer state in bf16 (half the memory, no fp32 master copy)
    model_dtype: str | None = None
    # veRL's key: each decoder layer prefetches the next one's all-gather in forward (sharded engines only)
    forward_prefetch: bool = False
    mixed_precision: MixedPrecisionSection = field(default_factory=MixedPrecisionSection)
    # training tensor parallelism (engines/tensor_parallel_train.py): ranks that split every projection; veRL's name
    # for the TP size of its engines (the rollout's is actor_rollout_ref.rollout.tensor_model_parallel_size)
    tensor_model_parallel_size: int = 1


@dataclass
class PolicyLossSection:
    loss_mode: str = "vanilla"  # vanilla (= ppo) | gspo | cispo | reinforce | any registered name


@dataclass
class RouterReplaySection:
    # MoE routing replay (veRL's key): disabled | R3 (training forwards use the experts the rollout chose)
    mode: str = "disabled"


ROUTER_REPLAY_MODES = ("disabled", "R3")


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


@dataclass
class RoleProfilerSection:
    """veRL's <role>.profiler (trainer/profiling.py): torch.profiler traces of global_profiler.steps on these ranks."""

    enable: bool = False
    tool: str | None = None  # null: global_profiler.tool; torch only (nsys / npu / torch_memory are refused)
    all_ranks: bool = False
    ranks: list = field(default_factory=list)  # none listed (and all_ranks false): rank 0
    save_path: str | None = None  # null: global_profiler.save_path


@dataclass
class CheckpointContentsSection:
    """veRL's actor.checkpoint: what a checkpoint holds (model shards, optimizer state, extra = LR schedule + RNG,
    hf_model = a transformers copy in actor/huggingface) and what a resume restores (null: save_contents)."""

    save_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: list | None = None


@dataclass
class ActorConfig:
    strategy: str = "fsdp2"
    ppo_mini_batch_size: int = 16  # prompts
    ppo_micro_batch_size_per_gpu: int = 8  # responses
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    # veRL's PrefixGrouper switch: each prompt computed once for its n responses in a packed micro-batch
    # (engines/shared_prompts.py). None: wherever the engine packs; true asks for it (an error where it cannot run,
    # e.g. a mixture-of-experts model); false: every row computes its own prompt
    use_prefix_grouper: bool | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio (DAPO clip-higher: e.g. 0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    policy_loss: PolicyLossSection = field(default_factory=PolicyLossSection)
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    recompute_old_log_prob: str = "auto"  # auto: skip the pass when the update is exactly on-policy | always
    # MoE: weight of the router load-balancing loss; null = the model config's rule (router_aux_loss_coef when
    # output_router_logits is true, else none). Router balance stats are logged for MoE models either way.
    router_aux_loss_coef: float | None = None
    router_replay: RouterReplaySection = field(default_factory=RouterReplaySection)
    use_torch_compile: bool = False  # veRL's key; the forward is eager here (true is refused, verl_model_keys.py)
    entropy_from_logits_with_chunking: bool = True  # veRL's key; always chunked here
    # veRL's diagnostic: log actor/sum_pi_squared, the mean over response tokens of sum_v pi(v)^2 (engines/hf_model.py)
    calculate_sum_pi_squared: bool = False
    # veRL's key: recompute each chunk's entropy from its logits in backward instead of keeping its activations
    entropy_checkpointing: bool = False
    optim: OptimSection = field(default_factory=OptimSection)
    fsdp_config: FSDPSection = field(default_factory=FSDPSection)
    ulysses_sequence_parallel_size: int = 1  # ranks that split every sequence (engines/ulysses.py)
    checkpoint: CheckpointContentsSection = field(default_factory=CheckpointContentsSection)
    profiler: RoleProfilerSection = field(default_factory=RoleProfilerSection)


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """veRL's ``rollout.multi_turn`` section (workers/agent_rollout.py maps it onto the agent loop; docs/agents.md).
    Keys veRL has keep its names; environment, environment_kwargs, tools and the limits after them are ours."""

    enable: bool = False
    max_assistant_turns: int | None = None  # None: no limit (the token budget still ends an episode)
    max_user_turns: int | None = None  # observations appended (tool results or environment messages)
    max_parallel_calls: int = 1  # tool calls run per assistant turn; more get an error observation
    max_tool_response_length: int | None = 256  # tokens kept of one tool result / environment message
    tool_response_truncate_side: str = "middle"  # left | middle | right: what a cut observation keeps
    tool_config_path: str | None = None  # veRL's tool config file (class_name + OpenAI function schema)
    format: str = "hermes"  # the tool-call parser: hermes (alias qwen) or 'package.module:Parser'
    environment: str | None = None  # a registered environment (guess_number, textarena) or 'package.module:Class'
    environment_kwargs: dict = field(default_factory=dict)  # passed to the environment for each episode
    tools: list = field(default_factory=list)  # typed Python functions as tools: ['package.module:function']
    max_tool_calls: int | None = None  # per episode
    max_tokens_per_turn: int | None = None  # None: the episode's remaining budget (data.max_response_length)
    tool_timeout_s: float | None = 10.0
    env_timeout_s: float | None = 30.0
    max_failure_fraction: float = 0.5  # more episodes than this with a tool/environment failure stop the run
    failure_reward: float = 0.0  # the environment reward of an episode whose environment failed


@dataclass
class AgentSection:
    """veRL's ``rollout.agent`` section, as far as hybridflow has what it switches: which agent loop runs a row whose
    data has no ``agent_name`` column (workers/agent_rollout.py; docs/agents.md)."""

    # single_turn_agent (one generation, no tools) | tool_agent (the multi-turn loop: tools / environment);
    # None: tool_agent when multi_turn.enable=true, else single_turn_agent (veRL's default is single_turn_agent)
    default_agent_loop: str | None = None


@dataclass
class TraceSection:
    """veRL's ``rollout.trace`` (agent-loop traces sent to mlflow / weave): not offered, so only its defaults, which
    trace nothing, are taken (verl_model_keys.py); samples.jsonl keeps rollouts and episodes as text."""

    backend: str | None = None
    token2text: bool = False
    max_samples_per_step_per_worker: int | None = None


@dataclass
class RolloutConfig:
    name: str = "native"  # native | hf | vllm
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = True
    dtype: str = "fp32"  # fp32 | bf16 | int8 (native engine on CPU: int8 weights in the layer matmuls); vllm: fp16 too
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    stop_token_ids: list = field(default_factory=list)
    # veRL's engine switches; None leaves the engine's default. native: enforce_eager=True -> no CUDA graphs,
    # free_cache_engine=True -> its CUDA-graph KV buffers are freed after each generation; vllm: passed through.
    enforce_eager: bool | None = None
    free_cache_engine: bool | None = None
    gpu_memory_utilization: float | None = None  # vllm on GPUs
    # native: prefill the prompts in groups of at most max_num_batched_tokens padded tokens (chunked_prefill.py);
    # enable_chunked_prefill=true alone: the default budget, 8192
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    # native: at most this many rows decode together (prompts in successive groups, same samples); vllm: its own cap
    max_num_seqs: int | None = None
    tensor_model_parallel_size: int = 1  # ranks per tensor-parallel rollout group (native: tensor_parallel.py)
    calculate_log_probs: bool = True  # False: generated rows carry no rollout_log_probs (no mismatch metrics)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    # Options for the engine's constructor: ``engine_kwargs.<option>`` for the chosen engine, or veRL's
    # per-engine ``engine_kwargs.<engine name>.<option>``, applied only when that engine is the chosen one.
    engine_kwargs: dict = field(default_factory=dict)
    # hybrid_engine=false only: the rollout group's own processes (veRL's standalone-rollout keys) and the size of
    # the buckets the actor's weights are streamed to it in
    nnodes: int = 1
    n_gpus_per_node: int = 1
    update_weights_bucket_megabytes: int = 64
    # veRL's keys, as far as hybridflow has what they switch (trainer/verl_model_keys.py)
    # async (veRL's default and, since it removed sync, its only mode) | sync: both name hybridflow's one rollout path,
    # the engine generating each request of the batch (the agent loop for multi-turn rows); verl_model_keys.py
    mode: str = "async"
    load_format: str = "auto"  # auto | hf | safetensors (requires *.safetensors in model.path)
    layered_summon: bool = True  # always: weight sync gathers one full tensor at a time
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentSection = field(default_factory=AgentSection)
    trace: TraceSection = field(default_factory=TraceSection)
    # veRL's keys whose one value is what hybridflow does (the others are refused with the reason,
    # verl_model_keys.py): every request runs to its end (no early abort of the slowest), the engine takes and
    # returns token ids, and the rollout records MoE routes exactly when actor.router_replay.mode=R3
    over_sample_rate: float = 0.0
    skip_tokenizer_init: bool = True
    enable_rollout_routing_replay: bool = False
    # veRL's engine knobs. max_model_len: the rollout engine's context length, any engine (None:
    # data.max_prompt_length + data.max_response_length; more leaves multi-turn episodes room). quantization and
    # enable_prefix_caching: vllm only, passed to vllm.LLM (other engines refuse them, engines/rollout/base.py)
    max_model_len: int | None = None
    quantization: str | None = None
    enable_prefix_caching: bool | None = None


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    fsdp_config: FSDPSection = field(default_factory=FSDPSection)
    use_torch_compile: bool = False  # veRL's key; the forward is eager here (true is refused, verl_model_keys.py)
    entropy_from_logits_with_chunking: bool = True  # veRL's key; always chunked here
    ulysses_sequence_parallel_size: int = 1
    strategy: str = "fsdp2"  # veRL's key: fsdp / fsdp2 (the reference runs on the actor's FSDP2 engine); no megatron
    # veRL's key; the reference computes no entropy and runs no backward, so true is refused (verl_model_keys.py)
    entropy_checkpointing: bool = False
    profiler: RoleProfilerSection = field(default_factory=RoleProfilerSection)  # the actor's processes hold the ref


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    # veRL's key: seconds a collective of the actor/rollout/ref process group may wait (torch.distributed's timeout)
    nccl_timeout: int = 600


@dataclass
class CriticConfig:
    enable: bool | None = None  # None: on when the advantage estimator needs values (gae)
    model: ModelConfig = field(default_factory=ModelConfig)  # path None: the actor's model path
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5))
    ppo_mini_batch_size: int | None = None  # None: the actor's
    ppo_micro_batch_size_per_gpu: int = 8
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # veRL's keys: the value pass (forward only) sized apart from the update; None: the ppo_* size above
    forward_micro_batch_size_per_gpu: int | None = None
    forward_max_token_len_per_gpu: int | None = None
    ppo_epochs: int | None = None  # None: the actor's
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    fsdp_config: FSDPSection = field(default_factory=FSDPSection)
    ulysses_sequence_parallel_size: int = 1
    profiler: RoleProfilerSection = field(default_factory=RoleProfilerSection)


@dataclass
class OverlongBuffer:
    enable: bool = False
    len: int = 16
    penalty_factor: float = 1.0
    log: bool = False  # veRL's DAPO recipe key: also log reward/overlong_fraction and each row's penalty


@dataclass
class RewardModelFSDPConfig:
    param_offload: bool = False  # the reward model's weights in host memory between scoring calls (veRL's key)


@dataclass
class RewardModelModelConfig(ModelConfig):
    fsdp_config: RewardModelFSDPConfig = field(default_factory=RewardModelFSDPConfig)


@dataclass
class RewardModelRolloutConfig:
    """veRL's reward_model.rollout: the engine that serves the reward model in the reward loop (use_reward_loop)."""

    name: str = "hf"  # hf (transformers, processes of its own) | vllm (vLLM's pooling runner)
    gpu_memory_utilization: float | None = None  # vllm only (None: veRL's 0.5); hf allocates per call, refused
    tensor_model_parallel_size: int = 1  # > 1: vllm only (its tensor_parallel_size)
    prompt_length: int | None = None  # the reward model reads the prompt's last N tokens (None: all), any engine
    response_length: int | None = None  # ... and the response's first N tokens (None: all), any engine


@dataclass
class SandboxFusionConfig:
    """veRL's reward_model.sandbox_fusion: code rewards' test cases run on a SandboxFusion service
    (rewards/sandbox_fusion.py) instead of hybridflow's local box."""

    url: str | None = None  # the service's run_code endpoint, e.g. http://host:8080/run_code; None: the local box
    max_concurrent: int = 64  # requests in flight at most (caps reward_model.num_workers)
    memory_limit_mb: int = 1024  # per test case


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    # veRL's switch: true scores with the engine of reward_model.rollout in processes of its own, overlapped with the
    # rule scoring; false is its legacy worker, in the actor's processes (workers/reward_model.py)
    use_reward_loop: bool = False
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    micro_batch_size_per_gpu: int = 16  # rows per forward (rollout.name=vllm: its max_num_seqs)
    weight: float = 1.0  # rm score weight when combined with rule scores
    reward_manager: str = "naive"  # naive | batch | dapo | prime (veRL's), see hybridflow/rewards/managers.py
    reward_kwargs: dict = field(default_factory=dict)  # veRL: the manager's own options, e.g. dapo's overlong_buffer_cfg
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)  # hybridflow's older key, any manager
    # veRL's switch: true computes the rule scores in a background thread (their scorers run in the workers below)
    # while the step's old-log-prob, reference and value passes run, joined before the advantages
    launch_reward_fn_async: bool = False
    # rule-scoring workers
    num_workers: int = 2
    timeout_s: float = 10.0
    failure_score: float = 0.0
    max_failure_fraction: float = 0.5
    batch_timeout_s: float = 300.0  # reward_manager=batch: the limit for one call on the whole batch
    sandbox: bool = False  # run custom_reward_function in the sandbox (no network, limits, no secrets; see docs)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class CustomRewardConfig:
    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)  # passed to every call of the function (veRL's key)


@dataclass
class KLCtrlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


# What DAPO's group filter compares within a group: score = the sequence's rule/reward score, acc = the scorer's
# "acc" field (a scorer returning {"score": ..., "acc": ...}), seq_reward = score minus the KL penalty in the reward
# (equal to score without use_kl_in_reward), seq_final_reward = score with the overlong shaping.
FILTER_METRICS = ("score", "acc", "seq_reward", "seq_final_reward")


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # DAPO dynamic sampling
    metric: str = "score"  # one of FILTER_METRICS
    max_num_gen_batches: int = 4  # generation batches per step at most; 0 = no limit


# Off-policy corrections (veRL's algorithm.rollout_correction keys): importance weights pi_old / pi_rollout from the
# rollout's own log-probs, truncated at rollout_is_threshold (TIS), per token or per sequence; rejection (MIS) zeroes
# tokens / sequences whose ratio leaves [rollout_rs_threshold_lower, rollout_rs_threshold]. With old log-probs
# recomputed this is the decoupled PPO objective (pi_old the proximal policy of the clip, pi_rollout the behaviour
# policy of the weight); bypass_mode=true uses the rollout's log-probs as old log-probs (no recompute, no weight).
@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = None  # None | token | sequence (algorithms/off_policy.py LEVELS)
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None  # None | token | sequence
    rollout_rs_threshold: float | None = None  # None: rollout_is_threshold
    rollout_rs_threshold_lower: float | None = None  # None: 1 / the upper threshold
    bypass_mode: bool = False
    # a sequence with any token whose ratio is below this is rejected whole (weight 0); None: no veto
    rollout_token_veto_threshold: float | None = None
    rollout_is_batch_normalize: bool = False  # IS weights divided by their mean over the step's batch


# PF-PPO (veRL's algorithm.pf_ppo keys, algorithms/pf_ppo.py): after the advantages, the step's responses are
# resampled with replacement by weights from their sequence scores
@dataclass
class PFPPOConfig:
    reweight_method: str = "pow"  # pow | max_min | max_random | a registered name (PF_PPO_WEIGHTS)
    weight_pow: float = 2.0  # pow: weight = |score| ** weight_pow


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)


@dataclass
class TrainerConfig:
    project_name: str = "hybridflow"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int | None = None
    logger: list = field(default_factory=lambda: ["console", "jsonl"])
    nnodes: int = 1
    n_gpus_per_node: int = 1  # ranks per node (processes); on CPU each rank is one process
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "ray"  # ray | local (single process, for debugging)
    placement: str = "colocate"  # colocate: every role shares the same processes | split: critic/rm apart
    # sync | one_step_off | async (trainer/rollout_driver.py); the last two need actor_rollout_ref.hybrid_engine=false
    rollout_mode: str = "sync"
    max_staleness: int = 1  # async: a batch more policy versions old than this is dropped (counted)
    rollout_buffer_batches: int = 2  # async: generation batches buffered or in flight at most
    num_threads_per_worker: int | None = None  # torch threads per rank; None: cores / ranks
    ray_address: str | None = None  # None: start a local cluster
    seed: int = 1
    critic_warmup: int = 0
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto | disable | <checkpoint path> | resume_path (veRL: the path in resume_from_path)
    resume_from_path: str | None = None  # veRL's key, read with resume_mode=resume_path
    log_val_generations: int = 0  # validation samples written to samples.jsonl (split "val") at each validation
    overwrite: bool = False  # a fresh start into a folder holding a run: archive that run beside it (else refused)
    max_ckpt_to_keep: int | None = 2
    max_restarts: int = 3  # worker deaths survived by rebuilding the groups and resuming (0: fail at once)
    fault_injection: str | None = None  # tests: "method:rank:step[,...]" kills that worker once (workers/fault.py)
    call_timeout_s: float = 1800.0
    log_samples_freq: int = 10
    progress_bar: bool = True
    balance_batch: bool = True
    max_consecutive_nonfinite: int = 3
    # veRL's keys: each step, the tokens whose rollout and actor probabilities differ most, as JSONL
    # (trainer/high_diff_tokens.py) under dump_high_diff_dir (None: RUN_DIR/high_diff_tokens)
    dump_high_diff_tokens: bool = False
    dump_high_diff_dir: str | None = None
    # veRL's key: auto / disable pick the new-style workers, hybridflow's only kind; enable is refused
    use_legacy_worker_impl: str = "auto"


@dataclass
class GlobalProfilerSection:
    """veRL's global_profiler (trainer/profiling.py): which tool and steps; the roles' profiler sections say where."""

    tool: str | None = None  # torch, or null: off
    steps: list | None = None  # global steps (from 1) to profile
    profile_continuous_steps: bool = False  # consecutive listed steps make one trace
    save_path: str | None = None  # null: trainer.default_local_dir/profile


@dataclass
class HybridFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    global_profiler: GlobalProfilerSection = field(default_factory=GlobalProfilerSection)


# ----------------------------------------------------------------------------------------------------- loading
def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k in node:
        full = f"{prefix}{k}"
        keys.append(full)
        v = node[k] if OmegaConf.is_config(node) else None
        if OmegaConf.is_dict(v):
            keys += _all_keys(v, full + ".")
    return keys


DELETE = object()  # the value of Hydra's `~key`: the key goes back to its default (a free-form dict's entry goes)


def _hydra_flow_to_yaml(raw: str) -> str:
    """Hydra's dict values (``{a:1,b:{c:x}}``, as veRL's scripts write them) in YAML's flow syntax (``{a: 1, ...}``):
    a space after each key's colon. YAML alone reads ``{a:1}`` as the key ``'a:1'`` with no value. Quoted text and
    colons inside a value (``{url:http://x}``) are left alone."""
    out, stack, quote, at_key = [], [], None, False
    for i, ch in enumerate(raw):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[":
            stack.append(ch)
            at_key = ch == "{"
        elif ch in "}]":
            if stack:
                stack.pop()
            at_key = False
        elif ch == "," and stack:
            at_key = stack[-1] == "{"
        elif ch == ":" and at_key:
            at_key = False
            out.append(ch)
            if i + 1 < len(raw) and raw[i + 1] not in " \t":
                out.append(" ")
            continue
        out.append(ch)
    return "".join(out)


def _parse_override(item: str) -> tuple[str, Any]:
    """``key=value`` (``+key=value`` too) -> (key, value parsed as YAML, Hydra's ``{a:1}`` dicts included);
    Hydra's ``~key`` -> (key, DELETE)."""
    if item.startswith("~"):
        return item[1:].split("=", 1)[0].strip(), DELETE
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. actor_rollout_ref.rollout.n=8), "
                          "or ~key to set a key back to its default")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    text = _hydra_flow_to_yaml(raw) if raw.lstrip().startswith("{") else raw
    try:
        value = yaml.safe_load(text) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


@functools.cache
def _schema_index(schema: type) -> tuple[frozenset[str], tuple[str, ...]]:
    """(every dotted key, the prefixes of free-form dict keys) of a config schema."""
    base = OmegaConf.structured(schema)
    known = set(_all_keys(base))
    free_form = tuple(
        k + "." for k in known if OmegaConf.is_dict(v := OmegaConf.select(base, k)) and OmegaConf.get_type(v) is dict
    )
    return frozenset(known), free_form


def classify_overrides(overrides: list[str], schema: type | None = None) -> dict[str, list[str]]:
    """How each dotted override is taken: "taken" (a hybridflow key), "renamed" ("veRL key -> hybridflow key"),
    "refused" (one line each: the feature and what to use), "unknown" (a typo: merge_overrides names the closest)."""
    from hybridflow.trainer.verl_keys import alias_of, refusal
    from hybridflow.trainer.verl_micro_batch import per_rank_key

    known, free_form = _schema_index(schema or HybridFlowConfig)
    out: dict[str, list[str]] = {"taken": [], "renamed": [], "refused": [], "unknown": []}
    for item in overrides:
        key, _ = _parse_override(item)
        ours = alias_of(key)
        if key in known or key.startswith(free_form):
            out["taken"].append(key)
        elif per_rank := per_rank_key(key, known):  # veRL's global micro-batch key (verl_micro_batch.py)
            out["renamed"].append(f"{key} -> {per_rank} (divided by the data-parallel ranks)")
        elif ours and (ours in known or ours.startswith(free_form)):  # renamed before refused, as merge_overrides
            out["renamed"].append(f"{key} -> {ours}")
        elif why := refusal(key):
            out["refused"].append(why)
        else:
            out["unknown"].append(key)
    return out


def merge_overrides(schema: type, overrides: list[str] | None, preset: str | None = None, what: str = "config"):
    """A typed config object: `schema`'s defaults <- optional YAML preset <- dotted `key=value` overrides.

    Unknown keys fail with the closest valid ones; values are type-checked against the dataclasses.
    """
    base = OmegaConf.structured(schema)
    # free-form dict fields (engine_kwargs, ...): any sub-key may be set, as in veRL's `+...engine_kwargs.x=y`
    known, free_form = _schema_index(schema)
    from hybridflow.trainer.verl_keys import alias_of, refusal
    from hybridflow.trainer.verl_micro_batch import apply_global_micro_batches, per_rank_key

    layers = []
    refused: list[str] = []
    global_micro: dict[str, Any] = {}  # veRL's global micro-batch keys, divided by the ranks once all keys are in
    if preset:
        if not os.path.exists(preset):
            raise ConfigError(f"config file {preset} does not exist")
        with open(preset) as f:
            layers.append(OmegaConf.create(yaml.safe_load(f) or {}))
    for item in overrides or []:
        key, value = _parse_override(item)
        if key not in known and not key.startswith(free_form) and alias_of(key):
            key = alias_of(key)  # veRL's name for a hybridflow key
        if key not in known and per_rank_key(key, known):
            global_micro[key] = value
            continue
        if key not in known and (why := refusal(key)):
            refused.append(why)
            continue
        if key == "trainer.logger" and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]  # veRL scripts pass trainer.logger=console
        if key not in known and not key.startswith(free_form):
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"unknown {what} key {key!r}.{hint} (run `hybridflow train --print-config` for all keys)")
        if value is DELETE:
            layers.append((DELETE, key))
            continue
        layer = OmegaConf.create()
        OmegaConf.update(layer, key, value, force_add=True)
        layers.append(layer)
    if refused:
        raise ConfigError(f"{what} keys hybridflow does not take (veRL names them):\n  - " + "\n  - ".join(refused))
    try:
        merged = base.copy()
        for layer in layers:
            if isinstance(layer, tuple):
                _delete(merged, layer[1], base, what)  # base: the schema's defaults (merged is its copy)
            else:
                merged = OmegaConf.merge(merged, layer)
        layers = [layer for layer in layers if not isinstance(layer, tuple)]
        cfg = OmegaConf.to_object(merged)
    except (ConfigKeyError, ConfigAttributeError) as e:
        raise ConfigError(f"unknown {what} key: {e}") from None
    except ValidationError as e:
        key = getattr(e, "full_key", None)
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if key:  # OmegaConf's message, with the key first and without its reference_type / object_type lines
            raise ConfigError(f"invalid {what} value for {key}: {why}; fix it on the command line or in the YAML "
                              f"(`hybridflow train --print-config` shows {key}'s default and type)") from None
        raise ConfigError(f"invalid {what} value: {e}") from None
    if global_micro:
        explicitly_set = {k for layer in layers for k in _all_keys(layer)}
        if problems := apply_global_micro_batches(cfg, global_micro, explicitly_set):
            raise ConfigError(f"{what}: veRL's global micro-batch keys:\n  - " + "\n  - ".join(problems))
    return cfg


def _delete(merged: Any, key: str, defaults: Any, what: str) -> None:
    """Hydra's ``~key`` on the config merged so far: an entry of a free-form dict is removed; a schema key (a whole
    free-form dict too) goes back to its default."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(merged, parent_key) if parent_key else merged
    if OmegaConf.select(defaults, key, default=DELETE) is not DELETE:
        OmegaConf.update(merged, key, OmegaConf.select(defaults, key), merge=False)
    elif OmegaConf.is_dict(parent) and leaf in parent:
        del parent[leaf]
    else:
        raise ConfigError(f"~{key}: there is no {what} key {key!r} to remove (run `hybridflow train --print-config` "
                          "for all keys)")


def load_config(overrides: list[str] | None = None, preset: str | None = None, validate: bool = True) -> HybridFlowConfig:
    """Defaults <- optional YAML preset file <- dotted command-line overrides; then validated."""
    cfg = merge_overrides(HybridFlowConfig, overrides, preset)
    if validate:
        validate_config(cfg)
    return cfg


def to_dict(cfg: HybridFlowConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


# ----------------------------------------------------------------------------------------------------- validation
def validate_config(cfg: HybridFlowConfig) -> None:
    """Fail before any worker starts, with the numbers to change (the checks are in config_checks.py)."""
    from hybridflow.trainer.config_checks import config_errors

    errors = config_errors(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def check_resources(cfg: HybridFlowConfig, available_cpus: float, available_gpus: float) -> None:
    """More ranks than devices is a configuration error, found before placement groups wait forever."""
    from hybridflow.trainer import config_checks

    config_checks.check_resources(cfg, available_cpus, available_gpus)
