"""Checkpoint, model and data files fail with their path (issue 23, item 4): garbage in the latest pointer, a cut-off
model .safetensors, a run folder where a checkpoint is expected, a parquet file with no rows."""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.data import DataConfigError, RLDataset
from hybridflow.engines.tiny import build_char_tokenizer
from hybridflow.trainer.checkpoint import LATEST_FILE, CheckpointError, CheckpointManager
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import resolve_defaults
from hybridflow.trainer.run_dir import RunDirError, prepare_run_dir


def _commit(mgr: CheckpointManager, step: int) -> str:
    tmp = mgr.staging_dir(step)
    with open(os.path.join(tmp, "weights.bin"), "wb") as f:
        f.write(b"\0" * 64)
    return mgr.commit(tmp, step, {"global_step": step})


def test_garbage_bytes_in_the_latest_pointer(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    _commit(mgr, 1)
    pointer = os.path.join(mgr.root, LATEST_FILE)
    with open(pointer, "wb") as f:
        f.write(b"\xff\xfe\x00garbage\x81")
    with pytest.raises(CheckpointError) as e:
        mgr.resolve("auto")
    assert pointer in str(e.value) and "Delete it" in str(e.value)
    with pytest.raises(RunDirError, match="was not written by hybridflow"):  # before the first step, with the path
        prepare_run_dir(mgr.root, resume_mode="auto", overwrite=False, total_steps=2, save_freq=1)


def test_truncated_model_safetensors_names_the_file(tiny_model_path, arithmetic_files, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    train, val = arithmetic_files
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", f"data.val_files={val}"])
    with pytest.raises(ValueError) as e:
        resolve_defaults(cfg)
    msg = str(e.value)
    assert str(weights) in msg and "truncated" in msg and "actor_rollout_ref.model.path" in msg
    assert len(msg.splitlines()) == 1


def test_run_folder_where_a_checkpoint_is_expected(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    _commit(mgr, 1)
    with pytest.raises(CheckpointError) as e:
        mgr.resolve(mgr.root)
    msg = str(e.value)
    assert "is a run folder, not a checkpoint" in msg and "global_step_N" in msg and "cut off" not in msg
    assert f"trainer.default_local_dir={mgr.root}" in msg


def test_empty_parquet_names_the_file(tmp_path):
    path = tmp_path / "empty.parquet"
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.string())])
    pq.write_table(pa.Table.from_pylist([], schema=schema), path)
    with pytest.raises(DataConfigError) as e:
        RLDataset(str(path), build_char_tokenizer())
    msg = str(e.value)
    assert str(path) in msg and "has no rows" in msg and "max_prompt_length" not in msg
