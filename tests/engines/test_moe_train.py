"""MoE training (engines/moe_train.py): the router load-balancing loss is transformers' own, on the real tokens, with
the model config's weight or actor.router_aux_loss_coef; router balance stats are logged; dense models are untouched."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.moe_train import aux_loss_coef, find_routers
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.protocol import DataProto


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "model", "unit", arch="qwen3_moe", seed=3)


def _engine(path: str, **kw) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                                   micro_batch_size_per_gpu=64, **kw))


def _batch(rows: int = 6) -> DataProto:
    data = make_batch(rows, prompt_len=10, response_len=6, seed=1, vocab=200)
    data.batch["advantages"] = torch.randn(rows, 6, generator=torch.Generator().manual_seed(2))
    return data


def _pg_loss(micro: DataProto, outputs):
    mask = micro.batch["response_mask"].float()
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {}


def _zero_loss(micro: DataProto, outputs):
    return outputs["log_probs"].sum() * 0.0, {}


def _grads(eng: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in eng.model.named_parameters() if p.grad is not None}


def test_aux_loss_gradient_is_transformers_load_balancing_loss_on_real_tokens(moe_path):
    from transformers import AutoModelForCausalLM

    coef = 0.05
    eng = _engine(moe_path, router_aux_loss_coef=coef)
    assert len(find_routers(eng.model)) == 2 and eng.router_tap.coef == coef
    data = _batch()
    metrics = eng.forward_backward(data, _zero_loss)
    ours = _grads(eng)

    ref = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    b = data.batch
    out = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
              output_router_logits=True, use_cache=False)
    (coef * out.aux_loss).backward()
    assert metrics["router/aux_loss"] == pytest.approx(out.aux_loss.item(), abs=1e-6)
    theirs = {f"hf.{n}": p.grad for n, p in ref.named_parameters() if p.grad is not None}
    router_grads = [n for n in theirs if "gate.weight" in n]
    assert router_grads and set(router_grads) <= set(ours)
    for name, grad in theirs.items():
        assert torch.allclose(ours[name], grad, atol=1e-6), name
    # padding is not routed: the loss over left-padded rows equals the loss over the same rows unpadded
    assert float(out.aux_loss) != pytest.approx(float(ref(input_ids=b["input_ids"], output_router_logits=True,
                                                          use_cache=False).aux_loss), abs=1e-7)


def test_aux_loss_adds_to_the_policy_loss_and_stats_are_logged(moe_path):
    data = _batch()
    plain = _engine(moe_path, router_aux_loss_coef=0.0)
    m0 = plain.forward_backward(data, _pg_loss)
    assert "router/aux_loss" not in m0 and 1.0 <= m0["router/max_load_ratio"] <= 4.0
    assert m0["router/max_load_ratio_worst_layer"] >= m0["router/max_load_ratio"]
    layers = [m0[key] for key in sorted(m0) if key.startswith("router/layer_")]
    assert len(layers) == len(plain.router_tap.routers) > 1  # one ratio per MoE layer
    assert max(layers) == m0["router/max_load_ratio_worst_layer"]
    assert sum(layers) / len(layers) == pytest.approx(m0["router/max_load_ratio"])
    g0 = _grads(plain)
    with_aux = _engine(moe_path, router_aux_loss_coef=0.5)
    with_aux.forward_backward(data, _pg_loss)
    g1 = _grads(with_aux)
    only_aux = _engine(moe_path, router_aux_loss_coef=0.5)
    only_aux.forward_backward(data, _zero_loss)
    ga = _grads(only_aux)
    for name in g1:
        assert torch.allclose(g1[name], g0[name] + ga.get(name, 0.0), atol=1e-6), name


def test_each_micro_batch_adds_its_token_share_of_the_aux_loss(moe_path):
    from transformers import AutoModelForCausalLM

    coef, data = 0.5, _batch()
    split = FSDPEngine(EngineConfig(model_path=moe_path, optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                                    micro_batch_size_per_gpu=1, router_aux_loss_coef=coef))
    split.forward_backward(data, _zero_loss)
    ours = _grads(split)
    ref = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    b, total = data.batch, float(data.batch["response_mask"].sum())
    for i in range(len(data)):
        out = ref(input_ids=b["input_ids"][i : i + 1], attention_mask=b["attention_mask"][i : i + 1],
                  position_ids=b["position_ids"][i : i + 1], output_router_logits=True, use_cache=False)
        (coef * float(b["response_mask"][i].sum()) / total * out.aux_loss).backward()
    for name, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.allclose(ours[f"hf.{name}"], p.grad, atol=1e-6), name


def test_coefficient_follows_the_model_config_unless_set(moe_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(moe_path)
    assert aux_loss_coef(cfg, None) == 0.0  # output_router_logits is off by default
    cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.02
    assert aux_loss_coef(cfg, None) == 0.02 and aux_loss_coef(cfg, 0.0) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef must be >= 0"):
        _engine(moe_path, router_aux_loss_coef=-1.0)


def test_dense_model_has_no_router_terms(tiny_model_path):
    eng = _engine(tiny_model_path, router_aux_loss_coef=0.5)
    assert len(eng.router_tap) == 0 and eng.router_tap.coef == 0.0
    metrics = eng.forward_backward(_batch(), _pg_loss)
    assert not any(k.startswith("router/") for k in metrics)
