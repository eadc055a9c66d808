"""Trackers write what their own tools can read; the JSONL file is exact; the progress bar suits TTYs and CI logs."""

from __future__ import annotations

import fcntl
import glob
import io
import json
import os
import select
import struct
import sys
import termios

import numpy as np
import pytest
import torch

from hybridflow.trainer.progress import ProgressBar
from hybridflow.trainer.tracking import Tracking, TrackingConfigError, logger_errors, mlflow_metric_name

STEP1 = {"critic/score/mean": 0.25, "actor/pg_loss": torch.tensor(-0.5), "response_length/max": np.int64(12)}
STEP2 = {"critic/score/mean": 0.75, "actor/pg_loss": float("nan"), "val/gsm8k/mean@1": 0.5}


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_jsonl_rows_are_exact_sorted_and_flushed(tmp_path):
    tr = Tracking(str(tmp_path), loggers=["console"], console_stream=io.StringIO())  # jsonl is always on
    tr.log(STEP1, step=1)
    # readable before finish(): every row is flushed, a crash loses nothing
    assert _lines(tr.metrics_path) == [
        '{"step": 1, "actor/pg_loss": -0.5, "critic/score/mean": 0.25, "response_length/max": 12}'
    ]
    tr.log(dict(reversed(list(STEP2.items()))), step=2)  # insertion order does not matter
    tr.finish()
    tr.finish()  # idempotent
    assert _lines(tr.metrics_path)[1] == (
        '{"step": 2, "actor/pg_loss": null, "critic/score/mean": 0.75, "val/gsm8k/mean@1": 0.5}'
    )
    with pytest.raises(RuntimeError, match="after finish"):
        tr.log({"a": 1.0}, step=3)


