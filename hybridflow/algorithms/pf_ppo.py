"""PF-PPO (policy filtration, Zhang et al. 2024): resample a step's responses by weights from their rewards.

A reward model is most reliable at the extremes of its scores, so PF-PPO trains more on the responses whose rewards
are high (or high and low) and less on the middle. After the advantages are computed, the batch of B responses is
replaced by B draws *with replacement*, row i drawn with probability proportional to ``w_i = method(R_i)`` where
R_i is the response's sequence score (the sum of its token-level scores). veRL's keys::

    algorithm.use_pf_ppo=true
    algorithm.pf_ppo.reweight_method=pow   # pow | max_min | max_random, or a registered / 'package.module:fn' name
    algorithm.pf_ppo.weight_pow=2.0        # the exponent of pow

Methods, R = the batch's sequence scores [B] -> weights [B] (a tiny constant is added so that every weight is > 0):
  * pow:        |R_i| ** weight_pow
  * max_min:    1 for the rows with the batch's highest or lowest score, 0 for the others
  * max_random: 0.4 for the rows with the highest score, 0.1 for the others
A method of your own: ``PF_PPO_WEIGHTS.add("name", fn)`` with ``fn(scores [B], weight_pow) -> weights [B]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.plugins import Registry

__all__ = ["PF_PPO_WEIGHTS", "pf_ppo_resample_indices", "pf_ppo_weights"]

WeightFn = Callable[[torch.Tensor, float], torch.Tensor]
PF_PPO_WEIGHTS: Registry[WeightFn] = Registry(
    "PF-PPO reweight method", "hybridflow.algorithms.pf_ppo.PF_PPO_WEIGHTS.add(name, fn)"
)
# keeps every row drawable (a zero-weight row would make an all-zero pow batch, R = 0 everywhere, undefined)
WEIGHT_FLOOR = 1e-8


def _pow(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    return scores.abs().pow(weight_pow)


def _max_min(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    extreme = (scores == scores.max()) | (scores == scores.min())
    return extreme.to(scores.dtype)


def _max_random(scores: torch.Tensor, weight_pow: float) -> torch.Tensor:
    best = scores == scores.max()
    return torch.where(best, 0.4, 0.1).to(scores.dtype)


PF_PPO_WEIGHTS.add("pow", _pow)
PF_PPO_WEIGHTS.add("max_min", _max_min)
PF_PPO_WEIGHTS.add("max_random", _max_random)


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """The sampling weights [B] (float64, all > 0) of sequence scores [B] under the registered `method`."""
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(f"PF-PPO needs one score per response, [batch] with batch >= 1; got {tuple(scores.shape)}")
    weights = PF_PPO_WEIGHTS.get(method)(scores.double(), float(weight_pow))
    if weights.shape != scores.shape or not torch.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(
            f"PF-PPO reweight method {method!r} must return finite weights >= 0 of shape {tuple(scores.shape)}"
        )
    return weights.double() + WEIGHT_FLOOR


def pf_ppo_resample_indices(
    scores: torch.Tensor, method: str, weight_pow: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Row indices [B] (int64): B draws with replacement, row i with probability w_i / sum(w)."""
    weights = pf_ppo_weights(scores, method, weight_pow)
    return torch.multinomial(weights, scores.numel(), replacement=True, generator=generator)
