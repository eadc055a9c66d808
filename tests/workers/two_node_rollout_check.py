"""Run as a script: a two-node Ray cluster on this machine (one CPU each), the actor on one node and a rollout group
of its own on the other; a short GRPO run whose weights cross nodes over the transfer group after every update.

test_separate_rollout.py runs it in a subprocess (it needs its own cluster). Prints one JSON line: the nodes of the
actor and rollout ranks and the per-step metrics that show the transfer was exact.
"""

from __future__ import annotations

import json
import sys

from e2e_helpers import tiny_run_overrides


def main(run_dir: str, model: str, train: str, val: str, mode: str) -> None:
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
    try:
        cfg = load_config(tiny_run_overrides(
            (train, val), model, run_dir, "trainer.backend=ray", "actor_rollout_ref.hybrid_engine=false",
            f"trainer.rollout_mode={mode}", "trainer.total_training_steps=3",
        ))
        run_training(cfg, progress=False)
        rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
        keep = ("weights/version", "rollout/mismatch_max_abs", "rollout/staleness_max", "perf/weight_transfer_MBps")
        print(json.dumps({"nodes": len([n for n in ray.nodes() if n["Alive"]]), **seen,
                          "rows": [{k: r.get(k) for k in keep} for r in rows]}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
