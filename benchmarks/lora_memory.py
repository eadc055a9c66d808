"""Memory of LoRA's reference-as-disabled-adapter vs a full reference copy, on the ~21M-parameter "mid" model.

Each case runs in a fresh process (so RSS is its own): build the engines, one training step on 16 rows, one
reference log-prob pass. Reported per case: bytes of parameters held (all engines), of AdamW state, and the
process's peak RSS (ru_maxrss) and RSS at the end. Cases:
  * ``full_ft+ref``        full fine-tuning actor + a reference engine (the default without LoRA)
  * ``lora+full_ref``      LoRA actor + a reference engine of its own (what a LoRA run costs without disable_adapter)
  * ``lora+disabled_ref``  LoRA actor whose adapter is switched off for the reference pass (what hybridflow does)

    .venv/bin/python benchmarks/lora_memory.py [--rank 8] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CASES = ("full_ft+ref", "lora+full_ref", "lora+disabled_ref")


def run_case(case: str, model_path: str, rank: int) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))
    from test_train_distributed import make_batch, seq_mean_pg_loss

    from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
    from hybridflow.engines.lora import LoraSettings

    torch.set_num_threads(1)
    lora = LoraSettings(rank=rank, alpha=2 * rank) if case.startswith("lora") else LoraSettings()
    actor = FSDPEngine(EngineConfig(model_path=model_path, optim=OptimConfig(lr=1e-3), lora=lora,
                                    micro_batch_size_per_gpu=4))
    ref = None if case == "lora+disabled_ref" else FSDPEngine(EngineConfig(model_path=model_path, role="ref"))
    batch = make_batch(rows=16, prompt_len=32, response_len=32, seed=0)
    actor.train_step(batch, seq_mean_pg_loss)
    if ref is None:
        actor.compute_log_prob(batch, temperature=1.0, base=True)
    else:
        ref.compute_log_prob(batch, temperature=1.0)
    engines = [e for e in (actor, ref) if e is not None]
    params = sum(p.numel() * p.element_size() for e in engines for p in e.model.parameters())
    optim = sum(v.numel() * v.element_size() for s in actor.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v))
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    return {"case": case, "param_bytes": params, "optimizer_state_bytes": optim, "trainable_params": trainable,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "end_rss_bytes": psutil.Process().memory_info().rss}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--model-path", help="a Hugging Face model folder (default: a random-init mid model), e.g. "
                        "SmolLM2 from `hybridflow import-gguf --smollm2 DIR`")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.model_path, args.rank)))
        return
    from benchmarks._common import document, emit
    from hybridflow.engines.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or write_tiny_model(tmp, spec="mid", seed=0)
        results = []
        for case in CASES:
            out = subprocess.check_output([sys.executable, __file__, "--case", case, "--model-path", path,
                                           "--rank", str(args.rank)], text=True, env={**os.environ,
                                                                                       "OMP_NUM_THREADS": "1"})
            results.append(json.loads(out.strip().splitlines()[-1]))
    by_case = {r["case"]: r for r in results}
    saved = by_case["lora+full_ref"]["param_bytes"] - by_case["lora+disabled_ref"]["param_bytes"]
    emit(document("lora_memory", {"model": args.model_path or "mid", "lora_rank": args.rank, "lora_alpha": 2 * args.rank},
                  {"cases": results, "param_bytes_saved_by_disabled_adapter_ref": saved,
                   "peak_rss_saved_bytes": by_case["lora+full_ref"]["peak_rss_bytes"]
                   - by_case["lora+disabled_ref"]["peak_rss_bytes"]}, extra_versions=("peft",)))


if __name__ == "__main__":
    main()
