"""Shared fixtures: one local Ray cluster per test process (ray.init costs seconds), tiny models on disk."""

from __future__ import annotations

import os

import pytest

# Workers are told how many torch threads to use; keep the driver (pytest) from oversubscribing 2 cores.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest processes (pytest-xdist) on what may be two cores: an OpenMP thread that spins
    # after each parallel region, waiting for more work, takes the core the other process's threads need. Set
    # before torch is imported; Ray workers and CLI subprocesses of the tests inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test of this pytest process (under xdist, one per worker; dashboard off,
    listening on loopback only)."""
    import ray

    from hybridflow.single_controller.local_ray import start_local_ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_worker_niceness", "0")  # as hybridflow.trainer.main does: workers do the compute
        # Logical CPUs are accounting only: 8 lets several small groups coexist on a 2-core machine.
        # Loopback only, as a run's own cluster is (hybridflow/single_controller/local_ray.py), and always a cluster
        # of our own, never one another process on this machine started
        start_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=True, namespace="hybridflow-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def rank_pool(ray_session):
    """Up to four rank processes kept for a test file, for tests that drive SPMD ranks themselves
    (tests/rank_pool.py). Not for the session: an idle Ray worker process still takes CPU time."""
    from rank_pool import RankPool

    pool = RankPool()
    yield pool
    pool.kill()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A ~0.14M-parameter random-init Qwen2 + character tokenizer, written once per session."""
    from hybridflow.engines.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), spec="unit", seed=0)


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory) -> tuple[str, str]:
    from hybridflow.data.tasks.arithmetic import generate_arithmetic_task

    return generate_arithmetic_task(tmp_path_factory.mktemp("arith"), num_train=128, num_val=16, seed=0,
                                    max_operands=2)
