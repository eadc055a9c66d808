"""`@register` and the dispatch modes: how one driver call becomes one call per rank, and how results come back.

A dispatch mode is a pair of functions:

  dispatch_fn(group, *args, **kwargs) -> Dispatched   the arguments each rank receives
  collect_fn(group, outputs) -> result                 outputs: what the *collecting* ranks returned, in order

Built-in modes (``Dispatch``):

  ONE_TO_ALL        every rank gets the same arguments; result: list of per-rank outputs.
  ALL_TO_ALL        arguments passed through unchanged to every rank; result: the raw list of per-rank outputs.
  DP_COMPUTE        every argument is a list with one entry per rank; rank i gets entry i; result: list.
  DP_COMPUTE_PROTO  every DataProto (or DataProtoFuture) argument is padded to a multiple of the data-parallel size
                    and chunked, rank i gets chunk i (other arguments go to every rank unchanged); the padding rows are
                    removed again on the worker, so the result is the concat of the collectors' outputs with exactly
                    as many rows per input row as the method produced (a method returning k rows per input row, like
                    generation with n=k samples laid out as row i*k+j, is unpadded by k rows per padding row).
  DP_COMPUTE_METRIC like DP_COMPUTE_PROTO on the way in; result: the list of collector outputs (one per dp rank,
                    e.g. metric dicts). Padding rows are seen by the method and not removed from metrics.

Mesh-aware data parallelism: by default the data-parallel size is the world size. A worker that runs tensor or
sequence parallelism declares its position with ``self.register_dp_mesh(mesh_name, dp_rank, dp_size, is_collector)``
(typically in ``init_model``), and a method registered with ``register(Dispatch.DP_COMPUTE_PROTO, mesh_name="actor")``
(or, equivalently, ``register(make_nd_compute_dataproto_dispatch_fn("actor"))``) then sends chunk ``dp_rank`` to
every rank, so tensor-parallel peers get the same chunk, and gathers only from collectors, in dp-rank order.

Execute modes (``Execute``):

  ALL             every rank runs the method (the normal SPMD case).
  RANK_ZERO       every rank runs the method -- SPMD code must, or its collectives would hang -- and the caller gets
                  rank 0's return value alone (not a list). NB: in veRL, RANK_ZERO runs rank 0 only; that is
                  RANK_ZERO_ONLY here.
  RANK_ZERO_ONLY  only rank 0 runs the method (one-off side effects: write a file, print); its return value.

Users add modes with ``register_dispatch_mode(name, dispatch_fn, collect_fn)`` and then use
``register(dispatch_mode=name)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow.protocol import DataProto

if TYPE_CHECKING:  # pragma: no cover
    from hybridflow.single_controller.worker_group import WorkerGroup

REGISTER_ATTR = "_hybridflow_register"


class Dispatch(str, enum.Enum):
    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"


class Execute(str, enum.Enum):
    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"
    RANK_ZERO_ONLY = "RANK_ZERO_ONLY"


@dataclass
class Dispatched:
    """What each rank receives. ``pad_rows[i]``: trailing padding rows in rank i's DataProto chunk (removed from
    its output by the worker). ``collectors``: the ranks whose outputs are gathered, in collection order (None: all).
    ``future_ok``: the outputs concatenate into one DataProto, so a non-blocking call may hand them on chunk-wise."""

    args: list[tuple]
    kwargs: list[dict]
    pad_rows: list[int] | None = None
    collectors: list[int] | None = None
    future_ok: bool = False


@dataclass(frozen=True)
class DispatchMode:
    """A named (dispatch_fn, collect_fn) pair; see the module docstring for the two signatures."""

    name: str
    dispatch_fn: Callable[..., Any]
    collect_fn: Callable[..., Any]


@dataclass(frozen=True)
class RegisterSpec:
    """What `@register` attached to a worker method."""

    mode: DispatchMode
    execute_mode: Execute
    blocking: bool


# ---------------------------------------------------------------------------------------------- built-in modes
def _world(group: WorkerGroup) -> int:
    return group.world_size


def dispatch_one_to_all(group: WorkerGroup, *args: Any, **kwargs: Any) -> Dispatched:
    n = _world(group)
    return Dispatched([args] * n, [kwargs] * n)


def collect_list(group: WorkerGroup, outputs: list[Any]) -> list[Any]:
    return list(outputs)


def dispatch_dp_compute(group: WorkerGroup, *args: Any, **kwargs: Any) -> Dispatched:
    n = _world(group)
    named = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"keyword {k!r}", v) for k, v in kwargs.items()]
    for where, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise TypeError(
                f"DP_COMPUTE needs every argument to be a list with one entry per rank ({n}); {where} is "
                f"{type(value).__name__}{f' of length {len(value)}' if isinstance(value, (list, tuple)) else ''}"
            )
    return Dispatched(
        [tuple(a[i] for a in args) for i in range(n)], [{k: v[i] for k, v in kwargs.items()} for i in range(n)]
    )


def _chunk_views(data: DataProto, dp_size: int) -> tuple[list[DataProto], int]:
    """pad_to_divisor + chunk, but the chunks are views (row ranges) of the padded batch, not copies.

    Ray pickles the arguments when the call is submitted, so the views never outlive the call; this saves one full
    copy of the batch in the driver per call.
    """
    padded, pad = data.pad_to_divisor(dp_size)
    rows = len(padded) // dp_size
    chunks = [
        DataProto(
            batch={k: t[d * rows : (d + 1) * rows] for k, t in padded.batch.items()},
            non_tensor_batch={k: a[d * rows : (d + 1) * rows] for k, a in padded.non_tensor_batch.items()},
            meta_info=dict(padded.meta_info),
        )
        for d in range(dp_size)
    ]
    return chunks, pad


def _split_data_args(dp_size: int, dp_rank_of: list[int], args: tuple, kwargs: dict) -> Dispatched:
    """Chunk DataProto / DataProtoFuture arguments by data-parallel rank; everything else is broadcast."""
    from hybridflow.single_controller.future import DataProtoFuture

    # a future computed already (local backend) is just its value
    values = [v.get() if isinstance(v, DataProtoFuture) and v.is_ready_value else v for v in [*args, *kwargs.values()]]
    lengths = {len(v) for v in values if isinstance(v, DataProto)}
    if len(lengths) > 1:
        raise ValueError(f"all DataProto arguments of one call must have the same length, got {sorted(lengths)}")
    pad = 0
    chunks: dict[int, list] = {}
    for i, v in enumerate(values):
        if isinstance(v, DataProto):
            chunks[i], pad = _chunk_views(v, dp_size)
        elif isinstance(v, DataProtoFuture):
            chunks[i] = [v.chunk_for(dp_rank, dp_size) for dp_rank in range(dp_size)]
    rows = (next(iter(lengths)) + pad) // dp_size if lengths else 0
    # padding rows sit at the end of the padded batch: the last ranks hold them
    pad_per_dp = [max(0, min(rows, (d + 1) * rows - (rows * dp_size - pad))) for d in range(dp_size)]
    per_rank_args, per_rank_kwargs, pad_rows = [], [], []
    n_args = len(args)
    keys = list(kwargs)
    for d in dp_rank_of:
        vals = [chunks[i][d] if i in chunks else v for i, v in enumerate(values)]
        per_rank_args.append(tuple(vals[:n_args]))
        per_rank_kwargs.append(dict(zip(keys, vals[n_args:])))
        pad_rows.append(pad_per_dp[d])
    return Dispatched(per_rank_args, per_rank_kwargs, pad_rows=pad_rows)


def dispatch_dp_compute_data_proto(group: WorkerGroup, *args: Any, **kwargs: Any) -> Dispatched:
    n = _world(group)
    out = _split_data_args(n, list(range(n)), args, kwargs)
    out.future_ok = True
    return out


def collect_dp_compute_data_proto(group: WorkerGroup, outputs: list[Any]) -> DataProto | None:
    if all(o is None for o in outputs):
        return None
    bad = [type(o).__name__ for o in outputs if not isinstance(o, DataProto)]
    if bad:
        raise TypeError(
            f"a DP_COMPUTE_PROTO method must return a DataProto on every collecting rank, got {bad}; "
            "use Dispatch.DP_COMPUTE_METRIC to get a list of arbitrary values back"
        )
    return DataProto.concat(outputs)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str, collect: str = "concat") -> DispatchMode:
    """A DP_COMPUTE_PROTO-like mode over the data-parallel axis of the named mesh (see module docstring).

    ``collect="concat"`` gathers one DataProto; ``collect="list"`` returns the collectors' outputs as a list.
    """
    if collect not in ("concat", "list"):
        raise ValueError(f"collect must be 'concat' or 'list', got {collect!r}")

    def dispatch(group: WorkerGroup, *args: Any, **kwargs: Any) -> Dispatched:
        mesh = group.dp_mesh(mesh_name)
        out = _split_data_args(mesh.dp_size, mesh.dp_rank_of, args, kwargs)
        out.collectors = mesh.collectors
        out.future_ok = collect == "concat"
        return out

    return DispatchMode(
        name=f"DP_COMPUTE_PROTO[mesh={mesh_name}]" if collect == "concat" else f"DP_COMPUTE_METRIC[mesh={mesh_name}]",
        dispatch_fn=dispatch,
        collect_fn=collect_dp_compute_data_proto if collect == "concat" else collect_list,
    )


_MODES: dict[str, DispatchMode] = {
    Dispatch.ONE_TO_ALL.value: DispatchMode("ONE_TO_ALL", dispatch_one_to_all, collect_list),
    Dispatch.ALL_TO_ALL.value: DispatchMode(
        "ALL_TO_ALL", lambda group, *a, **k: Dispatched([a] * _world(group), [k] * _world(group)), collect_list
    ),
    Dispatch.DP_COMPUTE.value: DispatchMode("DP_COMPUTE", dispatch_dp_compute, collect_list),
    Dispatch.DP_COMPUTE_PROTO.value: DispatchMode(
        "DP_COMPUTE_PROTO", dispatch_dp_compute_data_proto, collect_dp_compute_data_proto
    ),
    Dispatch.DP_COMPUTE_METRIC.value: DispatchMode(
        "DP_COMPUTE_METRIC",
        lambda group, *a, **k: _split_data_args(_world(group), list(range(_world(group))), a, k),
        collect_list,
    ),
}


def register_dispatch_mode(name: str, dispatch_fn: Callable[..., Any], collect_fn: Callable[..., Any]) -> DispatchMode:
    """Add a dispatch mode usable as ``register(dispatch_mode=name)``.

    ``dispatch_fn(group, *args, **kwargs)`` returns ``(args_per_rank, kwargs_per_rank)`` (two lists of length
    ``group.world_size``) or a `Dispatched`; ``collect_fn(group, outputs)`` turns the list of per-rank outputs into
    the caller's result. Registering an existing name raises (built-in modes cannot be replaced).
    """
    if name in _MODES:
        raise ValueError(f"dispatch mode {name!r} is registered already; pick another name")
    mode = DispatchMode(name, dispatch_fn, collect_fn)
    _MODES[name] = mode
    return mode


def resolve_dispatch_mode(dispatch_mode: Dispatch | str | DispatchMode, mesh_name: str | None = None) -> DispatchMode:
    if isinstance(dispatch_mode, DispatchMode):
        if mesh_name is not None:
            raise ValueError("mesh_name= only applies to Dispatch.DP_COMPUTE_PROTO / DP_COMPUTE_METRIC")
        return dispatch_mode
    name = dispatch_mode.value if isinstance(dispatch_mode, Dispatch) else str(dispatch_mode)
    if mesh_name is not None:
        if name == Dispatch.DP_COMPUTE_PROTO.value:
            return make_nd_compute_dataproto_dispatch_fn(mesh_name, "concat")
        if name == Dispatch.DP_COMPUTE_METRIC.value:
            return make_nd_compute_dataproto_dispatch_fn(mesh_name, "list")
        raise ValueError(f"mesh_name= only applies to DP_COMPUTE_PROTO / DP_COMPUTE_METRIC, not {name}")
    if name not in _MODES:
        raise ValueError(
            f"unknown dispatch mode {name!r}; known: {sorted(_MODES)} (add one with register_dispatch_mode)"
        )
    return _MODES[name]


def normalize_dispatched(group: WorkerGroup, value: Any, mode: DispatchMode) -> Dispatched:
    """Accept a `Dispatched` or the (args_per_rank, kwargs_per_rank) pair a user dispatch function returns."""
    if not isinstance(value, Dispatched):
        try:
            args, kwargs = value
        except (TypeError, ValueError):
            raise TypeError(
                f"dispatch function of mode {mode.name} must return (args_per_rank, kwargs_per_rank), got "
                f"{type(value).__name__}"
            ) from None
        value = Dispatched([tuple(a) for a in args], [dict(k) for k in kwargs])
    n = group.world_size
    if len(value.args) != n or len(value.kwargs) != n:
        raise ValueError(
            f"dispatch mode {mode.name} produced arguments for {len(value.args)} ranks (kwargs: {len(value.kwargs)}), "
            f"but group {group.name!r} has {n} ranks"
        )
    return value


def register(
    dispatch_mode: Dispatch | str | DispatchMode = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    mesh_name: str | None = None,
) -> Callable:
    """Mark a Worker method as a group method: ``wg.<name>(...)`` dispatches it to the ranks (module docstring).

    ``blocking=False`` makes the group method return a DataProtoFuture instead of waiting.
    """
    mode = resolve_dispatch_mode(dispatch_mode, mesh_name)
    spec = RegisterSpec(mode=mode, execute_mode=Execute(execute_mode), blocking=blocking)

    def decorate(fn: Callable) -> Callable:
        setattr(fn, REGISTER_ATTR, spec)  # no wrapper: worker tracebacks and debuggers see the method itself
        return fn

    return decorate
