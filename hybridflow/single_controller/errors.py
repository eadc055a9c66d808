"""WorkerGroupError and the wait loop that turns Ray failures into errors naming the group, the method and the rank."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the remote traceback header


class WorkerGroupError(RuntimeError):
    """A group call failed: a rank raised, died, or did not answer within the call timeout.

    Attributes: ``group``, ``method``, ``rank`` (None when several), ``node_ip``, ``pid``, ``kind``
    ("raised" | "died" | "timeout" | "startup").
    """

    def __init__(
        self,
        message: str,
        *,
        group: str,
        method: str,
        rank: int | None = None,
        node_ip: str | None = None,
        pid: int | None = None,
        kind: str = "raised",
    ) -> None:
        super().__init__(message)
        self.group, self.method, self.rank, self.node_ip, self.pid, self.kind = group, method, rank, node_ip, pid, kind


def where(rank_info: Sequence[dict] | None, rank: int) -> str:
    """'rank 1 (node 10.0.0.2, pid 4242)' -- as much as is known about that rank."""
    info = rank_info[rank] if rank_info and rank < len(rank_info) else {}
    parts = []
    if info.get("node_ip"):
        parts.append(f"node {info['node_ip']}")
    if info.get("pid"):
        parts.append(f"pid {info['pid']}")
    return f"rank {rank}" + (f" ({', '.join(parts)})" if parts else "")


# How long a failed call waits for the other ranks' outcomes before it decides what happened (see wait_for).
SETTLE_S = 20.0

# A rank whose collective or input fetch fails with one of these lost a peer: its error is the echo of a death.
PEER_LOST_PATTERNS = (
    "Connection reset by peer",  # gloo, the peer's socket vanished mid-transfer
    "Connection closed by peer",  # gloo
    "Broken pipe",
    "ncclRemoteError",  # NCCL: a remote rank failed
    "NCCL communicator was aborted",
    "ActorDiedError",  # a FutureChunk fetched from a producer rank that died
)


def lost_a_peer(text: str) -> bool:
    """Whether an error message is a collective (or fetch) failing because another process died."""
    return any(p in text for p in PEER_LOST_PATTERNS)


def wait_for(
    refs: Sequence[Any],
    ranks: Sequence[int],
    *,
    group: str,
    method: str,
    timeout_s: float | None,
    rank_info: Sequence[dict] | None = None,
    settle_s: float | None = None,
) -> list[Any]:
    """ray.get `refs` (one per rank in `ranks`), raising WorkerGroupError on a failure or at the timeout.

    Waiting with ray.wait instead of one ray.get means a rank that died surfaces at once, even while its peers are
    blocked in a collective waiting for it. A rank that *raised* is not judged alone: when a peer is SIGKILLed, the
    survivors' gloo collectives often fail ("Connection reset by peer") before Ray reports the death. So after the
    first raise the other ranks get up to `settle_s` seconds (default SETTLE_S) to report; the failure is a death (kind "died",
    restartable) if any rank died or the raise reads as a lost peer (PEER_LOST_PATTERNS), else kind "raised".
    """
    import ray
    from ray.exceptions import GetTimeoutError

    settle_s = SETTLE_S if settle_s is None else settle_s
    rank_of = {ref: r for ref, r in zip(refs, ranks)}
    results: dict[Any, Any] = {}
    raised: list[tuple[WorkerGroupError, BaseException]] = []  # (error, cause) per rank that raised, in order seen
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settle_deadline: float | None = None
    while pending:
        if settle_deadline is not None:  # settling: a bounded wait for the other ranks' outcomes
            remaining = max(0.0, settle_deadline - time.monotonic())
        else:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            if raised:
                break
            late = sorted(rank_of[r] for r in pending)
            raise WorkerGroupError(
                f"{group}.{method} did not finish within {timeout_s:.1f} s on "
                f"{', '.join(where(rank_info, r) for r in late)}. The rank(s) may hang in a collective or be stuck; "
                f"raise the group's call_timeout_s (trainer.call_timeout_s in `hybridflow train`) if the work is just slow. The group is unusable now: call shutdown().",
                group=group,
                method=method,
                rank=late[0] if len(late) == 1 else None,
                kind="timeout",
            )
        for ref in ready:
            rank = rank_of[ref]
            try:
                results[ref] = ray.get(ref)
            except GetTimeoutError as e:
                raised.append((_raised(e, group, method, rank, rank_info), e))
            except Exception as e:
                err = _classify(e, group, method, rank, rank_info)
                if err.kind == "died":
                    if raised:  # the earlier raises were this death's echo: say so
                        err.args = (f"{err.args[0]}\n(also: {_echoes(raised)})",)
                    raise err from e
                raised.append((err, e))
        if raised and settle_deadline is None:
            settle_deadline = time.monotonic() + settle_s
    if raised:
        first, cause = raised[0]
        peer_lost = [err for err, _ in raised if lost_a_peer(str(err))]
        if peer_lost:
            err = peer_lost[0]
            raise WorkerGroupError(
                f"{group}.{method} failed: {where(rank_info, err.rank)} lost a peer (a collective or an input fetch "
                "failed because another process went away); counted as a worker death. The group is unusable now: "
                f"call shutdown() and build a new one.\n{err}",
                group=group,
                method=method,
                rank=err.rank,
                node_ip=err.node_ip,
                pid=err.pid,
                kind="died",
            ) from cause
        raise first from cause
    return [results[r] for r in refs]


def _classify(e: Exception, group: str, method: str, rank: int, rank_info: Sequence[dict] | None) -> WorkerGroupError:
    """A failed ray.get of one rank's result -> WorkerGroupError of kind "died" (the process is gone) or "raised"."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

    if isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError)) and not isinstance(e, RayTaskError):
        info = rank_info[rank] if rank_info and rank < len(rank_info) else {}
        return WorkerGroupError(
            f"{group}.{method} failed: the worker process of {where(rank_info, rank)} died "
            f"({type(e).__name__}: {_first_line(e)}). Check that rank's log for an out-of-memory kill or a "
            "crash; the group is unusable now: call shutdown() and build a new one.",
            group=group,
            method=method,
            rank=rank,
            node_ip=info.get("node_ip"),
            pid=info.get("pid"),
            kind="died",
        )
    # RayTaskError (the method raised; it can also wrap an actor error raised inside the method), or e.g.
    # RaySystemError: the result could not be deserialised here.
    return _raised(e, group, method, rank, rank_info)


def _echoes(raised: list[tuple[WorkerGroupError, BaseException]]) -> str:
    return "; ".join(f"rank {err.rank} raised {_last_line(cause)[:200]}" for err, cause in raised)


def _last_line(e: BaseException) -> str:
    lines = [ln for ln in _ANSI.sub("", str(e)).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_IMPORT_HINT = (
    "\nHint: Ray workers import the worker class (and anything pickled by reference) by module name. Make its module "
    "importable there (an installed package), or ship it by value: ray.cloudpickle.register_pickle_by_value(module)."
)


def _raised(e: Exception, group: str, method: str, rank: int, rank_info: Sequence[dict] | None) -> WorkerGroupError:
    info = rank_info[rank] if rank_info and rank < len(rank_info) else {}
    text = _ANSI.sub("", str(e))
    hint = _IMPORT_HINT if "No module named" in text else ""
    return WorkerGroupError(
        f"{group}.{method} raised on {where(rank_info, rank)}:\n{text}{hint}",
        group=group,
        method=method,
        rank=rank,
        node_ip=info.get("node_ip"),
        pid=info.get("pid"),
        kind="raised",
    )
