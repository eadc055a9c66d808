"""The watchdog of a local cluster: it kills what a SIGKILLed driver started, and starts without importing torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from hybridflow.single_controller.reaper import start_reaper

# A stand-in driver: it starts a long-running child (as Ray's agents are) and prints the child's pid.
DRIVER = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '600']); print(c.pid, flush=True); time.sleep(600)"


def _wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_a_killed_drivers_children_are_killed_by_a_reaper_that_did_not_import_torch():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(driver.stdout.readline()))
    reaper = start_reaper(driver.pid)
    try:
        # it has loaded its modules and taken at least one look at the driver's children
        assert _wait_for(lambda: "psutil" in open(f"/proc/{reaper.pid}/maps").read(), 30)
        time.sleep(2.5)
        maps = open(f"/proc/{reaper.pid}/maps").read()
        assert "libtorch" not in maps  # started through the package, it would import torch (seconds of CPU)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert reaper.wait(timeout=30) == 0
        assert _wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 10)
    finally:
        for proc in (driver, reaper):
            if proc.poll() is None:
                proc.kill()
        if child.is_running():
            child.kill()
