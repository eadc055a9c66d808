"""The routing in C of the decode steps (engines/rollout/cpu_moe_router.py): moe.route_logits' weights and expert ids
bit for bit, bf16 and fp32 (torch's softmax, top-k order among equal probabilities, renormalisation, bf16 rounding), on
expert
counts and k on both sides of the vector width and of torch's partial-sort switch, with and without ties. It runs
where torch's AVX-512 kernels and a C++ compiler are: elsewhere these tests skip and the step calls torch's router."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import cpu_moe_router
from hybridflow.engines.rollout.moe import route_logits

pytestmark = pytest.mark.skipif(cpu_moe_router.load() is None, reason="the C MoE router does not run here (torch not "
                                "on its AVX-512 kernels, or no C++ compiler)")


@pytest.mark.parametrize("experts,k", [(4, 1), (4, 2), (6, 3), (8, 8), (16, 2), (33, 4), (64, 1), (64, 6),
                                       (128, 2), (128, 8), (512, 8)])
@pytest.mark.parametrize("levels", [None, 2, 7])  # None: continuous logits; else drawn from `levels` values (ties)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_routing_is_torchs(experts, k, levels, normalize, dtype):
    g = torch.Generator().manual_seed(experts * 100 + k)
    if levels is None:
        logits = torch.randn(700, experts, generator=g) * 3
    else:
        logits = torch.randint(0, levels, (700, experts), generator=g) * 0.5
    logits = logits.to(dtype)
    kernel = cpu_moe_router.load()
    if not kernel.agrees(experts, k, normalize, dtype):  # torch sums these k weights in another order here: refused
        assert normalize and k not in (1, 2, 3, 4, 8), (experts, k)  # the shapes of the MoE models people train
        return
    weights, ids = kernel.route(logits, k, normalize)
    want_weights, want_ids = route_logits(logits, k, normalize)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and ids.shape == (700, k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights)


def test_bad_logits_are_a_clear_error():
    kernel = cpu_moe_router.load()
    with pytest.raises(ValueError, match="expected bf16 or fp32"):
        kernel.route(torch.zeros(3, 4, dtype=torch.float16), 2, True)
    with pytest.raises(ValueError, match="0 < k <= experts"):
        kernel.route(torch.zeros(3, 4, dtype=torch.bfloat16), 5, True)
