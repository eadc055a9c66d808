"""OneDNNLinear (onednn_train.py): the training engine's fp32 CPU projections through oneDNN, forward and backward,
against nn.Linear; which engines take it; the same gradients and updates as with torch's default matmuls."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch
from test_train_engine import engine, max_diff, params, pg_loss

from hybridflow.engines import onednn_train
from hybridflow.engines.onednn_train import (
    MIN_HIDDEN_SIZE,
    OneDNNLinear,
    mkl_fast_path,
    onednn_training,
    use_onednn_linears,
)
from hybridflow.engines.optim import OptimConfig
from hybridflow.engines.rollout.onednn_linear import onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32),
                                reason="this torch build has no working oneDNN fp32 linear")


def linear_pair(bias: bool, shape=(24, 40)):
    torch.manual_seed(0)
    plain = torch.nn.Linear(*shape, bias=bias)
    ours = torch.nn.Sequential(torch.nn.Linear(*shape, bias=bias))
    ours[0].load_state_dict(plain.state_dict())
    assert use_onednn_linears(ours) == 1 and type(ours[0]) is OneDNNLinear
    return plain, ours[0]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(3, 7, 24), (5, 24), (1, 130, 24)])
def test_forward_and_all_gradients_match_nn_linear(bias, x_shape):
    plain, ours = linear_pair(bias)
    x = torch.randn(*x_shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = plain(x), ours(x2)
    assert y2.shape == y.shape
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    pairs = [(x.grad, x2.grad), (plain.weight.grad, ours.weight.grad)]
    if bias:
        pairs.append((plain.bias.grad, ours.bias.grad))
    for a, b in pairs:
        assert b is not None and b.shape == a.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_transposed_input_and_a_frozen_weight():
    """Strided inputs are read as they are; a frozen weight (LoRA's base) gets no gradient, the input still does."""
    plain, ours = linear_pair(True)
    for layer in (plain, ours):
        layer.weight.requires_grad_(False)
    base = torch.randn(24, 9)
    x, x2 = base.t().requires_grad_(True), base.t().detach().clone().requires_grad_(True)
    plain(x).sum().backward()
    ours(x2).sum().backward()
    assert ours.weight.grad is None
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_autocast_take_nn_linears_own_path():
    plain, ours = linear_pair(True)
    x = torch.randn(4, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours(x), plain(x)) and ours(x).dtype == torch.bfloat16
    plain16, ours16 = plain.to(torch.bfloat16), ours.to(torch.bfloat16)
    assert torch.equal(ours16(x.bfloat16()), plain16(x.bfloat16()))


def on_vendor(monkeypatch, vendor: str) -> None:
    monkeypatch.setattr(onednn_train, "cpu_vendor", lambda: vendor)


def test_mkl_fast_path_is_mkl_on_intel_processors(monkeypatch):
    on_vendor(monkeypatch, "GenuineIntel")
    assert mkl_fast_path() is torch.backends.mkl.is_available()
    on_vendor(monkeypatch, "AuthenticAMD")
    assert mkl_fast_path() is False
    assert onednn_training(torch.device("cpu"), torch.float32) is True  # MKL's slow path there: oneDNN


def test_onednn_training_choice_and_its_error(monkeypatch):
    cpu = torch.device("cpu")
    assert onednn_training(cpu, torch.float32) is not mkl_fast_path()  # by the processor
    on_vendor(monkeypatch, "AuthenticAMD")
    assert onednn_training(cpu, torch.float32) is True
    assert onednn_training(cpu, torch.bfloat16) is False  # bf16 compute already runs on oneDNN inside torch
    assert onednn_training(cpu, torch.float32, False) is False
    assert onednn_training(cpu, torch.float32, hidden_size=MIN_HIDDEN_SIZE - 1) is False
    assert onednn_training(cpu, torch.float32, True, hidden_size=8) is True
    with pytest.raises(ValueError, match="onednn_linears=True needs a CPU"):
        onednn_training(torch.device("meta"), torch.float32, True)


def count(eng) -> int:
    return sum(type(m) is OneDNNLinear for m in eng.model.modules())


@pytest.fixture(scope="module")
def wide_model_path(tmp_path_factory) -> str:
    from hybridflow.engines.tiny import SIZES, write_tiny_model

    assert SIZES["small"].hidden_size >= MIN_HIDDEN_SIZE
    return write_tiny_model(tmp_path_factory.mktemp("small_qwen2"), spec="small", seed=0)


def test_the_engine_takes_it_by_default_in_fp32_for_wide_models(tiny_model_path, wide_model_path, monkeypatch):
    assert (count(engine(wide_model_path)) > 0) is not mkl_fast_path()  # this machine's processor decides
    if torch.backends.mkl.is_available():
        on_vendor(monkeypatch, "GenuineIntel")
        assert count(engine(wide_model_path)) == 0  # torch's matmuls: MKL on its fast path
    on_vendor(monkeypatch, "AuthenticAMD")
    assert count(engine(wide_model_path)) > 0
    assert count(engine(wide_model_path, onednn_linears=False)) == 0
    assert count(engine(wide_model_path, param_dtype="bf16")) == 0
    # a unit model is narrower than MIN_HIDDEN_SIZE: torch's matmul by default, oneDNN when asked
    assert count(engine(tiny_model_path)) == 0
    assert count(engine(tiny_model_path, onednn_linears=True)) > 0


def test_the_engine_computes_the_same_gradients_and_update(tiny_model_path):
    """fp32 with oneDNN == fp32 with torch's default matmuls, to rounding: gradients, loss, the updated weights."""
    data = make_batch(rows=8, prompt_len=8, response_len=12, seed=5)
    results = {}
    for on in (True, False):
        # the fused norm/rotary/SwiGLU backward off in both: this compares the linears alone (test_cpu_train_ops.py)
        # Adam's first step is lr * g / (|g| + eps): on a gradient near eps (this model has some at ~1e-8) a rounding
        # difference in g moves the step by a percent of lr; a larger eps keeps the update a rounding comparison
        eng = engine(tiny_model_path, micro_batch_size_per_gpu=4, onednn_linears=on, fused_cpu_ops=False,
                     optim=OptimConfig(lr=1e-3, weight_decay=0.0, eps=1e-4))
        assert (count(eng) > 0) == on
        eng.forward_backward(data, pg_loss)
        grads = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
        eng.model.zero_grad(set_to_none=True)
        metrics = eng.train_step(data, pg_loss)
        results[on] = grads, metrics, params(eng)
    (g1, m1, p1), (g0, m0, p0) = results[True], results[False]
    scale = max(float(g.abs().max()) for g in g0.values())
    assert max_diff(g1, g0) <= 1e-5 * max(1.0, scale)
    assert m1["pg_loss"] == pytest.approx(m0["pg_loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-4)
    assert max_diff(p1, p0) <= 1e-5
