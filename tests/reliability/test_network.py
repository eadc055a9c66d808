"""Closed to the network by default (issue 23, item 6): during a single-node Ray run nothing listens on a
non-loopback address (GCS, raylet, object manager, agents, workers' gRPC, torch.distributed's store and gloo), and a
SIGKILLed driver leaves no process behind. A real `hybridflow train` in a subprocess, with its own Ray cluster."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
from e2e_helpers import tiny_run_overrides

LOOPBACK = ("127.", "::1", "::ffff:127.")


def _tree(pid: int) -> dict[int, str]:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):  # exited meanwhile
            out[p.pid] = p.name()
    return out


def _alive(pids: dict[int, str]) -> list[tuple[int, str]]:
    left = []
    for pid, name in pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append((pid, name))
        except psutil.NoSuchProcess:
            pass
    return left


def test_run_listens_on_loopback_only_and_a_killed_driver_leaves_nothing(arithmetic_files, tiny_model_path, tmp_path):
    run_dir = tmp_path / "run"
    overrides = tiny_run_overrides(arithmetic_files, tiny_model_path, str(run_dir), "trainer.backend=ray",
                                   "trainer.n_gpus_per_node=2", "trainer.total_training_steps=400", "trainer.save_freq=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow", "train", *overrides], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, env=env)
    seen: dict[int, str] = {}
    listeners: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + 400
    try:
        # Watch until the second checkpoint is committed: by then every server of the run (workers, gloo, store) is
        # up. The marker file, not a global_step_N folder (max_ckpt_to_keep prunes those), and a run far longer than
        # the watch, so a quick machine cannot finish it between two polls.
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(_tree(proc.pid))
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.pid in seen:
                    listeners.add((seen[c.pid], c.laddr.ip, c.laddr.port))
            marker = run_dir / "latest_checkpointed_iteration.txt"
            with contextlib.suppress(OSError, ValueError):
                if int(marker.read_text().strip()) >= 2:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    names = {name for name, _, _ in listeners}
    assert {"gcs_server", "raylet"} <= names and any("WorkerHost" in n for n in names), listeners
    open_ = sorted(entry for entry in listeners if not entry[1].startswith(LOOPBACK))
    assert not open_, f"listening beyond loopback: {open_}"

    deadline = time.monotonic() + 20  # the watchdog polls once a second
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(seen), f"left behind by the killed driver: {_alive(seen)}"
