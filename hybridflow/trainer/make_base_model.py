"""Regenerate the built-in task's shipped base policy: a random-init tiny model + `hybridflow sft` on the task.

    python -m hybridflow.trainer.make_base_model                 # writes hybridflow/assets/arithmetic_base
    python -m hybridflow.trainer.make_base_model --out DIR --sft-steps 40   # a smaller run (the test uses this)

The recipe is deliberately short: the base should be competent (it writes the answer format) but far from perfect
(held-out accuracy around 20-40%), leaving room for RL to show what it adds. The SFT data states 40% of the answers
as "answer: N", which the verifier rejects (see hybridflow/data/builtin.py), so the base knows more than it states
verifiably: greedy decoding picks the majority format, sampling at temperature 1 often does not. How fast a
0.4M-parameter model learns two-digit arithmetic varies a lot from run to run, so instead of a fixed step count the
recipe stops SFT the first time greedy accuracy on the task's validation prompts reaches TARGET_ACCURACY (checked
every EVAL_EVERY steps, at most SFT_STEPS steps); sampled accuracy (the main job's headline) is then about 20-40%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from hybridflow.data.builtin import ASSETS, ensure_builtin_task_files
from hybridflow.engines.tiny import TinyModelSpec, write_tiny_model
from hybridflow.protocol import DataProto

BASE_SPEC = TinyModelSpec(arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                          intermediate_size=384, max_position_embeddings=256)
SFT_STEPS = 3000
EVAL_EVERY = 250
TARGET_ACCURACY = 0.5
SFT_BATCH = 64
SFT_LR = 3e-3
SEED = 0


def heldout_accuracy(model_path: str, val_file: str, *, greedy: bool = True, n: int = 1, max_rows: int = 256,
                     max_new_tokens: int = 16, seed: int = 0) -> float:
    """Held-out accuracy with the native rollout engine and the built-in verifier: greedy, or the mean over `n`
    samples per prompt at temperature 1."""
    from transformers import AutoTokenizer

    from hybridflow.data import RLDataLoader, RLDataset
    from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
    from hybridflow.rewards import RewardManager

    tok = AutoTokenizer.from_pretrained(model_path)
    ds = RLDataset(val_file, tok, max_prompt_length=64, name="val").head(max_rows)
    batch = next(iter(RLDataLoader(ds, len(ds), shuffle=False, drop_last=False)))
    engine = create_rollout_engine("native", model_path, dtype="fp32", seed=seed)
    rm = RewardManager(tok, num_workers=1)
    try:
        params = SamplingParams(greedy=greedy, n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed)
        out = engine.generate(batch.select(["input_ids", "attention_mask", "position_ids"]), params)
        rows = batch.select([], non_tensor_keys=list(batch.non_tensor_batch)).repeat(n, interleave=True)
        rows.union(DataProto(batch=out.batch))
        return float(rm(rows).scores.mean())
    finally:
        rm.close()


def greedy_accuracy(model_path: str, val_file: str, max_rows: int = 256) -> float:
    return heldout_accuracy(model_path, val_file, greedy=True, max_rows=max_rows)


def make_base_model(out_dir: str, sft_steps: int = SFT_STEPS, *, batch_size: int = SFT_BATCH, lr: float = SFT_LR,
                    seed: int = SEED, threads: int | None = None, target_accuracy: float | None = TARGET_ACCURACY,
                    eval_every: int = EVAL_EVERY) -> dict:
    from hybridflow.trainer.sft_trainer import load_sft_config, run_sft

    train, val = ensure_builtin_task_files()
    work = tempfile.mkdtemp(prefix="hybridflow-base-")
    try:
        init = write_tiny_model(os.path.join(work, "init"), BASE_SPEC, seed=seed)
        cfg = load_sft_config([
            f"data.train_files={train}", "data.response_key=extra_info.response", "data.max_length=96",
            f"data.train_batch_size={batch_size}", f"data.micro_batch_size_per_gpu={batch_size}",
            f"model.path={init}", f"optim.lr={lr}", f"trainer.total_training_steps={sft_steps}",
            f"trainer.default_local_dir={os.path.join(work, 'sft')}", "trainer.backend=local",
            f"trainer.seed={seed}", "trainer.logger=[jsonl]", "optim.lr_scheduler_type=constant",
            "optim.warmup_ratio=0.02", *([f"trainer.num_threads_per_worker={threads}"] if threads else []),
        ])
        probes: list[dict] = []

        def reached_target(model_dir: str, step: int) -> bool:
            acc = greedy_accuracy(model_dir, val)
            probes.append({"step": step, "val_greedy_accuracy": acc})
            print(f"SFT step {step}: held-out greedy accuracy {acc:.3f}", flush=True)
            return target_accuracy is not None and acc >= target_accuracy

        summary = run_sft(cfg, eval_every=eval_every if target_accuracy is not None else 0, stop_when=reached_target)
        acc = greedy_accuracy(summary["model_dir"], val)
        sampled = heldout_accuracy(summary["model_dir"], val, greedy=False, n=4)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        shutil.copytree(summary["model_dir"], out_dir)
        info = {"sft_steps": summary["steps"], "max_sft_steps": sft_steps, "target_accuracy": target_accuracy,
                "probes": probes, "batch_size": batch_size, "lr": lr, "seed": seed,
                "final_nll": summary["final_nll"], "val_greedy_accuracy": acc, "val_sampled_mean_at_4": sampled,
                "params": sum(t.numel() for t in _load_weights(out_dir).values())}
        with open(os.path.join(out_dir, "hybridflow_base.json"), "w") as f:
            json.dump(info, f, indent=1)
        return info
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ASSETS, "arithmetic_base"))
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    p.add_argument("--batch-size", type=int, default=SFT_BATCH)
    p.add_argument("--lr", type=float, default=SFT_LR)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--target-accuracy", type=float, default=TARGET_ACCURACY,
                   help="stop SFT once held-out greedy accuracy reaches this (negative: run all steps)")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY)
    a = p.parse_args(argv)
    target = a.target_accuracy if a.target_accuracy >= 0 else None
    info = make_base_model(a.out, a.sft_steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed, threads=a.threads,
                           target_accuracy=target, eval_every=a.eval_every)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
