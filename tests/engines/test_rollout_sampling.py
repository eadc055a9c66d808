"""Sampling: the draws follow the model's distribution (chi-square), top-k/top-p restrict support, seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.engines.rollout import SamplingParams, create_rollout_engine, sampling
from hybridflow.engines.rollout.sampling import (
    _draw_filtered,
    _inverse_cdf,
    row_keys,
    sample_tokens,
    uniform_from_keys,
    uniform_table,
)
from hybridflow.engines.tiny import SIZES, build_char_tokenizer, make_config
from hybridflow.protocol import DataProto


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, z: float = 4.5) -> tuple[bool, float, float]:
    """Pearson chi-square of observed counts [V] vs expected probabilities [V] at a ~4e-6 false-alarm rate.

    Bins with an expected count under 5 are pooled; the critical value uses the Wilson-Hilferty approximation.
    """
    total = counts.sum().double()
    expected = probs.double() * total
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    if (obs[~keep] > 0).any():  # a draw where the expected count is exactly zero is an outright failure
        return False, math.inf, 0.0
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, stat, critical


def restricted(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The top-k then top-p filtered, renormalised distribution [V], written as a plain loop over sorted tokens."""
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    total_k = sum(float(probs[t]) for t in kept)
    out, mass = torch.zeros_like(probs), 0.0
    for t in kept:
        if mass >= top_p * total_k:
            break
        out[t] = probs[t]
        mass += float(probs[t])
    return out / out.sum()


# ---------------------------------------------------------------------- sample_tokens, no model
def test_uniforms_are_uniform_and_keys_distinct():
    keys = row_keys(123, torch.arange(20000) // 4, torch.arange(20000) % 4)
    assert keys.unique().numel() == keys.numel()
    u = uniform_from_keys(keys, step=7)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    ok, stat, crit = chi_square_ok(counts, torch.full((20,), 0.05))
    assert ok, (stat, crit)
    assert not torch.equal(u, uniform_from_keys(keys, step=8))


def test_a_table_of_uniforms_is_the_per_step_draws():
    keys = row_keys(5, torch.arange(6) // 2, torch.arange(6) % 2)
    table = uniform_table(keys, 5, 7)
    assert table.shape == (6, 7) and table.dtype == torch.float64
    for i in range(7):
        assert torch.equal(table[:, i], uniform_from_keys(keys, 5 + i))
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    by_keys = sample_tokens(logits, greedy=False, temperature=0.7, top_k=-1, top_p=0.9, keys=keys, step=8)
    by_table = sample_tokens(logits, greedy=False, temperature=0.7, top_k=-1, top_p=0.9, keys=None, step=8,
                             uniforms=table[:, 3])
    assert all(torch.equal(a, b) for a, b in zip(by_keys, by_table))


def test_the_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.25, 0.5, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5]], dtype=torch.float64)
    cases = {0.0: [0, 1], 0.3: [0, 1], 0.5: [1, 3], 1 - 2**-53: [1, 3], 1.0: [1, 3]}  # 1.0: outside [0, 1)
    for u, want in cases.items():
        assert _inverse_cdf(probs, torch.full((2,), u, dtype=torch.float64)).tolist() == want, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("greedy,top_k,top_p", [(False, -1, 1.0), (False, -1, 0.9), (False, 20, 1.0), (True, -1, 1.0)])
def test_sampling_rows_in_chunks_changes_nothing(dtype, greedy, top_k, top_p, monkeypatch):
    # 61 rows x 50,000 logits: sample_tokens goes through them in chunks of 20, 20 and 21 rows
    logits = (torch.randn(61, 50_000, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    kw = dict(greedy=greedy, temperature=0.9, top_k=top_k, top_p=top_p, step=4,
              keys=row_keys(2, torch.arange(61), torch.zeros(61, dtype=torch.long)))
    chunked = sample_tokens(logits, **kw)
    monkeypatch.setattr(sampling, "_CHUNK_ELEMENTS", 1 << 40)
    whole = sample_tokens(logits, **kw)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])


@pytest.mark.parametrize("top_k,top_p", [(-1, 0.9), (-1, 0.3), (-1, 0.995), (4, 1.0), (40, 1.0), (40, 0.8)])
@pytest.mark.parametrize("scale,step", [(0.5, None), (4.0, None), (2.0, 0.5)])
def test_sorting_only_candidates_draws_the_tokens_of_sorting_the_whole_row(top_k, top_p, scale, step):
    # step: logits on a grid of that spacing, so equal probabilities straddle the candidates' cut
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(3)) * scale
    if step is not None:
        logits = (logits / step).round() * step
    probs = logits.softmax(-1)
    u = uniform_from_keys(row_keys(4, torch.arange(64), torch.zeros(64, dtype=torch.long)), 0)
    whole_row = _draw_filtered(probs, u, top_k, top_p, first_width=5000)
    for width in (1, 5, 64, 700):  # 700: the next width, 5600, is past the row: the whole row
        assert torch.equal(_draw_filtered(probs, u, top_k, top_p, first_width=width), whole_row), width
    for row in (0, 17, 63) if step is None else ():  # restricted() orders ties as argsort does
        allowed = restricted(probs[row].double(), top_k, top_p).nonzero().flatten().tolist()
        assert int(whole_row[row]) in allowed


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (3, 1.0), (-1, 0.75), (-1, 0.85), (3, 0.6)])
def test_sample_tokens_follows_the_filtered_distribution(top_k, top_p):
    probs = torch.tensor([0.05, 0.3, 0.5, 0.1, 0.04, 0.01])
    logits = (probs.log() * 2.0).expand(20000, -1)  # at temperature 2.0 these logits give back `probs`
    keys = row_keys(9, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    tokens, log_probs = sample_tokens(logits, greedy=False, temperature=2.0, top_k=top_k, top_p=top_p, keys=keys, step=0)
    expected = restricted(probs, top_k, top_p)
    counts = torch.bincount(tokens, minlength=6)
    assert set(tokens.unique().tolist()) == set(expected.nonzero().flatten().tolist())
    ok, stat, crit = chi_square_ok(counts, expected)
    assert ok, (counts.tolist(), expected.tolist(), stat, crit)
    # reported log-probs are the temperature-scaled ones over the full vocabulary, not the renormalised ones
    torch.testing.assert_close(log_probs, probs.log()[tokens], atol=1e-5, rtol=0)


def test_greedy_is_argmax_with_temperature_one_log_probs():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    tokens, log_probs = sample_tokens(logits, greedy=True, temperature=0.3, top_k=2, top_p=0.5, keys=None, step=0)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).max(-1).values)


