"""The prefill without left padding (engines/rollout/packed_prefill.py): on left-padded prompts of different lengths
its logits and the K/V of every real position are bitwise those of NativeDecoder.prefill (which computes the padding
too), for dense, biased, soft-capped, sliding-window and routed-expert architectures and oneDNN-packed weights; a
batch without padding and MoE route recording keep the padded prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_rollout_engines import make_prompts

from hybridflow.engines.rollout import create_rollout_engine
from hybridflow.engines.rollout.kv_cache import KVCache
from hybridflow.engines.rollout.layout import read_prompts
from hybridflow.engines.rollout.packed_prefill import packed_prefill
from hybridflow.engines.tiny import SIZES, write_tiny_model

# lengths 3..33 characters: up to 30 padding columns in a row, and past the 8-token sliding window below
TEXTS = ["a", "hello world, this is a long prompt!", "abc", "the quick brown fox", "xy z"]


def _cache(model, prompts: int, prompt_len: int) -> KVCache:
    s = model.shape
    return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, prompts=prompts, prompt_len=prompt_len, n=1, max_new=2,
                   dtype=model.dtype, device=model.device)


def _engine(tmp_path, arch: str, prepack: bool | None = None, window: int | None = None):
    spec = dataclasses.replace(SIZES["unit"], arch=arch, sliding_window=window)
    path = write_tiny_model(tmp_path / arch, spec, seed=1, arch=arch)
    return create_rollout_engine("native", path, num_threads=1, prepack=prepack)


@pytest.mark.parametrize("arch,prepack,window", [("qwen2", None, None), ("qwen2", True, None), ("mistral", None, 8),
                                                 ("gemma2", None, 8), ("qwen3_moe", None, None)])
@torch.inference_mode()
def test_packed_prefill_equals_the_padded_one(tmp_path, arch, prepack, window):
    engine = _engine(tmp_path, arch, prepack, window)
    model = engine.model
    assert window is None or window in model.shape.windows  # the sliding window is shorter than the prompts
    if prepack:
        assert model.prepacked or not torch.backends.mkldnn.is_available()
    read = read_prompts(make_prompts(engine.tokenizer, TEXTS))
    ids, mask, pos = read.input_ids, read.attention_mask, read.position_ids
    B, P = ids.shape
    assert int(mask.sum()) < B * P  # there is padding to leave out
    padded, packed = _cache(model, B, P), _cache(model, B, P)
    want = model.prefill(ids, pos, mask, padded)

    fed = []
    original = model._layers

    def spy(tokens, *args):
        fed.append(tokens.shape)
        return original(tokens, *args)

    model._layers = spy
    got = packed_prefill(model, ids, pos, mask, packed)
    assert fed == [torch.Size([int(mask.sum())])]  # the layers ran on the real tokens only
    assert torch.equal(got, want)
    real = mask.bool()[:, None, :, None]
    for a, b in zip(padded.keys, packed.keys):  # keys stored transposed: [B, kv, D, P + max_new] (kv_cache.py)
        a, b = a[..., :P].transpose(-1, -2), b[..., :P].transpose(-1, -2)
        assert torch.equal(torch.where(real, a, 0), torch.where(real, b, 0))
    for a, b in zip(padded.values, packed.values):
        assert torch.equal(torch.where(real, a[:, :, :P], 0), torch.where(real, b[:, :, :P], 0))


@torch.inference_mode()
def test_unpadded_batches_and_route_recording_use_the_padded_prefill(tmp_path):
    engine = _engine(tmp_path, "qwen3_moe")
    model = engine.model
    calls = []
    original = model.prefill

    def spy(ids, *args):
        calls.append(ids.shape)
        return original(ids, *args)

    model.prefill = spy
    same = read_prompts(make_prompts(engine.tokenizer, ["abcd", "efgh"]))
    packed_prefill(model, same.input_ids, same.position_ids, same.attention_mask, _cache(model, 2, 4))
    assert calls == [torch.Size([2, 4])]
    ragged = read_prompts(make_prompts(engine.tokenizer, TEXTS))
    model.route_log = []  # moe.RouteRecorder: one route per padded position is expected
    packed_prefill(model, ragged.input_ids, ragged.position_ids, ragged.attention_mask,
                   _cache(model, len(TEXTS), ragged.input_ids.shape[1]))
    assert calls[-1] == ragged.input_ids.shape and len(model.route_log) == model.shape.num_layers
