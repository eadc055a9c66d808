"""The numbers logged every step: batch statistics, stage timings, throughput, and validation accuracy.

Key families (what `Tracking` receives):
  ``critic/score|rewards|advantages|returns|values/{mean,max,min}``, ``critic/vf_explained_var``
  ``response_length/{mean,max,min,clip_ratio}``, ``prompt_length/{mean,max,min}``
  ``timing/<stage>`` (s), ``timing_per_token_ms/<stage>`` (ms), ``perf/...``: wall-clock, not reproducible
  ``val/<data_source>/{mean@1, mean@n, pass@k, maj@k, num_prompts}``

Everything here is pure arithmetic on tensors and lists; no logger, worker or model is touched.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.common.metrics import machine_peak_flops, measure_peak_flops, reduce_metrics
from hybridflow.protocol import DataProto

__all__ = [
    "TIMING_PREFIXES",
    "Timer",
    "compute_data_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "compute_validation_metrics",
    "dense_transformer_flops",
    "machine_peak_flops",
    "majority_vote",
    "measure_peak_flops",
    "pass_at_k",
    "reduce_metrics",
    "without_timing",
]

# Metrics that depend on wall-clock time: they differ between two runs that are otherwise bitwise identical.
TIMING_PREFIXES = ("timing/", "timing_per_token_ms/", "perf/")


def without_timing(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`metrics` without the wall-clock keys (`TIMING_PREFIXES`): what two identical runs must agree on."""
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING_PREFIXES)}


