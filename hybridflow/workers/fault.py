"""Fault injection for tests of automatic restart: kill this worker process at a chosen (method, rank, step).

Configured with ``trainer.fault_injection="update_actor:1:3"`` (method, rank, global step). The kill happens once per
run folder: a marker file written just before the SIGKILL stops the restarted workers from dying again at the same
step, which is what a real one-off fault (an OOM kill, a lost node) looks like.
"""

from __future__ import annotations

import os
import signal


def maybe_inject_fault(spec: str | None, run_dir: str, method: str, rank: int, step: int) -> None:
    if not spec:
        return
    try:
        want_method, want_rank, want_step = spec.split(":")
        want = (want_method, int(want_rank), int(want_step))
    except ValueError:
        raise ValueError(f"trainer.fault_injection={spec!r} must look like 'update_actor:1:3' (method:rank:step)") from None
    if (method, rank, step) != want:
        return
    marker = os.path.join(run_dir, f".fault_injected_{method}_{rank}_{step}")
    if os.path.exists(marker):
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write("killed\n")
    os.kill(os.getpid(), signal.SIGKILL)
