"""WorkerHost: what runs in one rank's process -- it builds the role instances and runs the calls sent to them.

On the Ray backend every rank is one Ray actor whose class is WorkerHost; colocated roles are several instances in
the same host. The local backend uses the same class in the driver process, so both backends share this code path:
resolving future chunks, calling the method, removing padding rows.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow import device
from hybridflow.common.ports import hold_free_port, release_held_port
from hybridflow.protocol import DataProto
from hybridflow.single_controller.future import FutureChunk
from hybridflow.single_controller.worker import _CONSTRUCTION_CONTEXT, Worker, WorkerContext


@dataclass
class ClassWithInitArgs:
    """A worker class plus its constructor arguments; the group builds it inside each rank's process."""

    cls: type
    args: tuple = ()
    kwargs: dict | None = None

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self) -> Any:
        return self.cls(*self.args, **(self.kwargs or {}))


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - best effort for error messages
        pass
    return "127.0.0.1"


class WorkerHost:
    """One rank's process. Methods are called by WorkerGroup only."""

    def __init__(self) -> None:
        self._roles: dict[str, Worker] = {}
        self._held_port: tuple[str, int] | None = None

    def node_info(self, pick_port: bool, master_addr: str | None = None) -> dict:
        """Where this process runs; with `pick_port`, a rendezvous port held on `master_addr` (default: this node's
        address) until rank 0's init_distributed starts the store on it."""
        node_ip = _node_ip()
        port = None
        if pick_port:
            port = hold_free_port(master_addr or node_ip)
            self._held_port = (master_addr or node_ip, port)
        return {"node_ip": node_ip, "hostname": socket.gethostname(), "pid": os.getpid(), "port": port}

    def init_roles(self, ctx: WorkerContext, roles: dict[str, ClassWithInitArgs], in_driver: bool) -> None:
        """Build each role's worker with `ctx` visible to Worker.__init__ (env vars in a Ray actor)."""
        if not in_driver:
            os.environ.update(ctx.to_env())
            if ctx.num_threads:
                os.environ["OMP_NUM_THREADS"] = str(ctx.num_threads)
                device.set_num_threads(ctx.num_threads)
        token = _CONSTRUCTION_CONTEXT.set(ctx)
        try:
            for role, spec in roles.items():
                if not (isinstance(spec.cls, type) and issubclass(spec.cls, Worker)):
                    raise TypeError(
                        f"role {role!r}: {spec.cls!r} must be a subclass of hybridflow.single_controller.Worker"
                    )
                instance = spec.build()
                if not hasattr(instance, "_context"):
                    raise TypeError(f"{spec.cls.__name__}.__init__ must call super().__init__() (role {role!r})")
                self._roles[role] = instance
        finally:
            _CONSTRUCTION_CONTEXT.reset(token)

    def close(self) -> None:
        """Release what the roles hold in this process (used by the local backend, whose process is the driver)."""
        for worker in self._roles.values():
            worker.destroy_distributed()
        self._roles.clear()
        if self._held_port is not None:
            release_held_port(*self._held_port)

    def dp_mesh(self, role: str, mesh_name: str):
        return self._roles[role].get_dp_mesh(mesh_name)

    def call(self, role: str, method: str, args: tuple, kwargs: dict, pad_rows: int = 0) -> Any:
        """Run role.method(*args, **kwargs); drop `pad_rows` trailing padding rows (scaled) from a DataProto output."""
        args, kwargs, future_pad = _resolve_future_chunks(args, kwargs)
        if future_pad is not None:
            pad_rows = future_pad
        fn: Callable = getattr(self._roles[role], method)
        out = fn(*args, **kwargs)
        if pad_rows and isinstance(out, DataProto):
            out = _remove_padding(out, args, kwargs, pad_rows, f"{type(self._roles[role]).__name__}.{method}")
        return out

    def call_with_len(self, role: str, method: str, args: tuple, kwargs: dict, pad_rows: int = 0) -> tuple:
        """Like call, plus the output's row count (None for non-DataProto) as a separate, tiny object."""
        out = self.call(role, method, args, kwargs, pad_rows)
        return (len(out) if isinstance(out, DataProto) else None), out


def _resolve_future_chunks(args: tuple, kwargs: dict) -> tuple[tuple, dict, int | None]:
    pads: set[int] = set()

    def fetch(v: Any) -> Any:
        if isinstance(v, FutureChunk):
            data, pad = v.resolve()
            pads.add(pad)
            return data
        return v

    args = tuple(fetch(a) for a in args)
    kwargs = {k: fetch(v) for k, v in kwargs.items()}
    if len(pads) > 1:
        raise ValueError(
            f"input futures of one call produced different padding {sorted(pads)}; pass equal-length batches"
        )
    return args, kwargs, (pads.pop() if pads else None)


def _remove_padding(out: DataProto, args: tuple, kwargs: dict, pad_rows: int, where: str) -> DataProto:
    inputs = [v for v in [*args, *kwargs.values()] if isinstance(v, DataProto)]
    in_rows = len(inputs[0]) if inputs else 0
    if in_rows == 0 or len(out) % in_rows:
        raise ValueError(
            f"{where} returned {len(out)} rows for {in_rows} input rows, {pad_rows} of which are padding added to "
            "split the batch evenly; the padding can only be removed when the output has k rows per input row "
            "(row i*k+j for input row i). Make the batch size divisible by the data-parallel size instead."
        )
    per_row = len(out) // in_rows
    return out[: len(out) - pad_rows * per_row]
