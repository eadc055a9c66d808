"""The training engine's packed attention on CPU: the C kernel (engines/cpu_flash_attention.py) against torch's SDPA
per row (packing.py's other path), forward and forward + backward, as one JSON document.

Both go through `packing.varlen_attention`, the function the engine's packed model calls, on the mid model's heads
(8 query heads over 4 key/value heads of 64), for packed micro-batches of rows whose lengths vary (uniform in a
range), and for GRPO's shared-prompt groups (a prompt, then n responses that attend to it). The two are alternated
(A B, B A, ...) and the median of each is reported, with the useful causal FLOPs per second (2 * 2 * D * H per
(query, key) pair a query sees; a backward counts 2.5 forwards) and the largest output difference between them.

    .venv/bin/python benchmarks/train_attention.py [--threads 2] [--rounds 8] [--dtype bf16]

--dtype bf16 runs both under bf16 autocast with the operands the engine's bf16 mode gives (q and k fp32, v bf16):
torch's bf16 kernel forward and fp32 backward (causal_attention.py) against the kernel computing in fp32 from the
bf16-rounded operands.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import document, emit
from torch import nn

from hybridflow.engines import cpu_flash_attention, packing
from hybridflow.engines.shared_prompts import SharedPrompts

HEADS, KV_HEADS, DIM = 8, 4, 64


class _Attention(nn.Module):
    """What varlen_attention reads of a transformers attention module."""

    def __init__(self, kernel: bool):
        super().__init__()
        self.num_key_value_groups = HEADS // KV_HEADS
        self.hybridflow_flash_attention = kernel
        self.train()


def _rows(lengths: list[int]) -> dict:
    cu = torch.tensor([0, *lengths]).cumsum(0)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return {"tokens": sum(lengths), "pairs": pairs,
            "kwargs": {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}}


def _shared(prompt_lengths: list[int], responses: list[list[int]]) -> dict:
    groups, pos, pairs = [], 0, 0
    for plen, lengths in zip(prompt_lengths, responses):
        start, pos = pos, pos + plen
        spans = []
        for n in lengths:
            spans.append((pos, n))
            pos += n
            pairs += n * plen + n * (n + 1) // 2
        pairs += plen * (plen + 1) // 2
        groups.append((start, plen, spans))
    cu = torch.tensor([0, pos])
    return {"tokens": pos, "pairs": pairs,
            "kwargs": {"cu_seq_lens_q": cu, "max_length_q": pos,
                       "hybridflow_shared_prompts": SharedPrompts(groups=groups, tokens=pos)}}


def _time(fn, backward: bool, grad: torch.Tensor) -> float:
    start = time.perf_counter()
    if backward:
        fn().backward(grad)
    else:
        with torch.no_grad():
            fn()
    return time.perf_counter() - start


def bench_case(case: dict, rounds: int, bf16: bool = False) -> dict:
    """bf16: as the engine's bf16 autocast gives the operands (q and k fp32 after the rotary embedding, v bf16),
    under bf16 autocast."""
    g = torch.Generator().manual_seed(0)
    T = case["tokens"]
    q = torch.randn(1, T, HEADS, DIM, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, T, KV_HEADS, DIM, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    if bf16:
        v = v.detach().bfloat16().requires_grad_()
    grad = torch.randn(1, T, HEADS, DIM, generator=g, dtype=torch.bfloat16 if bf16 else torch.float32)
    modules = {name: _Attention(name == "kernel") for name in ("kernel", "sdpa")}

    def call(name: str):
        def attend():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return packing.varlen_attention(modules[name], q, k, v, None, **case["kwargs"])[0]

        return attend

    calls = {name: call(name) for name in modules}
    with torch.no_grad():
        outs = {name: fn() for name, fn in calls.items()}
    result = {"tokens": T, "attended_pairs": case["pairs"],
              "max_output_difference": float((outs["kernel"].float() - outs["sdpa"].float()).abs().max())}
    flops = 2 * 2 * DIM * HEADS * case["pairs"]
    for backward in (False, True):
        times = {"kernel": [], "sdpa": []}
        for fn in calls.values():
            _time(fn, backward, grad)  # warm-up
        for r in range(rounds):
            for name in (("kernel", "sdpa") if r % 2 == 0 else ("sdpa", "kernel")):
                times[name].append(_time(calls[name], backward, grad))
        label = "forward_backward" if backward else "forward"
        work = flops * (3.5 if backward else 1.0)
        for name, ts in times.items():
            med = statistics.median(ts)
            result[f"{label}_{name}_ms"] = med * 1e3
            result[f"{label}_{name}_gflops"] = work / med / 1e9
        result[f"{label}_speedup"] = statistics.median(times["sdpa"]) / statistics.median(times["kernel"])
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: under bf16 autocast, the operands as the engine's bf16 mode gives them")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpu_flash_attention.load() is None:
        raise SystemExit("the CPU attention kernel did not build here (see the log warning)")
    g = torch.Generator().manual_seed(1)

    def lengths(rows: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (rows,), generator=g).tolist()

    cases = {
        # train_throughput.py's batch: prompts 16..64 and responses 64..256, 16 rows a micro-batch
        "rows_80_to_320": _rows(lengths(16, 80, 320)),
        # a GRPO micro-batch of short rows (rl_step_vs_trl.py's mid: ~23 prompt + up to 64 response tokens)
        "rows_40_to_90": _rows(lengths(32, 40, 90)),
        # long rows (agent trajectories)
        "rows_512_to_2048": _rows(lengths(3, 512, 2048)),
        # GRPO's shared prompts: 8 groups of a 24-token prompt and 4 responses of 16..64 tokens
        "shared_24_by_4": _shared([24] * 8, [lengths(4, 16, 64) for _ in range(8)]),
        # long prompts, short responses: 4 groups of a 200-token prompt and 8 responses of 8..32 tokens
        "shared_200_by_8": _shared([200] * 4, [lengths(8, 8, 32) for _ in range(4)]),
    }
    results = {name: bench_case(case, args.rounds, args.dtype == "bf16") for name, case in cases.items()}
    doc = document("train_attention", {"threads": args.threads, "rounds": args.rounds, "dtype": args.dtype,
                                       "heads": HEADS,
                                       "kv_heads": KV_HEADS, "head_dim": DIM,
                                       "query_block": cpu_flash_attention.QUERY_BLOCK,
                                       "vector_width": cpu_flash_attention.load().vector_width}, results)
    emit(doc)
    return doc


if __name__ == "__main__":
    main()
