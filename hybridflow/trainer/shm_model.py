"""veRL's ``actor_rollout_ref.model.use_shm``: load the model from a copy in shared memory (``/dev/shm``).

Every engine of a run (actor, reference, rollout, critic without a path of its own) reads the checkpoint at start and
again on each restart; from a slow or network disk that is the start-up time. With use_shm=true the driver copies the
model folder once into a fresh folder under /dev/shm (RAM-backed, visible to every process of the node) before any
worker starts, points actor_rollout_ref.model.path at the copy, and removes that folder when the run ends, however
it ends. Only the folder this run created is removed (a uniquely named mkdtemp folder, holding a marker file);
nothing else under /dev/shm is touched. The copy lives on the driver's node, so the run's ranks must be there too
(trainer.nnodes=1; several nodes: leave use_shm off).

When /dev/shm cannot hold the folder (a margin is kept for the processes' own shared memory: torch, Ray's object
store), the run stops before the copy with both sizes and what to do.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

KEY = "actor_rollout_ref.model.use_shm"
SHM_ROOT = os.environ.get("HYBRIDFLOW_SHM_DIR", "/dev/shm")  # the tests may point it at another tmpfs folder
MARKER = ".hybridflow-shm-copy"
MARGIN_BYTES = 256 * 2**20  # left free for torch / Ray shared memory


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def folder_bytes(path: str) -> int:
    """Bytes of every file under `path` (links followed: a model folder of links to a cache holds the blobs)."""
    total = 0
    for root, _, files in os.walk(path, followlinks=True):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_size
    return total


def shm_config_errors(cfg: Any) -> list[str]:
    """Why use_shm cannot work for this config (folders and sizes are checked here too, before any copy)."""
    t, arr = cfg.trainer, cfg.actor_rollout_ref
    errors = []
    if t.nnodes > 1 or (not arr.hybrid_engine and arr.rollout.nnodes > 1):
        errors.append(f"{KEY}=true copies the model into the driver node's /dev/shm, which ranks on other nodes do "
                      "not see; with several nodes leave use_shm off")
    path = arr.model.path
    if path and not os.path.isdir(path):
        errors.append(f"{KEY}=true copies a local model folder, but actor_rollout_ref.model.path={path!r} is not one")
    elif path and (problem := _space_problem(path)):
        errors.append(problem)
    return errors


def _space_problem(path: str) -> str | None:
    if not os.path.isdir(SHM_ROOT):
        return f"{KEY}=true: {SHM_ROOT} does not exist on this machine (no shared-memory filesystem); drop the key"
    need = folder_bytes(path)
    free = shutil.disk_usage(SHM_ROOT).free
    if need + MARGIN_BYTES > free:
        return (f"{KEY}=true: the model folder {path} needs {_gib(need)} but {SHM_ROOT} has {_gib(free)} free "
                f"(keeping {_gib(MARGIN_BYTES)} for shared memory); free /dev/shm (or enlarge it, e.g. docker "
                "--shm-size), or drop the key and load from disk")
    return None


class ShmModelCopy:
    """A context manager: the model folder copied under SHM_ROOT on entry (its path returned), removed on exit."""

    def __init__(self, model_path: str):
        self.source = os.path.abspath(model_path)
        self.folder: str | None = None

    def __enter__(self) -> str:
        if problem := _space_problem(self.source):
            raise RuntimeError(problem)
        self.folder = tempfile.mkdtemp(prefix="hybridflow-model-", dir=SHM_ROOT)
        atexit.register(self.remove)  # also when the driver exits before the run's own cleanup (an error at start)
        try:
            open(os.path.join(self.folder, MARKER), "w").close()
            target = os.path.join(self.folder, os.path.basename(self.source.rstrip(os.sep)) or "model")
            shutil.copytree(self.source, target, symlinks=False)  # links resolved: the blobs themselves in RAM
        except BaseException:
            self.remove()
            raise
        logger.warning("use_shm: %s copied to %s (%s)", self.source, target, _gib(folder_bytes(target)))
        return target

    def remove(self) -> None:
        """Delete the folder this object created (only when it still holds the marker it wrote)."""
        if self.folder and os.path.exists(os.path.join(self.folder, MARKER)):
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def __exit__(self, *exc) -> None:
        self.remove()


def apply_use_shm(cfg: Any, stack) -> None:
    """With use_shm, copy actor_rollout_ref.model.path into shared memory and point the actor, reference and rollout
    at the copy (a critic without a path of its own, the actor's model, loads the copy too). stack: a contextlib.ExitStack that
    removes the copy when the run ends."""
    model = cfg.actor_rollout_ref.model
    if not model.use_shm:
        return
    model.path = stack.enter_context(ShmModelCopy(model.path))
