"""The training engine's packed CPU attention (engines/cpu_flash_attention.py, cpu_flash_attention.c): it builds here;
its output and gradients equal fp64 SDPA's to fp32 rounding for packed rows (lengths around its blocks and vector
widths, GQA group sizes, head sizes) and for shared-prompt groups, in every vector width this CPU runs; bf16 rounds
the operands and computes in fp32, no farther from fp64 than autocast SDPA; the bits do not depend on the thread
count; what it takes and refuses; an engine takes it by default for packed micro-batches, shared or not, with the
log-probs and gradients of an engine without it to rounding (fp32) or to bf16's resolution; asking for it where it
cannot run is an error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_attention import _builds  # the native build and the narrower vector widths this CPU runs
from test_shared_prompts import grpo_batch
from test_train_engine import engine, pg_loss

from hybridflow.engines import cpu_flash_attention as fa


@pytest.fixture(scope="module", params=_builds(), ids=lambda flags: " ".join(flags) or "native")
def kernel(request):
    built = fa.load(request.param)
    # no skip: where the kernel does not build the engine falls back silently, so a failed build must fail here
    assert built is not None, f"the training attention kernel did not build with {request.param} (see the log)"
    return built


def _inputs(tokens: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, n, dim, generator=g, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]


def _reference(base, allowed: torch.Tensor, grad: torch.Tensor):
    """fp64 SDPA under the boolean mask `allowed` [T, T]: output [T, H, D] and the gradients of q, k, v."""
    q, k, v = (t.transpose(0, 1)[None].detach().requires_grad_() for t in base)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=q.shape[1] != k.shape[1])
    out = out[0].transpose(0, 1)
    out.backward(grad)
    return out, [t.grad[0].transpose(0, 1) for t in (q, k, v)]


def _check(kernel, base, layout, allowed):
    q, k, v = (t.float() for t in base)
    out, lse = kernel.forward(q, k, v, layout, q.shape[-1] ** -0.5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref, ref_grads = _reference(base, allowed, grad)
    assert float((out.double() - ref.detach()).abs().max()) <= 1e-5 * float(ref.detach().abs().max())
    got = kernel.backward(q, k, v, out, lse, grad.float(), layout, q.shape[-1] ** -0.5)
    for name, mine, theirs in zip(("dq", "dk", "dv"), got, ref_grads):
        assert mine.shape == theirs.shape
        assert float((mine.double() - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max()), name


def _rows_mask(lengths: list[int]) -> torch.Tensor:
    allowed = torch.zeros(sum(lengths), sum(lengths), dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return allowed


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (8, 2, 64), (6, 3, 32), (2, 1, 128)])
def test_packed_rows_equal_fp64_sdpa(kernel, heads, kv_heads, dim):
    assert dim % kernel.vector_width == 0  # 16 floats at most: every build takes these head sizes
    # around the query block (48), the register block (6) and the vector widths; one-token rows
    lengths = [1, 17, 48, 49, 2, 97, 6, 1, 130]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    layout = kernel.layout([(lo, n, 0, 0) for lo, n in zip(starts, lengths)], list(range(len(lengths) + 1)))
    _check(kernel, _inputs(sum(lengths), heads, kv_heads, dim), layout, _rows_mask(lengths))


def test_shared_prompt_groups_equal_fp64_sdpa(kernel):
    """Each prompt attends causally to itself, each response fully to its prompt and causally to itself; prompts
    of one token and of lengths that are not multiples of the vector width, empty and long responses."""
    groups, pos = [], 0
    for prompt, responses in ((20, [5, 33, 0, 17]), (7, [60]), (50, [3, 1]), (1, [100, 2]), (16, [16])):
        start, pos = pos, pos + prompt
        spans = []
        for n in responses:
            spans.append((pos, n))
            pos += n
        groups.append((start, prompt, spans))
    allowed = torch.zeros(pos, pos, dtype=torch.bool)
    for start, prompt, spans in groups:
        allowed[start:start + prompt, start:start + prompt] = torch.ones(prompt, prompt, dtype=torch.bool).tril()
        for r, n in spans:
            allowed[r:r + n, start:start + prompt] = True
            allowed[r:r + n, r:r + n] = torch.ones(n, n, dtype=torch.bool).tril()
    sequences, offsets = [], [0]
    for start, prompt, spans in groups:
        sequences += [(start, prompt, 0, 0)] + [(r, n, start, prompt) for r, n in spans if n]
        offsets.append(len(sequences))
    dim = 16 if kernel.vector_width <= 16 else kernel.vector_width
    _check(kernel, _inputs(pos, 4, 2, dim, seed=3), kernel.layout(sequences, offsets), allowed)


def test_the_shared_layout_of_groups_and_its_refusal():
    if fa.load() is None:
        pytest.fail("the training attention kernel did not build here")
    layout = fa.shared_layout([(0, 3, [(3, 2), (5, 0), (5, 4)]), (9, 2, [(11, 1)])], 12)
    assert layout.sequences.tolist() == [[0, 3, 0, 0], [3, 2, 0, 3], [5, 4, 0, 3], [9, 2, 0, 0], [11, 1, 9, 2]]
    assert layout.groups.tolist() == [0, 3, 5]
    assert fa.shared_layout([(0, 3, [(3, 2)])], 6) is None  # token 5 is in no group
    assert fa.shared_layout([(0, 3, [(2, 2)])], 4) is None  # token 2 twice
    assert fa.shared_layout([(0, 3, [(3, 5)])], 6) is None  # a response past the packed row's last token
    assert fa.shared_layout([(2, 3, [(5, 1)])], 6) is None  # tokens 0 and 1 in no group


def test_what_it_takes():
    kernel = fa.load()
    assert kernel is not None
    D = 4 * kernel.vector_width

    def qkv(heads=4, kv_heads=2, dim=D, dtype=torch.float32):
        return [torch.randn(1, 10, n, dim, dtype=dtype).transpose(1, 2) for n in (heads, kv_heads, kv_heads)]

    assert fa.takes(*qkv(), 0.0)
    assert not fa.takes(*qkv(), 0.1)  # dropout
    assert fa.takes(*qkv(dtype=torch.bfloat16), 0.0)  # bf16: computed in fp32 from the bf16 operands
    assert not fa.takes(*qkv(dtype=torch.float16), 0.0)
    assert not fa.takes(*qkv(heads=3), 0.0)  # 3 query heads over 2 key/value heads
    assert not fa.takes(*qkv(dim=kernel.vector_width + 2), 0.0)
    q, k, v = qkv()
    assert not fa.takes(q, k, v[..., :-kernel.vector_width], 0.0)  # values of another head size
    assert not fa.takes(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), 0.0)  # not one packed row
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fa.takes(q, k, v.bfloat16(), 0.0)  # the engine's bf16: fp32 q and k, bf16 v
    with torch.autocast("cpu", dtype=torch.float16):
        assert not fa.takes(q, k, v, 0.0)


def test_bf16_rounds_the_operands_and_computes_in_fp32():
    """Under bf16 autocast (q, k fp32 as the rotary embedding leaves them, v bf16): the output is the fp64 attention
    of the bf16-rounded operands rounded to bf16, no farther from the exact result than SDPA's bf16 kernel's; the
    gradients are bf16-rounded, of each operand's dtype, no farther from fp64's than autocast SDPA's."""
    kernel = fa.load()
    lengths = [5, 40, 71]
    T = sum(lengths)
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(1, T, n, 2 * kernel.vector_width, generator=g) for n in (4, 2, 2)]

    def operands():
        q, k, v = (t.transpose(1, 2).clone() for t in base)
        return [q.requires_grad_(), k.requires_grad_(), v.bfloat16().detach().requires_grad_()]

    ours, theirs = operands(), operands()
    exact = [t.detach().bfloat16().double().requires_grad_() for t in operands()]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()

    def sdpa_per_row(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, :, lo:lo + n], k[:, :, lo:lo + n], v[:, :, lo:lo + n],
                                                         is_causal=True, enable_gqa=True)
                          for lo, n in zip(starts, lengths)], dim=2).transpose(1, 2)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fa.packed_causal_attention(*ours, fa.rows_layout(torch.tensor([0, *lengths]).cumsum(0)), None)
        ref = sdpa_per_row(*theirs)
    want = sdpa_per_row(*exact)
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    err_ours = float((out.detach().double() - want.detach()).abs().max())
    err_theirs = float((ref.detach().double() - want.detach()).abs().max())
    assert err_ours <= 2 ** -8 * float(want.detach().abs().max()) and err_ours <= err_theirs + 1e-6, (err_ours, err_theirs)
    weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    (ref.double() * weights).sum().backward()
    (want * weights).sum().backward()
    for a, b, e in zip(ours, theirs, exact):
        assert a.grad.dtype == a.dtype
        err_a, err_b = float((a.grad.double() - e.grad).abs().max()), float((b.grad.double() - e.grad).abs().max())
        assert err_a <= 1.1 * err_b + 1e-3 * float(e.grad.abs().max()), (err_a, err_b)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = fa._PackedCausal.apply

    def counted(*args):
        calls.append(args[3])
        return real(*args)

    monkeypatch.setattr(fa._PackedCausal, "apply", counted)
    return calls


