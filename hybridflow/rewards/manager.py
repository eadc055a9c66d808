"""RewardManager: decode a batch of responses, score each with its rule/custom function, shape the reward tensor.

Scoring runs in a persistent ScoringPool (``pool.py``): worker processes, a per-sample timeout enforced by killing the
stuck worker. A sample whose scorer raises, times out, crashes its process or returns something that is not a finite
number (None, NaN, inf, a string, a tuple, a dict without "score") gets ``failure_score``; each kind is counted in
the metrics and logged once per (kind, data_source) with the row and the reason. If more than
``max_failure_fraction`` of a batch fails, RewardComputationError stops the run: a broken reward function must not
quietly train the policy on failure scores.

Options that veRL spreads over its reward managers (see ``managers.py`` for which manager sets which):
``overlong`` adds DAPO's soft overlong penalty to the sequence reward (``token_level_scores``; ``scores`` and
``rule_scores`` stay unshaped, so validation accuracy is not moved by length), ``record_acc`` keeps each row's
accuracy as ``extra["acc"]`` (the scorer's own ``acc`` when it returns a dict, else its score), ``strip_eos`` drops a
trailing eos text from the decoded response, and the class attribute ``check`` decides which return values count.

``num_workers=0`` scores in the driver process without timeouts (for debugging a scorer with a debugger).
Why a pool for cheap rule scores too: one code path keeps the timeout guarantee for every scorer, and it is cheap.
Measured on a shared 2-core machine: 256 hybridflow/arithmetic scores take ~17-25 ms per batch through 2 warm
workers (decoding included), against ~25-40 ms in-process; workers start in the constructor and the first batch
waits for them (~0.3 s idle, ~1.5 s on a heavily loaded machine).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.algorithms.dapo import overlong_reward_penalty
from hybridflow.protocol import DataProto
from hybridflow.rewards.pool import Outcome, ScoringPool, check_value, score_one
from hybridflow.rewards.registry import RewardConfigError, ScorerTable, unknown_data_source

__all__ = ["OverlongShaping", "RewardComputationError", "RewardManager", "RewardResult"]

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("raised", "timeout", "invalid", "crashed")


class RewardComputationError(RuntimeError):
    """Too many samples of one batch could not be scored; the message gives counts, an example and what to do."""


@dataclass
class OverlongShaping:
    """DAPO's soft overlong punishment (veRL's ``overlong_buffer_cfg`` plus ``max_resp_len``), in tokens.

    Penalty per response of length L: ``min(0, -(L - (max_resp_len - len)) / len * penalty_factor)``: 0 up to
    ``max_resp_len - len`` tokens, then linear down to ``-penalty_factor`` at ``max_resp_len`` (and on below that
    if a response can be longer). ``log``: also report each row's penalty (``extra["overlong_reward"]``,
    ``extra["overlong"]``) and their batch means as metrics."""

    len: int
    max_resp_len: int
    penalty_factor: float = 1.0
    log: bool = False

    def __post_init__(self) -> None:
        if self.len <= 0:
            raise RewardConfigError(
                f"overlong_buffer_cfg.len={self.len} must be > 0 when the overlong penalty is enabled "
                "(to turn it off set overlong_buffer_cfg.enable=false)"
            )
        if self.max_resp_len < self.len:
            raise RewardConfigError(
                f"max_resp_len={self.max_resp_len} must be >= overlong_buffer_cfg.len={self.len}"
            )
        if self.penalty_factor < 0:
            raise RewardConfigError(f"overlong_buffer_cfg.penalty_factor={self.penalty_factor} must be >= 0")

    def penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """[B] response lengths -> [B] float32 penalties (<= 0)."""
        lengths = lengths.double()
        capped = overlong_reward_penalty(lengths.clamp(max=self.max_resp_len), self.max_resp_len, self.len,
                                         self.penalty_factor)
        # veRL's formula keeps falling past max_resp_len (only reachable when max_resp_len < the rollout's limit).
        beyond = (lengths - self.max_resp_len).clamp(min=0) / self.len * self.penalty_factor
        return (capped - beyond).float()


@dataclass
class RewardResult:
    """Scores of one batch. ``token_level_scores [B, R]`` float32 holds each sample's score on its last response
    token (zeros elsewhere; a row with an empty response_mask gets its score only in ``scores``)."""

    token_level_scores: torch.Tensor  # [B, R] float32: scores + overlong_penalty on the last response token
    scores: torch.Tensor  # [B] float32: rule/custom score (+ rm_score_weight * rm_scores when given)
    rule_scores: torch.Tensor  # [B] float32: rule/custom score alone, failure_score where scoring failed
    failed: torch.Tensor  # [B] bool
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)  # per-row values from scorers returning dicts
    responses_text: list[str] = field(default_factory=list)
    overlong_penalty: torch.Tensor | None = None  # [B] float32 (<= 0) when overlong shaping is on


class RewardManager:
    """Scores batches of rollouts one sample at a time (veRL's ``naive`` manager, and the base of the others); see
    the module docstring. Call ``close()`` (or use ``with``) to stop the workers."""

    check = staticmethod(check_value)  # which return values count as a score (module-level: workers unpickle it)

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Callable[..., Any] | None = None,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        failure_score: float = 0.0,
        max_failure_fraction: float = 0.5,
        reward_fn_key: str = "data_source",
        rm_score_weight: float = 1.0,
        overlong: OverlongShaping | None = None,
        record_acc: bool = False,
        strip_eos: bool = False,
        scorer_overrides: dict[str, Callable[..., Any]] | None = None,
    ) -> None:
        if num_workers < 0:
            raise RewardConfigError(f"reward num_workers must be >= 0 (0 = score in the driver), got {num_workers}")
        if timeout_s <= 0:
            raise RewardConfigError(f"reward timeout_s must be > 0, got {timeout_s}")
        if not 0 <= max_failure_fraction <= 1:
            raise RewardConfigError(f"reward max_failure_fraction must be in [0, 1], got {max_failure_fraction}")
        self.tokenizer = tokenizer
        # The registry snapshot (not default_compute_score itself) so scorers registered at run time reach workers.
        # scorer_overrides: data_source -> scorer in place of the registered one (e.g. code on a SandboxFusion service)
        if compute_score is None:
            table = ScorerTable()
            compute_score = ScorerTable({**table.scorers, **scorer_overrides}) if scorer_overrides else table
        self.compute_score = compute_score
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.failure_score = float(failure_score)
        self.max_failure_fraction = max_failure_fraction
        self.reward_fn_key = reward_fn_key
        self.rm_score_weight = rm_score_weight
        self.overlong = overlong
        self.record_acc = record_acc
        self.strip_eos = strip_eos
        self._pool: ScoringPool | None = None
        if num_workers > 0:
            try:
                self._pool = ScoringPool(self.compute_score, num_workers, timeout_s, check=self.check)
            except ValueError as e:
                raise RewardConfigError(str(e)) from e
        self._logged: set[tuple[str, str]] = set()
        self.total_failures: Counter[str] = Counter()

    # ------------------------------------------------------------------ inputs
    def _tasks(self, batch: DataProto) -> list[dict[str, Any]]:
        nt = batch.non_tensor_batch
        if self.reward_fn_key not in nt:
            raise RewardConfigError(
                f"the batch has no non-tensor column {self.reward_fn_key!r} (reward_fn_key) to choose the reward "
                f"function; columns: {sorted(nt)}"
            )
        if "ground_truth" in nt:
            truths = list(nt["ground_truth"])
        elif "reward_model" in nt:
            truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in nt["reward_model"]]
        else:
            raise RewardConfigError(
                f"the batch has neither 'ground_truth' nor 'reward_model' columns; columns: {sorted(nt)}. "
                "Keep the dataset's non-tensor columns on the batch through rollout"
            )
        if isinstance(self.compute_score, ScorerTable):  # say it once, up front, rather than fail every sample
            unknown = {str(ds) for ds in nt[self.reward_fn_key] if not self.compute_score.knows(str(ds))}
            if unknown:
                raise unknown_data_source(sorted(unknown)[0], self.compute_score.scorers)
        extra_infos = list(nt["extra_info"]) if "extra_info" in nt else [None] * len(batch)
        texts = self._decode(batch)
        eos = getattr(self.tokenizer, "eos_token", None)
        if self.strip_eos and eos:  # veRL's DAPO manager: an eos that decoding kept (not a special token) is not text
            texts = [t[: -len(eos)] if t.endswith(eos) else t for t in texts]
        return [
            {"data_source": str(ds), "solution_str": text, "ground_truth": gt, "extra_info": info}
            for ds, text, gt, info in zip(nt[self.reward_fn_key], texts, truths, extra_infos)
        ]

    def _decode(self, batch: DataProto) -> list[str]:
        responses, mask = batch.batch["responses"], self._response_mask(batch)
        # in numpy: per row a few torch ops cost more than the decoding itself
        keep = mask.numpy(force=True).astype(bool, copy=False)
        ids = [row[m].tolist() for row, m in zip(responses.numpy(force=True), keep)]
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if hasattr(backend, "decode_batch") and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # The Rust tokenizer directly: transformers' batch_decode spends most of its time converting inputs.
            return backend.decode_batch(ids, skip_special_tokens=True)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    @staticmethod
    def _response_mask(batch: DataProto) -> torch.Tensor:
        if "responses" not in batch.batch:
            raise RewardConfigError(f"the batch has no 'responses' tensor to score; tensors: {sorted(batch.batch)}")
        if "response_mask" in batch.batch:
            return batch.batch["response_mask"]
        if "attention_mask" in batch.batch:  # rollout layout: the mask's last R columns cover the responses
            return batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1] :]
        raise RewardConfigError("the batch has neither 'response_mask' nor 'attention_mask'; cannot tell padding apart")

    # ------------------------------------------------------------------ scoring
    # __call__ takes rm_scores=callable: reward-model scores computed elsewhere meanwhile (the reward loop), fetched
    # only once the rule scores are in, so the two overlap
    takes_late_rm_scores = True

    def __call__(self, batch: DataProto, rm_scores: Callable[[], torch.Tensor] | None = None) -> RewardResult:
        start = time.monotonic()
        tasks = self._tasks(batch)
        outcomes = self._score(tasks)
        n = len(tasks)
        rule = torch.full((n,), self.failure_score, dtype=torch.float32)
        failed = torch.zeros(n, dtype=torch.bool)
        counts: Counter[str] = Counter()
        extra: dict[str, list[Any]] = {}
        for i, (task, out) in enumerate(zip(tasks, outcomes)):
            if out.kind == "ok":
                rule[i] = out.score
                for k, v in out.extras.items():
                    extra.setdefault(k, [None] * n)[i] = v
            else:
                failed[i] = True
                counts[out.kind] += 1
                self._log_failure(out, task, i)
        if self.record_acc:  # the scorer's own acc where it gave one, else the row's score (failure_score if failed)
            given = extra.get("acc", [None] * n)
            extra["acc"] = [float(rule[i]) if given[i] is None else given[i] for i in range(n)]
        self.total_failures.update(counts)
        num_failed = int(failed.sum())
        if n and num_failed > self.max_failure_fraction * n:
            self._raise_too_many(tasks, outcomes, counts, num_failed)

        scores = rule.clone()
        metrics = {
            "reward/rule_score_mean": float(rule.mean()) if n else 0.0,
            "reward/failures": float(num_failed),
            "reward/failure_fraction": num_failed / n if n else 0.0,
            "reward/timeouts": float(counts["timeout"]),
            "reward/raised": float(counts["raised"]),
            "reward/invalid": float(counts["invalid"]),
            "reward/crashed": float(counts["crashed"]),
        }
        if rm_scores is not None:
            wait_start = time.monotonic()
            batch.batch["rm_scores"] = rm_scores()
            metrics["reward/rm_wait_s"] = time.monotonic() - wait_start  # ~0: the model was done before the rules
        if "rm_scores" in batch.batch:
            rm = batch.batch["rm_scores"].float().cpu()
            rm = rm.sum(-1) if rm.dim() == 2 else rm  # token-level reward-model scores sum to one per sample
            scores = scores + self.rm_score_weight * rm
            metrics["reward/rm_score_mean"] = float(rm.mean()) if n else 0.0
        metrics["reward/score_mean"] = float(scores.mean()) if n else 0.0

        mask = self._response_mask(batch).cpu()
        penalty = None
        shaped = scores
        if self.overlong is not None:
            penalty = self.overlong.penalty(mask.sum(-1))
            shaped = scores + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean()) if n else 0.0
            if self.overlong.log:
                extra["overlong_reward"] = penalty.tolist()
                extra["overlong"] = (penalty < 0).tolist()
                metrics["reward/overlong_fraction"] = float((penalty < 0).float().mean()) if n else 0.0
        token_level = torch.zeros(mask.shape, dtype=torch.float32)
        has_tokens = mask.any(-1)
        # Index of the last 1 in each row (masks may contain holes, e.g. tool outputs).
        last = (mask.shape[1] - 1) - mask.flip(-1).long().argmax(-1)
        rows = torch.nonzero(has_tokens, as_tuple=True)[0]
        token_level[rows, last[rows]] = shaped[rows]
        metrics["timing/reward_scoring"] = time.monotonic() - start
        return RewardResult(
            token_level_scores=token_level,
            scores=scores,
            rule_scores=rule,
            failed=failed,
            metrics=metrics,
            extra=extra,
            responses_text=[t["solution_str"] for t in tasks],
            overlong_penalty=penalty,
        )

    def _score(self, tasks: list[dict[str, Any]]) -> list[Outcome]:
        """One Outcome per task: in the pool, or here when num_workers=0."""
        if self._pool is not None:
            return self._pool.score(tasks)
        return [score_one(self.compute_score, t, self.check) for t in tasks]

    def _log_failure(self, out: Outcome, task: dict[str, Any], row: int) -> None:
        key = (out.kind, task["data_source"])
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(
            "reward %s for data_source %r (batch row %d): %s; scored as %g (logged once per kind and data_source)",
            out.kind, task["data_source"], row, out.message, self.failure_score,
        )

    def _raise_too_many(
        self, tasks: list[dict[str, Any]], outcomes: list[Outcome], counts: Counter[str], num_failed: int
    ) -> None:
        first = next(i for i, o in enumerate(outcomes) if o.kind != "ok")
        detail = ", ".join(f"{k}: {counts[k]}" for k in FAILURE_KINDS if counts[k])
        raise RewardComputationError(
            f"{num_failed} of {len(tasks)} samples could not be scored ({detail}), more than "
            f"max_failure_fraction={self.max_failure_fraction}. First: row {first}, data_source "
            f"{tasks[first]['data_source']!r}: {outcomes[first].kind} - {outcomes[first].message}. Fix the reward "
            "function, raise reward_model.timeout_s if it is just slow, or raise reward_model.max_failure_fraction"
        )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
