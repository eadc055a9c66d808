"""Fault specs for tests of automatic restart (``trainer.fault_injection="update_actor:1:3"``, or several faults
separated by commas: ``"generate_sequences:1:2,update_actor:1:2"``, each firing once).

``parse_fault_spec`` checks a spec without running anything, so a typo fails at start-up instead of inside a worker
(where it would look like a crash) or, with a method that has no fault point, never firing at all. The kill itself is
hybridflow/workers/fault.py's.
"""

from __future__ import annotations

# The worker methods that call maybe_inject_fault (ActorRolloutRefWorker._fault_point): the kill lands in
# generation, in a log-prob pass, right before update_actor's collectives, and half way through writing a checkpoint.
FAULT_POINTS = ("generate_sequences", "compute_log_prob", "update_actor", "save_checkpoint")


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


def parse_fault_specs(spec: str) -> list[tuple[str, int, int]]:
    """'generate_sequences:1:2,update_actor:1:2' -> one (method, rank, step) per fault; ValueError naming the bad
    one."""
    faults = [parse_fault_spec(part) for part in spec.split(",")]
    if len(set(faults)) != len(faults):
        raise ValueError(f"trainer.fault_injection={spec!r} names the same fault twice; each fires once per run")
    return faults
