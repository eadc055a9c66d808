"""MoE routing replay (R3): the native rollout records each token's experts, the training engine's forwards reuse
them, and the rollout/training log-prob mismatch that near-tied routers cause goes away (fp32, <= 1e-5).

The test model is a Qwen3-MoE whose routers have experts 1 and 2 tied up to 1e-7 for every token: the two engines
compute the same router logits up to rounding, so on such ties they pick different experts for some tokens -- the
known MoE train/inference mismatch, made certain here instead of rare.
"""

from __future__ import annotations

import json

import pytest
import torch
from e2e_helpers import tiny_run_overrides
from test_native_archs import write_arch_model
from test_rollout_engines import make_prompts
from transformers import AutoModelForCausalLM

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.tiny import build_char_tokenizer, write_tiny_model
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training

PROMPTS = ["12+34=", "a longer prompt here", "x", "what is 7*8?"] * 2


def _tie_routers(path: str) -> str:
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p[2] = p[1] + 1e-7 * torch.randn_like(p[1])
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tied_moe(tmp_path_factory) -> str:
    return _tie_routers(write_arch_model(tmp_path_factory.mktemp("r3") / "model", "qwen3_moe", seed=0))


def _rollout(path: str):
    engine = create_rollout_engine("native", path, record_routes=True, decode="eager", num_threads=1)
    return engine.generate(make_prompts(build_char_tokenizer(), PROMPTS),
                           SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=5))


def _actor(path: str, replay: bool, packing: bool = False) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, router_replay=replay, optim=OptimConfig(lr=1e-3),
                                   use_sequence_packing=packing))


def test_replay_removes_the_routing_mismatch(tied_moe):
    out = _rollout(tied_moe)
    b = out.batch
    routes = b["routed_experts"]
    assert routes.shape == (*b["input_ids"].shape, 1, 2)  # one routed layer (layer 0 is dense), top-2
    # every real token was routed (but the last generated one, which no forward saw unless its row ran on after
    # stopping); padding is marked -1
    prompt_len = b["prompts"].shape[1]
    real = b["attention_mask"].bool()
    for i in range(len(out)):
        last = prompt_len + int(b["response_mask"][i].sum()) - 1
        assert (routes[i][real[i]][:-1] >= 0).all() and (routes[i, last + 1 :] == -1).all(), i
        assert (routes[i][~real[i]] == -1).all(), i
    longest = int(b["response_mask"].sum(-1).argmax())
    assert (routes[longest, -1] == -1).all()  # the longest row's last token was never fed
    free = _actor(tied_moe, replay=False).compute_log_prob(out, temperature=1.0)["log_probs"]
    replayed = _actor(tied_moe, replay=True).compute_log_prob(out, temperature=1.0)["log_probs"]
    without = logprob_mismatch(b["rollout_log_probs"], free, b["response_mask"])
    with_replay = logprob_mismatch(b["rollout_log_probs"], replayed, b["response_mask"])
    assert without["mismatch/max_abs"] > 1e-3, without  # the tie really flips experts between the engines
    assert with_replay["mismatch/max_abs"] <= 1e-5, with_replay


def test_replay_follows_sequence_packing(tmp_path):
    """Packing lays the rows' real tokens end to end in one row; the routes follow them there. (A model without
    sliding windows: packing refuses those.)"""
    path = _tie_routers(write_tiny_model(tmp_path / "m", "unit", arch="qwen3_moe", seed=0))
    out = _rollout(path)
    b = out.batch
    free = _actor(path, replay=False, packing=True).compute_log_prob(out, temperature=1.0)["log_probs"]
    packed = _actor(path, replay=True, packing=True).compute_log_prob(out, temperature=1.0)["log_probs"]
    assert logprob_mismatch(b["rollout_log_probs"], free, b["response_mask"])["mismatch/max_abs"] > 1e-4
    assert logprob_mismatch(b["rollout_log_probs"], packed, b["response_mask"])["mismatch/max_abs"] <= 1e-5


def test_replayed_update_trains_the_router(tied_moe):
    out = _rollout(tied_moe)
    out.batch["advantages"] = torch.randn(out.batch["responses"].shape, generator=torch.Generator().manual_seed(0))
    actor = _actor(tied_moe, replay=True)

    def loss_fn(micro, outputs):
        mask = micro.batch["response_mask"].float()
        return -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info[
            "global_num_tokens"], {}

    actor.forward_backward(out, loss_fn)
    router = [p for n, p in actor.model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router and all(p.grad is not None and p.grad.abs().sum() > 0 for p in router)
    # the routes must come from the same rows: a batch whose routes are cut short is refused, not misaligned
    short = out[list(range(len(out)))]  # a copy
    short.batch["routed_experts"] = short.batch["routed_experts"][:, :-3]
    with pytest.raises((ValueError, RuntimeError)):
        actor.compute_log_prob(short, temperature=1.0)


def test_grpo_with_r3_has_no_rollout_mismatch(arithmetic_files, tied_moe, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tied_moe, run_dir, "trainer.backend=local",
                                         "actor_rollout_ref.rollout.name=native",
                                         "actor_rollout_ref.actor.router_replay.mode=R3"))
    assert run_training(cfg, progress=False).global_step == 2
    with open(f"{run_dir}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        assert row["rollout/mismatch_max_abs"] <= 1e-5, row["rollout/mismatch_max_abs"]
        assert 1.0 <= row["actor/router/max_load_ratio"] <= 4.0


def test_replay_config_errors(arithmetic_files, tied_moe, tiny_model_path, tmp_path):
    base = tiny_run_overrides(arithmetic_files, tied_moe, str(tmp_path / "run"), "trainer.backend=local")
    with pytest.raises(ConfigError, match=r"R2 .* is not implemented"):
        load_config([*base, "actor_rollout_ref.actor.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match="needs the rollout to record its routes"):
        load_config([*base, "actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.name=hf"])
    with pytest.raises(ValueError, match="has no MoE routers"):
        _actor(tiny_model_path, replay=True)
    with pytest.raises(ValueError, match="has no routed experts"):
        create_rollout_engine("native", tiny_model_path, record_routes=True)
