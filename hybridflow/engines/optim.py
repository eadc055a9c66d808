"""AdamW and its learning-rate schedule: linear warm-up, then constant or cosine decay to ``min_lr_ratio * lr``.

The schedule is a pure function of the step (``lr_multiplier``), wrapped in a ``LambdaLR`` so that its state is one
integer and a resumed run computes exactly the same learning rates as one that never stopped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["OptimConfig", "build_lr_scheduler", "build_optimizer", "lr_multiplier", "warmup_steps"]

LR_SCHEDULER_TYPES = ("constant", "cosine")


@dataclass
class OptimConfig:
    """Optimizer section of the engine config; `validate()` explains what to change."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_warmup_steps: int = -1  # > 0 wins over lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # fraction of total_training_steps, used when lr_warmup_steps <= 0
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    total_training_steps: int = -1  # needed by cosine and by lr_warmup_steps_ratio
    grad_clip: float = 1.0  # global L2 norm; <= 0 disables clipping (the norm is still reported)

    def validate(self) -> None:
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if self.lr_scheduler_type not in LR_SCHEDULER_TYPES:
            raise ValueError(
                f"optim.lr_scheduler_type is {self.lr_scheduler_type!r}; choose one of {list(LR_SCHEDULER_TYPES)}"
            )
        if self.lr_scheduler_type == "cosine" and self.total_training_steps <= 0:
            raise ValueError("optim.lr_scheduler_type='cosine' needs optim.total_training_steps > 0 (the decay length)")
        if self.lr_warmup_steps <= 0 and self.lr_warmup_steps_ratio > 0 and self.total_training_steps <= 0:
            raise ValueError(
                "optim.lr_warmup_steps_ratio needs optim.total_training_steps > 0; or set optim.lr_warmup_steps instead"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"optim.lr_warmup_steps_ratio must be in [0, 1], got {self.lr_warmup_steps_ratio}")
        if len(tuple(self.betas)) != 2:
            raise ValueError(f"optim.betas must be two numbers, got {self.betas}")


def warmup_steps(cfg: OptimConfig) -> int:
    """Number of warm-up steps implied by the config (0: no warm-up)."""
    if cfg.lr_warmup_steps > 0:
        return int(cfg.lr_warmup_steps)
    if cfg.lr_warmup_steps_ratio > 0 and cfg.total_training_steps > 0:
        return int(cfg.lr_warmup_steps_ratio * cfg.total_training_steps)
    return 0


def lr_multiplier(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based) as a fraction of `cfg.lr`.

    Warm-up is linear and reaches 1 on the last warm-up step, so step 0 already trains (at lr / warmup).
    """
    warm = warmup_steps(cfg)
    if step < warm:
        return (step + 1) / warm
    if cfg.lr_scheduler_type == "constant":
        return 1.0
    decay_steps = max(1, cfg.total_training_steps - warm)
    progress = min(1.0, (step - warm) / decay_steps)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    cfg.validate()
    trainable = [p for p in params if p.requires_grad]
    # fused: one kernel per parameter group instead of a chain of elementwise ops per tensor; on CPU one AdamW step
    # over 25M parameters took 0.028 s fused vs 0.165 s default and 0.183 s foreach (measured, 1 thread).
    # Deterministic, and it accepts FSDP2's DTensor parameters.
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler whose `step()` the trainer calls once per training step (not per micro- or mini-batch)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_multiplier, cfg=cfg))
