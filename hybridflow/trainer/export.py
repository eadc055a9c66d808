"""`hybridflow export`: assemble a checkpoint's per-rank weight shards into an ordinary Hugging Face model folder.

The folder writing is shared with `hybridflow merge` (``merge.py``), which reads veRL's FSDP checkpoints as well.
A LoRA run's checkpoint holds only the adapter (meta.json's ``lora`` names the base model and PEFT's LoraConfig):
export rebuilds the PEFT model on the base and writes the merged model, or with ``--adapter`` the PEFT adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained(base, folder)``)."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError

from hybridflow.common.files import umask_modes
from hybridflow.engines.checkpoint_io import assemble_full_state, read_rank_file
from hybridflow.trainer.checkpoint import CheckpointError


def load_full_actor_state(actor_dir: str) -> dict[str, torch.Tensor]:
    """Every rank's shards put together at the indices their files record (FSDP rows, TP slices), checked against
    meta.json's shapes."""
    meta_path = os.path.join(actor_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{actor_dir} has no meta.json: not an actor checkpoint folder")
    with open(meta_path) as f:
        meta = json.load(f)
    shards, layouts = [], []
    for rank in range(meta["world_size"]):
        path = os.path.join(actor_dir, f"model_rank{rank}.safetensors")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        try:
            tensors, layout = read_rank_file(path)
        except (OSError, SafetensorError, ValueError) as e:
            raise CheckpointError(f"{path} is unreadable ({e}): the checkpoint is truncated or corrupt") from e
        shards.append(tensors)
        layouts.append(layout)
    try:
        return assemble_full_state(shards, layouts, meta["parameters"], actor_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def lora_meta(actor_dir: str) -> dict | None:
    """meta.json's ``lora`` section of a hybridflow actor checkpoint (None: a full-weights checkpoint)."""
    path = os.path.join(actor_dir, "meta.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("lora")


def export_checkpoint(checkpoint: str, out_dir: str, *, adapter: bool = False) -> str:
    """A run folder (its latest checkpoint), a ``global_step_N`` folder or its ``actor/`` folder (veRL's habit) ->
    a Hugging Face model folder at `out_dir`; veRL FSDP checkpoints are read too (see ``merge.py``).
    adapter=True: a LoRA checkpoint's PEFT adapter folder instead of the merged model."""
    from hybridflow.trainer.merge import find_weights_dir, merge_checkpoint

    if adapter:
        layout, weights_dir = find_weights_dir(checkpoint)
        meta = lora_meta(weights_dir) if layout == "hybridflow" else None
        if meta is None:
            raise CheckpointError(
                f"{weights_dir} is not a LoRA checkpoint (no lora section in meta.json), so it has no adapter to "
                "export; drop --adapter to export the full model"
            )
        return write_lora_folder(load_full_actor_state(weights_dir), meta, weights_dir, out_dir, adapter=True)
    return merge_checkpoint(checkpoint, out_dir)


def write_lora_folder(adapter_state: dict[str, torch.Tensor], meta: dict, weights_dir: str, out_dir: str, *,
                      adapter: bool, dtype: str = "auto") -> str:
    """The adapter tensors (transformers names of the LoRA-injected model) on the base model of `meta`, written as a
    PEFT adapter folder (adapter=True) or merged into the base weights as a Hugging Face model folder."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.trainer.merge import write_hf_folder

    base_path = meta["base_model_path"]
    if not os.path.isdir(base_path):
        raise CheckpointError(
            f"{weights_dir} is a LoRA checkpoint of the base model {base_path}, which is not there any more; the "
            "checkpoint holds only the adapter, so export needs that base model folder back in place"
        )
    fields = {k: v for k, v in meta["peft_config"].items() if k in LoraConfig.__dataclass_fields__}
    config = LoraConfig(**fields)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    peft_model = get_peft_model(base, config)
    result = base.load_state_dict(adapter_state, strict=False)
    expected = {n for n, _ in base.named_parameters() if ".lora_" in n}
    if result.unexpected_keys or expected - set(adapter_state):
        raise CheckpointError(
            f"{weights_dir}: the adapter does not fit {base_path} with its LoraConfig: unexpected "
            f"{result.unexpected_keys[:5]}, missing {sorted(expected - set(adapter_state))[:5]}"
        )
    if adapter:
        os.makedirs(out_dir, exist_ok=True)
        peft_model.save_pretrained(out_dir)
        umask_modes(out_dir)  # safetensors writes 0600 (common/files.py)
        AutoTokenizer.from_pretrained(base_path).save_pretrained(out_dir)
        return out_dir
    merged = peft_model.merge_and_unload()
    state = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    return write_hf_folder(state, base_path, out_dir, dtype=dtype)
