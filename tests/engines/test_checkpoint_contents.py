"""veRL's actor.checkpoint.save_contents / load_contents on the training engine (world size 1, real safetensors and
torch.save files): what a checkpoint holds, what a resume restores, and a clear refusal when it asks for more."""

from __future__ import annotations

import json
import os

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.trainer.config import ConfigError, load_config


def pg_loss(micro, outputs):
    mask = micro.batch["response_mask"].float()
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {}


def engine(path: str) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3, weight_decay=0.0, lr_warmup_steps=3)))


def trained(path: str) -> FSDPEngine:
    eng = engine(path)
    for seed in (1, 2):
        eng.train_step(make_batch(rows=4, prompt_len=6, response_len=8, seed=seed), pg_loss)
        eng.lr_scheduler_step()
    return eng


def test_model_only_checkpoint_has_no_optimizer_state_and_a_full_resume_is_refused(tiny_model_path, tmp_path):
    eng = trained(tiny_model_path)
    full, lean = str(tmp_path / "full"), str(tmp_path / "lean")
    eng.save_checkpoint(full)
    eng.save_checkpoint(lean, ("model",))
    assert json.load(open(os.path.join(lean, "meta.json")))["contents"] == ["model"]
    assert json.load(open(os.path.join(full, "meta.json")))["contents"] == ["model", "optimizer", "extra"]
    lean_state = torch.load(os.path.join(lean, "optim_rank0.pt"), weights_only=True)
    assert not {"optimizer_state", "lr_scheduler", "rng_cpu"} & set(lean_state)
    assert os.path.getsize(os.path.join(lean, "optim_rank0.pt")) < os.path.getsize(os.path.join(full, "optim_rank0.pt"))

    with pytest.raises(ValueError, match=r"holds \['model'\] but resuming asks for \['optimizer', 'extra'\].*"
                                         r"load_contents=\['model'\]"):
        engine(tiny_model_path).load_checkpoint(lean)

    resumed = engine(tiny_model_path)
    resumed.load_checkpoint(lean, ("model",))
    weights, again = eng.full_state_dict(), resumed.full_state_dict()
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert not resumed.optimizer.state  # AdamW starts afresh
    assert resumed.lr_scheduler.last_epoch == 0 and eng.lr_scheduler.last_epoch == 2


def test_load_contents_without_optimizer_skips_the_saved_state(tiny_model_path, tmp_path, caplog):
    eng = trained(tiny_model_path)
    eng.save_checkpoint(str(tmp_path / "full"))
    resumed = engine(tiny_model_path)
    with caplog.at_level("WARNING"):
        resumed.load_checkpoint(str(tmp_path / "full"), ("model", "extra"))
    assert not resumed.optimizer.state and resumed.lr_scheduler.last_epoch == 2
    assert any("without its optimizer" in r.message for r in caplog.records)
    everything = engine(tiny_model_path)
    everything.load_checkpoint(str(tmp_path / "full"))
    assert everything.optimizer.state


def test_hf_model_in_save_contents_writes_a_transformers_copy(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    eng = trained(tiny_model_path)
    eng.save_checkpoint(str(tmp_path / "ck"), ("model", "optimizer", "extra", "hf_model"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck" / "huggingface"))
    ours = eng.full_state_dict()
    theirs = loaded.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    eng.save_checkpoint(str(tmp_path / "plain"))
    assert not os.path.exists(tmp_path / "plain" / "huggingface")


@pytest.mark.parametrize("override, match", [
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,weights]", r"\['weights'\] unknown"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[optimizer]", r"leaves out 'model'"),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model,hf_model]", r"load_contents lists 'hf_model'"),
])
def test_bad_contents_are_refused_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config([override])


def test_verl_contents_lists_are_taken():
    ck = load_config(["actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']"]
                     ).actor_rollout_ref.actor.checkpoint
    assert ck.save_contents == ["model", "optimizer", "extra", "hf_model"] and ck.load_contents is None
