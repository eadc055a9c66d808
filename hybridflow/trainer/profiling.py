"""veRL's profiler keys with ``tool=torch``: torch.profiler traces of chosen steps, from chosen ranks of chosen roles.

    global_profiler.tool=torch global_profiler.steps=[2,3] global_profiler.save_path=/tmp/prof \\
    actor_rollout_ref.actor.profiler.enable=true actor_rollout_ref.actor.profiler.ranks=[0,1]

``global_profiler``: ``tool`` (torch; veRL's nsys / npu / torch_memory are refused with the reason), ``steps`` (global
steps, from 1), ``profile_continuous_steps`` (consecutive listed steps make one trace instead of one each),
``save_path`` (default ``trainer.default_local_dir/profile``). Each role's ``profiler`` section (actor and ref share
the actor/rollout/ref workers' processes; the critic): ``enable``, ``ranks`` (none listed: rank 0), ``all_ranks``,
``tool`` / ``save_path`` (null: the global ones). The workers record (workers/profiling.py); one Chrome trace per rank
lands in ``SAVE_PATH/step_N/ROLE_rankR.json``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = ["StepProfiler", "profiler_errors"]

TOOLS = ("torch",)
_REFUSED_TOOLS = {
    "nsys": "Nsight Systems capture is not driven by hybridflow: run the job under `nsys profile` yourself, or use "
            "tool=torch",
    "npu": "Ascend NPUs are not supported (cpu and cuda devices); use tool=torch",
    "torch_memory": "CUDA memory snapshots are not taken; use tool=torch (torch.profiler traces)",
}


def _roles(cfg: Any) -> list[tuple[str, Any]]:
    arr = cfg.actor_rollout_ref
    return [("actor_rollout_ref.actor.profiler", arr.actor.profiler), ("actor_rollout_ref.ref.profiler",
            arr.ref.profiler), ("critic.profiler", cfg.critic.profiler)]


def _tool_error(key: str, tool: Any) -> str | None:
    if tool is None or tool in TOOLS:
        return None
    why = _REFUSED_TOOLS.get(str(tool), f"choose one of {list(TOOLS)}")
    return f"{key}={tool!r}: {why}"


def profiler_errors(cfg: Any) -> list[str]:
    """The profiler keys' problems, one line each (called by config validation)."""
    gp, world = cfg.global_profiler, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    errors = [e for e in [_tool_error("global_profiler.tool", gp.tool)] if e]
    steps = list(gp.steps or [])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
        errors.append(f"global_profiler.steps={steps}: give global steps (1, 2, ...) to profile")
    enabled = []
    for key, section in _roles(cfg):
        if problem := _tool_error(f"{key}.tool", section.tool):
            errors.append(problem)
        if not section.enable:
            unread = [f"{name}={value}" for name, value, unset in (
                ("all_ranks", section.all_ranks, False), ("ranks", list(section.ranks or []), []),
                ("save_path", section.save_path, gp.save_path)) if value != unset and value is not None]
            if unread:
                errors.append(f"{key}: {', '.join(unread)} set but {key}.enable is false; enable it or drop them")
            continue
        enabled.append(key)
        if (section.tool or gp.tool) is None:
            errors.append(f"{key}.enable=true but no tool is set; set global_profiler.tool=torch (or {key}.tool)")
        bad = [r for r in (section.ranks or []) if not isinstance(r, int) or not 0 <= r < world]
        if bad:
            errors.append(f"{key}.ranks={list(section.ranks)}: {bad} not among the {world} ranks (0..{world - 1})")
        if not steps:
            errors.append(f"{key}.enable=true but global_profiler.steps is empty; list the steps to profile")
    if gp.profile_continuous_steps and not steps:
        errors.append("global_profiler.profile_continuous_steps=true but global_profiler.steps is empty; list the steps")
    if steps and gp.tool is None and not enabled:
        errors.append("global_profiler.steps is set but global_profiler.tool is null; set tool=torch or drop the steps")
    if gp.tool in TOOLS and not enabled:
        errors.append(f"global_profiler.tool={gp.tool} profiles the roles whose profiler.enable=true, and none is; "
                      "set e.g. actor_rollout_ref.actor.profiler.enable=true")
    return errors


class StepProfiler:
    """``with profiler.step(n, groups):`` around global step n: the chosen roles' workers record it."""

    def __init__(self, cfg: Any) -> None:
        gp = cfg.global_profiler
        self.steps = sorted(set(gp.steps or []))
        self.continuous = bool(gp.profile_continuous_steps)
        default = gp.save_path or os.path.join(cfg.trainer.default_local_dir, "profile")
        arr = cfg.actor_rollout_ref
        # (group attribute on WorkerGroups, the trace root): the actor's processes also hold the reference
        self.targets = []
        for group, sections in (("actor_rollout", (arr.actor.profiler, arr.ref.profiler)),
                                ("critic", (cfg.critic.profiler,))):
            on = [s for s in sections if s.enable]
            tool = next((s.tool for s in on if s.tool), gp.tool)
            if on and tool in TOOLS:
                self.targets.append((group, next((s.save_path for s in on if s.save_path), default)))

    def _span(self, step: int) -> tuple[int, int]:
        """First and last step of the trace that holds `step` (one step unless profile_continuous_steps)."""
        lo = hi = step
        if self.continuous:
            while lo - 1 in self.steps:
                lo -= 1
            while hi + 1 in self.steps:
                hi += 1
        return lo, hi

    @contextlib.contextmanager
    def step(self, step: int, groups: Any):
        if step not in self.steps or not self.targets:
            yield
            return
        lo, hi = self._span(step)
        label = f"step_{lo}" if lo == hi else f"step_{lo}-{hi}"
        live = [(getattr(groups, name), root) for name, root in self.targets if getattr(groups, name) is not None]
        if step == lo:
            for group, root in live:
                group.start_profile(os.path.join(root, label))
        yield
        if step == hi:
            for group, _ in live:
                group.stop_profile()
