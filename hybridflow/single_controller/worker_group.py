"""WorkerGroup: a group of ranks that looks like one object to the driver.

    pool = ResourcePool(process_on_nodes=[2])
    wg = WorkerGroup(pool, ClassWithInitArgs(MyWorker, config), name_prefix="actor")
    out = wg.compute_log_prob(batch)      # every @register'ed method of MyWorker is a group method

Backends: ``"ray"`` -- one Ray actor (process) per rank, placed in the pool's bundles; ``"local"`` -- one rank built
in the driver process, no Ray needed (put a breakpoint in a worker method), the pool is not used. The API is the same;
non-blocking calls compute eagerly on the local backend.

Start-up: the group starts the rank processes, asks rank 0 for its node address and a free port (the torch.distributed
rendezvous), then builds the worker class in every rank with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT / HYBRIDFLOW_NUM_THREADS set (see worker.py). Torch threads per rank: ``num_threads``, else the driver's
HYBRIDFLOW_NUM_THREADS, else the pool's ``num_cpus_per_process``.

Failures: a rank that raises, dies, or does not answer within ``call_timeout_s`` raises WorkerGroupError in the driver,
naming the group, the method and the rank (with node and pid). After a death or a timeout the group is unusable:
shut it down and build a new one.

Colocation: ``create_colocated_worker_groups(pool, {"actor": ..., "ref": ...})`` starts one process per rank that hosts
every role, and returns one WorkerGroup per role; they share the processes (and torch.distributed group).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.single_controller.dispatch import (
    REGISTER_ATTR,
    Dispatched,
    Execute,
    RegisterSpec,
    normalize_dispatched,
)
from hybridflow.single_controller.errors import WorkerGroupError, wait_for
from hybridflow.single_controller.future import DataProtoFuture
from hybridflow.single_controller.host import ClassWithInitArgs, WorkerHost
from hybridflow.single_controller.resource_pool import ResourcePool
from hybridflow.single_controller.worker import NUM_THREADS_ENV, WorkerContext

BACKENDS = ("ray", "local")
_REMOTE_HOST = None


def _remote_host_class():
    global _REMOTE_HOST
    if _REMOTE_HOST is None:
        import ray

        _REMOTE_HOST = ray.remote(WorkerHost)
    return _REMOTE_HOST


@dataclass
class MeshLayout:
    """The data-parallel layout of a named mesh across a group's ranks."""

    dp_size: int
    dp_rank_of: list[int]  # per rank
    collectors: list[int]  # ranks whose outputs are gathered, in dp-rank order


