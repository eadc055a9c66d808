"""One run folder, one history: decide at start-up whether `trainer.default_local_dir` may take this run.

A run folder holds what a run wrote (``metrics.jsonl``, ``samples.jsonl``, ``global_step_N/`` checkpoints, the latest
pointer, tracker folders). A second run that started from step 0 in the same folder would interleave its rows with
the first one's (steps 1 2 3 1 2 3) and replace its checkpoints. So a run that starts afresh where a run already is
is refused, unless ``trainer.overwrite=true``: then the old run's files are moved (never deleted) into a sibling
folder ``<run_dir>.archived-<UTC time>`` and the move is announced.

Only files hybridflow writes are ever moved. Anything else (a veRL ``global_step_N`` without hybridflow's
``COMPLETE`` marker, the user's notes) stays where it is and is named in a warning; a planned checkpoint save that
would land on such a folder is refused before the first step, because hybridflow never replaces a folder it did not
write.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

from hybridflow.trainer.checkpoint import COMPLETE_MARKER, LATEST_FILE, STEP_DIR, CheckpointError, CheckpointManager

__all__ = ["RunDirError", "RunDirPlan", "planned_save_steps", "prepare_run_dir"]

logger = logging.getLogger(__name__)

# Top-level entries hybridflow (trainer, trackers, report, fault injection) writes into a run folder.
_OURS_FILES = ("metrics.jsonl", "samples.jsonl", "tracking_ids.json", "metrics.jsonl.tmp", LATEST_FILE)
_OURS_DIRS = ("tensorboard", "wandb", "mlruns", "report", "model_override",
             "high_diff_tokens")  # model_override: verl_model_keys.py; high_diff_tokens: trainer/high_diff_tokens.py
_OURS_PATTERN = re.compile(r"^(\.tmp-global_step_\d+|\.fault_injected_.+|latest_checkpointed_iteration\.txt\.tmp)$")


class RunDirError(ValueError):
    """The run folder cannot take this run as configured; the message names the folder and what to change."""


class RunDirPlan:
    """What `prepare_run_dir` found and did: `archived_to` (or None), `foreign` (entries left alone)."""

    def __init__(self, archived_to: str | None, foreign: list[str], start_step: int = 0) -> None:
        self.archived_to, self.foreign, self.start_step = archived_to, foreign, start_step


def _count_rows(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _is_ours_step_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, COMPLETE_MARKER))


def classify_entries(run_dir: str) -> tuple[list[str], list[str]]:
    """(hybridflow's entries, everyone else's) at the top of `run_dir`, names sorted."""
    ours, foreign = [], []
    if not os.path.isdir(run_dir):
        return ours, foreign
    for name in sorted(os.listdir(run_dir)):
        full = os.path.join(run_dir, name)
        if STEP_DIR.match(name):
            (ours if _is_ours_step_dir(full) else foreign).append(name)
        elif name == LATEST_FILE:
            (ours if _pointer_is_ours(run_dir) else foreign).append(name)
        elif (
            (name in _OURS_FILES and os.path.isfile(full))
            or (name in _OURS_DIRS and os.path.isdir(full))
            or _OURS_PATTERN.match(name)
        ):
            ours.append(name)
        else:
            foreign.append(name)
    return ours, foreign


def _pointer_is_ours(run_dir: str) -> bool:
    """Our pointer holds a step number whose folder, if present, carries our marker (veRL writes one of the same
    name next to its own global_step_N folders)."""
    try:
        with open(os.path.join(run_dir, LATEST_FILE), "rb") as f:
            text = f.read().decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    if not text.isdigit():
        return False
    target = os.path.join(run_dir, f"global_step_{text}")
    return not os.path.isdir(target) or _is_ours_step_dir(target)


def planned_save_steps(start_step: int, total_steps: int, save_freq: int) -> list[int]:
    """The steps fit() will checkpoint at (the same rule as RLTrainer.fit)."""
    return [
        s for s in range(start_step + 1, total_steps + 1)
        if (save_freq > 0 and s % save_freq == 0) or (s == total_steps and save_freq != 0)
    ]


def prepare_run_dir(run_dir: str, *, resume_mode: str, overwrite: bool, total_steps: int, save_freq: int,
                    check_only: bool = False) -> RunDirPlan:
    """Check `run_dir` before the first step; archive the old run when `overwrite` allows it. Raises RunDirError.
    check_only (``--dry-run``): the same checks, nothing created, moved or printed (`archived_to` is then the
    folder the old run *would* move to, without its time stamp).

    Starting afresh means resume_mode=disable, or resume_mode=auto with no checkpoint to resume from (a damaged one is
    a CheckpointError from CheckpointManager.latest, not a fresh start). Resuming from a checkpoint keeps the folder
    (rows after the checkpoint are rewound by the tracker).
    """
    if not check_only:
        os.makedirs(run_dir, exist_ok=True)
    ours, foreign = classify_entries(run_dir)
    if LATEST_FILE in foreign:
        raise RunDirError(
            f"{os.path.join(run_dir, LATEST_FILE)} was not written by hybridflow (it is not a step number, or it points "
            "at a global_step_N folder without hybridflow's COMPLETE marker, e.g. a veRL run); hybridflow would "
            "overwrite it. Choose another trainer.default_local_dir, or move the other tool's run out of the folder"
        )
    mgr = CheckpointManager(run_dir)
    resuming = False
    start_step = 0
    if resume_mode == "auto":
        latest = mgr.latest()  # CheckpointError if every checkpoint is damaged
        if latest is not None:
            resuming = True
            start_step = int(CheckpointManager.read_trainer_state(latest)["global_step"])
    elif resume_mode != "disable":
        resuming = True  # an explicit checkpoint: validated by CheckpointManager.resolve
        try:
            start_step = int(CheckpointManager.read_trainer_state(mgr.resolve(resume_mode))["global_step"])
        except (CheckpointError, KeyError, ValueError, TypeError):
            start_step = 0  # resolve() reports the problem with its own message when the trainer calls it
    archived_to = None
    history = [n for n in ours if not n.startswith((".tmp-", ".fault_injected_"))]
    rows = _count_rows(os.path.join(run_dir, "metrics.jsonl"))
    steps = [n for n in ours if STEP_DIR.match(n)]
    if not resuming and history and not rows and not steps and not _count_rows(os.path.join(run_dir, "samples.jsonl")):
        # what a run that stopped before its first step leaves (an empty metrics.jsonl, tracker folders): no history
        # to mix with, so the new run takes the folder as it is (nothing is moved or deleted)
        if not check_only:
            print(f"{run_dir}: the run that wrote it stopped before its first step (no metrics rows, samples or "
                  "checkpoints); this run starts in it", flush=True)
        history = []
    if not resuming and history:
        what = f"{rows} metrics rows" + (f", checkpoints {', '.join(steps)}" if steps else "")
        why = "trainer.resume_mode=disable" if resume_mode == "disable" else "there is no checkpoint to resume from"
        if not overwrite:
            raise RunDirError(
                f"{run_dir} already holds a run ({what}) and this one would start again at step 0 ({why}), mixing two "
                "histories in one folder. Resume it (trainer.resume_mode=auto, needs a checkpoint), choose another "
                "trainer.default_local_dir, or set trainer.overwrite=true to move the old run into an archive "
                "folder next to it"
            )
        if check_only:
            return RunDirPlan(f"{os.path.normpath(run_dir)}.archived-<time>", foreign, start_step)
        archived_to = _archive(run_dir, ours)
        print(f"trainer.overwrite=true: moved the previous run in {run_dir} ({what}) to {archived_to}", flush=True)
    if foreign:
        logger.warning(
            "%s holds entries hybridflow did not write; they are left untouched and never resumed from: %s",
            run_dir, ", ".join(foreign),
        )
        taken = {int(STEP_DIR.match(n).group(1)) for n in foreign if STEP_DIR.match(n)}
        clash = sorted(taken.intersection(planned_save_steps(start_step, total_steps, save_freq)))
        if clash:
            raise RunDirError(
                f"this run would save checkpoints into {', '.join(f'global_step_{s}' for s in clash)} in {run_dir}, "
                "but folders of those names exist and were not written by hybridflow (no COMPLETE marker); "
                "hybridflow never replaces them. Move them away or choose another trainer.default_local_dir"
            )
    return RunDirPlan(archived_to, foreign, start_step)


def _archive(run_dir: str, names: list[str]) -> str:
    """Move `names` from `run_dir` into a new sibling folder; returns its path. Renames only: nothing is deleted."""
    base = os.path.normpath(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = f"{base}.archived-{stamp}"
    k = 1
    while os.path.exists(dest):
        k += 1
        dest = f"{base}.archived-{stamp}-{k}"
    os.makedirs(dest)
    for name in names:
        shutil.move(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest
