"""actor_rollout_ref.model.batch_invariant: the native rollout's fp32 log-probs ARE the training engine's.

Checked with ``torch.equal``, not a tolerance: on every dense architecture's unit model (sliding windows shorter than
the rows, soft caps, q/k norms, partial rotary...), with samples stopping at different steps (the decode batch
compacts and carries dummy rows), rows longer than one 128-key block, micro-batches that group the rows otherwise
than the rollout did, in eval and in the update's train-mode forward, before and after a weight update + sync.
"""

from __future__ import annotations

import pytest
import torch
from test_native_archs import WINDOW, write_arch_model
from test_rollout_engines import make_prompts

from hybridflow.engines.batch_invariant import (
    KEY_BLOCK,
    causal_allowed,
    invariant_attention,
    onednn_matmuls,
)
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.onednn_train import OneDNNLinear
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine

DENSE = ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text", "phi3"]


def test_a_query_rounds_the_same_whatever_else_is_computed():
    """Row t of a full causal pass == the same query alone (1, 3 or 5 query rows), over only its visible keys or
    over more, with grouped KV heads, a sliding window and a soft cap, past one key block."""
    torch.manual_seed(0)
    B, H, KV, T, D = 3, 6, 2, KEY_BLOCK + 70, 16
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    for window, softcap in ((None, None), (40, 5.0)):
        allowed = causal_allowed(T, T, q.device, window)[None, None].expand(B, 1, T, T)
        full = invariant_attention(q, k, v, allowed, 0.25, softcap)
        for t in (0, 7, KEY_BLOCK - 1, KEY_BLOCK + 3, T - 1):
            for length in sorted({t + 1, min(T, t + 9), T}):
                for rows in (1, 3, 5):
                    visible = causal_allowed(T, T, q.device, window)[t, :length]
                    one = invariant_attention(q[:, :, t : t + 1].expand(B, H, rows, D), k[:, :, :length],
                                              v[:, :, :length], visible.expand(B, 1, rows, length), 0.25, softcap)
                    assert torch.equal(one[:, :, 0], full[:, :, t]), (window, t, length, rows)


def engine(path: str, **kwargs) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, role="actor", optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                                   batch_invariant=True, **kwargs))


def assert_bitwise(out, actor: FSDPEngine, temperature: float) -> None:
    mask = out.batch["response_mask"].bool()
    rollout = out.batch["rollout_log_probs"][mask]
    assert torch.equal(actor.compute_log_prob(out, temperature=temperature)["log_probs"][mask], rollout)
    actor.model.train()  # the first update forward measures the mismatch: train mode, grad on
    with torch.enable_grad():
        train = actor._forward(out, temperature=temperature, calculate_entropy=True)["log_probs"]
    actor.model.eval()
    assert torch.equal(train.detach()[mask], rollout)


@pytest.mark.parametrize("arch", DENSE)
def test_rollout_log_probs_equal_the_training_engine_bit_for_bit(arch, tmp_path):
    path = write_arch_model(tmp_path / arch, arch)
    rollout = create_rollout_engine("native", path, num_threads=1, batch_invariant=True)
    actor = engine(path, micro_batch_size_per_gpu=3)  # micro-batches group the rows otherwise than the rollout
    prompts = make_prompts(rollout.tokenizer)
    stop = [int(t) for t in rollout.tokenizer.convert_tokens_to_ids(list("aeiou"))]
    params = SamplingParams(temperature=0.8, n=3, max_new_tokens=24, seed=4, stop_token_ids=stop)
    before = rollout.generate(prompts, params)
    lengths = before.batch["response_mask"].sum(-1)
    assert int(lengths.min()) < int(lengths.max()) and int(lengths.max()) > WINDOW, lengths
    # the projections both engines run here: oneDNN (packed in the rollout) where this CPU's torch has it
    onednn = onednn_matmuls(torch.device("cpu"))
    assert rollout.model.matmul == ("onednn" if onednn else "dense")
    assert any(isinstance(m, OneDNNLinear) for m in actor.model.modules()) == onednn
    assert_bitwise(before, actor, 0.8)

    g = torch.Generator().manual_seed(1)  # a weight update, synced by HF name as the hybrid worker does
    with torch.no_grad():
        for _, p in actor.model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    rollout.update_weights(actor.named_full_parameters())
    after = rollout.generate(prompts, params)
    assert not torch.equal(after.batch["rollout_log_probs"], before.batch["rollout_log_probs"])
    assert_bitwise(after, actor, 0.8)


def test_rows_longer_than_a_key_block_and_a_token_budget(tmp_path):
    """Prompts + responses past 128 keys, the prefill split by a token budget, two threads."""
    path = write_arch_model(tmp_path / "qwen2", "qwen2", init=0.1)
    rollout = create_rollout_engine("native", path, num_threads=2, batch_invariant=True, max_model_len=512,
                                    max_num_batched_tokens=64)
    out = rollout.generate(make_prompts(rollout.tokenizer),
                           SamplingParams(temperature=1.0, n=2, max_new_tokens=KEY_BLOCK + 40, seed=0))
    assert out.batch["attention_mask"].sum(-1).max() > KEY_BLOCK + 20
    torch.set_num_threads(2)
    assert_bitwise(out, engine(path, micro_batch_size_per_gpu=5), 1.0)


def test_what_batch_invariance_cannot_cover_is_refused(tmp_path):
    moe = write_arch_model(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(ValueError, match="routed experts"):
        create_rollout_engine("native", moe, batch_invariant=True)
    dense = write_arch_model(tmp_path / "dense", "qwen2")
    for kwargs, message in (({"prepack": False}, "prepack"), ({"decode": "static"}, "eager"),
                            ({"dtype": "bf16"}, "fp32")):
        with pytest.raises(ValueError, match=message):
            create_rollout_engine("native", dense, batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match="batch_invariant"):
        create_rollout_engine("native", dense, batch_invariant=True).open_sessions()
    for kwargs in ({"use_remove_padding": False}, {"use_sequence_packing": True}, {"param_dtype": "bf16"}):
        with pytest.raises(ValueError, match="batch_invariant=true needs"):
            engine(dense, **kwargs)
