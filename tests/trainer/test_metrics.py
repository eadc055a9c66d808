"""Metric math: batch statistics, timings, throughput, pass@k / maj@k against brute-force references."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.engines.rollout.onednn_linear import onednn_available
from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import (
    Timer,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    compute_validation_metrics,
    dense_transformer_flops,
    machine_peak_flops,
    majority_vote,
    measure_peak_flops,
    pass_at_k,
    reduce_metrics,
    without_timing,
)


def _batch(meta=None) -> DataProto:
    # 3 rows, prompt length P=3 (left-padded), response length R=4 (right-padded)
    attention_prompt = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    scores = torch.zeros(3, 4)
    scores[0, 1], scores[1, 3], scores[2, 0] = 1.0, 0.0, 0.5
    rewards = scores.clone()
    rewards[0, 0] = -0.25  # a per-token KL penalty
    advantages = torch.tensor([[1.0, 2.0, 99.0, 99.0], [-1.0, -2.0, -3.0, -4.0], [5.0, 99.0, 99.0, 99.0]])
    returns = torch.tensor([[1.0, 1.0, 0, 0], [0.0, 0.0, 0.0, 0.0], [0.5, 0, 0, 0]])
    values = torch.tensor([[0.5, 1.0, 7, 7], [0.0, 0.5, 0.0, 0.0], [0.5, 7, 7, 7]])
    return DataProto.from_dict(
        {
            "prompts": torch.ones(3, 3, dtype=torch.long),
            "responses": torch.ones(3, 4, dtype=torch.long),
            "attention_mask": torch.cat([attention_prompt, response_mask.long()], dim=1),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": advantages,
            "returns": returns,
            "values": values,
        },
        meta_info=meta or {},
    )


def test_data_metrics_hand_computed():
    m = compute_data_metrics(_batch({"max_response_length": 4}), use_critic=True)
    assert m["critic/score/mean"] == pytest.approx(0.5)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, 0.0)
    assert m["critic/rewards/mean"] == pytest.approx((0.75 + 0.0 + 0.5) / 3)
    assert m["critic/rewards/min"] == 0.0
    # masked: the 99s on padding must not count; valid tokens 1,2,-1,-2,-3,-4,5
    assert m["critic/advantages/mean"] == pytest.approx(-2 / 7)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == (5.0, -4.0)
    assert m["critic/values/max"] == 1.0  # the 7s are padding
    returns = np.array([1, 1, 0, 0, 0, 0, 0.5])
    values = np.array([0.5, 1.0, 0, 0.5, 0, 0, 0.5])
    assert m["critic/vf_explained_var"] == pytest.approx(1 - np.var(returns - values) / np.var(returns))
    assert m["response_length/mean"] == pytest.approx(7 / 3)
    assert (m["response_length/max"], m["response_length/min"]) == (4.0, 1.0)
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(2.0)
    assert (m["prompt_length/max"], m["prompt_length/min"]) == (3.0, 1.0)


def test_data_metrics_skips_what_is_absent():
    b = _batch()
    m = compute_data_metrics(b, use_critic=False)
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m
    assert "response_length/clip_ratio" not in m  # no max length known: R is just this batch's longest response
    assert compute_data_metrics(b, use_critic=False, max_response_length=8)["response_length/clip_ratio"] == 0.0
    only_scores = DataProto.from_dict({"token_level_scores": torch.tensor([[0.0, 2.0], [1.0, 0.0]])})
    assert compute_data_metrics(only_scores, use_critic=True) == {
        "critic/score/mean": 1.5,
        "critic/score/max": 2.0,
        "critic/score/min": 1.0,
    }


def test_timer_timing_and_throughput():
    timing: dict[str, float] = {}
    with Timer("generate", timing):
        time.sleep(0.02)
    with Timer("generate", timing):  # a stage entered twice in one step adds up
        time.sleep(0.02)
    assert 0.035 < timing["generate"] < 1.0
    t = {"generate": 2.0, "update_actor": 1.0, "step": 4.0}
    m = compute_timing_metrics(t, num_tokens=500)
    assert m["timing/step"] == 4.0 and m["timing/generate"] == 2.0
    assert m["timing_per_token_ms/generate"] == pytest.approx(4.0)
    p = compute_throughput_metrics(t, num_tokens=1000, num_ranks=2, flops=8e12, peak_flops=1e12)
    assert p == {
        "perf/time_per_step": 4.0,
        "perf/tokens_per_s": 250.0,
        "perf/tokens_per_s_per_rank": 125.0,
        "perf/mfu": pytest.approx(1.0),
    }
    assert "perf/mfu" not in compute_throughput_metrics(t, 1000, 2)
    assert without_timing({**m, **p, "actor/pg_loss": 0.5}) == {"actor/pg_loss": 0.5}
    assert dense_transformer_flops(10, 3, training=True) == 180.0


def test_measure_peak_flops_is_positive_and_plausible():
    peak = measure_peak_flops("cpu", size=128, repeats=2)
    assert 1e6 < peak < 1e15


def test_the_cpu_peak_is_the_best_kernel_not_only_torch_matmul():
    """On CPU the peak is taken over torch.matmul and oneDNN (where this torch has it), so a slow BLAS path cannot
    inflate the MFU; the per-kernel rates are what measure_peak_flops takes the max of."""
    from hybridflow.common.metrics import matmul_peaks

    rates = matmul_peaks("cpu", size=(96, 128), repeats=2)
    assert "torch.matmul" in rates and all(1e6 < r < 1e15 for r in rates.values())
    if onednn_available(torch.float32):
        assert "onednn" in rates


def test_reduce_metrics():
    out = reduce_metrics([{"a": 1.0, "b": torch.tensor(2.0)}, {"a": 3.0}, {"c": np.float32(4.0), "b": 4.0}])
    assert out == {"a": 2.0, "b": 3.0, "c": 4.0}
    assert list(out) == ["a", "b", "c"]


def test_reduce_metrics_keeps_extremes():
    """The step's largest mismatch is the largest micro-batch's (and rank's), not their mean."""
    out = reduce_metrics([{"actor/rollout_mismatch_max_abs": 1e-5, "actor/rollout_mismatch_mean_abs": 1e-6,
                           "actor/is_weight_max": 1.5, "x_min": 2.0},
                          {"actor/rollout_mismatch_max_abs": 3e-5, "actor/rollout_mismatch_mean_abs": 3e-6,
                           "actor/is_weight_max": 1.1, "x_min": -1.0}])
    assert out == {"actor/rollout_mismatch_max_abs": 3e-5, "actor/rollout_mismatch_mean_abs": 2e-6,
                   "actor/is_weight_max": 1.5, "x_min": -1.0}


# ---------------------------------------------------------------------------------------------------- validation
def _brute_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_pass_at_k_equals_all_subsets(correct, data):
    k = data.draw(st.integers(1, len(correct)))
    assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(_brute_pass_at_k(correct, k), abs=1e-12)


def test_validation_metrics_hand_computed():
    # source "a": 2 prompts x 4 samples; source "b": 1 prompt x 4 samples. Row order interleaves sources.
    sources = ["a"] * 4 + ["b"] * 4 + ["a"] * 4
    pids = [0] * 4 + [0] * 4 + [1] * 4
    scores = [*[1, 0, 0, 1], *[0, 0, 0, 0], *[0, 1, 1, 1]]
    answers = [*["x", "y", "y", "x"], *[None] * 4, *["p", "q", "q", "q"]]
    m = compute_validation_metrics(sources, pids, scores, answers=answers, n=4)
    assert m["val/a/mean@1"] == 0.5  # first samples: 1 and 0
    assert m["val/a/mean@4"] == pytest.approx((0.5 + 0.75) / 2)
    assert m["val/a/pass@1"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert m["val/a/pass@2"] == pytest.approx(((1 - 1 / 6) + 1.0) / 2)  # 1 correct of 4: C(2,2)/C(4,2) fail
    assert m["val/a/pass@4"] == 1.0
    # maj@4: prompt 0 ties x:2 y:2 -> "x" appears first -> score 1; prompt 1 -> "q" -> 1
    assert m["val/a/maj@4"] == 1.0
    # maj@2 prompt 0, all 6 pairs in order: (x,y)->x 1,(x,y)->x 1,(x,x)->1,(y,y)->0,(y,x)->y 0,(y,x)->y 0 -> 3/6
    # maj@2 prompt 1: (p,q)->p 0 x3, (q,q)->1 x3 -> 1/2
    assert m["val/a/maj@2"] == pytest.approx(0.5)
    assert m["val/a/num_prompts"] == 2 and m["val/b/num_prompts"] == 1
    assert m["val/b/pass@4"] == 0.0 and m["val/b/maj@4"] == 0.0
    assert next(iter(m)) == "val/a/mean@1"  # sources in order of first appearance
    assert not any(k.endswith("maj@1") for k in m)


def test_validation_pass_at_k_set_and_threshold():
    m = compute_validation_metrics(["s"] * 6, [7] * 6, [0.1, 0.1, 0.1, 0.1, 0.1, 1.0], n=6)
    assert sorted(k for k in m if "pass@" in k) == ["val/s/pass@1", "val/s/pass@2", "val/s/pass@4", "val/s/pass@6"]
    assert m["val/s/pass@1"] == pytest.approx(1 / 6)  # 0.1 is a format score, not a correct answer
    lenient = compute_validation_metrics(["s"] * 6, [7] * 6, [0.1] * 5 + [1.0], n=6, correct_threshold=0.1)
    assert lenient["val/s/pass@1"] == 1.0
    assert "val/s/maj@2" not in m  # no answers given
    single = compute_validation_metrics(["s"], ["q"], [1.0], n=1)
    assert single == {"val/s/mean@1": 1.0, "val/s/pass@1": 1.0, "val/s/num_prompts": 1}


def test_majority_vote_ties_and_abstentions():
    assert majority_vote(["b", "a", "a", "b"], [0, 1, 1, 0]) == 0.0  # tie -> first seen ("b")
    assert majority_vote([None, "a", None], [1, 0.5, 1]) == 0.5  # None does not vote
    assert majority_vote([None, None], [0.25, 1]) == 0.25  # nobody votes -> first sample


def test_maj_at_k_matches_subset_enumeration_and_sampling_is_seeded():
    rng = np.random.default_rng(3)
    answers = [str(a) for a in rng.integers(0, 3, size=8)]
    scores = [1.0 if a == "1" else 0.0 for a in answers]
    m = compute_validation_metrics(["s"] * 8, [0] * 8, scores, answers=answers, n=8, max_subsets=10**6)
    for k in (2, 4, 8):
        subsets = list(itertools.combinations(range(8), k))
        ref = np.mean([majority_vote([answers[i] for i in s], [scores[i] for i in s]) for s in subsets])
        assert m[f"val/s/maj@{k}"] == pytest.approx(ref)
    sampled = [
        compute_validation_metrics(["s"] * 8, [0] * 8, scores, answers=answers, n=8, seed=seed, max_subsets=20)
        for seed in (0, 0, 1)
    ]
    assert sampled[0] == sampled[1]
    assert abs(sampled[0]["val/s/maj@4"] - m["val/s/maj@4"]) < 0.35


def test_validation_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"prompt 1 has 1 validation samples, expected n=2"):
        compute_validation_metrics(["s"] * 3, [0, 0, 1], [1, 1, 1], n=2)
    with pytest.raises(ValueError, match="one entry per sample"):
        compute_validation_metrics(["s"] * 2, [0], [1, 1], n=2)


def test_machine_peak_is_measured_once_and_kept_per_key(tmp_path, monkeypatch):
    """The driver and every training rank ask for the peak at start-up: measured once per machine, dtype and thread
    count, then read from the file; a broken file is measured over; 'off' always measures."""
    from hybridflow.common import metrics as common_metrics

    cache = tmp_path / "sub" / "peak.json"
    monkeypatch.setenv("HYBRIDFLOW_PEAK_FLOPS_CACHE", str(cache))
    measured = []

    def fake_measure(device, dtype, num_threads=None):
        measured.append((dtype, num_threads))
        return 1e9 * len(measured)

    monkeypatch.setattr(common_metrics, "measure_peak_flops", fake_measure)
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 1e9
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 1e9  # read back, not measured
    assert machine_peak_flops("cpu", torch.bfloat16, num_threads=1) == 2e9  # another key
    assert machine_peak_flops("cpu", torch.float32, num_threads=2) == 3e9
    assert measured == [(torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)]
    kept = json.loads(cache.read_text())
    assert sorted(kept.values()) == [1e9, 2e9, 3e9]
    assert all(f"torch {torch.__version__}" in key for key in kept)

    cache.write_text("{not json")
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 4e9
    assert len(json.loads(cache.read_text())) == 1

    monkeypatch.setenv("HYBRIDFLOW_PEAK_FLOPS_CACHE", "off")
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 5e9
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 6e9


def test_machine_peak_keeps_the_better_of_two_concurrent_measurements(tmp_path, monkeypatch):
    """Two processes that both found no value: the file keeps the larger, so a measurement taken at a busy moment
    does not lower the kept peak (which would inflate the MFU)."""
    from hybridflow.common import metrics as common_metrics

    cache = tmp_path / "peak.json"
    monkeypatch.setenv("HYBRIDFLOW_PEAK_FLOPS_CACHE", str(cache))
    monkeypatch.setattr(common_metrics, "measure_peak_flops", lambda device, dtype, num_threads=None: 7e9)
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 7e9
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: 0}))  # an unusable value is measured again

    def measure_while_another_process_writes(device, dtype, num_threads=None):
        cache.write_text(json.dumps({key: 9e9}))
        return 5e9

    monkeypatch.setattr(common_metrics, "measure_peak_flops", measure_while_another_process_writes)
    assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 9e9
    assert json.loads(cache.read_text()) == {key: 9e9}


def test_machine_peak_that_cannot_be_kept_is_returned_and_leaves_no_temporary_file(tmp_path, monkeypatch, caplog):
    """A write that fails half way (a full disk): the run goes on with its measurement, says why it was not kept,
    and no half-written file is left beside the cache."""
    from hybridflow.common import metrics as common_metrics

    monkeypatch.setenv("HYBRIDFLOW_PEAK_FLOPS_CACHE", str(tmp_path / "peak.json"))
    monkeypatch.setattr(common_metrics, "measure_peak_flops", lambda device, dtype, num_threads=None: 3e9)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common_metrics.json, "dump", disk_full)
    with caplog.at_level("WARNING"):
        assert machine_peak_flops("cpu", torch.float32, num_threads=1) == 3e9
    assert "could not keep the measured matmul peak" in caplog.text
    assert list(tmp_path.iterdir()) == []
