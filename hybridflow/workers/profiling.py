"""torch.profiler around chosen training steps, on chosen ranks (veRL's ``*.profiler`` keys with ``tool=torch``).

The driver (trainer/profiling.py) calls ``start_profile(step)`` / ``stop_profile()`` on a role's worker group around
the steps of ``global_profiler.steps``; each rank of that group the role's ``profiler`` section chooses (``ranks``,
``all_ranks``) records CPU (and CUDA, on GPUs) activity with ``torch.profiler`` and writes one Chrome trace per rank:

    SAVE_PATH/step_3/actor_rollout_rank0.json        (the worker's role; steps 3-4 profiled as one: step_3-4/...)

Roles that share processes (colocated placement: the actor and the critic in one process per rank) share the one
profiler of their process — torch allows one at a time — and its trace is named after all of them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["chosen_rank", "start_profile", "stop_profile"]

# this process's one profiler: the torch.profiler.profile, the roles recording now / ever, the trace folder, the rank
_active: dict[str, Any] = {}


def chosen_rank(section: Any, rank: int) -> bool:
    """Whether `rank` records when the role's profiler is on: all_ranks, or rank in ranks (none listed: rank 0)."""
    if not section.enable:
        return False
    if section.all_ranks:
        return True
    ranks = list(section.ranks or [])
    return rank in ranks if ranks else rank == 0


def start_profile(role: str, rank: int, folder: str) -> bool:
    """Start (or join) this process's profiler for `role`; the trace will go to `folder`. True if it started."""
    if _active:
        _active["roles"].append(role)
        _active["names"].append(role)
        return False
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities, record_shapes=True)
    prof.start()
    _active.update(profiler=prof, roles=[role], names=[role], folder=folder, rank=rank)
    return True


def stop_profile(role: str) -> str | None:
    """Leave the profiler; the last role to leave stops it and writes the trace. Returns the file written, or None."""
    if not _active or role not in _active["roles"]:
        return None
    _active["roles"].remove(role)
    if _active["roles"]:
        return None
    prof, folder, rank = _active["profiler"], _active["folder"], _active["rank"]
    names = _active["names"]
    _active.clear()
    prof.stop()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{'+'.join(sorted(set(names)))}_rank{rank}.json")
    prof.export_chrome_trace(path)
    return path