@pytest.mark.parametrize(("share_prompts", "dtype"), [(True, "fp32"), (False, "fp32"), (True, "bf16")],
                         ids=["shared-prompts", "rows", "shared-prompts-bf16"])
def test_the_engine_takes_it_with_the_same_log_probs_and_update_to_rounding(tiny_model_path, kernel_calls,
                                                                            share_prompts, dtype):
    data = grpo_batch()
    mask = data.batch["response_mask"].bool()
    results = {}
    for on in (True, False):
        eng = engine(tiny_model_path, cpu_flash_attention=on, share_prompts=share_prompts, use_dynamic_bsz=True,
                     max_tokens_per_micro_batch=4096, param_dtype=dtype)
        before = len(kernel_calls)
        log_probs = eng.compute_log_prob(data, temperature=0.7, calculate_entropy=True)
        eng.forward_backward(data, pg_loss)
        layers = sum(type(m).__name__.endswith("DecoderLayer") for m in eng.model.modules())
        assert layers > 0
        # one call per layer and pass (log-probs, training forward), or none
        assert len(kernel_calls) - before == (2 * layers if on else 0)
        if on:
            kinds = {len(layout.groups) - 1 < layout.sequences.shape[0] for layout in kernel_calls[before:]}
            assert kinds == {share_prompts}  # shared groups hold several sequences each
        results[on] = log_probs, {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}
    (l1, g1), (l0, g0) = results[True], results[False]
    # bf16: the two attentions round differently (module docstring); they agree to bf16's resolution, the kernel's
    # being the closer to the exact result (test_bf16_rounds_the_operands_and_computes_in_fp32)
    tolerance = 1e-5 if dtype == "fp32" else 3e-2
    for key in ("log_probs", "entropy"):
        assert float((l1[key] - l0[key])[mask].abs().max()) <= tolerance, key
    assert g1.keys() == g0.keys() and g0
    for name in g0:
        scale = float(g0[name].abs().max())
        assert float((g1[name] - g0[name]).abs().max()) <= tolerance * max(1.0, scale), name


