"""Per-rank RNG state (python, numpy, torch) saved as JSON, so resuming restores every rank's generators.

JSON rather than pickle: a checkpoint folder must be safe to load even when it came from somewhere else.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), npst[2], npst[3], npst[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_rank_state(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(capture_rng_state(), f)


def load_rank_state(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint is missing the per-rank RNG state {path}; it is incomplete or corrupt")
    with open(path) as f:
        restore_rng_state(json.load(f))
