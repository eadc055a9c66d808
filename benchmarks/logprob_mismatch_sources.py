"""Where the native rollout's fp32 log-probs differ from the training engine's: one JSON document.

For each variant of the native decoder (oneDNN-packed matmuls on/off, the rope's arithmetic order, the decode
attention's formulation) it samples the same prompts, then scores the sampled tokens with the FSDP engine's two
paths (``compute_log_prob``: eval, no grad; and the training forward the actor's first update step measures the
mismatch in: train mode, with grad) and, with --fp64, with the HF model in float64 (which side is off the truth).

    .venv/bin/python benchmarks/logprob_mismatch_sources.py --model /tmp/smol_hf          # SmolLM2, after import-gguf
    .venv/bin/python benchmarks/logprob_mismatch_sources.py --model DIR --prompts 2 --n 2 --max-new 16   # the CI run
    .venv/bin/python benchmarks/logprob_mismatch_sources.py --model DIR --variants default,prepack=false --fp64

A variant is comma-free ``key=value`` pairs joined by ``+``: prepack=true|false, rope=hf|addcmul, batch_invariant=true
(rollout and training engine both batch-invariant: engines/batch_invariant.py). ``default`` is the engine as shipped.
The decode-attention variants measured at commit da202ce (docs/benchmarks.md, SmolLM2) read the KV cache's old
key layout and were dropped when keys came to be stored transposed; batch_invariant=true supersedes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import git_commit, machine_info
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine, native_model
from hybridflow.protocol import DataProto

QUESTIONS = ["What is {a} plus {b}?", "What is {a} minus {b}?", "What is {a} times {b}?", "Is {a} bigger than {b}?"]


def chat_prompts(tokenizer, count: int) -> DataProto:
    """`count` short arithmetic chat prompts [count, P], left-padded (the rollout's layout)."""
    texts = [QUESTIONS[i % len(QUESTIONS)].format(a=3 + 7 * i % 40, b=2 + 5 * i % 30) for i in range(count)]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False) for t in texts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((count, width), tokenizer.pad_token_id)
    mask = torch.zeros(count, width, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


# ------------------------------------------------------------------------------------------- decoder variants
def _rotate_addcmul(x, cos, signed_sin):
    """The rope as the native decoder computed it before HF's order: addcmul(x*cos, roll(x), signed_sin)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return torch.addcmul(x * cos, torch.roll(x, dim // 2, dims=-1), signed_sin)
    rot = x[..., :dim]
    return torch.cat((torch.addcmul(rot * cos, torch.roll(rot, dim // 2, dims=-1), signed_sin), x[..., dim:]), -1)


def _rotate_hf(x, cos, signed_sin):
    """HF's order: x*cos + rotate_half(x)*sin, two roundings (addcmul may fuse them into one)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + torch.roll(x, dim // 2, dims=-1) * signed_sin
    rot = x[..., :dim]
    return torch.cat((rot * cos + torch.roll(rot, dim // 2, dims=-1) * signed_sin, x[..., dim:]), -1)


PATCHES = {
    ("rope", "hf"): (native_model, "_rotate", _rotate_hf),
    # (variant key, value) -> (module, attribute, replacement); absent: the shipped code
    ("rope", "addcmul"): (native_model, "_rotate", _rotate_addcmul),
}


def parse_variant(text: str) -> dict[str, str]:
    if text == "default":
        return {}
    pairs = dict(part.split("=", 1) for part in text.split("+"))
    unknown = set(pairs) - {"prepack", "rope", "batch_invariant"}
    if unknown:
        raise SystemExit(f"unknown variant keys {sorted(unknown)} in {text!r}; use prepack, rope, batch_invariant")
    return pairs


@contextlib.contextmanager
def patched(variant: dict[str, str]):
    saved = []
    for key, value in variant.items():
        if (key, value) in PATCHES:
            module, name, replacement = PATCHES[(key, value)]
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


# ------------------------------------------------------------------------------------------- scoring
def train_mode_log_probs(engine: FSDPEngine, out: DataProto, temperature: float) -> torch.Tensor:
    """The actor update's first forward (train mode, grad on) over all rows in one micro-batch: log_probs [B, R]."""
    engine.model.train()
    with torch.enable_grad():
        lp = engine._forward(out, temperature=temperature, calculate_entropy=False)["log_probs"]
    engine.model.eval()
    return lp.detach()


def fp64_log_probs(model, out: DataProto, temperature: float) -> torch.Tensor:
    """log p of the responses under the HF model in float64: [B, R]."""
    b = out.batch
    R = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, -R - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1)


def native_scoring_log_probs(decoder, out: DataProto, temperature: float) -> torch.Tensor:
    """The native decoder scoring the finished rows in one prefill-style pass (no KV cache, no decode steps):
    log_probs [B, R]. Its distance to the training engine is what is left without the decode path."""
    from hybridflow.engines.hf_model import log_probs_from_logits

    b = out.batch
    ids, mask, pos = b["input_ids"], b["attention_mask"].bool(), b["position_ids"]
    B, L = ids.shape
    R = b["responses"].shape[1]
    G = decoder.shape.num_heads // decoder.shape.num_kv_heads
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = ((causal[None] & mask[:, None, :]) | torch.eye(L, dtype=torch.bool)[None])[:, None]

    def attend(li, q, k, v):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1), v.transpose(1, 2).repeat_interleave(G, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                             scale=decoder.shape.attention_scale)
        return o.transpose(1, 2).reshape(B, L, -1)

    with torch.no_grad():
        hidden = decoder._layers(ids, pos, attend)[:, L - R - 1:-1]
        logits = decoder._logits(hidden.reshape(B * R, -1)) / temperature
    return log_probs_from_logits(logits, b["responses"].reshape(-1)).view(B, R)


def stats(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|a - b| of log-probs (ours: rollout/mismatch_*) and |exp a - exp b| (veRL's training/rollout_probs_diff_*)."""
    s = logprob_mismatch(a, b, mask)
    probs = (a.double().exp() - b.double().exp()).abs()[mask.bool()]
    return {"max_abs": s["mismatch/max_abs"], "mean_abs": s["mismatch/mean_abs"],
            "probs_diff_max": float(probs.max()), "probs_diff_mean": float(probs.mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF folder (e.g. `hybridflow import-gguf --smollm2 DIR`)")
    ap.add_argument("--variants", default="default,prepack=false,rope=addcmul,batch_invariant=true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seeds", default="0", help="comma-separated sampling seeds; stats over all of them")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fp64", action="store_true", help="also score with the HF model in float64")
    args = ap.parse_args()

    actors = {flag: FSDPEngine(EngineConfig(model_path=args.model, role="actor", micro_batch_size_per_gpu=4,
                                            num_threads=args.threads, batch_invariant=flag))
              for flag in {parse_variant(text).get("batch_invariant") == "true" for text in args.variants.split(",")}}
    reference = None
    if args.fp64:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float64).eval()
    results = []
    for text in args.variants.split(","):
        variant = parse_variant(text)
        kwargs = {} if "prepack" not in variant else {"prepack": variant["prepack"] == "true"}
        invariant = variant.get("batch_invariant") == "true"
        actor = actors[invariant]
        if invariant:
            kwargs["batch_invariant"] = True
        with patched(variant):
            engine = create_rollout_engine("native", args.model, num_threads=args.threads, max_model_len=512,
                                           **kwargs)
            prompts = chat_prompts(engine.tokenizer, args.prompts)
            outs, start = [], time.perf_counter()
            for seed in args.seeds.split(","):
                outs.append(engine.generate(prompts, SamplingParams(temperature=args.temperature, n=args.n,
                                                                    max_new_tokens=args.max_new, seed=int(seed))))
            seconds = time.perf_counter() - start
        row = {"variant": text, "matmul": engine.model.matmul, "generate_s": round(seconds, 2)}
        per = {"vs_train_eval": [], "vs_train_grad": [], "vs_fp64": [], "train_eval_vs_fp64": [],
               "scoring_vs_train_eval": []}
        scoring = []
        masks, native = [], []
        score_seconds = 0.0  # the training engine's compute_log_prob over the samples
        for out in outs:
            mask = out.batch["response_mask"]
            masks.append(mask)
            native.append(out.batch["rollout_log_probs"])
            start = time.perf_counter()
            per["vs_train_eval"].append(actor.compute_log_prob(out, temperature=args.temperature)["log_probs"])
            score_seconds += time.perf_counter() - start
            per["vs_train_grad"].append(train_mode_log_probs(actor, out, args.temperature))
            with patched(variant):
                scoring.append(native_scoring_log_probs(engine.model, out, args.temperature))
            per["scoring_vs_train_eval"].append(per["vs_train_eval"][-1])
            if reference is not None:
                exact = fp64_log_probs(reference, out, args.temperature)
                per["vs_fp64"].append(exact)
                per["train_eval_vs_fp64"].append(exact)
        mask, native = torch.cat(masks), torch.cat(native)
        row["tokens"] = int(mask.sum())
        row["train_compute_log_prob_s"] = round(score_seconds, 2)
        for key, parts in per.items():
            if parts:
                other = {"train_eval_vs_fp64": torch.cat(per["vs_train_eval"]),
                         "scoring_vs_train_eval": torch.cat(scoring) if scoring else None}.get(key, native)
                row[key] = stats(other, torch.cat(parts), mask)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "logprob_mismatch_sources", "machine": machine_info(), "git_commit": git_commit(),
                      "config": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
