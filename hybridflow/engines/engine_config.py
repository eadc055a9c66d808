"""The training engine's settings (`EngineConfig`, one per actor, ref or critic engine) and where packing applies.

`workers/engine_config.py` builds these from the trainer's config sections; `FSDPEngine` (fsdp_engine.py) runs them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hybridflow.engines import packing
from hybridflow.engines.lora import LoraSettings
from hybridflow.engines.optim import OptimConfig

__all__ = ["PARAM_DTYPES", "ROLES", "EngineConfig", "OptimConfig", "why_not_packed"]

ROLES = ("actor", "ref", "critic")
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class EngineConfig:
    """One engine (actor, ref or critic); `validate()` says what to change."""

    model_path: str
    role: str = "actor"  # actor | ref (no optimizer, no grads) | critic (value head)
    param_dtype: str = "fp32"  # fp32 | bf16 (bf16 compute; fp32 master weights, grads and optimizer state)
    # the dtype the weights are loaded and kept in (veRL's fsdp_config.model_dtype): fp32 (a master copy) | bf16
    # (weights, grads and AdamW state in bf16: half the memory, bf16 rounding in every update)
    model_dtype: str = "fp32"
    reduce_dtype: str = "fp32"  # sharded only: the gradients' reduce-scatter dtype (veRL's mixed_precision)
    buffer_dtype: str = "fp32"  # the model's floating buffers (e.g. RoPE's inv_freq), cast after loading
    micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False  # True: micro-batches by token budget instead of a fixed row count
    max_tokens_per_micro_batch: int = 4096  # padded tokens (rows * longest row) per micro-batch, dynamic mode
    gradient_checkpointing: bool = False
    param_offload: bool = False  # GPU only: parameters live in host memory between calls (fsdp_engine.py, "Offload")
    optimizer_offload: bool = False  # GPU only: AdamW state lives in host memory except during optimizer.step()
    fsdp_size: int = -1  # ranks that shard one copy; -1: all ranks (pure FSDP); smaller: HSDP replicas
    # sharded only: each decoder layer starts the next one's all-gather before it computes (FSDP2's explicit
    # forward prefetch, veRL's fsdp_config.forward_prefetch); one rank has nothing to gather
    forward_prefetch: bool = False
    seed: int = 0  # same seed on every rank -> same initial value head
    optim: OptimConfig = field(default_factory=OptimConfig)
    use_remove_padding: bool = True  # strip rows to real tokens and bucket by length (False: plain padded forward)
    # True: each micro-batch's rows end to end in one [1, T] row, attention per row (packing.py); no padding at all.
    # None: packed where it applies (one tensor/sequence-parallel rank, stripped rows, not batch-invariant, a model
    # whose attention packing runs; `why_not_packed` says why not), else bucketed.
    use_sequence_packing: bool | None = None
    # A packed micro-batch holds each distinct prompt once, before the responses of all its rows (shared_prompts.py:
    # GRPO's n samples of a prompt compute it once). None: wherever the engine packs, except with flash-attn's varlen
    # kernel (CUDA), router replay or a mixture-of-experts model; True asks for it (an error where it cannot run).
    share_prompts: bool | None = None
    # True: attention and matmul shapes whose fp32 rounding the native rollout reproduces bit for bit
    # (batch_invariant.py); needs the stripped rows (use_remove_padding) and one tensor-parallel rank
    batch_invariant: bool = False
    # fp32 linears on CPU through oneDNN, forward and backward (onednn_train.py); None: where torch has oneDNN and
    # the model is wide enough to gain (onednn_train.MIN_HIDDEN_SIZE)
    onednn_linears: bool | None = None
    # RMSNorm, rotary and SwiGLU as one C call each way on CPU in fp32 and bf16 (autocast), with transformers'
    # forward bits (cpu_train_ops.py); None: on CPU in fp32 or bf16 where the kernels build
    fused_cpu_ops: bool | None = None
    # a packed micro-batch's attention on CPU as one C call each way for all its rows, fp32 and bf16 (autocast;
    # computed in fp32) (cpu_flash_attention.py); None: wherever the engine packs on CPU and the kernel builds; not in
    # the batch-invariant mode
    cpu_flash_attention: bool | None = None
    entropy_chunk_size: int = 2048  # tokens whose [chunk, vocab] logits are held at once
    # veRL's entropy_checkpointing: training forwards recompute each chunk's entropy in backward (hf_model.py)
    entropy_checkpointing: bool = False
    # veRL's model.use_fused_kernels: training forwards recompute each chunk's logits in backward (hf_model.py):
    # backward holds one chunk's [chunk, vocab] logits instead of every chunk's, for one more head matmul per chunk
    logits_checkpointing: bool = False
    num_threads: int | None = None  # torch intra-op threads for this rank (None: leave as is)
    # Forward-only passes (compute_log_prob, compute_values) hold no activations for backward, so they may use
    # larger micro-batches than training (veRL's log_prob_* keys); None: the training setting above.
    infer_micro_batch_size_per_gpu: int | None = None
    infer_use_dynamic_bsz: bool | None = None
    infer_max_tokens_per_micro_batch: int | None = None
    # LoRA (actor only, lora.py): adapters on the frozen base; the reference is the base with the adapter disabled.
    lora: LoraSettings = field(default_factory=LoraSettings)
    # MoE (moe_train.py): weight of the router load-balancing loss; None: the model config's (transformers' rule)
    router_aux_loss_coef: float | None = None
    router_replay: bool = False  # R3: forwards use the rollout's experts (batch column routed_experts)
    # Model parallelism inside the training world (train_mesh.py): tensor-parallel ranks split every projection,
    # Ulysses sequence-parallel ranks split every sequence; data parallelism gets world / (tp * sp) groups.
    tensor_parallel_size: int = 1
    ulysses_sequence_parallel_size: int = 1

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"engine role is {self.role!r}; choose one of {list(ROLES)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype is {self.param_dtype!r}; choose one of {list(PARAM_DTYPES)}")
        for name in ("model_dtype", "reduce_dtype", "buffer_dtype"):
            if getattr(self, name) not in PARAM_DTYPES:
                raise ValueError(f"{name} is {getattr(self, name)!r}; choose one of {list(PARAM_DTYPES)}")
        if self.micro_batch_size_per_gpu <= 0:
            raise ValueError(f"micro_batch_size_per_gpu must be positive, got {self.micro_batch_size_per_gpu}")
        if self.max_tokens_per_micro_batch <= 0:
            raise ValueError(f"max_tokens_per_micro_batch must be positive, got {self.max_tokens_per_micro_batch}")
        for name in ("infer_micro_batch_size_per_gpu", "infer_max_tokens_per_micro_batch"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(f"model_path {self.model_path!r} is not a directory (save_pretrained output)")
        if self.role != "ref":
            self.optim.validate()
        self.lora.validate()
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 (or null for the model config's), "
                             f"got {self.router_aux_loss_coef}")
        if self.lora.enabled and self.role != "actor":
            raise ValueError(f"LoRA (lora_rank={self.lora.rank}) is for the actor engine, this one is {self.role!r}")
        if self.tensor_parallel_size > 1 and self.lora.enabled:
            raise ValueError(f"tensor_model_parallel_size={self.tensor_parallel_size} with LoRA (lora_rank="
                             f"{self.lora.rank}) is not supported: PEFT's layers cannot be split; use one of them")
        if self.batch_invariant:
            why = [f"{name}={value}" for name, value, ok in (
                ("use_remove_padding", self.use_remove_padding, self.use_remove_padding),
                ("use_sequence_packing", self.use_sequence_packing, not self.use_sequence_packing),
                ("ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size,
                 self.ulysses_sequence_parallel_size == 1),
                ("tensor_model_parallel_size", self.tensor_parallel_size, self.tensor_parallel_size == 1),
                ("param_dtype", self.param_dtype, self.param_dtype == "fp32"),
                ("model_dtype", self.model_dtype, self.model_dtype == "fp32")) if not ok]
            if why:
                raise ValueError(f"batch_invariant=true needs fp32 rows stripped to their real tokens on one "
                                 f"tensor/sequence-parallel rank (the layout the rollout reproduces); got "
                                 f"{', '.join(why)}")
        if self.ulysses_sequence_parallel_size > 1 and not self.use_remove_padding:
            raise ValueError(f"ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} needs "
                             "use_remove_padding=True (the stripped, causal-only layout)")


def why_not_packed(config: EngineConfig, hf_config) -> str | None:
    """Why use_sequence_packing=None leaves `config`'s engine bucketed (None: it packs). Packing is exact (packed ==
    bucketed to fp32 rounding, tests/engines/test_packing.py: log-probs, entropy, values and gradients) and computes
    no padding; left out are a padded forward (use_remove_padding=False), tensor or sequence parallelism, the
    batch-invariant mode, and models whose attention it cannot run (sliding windows, soft-capping:
    packing.packing_refusal)."""
    if not config.use_remove_padding:
        return "use_remove_padding=False asks for the plain padded forward"
    if config.tensor_parallel_size > 1 or config.ulysses_sequence_parallel_size > 1:
        return (f"tensor_parallel_size={config.tensor_parallel_size}, ulysses_sequence_parallel_size="
                f"{config.ulysses_sequence_parallel_size} split the bucketed rows")
    if config.batch_invariant:
        return "batch_invariant=True reproduces the rollout's stripped rows"
    return packing.packing_refusal(hf_config)
