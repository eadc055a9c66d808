"""Checks of the engines' accelerator-only paths, for a lent GPU machine; prints one JSON document.

CI has no GPU, so what only happens on one is checked here, in one short run:
  * offload: an engine with param_offload + optimizer_offload holds (almost) no device memory between calls and trains
    to bitwise the same parameters as one without;
  * hybrid engine: an fp32 actor's weights synced into the native rollout (sync time); the rollout's log-probs against
    the actor's for the same tokens (fp32: <= 1e-5; bf16: reported);
  * greedy native == hf (fp32) on the device.
It also runs on CPU (the offload check then says it does not apply), which is how the script itself is tested.

    python benchmarks/gpu_check.py [--size tiny|unit|mid]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridflow import device
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


def make_prompts(batch: int, min_len: int, max_len: int, seed: int, vocab: int = 200) -> DataProto:
    """Left-padded random prompts (token ids 4..vocab)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    ids = torch.zeros(batch, max_len, dtype=torch.long)
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, max_len - n :] = torch.randint(4, vocab, (n,), generator=g)
        mask[i, max_len - n :] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    adv = torch.linspace(-1, 1, mask.shape[0], device=mask.device)[:, None]
    return -(adv * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"], {}


def allocated_mb() -> float | None:
    return torch.cuda.memory_allocated() / 2**20 if device.is_cuda_available() else None


def check_offload(path: str, batch: DataProto) -> dict:
    """Two engines, offload off and on: same parameters after two steps; device memory held between calls."""
    result: dict = {}
    params = {}
    for offload in (False, True):
        before = allocated_mb()
        engine = FSDPEngine(
            EngineConfig(model_path=path, param_offload=offload, optimizer_offload=offload, optim=OptimConfig(lr=1e-3))
        )
        for _ in range(2):
            engine.train_step(batch, pg_loss)
        device.synchronize()
        held = allocated_mb()
        lp = engine.compute_log_prob(batch, temperature=1.0)["log_probs"]
        params[offload] = ({n: t.detach().cpu().clone() for n, t in engine.named_full_parameters()}, lp)
        result["offload_on" if offload else "offload_off"] = {
            "device_mb_held_between_calls": None if held is None else round(held - before, 2),
            "param_device": str(next(engine.model.parameters()).device),
            "optimizer_state_device": sorted({str(v.device) for s in engine.optimizer.state.values()
                                              for v in s.values() if torch.is_tensor(v)}),
        }
        del engine
        device.empty_cache()
    same = all(torch.equal(params[False][0][n], params[True][0][n]) for n in params[False][0])
    result["parameters_bitwise_equal"] = same
    result["log_probs_bitwise_equal"] = torch.equal(params[False][1], params[True][1])
    result["applies"] = device.is_cuda_available()
    return result


def check_hybrid(path: str, batch: DataProto, prompts: DataProto) -> dict:
    """Actor (fp32) -> rollout weight sync, then the train-inference mismatch of a sampled rollout."""
    actor = FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3)))
    actor.train_step(batch, pg_loss)  # the rollout must follow the *updated* weights
    out: dict = {}
    for dtype in ("fp32", "bf16"):
        rollout = create_rollout_engine("native", path, dtype=dtype)
        device.synchronize()
        start = time.perf_counter()
        rollout.update_weights(actor.named_full_parameters())
        device.synchronize()
        sync_s = time.perf_counter() - start
        gen = rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=32, seed=1))
        rollout.release_memory()
        train_lp = actor.compute_log_prob(gen, temperature=1.0)["log_probs"]
        mm = logprob_mismatch(gen.batch["rollout_log_probs"], train_lp, gen.batch["response_mask"])
        out[dtype] = {"sync_seconds": round(sync_s, 4), **{k: float(f"{v:.3g}") for k, v in mm.items()}}
        del rollout
    out["fp32_within_1e-5"] = out["fp32"]["mismatch/max_abs"] <= 1e-5
    return out


def check_greedy(path: str, prompts: DataProto) -> dict:
    params = SamplingParams(greedy=True, max_new_tokens=32)
    got = {name: create_rollout_engine(name, path, dtype="fp32").generate(prompts, params) for name in ("hf", "native")}
    same = torch.equal(got["hf"].batch["responses"], got["native"].batch["responses"])
    return {"greedy_native_equals_hf": same, "rows": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="unit")
    args = parser.parse_args()
    torch.manual_seed(0)
    doc: dict = {
        "benchmark": "gpu_check",
        "device": torch.cuda.get_device_name() if device.is_cuda_available() else "cpu",
        "versions": {"torch": torch.__version__},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(os.path.join(tmp, args.size), args.size, seed=0)
        prompts = make_prompts(16, 4, 12, seed=0)
        sampled = create_rollout_engine("native", path).generate(prompts, SamplingParams(max_new_tokens=24, seed=0))
        batch = sampled.select(["input_ids", "attention_mask", "position_ids", "responses", "response_mask"])
        batch.meta_info = {"temperature": 1.0}
        for name, fn in (
            ("offload", lambda: check_offload(path, batch)),
            ("hybrid", lambda: check_hybrid(path, batch, prompts)),
            ("greedy", lambda: check_greedy(path, prompts)),
        ):
            try:
                doc[name] = fn()
            except Exception as err:  # report every check, even when one breaks
                doc[name] = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
