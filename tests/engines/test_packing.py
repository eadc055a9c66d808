"""True sequence packing (hybridflow/engines/packing.py) against length bucketing: same layout facts, same
log-probs / entropy / gradients (<= 1e-5, fp32) on a batch whose row lengths vary 10x, and the fused log-prob +
entropy helper against the two separate ones."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines import micro_batch as mb
from hybridflow.engines import packing
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.hf_model import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


def rollout_mask(prompt_lens, resp_lens, prompt_len, response_len) -> torch.Tensor:
    mask = torch.zeros(len(prompt_lens), prompt_len + response_len, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[i, prompt_len - p : prompt_len + r] = 1
    return mask


def varied_batch(rows: int = 8, seed: int = 3) -> DataProto:
    """make_batch's layout with real lengths from ~4 to 40 tokens (10x)."""
    data = make_batch(rows=rows, prompt_len=8, response_len=32, seed=seed)
    mask = rollout_mask([2, 8, 3, 5, 2, 8, 4, 6][:rows], [2, 32, 5, 20, 3, 30, 9, 14][:rows], 8, 32)
    ids = data.batch["input_ids"].clone()
    ids[mask == 0] = 0
    ids[mask == 1] = torch.randint(4, 250, (int(mask.sum()),), generator=torch.Generator().manual_seed(seed))
    data.batch["input_ids"] = ids
    data.batch["attention_mask"] = mask
    data.batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    data.batch["responses"] = ids[:, 8:]
    data.batch["response_mask"] = mask[:, 8:]
    data.batch["advantages"] = data.batch["advantages"] * mask[:, 8:]
    return data


def test_packed_layout_concatenates_rows_and_restarts_positions():
    prompt_len, response_len = 4, 3
    mask = rollout_mask([2, 4], [3, 1], prompt_len, response_len)
    ids = torch.arange(1, 15).reshape(2, 7) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = packing.build_packed(ids, mask, pos, response_len)
    assert packed.input_ids.tolist() == [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert packed.cu_seq_lens.tolist() == [0, 5, 10] and packed.cu_seq_lens.dtype == torch.int32
    assert packed.max_length == 5 and packed.attention_mask is None
    # response tokens 5,6,7 (row 0) are predicted from packed positions 1,2,3; token 12 (row 1) from position 8
    assert packed.select_cols.tolist() == [1, 2, 3, 8]
    assert packed.target_ids.tolist() == [5, 6, 7, 12]
    flat = packed.input_ids[0]
    assert flat[packed.select_cols + 1].tolist() == packed.target_ids.tolist()
    bucket = mb.build_bucket(ids, mask, pos, response_len)
    assert packed.out_rows.tolist() == bucket.out_rows.tolist() and packed.out_cols.tolist() == bucket.out_cols.tolist()


def test_the_same_rows_again_take_the_last_layout_and_other_rows_a_new_one():
    """build_packed keeps its last layout for a pass over the same rows (equal values, not the same tensors), and
    makes a new one for rows that differ in any of the three tensors or options, or that the caller changed in place
    since (it compares against copies)."""
    prompt_len, response_len = 4, 3
    mask = rollout_mask([2, 4, 4], [3, 1, 2], prompt_len, response_len)
    ids = torch.arange(1, 22).reshape(3, 7) * mask
    ids[2, :prompt_len] = ids[1, :prompt_len]  # rows 1 and 2 share a prompt
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    first = packing.build_packed(ids, mask, pos, response_len, share_prompts=True)
    assert first.shared is not None
    assert packing.build_packed(ids.clone(), mask.clone(), pos.clone(), response_len, share_prompts=True) is first
    assert packing.build_packed(ids, mask, pos, response_len) is not first  # other options
    again = packing.build_packed(ids, mask, pos, response_len, share_prompts=True)
    assert again is not first  # the last layout is the unshared one now
    ids[0, -1] = 99  # in place: a new target token
    changed = packing.build_packed(ids, mask, pos, response_len, share_prompts=True)
    assert changed is not again and changed.target_ids.tolist()[2] == 99
    fresh = packing._build_packed(ids, mask, pos, response_len, 0, True)
    for name in ("input_ids", "position_ids", "select_cols", "target_ids", "out_rows", "out_cols", "cu_seq_lens"):
        assert torch.equal(getattr(changed, name), getattr(fresh, name)), name


def test_varlen_attention_is_block_diagonal_causal():
    """Row by row SDPA equals a dense block-diagonal causal mask over the packed row, and keeps rows apart."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out, _ = packing.varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    seg = torch.tensor([0] * 3 + [1] * 7)
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(10, 10).tril().bool()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert out.shape == (1, 10, 4, 8)
    assert float((out - dense.transpose(1, 2)).abs().max()) <= 1e-6
    k2 = k.clone()
    # changing row 0's keys (not by a constant: softmax would not see a shift common to a query's keys) leaves row 1's
    # outputs untouched
    k2[:, :, :3] += torch.randn(k2[:, :, :3].shape, generator=g)
    out2, _ = packing.varlen_attention(module, q, k2, v, None, cu_seq_lens_q=cu, max_length_q=7)
    assert torch.equal(out2[:, 3:], out[:, 3:]) and not torch.allclose(out2[:, :3], out[:, :3])


def test_rows_of_equal_length_are_attended_together_with_the_same_result_and_gradients():
    """Rows sharing a length go through one batched call per length (GQA: 4 query heads on 2 KV heads); outputs and
    the gradients of q, k, v equal the dense block-diagonal causal reference, and rows stay apart."""
    g = torch.Generator().manual_seed(2)
    lengths = [3, 5, 3, 1, 5, 3, 2]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, total, 8, generator=g, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = packing.varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(lengths))
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total).tril().bool()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert out.shape == (1, total, 4, 8)
    assert float((out - dense.transpose(1, 2)).abs().max()) <= 1e-6
    weights = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((dense.transpose(1, 2) * weights).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= 1e-5
    k2 = k.detach().clone()
    # row 1 (length 5, batched with row 4) changes (random keys: a constant shift is invisible to softmax); every
    # other row's outputs do not
    k2[:, :, 3:8] += torch.randn(k2[:, :, 3:8].shape, generator=g)
    out2, _ = packing.varlen_attention(module, q.detach(), k2, v.detach(), None, cu_seq_lens_q=cu, max_length_q=5)
    assert torch.equal(out2[:, :3], out[:, :3].detach()) and torch.equal(out2[:, 8:], out[:, 8:].detach())
    assert not torch.allclose(out2[:, 3:8], out[:, 3:8].detach())


def test_a_padded_batch_through_a_packed_model_is_still_masked(tiny_model_path):
    """Not every forward of the engine's model is packed (an export check, a plain call): with left padding the
    packed-attention model gives transformers' sdpa logits at every real position."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa")
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert packing.enable_packed_attention(packed) == packing.VARLEN_ATTENTION
    mask = rollout_mask([3, 7, 5], [4, 1, 6], 7, 6)
    ids = torch.randint(4, 250, mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = packed(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    assert float((got[real] - want[real]).abs().max()) <= 1e-5


def test_fused_log_probs_and_entropy_equal_the_separate_functions():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 50, generator=g) * 3
    target = torch.randint(0, 50, (7,), generator=g)
    lp, ent = log_probs_and_entropy(logits, target)
    assert torch.allclose(lp, log_probs_from_logits(logits, target), atol=1e-6)
    assert torch.allclose(ent, entropy_from_logits(logits), atol=1e-6)


def engine(path: str, **overrides) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3, weight_decay=0.0), **overrides))


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    loss = loss - 0.01 * (outputs["entropy"] * mask).sum() / total
    return loss, {"pg_loss": loss.detach()}


