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


def wait_for(
    refs: Sequence[Any],
    ranks: Sequence[int],
    *,
    group: str,
    method: str,
    timeout_s: float | None,
    rank_info: Sequence[dict] | None = None,
) -> list[Any]:
    """ray.get `refs` (one per rank in `ranks`), raising WorkerGroupError on the first failure or at the timeout.

    Waiting with ray.wait instead of one ray.get means a rank that died surfaces at once, even while its peers are
    blocked in a collective waiting for it.
    """
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

    rank_of = {ref: r for ref, r in zip(refs, ranks)}
    results: dict[Any, Any] = {}
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            late = sorted(rank_of[r] for r in pending)
            raise WorkerGroupError(
                f"{group}.{method} did not finish within {timeout_s:.1f} s on "
                f"{', '.join(where(rank_info, r) for r in late)}. The rank(s) may hang in a collective or be stuck; "
                f"raise call_timeout_s if the work is just slow. The group is unusable now: call shutdown().",
                group=group,
                method=method,
                rank=late[0] if len(late) == 1 else None,
                kind="timeout",
            )
        for ref in ready:
            rank = rank_of[ref]
            info = rank_info[rank] if rank_info and rank < len(rank_info) else {}
            try:
                results[ref] = ray.get(ref)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as e:
                if isinstance(e, RayTaskError):  # a RayTaskError can wrap an actor error raised inside the method
                    raise _raised(e, group, method, rank, rank_info) from e
                raise WorkerGroupError(
                    f"{group}.{method} failed: the worker process of {where(rank_info, rank)} died "
                    f"({type(e).__name__}: {_first_line(e)}). Check that rank's log for an out-of-memory kill or a "
                    "crash; the group is unusable now: call shutdown() and build a new one.",
                    group=group,
                    method=method,
                    rank=rank,
                    node_ip=info.get("node_ip"),
                    pid=info.get("pid"),
                    kind="died",
                ) from e
            except (RayTaskError, GetTimeoutError) as e:
                raise _raised(e, group, method, rank, rank_info) from e
            except Exception as e:  # e.g. RaySystemError: the result could not be deserialised here
                raise _raised(e, group, method, rank, rank_info) from e
    return [results[r] for r in refs]


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
