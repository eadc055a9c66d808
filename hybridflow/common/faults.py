"""Fault specs for tests of automatic restart (``trainer.fault_injection="update_actor:1:3"``).

``parse_fault_spec`` checks a spec without running anything, so a typo fails at start-up instead of inside a worker
(where it would look like a crash) or, with a method that has no fault point, never firing at all. The kill itself is
hybridflow/workers/fault.py's.
"""

from __future__ import annotations

# The worker methods that call maybe_inject_fault (ActorRolloutRefWorker._fault_point); generate_sequences only on
# a rollout group of its own (hybrid_engine=false).
FAULT_POINTS = ("compute_log_prob", "update_actor", "generate_sequences")


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
