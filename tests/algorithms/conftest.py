"""Random RL batches for the algorithm tests: float64, random masks (with holes), random group sizes.

Masked positions are filled with garbage on purpose, so a test fails if an implementation lets them leak in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch


@dataclass
class RandomBatch:
    token_level_rewards: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] float64 0/1
    values: torch.Tensor  # [B, T]
    index: np.ndarray  # [B] str uids, random group sizes 1..5, rows of a group not contiguous
    old_log_prob: torch.Tensor  # [B, T]
    log_prob: torch.Tensor  # [B, T]
    ref_log_prob: torch.Tensor  # [B, T]
    reward_baselines: torch.Tensor  # [B]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.response_mask.shape)


def random_mask(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    mask = np.zeros((batch, length))
    for i in range(batch):
        n = rng.integers(1, length + 1)  # at least one response token
        mask[i, :n] = 1.0
        if rng.random() < 0.4 and n > 2:  # multi-turn style holes (e.g. tool outputs) inside the response
            holes = rng.choice(np.arange(1, n - 1), size=rng.integers(1, n - 1), replace=False)
            mask[i, holes] = 0.0
    return mask


def random_uids(rng: np.random.Generator, batch: int) -> np.ndarray:
    uids: list[str] = []
    group = 0
    while len(uids) < batch:
        size = int(rng.integers(1, 6))
        uids += [f"prompt-{group}"] * size
        group += 1
    uids = np.array(uids[:batch], dtype=object)
    rng.shuffle(uids)
    return uids


def make_random_batch(seed: int, batch: int = 12, length: int = 7, outcome_only: bool = False) -> RandomBatch:
    rng = np.random.default_rng(seed)
    mask = random_mask(rng, batch, length)
    if outcome_only:  # one verifier reward (often 0/1) on the last valid token, garbage elsewhere
        rewards = rng.normal(size=(batch, length)) * (1 - mask)
        for i in range(batch):
            last = np.flatnonzero(mask[i])[-1]
            rewards[i, last] = float(rng.integers(0, 2)) if rng.random() < 0.5 else rng.normal()
    else:
        rewards = rng.normal(size=(batch, length))
    rewards = np.where(mask > 0, rewards, rng.normal(size=(batch, length)) * 100)
    old = -rng.exponential(size=(batch, length))
    new = old + rng.normal(scale=0.3, size=(batch, length))
    ref = old + rng.normal(scale=0.5, size=(batch, length))

    def t(x):
        return torch.tensor(x, dtype=torch.float64)

    return RandomBatch(
        token_level_rewards=t(rewards),
        response_mask=t(mask),
        values=t(rng.normal(size=(batch, length))),
        index=random_uids(rng, batch),
        old_log_prob=t(old),
        log_prob=t(new),
        ref_log_prob=t(ref),
        reward_baselines=t(rng.normal(size=batch)),
    )


@pytest.fixture
def make_batch():
    """make_batch(seed, batch=12, length=7, outcome_only=False) -> RandomBatch (float64)."""
    return make_random_batch
