"""Shared prompts in packed micro-batches (engines/shared_prompts.py): rows of one prompt hold it once; log-probs,
entropy, values and gradients equal the unshared packed computation to fp32 rounding, with responses of different
lengths, an empty response, prompts of one row, GQA and Qwen3's q/k norms; the layout's token count; the engine's
choice and its error."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch
from test_train_engine import engine, pg_loss

from hybridflow.engines import packing, shared_prompts
from hybridflow.engines.shared_prompts import shared_layout
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


def grpo_batch(groups: int = 3, n: int = 4, prompt_len: int = 10, response_len: int = 12, seed: int = 1) -> DataProto:
    """`groups` prompts x `n` responses of varying lengths (one empty), plus two rows with prompts of their own."""
    data = make_batch(rows=groups * n + 2, prompt_len=prompt_len, response_len=response_len, seed=seed)
    b = data.batch
    for row in range(groups * n):
        first = row - row % n
        b["input_ids"][row, :prompt_len] = b["input_ids"][first, :prompt_len]
        b["attention_mask"][row, :prompt_len] = b["attention_mask"][first, :prompt_len]
    b["attention_mask"][1, prompt_len:] = 0  # an empty response
    b["attention_mask"][2, prompt_len:] = 1  # a full one
    mask = b["attention_mask"]
    b["input_ids"] = b["input_ids"].masked_fill(mask == 0, 0)
    b["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    b["response_mask"] = mask[:, prompt_len:].clone()
    b["responses"] = b["input_ids"][:, prompt_len:].clone()
    b["advantages"] = b["advantages"] * b["response_mask"]
    return data


def test_the_layout_holds_each_prompt_once():
    data = grpo_batch()
    b = data.batch
    R = b["responses"].shape[1]
    layout = shared_layout(b["input_ids"], b["attention_mask"], b["position_ids"], R)
    prompt_tokens = (b["attention_mask"][:, :-R].sum(-1)).tolist()
    unique = sum(prompt_tokens[row] for row in (0, 4, 8, 12, 13))
    assert layout["input_ids"].shape == (1, unique + int(b["response_mask"].sum()))
    assert len(layout["shared"].groups) == 5 and [len(g[2]) for g in layout["shared"].groups] == [4, 4, 4, 1, 1]
    # rows of distinct prompts only, or a row without a prompt token: no shared layout
    distinct = make_batch(rows=4, prompt_len=6, response_len=5, seed=0).batch
    assert shared_layout(distinct["input_ids"], distinct["attention_mask"], distinct["position_ids"], 5) is None


def _passes(path, data, role="actor", **overrides):
    eng = engine(path, role=role, **{"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 4096, **overrides})
    if role == "critic":
        values = eng.compute_values(data)

        def value_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
            mask = micro.batch["response_mask"].float()
            return ((outputs["values"] - 0.5) ** 2 * mask).sum() / micro.meta_info["global_num_tokens"], {}

        eng.forward_backward(data, value_loss)
        outputs = {"values": values}
    else:
        outputs = eng.compute_log_prob(data, temperature=0.7, calculate_entropy=True)
        eng.forward_backward(data, pg_loss)
    grads = {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}
    return eng, outputs, grads


def _assert_equal_to_rounding(shared, plain, mask):
    (eng_s, out_s, g_s), (eng_p, out_p, g_p) = shared, plain
    assert eng_s.share_prompts and not eng_p.share_prompts
    for key in out_p:
        assert float(out_p[key][mask].abs().max()) > 0
        assert float((out_s[key] - out_p[key])[mask].abs().max()) <= 1e-5, key
    assert g_s.keys() == g_p.keys() and g_p
    for name in g_p:
        scale = float(g_p[name].abs().max()) + 1e-12
        assert float((g_s[name] - g_p[name]).abs().max()) <= 1e-5 * max(1.0, scale), name


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_log_probs_entropy_values_and_gradients_equal_the_unshared_ones(tiny_model_path, role):
    data = grpo_batch()
    mask = data.batch["response_mask"].bool()
    _assert_equal_to_rounding(_passes(tiny_model_path, data, role, share_prompts=True),
                              _passes(tiny_model_path, data, role, share_prompts=False), mask)


def test_qwen3_and_several_micro_batches(tmp_path):
    path = write_tiny_model(tmp_path / "qwen3", "unit", arch="qwen3", seed=0)
    data = grpo_batch(groups=4, n=3, seed=5)
    mask = data.batch["response_mask"].bool()
    # a budget of ~2 groups' tokens: the rows of a prompt may land in different micro-batches
    shared = _passes(path, data, share_prompts=True, max_tokens_per_micro_batch=80)
    plain = _passes(path, data, share_prompts=False, max_tokens_per_micro_batch=80)
    _assert_equal_to_rounding(shared, plain, mask)


def test_the_engines_choice_and_its_error(tiny_model_path, tmp_path):
    assert engine(tiny_model_path).share_prompts  # packed by default: shared
    assert not engine(tiny_model_path, share_prompts=False).share_prompts
    assert not engine(tiny_model_path, use_sequence_packing=False).share_prompts
    moe = write_tiny_model(tmp_path / "moe", "unit", arch="qwen3_moe", seed=0)
    assert not engine(moe).share_prompts
    with pytest.raises(ValueError, match="share_prompts=True cannot run here: the engine does not pack"):
        engine(tiny_model_path, use_sequence_packing=False, share_prompts=True)
    with pytest.raises(ValueError, match="share_prompts=True cannot run here: the model routes experts"):
        engine(moe, share_prompts=True)


def test_the_packed_attention_reads_the_groups(tiny_model_path, monkeypatch):
    calls = []
    real = packing.shared_prompt_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(packing, "shared_prompt_attention", counted)
    data = grpo_batch()
    # one micro-batch; torch's attention (the CPU kernel reads the groups itself: test_cpu_flash_attention.py)
    eng = engine(tiny_model_path, use_dynamic_bsz=True, max_tokens_per_micro_batch=4096, cpu_flash_attention=False)
    eng.compute_log_prob(data, temperature=1.0)
    prompts = int(data.batch["attention_mask"][:, :-12].sum(-1)[[0, 4, 8, 12, 13]].sum())
    assert calls and all(shape[2] == prompts + int(data.batch["response_mask"].sum()) for shape in calls)


def test_groups_past_the_mask_budget_keep_their_own_prompt_copies(tiny_model_path, monkeypatch):
    data = grpo_batch(prompt_len=20, response_len=5)  # prompts longer than the responses: the masked form
    b = data.batch
    R = b["responses"].shape[1]
    full = shared_layout(b["input_ids"], b["attention_mask"], b["position_ids"], R)
    monkeypatch.setattr(shared_prompts, "MASK_BUDGET", 1)  # no group's mask fits: every row on its own
    assert shared_layout(b["input_ids"], b["attention_mask"], b["position_ids"], R) is None
    # room for the first group only (its responses differ in length: one mask per row)
    first_prompt = int(b["attention_mask"][0, :-R].sum())
    monkeypatch.setattr(shared_prompts, "MASK_BUDGET", 4 * R * (first_prompt + R))
    some = shared_layout(b["input_ids"], b["attention_mask"], b["position_ids"], R)
    assert [len(g[2]) for g in some["shared"].groups] == [4] + [1] * 10
    assert some["input_ids"].shape[1] > full["input_ids"].shape[1]
    mask = b["response_mask"].bool()
    _assert_equal_to_rounding(_passes(tiny_model_path, data, share_prompts=True),
                              _passes(tiny_model_path, data, share_prompts=False), mask)


def test_a_group_with_short_prompts_needs_no_mask_and_no_budget(monkeypatch):
    data = grpo_batch(prompt_len=6, response_len=12)
    b = data.batch
    monkeypatch.setattr(shared_prompts, "MASK_BUDGET", 1)
    layout = shared_layout(b["input_ids"], b["attention_mask"], b["position_ids"], 12)
    assert [len(g[2]) for g in layout["shared"].groups] == [4, 4, 4, 1, 1]
    assert all(mask is None for *_, mask in layout["shared"].plan(torch.device("cpu"))["calls"])


@pytest.mark.parametrize(("prompt_len", "response_len", "masked"), [(6, 9, False), (12, 4, True)])
def test_both_attention_forms_equal_each_rows_own_attention(prompt_len, response_len, masked):
    """Outputs and q/k/v gradients (fp64, GQA) equal each row's own causal attention over [prompt; response]:
    groups with responses of different lengths and an empty one, two groups of one padded length, a lone row."""
    spec = [(prompt_len, [response_len, 2, 0]), (prompt_len, [response_len, 1]), (prompt_len - 1, [3])]
    groups, rows, pos = [], [], 0
    for plen, lengths in spec:
        start, responses = pos, []
        pos += plen
        for length in lengths:
            responses.append((pos, length))
            rows.append(torch.cat((torch.arange(start, start + plen), torch.arange(pos, pos + length))))
            pos += length
        groups.append((start, plen, responses))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, pos, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, pos, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    shared = shared_prompts.SharedPrompts(groups=groups, tokens=pos)
    out = shared_prompts.shared_prompt_attention(q, k, v, shared, 0.0, None, 2)[0]
    calls = shared.plan(torch.device("cpu"))["calls"]
    assert any(mask is not None for *_, mask in calls) == masked
    want = torch.zeros(pos, 4, 8, dtype=torch.float64)
    for idx in rows:  # a prompt's outputs are the same in each of its rows: the last write stands
        own = torch.nn.functional.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx],
                                                               is_causal=True, enable_gqa=True)
        want = want.index_copy(0, idx, own[0].transpose(0, 1))
    assert float((out - want).detach().abs().max()) <= 1e-12
    weights = torch.randn(out.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for a, e in zip(got, expected):
        assert float(e.abs().max()) > 0 and float((a - e).abs().max()) <= 1e-12
