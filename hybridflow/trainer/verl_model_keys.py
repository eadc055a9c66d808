"""veRL's model-loading and engine switches, as far as hybridflow has the thing they switch.

* ``actor_rollout_ref.model.override_config.*`` — attributes set on the transformers config of the actor, the
  reference and the rollout (veRL sets them on the config before ``from_pretrained``). Here the driver writes a model
  folder of its own, ``RUN_DIR/model_override/``: the overridden ``config.json`` beside links to every other file of
  the model folder (weights, tokenizer), and every engine loads from it, so actor, reference and rollout (native,
  hf or vllm) all see the same overridden config. An attribute the config does not have is an error, not a new key.
* ``*.trust_remote_code`` — transformers would import Python code from the model folder (``auto_map``). hybridflow runs
  only the architectures transformers (and its native engine) ship, so ``true`` is taken where the folder holds no
  such code (loading is then the same with or without the flag, as in veRL) and refused where it does.
* ``actor_rollout_ref.rollout.load_format`` — where the rollout's first weights come from. Every engine loads the
  checkpoint at start (then the actor's weights are synced in before the first generation): ``auto`` / ``hf`` read
  any transformers weights, ``safetensors`` requires ``*.safetensors`` files; veRL's ``dummy*`` (random init) is not
  offered.
* Switches whose one value is what hybridflow always does (the other value is refused with the reason):
  ``rollout.layered_summon=true`` (weight sync gathers one tensor at a time, less than one layer),
  ``model.fused_kernel_options.impl_backend=torch`` (or veRL's None) and ``*.entropy_from_logits_with_chunking=true``
  (log-probs and entropy come from the hidden states of the response positions only, in chunks of rows: no [tokens,
  vocab] logits at once in a forward),
  ``*.use_torch_compile=false`` (the training forward is eager), ``rollout.mode=async|sync`` (veRL's ``async``, its
  default, serves the engine behind an agent loop; here the engine generates every request of the batch and
  multi-turn rows run the agent loop, so both values name that one path),
  ``rollout.over_sample_rate=0`` (every request runs to its end), ``rollout.skip_tokenizer_init=true`` (the engines
  take and return token ids), ``rollout.enable_rollout_routing_replay`` (true only with ``actor.router_replay.mode=R3``,
  whose routes the rollout records), ``rollout.trace.*`` at their defaults (no mlflow / weave traces),
  ``data.dataloader_num_workers=0`` (no loader processes), ``trainer.use_legacy_worker_impl=auto|disable``
  (hybridflow's one worker implementation is veRL's new-style one; ``enable`` is refused).
* ``actor_rollout_ref.model.use_fused_kernels``: veRL's fused log-prob / entropy kernels, whose point is memory;
  ``true`` makes the actor's backward recompute each chunk's logits from its hidden states instead of keeping every
  chunk's (engines/hf_model.py ``logits_checkpointing``), ``false`` (veRL's default) keeps them.
* ``actor_rollout_ref.actor.checkpoint.save_contents`` / ``load_contents`` (checked here, honoured by the actor's
  engine): what a checkpoint holds and what a resume restores; see engines/checkpoint_io.py.
* ``*.fsdp_config.model_dtype`` and ``actor_rollout_ref.model.torch_dtype``: the dtype an engine loads and keeps its
  weights in (workers/engine_config.py ``model_dtype``): fp32 (the default, a master copy under param_dtype=bf16
  compute) or bf16 (weights, grads and optimizer state in bf16); ``fsdp_config.mixed_precision.reduce_dtype`` /
  ``buffer_dtype``: the gradients' reduce-scatter dtype and the model buffers' dtype (its ``param_dtype`` is renamed to
  ``fsdp_config.param_dtype``, verl_keys.py).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

LOAD_FORMATS = ("auto", "hf", "safetensors")
OVERRIDE_DIR = "model_override"  # inside the run folder (run_dir.py counts it as hybridflow's)


def switch_errors(cfg: Any) -> list[str]:
    """The switches of the module docstring set to a value hybridflow does not have, one message each."""
    arr = cfg.actor_rollout_ref
    errors = []
    fixed = [
        ("actor_rollout_ref.rollout.layered_summon", arr.rollout.layered_summon, True,
         "weight sync always gathers the actor's parameters one full tensor at a time (less memory than a layer)"),
        ("actor_rollout_ref.actor.entropy_from_logits_with_chunking", arr.actor.entropy_from_logits_with_chunking,
         True, "entropy is always computed in chunks of rows"),
        ("actor_rollout_ref.ref.entropy_from_logits_with_chunking", arr.ref.entropy_from_logits_with_chunking, True,
         "entropy is always computed in chunks of rows"),
        ("actor_rollout_ref.actor.use_torch_compile", arr.actor.use_torch_compile, False,
         "the training forward runs eagerly: a torch.compile'd step is not offered (length-bucketed micro-batches "
         "change shape every call)"),
        ("actor_rollout_ref.ref.use_torch_compile", arr.ref.use_torch_compile, False,
         "the reference forward runs eagerly: a torch.compile'd forward is not offered"),
        ("actor_rollout_ref.ref.entropy_checkpointing", arr.ref.entropy_checkpointing, False,
         "the reference computes log-probs only, without grad: no entropy and no backward to recompute it for "
         "(veRL's reference never uses the key either); actor_rollout_ref.actor.entropy_checkpointing is the actor's"),
    ]
    for key, value, only, why in fixed:
        if value is not only:
            errors.append(f"{key}={str(value).lower()}: {why}; remove the key or set it to {str(only).lower()}")
    if arr.rollout.mode not in ("async", "sync"):
        errors.append(
            f"actor_rollout_ref.rollout.mode={arr.rollout.mode!r}: veRL's rollout modes are async (its default) and "
            "sync; both run hybridflow's rollout (the engine generates every request of the batch, multi-turn rows "
            "through the agent loop). To overlap generation with training use trainer.rollout_mode=one_step_off or "
            "async"
        )
    rollout = arr.rollout
    if rollout.over_sample_rate != 0:
        errors.append(f"actor_rollout_ref.rollout.over_sample_rate={rollout.over_sample_rate}: aborting a step's "
                      "slowest requests is not offered (every sample runs to its end; trainer.rollout_mode=async "
                      "overlaps long generations with training instead); set 0 or remove the key")
    if not rollout.skip_tokenizer_init:
        errors.append("actor_rollout_ref.rollout.skip_tokenizer_init=false: the rollout engines always take and "
                      "return token ids (the worker decodes what it needs); set true or remove the key")
    if rollout.enable_rollout_routing_replay and arr.actor.router_replay.mode != "R3":
        errors.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true records the MoE routes that "
                      "actor_rollout_ref.actor.router_replay.mode=R3 replays; set that mode, or remove the key")
    if cfg.data.dataloader_num_workers != 0:
        errors.append(f"data.dataloader_num_workers={cfg.data.dataloader_num_workers}: there are no data loader "
                      "processes (the prompts are tokenized before the first step, by data."
                      "filter_overlong_prompts_workers processes, and each batch is a slice of them); set 0 or remove "
                      "the key")
    trace = arr.rollout.trace
    for key, value in (("backend", trace.backend), ("token2text", trace.token2text or None),
                       ("max_samples_per_step_per_worker", trace.max_samples_per_step_per_worker)):
        if value is not None:
            errors.append(f"actor_rollout_ref.rollout.trace.{key}={value}: rollout traces to mlflow / weave are not "
                          "offered (trainer.log_samples_freq writes rollouts and episodes, turn by turn, to "
                          "samples.jsonl, and `hybridflow report` shows them); remove the key")
    backend = arr.model.fused_kernel_options.impl_backend
    if backend not in ("torch", None, "None"):
        errors.append(f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}: hybridflow's fused "
                      "log-prob / entropy path (chunked rows from the hidden states, logits recomputed in backward) "
                      "is torch code, with no triton kernels; set torch or remove the key")
    legacy = cfg.trainer.use_legacy_worker_impl
    if legacy == "enable":
        errors.append("trainer.use_legacy_worker_impl=enable: veRL's legacy workers are not in hybridflow, which has "
                      "one worker implementation (veRL's new-style one: a training engine behind each role); set "
                      "auto or disable, or remove the key")
    elif legacy not in ("auto", "disable"):
        errors.append(f"trainer.use_legacy_worker_impl={legacy!r}: choose auto or disable (both select hybridflow's "
                      "one worker implementation)")
    errors += _checkpoint_contents_errors(arr.actor.checkpoint)
    from hybridflow.workers.engine_config import MODEL_DTYPE_NAMES, model_dtype

    for prefix, fsdp, model in (("actor_rollout_ref.actor.", arr.actor.fsdp_config, arr.model),
                                ("actor_rollout_ref.ref.", arr.ref.fsdp_config, arr.model),
                                ("critic.", cfg.critic.fsdp_config, None)):
        for name in ("reduce_dtype", "buffer_dtype"):
            value = getattr(fsdp.mixed_precision, name)
            if str(value) not in MODEL_DTYPE_NAMES:
                errors.append(f"{prefix}fsdp_config.mixed_precision.{name}={value!r}: choose fp32/float32 or "
                              "bf16/bfloat16")
        try:
            model_dtype(fsdp, model)
        except ValueError as err:
            where = prefix if str(err).startswith("fsdp_config") else "actor_rollout_ref."
            if f"{where}{err}" not in errors:  # model.torch_dtype is shared by actor and ref: said once
                errors.append(f"{where}{err}")
    if arr.rollout.load_format not in LOAD_FORMATS:
        fix = ("random initial rollout weights are not offered: the engines load the checkpoint, then take the "
               "actor's weights" if str(arr.rollout.load_format).startswith("dummy") else "")
        errors.append(
            f"actor_rollout_ref.rollout.load_format={arr.rollout.load_format!r}: choose one of {list(LOAD_FORMATS)}"
            + (f" ({fix})" if fix else "")
        )
    return errors


def _checkpoint_contents_errors(ck: Any) -> list[str]:
    """actor.checkpoint.save_contents / load_contents: known names, the model's shards always in (a resume needs
    them; an HF copy alone is `hybridflow export`'s job), hf_model never asked of a resume (it is not read back)."""
    from hybridflow.trainer.config import CHECKPOINT_CONTENTS

    key = "actor_rollout_ref.actor.checkpoint"
    errors = []
    for name, contents in (("save_contents", ck.save_contents), ("load_contents", ck.load_contents)):
        if contents is None:
            continue
        unknown = [c for c in contents if c not in CHECKPOINT_CONTENTS]
        if unknown:
            errors.append(f"{key}.{name}={list(contents)}: {unknown} unknown; choose from {list(CHECKPOINT_CONTENTS)}")
        elif "model" not in contents:
            errors.append(f"{key}.{name}={list(contents)} leaves out 'model': a checkpoint always holds (and a resume "
                          "always restores) the model's shards; add 'model' (for an HF copy only, use hybridflow export)")
    if ck.load_contents is not None and "hf_model" in ck.load_contents:
        errors.append(f"{key}.load_contents lists 'hf_model': a resume restores the shards ('model'), the HF copy is "
                      "for export and never read back; remove it")
    return errors


