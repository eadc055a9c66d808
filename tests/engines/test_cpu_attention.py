"""The CPU decode-attention kernel (engines/rollout/cpu_attention.py, cpu_decode_attention.c): it builds here, it
computes what kv_cache.decode_attention computes (both cache layouts, compaction, left padding, sliding windows,
soft-capping, GQA group sizes, head sizes not a multiple of its blocks, fp32 and bf16), it writes a step's K/V as
write_token does, a native engine gives the
same tokens with and without it, bf16 engines use it by default, and without a compiler the engine falls back to
torch's path and says why."""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.engines.rollout import SamplingParams, c_kernels, cpu_attention, create_rollout_engine
from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows, attention_bias, decode_attention
from hybridflow.engines.tiny import write_tiny_model

LAYERS, MAX_NEW = 2, 9


def _builds() -> list[tuple[str, ...]]:
    """The build the engine uses here, and the narrower vector widths of the same source this CPU also runs."""
    builds = [()]
    if torch.cpu._is_avx512_supported():
        builds.append(("-mno-avx512f",))  # 8-wide (AVX2)
    if torch.cpu._is_avx2_supported():
        builds.append(("-mno-avx",))  # 4-wide (SSE), the portable vector code and buffered partial loads
    return builds


@pytest.fixture(scope="module")
def kernel():
    built = cpu_attention.load()
    assert built is not None, "the decode-attention kernel did not build on this machine (see the log warning)"
    return built


@pytest.fixture(scope="module", params=_builds(), ids=lambda flags: " ".join(flags) or "native")
def any_build(request):
    built = cpu_attention.load(request.param)
    assert built is not None, f"the decode-attention kernel did not build with {request.param} (see the log warning)"
    return built


def _filled_cache(n, kv, D, dtype, g, P):
    prompts = 3
    cache = KVCache(LAYERS, kv, D, prompts=prompts, prompt_len=P, n=n, max_new=MAX_NEW, dtype=dtype,
                    device=torch.device("cpu"))
    for li in range(LAYERS):
        cache.write_prompts(li, torch.randn(prompts, kv, P, D, generator=g).to(dtype),
                            torch.randn(prompts, kv, P, D, generator=g).to(dtype))
    mask = torch.ones(prompts, P, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[2, :P - 1] = False  # a one-token prompt
    return cache, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0), (5, 20.0)])
@pytest.mark.parametrize("kv,G,D", [(2, 1, 64), (2, 3, 16), (1, 7, 80), (2, 4, 128), (1, 2, 72)])
# prompts of 7 keys: every key block partial; of 37: full vectors and a tail; of 200: more key columns than one block
# of the widest kind holds (12 vectors, 192 keys with AVX-512), so a task's scores take two blocks
@pytest.mark.parametrize("P", [7, 37, 200])
def test_the_kernel_matches_torchs_decode_attention(any_build, dtype, n, window, softcap, kv, G, D, P):
    kernel = any_build
    g = torch.Generator().manual_seed(n * 1000 + G * 10 + D + P)
    cache, mask = _filled_cache(n, kv, D, dtype, g, P)
    twin = _cloned(cache)  # the same cache, with each step's K/V written by the kernel instead of write_token
    rows = mask.shape[0] * n
    prompt_of = torch.arange(rows) // n
    running = RunningRows(prompt_of, torch.arange(rows) % n, n)
    bias_rows = torch.zeros(rows, P, dtype=dtype).masked_fill(~mask[prompt_of], float("-inf"))
    live = torch.arange(rows)
    for step in range(MAX_NEW):
        if step == 4:  # rows 0 and 2 stop: the others move to the front (ungrouped from then on)
            keep = torch.tensor([i for i in range(live.numel()) if i not in (0, 2)])
            cache.compact(keep, step)
            twin.compact(keep, step)
            live, bias_rows = live[keep], bias_rows[keep]
            running = RunningRows(running.prompt_index[keep], running.sample_index[keep], n, grouped=False)
        r = live.numel()
        new = [(torch.randn(r, kv, D, generator=g).to(dtype), torch.randn(r, kv, D, generator=g).to(dtype))
               for _ in range(LAYERS)]
        for li in range(LAYERS):
            cache.write_token(li, step, *new[li])
        assert kernel.supports(cache)
        starts = kernel.starts(bias_rows, P, step + 1, [window])
        assert starts is not None
        bias = attention_bias(cache, bias_rows, step + 1, window=window)
        q = torch.randn(r, kv, G, D, generator=g).to(dtype)
        for li in range(LAYERS):
            got = kernel(q, cache, li, running, starts[window], step + 1, 0.3, softcap)
            wrote = kernel(q, twin, li, running, starts[window], step + 1, 0.3, softcap, *new[li])
            assert torch.equal(wrote, got)
            column = twin.offset + step
            assert torch.equal(twin.keys[li][:r, :, :, column], cache.keys[li][:r, :, :, column])
            assert torch.equal(twin.values[li][:r, :, column], cache.values[li][:r, :, column])
            if dtype == torch.float32:
                want = decode_attention(q, cache, li, running, bias, step + 1, 0.3, softcap)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:  # against torch's path on the same bf16 values in fp32 (the kernel accumulates in fp32)
                want = decode_attention(q.float(), _as_float(cache), li, running, _float_bias(bias), step + 1, 0.3,
                                        softcap)
                torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _mapped(cache: KVCache, fn) -> KVCache:
    """A KVCache with fn applied to each of its tensors."""
    copy = object.__new__(KVCache)
    copy.__dict__ = dict(cache.__dict__)
    for name in ("keys", "values", "prompt_keys", "prompt_values"):
        if hasattr(cache, name):
            setattr(copy, name, [fn(t) for t in getattr(cache, name)])
    return copy


