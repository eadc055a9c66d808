"""Two simulated nodes (ray.cluster_utils.Cluster): ranks of one group on both, gloo all-reduce across them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_group_spans_two_nodes_and_all_reduces():
    script = Path(__file__).with_name("two_node_check.py")
    env = {**os.environ, "RAY_ADDRESS": ""}  # never attach to the test session's cluster
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=script.parent
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    report = json.loads(line)
    results = report["results"]
    assert report["nodes"] == 2
    assert [r["rank"] for r in results] == [0, 1]
    assert len({r["node_id"] for r in results}) == 2  # one rank on each node
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["local_rank"] for r in results] == [0, 0]  # each is alone on its node
    assert len({r["master"] for r in results}) == 1