# ---------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    """A unit-size Qwen2 with a wide init (std 0.3): peaked next-token distributions, as in a trained model."""
    tokenizer = build_char_tokenizer()
    config = make_config(SIZES["unit"], tokenizer)
    config.initializer_range = 0.3
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("qwen2_sampling")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def native(model_path):
    return create_rollout_engine("native", model_path, num_threads=1)


def prompt_batch(tokenizer, texts) -> DataProto:
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, padding_side="left")
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def next_token_probs(model_path: str, ids: list[int], temperature: float) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_path)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return torch.softmax(logits / temperature, -1)


@pytest.mark.parametrize("name", ["native", "hf"])
def test_first_and_second_tokens_follow_the_model(model_path, name):
    """n samples of one prompt: token 1 vs the exact softmax; token 2 (drawn after the KV cache is in use) vs the
    exact softmax given the most frequent token 1."""
    engine = create_rollout_engine(name, model_path, num_threads=1)
    temperature, n = 1.1, 4000
    prompt = "abc"
    out = engine.generate(prompt_batch(engine.tokenizer, [prompt]), SamplingParams(temperature=temperature, n=n,
                                                                                  max_new_tokens=2, seed=17))
    responses = out.batch["responses"]
    ids = engine.tokenizer(prompt)["input_ids"]
    first = next_token_probs(model_path, ids, temperature)
    ok, stat, crit = chi_square_ok(torch.bincount(responses[:, 0], minlength=first.numel()), first)
    assert ok, ("first token", stat, crit)

    top = int(torch.bincount(responses[:, 0]).argmax())
    rows = (responses[:, 0] == top) & (out.batch["response_mask"][:, 1] == 1)
    assert int(rows.sum()) > 200, "not enough draws of the commonest first token for the second-token test"
    second = next_token_probs(model_path, [*ids, top], temperature)
    ok, stat, crit = chi_square_ok(torch.bincount(responses[rows, 1], minlength=second.numel()), second)
    assert ok, ("second token", stat, crit)


@pytest.mark.parametrize("name", ["native", "hf"])
def test_top_k_top_p_restrict_the_support(model_path, name):
    engine = create_rollout_engine(name, model_path, num_threads=1)
    prompt, temperature = "hello", 1.0
    ids = engine.tokenizer(prompt)["input_ids"]
    probs = next_token_probs(model_path, ids, temperature)
    for top_k, top_p in [(5, 1.0), (-1, 0.6)]:
        out = engine.generate(prompt_batch(engine.tokenizer, [prompt]),
                              SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, n=600,
                                             max_new_tokens=1, seed=4))
        allowed = set(restricted(probs, top_k, top_p).nonzero().flatten().tolist())
        drawn = set(out.batch["responses"][:, 0].tolist())
        assert drawn <= allowed, (top_k, top_p, drawn - allowed)
        assert len(drawn) > 1


def test_same_seed_same_samples_and_rows_do_not_depend_on_the_batch(native):
    texts = ["first prompt", "b", "a third one"]
    params = SamplingParams(temperature=1.0, n=4, max_new_tokens=16, seed=21)
    out = native.generate(prompt_batch(native.tokenizer, texts), params)
    again = native.generate(prompt_batch(native.tokenizer, texts), params)
    assert torch.equal(out.batch["responses"], again.batch["responses"])
    other_seed = native.generate(prompt_batch(native.tokenizer, texts), SamplingParams(
        temperature=1.0, n=4, max_new_tokens=16, seed=22))
    assert not torch.equal(out.batch["responses"], other_seed.batch["responses"])
    # sample j of prompt row 0 uses the random stream (seed, 0, j) whatever else is in the batch
    alone = native.generate(prompt_batch(native.tokenizer, texts[:1]), params)
    R = alone.batch["responses"].shape[1]
    assert torch.equal(alone.batch["responses"], out.batch["responses"][:4, :R])
    # the n samples of one prompt differ from each other
    assert len({tuple(r.tolist()) for r in out.batch["responses"][:4]}) > 1


def test_unseeded_calls_are_reproducible_from_the_engine_seed(model_path):
    prompts = ["xyz"]
    params = SamplingParams(n=4, max_new_tokens=8)
    runs = []
    for _ in range(2):
        engine = create_rollout_engine("native", model_path, seed=5, num_threads=1)
        first = engine.generate(prompt_batch(engine.tokenizer, prompts), params)
        second = engine.generate(prompt_batch(engine.tokenizer, prompts), params)
        runs.append((first.batch["responses"], second.batch["responses"]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1])  # successive calls draw fresh samples
