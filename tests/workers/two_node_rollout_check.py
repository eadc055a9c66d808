"""Run as a script: a two-node Ray cluster on this machine (one CPU each), the actor on one node and a rollout group
of its own on the other; a short GRPO run whose weights cross nodes over the transfer group after every update.

test_separate_rollout.py runs it in a subprocess (it needs its own cluster), with every rollout mode it checks in one
call: the modes' runs share the cluster, so it starts once. Prints one JSON line per mode: the mode, the nodes of the
actor and rollout ranks and the per-step metrics that show the transfer was exact.
"""

from __future__ import annotations

import json
import sys

from e2e_helpers import tiny_run_overrides


def main(runs_dir: str, model: str, train: str, val: str, modes: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from hybridflow.trainer import placement
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    seen = {}
    original = placement.build_worker_groups

    def recording(*args, **kwargs):
        groups = original(*args, **kwargs)
        seen["actor"] = [i["node_id"] for i in groups.actor_rollout.worker_info]
        seen["rollout"] = [i["node_id"] for i in groups.rollout.worker_info]
        return groups

    placement.build_worker_groups = recording
    keep = ("weights/version", "rollout/mismatch_max_abs", "rollout/staleness_max", "perf/weight_transfer_MBps")
    try:
        for mode in modes.split(","):
            run_dir = f"{runs_dir}/{mode}"
            cfg = load_config(tiny_run_overrides(
                (train, val), model, run_dir, "trainer.backend=ray", "actor_rollout_ref.hybrid_engine=false",
                f"trainer.rollout_mode={mode}", "trainer.total_training_steps=3",
            ))
            seen.clear()
            run_training(cfg, progress=False)
            rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
            print(json.dumps({"mode": mode, "nodes": len([n for n in ray.nodes() if n["Alive"]]), **seen,
                              "rows": [{k: r.get(k) for k in keep} for r in rows]}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
