"""A watchdog for a driver's local Ray cluster: when the driver dies, even by SIGKILL, stop what it started.

Ray's head processes die with a killed driver, but its dashboard and runtime-env agents can linger for minutes (one
with an open port). ``python -m hybridflow.single_controller.reaper <driver pid>`` runs in its own session (so a
signal to the driver's process group does not take it along), notes the driver's descendants once a second, and
when the driver is gone kills the ones still running -- each checked by its start time, so a recycled pid is never
hit. `start_local_ray` starts it; it exits on its own right after the driver.

`start_reaper` loads this file alone, not through the package: ``-m`` would run hybridflow/single_controller's
``__init__``, which imports torch -- seconds of CPU taken from Ray and its workers while they start, for a watchdog
that needs only psutil.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

POLL_S = 1.0
# Runs this file as a module of its own (argv: this file's path, the driver's pid).
_BOOTSTRAP = (
    "import importlib.util, sys; spec = importlib.util.spec_from_file_location('hybridflow_reaper', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module.watch(int(sys.argv[2]))"
)


def watch(driver_pid: int, poll_s: float = POLL_S) -> int:
    """Block until `driver_pid` exits, then kill its last known descendants; returns how many were killed."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return 0
    known: dict[int, float] = {}
    me = psutil.Process().pid  # a child of the driver too: never on the list
    while True:
        try:
            if driver.status() == psutil.STATUS_ZOMBIE:
                break
            for child in driver.children(recursive=True):
                if child.pid == me:
                    continue
                with contextlib.suppress(psutil.Error):  # it exited between the listing and the query
                    known[child.pid] = child.create_time()
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    killed = 0
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def start_reaper(driver_pid: int) -> subprocess.Popen:
    """Start the watchdog for `driver_pid` in a new session, detached from the driver's stdio."""
    return subprocess.Popen(
        [sys.executable, "-c", _BOOTSTRAP, os.path.abspath(__file__), str(driver_pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        close_fds=True,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
