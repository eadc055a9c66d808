"""Gradient checkpointing (actor_rollout_ref.model.enable_gradient_checkpointing) recomputes each decoder layer in
backward: the gradients equal those of the plain forward (<= 1e-6), on a dense and on an MoE model."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.tiny import write_tiny_model


def _loss(micro, outputs):
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    return loss - 0.01 * (outputs["entropy"] * mask).sum() / total, {}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_checkpointed_gradients_equal_plain(tmp_path, arch):
    path = write_tiny_model(tmp_path / "m", "unit", arch=arch, seed=4)
    data = make_batch(6, prompt_len=8, response_len=10, seed=5)
    data.batch["advantages"] = torch.randn(6, 10, generator=torch.Generator().manual_seed(6))
    data.meta_info["calculate_entropy"] = True
    grads = []
    for on in (False, True):
        eng = FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=3,
                                      gradient_checkpointing=on, router_aux_loss_coef=0.01))
        eng.forward_backward(data, _loss)
        grads.append({n: p.grad for n, p in eng.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 5
    for name, grad in grads[0].items():
        assert (grads[1][name] - grad).abs().max().item() <= 1e-6, name
