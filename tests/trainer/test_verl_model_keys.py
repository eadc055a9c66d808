"""veRL's model-loading and engine switches (trainer/verl_model_keys.py) and veRL's SFT keys: each read by a run
and tested, or refused with one reason line."""

from __future__ import annotations

import json
import shutil

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.preflight import preflight_errors


@pytest.mark.parametrize("override, match", [
    ("actor_rollout_ref.rollout.layered_summon=false", r"layered_summon=false: weight sync always gathers"),
    ("actor_rollout_ref.actor.entropy_from_logits_with_chunking=false", r"always computed in chunks"),
    ("actor_rollout_ref.ref.entropy_from_logits_with_chunking=false", r"always computed in chunks"),
    ("actor_rollout_ref.actor.use_torch_compile=true", r"use_torch_compile=true: the training forward runs eagerly"),
    ("actor_rollout_ref.ref.use_torch_compile=true", r"ref.use_torch_compile=true"),
    ("actor_rollout_ref.rollout.mode=server", r"rollout.mode='server': veRL's rollout modes are async .* and sync"),
    ("actor_rollout_ref.rollout.load_format=dummy_dtensor", r"random initial rollout weights are not offered"),
    ("actor_rollout_ref.rollout.load_format=pt", r"load_format='pt': choose one of \['auto', 'hf', 'safetensors'\]"),
    ("actor_rollout_ref.model.fused_kernel_options.impl_backend=triton", r"impl_backend=triton: .* is torch code"),
])
def test_switch_values_hybridflow_does_not_have_are_refused_with_the_reason(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config([override])


def test_the_values_hybridflow_has_are_taken():
    cfg = load_config(["actor_rollout_ref.rollout.layered_summon=True", "actor_rollout_ref.model.use_fused_kernels=True",
                       "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.ref.use_torch_compile=False",
                       "actor_rollout_ref.rollout.mode=sync", "actor_rollout_ref.rollout.load_format=safetensors",
                       "actor_rollout_ref.rollout.mode=async",  # veRL's default (its only mode: sync was removed)
                       "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
                       "actor_rollout_ref.model.trust_remote_code=True", "data.trust_remote_code=True",
                       "critic.model.trust_remote_code=True",
                       "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"])
    assert cfg.actor_rollout_ref.rollout.load_format == "safetensors" and cfg.actor_rollout_ref.model.trust_remote_code


@pytest.mark.parametrize("fused", [True, False])
def test_use_fused_kernels_sets_the_actors_logit_recomputation(fused, tiny_model_path):
    from hybridflow.workers.engine_config import engine_config

    cfg = load_config([f"actor_rollout_ref.model.use_fused_kernels={fused}",
                       "actor_rollout_ref.model.fused_kernel_options.impl_backend=null"])
    arr = cfg.actor_rollout_ref
    for role, fsdp in (("actor", arr.actor.fsdp_config), ("ref", arr.ref.fsdp_config)):
        engine = engine_config(model_path=tiny_model_path, role=role, model=arr.model, fsdp=fsdp, seed=0,
                               micro_batch_size=2, use_dynamic_bsz=False, max_token_len=256)
        assert engine.logits_checkpointing is (fused and role == "actor")  # the reference has no backward


def _cfg(model_path, *extra):
    return load_config([f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.rollout.n=2", *extra])


def test_trust_remote_code_is_refused_only_for_a_folder_with_code_of_its_own(tiny_model_path, tmp_path):
    assert preflight_errors(_cfg(tiny_model_path, "actor_rollout_ref.model.trust_remote_code=true",
                                 "data.trust_remote_code=true")) == []
    custom = tmp_path / "custom"
    shutil.copytree(tiny_model_path, custom)
    config = json.loads((custom / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (custom / "config.json").write_text(json.dumps(config))
    errors = preflight_errors(_cfg(custom, "actor_rollout_ref.model.trust_remote_code=true"))
    assert any("actor_rollout_ref.model.trust_remote_code=true" in e and "auto_map" in e for e in errors), errors
    assert not any("trust_remote_code" in e for e in preflight_errors(_cfg(custom)))  # the flag off: nothing to trust


def test_load_format_safetensors_needs_safetensors_files(tiny_model_path, tmp_path):
    assert preflight_errors(_cfg(tiny_model_path, "actor_rollout_ref.rollout.load_format=safetensors")) == []
    bin_only = tmp_path / "bin_only"
    shutil.copytree(tiny_model_path, bin_only)
    (bin_only / "model.safetensors").unlink()
    errors = preflight_errors(_cfg(bin_only, "actor_rollout_ref.rollout.load_format=safetensors"))
    assert any("has no *.safetensors file" in e for e in errors), errors


def test_override_config_names_an_attribute_the_config_lacks(tiny_model_path):
    errors = preflight_errors(_cfg(tiny_model_path, "+actor_rollout_ref.model.override_config.embd_pdrop=0.0"))
    assert any("override_config.embd_pdrop: the model's Qwen2Config has no attribute 'embd_pdrop'" in e
               for e in errors), errors


def test_override_folder_is_what_the_training_model_and_the_native_rollout_load(tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.rollout.registry import create_rollout_engine
    from hybridflow.trainer.verl_model_keys import write_override_folder

    out = write_override_folder(tiny_model_path, {"rms_norm_eps": 0.25, "attention_dropout": 0.0}, str(tmp_path))
    assert AutoModelForCausalLM.from_pretrained(out).config.rms_norm_eps == 0.25
    engine = create_rollout_engine("native", out)
    assert engine.config.rms_norm_eps == 0.25
    assert json.loads(open(f"{tiny_model_path}/config.json").read())["rms_norm_eps"] == 1e-06  # the original stays


def test_override_config_reaches_actor_ref_and_rollout_in_a_run(arithmetic_files, tiny_model_path, tmp_path):
    """A run with override_config: every policy engine loads RUN/model_override, so the rollout's log-probs of its
    own samples equal the actor's (a config applied to one side only would differ by far more than 1e-5)."""
    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local", "trainer.total_training_steps=1",
        "+actor_rollout_ref.model.override_config.rms_norm_eps=0.25", "actor_rollout_ref.actor.use_kl_loss=true",
    ))
    run_training(cfg, progress=False)
    assert cfg.actor_rollout_ref.model.path == f"{run_dir}/model_override"
    assert cfg.critic.model.path == tiny_model_path  # the critic keeps the original (its own override_config)
    assert json.loads(open(f"{run_dir}/model_override/config.json").read())["rms_norm_eps"] == 0.25
    row = json.loads(open(f"{run_dir}/metrics.jsonl").readline())
    assert row["rollout/mismatch_mean_abs"] <= 1e-5, row["rollout/mismatch_mean_abs"]


def test_verl_sft_keys_run(tiny_model_path, tmp_path):
    """veRL's gsm8k SFT command line: the text inside the extra_info dict column, model.partial_pretrain, run names."""
    from hybridflow.trainer.sft_trainer import sft_main

    data = tmp_path / "sft.jsonl"
    rows = [{"prompt": "unused", "extra_info": {"question": f"{i}+1?", "answer": f"#### {i + 1}"}} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    summary = sft_main([
        f"data.train_files={data}", "data.prompt_key=extra_info", "data.response_key=extra_info",
        "+data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']", "data.train_batch_size=4",
        "data.micro_batch_size_per_gpu=4", f"model.partial_pretrain={tiny_model_path}", "model.strategy=fsdp",
        "trainer.project_name=gsm8k-sft", "trainer.experiment_name=tiny", f"trainer.default_local_dir={out}",
        "trainer.total_training_steps=2", "trainer.logger=[jsonl]", "trainer.num_threads_per_worker=1",
    ])
    assert summary["steps"] == 2 and (out / "huggingface" / "config.json").exists()


def test_sft_dict_keys_errors_name_the_path(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from hybridflow.data.schema import DataConfigError
    from hybridflow.data.sft_dataset import SFTDataset

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"extra_info": {"question": "q"}}) + "\n")
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(DataConfigError, match=r"row 0: 'extra_info.answer' is missing"):
        SFTDataset(str(data), tok, prompt_key="extra_info", response_key="extra_info",
                   prompt_dict_keys=("question",), response_dict_keys=("answer",))
    with pytest.raises(ConfigError, match=r"model\.strategy='megatron'"):
        from hybridflow.trainer.sft_trainer import load_sft_config

        load_sft_config([f"data.train_files={data}", f"model.path={tiny_model_path}", "model.strategy=megatron"])


def test_multiturn_sft_trains_on_every_assistant_turn_only(tiny_model_path, tmp_path):
    """veRL's data.multiturn: the loss mask covers each assistant turn's tokens (content and end-of-turn), not the
    user turns between them; the prompt is everything before the first assistant turn."""
    from transformers import AutoTokenizer

    from hybridflow.data.sft_dataset import SFTDataset
    from hybridflow.trainer.sft_trainer import sft_main

    chat = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "and 2+2"}, {"role": "assistant", "content": "4"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"conversation": chat}) + "\n" for _ in range(4)))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ds = SFTDataset(str(data), tok, messages_key="conversation", max_length=256)
    batch = ds.collate([0])
    resp = batch.batch["responses"][0]
    mask = batch.batch["response_mask"][0].bool()
    trained = tok.decode(resp[mask])
    assert trained == "2<|im_end|>\n4<|im_end|>\n", trained
    assert tok.decode(batch.batch["prompts"][0]).endswith("<|im_start|>assistant\n")
    assert "and 2+2" in tok.decode(resp[~mask])
    summary = sft_main([
        f"data.train_files={data}", "data.multiturn.enable=true", "data.multiturn.messages_key=conversation",
        "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4", f"model.path={tiny_model_path}",
        f"trainer.default_local_dir={tmp_path / 'out'}", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
        "trainer.num_threads_per_worker=1",
    ])
    assert summary["steps"] == 1


def test_multiturn_rows_without_an_assistant_turn_are_named(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from hybridflow.data.schema import DataConfigError
    from hybridflow.data.sft_dataset import SFTDataset

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataConfigError, match=r"chat.jsonl row 0: the conversation has no assistant turn"):
        SFTDataset(str(data), AutoTokenizer.from_pretrained(tiny_model_path), messages_key="messages")