def _remote_code(folder: str, filename: str) -> bool:
    try:
        with open(os.path.join(folder, filename)) as f:
            return bool(json.load(f).get("auto_map"))
    except (OSError, ValueError):
        return False


def model_folder_errors(cfg: Any) -> list[str]:
    """What the model folders cannot do for trust_remote_code, load_format and override_config (reads configs only)."""
    arr = cfg.actor_rollout_ref
    errors = []
    actor_path = arr.model.path
    folders = [("actor_rollout_ref.model", actor_path, arr.model.trust_remote_code, "config.json"),
               ("data", actor_path, cfg.data.trust_remote_code, "tokenizer_config.json"),
               ("critic.model", cfg.critic.model.path or actor_path, cfg.critic.model.trust_remote_code, "config.json"),
               ("reward_model.model", cfg.reward_model.model.path, cfg.reward_model.model.trust_remote_code,
                "config.json")]
    for section, folder, trust, filename in folders:
        if trust and folder and _remote_code(folder, filename):
            errors.append(
                f"{section}.trust_remote_code=true: {folder}/{filename} names Python code of its own (auto_map), "
                "which hybridflow does not run; use a model of an architecture transformers ships"
            )
    if actor_path and arr.rollout.load_format == "safetensors" and not glob.glob(os.path.join(actor_path, "*.safetensors")):
        errors.append(
            f"actor_rollout_ref.rollout.load_format=safetensors: {actor_path} has no *.safetensors file; use "
            "load_format=auto (any transformers weights) or save the model with safetensors"
        )
    if actor_path and arr.model.override_config:
        try:
            overridden_config(actor_path, dict(arr.model.override_config))
        except (ValueError, OSError) as err:
            errors.append(str(err))
    return errors


