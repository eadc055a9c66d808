"""Atomic checkpoint folders: write into a temporary folder, fsync, rename, and move the "latest" pointer last.

Layout of ``<default_local_dir>``::

    global_step_12/            one finished checkpoint (actor/, critic/, trainer_state.json, MANIFEST.json, COMPLETE)
    latest_checkpointed_iteration.txt   the step of the newest complete checkpoint (written last, atomically)

A crash at any point leaves either the previous checkpoint or the new one complete and pointed to; half-written
folders keep a ``.tmp-`` prefix and are removed at the next save (or at once when the save itself fails, e.g. on a
full disk, so the space comes back).

``MANIFEST.json`` records every file's size at commit time. ``latest()`` skips a folder whose files no longer match it
(a weights file cut short by a copy, a quota or a bad disk) and falls back to the newest older checkpoint that does,
with a warning; a checkpoint named explicitly (``trainer.resume_mode=<path>``) fails with a CheckpointError naming
the file. Sizes catch truncation, not bit flips: hashing every file at each resume would cost a full read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from typing import Any

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_FILE = "MANIFEST.json"
STEP_DIR = re.compile(r"^global_step_(\d+)$")

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the folder."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")  # the rename itself must survive a power cut


def _file_sizes(path: str) -> dict[str, int]:
    """{path relative to `path`: size in bytes} of every file below `path`, except the marker and the manifest."""
    sizes = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel not in (COMPLETE_MARKER, MANIFEST_FILE):
                sizes[rel] = os.path.getsize(full)
    return sizes


class CheckpointManager:
    def __init__(self, root: str, max_to_keep: int | None = 2):
        self.root = root
        self.max_to_keep = max_to_keep

    def staging_dir(self, step: int) -> str:
        """A fresh temporary folder for the workers to write step `step` into."""
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):  # leftovers of a save that crashed
            if name.startswith(".tmp-"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        tmp = os.path.join(self.root, f".tmp-global_step_{step}")
        os.makedirs(tmp)
        return tmp

    def commit(self, tmp: str, step: int, trainer_state: dict[str, Any]) -> str:
        """Finish a save: trainer state, manifest + marker, fsync, rename into place, then move the latest pointer.

        If anything fails before the rename (ENOSPC, EIO), the staging folder is removed and the error re-raised:
        the previous checkpoint and the pointer are untouched.
        """
        try:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(trainer_state, f, indent=1, sort_keys=True)
            with open(os.path.join(tmp, MANIFEST_FILE), "w") as f:
                json.dump({"step": step, "files": _file_sizes(tmp)}, f, indent=1, sort_keys=True)
            with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
                f.write(str(step))
            _fsync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # on a full disk, give the space back at once
            raise
        final = os.path.join(self.root, f"global_step_{step}")
        if os.path.exists(final):
            if not os.path.exists(os.path.join(final, COMPLETE_MARKER)):
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(
                    f"{final} exists and was not written by hybridflow (no {COMPLETE_MARKER} marker; e.g. a veRL "
                    "checkpoint); it is left untouched and this save is refused. Move it away or choose another "
                    "trainer.default_local_dir"
                )
            shutil.rmtree(final)  # our own older save of the same step (a rerun after a restart)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        _atomic_write_text(os.path.join(self.root, LATEST_FILE), str(step))
        self._prune()
        return final

    def _complete_steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = STEP_DIR.match(name)
            if m and os.path.exists(os.path.join(self.root, name, COMPLETE_MARKER)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _prune(self) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        for step in self._complete_steps()[: -self.max_to_keep]:
            shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)

    @staticmethod
    def verify(path: str) -> str | None:
        """None if `path` is a complete checkpoint whose files match its manifest, else what is wrong with it."""
        if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
            if os.path.exists(os.path.join(path, LATEST_FILE)) or any(
                STEP_DIR.match(n) for n in (os.listdir(path) if os.path.isdir(path) else [])
            ):
                return (
                    f"{path} is a run folder, not a checkpoint: name one of its global_step_N folders, or set "
                    f"trainer.default_local_dir={path} trainer.resume_mode=auto to take its newest checkpoint"
                )
            return f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker): it was cut off or is not one"
        manifest = os.path.join(path, MANIFEST_FILE)
        if not os.path.exists(manifest):
            return None  # written before manifests existed: only the marker can be checked
        try:
            with open(manifest) as f:
                recorded = json.load(f)["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{manifest} is unreadable ({e}); the checkpoint is corrupt"
        for rel, size in sorted(recorded.items()):
            full = os.path.join(path, rel)
            if not os.path.exists(full):
                return f"{full} is missing (the manifest lists it); the checkpoint is incomplete"
            actual = os.path.getsize(full)
            if actual != size:
                return f"{full} is {actual} bytes but {size} were written: the file was truncated or changed"
        return None

    def latest(self) -> str | None:
        """The newest usable checkpoint folder: the pointer's if it verifies, else the newest complete folder that
        does (each one skipped is logged with the reason); None if there is none."""
        candidates: list[str] = []
        pointer = os.path.join(self.root, LATEST_FILE)
        if os.path.exists(pointer):
            text = self._read_pointer(pointer)
            candidates.append(os.path.join(self.root, f"global_step_{text}"))
        candidates += [os.path.join(self.root, f"global_step_{s}") for s in reversed(self._complete_steps())]
        seen: set[str] = set()
        damaged: list[str] = []
        for path in candidates:
            if path in seen or not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
                continue
            seen.add(path)
            problem = self.verify(path)
            if problem is None:
                return path
            damaged.append(problem)
            logger.warning("skipping checkpoint %s: %s; trying an older one", path, problem)
        if damaged:
            # Starting at step 0 beside the old run's rows would mix two histories and hide the damage.
            raise CheckpointError(
                f"every checkpoint in {self.root} is damaged, so there is nothing to resume from:\n  - "
                + "\n  - ".join(damaged)
                + "\nRestore them from a copy, name an intact checkpoint elsewhere (trainer.resume_mode=<path>), or "
                "start afresh with trainer.resume_mode=disable trainer.overwrite=true (the old run is archived)"
            )
        return None

    @staticmethod
    def _read_pointer(pointer: str) -> str:
        """The step number in the latest pointer; CheckpointError naming the file if it holds anything else."""
        try:
            with open(pointer, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise CheckpointError(f"{pointer} is unreadable ({e})") from e
        text = raw.decode("ascii", errors="replace").strip()
        if not text.isdigit():
            raise CheckpointError(
                f"{pointer} should hold the step of the newest checkpoint but holds {raw[:40]!r}: it is damaged or "
                "not hybridflow's. Delete it (resume then takes the newest intact global_step_N folder), or start "
                "afresh with trainer.resume_mode=disable"
            )
        return text

    @classmethod
    def read_trainer_state(cls, path: str) -> dict[str, Any]:
        problem = cls.verify(path)
        if problem is not None:
            raise CheckpointError(
                f"{problem}. Resume from another checkpoint (trainer.resume_mode=auto takes the newest intact one) "
                "or start afresh (trainer.resume_mode=disable)"
            )
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}/trainer_state.json is unreadable ({e}); the checkpoint is corrupt") from e

    def resolve(self, resume_mode: str) -> str | None:
        """auto -> latest complete checkpoint or None; disable -> None; a path -> that checkpoint (validated)."""
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest()
        path = os.path.abspath(os.path.expanduser(resume_mode))
        if not os.path.isdir(path):
            raise CheckpointError(
                f"trainer.resume_mode={resume_mode!r} is neither auto, disable nor an existing checkpoint folder"
            )
        self.read_trainer_state(path)
        return path
