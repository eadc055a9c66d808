"""A persistent pool of scoring processes with a per-sample timeout.

Why our own pool and not ``concurrent.futures``: a scorer that hangs must cost one sample, not the run, and a
ProcessPoolExecutor can neither time out one task nor kill the worker stuck in it. Here each worker gets a chunk of
samples and sends one result per sample as it goes; the driver restarts the clock on every result, so when a worker
has been silent for ``timeout_s`` the sample it is on is known. That worker is killed (SIGKILL), the sample is marked
``timeout``, a fresh worker is started, and the rest of its chunk is queued again.

Workers are plain ``python -c`` subprocesses talking over a socket pair (see ``_Worker`` for why not
multiprocessing). They stay alive between batches, so a batch of a few hundred cheap rule scores costs a few round
trips (milliseconds), not process start-ups.

Outcome kinds: ``ok`` (value = (score, extras)), ``raised``, ``timeout``, ``invalid`` (None, NaN, inf, a string, a
tuple, a dict without "score", ...), ``crashed`` (the worker process died, e.g. os._exit or a segfault).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import pickle
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["Outcome", "ScoringPool", "check_batch_values", "check_first_value", "check_value", "score_one"]

_MAX_MESSAGE = 300


@dataclass
class Outcome:
    kind: str  # ok | raised | timeout | invalid | crashed
    score: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)
    message: str = ""


def _as_float(value: Any) -> float | None:
    """bool/int/float/numpy scalars, and one-element numpy arrays or torch tensors -> float; else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and hasattr(value, "shape"):
        try:
            item = value.item()  # raises unless there is exactly one element
        except (ValueError, RuntimeError):
            return None
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def check_value(value: Any, task: dict[str, Any] | None = None) -> Outcome:
    """One score: a finite number, or a dict with a finite "score" (other keys become extras)."""
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return Outcome("invalid", message=f"returned a dict without 'score' (keys: {sorted(map(str, value))[:10]})")
        for k, v in value.items():
            if k != "score":
                f = _as_float(v)
                extras[str(k)] = f if f is not None else (v if isinstance(v, str) else repr(v)[:_MAX_MESSAGE])
        value = value["score"]
    if isinstance(value, (tuple, list)):
        return Outcome("invalid", message=f"returned a {type(value).__name__} of {len(value)} values; return one number")
    score = None if isinstance(value, (str, bytes)) else _as_float(value)
    if score is None:
        return Outcome("invalid", message=f"returned {type(value).__name__} {repr(value)[:80]}, not a number")
    if not math.isfinite(score):
        return Outcome("invalid", message=f"returned {score}")
    return Outcome("ok", score=score, extras=extras)


def check_first_value(value: Any, task: dict[str, Any] | None = None) -> Outcome:
    """veRL's prime manager: a tuple/list result counts by its first element (e.g. ``(score, details)``)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    return check_value(value)


def check_batch_values(value: Any, task: dict[str, Any]) -> Outcome:
    """A batch scorer's result: one score per row (``task["solution_strs"]``); each row checked as `check_value`.

    ok -> ``extras["rows"]`` holds one Outcome per row; a result of the wrong type or length is ``invalid``."""
    n = len(task["solution_strs"])
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # numpy arrays, tensors
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return Outcome("invalid", message=f"returned {type(value).__name__}, not a list of {n} scores (one per row)")
    if len(value) != n:
        return Outcome("invalid", message=f"returned {len(value)} scores for a batch of {n} rows; return one per row")
    return Outcome("ok", extras={"rows": [check_value(v) for v in value]})


def score_one(
    scorer: Callable[..., Any], task: dict[str, Any], check: Callable[..., Outcome] = check_value
) -> Outcome:
    """Call `scorer(**task)` and classify the result with `check`."""
    try:
        value = scorer(**task)
    except (Exception, SystemExit) as e:
        return Outcome("raised", message=f"{type(e).__name__}: {str(e)[:_MAX_MESSAGE]}")
    return check(value, task)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when the driver dies, even if a scorer is stuck in a sleep."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # without it a stuck worker outlives a killed driver until its scorer returns


def _worker_main(fd: int) -> None:
    """Entry point of a worker process: handshake, then score chunks until told to stop."""
    _die_with_parent()
    conn = Connection(fd)
    try:
        scorer, check = pickle.loads(conn.recv_bytes())
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, task in chunk:
            conn.send((index, score_one(scorer, task, check)))


class WorkerStartError(RuntimeError):
    """A scoring worker could not start or could not load the reward function."""


class _Worker:
    """One scoring process. Started with subprocess (not multiprocessing): spawn/forkserver would re-run the
    driver's ``__main__`` script in every worker, and forking a driver that runs Ray and torch threads is unsafe."""

    def __init__(self, scorer_blob: bytes) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from hybridflow.rewards.pool import _worker_main; _worker_main({child.fileno()})"],
            pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL,
        )
        child.close()
        self.conn = Connection(parent.detach())
        self.conn.send_bytes(scorer_blob)
        self.pending: deque[int] = deque()  # sample indices sent and not answered yet, in order
        self.since = 0.0  # when the sample at pending[0] started (last result or chunk send)
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            self.kill()
            raise WorkerStartError(f"a reward worker did not start within {timeout_s:g}s")
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            status, message = "error", f"the process exited with code {self.process.wait()}"
        if status != "ready":
            self.kill()
            raise WorkerStartError(f"a reward worker could not load the reward function: {message}")
        self.ready = True

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        self.conn.close()


