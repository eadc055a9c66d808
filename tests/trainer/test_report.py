"""`hybridflow report` turns metrics.jsonl + samples.jsonl into PNGs and one self-contained HTML page."""

from __future__ import annotations

import base64
import json
import os
import re

import pytest

from hybridflow.trainer.report import main, make_report, metrics_by_step
from hybridflow.trainer.samples import RolloutSampleWriter, select_extremes
from hybridflow.trainer.tracking import Tracking

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STAGES = ("generate", "reward", "old_log_prob", "update_actor")


def _write_run(run_dir: str, steps: int = 6) -> None:
    with Tracking(run_dir, loggers=["jsonl"]) as tr:
        tr.log({"val/gsm8k/mean@1": 0.1, "val/math/mean@1": 0.05}, step=0)
        for s in range(1, steps + 1):
            metrics = {
                "critic/score/mean": 0.1 * s,
                "critic/rewards/mean": 0.1 * s - 0.01,
                "response_length/mean": 20.0 + s,
                "response_length/max": 32.0,
                "actor/ppo_kl": 0.001 * s,
                "actor/kl_loss": 0.002 * s,
                "actor/entropy": 2.0 - 0.1 * s,
                "timing/step": 1.5,
                **{f"timing/{st}": 0.3 + 0.01 * i for i, st in enumerate(STAGES)},
            }
            tr.log(metrics, step=s)
            if s % 3 == 0:
                tr.log({"val/gsm8k/mean@1": 0.1 + 0.05 * s, "val/math/mean@1": 0.05 * s}, step=s)
    writer = RolloutSampleWriter(run_dir, every_n_steps=2, max_rows=4)
    for s in range(1, steps + 1):
        n = 6
        writer.maybe_write(
            s,
            prompts=[f"What is {i}+{s}? <b>" for i in range(n)],
            responses=[f"answer-{s}-{i}" for i in range(n)],
            scores=[float(i % 3 == 0) + 0.01 * i for i in range(n)],
            rewards=[float(i) for i in range(n)],
            ground_truths=[str(i + s) for i in range(n)],
        )


def _read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _png_size(path: str) -> int:
    data = _read_bytes(path)
    assert data.startswith(PNG_MAGIC), path
    return len(data)


def test_report_writes_plots_and_self_contained_html(tmp_path):
    run = str(tmp_path / "run")
    _write_run(run)
    written = make_report(run)
    assert set(written) == {"reward", "val_accuracy", "response_length", "kl", "entropy", "timing", "html"}
    for name, path in written.items():
        assert os.path.dirname(path) == os.path.join(run, "report")
        if name != "html":
            assert _png_size(path) > 2000
    page = _read(written["html"])
    images = re.findall(r'<img alt="(\w+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    assert [name for name, _ in images] == ["reward", "val_accuracy", "response_length", "kl", "entropy", "timing"]
    for name, data in images:  # the embedded bytes are the PNG files themselves
        assert base64.b64decode(data) == _read_bytes(written[name])
    # samples: written at steps 2, 4, 6; best = row 3 (score 1.03), worst = row 1 (score 0.01); HTML-escaped
    assert page.count("<summary>train step") == 3
    assert "answer-4-3" in page and "answer-4-1" in page and "answer-4-2" not in page
    assert "What is 3+4? &lt;b&gt;" in page and "<b>?" not in page


def test_report_vs_wall_time_uses_cumulative_step_time(tmp_path):
    run = str(tmp_path / "run")
    _write_run(run)
    by_step = metrics_by_step([json.loads(line) for line in _read(os.path.join(run, "metrics.jsonl")).splitlines()])
    assert by_step[3]["val/gsm8k/mean@1"] == pytest.approx(0.25)  # the training and validation rows of step 3 merge
    assert by_step[3]["critic/score/mean"] == pytest.approx(0.3)
    from hybridflow.trainer.report import _wall_time

    assert _wall_time(by_step) == {0: 0.0, 1: 1.5, 2: 3.0, 3: 4.5, 4: 6.0, 5: 7.5, 6: 9.0}


def test_report_skips_missing_plots_and_survives_a_cut_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": null}\n'
        '{"step": 2, "critic/score/mean": 0.7}\n'
        '{"step": 3, "critic/sco'  # killed mid-write
    )
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3"):
        written = make_report(str(run), str(tmp_path / "out"))
    assert set(written) == {"reward", "html"}
    assert _png_size(written["reward"]) > 1000
    page = _read(written["html"])
    assert page.count("data:image/png;base64,") == 1 and "Rollout samples" not in page


def test_report_main_entry_point(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "actor/entropy": 1.5}\n{"step": 2, "actor/entropy": 1.25}\n')
    assert main([str(run), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "r" / "report.html") in out
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_sample_writer_keeps_extremes_every_n_steps(tmp_path):
    assert select_extremes([0.5, 0.1, 0.9, 0.1, 0.7], max_rows=3) == [1, 2, 4]  # best 2 (0.9, 0.7), worst 1 (0.1 first)
    assert select_extremes([1.0, 0.0], max_rows=5) == [0, 1]
    w = RolloutSampleWriter(str(tmp_path), every_n_steps=2, max_rows=2)
    assert not w.maybe_write(1, ["p"], ["r"], [1.0])
    assert w.maybe_write(2, ["p0", "p1", "p2"], ["r0", "r1", "r2"], [0.0, 1.0, 0.5], ground_truths=[{"a": 1}, 2, None])
    rows = [json.loads(line) for line in _read(tmp_path / "samples.jsonl").splitlines()]
    assert rows == [
        {
            "step": 2,
            "split": "train",
            "index": 0,
            "prompt": "p0",
            "response": "r0",
            "score": 0.0,
            "ground_truth": {"a": 1},
        },
        {"step": 2, "split": "train", "index": 1, "prompt": "p1", "response": "r1", "score": 1.0, "ground_truth": 2},
    ]
    with pytest.raises(ValueError, match=r"3 prompts but column lengths \{'scores': 2\}"):
        w.maybe_write(4, ["a", "b", "c"], ["x", "y", "z"], [1.0, 0.0])
