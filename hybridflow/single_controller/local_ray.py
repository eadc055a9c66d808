"""Start a single-node Ray cluster that listens on loopback only.

By default Ray picks the machine's routable address as the node IP, and its GCS, raylet, object manager, runtime-env
agent and every worker's gRPC server then listen on all interfaces: anyone who can reach the host could join or
drive the cluster. A single-node run needs none of that, so ``start_local_ray`` makes the node IP 127.0.0.1, and
each of those servers binds to loopback (checked with ``ss -ltnp`` / psutil in tests/reliability/test_network.py).

How (Ray 2.60): ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough, because Ray swaps a loopback address
for the routable one (``services.resolve_ip_for_localhost``). Ray keeps its clusters on loopback where multi-node
clusters are off -- the ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` switch, read into
``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` when Ray is imported. Both are turned off for the duration of the
start (the processes it spawns inherit the environment), then restored, so a later ``ray.init(address=...)`` in the
same process still joins a real cluster normally.

To open a run to other machines, start the cluster yourself (``ray start --head --node-ip-address=<ip>`` on the head,
``ray start --address=<head ip>:6379`` on the others; token auth or a private network) and pass
``trainer.ray_address=auto``: joining an existing cluster changes nothing here.

A driver killed with SIGKILL cannot stop its cluster; a small watchdog process (reaper.py) does it instead.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from hybridflow.single_controller.reaper import start_reaper

_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _loopback_node_ip():
    from ray._private import ray_constants

    old_env, old_flag = os.environ.get(_SWITCH), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_SWITCH, None)
        else:
            os.environ[_SWITCH] = old_env


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init(**init_kwargs)`` for a new single-node cluster whose servers listen on 127.0.0.1 only.

    Raises RuntimeError if Ray came up on another address anyway (a Ray version that changed how the node IP is
    chosen): a run that believes it is closed to the network must not quietly be open.
    """
    import ray

    if "address" in init_kwargs:
        raise ValueError("start_local_ray starts a new local cluster; to join one, call ray.init(address=...)")
    with _loopback_node_ip():
        ray.init(address="local", _node_ip_address=LOOPBACK, **init_kwargs)
    start_reaper(os.getpid())  # a SIGKILLed driver leaves no Ray agent behind (reaper.py)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"Ray started on {node_ip} instead of {LOOPBACK}, so its servers would listen on the network; this Ray "
            f"version ({ray.__version__}) chooses the node address differently. Start the cluster yourself "
            "(ray start --head --node-ip-address=...) and pass trainer.ray_address"
        )