@pytest.mark.parametrize("micro_batch_size", [8, 3])
def test_packed_equals_bucketed_log_probs_and_gradients(tiny_model_path, micro_batch_size):
    data = varied_batch()
    lengths = data.batch["attention_mask"].sum(-1)
    assert float(lengths.max() / lengths.min()) >= 10  # the case packing is for
    out, grads = {}, {}
    for name, packed in (("bucketed", False), ("packed", True)):
        eng = engine(tiny_model_path, micro_batch_size_per_gpu=micro_batch_size, use_sequence_packing=packed)
        assert (eng.model.hf.config._attn_implementation == packing.VARLEN_ATTENTION) == packed
        out[name] = eng.compute_log_prob(data, temperature=0.7, calculate_entropy=True)
        eng.forward_backward(data, pg_loss)
        grads[name] = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
    for key in ("log_probs", "entropy"):
        assert float((out["packed"][key] - out["bucketed"][key]).abs().max()) <= 1e-5, key
    # past each response both are exactly 0
    assert torch.equal(out["packed"]["log_probs"][data.batch["response_mask"] == 0], torch.zeros(0).new_zeros(
        int((data.batch["response_mask"] == 0).sum())))
    scale = max(float(g.abs().max()) for g in grads["bucketed"].values())
    worst = max(float((grads["packed"][n] - grads["bucketed"][n]).abs().max()) for n in grads["bucketed"])
    assert worst <= 1e-5 * max(1.0, scale)
    assert scale > 0


