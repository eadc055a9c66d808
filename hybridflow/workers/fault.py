"""Fault injection for tests of automatic restart: kill this worker process at a chosen (method, rank, step).

Configured with ``trainer.fault_injection="update_actor:1:3"`` (method, rank, global step; see FAULT_POINTS). The kill happens once per
run folder: a marker file written just before the SIGKILL stops the restarted workers from dying again at the same
step, which is what a real one-off fault (an OOM kill, a lost node) looks like.

``parse_fault_spec`` checks a spec without running anything, so a typo fails at start-up instead of inside a worker
(where it would look like a crash) or, with a method that has no fault point, never firing at all.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

# The worker methods that call maybe_inject_fault (ActorRolloutRefWorker._fault_point): the kill lands in
# generation, in a log-prob pass, right before update_actor's collectives, and half way through writing a checkpoint.
FAULT_POINTS = ("generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint")
_STEP_DIR = re.compile(r"global_step_(\d+)$")


def step_of(where: Any) -> int:
    """The global step a fault point is at: a DataProto's meta_info["global_step"], or the N of a checkpoint folder
    path ending in ``global_step_N`` (also ``.tmp-global_step_N`` while it is written); -1 when unknown."""
    if isinstance(where, str):
        m = _STEP_DIR.search(where.rstrip("/"))
        return int(m.group(1)) if m else -1
    return int(getattr(where, "meta_info", {}).get("global_step", -1))


def parse_fault_spec(spec: str) -> tuple[str, int, int]:
    """'update_actor:1:3' -> ('update_actor', 1, 3); ValueError saying what is wrong otherwise."""
    usage = f"trainer.fault_injection={spec!r} must look like 'update_actor:1:3' (method:rank:step)"
    parts = spec.split(":")
    if len(parts) != 3:
        raise ValueError(usage)
    method, rank_text, step_text = (p.strip() for p in parts)
    try:
        rank, step = int(rank_text), int(step_text)
    except ValueError:
        raise ValueError(f"{usage}; rank and step must be integers") from None
    if method not in FAULT_POINTS:
        raise ValueError(f"{usage}; method {method!r} has no fault point, choose one of {list(FAULT_POINTS)}")
    if rank < 0 or step < 1:
        raise ValueError(f"{usage}; rank must be >= 0 and step >= 1 (global steps count from 1)")
    return method, rank, step


def maybe_inject_fault(spec: str | None, run_dir: str, method: str, rank: int, step: int) -> None:
    if not spec:
        return
    if (method, rank, step) != parse_fault_spec(spec):
        return
    marker = os.path.join(run_dir, f".fault_injected_{method}_{rank}_{step}")
    if os.path.exists(marker):
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write("killed\n")
    os.kill(os.getpid(), signal.SIGKILL)