class _Ranks:
    """The rank processes (Ray actors, or one in-driver host) shared by the groups built on them."""

    def __init__(
        self,
        resource_pool: ResourcePool | None,
        backend: str,
        name: str,
        num_threads: int | None,
        env_vars: dict[str, str] | None,
        startup_timeout_s: float,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.name, self.pool = backend, name, resource_pool
        self.alive = True
        if num_threads is None and os.environ.get(NUM_THREADS_ENV):
            num_threads = int(os.environ[NUM_THREADS_ENV])
        if backend == "local":
            if resource_pool is not None and resource_pool.world_size != 1:
                warnings.warn(
                    f"backend='local' runs one rank in the driver; resource pool {resource_pool.name!r} "
                    f"({resource_pool.world_size} processes) is not used",
                    stacklevel=3,
                )
            if env_vars:
                os.environ.update(env_vars)
            self.hosts: list[Any] = [WorkerHost()]
            master_addr = WorkerContext.master_addr
            self.info = [self.hosts[0].node_info(pick_port=True, master_addr=master_addr)]
            self.contexts = [
                WorkerContext(master_addr=master_addr, master_port=self.info[0]["port"], num_threads=num_threads)
            ]
            return
        if resource_pool is None:
            raise ValueError("backend='ray' needs a resource_pool (e.g. ResourcePool(process_on_nodes=[2]))")
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_threads is None:
            num_threads = max(1, int(resource_pool.num_cpus_per_process))
        slots = resource_pool.slots()
        resource_pool.acquire(self)
        options = dict(resource_pool.process_resources(), max_restarts=0)
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        remote = _remote_host_class()
        self.hosts = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    s.placement_group, placement_group_bundle_index=s.bundle_index
                ),
                **options,
            ).remote()
            for s in slots
        ]
        try:
            refs = [h.node_info.remote(pick_port=(r == 0)) for r, h in enumerate(self.hosts)]
            self.info = wait_for(refs, range(len(refs)), group=name, method="<start>", timeout_s=startup_timeout_s)
        except WorkerGroupError:
            self.kill()
            raise
        for rank, (info, slot) in enumerate(zip(self.info, slots)):
            info["rank"], info["node_id"] = rank, slot.node_id
        local_ranks, counts = [], {}
        for s in slots:
            local_ranks.append(counts.get(s.node_id, 0))
            counts[s.node_id] = local_ranks[-1] + 1
        self.contexts = [
            WorkerContext(
                rank=r,
                world_size=len(slots),
                local_rank=local_ranks[r],
                local_world_size=counts[s.node_id],
                master_addr=self.info[0]["node_ip"],
                master_port=self.info[0]["port"],
                num_threads=num_threads,
            )
            for r, s in enumerate(slots)
        ]

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def submit(self, rank: int, fn: str, args: tuple, *, group: str, method: str, num_returns: int = 1) -> Any:
        """Ray: an ObjectRef (or `num_returns` of them). Local: runs now and returns the value itself, raising
        WorkerGroupError from the original exception (which a debugger or the traceback shows in full)."""
        if not self.alive:
            raise RuntimeError(f"worker group {self.name!r} has been shut down; build a new one")
        host = self.hosts[rank]
        if self.backend == "local":
            try:
                return getattr(host, fn)(*args)
            except Exception as e:
                raise WorkerGroupError(
                    f"{group}.{method} raised on rank 0 (local backend): {type(e).__name__}: {e}",
                    group=group,
                    method=method,
                    rank=0,
                    pid=os.getpid(),
                    kind="raised",
                ) from e
        remote_method = getattr(host, fn)
        if num_returns != 1:
            remote_method = remote_method.options(num_returns=num_returns)
        return remote_method.remote(*args)

    def gather(self, handles: list, ranks: list[int], group: str, method: str, timeout_s: float | None) -> list:
        if self.backend == "local":
            return handles
        return wait_for(handles, ranks, group=group, method=method, timeout_s=timeout_s, rank_info=self.info)

    def init_roles(self, roles: dict[str, ClassWithInitArgs], group: str, timeout_s: float) -> None:
        """Build every role in every rank (the user classes' __init__ runs here); on failure stop the processes."""
        in_driver = self.backend == "local"
        ranks = list(range(self.world_size))
        try:
            handles = [
                self.submit(r, "init_roles", (self.contexts[r], roles, in_driver), group=group, method="__init__")
                for r in ranks
            ]
            self.gather(handles, ranks, group, "__init__", timeout_s)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        if self.backend == "ray":
            import ray

            for h in self.hosts:
                with contextlib.suppress(Exception):  # already dead, or Ray shut down
                    ray.kill(h, no_restart=True)
            if self.pool is not None:
                self.pool.release(self)
        else:
            for h in self.hosts:
                h.close()


