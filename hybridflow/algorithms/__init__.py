"""The math of RL post-training as pure functions on tensors (no Ray, no models, no workers).

Advantage estimators and policy losses are chosen by name from registries (`get_advantage_estimator("grpo")`,
`get_policy_loss("ppo")`), so the driver never branches on the algorithm. One idea per module:

  registry.py     name -> function registries, with metadata (needs_critic, needs_greedy_baseline, ...)
  masked.py       masked_mean / masked_whiten: statistics over valid tokens
  aggregation.py  agg_loss: per-token loss -> scalar, normalised by global token/sequence counts
  advantage.py    gae, grpo, dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax
  policy_loss.py  ppo (clip-higher, dual-clip), gspo, cispo, reinforce
  kl.py           KL estimators k1/k2/k3/abs (+ straight-through), KL in the reward or as a loss, KL controllers
  entropy.py      entropy from logits, plain and chunked (memory-efficient, exact, differentiable)
  value_loss.py   clipped value loss, explained variance
  dapo.py         overlong reward penalty, group filter for dynamic sampling
"""

from hybridflow.algorithms import advantage as _advantage  # noqa: F401  (registers the estimators)
from hybridflow.algorithms import policy_loss as _policy_loss  # noqa: F401  (registers the losses)
from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs
from hybridflow.algorithms.dapo import filter_groups, overlong_reward_penalty
from hybridflow.algorithms.entropy import entropy_from_logits, entropy_from_logits_chunked
from hybridflow.algorithms.kl import (
    KL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_loss,
    kl_penalty,
)
from hybridflow.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from hybridflow.algorithms.registry import (
    AdvantageEstimator,
    PolicyLoss,
    available_advantage_estimators,
    available_policy_losses,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from hybridflow.algorithms.value_loss import compute_value_loss, explained_variance

__all__ = [
    "KL_TYPES",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "PolicyLoss",
    "agg_loss",
    "apply_kl_penalty",
    "available_advantage_estimators",
    "available_policy_losses",
    "compute_value_loss",
    "count_tokens_and_seqs",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "explained_variance",
    "filter_groups",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_reward_penalty",
    "register_advantage",
    "register_policy_loss",
]
