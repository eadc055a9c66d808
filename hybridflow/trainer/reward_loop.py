"""veRL's reward loop on the driver's side: the engine keys' start-up checks, the engine's process count, and the
reward-model scores that arrive while the rule scores are computed.

Which engine scores: ``use_reward_loop=false`` -> transformers in the actor's processes (veRL's legacy worker);
``use_reward_loop=true`` -> ``reward_model.rollout.name`` (``hf`` or ``vllm``) in processes of its own. A key the
chosen engine has no use for is an error naming it, never a silent no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.single_controller.future import DataProtoFuture

ENGINES = ("hf", "vllm")


def reward_model_engine(cfg: Any) -> str:
    rm = cfg.reward_model
    return rm.rollout.name if rm.use_reward_loop else "hf"


def reward_model_errors(cfg: Any) -> list[str]:
    rm = cfg.reward_model
    r = rm.rollout
    key = "reward_model.rollout"
    if r.name not in ENGINES:
        why = {"sglang": "SGLang / TensorRT-LLM are not supported", "trtllm": "SGLang / TensorRT-LLM are not supported",
               "native": "the native engine generates text and has no classification head"}.get(
            r.name, "not a reward-model engine")
        return [f"{key}.name={r.name!r}: {why}; choose one of {list(ENGINES)} (with reward_model.use_reward_loop=true)"]
    errors: list[str] = []
    engine = reward_model_engine(cfg)
    if not rm.use_reward_loop and r.name != "hf":
        errors.append(
            f"{key}.name={r.name} is read only with reward_model.use_reward_loop=true (veRL's reward loop); without it "
            "the reward model is scored by transformers in the actor's processes. Set use_reward_loop=true or drop "
            "the key"
        )
    if r.gpu_memory_utilization is not None:
        if not 0 < r.gpu_memory_utilization <= 1:
            errors.append(f"{key}.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
        elif engine != "vllm":
            errors.append(
                f"{key}.gpu_memory_utilization={r.gpu_memory_utilization} is the share of device memory vLLM "
                f"reserves up front; the {engine} engine reserves nothing (it allocates per call). Set "
                "reward_model.use_reward_loop=true reward_model.rollout.name=vllm, or drop the key"
            )
    if r.tensor_model_parallel_size < 1:
        errors.append(f"{key}.tensor_model_parallel_size={r.tensor_model_parallel_size} must be >= 1")
    elif r.tensor_model_parallel_size > 1 and engine != "vllm":
        errors.append(
            f"{key}.tensor_model_parallel_size={r.tensor_model_parallel_size}: the {engine} engine holds one whole "
            "copy of the reward model per process; sharding it needs vLLM (reward_model.use_reward_loop=true "
            "reward_model.rollout.name=vllm), or set it to 1"
        )
    for name in ("prompt_length", "response_length"):
        value = getattr(r, name)
        if value is not None and value < 1:
            errors.append(f"{key}.{name}={value} must be >= 1 (or null: the reward model reads every token)")
    if engine == "vllm":
        from hybridflow.engines.reward_model.vllm import VLLM_MISSING, vllm_available

        if not rm.model.use_remove_padding:
            errors.append(
                "reward_model.model.use_remove_padding=false with reward_model.rollout.name=vllm: vLLM packs the "
                "rows and never computes padding; drop the key or score with reward_model.rollout.name=hf"
            )
        if rm.enable and not vllm_available():
            import sys

            errors.append(VLLM_MISSING.format(python=sys.executable))
    return errors


def reward_loop_replicas(cfg: Any) -> int:
    """Reward-model engine processes of the reward loop: as veRL's colocate mode, one per tensor-parallel group of
    the trainer's ranks (``nnodes * n_gpus_per_node // tensor_model_parallel_size``), at least one."""
    t = cfg.trainer
    return max(1, (t.nnodes * t.n_gpus_per_node) // cfg.reward_model.rollout.tensor_model_parallel_size)


class LateRMScores:
    """The reward loop's answer, fetched on first call: ``rm_scores [B]`` of a non-blocking ``compute_rm_score``.

    The reward manager calls it once its rule scores are in (RewardManager.__call__'s ``rm_scores``), so the model
    scores in its own processes while the rule scorers run in theirs.
    """

    def __init__(self, future: DataProtoFuture):
        self.future = future
        self.value: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.future.get().batch["rm_scores"]
        return self.value


def _tokenizers(cfg: Any):
    """(policy tokenizer, reward-model tokenizer), or None when there is nothing to compare yet."""
    import os

    rm, policy = cfg.reward_model.model.path, cfg.actor_rollout_ref.model.path
    if not cfg.reward_model.enable or not rm or not policy or not (os.path.isdir(rm) and os.path.isdir(policy)):
        return None  # a missing folder is named by the model-folder checks
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(policy), AutoTokenizer.from_pretrained(rm)


def reward_model_rerenders(cfg: Any) -> bool:
    """True when the reward model's tokenizer is not the policy's: it then reads the conversation re-rendered in its
    own chat template (engines/reward_model/chat.py), which needs each prompt's chat messages (raw_prompt)."""
    from hybridflow.engines.reward_model.chat import same_tokenizer

    pair = _tokenizers(cfg)
    return pair is not None and not same_tokenizer(*pair)


def reward_model_tokenizer_errors(cfg: Any) -> list[str]:
    """A reward model with a tokenizer of its own must have a chat template to re-render the conversation with."""
    try:
        pair = _tokenizers(cfg)
    except (OSError, ValueError) as e:
        return [f"reward_model.model.path={cfg.reward_model.model.path}: its tokenizer does not load ({e})"]
    if pair is None:
        return []
    from hybridflow.engines.reward_model.chat import same_tokenizer

    policy, rm = pair
    if same_tokenizer(policy, rm) or getattr(rm, "chat_template", None):
        return []
    return [f"reward_model.model.path={cfg.reward_model.model.path}: its tokenizer is not the policy's "
            f"({cfg.actor_rollout_ref.model.path}) and has no chat template, so the conversation cannot be "
            "re-rendered for it; add the reward model's chat template to its tokenizer_config.json, or use a reward "
            "model with the policy's tokenizer"]