class ScoringPool:
    """`num_workers` processes running `scorer(**task)`, results classified by `check` (a module-level function such
    as ``check_value``); see the module docstring for the timeout rule."""

    def __init__(
        self, scorer: Callable[..., Any], num_workers: int, timeout_s: float,
        check: Callable[..., Outcome] = check_value,
    ) -> None:
        try:
            self._blob = pickle.dumps((scorer, check))
        except Exception as e:
            raise ValueError(
                f"the reward function {scorer!r} cannot be pickled ({e}), so worker processes cannot receive it; "
                "define it at module level or load it with load_custom_reward_fn('file.py:fn')"
            ) from e
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.restarts = 0
        self.start_timeout_s = 60.0
        # Start now, wait at the first batch: the start-up overlaps with whatever the caller does meanwhile.
        self._workers = [_Worker(self._blob) for _ in range(num_workers)]

    def _ensure_workers(self) -> None:
        alive = [w for w in self._workers if w.alive()]
        self._workers = alive + [_Worker(self._blob) for _ in range(self.num_workers - len(alive))]
        for w in self._workers:  # started together, so their start-ups overlap
            w.wait_ready(self.start_timeout_s)

    def score(self, tasks: list[dict[str, Any]]) -> list[Outcome]:
        """One Outcome per task, in order."""
        results: list[Outcome | None] = [None] * len(tasks)
        queue = deque(range(len(tasks)))
        # four chunks a worker balance the workers' loads; one worker gets the batch as one chunk (each chunk
        # boundary is a round trip in which it waits)
        chunks = 4 * self.num_workers if self.num_workers > 1 else 1
        chunk_size = max(1, min(64, math.ceil(len(tasks) / chunks)))
        self._ensure_workers()
        remaining = len(tasks)
        while remaining:
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if not w.pending and queue:
                    chunk = [queue.popleft() for _ in range(min(chunk_size, len(queue)))]
                    try:
                        w.conn.send([(i, tasks[i]) for i in chunk])
                    except OSError:  # died while idle (e.g. OOM-killed between batches): no sample to blame
                        queue.extendleft(reversed(chunk))
                        w.kill()
                        self._workers[slot] = fresh = _Worker(self._blob)
                        fresh.wait_ready(self.start_timeout_s)
                        self.restarts += 1
                        continue
                    w.pending.extend(chunk)
                    w.since = now
            busy = [w for w in self._workers if w.pending]
            deadline = min(w.since for w in busy) + self.timeout_s
            ready = wait([w.conn for w in busy], timeout=max(0.0, deadline - time.monotonic()))
            for w in busy:
                if w.conn in ready:
                    remaining -= self._drain(w, results, queue)
            now = time.monotonic()
            for w in list(self._workers):
                dead = w.pending and not w.alive() and w.conn not in ready
                if w.pending and (now - w.since >= self.timeout_s or dead):
                    kind = "crashed" if dead else "timeout"
                    message = (
                        f"the worker process died (exit code {w.process.poll()})" if dead
                        else f"no result after {self.timeout_s:g}s; the worker was killed"
                    )
                    remaining -= self._replace(w, results, kind, message, queue)
        return [r for r in results if r is not None]

    def _drain(self, w: _Worker, results: list[Outcome | None], queue: deque[int]) -> int:
        done = 0
        try:
            while w.conn.poll():
                index, outcome = w.conn.recv()
                w.pending.remove(index)
                results[index] = outcome
                w.since = time.monotonic()
                done += 1
        except (EOFError, OSError):
            if w.pending:  # the process died mid-sample: that sample is the culprit
                message = f"the worker process died (exit code {w.process.wait()})"
                done += self._replace(w, results, "crashed", message, queue)
        return done

    def _replace(
        self, w: _Worker, results: list[Outcome | None], kind: str, message: str, queue: deque[int]
    ) -> int:
        """Fail the sample `w` is on, requeue the rest of its chunk, and start a fresh worker in its place."""
        w.kill()
        culprit = w.pending.popleft()
        results[culprit] = Outcome(kind, message=message)
        queue.extendleft(reversed(w.pending))
        w.pending.clear()
        fresh = _Worker(self._blob)
        fresh.wait_ready(self.start_timeout_s)
        self._workers[self._workers.index(w)] = fresh
        self.restarts += 1
        return 1

    def close(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError, BrokenPipeError):
                w.conn.send(None)
        for w in self._workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.process.wait(timeout=2)
            w.kill()
        self._workers = []
