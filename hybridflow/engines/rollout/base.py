"""The rollout interface every generation backend implements (hf, native, vllm).

Batch layout (shared with the training engine and the workers):
  input  ``input_ids [B, P]`` left-padded prompts, ``attention_mask [B, P]``, ``position_ids [B, P]``
  output, B * n rows, sample j of prompt i at row ``i * n + j``:
    ``prompts [B*n, P]``, ``responses [B*n, R]`` right-padded with pad_token_id,
    ``input_ids [B*n, P+R]`` = cat(prompts, responses), ``attention_mask [B*n, P+R]``, ``position_ids [B*n, P+R]``,
    ``response_mask [B*n, R]`` (1 on generated tokens, the eos/stop token included),
    ``rollout_log_probs [B*n, R]`` (log p of each sampled token under the *temperature-scaled* distribution;
    0 on padding). R is the longest response in the batch (at most max_new_tokens).
Temperature semantics: logits / temperature, then top-k, then top-p; the training engine applies the same
logits / temperature before its log-softmax, so the two sets of log-probs are comparable token by token.

Log-prob convention (every backend): ``rollout_log_probs`` = log_softmax(logits / temperature) over the FULL
vocabulary, gathered at the sampled token. top-k / top-p only restrict which tokens can be drawn; they do not
renormalise the reported number (that is what the training engine can recompute). Greedy: temperature 1.
top-p keeps the smallest set of most-likely tokens whose mass reaches top_p (the mass strictly above a token must be
< top_p for it to stay), applied to the top-k-filtered distribution; at least one token is always kept.

Stopping: a row ends at the first token in eos_token_ids (tokenizer + generation_config.json + model config, see
layout.special_token_ids) or params.stop_token_ids; that token is part of the response (response_mask 1).

Seeds: params.seed fixes the samples of a call. In the native engine sample j of prompt row i draws from its own
random stream (seed, i, j, step), so it does not depend on the other rows (up to floating-point effects of batch
shape); the hf engine seeds torch's generator once per call (reproducible, but batch-dependent). params.seed=None
draws a fresh seed per call from the engine's own generator, seeded by the engine's ``seed`` argument.

Non-tensor prompt columns are repeated n times (interleaved) into the output; meta_info is kept.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.protocol import DataProto


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    greedy: bool = False  # argmax decoding; temperature/top-k/top-p ignored, log-probs at temperature 1
    n: int = 1  # samples per prompt
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the tokenizer's eos
    seed: int | None = None  # same seed + same prompts -> same samples

    def validate(self) -> None:
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={self.n}, max_new_tokens={self.max_new_tokens}")


# veRL's rollout engine switches (None: not given) -> the engines that honour them, for the refusal message
_SWITCH_ENGINES = {
    "enforce_eager": "native and vllm",
    "free_cache_engine": "native and vllm",
    "gpu_memory_utilization": "vllm",
    "enable_chunked_prefill": "native",
    "max_num_batched_tokens": "native",
    "quantization": "vllm; the native engine loads the checkpoint's own dtype, and on CPU "
    "actor_rollout_ref.rollout.dtype=int8 gives it int8 weight matmuls",
    "enable_prefix_caching": "vllm; the native engine prefills each prompt once for its n samples and multi-turn "
    "sessions keep their KV between turns, with no switch",
    "max_num_seqs": "native and vllm",
}


class RolloutEngine(ABC):
    """Generates responses for a batch of prompts; holds its own copy of the policy weights.

    An engine also says what it reads from the config's rollout section (``actor_rollout_ref.rollout``), so that
    validation asks the engine rather than a list kept elsewhere: ``DTYPES`` it can run, ``options_from_config``
    (veRL's engine switches as its constructor kwargs) and ``config_errors`` (what it cannot do).
    """

    DTYPES: tuple[str, ...] = ("fp32", "bf16")
    # veRL rollout switches this engine understands; a switch set to a non-None value for an engine that does not
    # list it is a config error (it would be silently ignored otherwise).
    SWITCHES: tuple[str, ...] = ()
    # False for an engine that cannot take new weights (a frozen server, say): config validation refuses to train
    # with it, since the policy being trained would never be the one sampling.
    SUPPORTS_WEIGHT_UPDATES: bool = True
    # True for an engine that splits the model over actor_rollout_ref.rollout.tensor_model_parallel_size ranks
    # (each rank of a TP group gets the same prompts; the worker returns TP rank 0's results)
    TENSOR_PARALLEL: bool = False

    @classmethod
    def options_from_config(cls, rollout: Any) -> dict[str, Any]:
        """Constructor kwargs from the rollout section's veRL switches (``enforce_eager``, ...); {} by default."""
        return {}

    @classmethod
    def accepted_options(cls) -> set[str] | None:
        """Keyword options of the constructor beyond the common four; None when it takes any (``**kwargs``)."""
        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        return {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - {
            "dtype", "seed", "max_model_len"
        }

    @classmethod
    def model_errors(cls, model_path: str) -> list[str]:
        """What in the model at `model_path` this engine cannot run (read from its config, no weights); [] here."""
        return []

    @classmethod
    def config_errors(cls, rollout: Any) -> list[str]:
        """What in the rollout section this engine cannot honour, as messages naming the key and the fix."""
        errors = []
        where = f"actor_rollout_ref.rollout.name={rollout.name}"
        if rollout.dtype not in cls.DTYPES:
            errors.append(f"actor_rollout_ref.rollout.dtype={rollout.dtype!r}: {where} runs {list(cls.DTYPES)}")
        for switch, engines in _SWITCH_ENGINES.items():
            if getattr(rollout, switch, None) is not None and switch not in cls.SWITCHES:
                errors.append(
                    f"actor_rollout_ref.rollout.{switch} has no effect with {where}; remove it (it applies to "
                    f"{engines})"
                )
        tp = getattr(rollout, "tensor_model_parallel_size", 1)
        if tp != 1 and not cls.TENSOR_PARALLEL:
            errors.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: {where} does not split the "
                          "model over ranks; set it to 1, or use actor_rollout_ref.rollout.name=native (or vllm on GPUs)")
        if "tensor_parallel_size" in dict(getattr(rollout, "engine_kwargs", {}) or {}):
            errors.append("actor_rollout_ref.rollout.engine_kwargs.tensor_parallel_size: set "
                          "actor_rollout_ref.rollout.tensor_model_parallel_size instead (the workers' layout follows it)")
        accepted = cls.accepted_options()
        if accepted is not None:
            from hybridflow.engines.rollout.registry import rollout_engine_kwargs

            given = set(rollout_engine_kwargs(rollout))
            for key in sorted(given - accepted):
                errors.append(
                    f"actor_rollout_ref.rollout.engine_kwargs.{key}: {where} has no option {key!r}; "
                    f"its options: {sorted(accepted)}"
                )
        return errors

    @abstractmethod
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """Prompts in the layout above -> B * n rows of responses in the layout above."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights (HF parameter names) without rebuilding the engine."""

    def release_memory(self) -> None:  # noqa: B027 - optional hook, most engines free KV after generate anyway
        """Free KV cache and other generation-time buffers."""
