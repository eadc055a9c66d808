"""The training engine's log-probs on CPU (hf_model.log_probs_from_logits' C path, cpu_sampling.c's last section):
the value the native rollout's sampling reports for the same logits bit for bit, closer to fp64 than torch's
formula, torch's gradient within rounding, rows independent of the batch and the thread count, torch's results on
masked and broken rows, and a clear error for a target outside the vocabulary; the entropy from the same pass
(log_probs_and_entropy), closer to fp64 than torch's, with its gradient."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.hf_model import log_prob_kernel_applies, log_probs_and_entropy, log_probs_from_logits
from hybridflow.engines.rollout import cpu_sampling
from hybridflow.engines.rollout.sampling import row_keys, sample_tokens

pytestmark = pytest.mark.skipif(cpu_sampling.load() is None, reason="no C compiler here: torch's formula runs")


def _torch_formula(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def _case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3, torch.randint(0, vocab, (rows,), generator=g)


def test_the_c_path_is_taken_only_for_plain_fp32_cpu_rows():
    logits = torch.randn(4, 10)
    assert log_prob_kernel_applies(logits)
    assert not log_prob_kernel_applies(logits.double())
    assert not log_prob_kernel_applies(logits.t())  # rows not contiguous
    assert not log_prob_kernel_applies(logits[None])


@pytest.mark.parametrize("vocab", [1, 63, 64, 288, 49_152])
def test_log_probs_are_closer_to_fp64_than_torchs_and_have_its_gradient(vocab):
    logits, targets = _case(32, vocab, vocab)
    logits.requires_grad_(True)
    got = log_probs_from_logits(logits, targets)
    torch_lp = _torch_formula(logits, targets)
    exact = _torch_formula(logits.detach().double(), targets)
    # one fp32 rounding of the result (half an ulp) plus the logit's own; torch's fp32 logsumexp adds its own
    bound = (logits.detach().gather(-1, targets[:, None]).squeeze(-1).double().abs() + exact.abs()) * 2.0**-24 + 1e-7
    assert ((got.detach().double() - exact).abs() <= bound).all()
    assert (got.detach().double() - exact).abs().max() <= (torch_lp.detach().double() - exact).abs().max() + 1e-7
    weights = torch.randn(32, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(got, logits, weights)
    (torch_grad,) = torch.autograd.grad(torch_lp, logits, weights)
    assert torch.allclose(grad, torch_grad, atol=1e-6, rtol=1e-5)
    # the gradient of a row sums to 0 (the target's +g against the probabilities' -g)
    assert torch.allclose(grad.double().sum(-1), torch.zeros(32, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("vocab", [64, 288, 49_152])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, 20, 1.0), (0.7, -1, 0.9)])
def test_the_rollouts_reported_log_probs_are_the_training_engines_bit_for_bit(vocab, temperature, top_k, top_p):
    """For the same logits, the draws' log-probs (C call, and torch's path that the batch-invariant mode keeps) are
    what the training engine computes from logits / temperature."""
    logits, _ = _case(24, vocab, 7)
    keys = row_keys(3, torch.arange(24), torch.zeros(24, dtype=torch.long))
    kw = dict(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p, keys=keys, step=2)
    scaled = logits / temperature if temperature != 1.0 else logits
    for kernel in (True, False):
        tokens, reported = sample_tokens(logits, **kw, kernel=kernel)
        assert torch.equal(reported, log_probs_from_logits(scaled, tokens)), kernel
    tokens, reported = sample_tokens(logits, greedy=True, temperature=1.0, top_k=-1, top_p=1.0, keys=keys, step=2)
    assert torch.equal(reported, log_probs_from_logits(logits, tokens))


def test_a_row_does_not_depend_on_the_batch_or_the_thread_count():
    logits, targets = _case(37, 5_000, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = log_probs_from_logits(logits, targets)
        torch.set_num_threads(2)
        two = log_probs_from_logits(logits, targets)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(two[5:9], log_probs_from_logits(logits[5:9], targets[5:9]))
    assert torch.equal(two[:20], log_probs_from_logits(logits[:20].contiguous(), targets[:20]))


def test_masked_and_broken_rows_give_torchs_values():
    logits, _ = _case(5, 300, 4)
    logits[:, 100:] = float("-inf")  # masked tokens: the allowed ones keep finite log-probs
    targets = torch.tensor([1, 2, 3, 4, 150])
    logits[0] = float("-inf")  # only -inf: NaN
    logits[1, 5] = float("nan")  # a NaN: NaN
    logits[2, 7] = float("inf")  # a +inf elsewhere: -inf
    got, expected = log_probs_from_logits(logits, targets), _torch_formula(logits, targets)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.allclose(got[~got.isnan()], expected[~expected.isnan()], atol=1e-6)
    assert got[4] == float("-inf") and torch.isfinite(got[3])


def test_a_target_outside_the_vocabulary_is_a_clear_error():
    logits, _ = _case(3, 50, 5)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        log_probs_from_logits(logits, torch.tensor([0, 50, 1]))


@pytest.mark.parametrize("vocab", [1, 63, 288, 49_152])
def test_the_entropy_comes_from_the_same_pass_closer_to_fp64_with_its_gradient(vocab):
    logits, targets = _case(24, vocab, 6)
    logits.requires_grad_(True)
    log_p, entropy = log_probs_and_entropy(logits, targets)
    assert torch.equal(log_p, log_probs_from_logits(logits, targets))  # the log-prob's bits with the entropy on
    exact_lp = torch.log_softmax(logits.detach().double(), -1)
    exact = -(exact_lp.exp() * exact_lp).sum(-1)
    torch_entropy = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    error = (entropy.detach().double() - exact).abs().max()
    assert error <= 1e-6 and error <= (torch_entropy.detach().double() - exact).abs().max() + 1e-7
    # both gradients in one backward pass, against fp64's
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(24, generator=g), torch.randn(24, generator=g)
    (grad,) = torch.autograd.grad((log_p * a).sum() + (entropy * b).sum(), logits)
    wide = logits.detach().double().requires_grad_(True)
    lp64 = torch.log_softmax(wide, -1)
    ((lp64.gather(-1, targets[:, None]).squeeze(-1) * a).sum() - ((lp64.exp() * lp64).sum(-1) * b).sum()).backward()
    assert (grad.double() - wide.grad).abs().max() <= 2e-6
    # the entropy alone (its log-prob unused in the loss), against fp64's gradient: no farther from it than torch's
    # fp32 one (whose own error depends on the CPU's vector width: 1.3e-5 with AVX-512, 3e-5 with AVX2 at 49,152)
    (only,) = torch.autograd.grad(log_probs_and_entropy(logits, targets)[1].sum(), logits)
    (torch_only,) = torch.autograd.grad(torch_entropy.sum(), logits)
    wide = logits.detach().double().requires_grad_(True)
    lp64 = torch.log_softmax(wide, -1)
    (-(lp64.exp() * lp64).sum()).backward()
    assert (only.double() - wide.grad).abs().max() <= max(2e-6, float((torch_only.double() - wide.grad).abs().max()))


def test_masked_tokens_add_nothing_to_the_entropy_or_its_gradient():
    logits, _ = _case(3, 300, 8)
    logits[:, 100:] = float("-inf")
    logits.requires_grad_(True)
    log_p, entropy = log_probs_and_entropy(logits, torch.tensor([1, 2, 3]))
    allowed = logits.detach()[:, :100]
    assert torch.allclose(entropy, -(torch.log_softmax(allowed, -1).exp() * torch.log_softmax(allowed, -1)).sum(-1),
                          atol=1e-6)
    (grad,) = torch.autograd.grad(log_p.sum() + entropy.sum(), logits)
    assert torch.isfinite(grad).all() and not grad[:, 100:].any()
