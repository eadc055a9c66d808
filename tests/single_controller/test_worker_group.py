"""WorkerGroup on a real local Ray cluster: dispatch modes, futures, colocation, meshes, failures, the local backend."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from workers_for_tests import (
    BrokenInitWorker,
    ClashingWorker,
    CollectiveWorker,
    EchoWorker,
    ForgetsSuperWorker,
    ProducerWorker,
    RefWorker,
    TensorParallelWorker,
    ship_by_value,
)

from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    ClassWithInitArgs,
    DataProtoFuture,
    ResourcePool,
    WorkerGroup,
    WorkerGroupError,
    create_colocated_worker_groups,
)


def batch(n: int) -> DataProto:
    return DataProto.from_dict(
        {"values": torch.arange(n, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(n)]}, {"step": 1}
    )


@pytest.fixture(scope="module")
def echo(ray_session):
    ship_by_value()
    pool = ResourcePool(process_on_nodes=[2], num_cpus_per_process=0.5, name="echo_pool")
    wg = WorkerGroup(pool, ClassWithInitArgs(EchoWorker, offset=0.5), name_prefix="echo", num_threads=2)
    yield wg
    wg.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_session):
    ship_by_value()
    pool = ResourcePool(process_on_nodes=[2], num_cpus_per_process=0.5, name="coloc_pool")
    groups = create_colocated_worker_groups(
        pool,
        {
            "collective": ClassWithInitArgs(CollectiveWorker),
            "ref": ClassWithInitArgs(RefWorker, 3.0),
            "producer": ClassWithInitArgs(ProducerWorker),
        },
        name_prefix="coloc",
    )
    yield groups
    groups["ref"].shutdown()


# ---------------------------------------------------------------------------------------------- start-up
def test_ranks_know_their_place_and_threads(echo):
    infos = echo.whoami()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert sorted(i["local_rank"] for i in infos) == [0, 1]  # one node
    master = {i["master"] for i in infos}
    assert len(master) == 1 and next(iter(master))[1] > 0
    assert {i["threads"] for i in infos} == {2}  # num_threads applied despite Ray's OMP_NUM_THREADS
    assert len({i["pid"] for i in infos} | {os.getpid()}) == 3
    assert [w["pid"] for w in echo.worker_info] == [i["pid"] for i in infos]
    assert echo.world_size == 2 and echo.name == "echo"


# ---------------------------------------------------------------------------------------------- dispatch modes
def test_one_to_all_all_to_all_and_dp_compute(echo):
    assert echo.echo(1, k="v") == [(0, (1,), {"k": "v"}), (1, (1,), {"k": "v"})]
    assert echo.scale([10, 20], factor=[1, 3]) == [10, 61]
    with pytest.raises(TypeError, match=r"one entry per rank \(2\).*argument 0 is list of length 3"):
        echo.scale([1, 2, 3])


@pytest.mark.parametrize("n", [8, 7, 1])
def test_dp_compute_proto_splits_and_removes_padding(echo, n):
    out = echo.add_offset(batch(n))
    assert len(out) == n
    assert torch.equal(out.batch["values"], torch.arange(n, dtype=torch.float32) + 0.5)
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    per_rank = (n + 1) // 2
    assert out.batch["seen_by"].tolist() == [min(i // per_rank, 1) for i in range(n)]
    assert out.meta_info["rows_on_rank"] == per_rank  # both ranks saw equal (padded) chunks


def test_padding_is_removed_per_output_row_when_a_method_multiplies_rows(echo):
    out = echo.repeat_rows(batch(5), n=3)
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(5) for _ in range(3)]


def test_dp_compute_metric_returns_one_result_per_rank(echo):
    metrics = echo.row_sum(batch(3))  # padded to 4: rank 1 sees rows 2 and the copy of row 0
    assert metrics == [{"rank": 0, "rows": 2, "sum": 1.0}, {"rank": 1, "rows": 2, "sum": 2.0}]


def test_execute_modes(echo):
    before = echo.get_calls()
    assert echo.count_call() == 100 * 0 + before[0] + 1  # RANK_ZERO: everyone runs, rank 0's value
    assert echo.get_calls() == [before[0] + 1, before[1] + 1]
    assert echo.count_call_rank_zero_only() == before[0] + 2
    assert echo.get_calls() == [before[0] + 2, before[1] + 1]  # only rank 0 ran


def test_user_registered_dispatch_mode(echo):
    assert echo.upper("ab") == "Ab"


def test_execute_all_calls_unregistered_methods(echo):
    assert echo.execute_all("not_registered", 5) == [(0, 5), (1, 5)]
    assert echo.execute_rank_zero("not_registered", x=6) == (0, 6)


def test_worker_exception_names_group_method_and_rank(echo):
    with pytest.raises(
        WorkerGroupError, match=r"(?s)echo\.raise_on raised on rank 1 \(node .*, pid \d+\).*boom on rank 1"
    ) as e:
        echo.raise_on(1)
    assert e.value.rank == 1 and e.value.method == "raise_on" and e.value.group == "echo" and e.value.kind == "raised"
    assert echo.raise_on(7) == [0, 1]  # the group is still usable after a method raised


# ---------------------------------------------------------------------------------------------- futures
def test_non_blocking_call_returns_a_future(echo):
    fut = echo.add_offset_async(batch(5))
    assert isinstance(fut, DataProtoFuture)
    out = fut.get()
    assert torch.equal(out.batch["values"], torch.arange(5, dtype=torch.float32) + 0.5)


@pytest.mark.parametrize("n", [6, 5])
def test_future_chained_into_another_group_is_split_by_the_consumer(echo, colocated, n):
    fut = echo.slow_add_offset_async(batch(n))
    t0 = time.monotonic()
    out = colocated["ref"].scaled(fut)  # each ref rank fetches its own rows from the echo ranks' outputs
    assert time.monotonic() - t0 >= 0.4  # the consumer really waited for the producer
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    assert torch.equal(out.batch["values"], (torch.arange(n, dtype=torch.float32) + 0.5) * 3.0)


def test_chained_future_never_passes_through_the_driver(echo, colocated):
    fut = colocated["producer"].produce(batch(7), driver_pid=os.getpid())
    out = echo.add_offset(fut)  # would raise if the poisoned rows were unpickled here
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(7)]
    with pytest.raises(WorkerGroupError, match="deserialised in the driver"):  # the poison works
        colocated["producer"].produce(batch(2), driver_pid=os.getpid()).get()


def test_failed_future_reports_the_producer_in_the_consumer_error(echo, colocated):
    fut = echo.fail_async(batch(4))
    with pytest.raises(
        WorkerGroupError, match=r"(?s)coloc_ref\.scaled raised on rank \d.*echo\.fail_async.*deliberate"
    ):
        colocated["ref"].scaled(fut)
    with pytest.raises(WorkerGroupError, match=r"(?s)echo\.fail_async raised on rank \d.*deliberate"):
        echo.fail_async(batch(4)).get()


# ---------------------------------------------------------------------------------------------- colocation
def test_colocated_roles_share_one_process_per_rank(colocated):
    assert set(colocated) == {"collective", "ref", "producer"}
    ref_pids = colocated["ref"].pid()
    assert colocated["producer"].pid() == ref_pids and len(set(ref_pids)) == 2
    assert colocated["ref"].name == "coloc_ref"


def test_gloo_all_reduce_across_two_ranks_shared_by_colocated_roles(colocated):
    assert colocated["collective"].init_model() == [True, True]
    assert [r["sum"] for r in colocated["collective"].all_reduce_rank()] == [3.0, 3.0]
    assert colocated["ref"].rank_and_dist() == [(0, True), (1, True)]  # the same process group, seen by role "ref"


# ---------------------------------------------------------------------------------------------- mesh-aware dispatch
@pytest.fixture(scope="module")
def tp_group(ray_session):
    """4 ranks, dp=2 x tp=2. The failure test below runs last on it and leaves it broken."""
    ship_by_value()
    pool = ResourcePool(process_on_nodes=[4], num_cpus_per_process=0.5, name="tp_pool")
    wg = WorkerGroup(pool, ClassWithInitArgs(TensorParallelWorker), name_prefix="tp", call_timeout_s=2.0)
    yield wg
    wg.shutdown()


def test_tensor_parallel_peers_get_the_same_chunk_and_only_collectors_return(tp_group):
    wg = tp_group
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2, 3\] have not declared mesh 'actor'"):
        wg.compute(batch(4))
    wg.init_model()
    out = wg.compute(batch(5))  # dp=2: padded to 6, 3 rows per dp rank
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(5)]
    assert torch.equal(out.batch["values"], torch.arange(5, dtype=torch.float32) * 10)
    assert out.batch["seen_by"].tolist() == [0, 0, 0, 2, 2]  # collectors are ranks 0 and 2
    assert wg.chunk_uids(batch(4)) == [[0, "u0", "u1"], [2, "u2", "u3"]]
    wg.record(batch(4))
    assert wg.last_chunk_uids() == [["u0", "u1"], ["u0", "u1"], ["u2", "u3"], ["u2", "u3"]]


# ---------------------------------------------------------------------------------------------- failures
def test_hanging_rank_times_out_and_dead_rank_is_reported(tp_group):
    wg = tp_group  # call_timeout_s=2
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match=r"tp\.sleep_on did not finish within 2\.0 s on rank 0 \(") as e:
        wg.sleep_on(0, 60)
    assert time.monotonic() - t0 < 10 and e.value.kind == "timeout" and e.value.rank == 0

    pid1 = wg.worker_info[1]["pid"]
    os.kill(pid1, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(
        WorkerGroupError, match=rf"tp\.sleep_on failed: the worker process of rank 1 \(node .*, pid {pid1}\) died"
    ) as e:
        wg.sleep_on(-1, 0)  # rank 0 is still busy sleeping: the death must surface anyway
    assert time.monotonic() - t0 < 10 and e.value.kind == "died" and e.value.pid == pid1 and e.value.rank == 1
    wg.shutdown()
    wg.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        wg.sleep_on(-1, 0)


def test_resource_pool_that_cannot_fit_fails_at_once(ray_session):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"2 processes on one node need CPU=2000.*no node has that much"):
        WorkerGroup(ResourcePool([2], num_cpus_per_process=1000, name="huge"), ClassWithInitArgs(EchoWorker))
    with pytest.raises(ValueError, match=r"GPU=1.*use_gpu=True"):
        WorkerGroup(ResourcePool([1], use_gpu=True, name="gpu"), ClassWithInitArgs(EchoWorker))
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="positive ints"):
        ResourcePool([0])


def test_groups_share_a_pool_up_to_max_colocate_count(ray_session):
    ship_by_value()
    pool = ResourcePool([1], num_cpus_per_process=0.5, max_colocate_count=2, name="shared_pool")
    assert pool.bundle() == {"CPU": 1.0} and pool.process_resources()["num_cpus"] == 0.5
    first = WorkerGroup(pool, ClassWithInitArgs(EchoWorker), name_prefix="first")
    second = WorkerGroup(pool, ClassWithInitArgs(RefWorker, 2.0), name_prefix="second")
    assert first.worker_info[0]["node_id"] == second.worker_info[0]["node_id"]
    assert first.whoami()[0]["pid"] != second.pid()[0]  # separate processes in one bundle
    first.shutdown()
    assert second.pid()[0] > 0  # the placement group stays while a group still uses it
    second.shutdown()
    assert pool._slots is None  # ... and goes with the last one


def test_two_unnamed_pools_live_side_by_side_and_verl_keyword_works(ray_session):
    ship_by_value()
    a, b = ResourcePool([1], num_cpus_per_process=0.5), ResourcePool([1], num_cpus_per_process=0.5)
    assert a.name != b.name
    first = WorkerGroup(a, ray_cls_with_init=ClassWithInitArgs(EchoWorker), name_prefix="unnamed_a")
    second = WorkerGroup(b, ClassWithInitArgs(EchoWorker), name_prefix="unnamed_b")
    try:
        assert first.whoami()[0]["pid"] != second.whoami()[0]["pid"]
    finally:
        first.shutdown()
        second.shutdown()
    with pytest.raises(ValueError, match="not both"):
        WorkerGroup(None, ClassWithInitArgs(EchoWorker), ray_cls_with_init=ClassWithInitArgs(EchoWorker),
                    backend="local")


# ---------------------------------------------------------------------------------------------- local backend
def test_local_backend_runs_the_same_worker_class_in_the_driver():
    wg = WorkerGroup(None, ClassWithInitArgs(EchoWorker, offset=0.5), name_prefix="local_echo", backend="local")
    info = wg.whoami()
    assert info[0]["pid"] == os.getpid() and info[0]["rank"] == 0 and info[0]["world_size"] == 1
    out = wg.add_offset(batch(3))
    assert torch.equal(out.batch["values"], torch.tensor([0.5, 1.5, 2.5]))
    fut = wg.add_offset_async(batch(2))
    assert isinstance(fut, DataProtoFuture) and len(fut.get()) == 2
    assert len(wg.add_offset(fut)) == 2  # a local future feeds another call
    assert wg.upper("x") == "X" and wg.count_call() == 1 and wg.row_sum(batch(2))[0]["rows"] == 2
    with pytest.raises(WorkerGroupError, match=r"local_echo\.raise_on raised on rank 0.*boom") as e:
        wg.raise_on(0)
    assert isinstance(e.value.__cause__, KeyError)  # the original exception, for the debugger
    wg.shutdown()


def test_local_backend_colocation_and_distributed_init():
    groups = create_colocated_worker_groups(
        None, {"ref": ClassWithInitArgs(RefWorker, 2.0), "echo": ClassWithInitArgs(EchoWorker)}, backend="local"
    )
    assert groups["ref"].pid() == [os.getpid()]
    fut = groups["echo"].add_offset_async(batch(3))
    assert torch.equal(groups["ref"].scaled(fut).batch["values"], torch.tensor([0.0, 2.0, 4.0]))
    groups["ref"].shutdown()


def test_local_backend_joins_a_one_rank_process_group_in_the_driver():
    import torch.distributed as dist

    assert not dist.is_initialized()
    wg = WorkerGroup(None, ClassWithInitArgs(CollectiveWorker), name_prefix="local_dist", backend="local")
    try:
        assert wg.init_model() == [True]
        assert wg.init_model() == [True]  # idempotent
        assert wg.all_reduce_value(2.5) == [2.5]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # leave the test process as we found it


def test_construction_errors_are_explained():
    with pytest.raises(WorkerGroupError, match=r"broken\.__init__ raised on rank 0.*no checkpoint at /nowhere"):
        WorkerGroup(None, ClassWithInitArgs(BrokenInitWorker), name_prefix="broken", backend="local")
    with pytest.raises(WorkerGroupError, match=r"ForgetsSuperWorker\.__init__ must call super\(\)\.__init__\(\)"):
        WorkerGroup(None, ClassWithInitArgs(ForgetsSuperWorker), backend="local")
    with pytest.raises(ValueError, match=r"ClashingWorker\.shutdown is @register'ed but WorkerGroup has an attribute"):
        WorkerGroup(None, ClassWithInitArgs(ClashingWorker), backend="local")
    with pytest.raises(ValueError, match="backend must be one of"):
        WorkerGroup(None, ClassWithInitArgs(EchoWorker), backend="threads")
    with pytest.raises(ValueError, match="needs a resource_pool"):
        WorkerGroup(None, ClassWithInitArgs(EchoWorker), backend="ray")
