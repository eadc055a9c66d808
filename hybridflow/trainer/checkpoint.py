"""Atomic checkpoint folders: write into a temporary folder, fsync, rename, and move the "latest" pointer last.

Layout of ``<default_local_dir>``::

    global_step_12/            one finished checkpoint (actor/, critic/, trainer_state.json, COMPLETE)
    latest_checkpointed_iteration.txt   the step of the newest complete checkpoint (written last, atomically)

A crash at any point leaves either the previous checkpoint or the new one complete and pointed to; half-written
folders keep a ``.tmp-`` prefix and are removed at the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message names the folder."""


def _fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        """Finish a save: trainer state + marker, fsync, rename into place, then move the latest pointer."""
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(trainer_state, f, indent=1, sort_keys=True)
        with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
            f.write(str(step))
        _fsync_tree(tmp)
        final = os.path.join(self.root, f"global_step_{step}")
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
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

    def latest(self) -> str | None:
        """The newest complete checkpoint folder (the pointer if valid, else the newest complete folder)."""
        pointer = os.path.join(self.root, LATEST_FILE)
        if os.path.exists(pointer):
            with open(pointer) as f:
                text = f.read().strip()
            path = os.path.join(self.root, f"global_step_{text}")
            if text.isdigit() and os.path.exists(os.path.join(path, COMPLETE_MARKER)):
                return path
        steps = self._complete_steps()
        return os.path.join(self.root, f"global_step_{steps[-1]}") if steps else None

    @staticmethod
    def read_trainer_state(path: str) -> dict[str, Any]:
        if not os.path.exists(os.path.join(path, COMPLETE_MARKER)):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker): it was cut off")
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
