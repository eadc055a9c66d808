"""PF-PPO's step on the driver: the trained batch replaced by a reward-weighted resample of its rows.

The weights come from `algorithms/pf_ppo.py` (a registry of methods); this module only applies them to a DataProto,
after the advantages (and values, returns) are computed, so actor and critic both train on the resampled rows, as in
veRL. The draw is seeded from trainer.seed and the step, so a resumed run draws the same rows.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.algorithms.pf_ppo import pf_ppo_resample_indices
from hybridflow.common.seeds import derive_seed
from hybridflow.protocol import DataProto

PF_PPO_SALT = 0x5F5F  # keeps this draw's stream apart from the sampling streams seeded from the same step


def pf_ppo_resample(batch: DataProto, alg: Any, seed: int, step: int) -> dict[str, float]:
    """Reorder `batch` in place into B rows drawn by PF-PPO's weights; returns pf_ppo/* metrics.

    alg: the algorithm config section (alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow). The sequence score of a
    row is the sum of its token_level_scores [B, T] (the reward before any KL penalty, as veRL's).
    """
    scores = batch.batch["token_level_scores"].sum(dim=-1)
    generator = torch.Generator().manual_seed(derive_seed(seed, step, PF_PPO_SALT))
    idx = pf_ppo_resample_indices(scores.cpu(), alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow, generator)
    batch.reorder(idx)
    return {
        "pf_ppo/unique_fraction": float(idx.unique().numel()) / max(len(idx), 1),
        "pf_ppo/score_mean_before": float(scores.float().mean()),
        "pf_ppo/score_mean_after": float(scores[idx].float().mean()),
    }
