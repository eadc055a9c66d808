"""veRL keys honoured by their own modules: algorithm.use_pf_ppo / pf_ppo.*, trainer.dump_high_diff_tokens / _dir,
actor_rollout_ref.model.use_shm, ref.strategy, rollout.max_model_len / quantization / enable_prefix_caching,
actor.calculate_sum_pi_squared."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.protocol import DataProto
from hybridflow.trainer import shm_model
from hybridflow.trainer.batch_reweight import pf_ppo_resample
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.high_diff_tokens import high_diff_positions
from hybridflow.trainer.main import run_training


def test_a_run_with_pf_ppo_dumps_and_shm(arithmetic_files, tiny_model_path, tmp_path, monkeypatch):
    shm_root = tmp_path / "shm"
    shm_root.mkdir()
    (shm_root / "someone_elses").write_text("not ours")
    monkeypatch.setattr(shm_model, "SHM_ROOT", str(shm_root))
    run_dir, dump_dir = str(tmp_path / "run"), str(tmp_path / "dumps")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local", "algorithm.use_pf_ppo=true",
        "algorithm.pf_ppo.reweight_method=max_random", "trainer.dump_high_diff_tokens=true",
        f"trainer.dump_high_diff_dir={dump_dir}", "actor_rollout_ref.model.use_shm=true",
        "actor_rollout_ref.rollout.max_model_len=64", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"))
    result = run_training(cfg, progress=False)
    assert result.global_step == 2
    # use_shm: the engines loaded the copy, which is gone after the run; what was there before stays
    assert cfg.actor_rollout_ref.model.path.startswith(str(shm_root)) and not os.path.exists(cfg.actor_rollout_ref.model.path)
    assert sorted(os.listdir(shm_root)) == ["someone_elses"]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "pf_ppo/unique_fraction" in r]
    assert len(steps) == 2 and all(0 < r["pf_ppo/unique_fraction"] <= 1 for r in steps)
    assert all("rollout/high_diff_max_prob_diff" in r for r in steps)
    assert all(0 < r["actor/sum_pi_squared"] <= 1 for r in steps)
    for step in (1, 2):
        lines = [json.loads(line) for line in open(os.path.join(dump_dir, f"step_{step}.jsonl"))]
        assert 0 < len(lines) <= 32
        diffs = [x["prob_diff"] for x in lines]
        assert diffs == sorted(diffs, reverse=True)
        for x in lines:
            assert x["step"] == step and isinstance(x["token"], str) and x["uid"]
            assert math.isclose(x["prob_diff"], abs(math.exp(x["rollout_log_prob"]) - math.exp(x["actor_log_prob"])),
                                rel_tol=1e-4, abs_tol=1e-6)


def test_high_diff_positions_and_pf_ppo_resample_by_hand():
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.9, 0.1]]))
    actor = torch.log(torch.tensor([[0.5, 0.1, 0.1], [0.7, 0.9, 0.1]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = high_diff_positions(rollout, actor, mask, k=2)
    assert [(r, p) for r, p, _ in got] == [(1, 0), (0, 1)]  # (0, 2) differs most but is padding
    assert got[0][2] == pytest.approx(0.5) and got[1][2] == pytest.approx(0.4)
    assert len(high_diff_positions(rollout, actor, mask, k=99)) == 5
    batch = DataProto.from_dict({"token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, -1.0]]),
                                 "advantages": torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])})
    batch.non_tensor_batch["uid"] = np.array(["a", "b", "c"], dtype=object)
    alg = SimpleNamespace(pf_ppo=SimpleNamespace(reweight_method="max_min", weight_pow=2.0))
    pf_ppo_resample(batch, alg, seed=1, step=1)
    # max_min keeps the best (a) and the worst (c); rows move with their columns
    assert set(batch.non_tensor_batch["uid"]) <= {"a", "c"}
    for uid, adv in zip(batch.non_tensor_batch["uid"], batch.batch["advantages"][:, 0], strict=True):
        assert float(adv) == {"a": 1.0, "c": 3.0}[uid]


def test_bad_values_are_refused_with_the_key():
    for overrides, match in [
        (["actor_rollout_ref.ref.strategy=megatron"], r"ref\.strategy='megatron': Megatron-LM is not supported"),
        (["algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=maxmin"], r"pf_ppo\.reweight_method: unknown"),
        (["actor_rollout_ref.rollout.max_model_len=100"], r"max_model_len=100 is shorter than .* = 1024"),
        (["actor_rollout_ref.rollout.quantization=fp8"], r"quantization has no effect with .*name=native.*int8"),
        (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.enable_prefix_caching=true"],
         r"enable_prefix_caching has no effect with .*name=hf.*prefills each prompt once"),
        (["trainer.dump_high_diff_tokens=true", "actor_rollout_ref.rollout.calculate_log_probs=false"],
         r"calculate_log_probs=false keeps none"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(overrides)
    for ok in ("fsdp", "fsdp2"):
        assert load_config([f"actor_rollout_ref.ref.strategy={ok}"]).actor_rollout_ref.ref.strategy == ok


def test_use_shm_names_both_sizes_when_shm_is_too_small(tiny_model_path, monkeypatch):
    monkeypatch.setattr(shm_model, "MARGIN_BYTES", 10**15)  # as if /dev/shm were nearly full
    with pytest.raises(ConfigError, match=r"needs \d+\.\d\d GiB but .* has \d+\.\d\d GiB free"):
        load_config([f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.model.use_shm=true"])
    with pytest.raises(ConfigError, match=r"use_shm=true copies the model into the driver node's /dev/shm"):
        load_config([f"actor_rollout_ref.model.path={tiny_model_path}", "actor_rollout_ref.model.use_shm=true",
                     "trainer.nnodes=2"])
