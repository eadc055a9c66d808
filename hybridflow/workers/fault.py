"""Fault injection for tests of automatic restart: kill this worker process at a chosen (method, rank, step).

Configured with ``trainer.fault_injection="update_actor:1:3"`` (method, rank, global step; several, comma-separated,
kill several times). Each kill happens once per run folder: a marker file written just before the SIGKILL stops the
restarted workers from dying again at the same step, which is what a real one-off fault (an OOM kill, a lost node)
looks like.

The spec's parser lives in hybridflow/common/faults.py, so config validation can check it without importing workers.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from hybridflow.common.faults import FAULT_POINTS, parse_fault_spec, parse_fault_specs

__all__ = ["FAULT_POINTS", "maybe_inject_fault", "parse_fault_spec", "parse_fault_specs", "step_of"]

_STEP_DIR = re.compile(r"global_step_(\d+)$")


def step_of(where: Any) -> int:
    """The global step a fault point is at: a DataProto's meta_info["global_step"], or the N of a checkpoint folder
    path ending in ``global_step_N`` (also ``.tmp-global_step_N`` while it is written); -1 when unknown."""
    if isinstance(where, str):
        m = _STEP_DIR.search(where.rstrip("/"))
        return int(m.group(1)) if m else -1
    return int(getattr(where, "meta_info", {}).get("global_step", -1))


def maybe_inject_fault(spec: str | None, run_dir: str, method: str, rank: int, step: int) -> None:
    if not spec:
        return
    if (method, rank, step) not in parse_fault_specs(spec):
        return
    marker = os.path.join(run_dir, f".fault_injected_{method}_{rank}_{step}")
    if os.path.exists(marker):
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(marker, "w") as f:
        f.write("killed\n")
    os.kill(os.getpid(), signal.SIGKILL)
