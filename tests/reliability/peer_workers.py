"""Worker class for the failure-classification tests: ranks that raise, die or lose a peer on cue (shipped by value)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hybridflow.single_controller import Dispatch, Worker, register


def ship_by_value() -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PeerWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> int:
        self.init_distributed(timeout_s=60)
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def act(self, plan: dict) -> str:
        """plan[rank] (default "ok") is what this rank does: "ok", "die:<delay_s>", "raise:<message>",
        "sleep:<seconds>" or "all_reduce" (a real gloo collective; a lost peer makes it raise)."""
        what = plan.get(self.rank, "ok")
        verb, _, arg = what.partition(":")
        if verb == "die":
            time.sleep(float(arg))
            os.kill(os.getpid(), signal.SIGKILL)
        if verb == "raise":
            raise RuntimeError(arg)
        if verb == "sleep":
            time.sleep(float(arg))
        if verb == "all_reduce":
            dist.all_reduce(torch.ones(1))
        return what

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_and_record(self, victim: int, path: str) -> None:
        """The victim dies; every other rank all-reduces and writes what its collective raised to `path`.<rank>."""
        if self.rank == victim:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(torch.ones(1))
            text = "no error"
        except Exception as e:  # the test wants gloo's own words, whatever the type
            text = f"{type(e).__name__}: {e}"
        with open(f"{path}.{self.rank}", "w") as f:
            f.write(text)
