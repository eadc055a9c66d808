"""`hybridflow export`: assemble a checkpoint's per-rank weight shards into an ordinary Hugging Face model folder.

The folder writing is shared with `hybridflow merge` (``merge.py``), which reads veRL's FSDP checkpoints as well."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hybridflow.trainer.checkpoint import CheckpointError


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
    """A run folder (its latest checkpoint), a ``global_step_N`` folder or its ``actor/`` folder (veRL's habit) ->
    a Hugging Face model folder at `out_dir`; veRL FSDP checkpoints are read too (see ``merge.py``)."""
    from hybridflow.trainer.merge import merge_checkpoint

    return merge_checkpoint(checkpoint, out_dir)