# ---------------------------------------------------------------------------------------------------- batch
def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean/max/min of a 1-D tensor (computed in float64); empty -> nothing."""
    if values.numel() == 0:
        return {}
    v = values.detach().to(torch.float64)
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def _max_response_length(batch: DataProto, given: int | None) -> int | None:
    if given is not None:
        return int(given)
    for key in ("max_response_length", "max_new_tokens"):
        if batch.meta_info.get(key) is not None:
            return int(batch.meta_info[key])
    return None


def compute_data_metrics(
    batch: DataProto, *, use_critic: bool, max_response_length: int | None = None
) -> dict[str, float]:
    """Statistics of one training batch (the rollout layout of engines/rollout/base.py).

    Reads whatever of these tensors is present and skips the rest:
      ``token_level_scores``, ``token_level_rewards`` [B, R]: summed over the response -> per-sequence score/reward;
      ``advantages``, ``returns``, ``values`` [B, R]: over the tokens where ``response_mask`` [B, R] is 1
          (``values`` and the explained variance only when `use_critic`);
      ``response_mask`` [B, R]: response lengths; ``clip_ratio`` is the fraction of responses whose length equals
          `max_response_length` (argument, else ``meta_info["max_response_length"]`` or ``["max_new_tokens"]``;
          without one the ratio is not reported, since R is only the longest response of this batch);
      ``attention_mask`` [B, P+R] (+ ``prompts`` [B, P] or ``responses`` [B, R] to find P): prompt lengths.
    Values are Python floats computed in float64.
    """
    t = batch.batch
    out: dict[str, float] = {}
    mask = t["response_mask"].bool() if "response_mask" in t else None

    for name, key in (("score", "token_level_scores"), ("rewards", "token_level_rewards")):
        if key in t:
            x = t[key] if mask is None else t[key] * mask
            out.update(_stats(f"critic/{name}", x.sum(-1)))

    def masked(key: str) -> torch.Tensor:
        return t[key][mask] if mask is not None else t[key].reshape(-1)

    for key in ("advantages", "returns"):
        if key in t:
            out.update(_stats(f"critic/{key}", masked(key)))
    if use_critic and "values" in t:
        values = masked("values")
        out.update(_stats("critic/values", values))
        returns = masked("returns").to(torch.float64) if "returns" in t else None
        if returns is not None and returns.numel() > 1 and returns.var(unbiased=False) > 0:  # undefined otherwise
            residual = (returns - values.to(torch.float64)).var(unbiased=False)
            # 1 = the critic explains the returns fully, 0 = no better than their mean, < 0 = worse.
            out["critic/vf_explained_var"] = (1.0 - residual / returns.var(unbiased=False)).item()

    if mask is not None:
        lengths = mask.sum(-1)
        out.update(_stats("response_length", lengths))
        max_len = _max_response_length(batch, max_response_length)
        if max_len is not None and lengths.numel():
            out["response_length/clip_ratio"] = (lengths >= max_len).to(torch.float64).mean().item()

    if "attention_mask" in t:
        seq = t["attention_mask"].shape[1]
        if "prompts" in t:
            prompt_len = t["prompts"].shape[1]
        elif "responses" in t:
            prompt_len = seq - t["responses"].shape[1]
        elif mask is not None:
            prompt_len = seq - mask.shape[1]
        else:
            prompt_len = seq  # a prompt-only batch
        out.update(_stats("prompt_length", t["attention_mask"][:, :prompt_len].sum(-1)))

    return out


# ---------------------------------------------------------------------------------------------------- time
class Timer:
    """``with Timer("generate", timing): ...`` adds the block's wall-clock seconds to ``timing["generate"]``.

    Adds rather than overwrites, so a stage entered twice in one step is counted once in total; use a fresh dict
    per step. The elapsed time of the last block is also kept in ``.seconds``.
    """

    def __init__(self, name: str, timing: dict[str, float]) -> None:
        self.name = name
        self.timing = timing
        self.seconds = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.seconds = time.perf_counter() - self._start
        self.timing[self.name] = self.timing.get(self.name, 0.0) + self.seconds


def compute_timing_metrics(timing: Mapping[str, float], num_tokens: int) -> dict[str, float]:
    """``timing/<stage>`` in seconds and ``timing_per_token_ms/<stage>``: milliseconds per token of the step.

    `num_tokens` is the number of tokens the step processed (prompt + response tokens over the whole batch), so the
    per-token numbers compare across batch sizes.
    """
    out = {f"timing/{stage}": float(s) for stage, s in timing.items()}
    if num_tokens > 0:
        out.update({f"timing_per_token_ms/{stage}": 1000.0 * float(s) / num_tokens for stage, s in timing.items()})
    return out


def compute_throughput_metrics(
    timing: Mapping[str, float],
    num_tokens: int,
    num_ranks: int,
    flops: float | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """Throughput of one step.

    Args:
        timing: stage -> seconds; ``timing["step"]`` is the whole step (else the sum of the stages is used).
        num_tokens: tokens processed in the step, over all ranks.
        num_ranks: devices (or CPU processes) that did the work.
        flops: floating-point operations the step did, over all ranks (e.g. from `dense_transformer_flops`).
        peak_flops: peak FLOP/s of ONE device (e.g. from `measure_peak_flops`).
    Returns ``perf/time_per_step`` (s), ``perf/tokens_per_s`` (all ranks), ``perf/tokens_per_s_per_rank`` and, when
    both FLOP counts are given, ``perf/mfu`` = flops / (time_per_step * num_ranks * peak_flops), in [0, 1].
    """
    step_time = float(timing["step"]) if "step" in timing else float(sum(timing.values()))
    out = {"perf/time_per_step": step_time}
    if step_time > 0:
        out["perf/tokens_per_s"] = num_tokens / step_time
        out["perf/tokens_per_s_per_rank"] = num_tokens / step_time / max(num_ranks, 1)
        if flops is not None and peak_flops:
            out["perf/mfu"] = float(flops) / (step_time * max(num_ranks, 1) * float(peak_flops))
    return out


def dense_transformer_flops(num_params: int, num_tokens: int, *, training: bool) -> float:
    """The usual estimate for a dense decoder: 2 FLOPs per parameter per token forward, 6 with the backward pass.

    It counts the matmuls with the weights only (attention's score/value products and elementwise work are left
    out), so MFU from it is a lower bound of the hardware's real utilisation."""
    return (6.0 if training else 2.0) * num_params * num_tokens


# ---------------------------------------------------------------------------------------------------- validation
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, drawn without replacement, hold at
    least one of the c correct ones, i.e. 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: Sequence[Hashable | None], scores: Sequence[float]) -> float:
    """Score of the majority answer among these samples.

    Samples with answer None (nothing could be extracted) do not vote. Ties go to the tied answer that appears
    first in the given order. The result is the mean score of the samples giving the winning answer (normally they
    all score the same). If no sample has an answer, the first sample's score is returned.
    """
    counts: dict[Any, int] = {}
    for a in answers:
        if a is not None:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return float(scores[0])
    top = max(counts.values())
    winner = next(a for a in counts if counts[a] == top)  # dicts keep first-appearance order
    return float(np.mean([s for a, s in zip(answers, scores) if a == winner]))