class WorkerGroup:
    """One object standing for `world_size` ranks of a Worker class; see the module docstring."""

    def __init__(
        self,
        resource_pool: ResourcePool | None = None,
        cls_with_init: ClassWithInitArgs | None = None,
        name_prefix: str = "worker",
        backend: str = "ray",
        call_timeout_s: float | None = 600.0,
        num_threads: int | None = None,
        env_vars: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        *,
        ray_cls_with_init: ClassWithInitArgs | None = None,
    ) -> None:
        if ray_cls_with_init is not None:  # veRL's keyword for the same thing
            if cls_with_init is not None:
                raise ValueError("pass cls_with_init= or ray_cls_with_init= (veRL's name for it), not both")
            cls_with_init = ray_cls_with_init
        if cls_with_init is None:
            raise ValueError("WorkerGroup needs cls_with_init=ClassWithInitArgs(MyWorker, *args, **kwargs)")
        ranks = _Ranks(resource_pool, backend, name_prefix, num_threads, env_vars, startup_timeout_s)
        try:
            self._bind(ranks, "main", cls_with_init.cls, name_prefix, call_timeout_s)
        except BaseException:
            ranks.kill()
            raise
        ranks.init_roles({"main": cls_with_init}, name_prefix, startup_timeout_s)  # stops the ranks if it fails

    @classmethod
    def _attached(cls, ranks: _Ranks, role: str, worker_cls: type, name: str, call_timeout_s: float | None):
        group = cls.__new__(cls)
        group._bind(ranks, role, worker_cls, name, call_timeout_s)
        return group

    def _bind(self, ranks: _Ranks, role: str, worker_cls: type, name: str, call_timeout_s: float | None) -> None:
        self._ranks, self._role, self.worker_cls, self.name = ranks, role, worker_cls, name
        self.call_timeout_s = call_timeout_s
        self._meshes: dict[str, MeshLayout] = {}
        for attr in dir(worker_cls):
            spec = getattr(getattr(worker_cls, attr, None), REGISTER_ATTR, None)
            if spec is None:
                continue
            if hasattr(self, attr):  # a WorkerGroup attribute (shutdown, name, world_size, ...)
                raise ValueError(
                    f"{worker_cls.__name__}.{attr} is @register'ed but WorkerGroup has an attribute of that name; "
                    "rename the worker method"
                )
            setattr(self, attr, self._group_method(attr, spec))

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    @property
    def backend(self) -> str:
        return self._ranks.backend

    def shares_processes_with(self, other: WorkerGroup) -> bool:
        """Whether both groups' roles live in the same rank processes (create_colocated_worker_groups): their calls
        then run one after the other in each process, so calls with collectives must be made in the same order."""
        return self._ranks is other._ranks

    @property
    def worker_info(self) -> list[dict]:
        """Per rank: node_ip, hostname, pid (and rank, node_id on Ray)."""
        return [dict(i) for i in self._ranks.info]

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.worker_cls.__name__}, world_size={self.world_size}, {self.backend})"

    # ------------------------------------------------------------------ calls
    def _group_method(self, method: str, spec: RegisterSpec) -> Callable:
        def group_method(*args: Any, **kwargs: Any) -> Any:
            return self._call(method, spec, args, kwargs)

        group_method.__name__ = method
        group_method.__doc__ = getattr(self.worker_cls, method).__doc__
        return group_method

    def _call(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict) -> Any:
        """dispatch -> one call per rank (all at once) -> wait (or hand back a future) -> collect."""
        mode = spec.mode
        try:
            dispatched = normalize_dispatched(self, mode.dispatch_fn(self, *args, **kwargs), mode)
        except WorkerGroupError:
            raise
        except (TypeError, ValueError, KeyError, IndexError) as e:  # say which call could not be split
            raise type(e)(f"{self.name}.{method}: cannot dispatch the arguments ({mode.name}): {e}") from e
        ranks = [0] if spec.execute_mode == Execute.RANK_ZERO_ONLY else list(range(self.world_size))
        if spec.execute_mode == Execute.ALL:
            collectors = dispatched.collectors if dispatched.collectors is not None else ranks
            collect = lambda outs: mode.collect_fn(self, outs)  # noqa: E731
        else:  # RANK_ZERO and RANK_ZERO_ONLY: rank 0's own return value
            collectors = [0]
            collect = lambda outs: outs[0]  # noqa: E731
        use_len = (not spec.blocking) and dispatched.future_ok and spec.execute_mode == Execute.ALL
        handles = self._submit(method, dispatched, ranks, with_len=use_len)
        if self.backend == "local":
            value = collect([handles[ranks.index(r)] for r in collectors])
            return value if spec.blocking else DataProtoFuture.from_value(value, group=self.name, method=method)
        if spec.blocking:
            outputs = self._ranks.gather(handles, ranks, self.name, method, self.call_timeout_s)
            return collect([outputs[ranks.index(r)] for r in collectors])
        if use_len:
            len_refs = [handles[ranks.index(r)][0] for r in collectors]
            data_refs = [handles[ranks.index(r)][1] for r in collectors]
        else:
            len_refs, data_refs = None, [handles[ranks.index(r)] for r in collectors]
        return DataProtoFuture(
            group=self.name,
            method=method,
            data_refs=data_refs,
            ranks=collectors,
            collect=collect,
            len_refs=len_refs,
            timeout_s=self.call_timeout_s,
            rank_info=self._ranks.info,
        )

    def _submit(self, method: str, dispatched: Dispatched, ranks: list[int], with_len: bool) -> list:
        pads = dispatched.pad_rows or [0] * self.world_size
        fn, num_returns = ("call_with_len", 2) if with_len and self.backend == "ray" else ("call", 1)
        return [
            self._ranks.submit(
                r,
                fn,
                (self._role, method, dispatched.args[r], dispatched.kwargs[r], pads[r]),
                group=self.name,
                method=method,
                num_returns=num_returns,
            )
            for r in ranks
        ]

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call any worker method (registered or not) on every rank with the same arguments; per-rank results."""
        ranks = list(range(self.world_size))
        dispatched = Dispatched([args] * len(ranks), [kwargs] * len(ranks))
        handles = self._submit(method_name, dispatched, ranks, with_len=False)
        return self._ranks.gather(handles, ranks, self.name, method_name, self.call_timeout_s)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a worker method on rank 0 only; its result."""
        handles = self._submit(method_name, Dispatched([args], [kwargs]), [0], with_len=False)
        return self._ranks.gather(handles, [0], self.name, method_name, self.call_timeout_s)[0]

    # ------------------------------------------------------------------ meshes
    def dp_mesh(self, mesh_name: str) -> MeshLayout:
        """The data-parallel layout the ranks declared with Worker.register_dp_mesh (queried once, then cached)."""
        if mesh_name in self._meshes:
            return self._meshes[mesh_name]
        ranks = list(range(self.world_size))
        label = f"<dp_mesh {mesh_name!r}>"
        handles = [
            self._ranks.submit(r, "dp_mesh", (self._role, mesh_name), group=self.name, method=label) for r in ranks
        ]
        infos = self._ranks.gather(handles, ranks, self.name, label, self.call_timeout_s)
        missing = [r for r, i in enumerate(infos) if i is None]
        if missing:
            raise ValueError(
                f"{self.name}: ranks {missing} have not declared mesh {mesh_name!r}; call "
                f"self.register_dp_mesh({mesh_name!r}, dp_rank, dp_size, is_collector) in every rank (e.g. in "
                "init_model) before calling methods registered with that mesh"
            )
        sizes = {i.dp_size for i in infos}
        if len(sizes) != 1:
            raise ValueError(f"{self.name}: ranks disagree on the dp size of mesh {mesh_name!r}: {sorted(sizes)}")
        dp_size = sizes.pop()
        collectors = sorted((i.dp_rank, r) for r, i in enumerate(infos) if i.is_collector)
        if [d for d, _ in collectors] != list(range(dp_size)):
            raise ValueError(
                f"{self.name}: mesh {mesh_name!r} needs exactly one collector per dp rank 0..{dp_size - 1}, "
                f"got collectors (dp_rank, rank) {collectors}"
            )
        layout = MeshLayout(dp_size, [i.dp_rank for i in infos], [r for _, r in collectors])
        self._meshes[mesh_name] = layout
        return layout

    # ------------------------------------------------------------------ lifetime
    def shutdown(self) -> None:
        """Kill the rank processes (shared by colocated groups) and release the pool's placement groups. Idempotent."""
        self._ranks.kill()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def create_colocated_worker_groups(
    resource_pool: ResourcePool | None,
    class_dict: dict[str, ClassWithInitArgs],
    backend: str = "ray",
    name_prefix: str = "colocated",
    call_timeout_s: float | None = 600.0,
    num_threads: int | None = None,
    env_vars: dict[str, str] | None = None,
    startup_timeout_s: float = 300.0,
) -> dict[str, WorkerGroup]:
    """One process per rank hosting every role of `class_dict`; one WorkerGroup per role, named "<prefix>_<role>".

    Roles are built in `class_dict` order in each process. Shutting down any of the groups stops the shared processes.
    """
    if not class_dict:
        raise ValueError("create_colocated_worker_groups needs at least one role")
    ranks = _Ranks(resource_pool, backend, name_prefix, num_threads, env_vars, startup_timeout_s)
    try:
        groups = {
            role: WorkerGroup._attached(ranks, role, spec.cls, f"{name_prefix}_{role}", call_timeout_s)
            for role, spec in class_dict.items()
        }
    except BaseException:
        ranks.kill()
        raise
    ranks.init_roles(dict(class_dict), name_prefix, startup_timeout_s)
    return groups
