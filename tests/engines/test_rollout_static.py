"""The native rollout's fixed-shape decode (static_decode.py): the step that CUDA graphs capture on GPUs.

On CPU it runs as decode="static" (the same step, not captured); with a GPU the same tests run decode="cuda_graph"."""

from __future__ import annotations

import pytest
import torch
from test_rollout_engines import PROMPTS, forward_log_probs, make_prompts, write_model
from transformers import AutoModelForCausalLM

from hybridflow import device
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.static_decode import bucket

MODES = ["static", pytest.param("cuda_graph", marks=pytest.mark.skipif(
    not device.is_cuda_available(), reason="CUDA graphs need a GPU; the same step runs as 'static' above"))]


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("qwen2_static"), "qwen2", seed=0)


@pytest.fixture(scope="module")
def eager(qwen_path):
    return create_rollout_engine("native", qwen_path, num_threads=1, decode="eager")


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]
    assert bucket(5, minimum=64) == 64 and bucket(100, minimum=64) == 128


@pytest.mark.parametrize("mode", MODES)
def test_fixed_shape_decode_gives_the_eager_tokens_and_true_log_probs(eager, qwen_path, mode):
    """Samples stop at different steps (vowels are stop tokens), so the live rows move to smaller buckets; every
    token must still see exactly its own prompt and earlier tokens."""
    engine = create_rollout_engine("native", qwen_path, num_threads=1, decode=mode)
    tokenizer = engine.tokenizer
    stop = [int(t) for t in tokenizer.convert_tokens_to_ids(list("aeiou"))]
    cases = [
        SamplingParams(greedy=True, max_new_tokens=20),
        SamplingParams(temperature=1.0, n=4, max_new_tokens=16, seed=3, stop_token_ids=stop),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, n=2, max_new_tokens=16, seed=11),
    ]
    for params in cases:
        prompts = make_prompts(tokenizer)
        want, got = eager.generate(prompts, params), engine.generate(prompts, params)
        assert torch.equal(got.batch["responses"], want.batch["responses"])
        assert torch.equal(got.batch["response_mask"], want.batch["response_mask"])
        temperature = 1.0 if params.greedy else params.temperature
        stats = logprob_mismatch(got.batch["rollout_log_probs"], forward_log_probs(qwen_path, got, temperature),
                                 got.batch["response_mask"])
        assert stats["mismatch/mean_abs"] <= 1e-5 and stats["mismatch/max_abs"] <= 1e-4, stats
    lengths = got.batch["response_mask"].sum(-1)
    assert int(lengths.min()) < int(lengths.max())
    # 6 prompts x 4 samples start in the 32-row bucket; rows that stopped moved the rest to smaller ones
    row_buckets = {rows for rows, _ in engine._graphs._buffers}
    assert 32 in row_buckets and min(row_buckets) < 32, row_buckets
    assert len(PROMPTS) == 6


@pytest.mark.parametrize("mode", MODES)
def test_fixed_shape_buffers_persist_and_follow_weight_updates(qwen_path, tmp_path, mode):
    other_path = write_model(tmp_path / "other", "qwen2", seed=7)
    engine = create_rollout_engine("native", qwen_path, num_threads=1, decode=mode)
    prompts = make_prompts(engine.tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=12)
    before = engine.generate(prompts, params)
    buffers = dict(engine._graphs._buffers)
    engine.release_memory()
    engine.update_weights(AutoModelForCausalLM.from_pretrained(other_path).state_dict().items())
    after = engine.generate(prompts, params)
    reference = create_rollout_engine("hf", other_path).generate(prompts, params)
    assert torch.equal(after.batch["responses"], reference.batch["responses"])
    assert not torch.equal(after.batch["responses"], before.batch["responses"])
    # the same buffers (and, on GPUs, the same captured graphs) served the second call
    assert all(engine._graphs._buffers[k] is v for k, v in buffers.items())


def test_decode_mode_errors(qwen_path):
    with pytest.raises(ValueError, match="choose one of"):
        create_rollout_engine("native", qwen_path, decode="graphs")
    if not device.is_cuda_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            create_rollout_engine("native", qwen_path, decode="cuda_graph")
        assert create_rollout_engine("native", qwen_path).decode == "eager"  # the CPU default
    else:
        assert create_rollout_engine("native", qwen_path).decode == "cuda_graph"  # the GPU default


def test_free_cache_engine_drops_the_step_buffers_after_each_call(qwen_path):
    keep = create_rollout_engine("native", qwen_path, num_threads=1, decode="static")
    free = create_rollout_engine("native", qwen_path, num_threads=1, decode="static", free_cache_engine=True)
    prompts = make_prompts(keep.tokenizer)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    outs = []
    for engine in (keep, free):
        outs.append(engine.generate(prompts, params))
        engine.release_memory()  # what the worker calls after generate_sequences
    assert keep._graphs._buffers and not free._graphs._buffers
    assert torch.equal(free.generate(prompts, params).batch["responses"], outs[0].batch["responses"])