def _maj_at_k(answers: list, scores: list[float], k: int, rng: np.random.Generator, max_subsets: int) -> float:
    """Expected majority-vote score over k-subsets of the n samples: exact when C(n, k) <= max_subsets (every subset,
    samples kept in their original order), otherwise the mean over `max_subsets` subsets drawn with `rng`."""
    n = len(answers)
    if math.comb(n, k) <= max_subsets:
        subsets: Iterable[Sequence[int]] = itertools.combinations(range(n), k)
    else:
        subsets = [np.sort(rng.choice(n, size=k, replace=False)) for _ in range(max_subsets)]
    values = [majority_vote([answers[i] for i in s], [scores[i] for i in s]) for s in subsets]
    return float(np.mean(values))


def _hashable(answer: Any) -> Hashable | None:
    if answer is None:
        return None
    try:
        hash(answer)
        return answer
    except TypeError:
        return repr(answer)


def compute_validation_metrics(
    data_sources: Sequence[str],
    prompt_ids: Sequence[Hashable],
    scores: Sequence[float],
    *,
    answers: Sequence[Any] | None = None,
    n: int,
    seed: int = 0,
    correct_threshold: float = 1.0,
    max_subsets: int = 256,
) -> dict[str, float]:
    """Validation accuracy per data source from n samples per prompt (one row per sample).

    Rows of one prompt are those sharing ``(data_source, prompt_id)``; each prompt must have exactly `n` rows, and its
    first row is the greedy sample when the validation generated one (otherwise simply the first sample).
    Returns, for each data source s (in order of first appearance):
      ``val/s/mean@1``   mean score of each prompt's first row;
      ``val/s/mean@n``   mean score over all rows (n > 1 only);
      ``val/s/pass@k``   for k = 1, 2, 4, ... and n: unbiased pass@k, a sample being correct when
                         score >= `correct_threshold`;
      ``val/s/maj@k``    (when `answers` are given; same k except 1) expected score of the majority answer of k
                         samples, see `majority_vote` for abstentions and ties; exact over all k-subsets when there
                         are at most `max_subsets` of them, else estimated from `max_subsets` random subsets (`seed`);
      ``val/s/num_prompts``.
    """
    rows = len(scores)
    if len(data_sources) != rows or len(prompt_ids) != rows or (answers is not None and len(answers) != rows):
        lengths = f"data_sources {len(data_sources)}, prompt_ids {len(prompt_ids)}, scores {rows}"
        lengths += f", answers {len(answers)}" if answers is not None else ""
        raise ValueError(f"validation columns must have one entry per sample; got {lengths}")
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")

    groups: dict[str, dict[Hashable, list[int]]] = {}
    for i, (src, pid) in enumerate(zip(data_sources, prompt_ids)):
        groups.setdefault(str(src), {}).setdefault(pid, []).append(i)

    ks = sorted({2**j for j in range(n.bit_length()) if 2**j <= n} | {n})
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    for src, prompts in groups.items():
        for pid, idx in prompts.items():
            if len(idx) != n:
                raise ValueError(
                    f"data_source {src!r} prompt {pid!r} has {len(idx)} validation samples, expected n={n}; "
                    "every prompt must be sampled n times (check the validation rollout's n and de-duplication)"
                )
        per_prompt = [[float(scores[i]) for i in idx] for idx in prompts.values()]
        out[f"val/{src}/mean@1"] = float(np.mean([s[0] for s in per_prompt]))
        if n > 1:
            out[f"val/{src}/mean@{n}"] = float(np.mean([np.mean(s) for s in per_prompt]))
        correct = [sum(x >= correct_threshold for x in s) for s in per_prompt]
        for k in ks:
            out[f"val/{src}/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
        if answers is not None:
            for k in ks:
                if k == 1:
                    continue  # maj@1 is mean@n
                vals = [
                    _maj_at_k([_hashable(answers[i]) for i in idx], s, k, rng, max_subsets)
                    for idx, s in zip(prompts.values(), per_prompt)
                ]
                out[f"val/{src}/maj@{k}"] = float(np.mean(vals))
        out[f"val/{src}/num_prompts"] = len(prompts)
    return out
