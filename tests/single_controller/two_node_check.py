"""Run as a script: a two-node Ray cluster on this machine, one WorkerGroup with a rank on each node, gloo all-reduce.

It needs its own Ray cluster (ray.cluster_utils.Cluster), so test_two_nodes.py runs it in a subprocess instead of
sharing the test session's cluster. Prints one JSON line: per-rank node ids, all-reduce sums, master address.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from hybridflow.single_controller import ClassWithInitArgs, Dispatch, ResourcePool, Worker, WorkerGroup, register


class AllReduceWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> dict:
        import ray

        self.init_distributed(timeout_s=60)
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "sum": float(t.item()),
            "node_id": ray.get_runtime_context().get_node_id(),
            "master": f"{self.master_addr}:{self.master_port}",
        }


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        # one CPU per node and one CPU per process: the two placement groups must land on different nodes
        pool = ResourcePool(process_on_nodes=[1, 1], num_cpus_per_process=1, name="two_nodes")
        wg = WorkerGroup(pool, ClassWithInitArgs(AllReduceWorker), name_prefix="two_nodes", call_timeout_s=120)
        results = wg.all_reduce()
        print(json.dumps({"results": results, "nodes": len([n for n in ray.nodes() if n["Alive"]])}))
        wg.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
