"""ResourcePool: the Ray placement groups a WorkerGroup's ranks live in.

``ResourcePool(process_on_nodes=[2, 2])`` asks for two placement groups of two bundles each; every placement group is
STRICT_PACK, so its processes share a node. A bundle holds ``num_cpus_per_process * max_colocate_count`` CPUs and
``num_gpus_per_process`` GPUs (with ``use_gpu``); each process takes ``num_cpus_per_process`` CPUs and
``num_gpus_per_process / max_colocate_count`` GPUs, so up to ``max_colocate_count`` worker groups built on the same
pool share each bundle (and its device).

Ranks are numbered by node address (then node id, then placement-group order), so the same cluster gives the same
rank layout on every run. Placement groups are created on first use, after checking `ray.nodes()`: a request no node
can hold fails at once, with the numbers, instead of waiting forever; scheduling is also bounded by ``pg_timeout_s``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Any

from hybridflow import device


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs: a bundle of a placement group on a node."""

    placement_group: Any
    bundle_index: int
    node_id: str
    node_ip: str


_POOL_IDS = itertools.count()


class ResourcePool:
    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        num_cpus_per_process: float = 1,
        num_gpus_per_process: float = 1,
        max_colocate_count: int = 1,
        name: str | None = None,
        pg_timeout_s: float = 120.0,
    ) -> None:
        if not process_on_nodes or any(not isinstance(n, int) or n < 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive ints, got {process_on_nodes!r}")
        if num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process must be > 0, got {num_cpus_per_process}")
        if use_gpu and num_gpus_per_process <= 0:
            raise ValueError(f"num_gpus_per_process must be > 0 with use_gpu=True, got {num_gpus_per_process}")
        if max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.num_cpus_per_process = num_cpus_per_process
        self.num_gpus_per_process = num_gpus_per_process if use_gpu else 0
        self.max_colocate_count = max_colocate_count
        # Placement groups are named after the pool and Ray refuses duplicate names: pools without a name get a
        # unique one, so two of them can live side by side.
        self.name = name if name is not None else f"pool-{next(_POOL_IDS)}-{os.getpid()}"
        self.pg_timeout_s = pg_timeout_s
        self._slots: list[RankSlot] | None = None
        self._users: set[int] = set()

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": self.num_cpus_per_process * self.max_colocate_count}
        if self.use_gpu:
            b[device.ray_accelerator_resource()] = self.num_gpus_per_process
        return b

    def process_resources(self) -> dict[str, float]:
        """What one process (Ray actor) of one worker group asks for inside its bundle."""
        return {
            "num_cpus": self.num_cpus_per_process,
            "num_gpus": self.num_gpus_per_process / self.max_colocate_count if self.use_gpu else 0,
        }

    def check_fits(self) -> None:
        """Raise ValueError at once when no node (or not the whole cluster) could ever hold the request."""
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                f"resource pool {self.name!r}: Ray is not running; call ray.init() (or ray.init(address=...) for a "
                "cluster) before building a WorkerGroup with backend='ray', or use backend='local'"
            )
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        caps = [(n.get("NodeManagerAddress", "?"), n.get("Resources", {})) for n in nodes]
        bundle = self.bundle()
        summary = ", ".join(f"{ip}: " + ", ".join(f"{k}={r.get(k, 0):g}" for k in bundle) for ip, r in caps)
        for count in sorted(set(self.process_on_nodes)):
            need = {k: v * count for k, v in bundle.items()}
            if not any(all(r.get(k, 0) >= v for k, v in need.items()) for _, r in caps):
                raise ValueError(
                    f"resource pool {self.name!r}: {count} processes on one node need "
                    + ", ".join(f"{k}={v:g}" for k, v in need.items())
                    + f" (num_cpus_per_process={self.num_cpus_per_process:g} x max_colocate_count="
                    f"{self.max_colocate_count}, use_gpu={self.use_gpu}), but no node has that much; nodes: {summary}. "
                    "Use fewer processes per node (more entries in process_on_nodes), or fewer CPUs/GPUs per process."
                )
        total = {k: sum(r.get(k, 0) for _, r in caps) for k in bundle}
        need_all = {k: v * self.world_size for k, v in bundle.items()}
        if any(need_all[k] > total[k] for k in bundle):
            raise ValueError(
                f"resource pool {self.name!r} needs {need_all} in total but the cluster has {total}; "
                "shrink process_on_nodes or the per-process resources"
            )

    def slots(self) -> list[RankSlot]:
        """The rank -> (placement group, bundle, node) table, creating the placement groups on first use."""
        if self._slots is not None:
            return self._slots
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        self.check_fits()
        pgs = [
            placement_group([self.bundle()] * count, strategy="STRICT_PACK", name=f"{self.name}_{i}")
            for i, count in enumerate(self.process_on_nodes)
        ]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=self.pg_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in pgs:
                remove_placement_group(pg)
            raise TimeoutError(
                f"resource pool {self.name!r}: placement groups {self.process_on_nodes} x {self.bundle()} were not "
                f"scheduled within {self.pg_timeout_s:g} s; free resources now: {ray.available_resources()}. "
                "Other groups may hold the resources: shut them down, or share a pool with max_colocate_count."
            ) from None
        ip_of = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
        placed = []
        for order, pg in enumerate(pgs):
            table = placement_group_table(pg)
            node_of_bundle = table["bundles_to_node_id"]
            node_id = node_of_bundle[0]
            placed.append((ip_of.get(node_id, ""), node_id, order, pg, node_of_bundle))
        placed.sort(key=lambda p: (_ip_key(p[0]), p[1], p[2]))
        self._slots = [
            RankSlot(pg, b, node_of_bundle[b], ip_of.get(node_of_bundle[b], ""))
            for _, _, _, pg, node_of_bundle in placed
            for b in range(len(node_of_bundle))
        ]
        return self._slots

    # ------------------------------------------------------------------ lifetime
    def acquire(self, user: object) -> None:
        self._users.add(id(user))

    def release(self, user: object) -> None:
        """A group is done with the pool; the placement groups go when the last one is."""
        self._users.discard(id(user))
        if not self._users:
            self.shutdown()

    def shutdown(self) -> None:
        """Remove the placement groups (killing anything still in them). Idempotent; the pool can be reused."""
        if self._slots is None:
            return
        from ray.util.placement_group import remove_placement_group

        for pg in {id(s.placement_group): s.placement_group for s in self._slots}.values():
            with contextlib.suppress(Exception):  # already gone (ray.shutdown)
                remove_placement_group(pg)
        self._slots = None

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.name!r}, process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
            f"bundle={self.bundle()}, max_colocate_count={self.max_colocate_count})"
        )


def _ip_key(ip: str) -> tuple:
    """Sort IPv4 addresses numerically (10.0.0.9 before 10.0.0.10); anything else by text."""
    parts = ip.split(".")
    if len(parts) == 4 and all(p.isdigit() for p in parts):
        return (0, *map(int, parts))
    return (1, ip)
