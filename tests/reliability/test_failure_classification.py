"""A group call's failure is judged by the whole group's state: a rank that raised because a peer died is a death
(restartable), a rank that raised on its own is a deterministic error (not restarted). Real Ray, real gloo."""

from __future__ import annotations

import time

import pytest
from peer_workers import PeerWorker, ship_by_value

from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup, WorkerGroupError
from hybridflow.single_controller import errors as errors_mod
from hybridflow.single_controller.errors import lost_a_peer


def _group(name: str) -> WorkerGroup:
    ship_by_value()
    pool = ResourcePool(process_on_nodes=[2], num_cpus_per_process=0.5, name=f"{name}_pool")
    wg = WorkerGroup(pool, ClassWithInitArgs(PeerWorker), name_prefix=name, call_timeout_s=120)
    wg.init_model()
    return wg


def _fail(wg: WorkerGroup, plan: dict) -> WorkerGroupError:
    try:
        with pytest.raises(WorkerGroupError) as e:
            wg.act(plan)
        return e.value
    finally:
        wg.shutdown()


def test_gloo_peer_loss_message_is_recognised(ray_session, tmp_path):
    """What gloo really says when the peer of an all_reduce is SIGKILLed must read as a lost peer."""
    wg = _group("gloo_words")
    try:
        with pytest.raises(WorkerGroupError) as e:
            wg.all_reduce_and_record(1, str(tmp_path / "err"))
        assert e.value.kind == "died"
        deadline = time.monotonic() + 30
        while not (tmp_path / "err.0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = (tmp_path / "err.0").read_text()
    finally:
        wg.shutdown()
    assert lost_a_peer(text), f"gloo's error is not in PEER_LOST_PATTERNS: {text!r}"


def test_rank_raising_peer_reset_before_the_death_is_reported_is_a_death(ray_session):
    # Rank 0's error arrives first (the race of issue 23); the death of rank 1 follows a second later.
    err = _fail(_group("echo_first"), {0: "raise:[gloo] Read error [127.0.0.1]:5: Connection reset by peer", 1: "die:1"})
    assert err.kind == "died" and err.rank == 1
    assert "Connection reset by peer" in str(err)  # the echo is reported beside the death


def test_plain_raise_followed_by_a_peer_death_is_a_death(ray_session):
    err = _fail(_group("raise_then_die"), {0: "raise:something unrelated", 1: "die:1"})
    assert err.kind == "died" and err.rank == 1 and "something unrelated" in str(err)


def test_peer_reset_whose_death_is_never_seen_is_still_a_death(ray_session, monkeypatch):
    monkeypatch.setattr(errors_mod, "SETTLE_S", 2.0)
    t0 = time.monotonic()
    err = _fail(_group("reset_alone"), {0: "raise:Connection closed by peer [127.0.0.1]:5", 1: "sleep:30"})
    assert err.kind == "died" and err.rank == 0 and "lost a peer" in str(err)
    assert time.monotonic() - t0 < 25  # bounded by the settle time, not by the sleeping rank


def test_a_rank_raising_on_its_own_is_deterministic(ray_session, monkeypatch):
    monkeypatch.setattr(errors_mod, "SETTLE_S", 2.0)
    err = _fail(_group("alone_ok"), {0: "raise:bad shape", 1: "sleep:0.5"})
    assert err.kind == "raised" and err.rank == 0 and "bad shape" in str(err)
    t0 = time.monotonic()
    err = _fail(_group("alone_hang"), {0: "raise:bad shape", 1: "sleep:30"})
    assert err.kind == "raised" and err.rank == 0
    assert time.monotonic() - t0 < 25