def test_jsonl_resume_drops_rows_logged_after_the_checkpoint(tmp_path):
    with Tracking(str(tmp_path), loggers="jsonl") as tr:
        for step in range(1, 6):
            tr.log({"x": float(step)}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x": 6.')  # the crash cut this row short
    with Tracking(str(tmp_path), loggers=["jsonl"], resume_from_step=3) as tr:
        tr.log({"x": 4.5}, step=4)
    assert [json.loads(line)["x"] for line in _lines(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0, 4.5]
    with Tracking(str(tmp_path), loggers=["jsonl"]) as tr:
        tr.rewind(2)
        tr.log({"x": 3.5}, step=3)
    assert [json.loads(line)["x"] for line in _lines(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.5]


def test_console_table_is_readable(tmp_path):
    out = io.StringIO()
    with Tracking(str(tmp_path), loggers=["console"], console_stream=out) as tr:
        tr.log({**STEP1, "timing/step": 3.25, "other/key": 1.0}, step=1)
        tr.log({**STEP2, "val/gsm8k/pass@4": 0.75, "val/gsm8k/mean@4": 0.375}, step=2)
    lines = out.getvalue().splitlines()
    # headline columns only, in the default order; "other/key" and response_length/max are not headline metrics
    assert lines[0].split() == ["step", "score/mean", "actor/pg_loss", "timing/step"]
    assert lines[1].split() == ["1", "0.2500", "-0.5000", "3.2500"]
    # step 2 has other columns -> a new header, then its row, then validation on its own line
    assert lines[2].split() == ["step", "score/mean", "actor/pg_loss"]
    assert lines[3].split() == ["2", "0.7500", "nan"]
    assert lines[4].strip() == "validation @ step 2: gsm8k/mean@1=0.5000  gsm8k/mean@4=0.3750"
    assert len(lines) == 5
    custom = io.StringIO()
    with Tracking(
        str(tmp_path / "b"), loggers=["console"], console_keys=["response_length/"], console_stream=custom
    ) as tr:
        tr.log(STEP1, step=7)
    assert custom.getvalue().splitlines()[1].split() == ["7", "12"]


def test_unknown_logger_lists_valid_ones(tmp_path):
    with pytest.raises(TrackingConfigError, match=r"unknown logger\(s\) \['tensorbord'\].*'tensorboard'"):
        Tracking(str(tmp_path), loggers=["console", "tensorbord"])


@pytest.mark.parametrize("logger,module", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail as if it were not installed
    with pytest.raises(TrackingConfigError, match=r"pip install 'hybridflow\[tracking\]'") as err:
        Tracking(str(tmp_path), loggers=["jsonl", logger])
    assert repr(logger) in str(err.value)


def test_logger_errors_finds_what_tracking_would_refuse_without_importing(monkeypatch):
    assert logger_errors(["console", "jsonl", "tensorboard", "wandb", "mlflow"]) == []  # the tracking extra is in
    assert logger_errors("console,tensorbord") == [
        "unknown logger(s) ['tensorbord'] in trainer.logger=['console', 'tensorbord']; valid loggers are "
        "['console', 'jsonl', 'tensorboard', 'wandb', 'mlflow']"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    errors = logger_errors(["console", "wandb", "mlflow", "wandb"])
    assert len(errors) == 2 and "'wandb'" in errors[0] and "'mlflow'" in errors[1]
    assert all("pip install 'hybridflow[tracking]'" in e for e in errors)


def test_tensorboard_event_file_is_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracking(str(tmp_path), loggers=["tensorboard"], config={"trainer": {"total_steps": 2}}) as tr:
        tr.log(STEP1, step=1)
        tr.log(STEP2, step=2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("response_length/max")] == [(1, 12.0)]
    assert acc.Scalars("val/gsm8k/mean@1")[0].value == 0.5


def test_mlflow_run_is_found_in_the_local_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # Tracking sets it for its default file store
    from mlflow.tracking import MlflowClient

    cfg = {"algorithm": {"adv_estimator": "grpo"}, "data": {"train_batch_size": 8}}
    with Tracking(str(tmp_path), loggers=["mlflow"], project="proj", experiment="exp1", config=cfg) as tr:
        tr.log(STEP1, step=1)
    with Tracking(str(tmp_path), loggers=["mlflow"], project="proj", experiment="exp1") as tr:  # resumed
        tr.log(STEP2, step=2)
    client = MlflowClient(tracking_uri="file:" + str(tmp_path / "mlruns"))
    exp = client.get_experiment_by_name("proj")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the resumed session continued the same run
    run = runs[0]
    assert run.info.run_name == "exp1" and run.info.status == "FINISHED"
    assert run.data.params == {"algorithm.adv_estimator": "grpo", "data.train_batch_size": "8"}
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    key = mlflow_metric_name("val/gsm8k/mean@1")
    assert key == "val/gsm8k/mean_at_1"
    assert [m.value for m in client.get_metric_history(run.info.run_id, key)] == [0.5]


def test_wandb_offline_run_directory_is_created(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracking(str(tmp_path), loggers=["wandb"], project="proj", experiment="exp1", config={"lr": 1e-6}) as tr:
        tr.log(STEP1, step=1)
        tr.log(STEP2, step=2)
    run_id = json.loads((tmp_path / "tracking_ids.json").read_text())["wandb"]
    run_dirs = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}"))
    assert len(run_dirs) == 1
    data_file = os.path.join(run_dirs[0], f"run-{run_id}.wandb")
    with open(data_file, "rb") as f:
        data = f.read()
    assert b"critic/score/mean" in data and b"val/gsm8k/mean@1" in data


# ---------------------------------------------------------------------------------------------------- progress
def test_progress_without_tty_prints_plain_lines():
    out = io.StringIO()
    pb = ProgressBar(total_steps=10, initial=2, stream=out, print_every=4)
    for step in range(3, 11):
        pb.update(step, {"critic/score/mean": 0.5 + step / 100, "actor/entropy": 1.25})
    pb.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "training step 4/10 (40%)",
        "training step 8/10 (80%)",
        "training step 10/10 (100%)",
    ]
    assert "score 0.58" in lines[1] and "entropy 1.25" in lines[1] and "eta 0:00:00" in lines[2]


@pytest.mark.parametrize("columns", [120, 0])  # 0: a tty that reports no size (some containers)
def test_progress_on_a_tty_redraws_in_place(columns):
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert tty.isatty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
            pb = ProgressBar(total_steps=3, stream=tty)
            for step in (1, 2, 3):
                pb.update(step, {"critic/score/mean": 0.125})
            pb.close()
            tty.flush()
        chunks = []
        while select.select([master], [], [], 0.2)[0]:
            chunks.append(os.read(master, 65536))
        text = b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)
    assert "\r" in text and "3/3" in text and "score=0.125" in text


def test_progress_resumed_run_counts_from_the_checkpoint():
    out = io.StringIO()
    pb = ProgressBar(total_steps=100, stream=out, print_every=50)
    assert pb.eta_seconds() is None  # nothing done yet: no pace to extrapolate
    pb.start_at(90)  # resumed from a checkpoint at step 90
    pb.update(100, {})
    assert out.getvalue().startswith("training step 100/100 (100%)")
    assert pb.eta_seconds() == 0.0


def test_progress_disabled_prints_nothing():
    out = io.StringIO()
    pb = ProgressBar(total_steps=2, disable=True, stream=out)
    pb.update(1, {})
    pb.update(2, {})
    pb.close()
    assert out.getvalue() == ""
