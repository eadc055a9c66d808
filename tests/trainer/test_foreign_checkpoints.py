"""A run folder that holds another program's checkpoints (a veRL run): they are never deleted, pruned, overwritten or
pointed away from; a save that would land on one is refused before training starts."""

from __future__ import annotations

import logging
import os

import pytest

from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager
from hybridflow.trainer.config import ConfigError
from hybridflow.trainer.main import check_checkpoint_folder


def _verl_run(root) -> str:
    actor = root / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (actor / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')
    (actor / "model_world_size_1_rank_0.pt").write_bytes(b"veRL weights")
    (root / "latest_checkpointed_iteration.txt").write_text("3")  # veRL writes the same pointer name
    return str(actor)


def _save(mgr: CheckpointManager, step: int) -> str:
    tmp = mgr.staging_dir(step)
    with open(os.path.join(tmp, "weights.bin"), "w") as f:
        f.write(str(step))
    return mgr.commit(tmp, step, {"global_step": step})


def test_foreign_checkpoints_are_left_alone(tmp_path, caplog):
    actor = _verl_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.checkpoint"):
        mgr = CheckpointManager(str(tmp_path), max_to_keep=1)
    assert any("did not write" in r.getMessage() and "global_step_3" in r.getMessage() for r in caplog.records)
    assert mgr.latest() is None  # never resumed from
    _save(mgr, 1)
    _save(mgr, 2)  # prunes our step 1 (max_to_keep=1), not veRL's step 3
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(actor, "model_world_size_1_rank_0.pt"), "rb").read() == b"veRL weights"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"  # veRL's pointer stays
    assert mgr.latest() == str(tmp_path / "global_step_2")  # ours is still found
    with pytest.raises(CheckpointError, match=r"global_step_3 exists and was not written by hybridflow"):
        _save(mgr, 3)
    assert open(os.path.join(actor, "model_world_size_1_rank_0.pt"), "rb").read() == b"veRL weights"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_a_run_that_would_save_onto_them_is_refused_up_front(tmp_path):
    _verl_run(tmp_path)
    with pytest.raises(ConfigError, match=r"holds \['global_step_3'\], written by another program"):
        check_checkpoint_folder(str(tmp_path), save_freq=1, total_steps=5)
    with pytest.raises(ConfigError, match="global_step_3"):
        check_checkpoint_folder(str(tmp_path), save_freq=-1, total_steps=3)  # the final save is step 3
    check_checkpoint_folder(str(tmp_path), save_freq=2, total_steps=4)  # saves 2 and 4: no clash
    check_checkpoint_folder(str(tmp_path), save_freq=0, total_steps=3)  # no saves at all