def test_packed_train_step_runs_with_a_token_budget(tiny_model_path):
    data = varied_batch()
    eng = engine(tiny_model_path, use_sequence_packing=True, use_dynamic_bsz=True, max_tokens_per_micro_batch=64)
    lengths = data.batch["attention_mask"].sum(-1).tolist()
    plan = eng._plan(data)
    assert len(plan) > 1
    # the budget bounds each packed micro-batch's summed length (no padding to count), in as few as fit
    assert all(sum(lengths[i] for i in g) <= 64 or len(g) == 1 for g in plan)
    assert plan == mb.packed_micro_batches(lengths, 64)
    roomy = engine(tiny_model_path, use_sequence_packing=True, use_dynamic_bsz=True,
                   max_tokens_per_micro_batch=sum(lengths))
    assert len(roomy._plan(data)) == 1
    # the budget's groups are not runs of rows in order: results still come back in the rows' order
    split, whole = (e.compute_log_prob(data, temperature=1.0, calculate_entropy=True) for e in (eng, roomy))
    for key in ("log_probs", "entropy"):
        assert float((split[key] - whole[key]).abs().max()) <= 1e-5, key
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    result = eng.train_step(data, pg_loss)
    assert result["skipped_nonfinite"] == 0.0 and result["grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in eng.model.named_parameters())


# the tiny Mistral sets no sliding_window (its layers attend fully), so it packs
@pytest.mark.parametrize("arch, packable", [("gemma2", False), ("gemma3_text", False), ("mistral", True),
                                            ("qwen2", True), ("llama", True)])
def test_packing_a_model_it_cannot_apply_to_is_refused_at_start_up(tmp_path, arch, packable):
    """The forward-time refusal of varlen_attention, moved to config validation: the run never starts."""
    from transformers import AutoConfig

    from hybridflow.trainer.config import ConfigError, load_config

    path = write_tiny_model(tmp_path / arch, "unit", arch=arch, seed=0)
    assert (packing.packing_refusal(AutoConfig.from_pretrained(path)) is None) == packable
    overrides = [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.model.use_sequence_packing=true"]
    if packable:
        load_config(overrides)
        return
    with pytest.raises(ConfigError, match=r"use_sequence_packing=true: the model at .* uses (sliding-window|soft-capped)"):
        load_config(overrides)


def test_a_mistral_with_a_window_is_not_packed():
    from transformers import MistralConfig, Qwen2Config, Qwen3MoeConfig

    assert "sliding_window=16" in packing.packing_refusal(MistralConfig(sliding_window=16))
    # no layer types: the window is passed to every layer's attention
    assert "sliding_window=16" in packing.packing_refusal(Qwen3MoeConfig(use_sliding_window=True, sliding_window=16))
    assert packing.packing_refusal(Qwen3MoeConfig(use_sliding_window=False, sliding_window=16)) is None
    assert packing.packing_refusal(Qwen2Config(use_sliding_window=False, sliding_window=16)) is None
    assert "on 2 of its layers" in packing.packing_refusal(
        Qwen2Config(use_sliding_window=True, sliding_window=16, num_hidden_layers=2, max_window_layers=0))


def test_the_default_packs_where_packing_applies_and_says_why_not_elsewhere(tiny_model_path, tmp_path, caplog):
    """use_sequence_packing=None: actor, reference and critic pack; the padded forward, the batch-invariant mode and a
    model with a sliding window are bucketed, each with its reason logged; True/False are obeyed."""
    import logging

    from hybridflow.engines.engine_config import why_not_packed

    assert all(engine(tiny_model_path, role=role).packing for role in ("actor", "ref", "critic"))
    assert not engine(tiny_model_path, use_sequence_packing=False).packing
    windowed = write_tiny_model(tmp_path / "gemma2", "unit", arch="gemma2", seed=0)
    with caplog.at_level(logging.INFO, logger="hybridflow.engines.fsdp_engine"):
        for path, overrides, reason in (
            (tiny_model_path, {"use_remove_padding": False}, "use_remove_padding=False"),
            (tiny_model_path, {"batch_invariant": True}, "batch_invariant=True"),
            (windowed, {}, "sliding-window"),
        ):
            eng = engine(path, **overrides)
            assert not eng.packing and reason in why_not_packed(eng.config, eng.hf_config)
            assert reason in caplog.text
    with pytest.raises(ValueError, match="sliding-window"):  # asked for explicitly: refused at the first forward
        eng = engine(windowed, use_sequence_packing=True)
        eng.compute_log_prob(varied_batch(), temperature=1.0)


def test_packed_critic_values_and_gradients_equal_the_bucketed_ones(tiny_model_path):
    data = varied_batch()

    def value_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
        mask = micro.batch["response_mask"].float()
        return ((outputs["values"] - 0.5) ** 2 * mask).sum() / micro.meta_info["global_num_tokens"], {}

    values, grads = {}, {}
    for packed in (False, True):
        eng = engine(tiny_model_path, role="critic", micro_batch_size_per_gpu=4, use_sequence_packing=packed)
        assert eng.packing == packed
        values[packed] = eng.compute_values(data)
        eng.forward_backward(data, value_loss)
        grads[packed] = {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}
    assert float(values[False].abs().max()) > 0
    assert float((values[True] - values[False]).abs().max()) <= 1e-5
    assert grads[True].keys() == grads[False].keys() and grads[False]
    assert max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[False]) <= 1e-5
