"""FSDPEngine at world size 1 (in the pytest process, no torch.distributed): outputs against a plain HF forward,
micro-batching equivalence, checkpoint resume, HF export, non-finite steps, critic, ref, bf16, LR schedule."""

from __future__ import annotations

import math

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.optim import lr_multiplier
from hybridflow.protocol import DataProto


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    """Token-mean policy-gradient loss with an entropy bonus: this micro-batch's share of the mini-batch mean."""
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    if "entropy" in outputs:
        loss = loss - 0.01 * (outputs["entropy"] * mask).sum() / total
    return loss, {"pg_loss": loss.detach(), "rows": float(len(micro))}


def value_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    err = (outputs["values"] - micro.batch["returns"]) ** 2 * mask
    loss = 0.5 * err.sum() / micro.meta_info["global_num_tokens"]
    return loss, {"vf_loss": loss.detach()}


def nan_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    loss, metrics = pg_loss(micro, outputs)
    return loss * float("nan"), metrics


def reference_log_probs(hf_model, data: DataProto, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain padded HF forward: log-probs and entropy ``[B, R]`` of softmax(logits / T), zero past each response."""
    b = {k: v.to(hf_model.device) for k, v in data.batch.items()}  # the engine's model may sit on a GPU
    resp_len = b["responses"].shape[1]
    with torch.no_grad():
        logits = hf_model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    logits = logits[:, -resp_len - 1 : -1].float() / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    mask = b["attention_mask"][:, -resp_len:].float()
    token = log_p.gather(-1, b["responses"][..., None]).squeeze(-1) * mask
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    return token.cpu(), entropy.cpu()


def engine(path: str, **overrides) -> FSDPEngine:
    optim = overrides.pop("optim", OptimConfig(lr=1e-3, weight_decay=0.0))
    return FSDPEngine(EngineConfig(model_path=path, optim=optim, **overrides))


def params(eng: FSDPEngine) -> dict[str, torch.Tensor]:
    return eng.full_state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "overrides",
    [
        {"use_remove_padding": True, "use_dynamic_bsz": True, "max_tokens_per_micro_batch": 48},
        {"use_remove_padding": True, "micro_batch_size_per_gpu": 3},
        {"use_remove_padding": False, "micro_batch_size_per_gpu": 4},
    ],
    ids=["bucketed-token-budget", "bucketed-fixed", "padded"],
)
def test_log_probs_and_entropy_match_a_padded_hf_forward(tiny_model_path, overrides):
    eng = engine(tiny_model_path, role="ref", **overrides)
    data = make_batch(rows=10, prompt_len=9, response_len=12, seed=1)
    out = eng.compute_log_prob(data, temperature=0.7, calculate_entropy=True)
    ref_lp, ref_ent = reference_log_probs(eng.model.hf, data, temperature=0.7)
    assert out["log_probs"].shape == (10, 12) and out["log_probs"].dtype == torch.float32
    assert float((out["log_probs"] - ref_lp).abs().max()) <= 1e-5
    assert float((out["entropy"] - ref_ent).abs().max()) <= 1e-5
    # The temperature is applied: at T=1 the same tokens get different log-probs, matching the T=1 reference.
    at_one = eng.compute_log_prob(data, temperature=1.0)
    assert "entropy" not in at_one
    assert float((at_one["log_probs"] - out["log_probs"]).abs().max()) > 1e-3
    assert float((at_one["log_probs"] - reference_log_probs(eng.model.hf, data, 1.0)[0]).abs().max()) <= 1e-5


def test_token_budget_micro_batches_give_the_same_gradient_as_fixed_ones(tiny_model_path):
    data = make_batch(rows=12, prompt_len=8, response_len=16, seed=2)
    grads = {}
    settings = {
        "one-micro-batch": {"micro_batch_size_per_gpu": 12},
        "fixed-2": {"micro_batch_size_per_gpu": 2},
        "token-budget": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 64},
        "padded-fixed-5": {"micro_batch_size_per_gpu": 5, "use_remove_padding": False},
        "checkpointed": {"micro_batch_size_per_gpu": 4, "gradient_checkpointing": True},
    }
    for name, overrides in settings.items():
        eng = engine(tiny_model_path, **overrides)
        hf = eng.model.hf  # transformers renamed the flag (is_gradient_checkpointing before 5.2x)
        on = getattr(hf, "is_activation_checkpointing", None)
        on = hf.is_gradient_checkpointing if on is None else on
        assert on == overrides.get("gradient_checkpointing", False)
        metrics = eng.forward_backward(data, pg_loss)
        grads[name] = {n: p.grad.clone() for n, p in eng.model.named_parameters()}
        assert metrics["pg_loss"] != 0.0
    plans = {name: len(engine(tiny_model_path, **o)._plan(data)) for name, o in settings.items()}
    assert plans["token-budget"] > 1 and plans["fixed-2"] == 6  # the settings really split differently
    scale = max(float(g.abs().max()) for g in grads["one-micro-batch"].values())
    for name in settings:
        assert max_diff(grads[name], grads["one-micro-batch"]) <= 1e-5 * max(1.0, scale), name


def test_train_step_updates_and_reports(tiny_model_path):
    eng = engine(tiny_model_path, micro_batch_size_per_gpu=4)
    data = make_batch(rows=8, prompt_len=8, response_len=10, seed=3)
    before = params(eng)
    metrics = eng.train_step(data, pg_loss)
    assert metrics["skipped_nonfinite"] == 0.0 and metrics["lr"] == pytest.approx(1e-3)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["rows"] == pytest.approx(4.0)  # mean over the two micro-batches of 4 rows
    assert max_diff(before, params(eng)) > 1e-5
    assert all(p.grad is None for p in eng.model.parameters())


def test_passes_put_every_module_in_their_mode(tiny_model_path):
    """Log-prob passes run in eval mode and updates in train mode, module by module, even after a caller switched
    one submodule itself (the engine only skips the switch when every module is already in the mode)."""
    eng = engine(tiny_model_path, micro_batch_size_per_gpu=4)
    data = make_batch(rows=4, prompt_len=6, response_len=5, seed=4)
    seen = []
    hook = eng.model.register_forward_pre_hook(lambda module, args: seen.append(
        {m.training for m in module.modules()}))
    eng.compute_log_prob(data, temperature=1.0)
    list(eng.model.modules())[-1].training = True  # one leaf alone back in train mode
    eng.compute_log_prob(data, temperature=1.0)
    eng.train_step(data, pg_loss)
    list(eng.model.modules())[-1].eval()  # one leaf in eval mode
    eng.train_step(data, pg_loss)
    eng.compute_log_prob(data, temperature=1.0)
    hook.remove()
    assert seen == [{False}, {False}, {True}, {True}, {False}]


def test_switching_modes_on_cpu_does_not_kernelize_the_model_again(tiny_model_path, monkeypatch):
    """transformers 5 kernelizes a model with the `kernels` package's hub layers at every train()/eval() switch; its
    mapping has nothing for CPU, so the CPU engine turns that off: switches run no kernelize, and the outputs are the
    plain model's."""
    pytest.importorskip("kernels")
    import transformers.modeling_utils as modeling_utils

    if not hasattr(modeling_utils, "kernelize"):
        pytest.skip("this transformers does not kernelize models")

    eng = engine(tiny_model_path, micro_batch_size_per_gpu=4)
    assert not getattr(eng.model.hf, "use_kernels", False)
    calls = []
    real = modeling_utils.kernelize
    monkeypatch.setattr(modeling_utils, "kernelize", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = make_batch(rows=4, prompt_len=6, response_len=5, seed=4)
    first = eng.compute_log_prob(data, temperature=1.0)
    eng.train_step(data, pg_loss)
    eng.compute_log_prob(data, temperature=1.0)
    assert calls == []
    # the same log-probs as the model kernelized the way transformers loads it (no CPU kernels: torch's forward)
    fresh = engine(tiny_model_path, micro_batch_size_per_gpu=4)
    fresh.model.hf.use_kernels = True
    again = fresh.compute_log_prob(data, temperature=1.0)
    assert all(torch.equal(again[key], first[key]) for key in first)


@pytest.mark.parametrize("scale", [1e-3, 1e3], ids=["under-max-norm", "over-max-norm"])
def test_gradient_clipping_is_torchs_bit_for_bit(tiny_model_path, scale):
    """The engine's clip (which skips the multiply by a coefficient of 1) against torch's clip_grad_norm_."""
    eng = engine(tiny_model_path, micro_batch_size_per_gpu=8)
    data = make_batch(rows=8, prompt_len=8, response_len=10, seed=3)

    def scaled_loss(micro, outputs):
        loss, metrics = pg_loss(micro, outputs)
        return loss * scale, metrics

    eng.forward_backward(data, scaled_loss)
    params = [p for p in eng.model.parameters() if p.grad is not None]
    want = [p.grad.clone() for p in params]
    # clip_grad_norm_ scales the .grad of the parameters it is given: give it copies
    copies = [torch.nn.Parameter(torch.empty_like(g)) for g in want]
    for c, g in zip(copies, [p.grad.clone() for p in params], strict=True):
        c.grad = g
    want_norm = torch.nn.utils.clip_grad_norm_(copies, 1.0, foreach=True)
    norm = eng._clip_grad_norm()
    assert norm == float(want_norm) and (norm > 1.0) == (scale > 1)
    assert all(torch.equal(p.grad, c.grad) for p, c in zip(params, copies, strict=True))
    assert (scale < 1) == all(torch.equal(p.grad, g) for p, g in zip(params, want, strict=True))


def test_nonfinite_loss_skips_the_step_and_says_so(tiny_model_path):
    eng = engine(tiny_model_path)
    data = make_batch(rows=4, prompt_len=6, response_len=8, seed=4)
    before = params(eng)
    metrics = eng.train_step(data, nan_loss)
    assert metrics["skipped_nonfinite"] == 1.0
    assert max_diff(before, params(eng)) == 0.0
    assert eng.train_step(data, pg_loss)["skipped_nonfinite"] == 0.0
    assert max_diff(before, params(eng)) > 0.0


def test_checkpoint_resume_is_bitwise_identical(tiny_model_path, tmp_path):
    optim = OptimConfig(
        lr=1e-3, lr_warmup_steps=2, lr_scheduler_type="cosine", total_training_steps=6, min_lr_ratio=0.1
    )
    batches = [make_batch(rows=6, prompt_len=6, response_len=10, seed=10 + i) for i in range(3)]

    def step(eng, batch):
        metrics = eng.train_step(batch, pg_loss)
        eng.lr_scheduler_step()
        return metrics

    straight = engine(tiny_model_path, optim=optim, use_dynamic_bsz=True, max_tokens_per_micro_batch=64)
    for batch in batches[:2]:
        step(straight, batch)
    straight.save_checkpoint(str(tmp_path / "ckpt"))
    last = step(straight, batches[2])

    resumed = engine(tiny_model_path, optim=optim, use_dynamic_bsz=True, max_tokens_per_micro_batch=64)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.global_step == 2
    again = step(resumed, batches[2])
    assert again["lr"] == last["lr"] and again["grad_norm"] == last["grad_norm"]
    a, b = params(straight), params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_save_hf_model_loads_with_transformers_and_scores_the_same(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    eng = engine(tiny_model_path)
    data = make_batch(rows=4, prompt_len=6, response_len=8, seed=5)
    eng.train_step(data, pg_loss)
    eng.save_hf_model(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer.pad_token == eng.tokenizer.pad_token
    ours = eng.compute_log_prob(data, temperature=0.7)["log_probs"]
    theirs, _ = reference_log_probs(loaded, data, temperature=0.7)
    assert float((ours - theirs).abs().max()) <= 1e-6


def test_full_state_dict_round_trip_and_hf_names(tiny_model_path):
    eng = engine(tiny_model_path)
    sd = eng.full_state_dict()
    hf_names = set(eng.model.hf.state_dict())
    assert set(sd) <= hf_names and "model.embed_tokens.weight" in sd
    assert set(dict(eng.named_full_parameters())) == set(sd)
    changed = {k: v + 0.5 for k, v in sd.items()}
    eng.load_full_state_dict(changed)
    assert max_diff(eng.full_state_dict(), changed) == 0.0
    assert max_diff(changed, {k: v + 0.5 for k, v in sd.items()}) == 0.0  # the caller's dict is untouched


def test_critic_values_come_from_the_state_before_each_response_token(tiny_model_path, tmp_path):
    from transformers import AutoModelForTokenClassification

    eng = engine(tiny_model_path, role="critic", micro_batch_size_per_gpu=3)
    data = make_batch(rows=5, prompt_len=7, response_len=9, seed=6)
    values = eng.compute_values(data)
    assert values.shape == (5, 9) and values.dtype == torch.float32
    b = {k: v.to(eng.model.hf.device) for k, v in data.batch.items()}
    with torch.no_grad():
        hidden = eng.model.hf.model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).last_hidden_state
        expected = (eng.model.hf.score(hidden[:, 7 - 1 : -1]).squeeze(-1) * b["response_mask"]).cpu()
    assert float((values - expected).abs().max()) <= 1e-5
    losses = [eng.train_step(data, value_loss)["vf_loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    # The exported critic is an ordinary one-label token classifier and reloads as a critic engine.
    eng.save_hf_model(str(tmp_path / "critic"))
    exported = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic"))
    assert exported.config.num_labels == 1
    reloaded = engine(str(tmp_path / "critic"), role="critic")
    assert float((reloaded.compute_values(data) - eng.compute_values(data)).abs().max()) <= 1e-6
    with pytest.raises(ValueError, match="critic"):
        eng.compute_log_prob(data, temperature=1.0)


def test_ref_engine_has_no_optimizer_and_no_grads(tiny_model_path):
    eng = engine(tiny_model_path, role="ref")
    assert eng.optimizer is None and not any(p.requires_grad for p in eng.model.parameters())
    with pytest.raises(ValueError, match="ref engine"):
        eng.train_step(make_batch(rows=2, prompt_len=4, response_len=4, seed=0), pg_loss)


def test_bf16_mixed_precision_keeps_fp32_master_weights(tiny_model_path):
    eng = engine(tiny_model_path, param_dtype="bf16", use_dynamic_bsz=True, max_tokens_per_micro_batch=64)
    data = make_batch(rows=6, prompt_len=6, response_len=8, seed=7)
    out = eng.compute_log_prob(data, temperature=1.0)["log_probs"]
    ref, _ = reference_log_probs(eng.model.hf, data, temperature=1.0)
    assert out.dtype == torch.float32 and 0 < float((out - ref).abs().max()) < 0.1
    metrics = eng.train_step(data, pg_loss)
    assert metrics["skipped_nonfinite"] == 0.0
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in eng.optimizer.state.values())


def test_lr_schedule_warms_up_then_decays():
    cfg = OptimConfig(lr=1.0, lr_warmup_steps=4, lr_scheduler_type="cosine", total_training_steps=14, min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(14, cfg) == pytest.approx(0.1) and lr_multiplier(100, cfg) == pytest.approx(0.1)
    const = OptimConfig(lr_warmup_steps_ratio=0.5, total_training_steps=4)
    assert [lr_multiplier(s, const) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_training_steps"):
        OptimConfig(lr_scheduler_type="cosine").validate()


def test_config_errors_say_what_to_change(tiny_model_path):
    with pytest.raises(ValueError, match="choose one of"):
        FSDPEngine(EngineConfig(model_path=tiny_model_path, role="policy"))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        FSDPEngine(EngineConfig(model_path="/nonexistent/model"))