def test_the_engine_default_and_its_error(tiny_model_path):
    assert fa.flash_attention_here(torch.device("cpu"))
    eng = engine(tiny_model_path)
    assert all(getattr(m, "hybridflow_flash_attention", False) for m in eng.model.modules()
               if type(m).__name__.endswith("Attention"))
    assert not any(getattr(m, "hybridflow_flash_attention", False)
                   for m in engine(tiny_model_path, use_sequence_packing=False).model.modules())
    with pytest.raises(ValueError, match="cpu_flash_attention=True needs a CPU"):
        fa.flash_attention_here(torch.device("meta"), True)


def test_the_result_does_not_depend_on_the_thread_count():
    """Each output and each gradient is one task's, in a fixed order: the bits are the same on 1 thread and on 2."""
    kernel = fa.load()
    lengths = [33, 1, 70, 12]
    base = _inputs(sum(lengths), 4, 2, 2 * kernel.vector_width, seed=5)
    q, k, v = (t.float() for t in base)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    layout = kernel.layout([(lo, n, 0, 0) for lo, n in zip(starts, lengths)], list(range(len(lengths) + 1)))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out, lse = kernel.forward(q, k, v, layout, 0.3)
            results.append((out, lse, *kernel.backward(q, k, v, out, lse, grad, layout, 0.3)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)
