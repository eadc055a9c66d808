"""The native rollout's fp32 panel kernel (cpu_linear.py): F.linear up to fp32 rounding at every shape the decoder
meets (tails of panels and row blocks, bias or not, strided input), a row's result independent of the other rows,
the AVX2 variant as well as the AVX-512 one, a re-pack into old panels, and the engine on it: the oneDNN engine's
tokens, weight updates re-packed (in place), oneDNN kept for batch-invariant decoding, and a fallback that says why."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_rollout_engines import make_prompts, write_model

from hybridflow import device
from hybridflow.engines.rollout import SamplingParams, c_kernels, cpu_linear, create_rollout_engine

pytestmark = pytest.mark.skipif(device.is_cuda_available(), reason="a CPU-only path")


def _variants() -> list[tuple[str, ...]]:
    variants = [()]
    if torch.cpu._is_avx512_supported() and torch.cpu._is_avx2_supported():
        variants.append(("-mno-avx512f",))  # the AVX2 build, on a CPU that also runs the AVX-512 one
    return variants


@pytest.fixture(scope="module", params=_variants(), ids=lambda flags: "avx2" if flags else "native")
def kernel(request):
    built = cpu_linear.load(request.param)
    if built is None:
        pytest.skip("no C compiler, or a CPU without AVX2/AVX-512 (the decoder keeps oneDNN; tested below)")
    assert built.vector_width == (8 if request.param else (16 if torch.cpu._is_avx512_supported() else 8))
    return built


@pytest.mark.parametrize("out_features,in_features", [(96, 80), (1024, 512), (17, 40), (3, 7), (50, 33), (288, 128)])
def test_panel_linear_is_f_linear_up_to_rounding(kernel, out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    packed = kernel.pack(w)
    assert packed.panels.shape == (-(-out_features // 16), in_features, 16) and packed.out_features == out_features
    # row counts around the AVX-512 (12) and AVX2 (6) row blocks and their split of a remainder
    for rows in (0, 1, 5, 6, 7, 12, 13, 15, 16, 17, 23, 25, 64, 130):
        x = torch.randn(rows, in_features, generator=g)
        want = F.linear(x.double(), w.double(), b.double()).float()
        torch.testing.assert_close(kernel.linear(x, packed, b), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(kernel.linear(x, packed, None), want - b, atol=1e-4, rtol=1e-5)


def test_calls_past_max_rows_run_f_linear_on_the_weight_itself(kernel):
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 32, generator=g), torch.randn(40, generator=g)
    packed = kernel.pack(w)
    assert packed.weight.data_ptr() == w.data_ptr()  # the caller's tensor, not a copy
    x = torch.randn(cpu_linear.MAX_ROWS + 3, 32, generator=g)
    assert torch.equal(kernel.linear(x, packed, b), F.linear(x, w, b))
    # up to MAX_ROWS the panels serve the call: a row's result is the same in a call of 7 rows or of MAX_ROWS
    assert torch.equal(kernel.linear(x[:7], packed, b), kernel.linear(x[: cpu_linear.MAX_ROWS], packed, b)[:7])
    new = torch.randn(40, 32, generator=g)
    assert kernel.pack(new, out=packed) is packed and packed.weight.data_ptr() == new.data_ptr()  # follows it
    assert torch.equal(kernel.linear(x, packed, None), F.linear(x, new))
    half = kernel.pack(new.bfloat16())  # packed from a converted copy: none kept, the panels serve every call
    assert half.weight is None
    torch.testing.assert_close(kernel.linear(x, half, None), F.linear(x, new.bfloat16().float()), atol=1e-4,
                               rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows(kernel):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    packed = kernel.pack(w)
    x = torch.randn(40, 48, generator=g)
    full = kernel.linear(x, packed, b)
    for lo, hi in ((0, 1), (5, 6), (3, 16), (13, 40)):
        assert torch.equal(kernel.linear(x[lo:hi], packed, b), full[lo:hi])
    # any leading shape, and a strided input, are the same rows
    assert torch.equal(kernel.linear(x.view(4, 10, 48), packed, b).view(40, 80), full)
    wide = torch.randn(40, 96, generator=g)
    wide[:, :48] = x
    assert torch.equal(kernel.linear(wide[:, :48], packed, b), full)
    # past 64 inputs, a call of two row blocks (13-23 rows with AVX-512, 7-11 with AVX2) takes the K loop in chunks:
    # the same sums in the same order, so the same bits as one row alone
    w, b = torch.randn(70, 200, generator=g), torch.randn(70, generator=g)
    packed = kernel.pack(w)
    x = torch.randn(24, 200, generator=g)
    alone = torch.cat([kernel.linear(x[i:i + 1], packed, b) for i in range(24)])
    for rows in (7, 11, 13, 14, 15, 16, 17, 23, 24):
        assert torch.equal(kernel.linear(x[:rows], packed, b), alone[:rows]), rows


def test_a_re_pack_into_old_panels_is_a_fresh_pack(kernel):
    g = torch.Generator().manual_seed(2)
    old = kernel.pack(torch.randn(64, 40, generator=g))
    w = torch.randn(64, 40, generator=g)
    again = kernel.pack(w, out=old)
    assert again is old and torch.equal(again.panels, kernel.pack(w).panels)
    # another shape, or a width that is not whole panels, packs anew and leaves `out` alone
    before = old.panels.clone()
    for other in (torch.randn(32, 40, generator=g), torch.randn(60, 40, generator=g)):
        packed = kernel.pack(other, out=old)
        assert packed is not old and torch.equal(packed.panels, kernel.pack(other).panels)
    assert torch.equal(old.panels, before)


def test_bad_input_is_refused_with_the_shapes(kernel):
    packed = kernel.pack(torch.randn(32, 16))
    with pytest.raises(ValueError, match=r"x \(3, 8\).*32 x 16"):
        kernel.linear(torch.randn(3, 8), packed, None)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.linear(torch.randn(3, 16).bfloat16(), packed, None)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # untied head: the packed lm_head is used; qwen2: biased q/k/v projections
    return write_model(tmp_path_factory.mktemp("panel") / "qwen2", "qwen2", seed=5, tie=False)


# linear_kernel=True (and the default) takes the kernel wherever it builds, the AVX2 build too
needs_kernel = pytest.mark.skipif(cpu_linear.load() is None, reason="the panel kernel cannot be built here")


@needs_kernel
def test_the_engine_on_the_kernel_gives_the_onednn_engines_tokens_and_log_probs(model_path):
    panel = create_rollout_engine("native", model_path, num_threads=1, prepack=True, linear_kernel=True)
    onednn = create_rollout_engine("native", model_path, num_threads=1, prepack=True, linear_kernel=False)
    assert panel.model.matmul == "panel" and onednn.model.matmul == "onednn"
    prompts = make_prompts(panel.tokenizer)
    for params in (SamplingParams(greedy=True, max_new_tokens=16),
                   SamplingParams(temperature=1.0, n=3, max_new_tokens=16, seed=4)):
        a, b = panel.generate(prompts, params), onednn.generate(prompts, params)
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)


@needs_kernel
def test_a_weight_update_is_re_packed(model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = create_rollout_engine("native", model_path, num_threads=1, prepack=True, linear_kernel=True)
    other_path = write_model(tmp_path / "other", "qwen2", seed=11, tie=False)
    fresh = create_rollout_engine("native", other_path, num_threads=1, prepack=True, linear_kernel=True)
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=12)
    before = engine.generate(prompts, params)  # packs the first weights
    panels = engine.model.packed_weights()["layers"][0]["qkv"].panels
    engine.update_weights(AutoModelForCausalLM.from_pretrained(other_path).state_dict().items())
    after, want = engine.generate(prompts, params), fresh.generate(prompts, params)
    assert engine.model.packed_weights()["layers"][0]["qkv"].panels is panels  # re-packed in place
    assert not torch.equal(before.batch["rollout_log_probs"], want.batch["rollout_log_probs"])
    assert torch.equal(after.batch["responses"], want.batch["responses"])
    assert torch.equal(after.batch["rollout_log_probs"], want.batch["rollout_log_probs"])


def test_batch_invariant_decoding_keeps_onednn_and_refuses_the_kernel(model_path):
    engine = create_rollout_engine("native", model_path, num_threads=1, batch_invariant=True)
    assert engine.model.matmul in ("onednn", "dense") and engine.model.panel_kernel is None
    with pytest.raises(ValueError, match="drop linear_kernel=True"):
        create_rollout_engine("native", model_path, num_threads=1, batch_invariant=True, linear_kernel=True)


def test_linear_kernel_true_where_it_cannot_run_is_an_error(model_path):
    with pytest.raises(ValueError, match=r"linear_kernel=True.*'dense'"):
        create_rollout_engine("native", model_path, num_threads=1, prepack=False, linear_kernel=True)


def test_without_a_compiler_the_decoder_says_so_and_keeps_onednn(model_path, monkeypatch, tmp_path, caplog):
    cpu_linear.load.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HYBRIDFLOW_KERNEL_CACHE", str(tmp_path / "kernels"))
    try:
        with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
            engine = create_rollout_engine("native", model_path, num_threads=1, prepack=True)
        assert engine.model.matmul == "onednn" and engine.model.panel_kernel is None
        assert "the projections run as oneDNN's packed matmuls" in caplog.text
        out = engine.generate(make_prompts(engine.tokenizer), SamplingParams(greedy=True, max_new_tokens=8))
        assert out.batch["response_mask"].sum() > 0
        with pytest.raises(ValueError, match="kernel built: False"):
            create_rollout_engine("native", model_path, num_threads=1, prepack=True, linear_kernel=True)
    finally:
        cpu_linear.load.cache_clear()  # later tests build (or find) the real kernel again


def test_either_build_is_the_default(kernel, monkeypatch):
    """kernel_for(None) and kernel_for(True) take the build made here, AVX-512 or AVX2; False takes none."""
    monkeypatch.setattr(cpu_linear, "load", lambda: kernel)
    assert cpu_linear.kernel_for(False) is None
    assert cpu_linear.kernel_for(True) is kernel and cpu_linear.kernel_for(None) is kernel


@pytest.mark.parametrize("shapes", [[(96, 80), (17, 40), (3, 7), (288, 128)], [(50, 33)]])
def test_panels_laid_out_in_one_buffer_pack_as_fresh_ones(kernel, shapes):
    g = torch.Generator().manual_seed(4)
    buffer = torch.full((kernel.panel_bytes(shapes) + 64,), 255, dtype=torch.uint8)  # not zero: panel_weights zeroes
    panels = kernel.panel_weights(shapes, buffer)
    for (n, k), out in zip(shapes, panels):
        assert out.panels.data_ptr() % 64 == 0 and out.panels.is_contiguous()
        w = torch.randn(n, k, generator=g)
        assert kernel.pack(w, out=out) is out and torch.equal(out.panels, kernel.pack(w).panels)
        x = torch.randn(5, k, generator=g)
        assert torch.equal(kernel.linear(x, out, None), kernel.linear(x, kernel.pack(w), None))


@needs_kernel
def test_huge_pages_hold_the_panels_and_change_no_bit(model_path):
    on = create_rollout_engine("native", model_path, num_threads=1, linear_kernel=True, prepack=True,
                               huge_pages=None if not device.huge_pages_available() else True)
    off = create_rollout_engine("native", model_path, num_threads=1, linear_kernel=True, prepack=True,
                                huge_pages=False)
    assert on.model.huge_pages == device.huge_pages_available() and not off.model.huge_pages
    prompts = make_prompts(on.tokenizer)
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=4)
    a, b = on.generate(prompts, params), off.generate(prompts, params)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"])
    panels = on.model.packed_weights()["layers"][0]["qkv"].panels
    assert device.huge_page_state(panels)["eligible"] == device.huge_pages_available()  # advised (the rest is
    assert panels.data_ptr() % device.HUGE_PAGE_BYTES == 0 or not device.huge_pages_available()  # the kernel's)
    # all the projections in one buffer, in order
    packed = on.model.packed_weights()
    first, head = packed["layers"][0]["qkv"].panels, packed["lm_head"].panels
    assert first.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()


def test_huge_pages_true_where_the_projections_are_not_panels_is_an_error(model_path):
    with pytest.raises(ValueError, match=r"huge_pages=True.*'dense'"):
        create_rollout_engine("native", model_path, num_threads=1, prepack=False, huge_pages=True)
