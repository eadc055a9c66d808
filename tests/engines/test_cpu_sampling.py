"""The C token choice (cpu_sampling.py) against torch's ops in sampling.py and against fp64: the same draws and
distribution, closer log-probs, masked tokens never drawn, rows independent of the batch and the thread count; with
top-k and top-p, the tokens of sorting the whole row."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import cpu_sampling
from hybridflow.engines.rollout.sampling import row_keys, sample_tokens, uniform_from_keys
from tests.engines.test_rollout_sampling import chi_square_ok, restricted

pytestmark = pytest.mark.skipif(cpu_sampling.load() is None, reason="no C compiler here: sampling keeps torch's ops")


def _keys(rows: int, seed: int = 1) -> torch.Tensor:
    return row_keys(seed, torch.arange(rows), torch.zeros(rows, dtype=torch.long))


def _exact_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("vocab", [1, 63, 64, 288, 1000, 49_152])
@pytest.mark.parametrize("greedy,temperature", [(True, 1.0), (False, 1.0), (False, 0.7)])
def test_the_kernel_draws_torchs_tokens_with_closer_log_probs(vocab, greedy, temperature):
    # the two paths round the CDF differently, so a draw within ~1e-7 of a token boundary could differ: at these
    # 48 draws per case, no seed has come close
    logits = torch.randn(48, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    kw = dict(greedy=greedy, temperature=temperature, top_k=-1, top_p=1.0, keys=_keys(48), step=5)
    tokens, log_probs = sample_tokens(logits, **kw)
    torch_tokens, torch_log_probs = sample_tokens(logits, **kw, kernel=False)
    assert torch.equal(tokens, torch_tokens)
    t = 1.0 if greedy else temperature
    exact = _exact_log_probs(logits, tokens, t)
    # fp32 roundings: the scaled logit's (half an ulp of s = z / t) and the result's (half an ulp of the log-prob);
    # the normaliser, summed in fp64, adds next to nothing (torch's fp32 logsumexp adds its own rounding on top)
    scaled = (logits.gather(-1, tokens[:, None]).squeeze(-1) / t).double()
    bound = (scaled.abs() + exact.abs()) * 2.0**-24 + 1e-7
    assert bool(((log_probs.double() - exact).abs() <= bound).all())
    assert float((torch_log_probs.double() - exact).abs().max()) <= 2e-5  # torch's path: its fp32 rounding


def test_greedy_takes_the_first_of_equal_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    tokens, log_probs = sample_tokens(logits, greedy=True, temperature=1.0, top_k=-1, top_p=1.0, keys=None, step=0)
    assert tokens.tolist() == [1, 0, 0] == logits.argmax(-1).tolist()
    torch.testing.assert_close(log_probs.double(), _exact_log_probs(logits, tokens, 1.0), atol=1e-7, rtol=0)


def test_draws_follow_the_distribution_and_skip_masked_tokens():
    # 200 tokens: three blocks of 64 and a short one; the second block and part of the last are masked (-inf)
    g = torch.Generator().manual_seed(0)
    row = torch.randn(200, generator=g)
    row[64:128] = float("-inf")
    row[190:] = float("-inf")
    rows = 40_000
    tokens, log_probs = sample_tokens(row.expand(rows, -1), greedy=False, temperature=0.8, top_k=-1, top_p=1.0,
                                      keys=_keys(rows, seed=3), step=0)
    probs = torch.softmax(row.double() / 0.8, -1)
    assert bool((probs[tokens] > 0).all())
    ok, stat, critical = chi_square_ok(torch.bincount(tokens, minlength=200), probs)
    assert ok, (stat, critical)
    torch.testing.assert_close(log_probs.double(), probs.log()[tokens], atol=1e-6, rtol=0)


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2.0**-53])
def test_the_ends_of_the_cdf_draw_a_token_of_positive_probability(u):
    # the last 80 tokens (past the last positive one) are masked: u near 1 must not walk into them
    row = torch.randn(300, generator=torch.Generator().manual_seed(1))
    row[220:] = float("-inf")
    tokens, _ = cpu_sampling.load().choose(row[None], torch.tensor([u], dtype=torch.float64), 1.0)
    assert 0 <= int(tokens[0]) < 220
    if u == 0.0:
        assert int(tokens[0]) == 0
    if u > 0.99:
        assert int(tokens[0]) == 219


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("kernel", [True, False])
def test_logits_that_are_no_distribution_are_a_clear_error(bad, kernel):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 17] = bad
    for greedy in (True, False):
        with pytest.raises(ValueError, match=r"holds a NaN or \+inf, or only -inf.*grad_norm"):
            sample_tokens(logits, greedy=greedy, temperature=1.0, top_k=-1, top_p=1.0, keys=_keys(3), step=0,
                          kernel=kernel)


def test_a_row_does_not_depend_on_the_batch_or_the_thread_count():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(4)) * 2  # past the kernel's split size
    u = uniform_from_keys(_keys(64), 9)
    kernel = cpu_sampling.load()
    threads = torch.get_num_threads()
    whole = kernel.choose(logits, u, 0.9)
    try:
        torch.set_num_threads(1)
        alone = kernel.choose(logits, u, 0.9)
    finally:
        torch.set_num_threads(threads)
    some = kernel.choose(logits[10:13], u[10:13], 0.9)
    strided = kernel.choose(torch.cat([logits, logits], 1)[:, :5000], u, 0.9)  # a row stride past the vocabulary
    for other in (alone, strided):
        assert torch.equal(whole[0], other[0]) and torch.equal(whole[1], other[1])
    assert torch.equal(whole[0][10:13], some[0]) and torch.equal(whole[1][10:13], some[1])


def test_bf16_logits_are_sampled_as_their_fp32_values():
    logits = (torch.randn(8, 700, generator=torch.Generator().manual_seed(6)) * 3).bfloat16()
    kw = dict(greedy=False, temperature=1.0, top_k=-1, top_p=1.0, keys=_keys(8), step=2)
    assert all(torch.equal(a, b) for a, b in zip(sample_tokens(logits, **kw), sample_tokens(logits.float(), **kw)))


# ---------------------------------------------------------------------- top-k and top-p
_FILTERS = [(-1, 0.9), (-1, 0.3), (-1, 0.995), (-1, 1e-9), (1, 1.0), (4, 1.0), (50, 1.0), (40, 0.8), (3000, 0.95)]


@pytest.mark.parametrize("top_k,top_p", _FILTERS)
@pytest.mark.parametrize("vocab,temperature", [(2, 1.0), (63, 0.7), (300, 1.0), (5000, 1.3), (49_152, 1.0)])
def test_filtered_draws_are_torchs_tokens(top_k, top_p, vocab, temperature):
    # logits of standard deviation 3 (a seventh masked): the two paths' probabilities differ by rounding only, and
    # no draw of these seeds falls within rounding of a boundary; the log-prob is the unfiltered distribution's
    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(vocab + top_k)) * 3
    if vocab > 7:
        logits[:, 3::7] = float("-inf")
    for step in range(3):
        kw = dict(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p, keys=_keys(40), step=step)
        tokens, log_probs = sample_tokens(logits, **kw)
        torch_tokens, _ = sample_tokens(logits, **kw, kernel=False)
        assert torch.equal(tokens, torch_tokens), (step, (tokens != torch_tokens).nonzero().flatten().tolist())
        exact = _exact_log_probs(logits, tokens, temperature)
        scaled = (logits.gather(-1, tokens[:, None]).squeeze(-1) / temperature).double()
        assert bool(((log_probs.double() - exact).abs() <= (scaled.abs() + exact.abs()) * 2.0**-24 + 1e-7).all())


@pytest.mark.parametrize("top_k,top_p", _FILTERS)
def test_equal_probabilities_are_kept_and_drawn_in_index_order(top_k, top_p):
    # logits on a grid of 0.25: every row holds long runs of exactly equal values, in both paths, so a cut or a
    # draw inside a run picks by index as the stable sort does
    logits = (torch.randn(64, 5000, generator=torch.Generator().manual_seed(11)) * 2 / 0.25).round() * 0.25
    for step in range(4):
        kw = dict(greedy=False, temperature=1.0, top_k=top_k, top_p=top_p, keys=_keys(64, seed=5), step=step)
        assert torch.equal(sample_tokens(logits, **kw)[0], sample_tokens(logits, **kw, kernel=False)[0])


def test_on_a_flat_row_the_paths_differ_only_between_tokens_of_equal_fp32_probability():
    # 49,152 logits of standard deviation 0.3: top-p 0.9 keeps ~40,000 tokens, and exp() rounds many neighbours to
    # the same fp32 value in one path and not in the other; a draw may then pick the neighbour in the sorted order
    logits = torch.randn(64, 49_152, generator=torch.Generator().manual_seed(0)) * 0.3
    differ = 0
    for step in range(3):
        kw = dict(greedy=False, temperature=1.0, top_k=-1, top_p=0.9, keys=_keys(64), step=step)
        tokens, torch_tokens = sample_tokens(logits, **kw)[0], sample_tokens(logits, **kw, kernel=False)[0]
        for row in (tokens != torch_tokens).nonzero().flatten().tolist():
            differ += 1
            probs = torch.softmax(logits[row].double(), -1)
            a, b = probs[tokens[row]], probs[torch_tokens[row]]
            assert abs(a - b) <= 1e-6 * a, (row, float(a), float(b))
    assert differ <= 6  # of 192 draws


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (-1, 0.75), (3, 0.6), (5, 0.5)])
def test_filtered_draws_follow_the_restricted_distribution(top_k, top_p):
    # 300 tokens in five blocks of 64, the probabilities of a fixed random row at temperature 0.8
    row = torch.randn(300, generator=torch.Generator().manual_seed(7))  # keeps 3, 94, 2 and 2 tokens
    rows = 30_000
    tokens, _ = sample_tokens(row.expand(rows, -1), greedy=False, temperature=0.8, top_k=top_k, top_p=top_p,
                              keys=_keys(rows, seed=8), step=0)
    expected = restricted(torch.softmax(row.double() / 0.8, -1), top_k, top_p)
    assert set(tokens.unique().tolist()) <= set(expected.nonzero().flatten().tolist())
    ok, stat, critical = chi_square_ok(torch.bincount(tokens, minlength=300), expected)
    assert ok, (stat, critical)


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 2.0**-53])
@pytest.mark.parametrize("top_k,top_p", [(10, 1.0), (250, 1.0), (-1, 0.5), (250, 0.999999)])
def test_filtered_ends_of_the_cdf(u, top_k, top_p):
    # 220 drawable tokens and 80 masked: a top-k of 250 runs into the masked ones, which are never drawn
    row = torch.randn(300, generator=torch.Generator().manual_seed(1))
    row[220:] = float("-inf")
    tokens, _ = cpu_sampling.load().choose(row[None], torch.tensor([u], dtype=torch.float64), 1.0, top_k, top_p)
    order = torch.sort(row, descending=True, stable=True).indices
    kept = restricted(torch.softmax(row.double(), -1), top_k, top_p).nonzero().flatten()
    assert int(tokens[0]) in kept.tolist()
    if u == 0.0:
        assert int(tokens[0]) == int(order[0])
    if u > 0.99:  # the last kept token in sorted order
        assert int(tokens[0]) == int(order[len(kept) - 1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_filtered_logits_that_are_no_distribution_are_a_clear_error(bad):
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 17] = bad
    for top_k, top_p in [(5, 1.0), (-1, 0.9)]:
        with pytest.raises(ValueError, match=r"holds a NaN or \+inf, or only -inf"):
            sample_tokens(logits, greedy=False, temperature=1.0, top_k=top_k, top_p=top_p, keys=_keys(3), step=0)


def test_a_filtered_row_does_not_depend_on_the_batch_or_the_thread_count():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(4)) * 2
    u = uniform_from_keys(_keys(64), 9)
    kernel = cpu_sampling.load()
    threads = torch.get_num_threads()
    whole = kernel.choose(logits, u, 0.9, 40, 0.9)
    try:
        torch.set_num_threads(1)
        alone = kernel.choose(logits, u, 0.9, 40, 0.9)
    finally:
        torch.set_num_threads(threads)
    some = kernel.choose(logits[10:13], u[10:13], 0.9, 40, 0.9)
    strided = kernel.choose(torch.cat([logits, logits], 1)[:, :5000], u, 0.9, 40, 0.9)
    for other in (alone, strided):
        assert torch.equal(whole[0], other[0]) and torch.equal(whole[1], other[1])
    assert torch.equal(whole[0][10:13], some[0]) and torch.equal(whole[1][10:13], some[1])