def _cloned(cache: KVCache) -> KVCache:
    return _mapped(cache, torch.Tensor.clone)


def _as_float(cache: KVCache) -> KVCache:
    return _mapped(cache, torch.Tensor.float)


def _float_bias(bias):
    if isinstance(bias, tuple):
        return tuple(None if b is None else b.float() for b in bias)
    return bias.float()


def test_a_mask_that_is_not_left_padding_takes_torchs_path(kernel):
    bias = torch.zeros(2, 5)
    bias[0, 3] = float("-inf")  # a hole in the middle: no first-column form
    assert kernel.starts(bias, 5, 1, [None]) is None
    bias = torch.zeros(2, 5)
    bias[1, :2] = float("-inf")
    starts = kernel.starts(bias, 5, 4, [None, 3])
    assert starts[None].tolist() == [0, 2] and starts[3].tolist() == [6, 6]  # 5 + 4 - 3


def _engine_outputs(path, dtype="fp32", **kwargs):
    engine = create_rollout_engine("native", path, dtype=dtype, seed=3, **kwargs)
    prompts = engine.tokenizer(["a b c", "d", "e f g h i j"], return_tensors="pt", padding=True, padding_side="left")
    from hybridflow.protocol import DataProto

    batch = DataProto.from_dict({
        "input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"],
        "position_ids": (prompts["attention_mask"].cumsum(-1) - 1).clamp(min=0),
    })
    greedy = engine.generate(batch, SamplingParams(greedy=True, max_new_tokens=12))
    sampled = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=12, n=3))
    return engine, greedy, sampled


@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_the_engine_gives_the_same_tokens_with_and_without_the_kernel(kernel, tmp_path, arch):
    path = write_tiny_model(str(tmp_path / arch), "tiny", seed=0, arch=arch)
    with_kernel, greedy_k, sampled_k = _engine_outputs(path, attention_kernel=True)
    assert with_kernel.model.attention_kernel is not None
    without, greedy_t, sampled_t = _engine_outputs(path, attention_kernel=False)
    assert without.model.attention_kernel is None
    assert _engine_outputs(path)[0].model.attention_kernel is kernel  # the default in fp32 too
    for a, b in ((greedy_k, greedy_t), (sampled_k, sampled_t)):
        assert torch.equal(a.batch["responses"], b.batch["responses"])
        torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], rtol=0, atol=1e-5)


def test_bf16_engines_use_the_kernel_by_default_too(kernel, tmp_path):
    path = write_tiny_model(str(tmp_path / "m"), "tiny", seed=0, arch="llama")
    engine, greedy, sampled = _engine_outputs(path, dtype="bf16")
    assert engine.model.attention_kernel is kernel
    assert greedy.batch["response_mask"].sum() > 0 and torch.isfinite(sampled.batch["rollout_log_probs"]).all()


def test_without_a_compiler_the_engine_says_so_and_uses_torch(monkeypatch, tmp_path, caplog):
    path = write_tiny_model(str(tmp_path / "m"), "tiny", seed=0, arch="qwen2")
    cpu_attention.load.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("HYBRIDFLOW_KERNEL_CACHE", str(tmp_path / "kernels"))
    try:
        with caplog.at_level(logging.WARNING, logger=c_kernels.__name__):
            engine, greedy, _ = _engine_outputs(path, dtype="bf16")
        assert engine.model.attention_kernel is None
        assert "decode attention runs as torch matmuls" in caplog.text
        assert greedy.batch["response_mask"].sum() > 0
        with pytest.raises(ValueError, match="could not be built"):
            create_rollout_engine("native", path, dtype="fp32", attention_kernel=True)
        assert create_rollout_engine("native", path, dtype="fp32").model.attention_kernel is None
    finally:
        cpu_attention.load.cache_clear()  # later tests build (or find) the real kernel again


def test_left_pads_are_kept_per_mask_and_found_again_when_it_changes(kernel):
    bias = torch.zeros(2, 5)
    bias[1, :2] = float("-inf")
    assert kernel.starts(bias, 5, 1, [None])[None].tolist() == [0, 2]
    assert kernel.starts(bias, 5, 2, [None, 3])[3].tolist() == [4, 4]  # the kept pads, a new window clamp
    bias[0, :3] = float("-inf")  # written in place: torch's version counter moves
    assert kernel.starts(bias, 5, 1, [None])[None].tolist() == [3, 2]
    assert kernel.starts(bias, 4, 1, [None]) is None  # another prompt length: [0, :3] of 4 columns is not [0, 2]
    with torch.inference_mode():
        fresh = torch.zeros(2, 5)
        fresh[0, :1] = float("-inf")
        assert kernel.starts(fresh, 5, 1, [None])[None].tolist() == [1, 0]
