"""`hybridflow export`: assemble a checkpoint's per-rank weight shards into an ordinary Hugging Face model folder."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager


def load_full_actor_state(actor_dir: str) -> dict[str, torch.Tensor]:
    """Concatenate the FSDP2 dim-0 shards of every rank (rank order) into full tensors, checked against meta.json."""
    meta_path = os.path.join(actor_dir, "meta.json")
    if not os.path.exists(meta_path):
        raise CheckpointError(f"{actor_dir} has no meta.json: not an actor checkpoint folder")
    with open(meta_path) as f:
        meta = json.load(f)
    shards = []
    for rank in range(meta["world_size"]):
        path = os.path.join(actor_dir, f"model_rank{rank}.safetensors")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        try:
            shards.append(load_file(path))
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{path} is unreadable ({e}): the checkpoint is truncated or corrupt") from e
    full = {}
    for name, shape in meta["parameters"].items():
        parts = [s[name] for s in shards if name in s and s[name].numel() > 0]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        if list(tensor.shape) != list(shape):
            raise CheckpointError(f"{name}: assembled shape {list(tensor.shape)} != recorded {shape}")
        full[name] = tensor
    return full


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = checkpoint
    if not os.path.exists(os.path.join(path, "actor")):  # a run folder: take its latest checkpoint
        latest = CheckpointManager(path).latest()
        if latest is None:
            raise CheckpointError(f"{checkpoint} is neither a checkpoint (global_step_N) nor a run folder with one")
        path = latest
    problem = CheckpointManager.verify(path)
    if problem is not None:
        raise CheckpointError(f"cannot export {path}: {problem}")
    actor_dir = os.path.join(path, "actor")
    hf_dir = os.path.join(actor_dir, "huggingface")
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_full_actor_state(actor_dir)
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [n for n, _ in model.named_parameters() if n not in state]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected "
                              f"{result.unexpected_keys[:5]}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    return out_dir