def overridden_config(model_path: str, overrides: dict[str, Any]):
    """The model folder's transformers config with `overrides` set on it (nested dicts: sub-configs)."""
    from transformers import AutoConfig, PretrainedConfig

    config = AutoConfig.from_pretrained(model_path)

    def apply(target: Any, values: dict[str, Any], prefix: str) -> None:
        for key, value in values.items():
            where = f"actor_rollout_ref.model.override_config.{prefix}{key}"
            if not hasattr(target, key):
                raise ValueError(
                    f"{where}: the model's {type(target).__name__} has no attribute {key!r}; override_config sets "
                    "attributes the config already has (see the model's config.json)"
                )
            current = getattr(target, key)
            if isinstance(value, dict) and isinstance(current, PretrainedConfig):
                apply(current, value, f"{prefix}{key}.")
            else:
                setattr(target, key, value)

    apply(config, overrides, "")
    return config


def write_override_folder(model_path: str, overrides: dict[str, Any], run_dir: str) -> str:
    """RUN_DIR/model_override: the overridden config.json and links to every other file of `model_path`."""
    out = os.path.join(run_dir, OVERRIDE_DIR)
    config = overridden_config(model_path, overrides)
    shutil.rmtree(out, ignore_errors=True)  # ours: written again at every start, from the current keys
    os.makedirs(out)
    for name in os.listdir(model_path):
        if name != "config.json":
            os.symlink(os.path.join(os.path.abspath(model_path), name), os.path.join(out, name))
    config.save_pretrained(out)
    return out


def apply_model_overrides(cfg: Any, run_dir: str) -> None:
    """With override_config set, point actor, reference and rollout at RUN_DIR/model_override (the critic keeps
    the original folder: veRL's critic has an override_config of its own)."""
    model = cfg.actor_rollout_ref.model
    if not model.override_config:
        return
    if cfg.critic.model.path is None:
        cfg.critic.model.path = model.path
    model.path = write_override_folder(model.path, dict(model.override_config), run_dir)
