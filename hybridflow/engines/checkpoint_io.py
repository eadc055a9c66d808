"""Save and load the training engine's state: per-rank shards of weights, optimizer state, LR schedule and RNG.

Layout of a checkpoint directory (one set of files per rank, written by that rank):
  ``model_rank{r}.safetensors``   this rank's local shard of every parameter (HF names), exact bits; the file's
                                  metadata ``hybridflow.layout`` says, per sharded parameter and dim, which global
                                  indices the shard holds (FSDP's dim-0 rows, TP's column or row slices, both), so
                                  `assemble_full_state` rebuilds the full tensors without a process group
  ``optim_rank{r}.pt``            AdamW state (local shards) + param groups + LR scheduler + RNG; plain tensors and
                                  Python scalars only, read back with ``torch.load(weights_only=True)``
  ``meta.json``                   world size, parameter names and full shapes, and "contents": what the files hold
                                  (model, optimizer, extra = LR schedule + RNG; veRL's checkpoint.save_contents)
Local shards (not gathered tensors) make resume bitwise exact and keep memory flat; the price is that a checkpoint
is tied to its world size and sharding. For a portable copy use the engine's ``save_hf_model``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import pickle
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from hybridflow.common.files import umask_modes
from hybridflow.device import device_name
from hybridflow.engines.hf_model import hf_name

__all__ = [
    "assemble_full_state",
    "check_safetensors_files",
    "load_engine_state",
    "local_tensor",
    "read_rank_file",
    "save_engine_state",
    "shard_index_runs",
]

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
LAYOUT_KEY = "hybridflow.layout"  # safetensors metadata of model_rank{r}: {name: {dim: [[start, stop], ...]}}
_EARLIER = (
    "resume from an earlier checkpoint (trainer.resume_mode=auto skips damaged ones) "
    "or start afresh (trainer.resume_mode=disable)"
)
_OTHER_MODEL = (
    "resume with the actor_rollout_ref.model.path (or critic.model.path) it was trained from, "
    "or start afresh with trainer.resume_mode=disable"
)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _chunk(indices: list[int], n: int, c: int) -> list[int]:
    size = -(-len(indices) // n)  # torch.chunk's split: ceil-sized pieces, the last ones short or empty
    return indices[c * size : (c + 1) * size]


def shard_index_runs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
                     placements: tuple[Any, ...]) -> dict[int, list[list[int]]]:
    """The global indices a DTensor's local shard holds, per tensor dim it splits, as ``[start, stop)`` runs.

    Placements apply mesh dim by mesh dim, left to right, each splitting the indices the earlier ones left along its
    tensor dim: ``Shard(d)`` keeps chunk ``coordinate`` of them (torch.chunk's sizes). FSDP2 over a TP-sharded dim
    records ``_StridedShard(d, split_factor=tp)`` on its mesh dim: the indices are cut in ``split_factor`` pieces (the
    TP slices, applied after) and the rank keeps its chunk of each. ``Replicate`` splits nothing; ``Partial`` (pending
    sums) is refused: a saved shard must hold values."""
    index: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        dim = getattr(placement, "dim", None)
        if dim is None:
            raise ValueError(f"placement {placement} holds partial values; reduce the tensor before saving it")
        current = index.get(dim, list(range(shape[dim])))
        n, c = mesh_shape[mesh_dim], coordinate[mesh_dim]
        pieces = getattr(placement, "split_factor", 1)
        index[dim] = [i for k in range(pieces) for i in _chunk(_chunk(current, pieces, k), n, c)]
    return {dim: _runs(indices) for dim, indices in index.items()}


def _runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def _layout(p: torch.Tensor) -> dict[str, list[list[int]]] | None:
    """`shard_index_runs` of a DTensor parameter on this rank (None: a plain tensor, held whole)."""
    if not hasattr(p, "to_local"):
        return None
    mesh = p.device_mesh
    runs = shard_index_runs(tuple(p.shape), tuple(mesh.shape), mesh.get_coordinate(), tuple(p.placements))
    return {str(dim): r for dim, r in runs.items()}


def assemble_full_state(shards: list[dict[str, torch.Tensor]], layouts: list[dict[str, dict] | None],
                        shapes: dict[str, list[int]], where: str) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local shards and their ``hybridflow.layout`` (`shard_index_runs`); each shard
    is written at its indices, so FSDP rows, TP slices and replicas all land right. A layout of None (a checkpoint
    written before layouts were recorded) means FSDP's dim-0 rows in rank order. ValueError naming the parameter
    where the pieces do not cover the recorded shape."""
    full: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        held = [(s[name], None if layout is None else layout.get(name, {})) for s, layout in zip(shards, layouts)
                if name in s]
        if not held:
            raise ValueError(f"{where}: no rank's file holds {name}")
        if any(layout is None for _, layout in held):
            parts = [t for t, _ in held if t.numel() > 0]
            tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if list(tensor.shape) != list(shape):
                raise ValueError(
                    f"{where}: {name}: assembled shape {list(tensor.shape)} != recorded {shape} (its files predate "
                    "the recorded shard layout, which a tensor-parallel checkpoint needs; export it with the "
                    "hybridflow version that wrote it, or resume and save it again)"
                )
            full[name] = tensor
            continue
        tensor = torch.empty(shape, dtype=held[0][0].dtype)
        blocks: set[tuple[tuple[int, int], ...]] = set()
        for local, layout in held:
            # per dim, the [start, stop) runs this shard holds and where each sits in the shard
            per_dim = []
            for dim, size in enumerate(shape):
                runs = layout.get(str(dim), [[0, size]])  # absent: the dim is not split
                at, placed = 0, []
                for a, b in runs:
                    placed.append((a, b, at))
                    at += b - a
                if at != local.shape[dim]:
                    raise ValueError(f"{where}: {name}: a shard of shape {list(local.shape)} does not match its "
                                     "layout")
                per_dim.append(placed)
            # slices, never index tensors: a 150k x 4k embedding costs no index memory
            for combo in itertools.product(*per_dim):
                block = tuple((a, b) for a, b, _ in combo)
                if block in blocks or any(a == b for a, b in block):
                    continue  # a replica's copy of a block already written, or an empty piece
                blocks.add(block)
                tensor[tuple(slice(a, b) for a, b in block)] = local[tuple(slice(at, at + b - a) for a, b, at in combo)]
        _check_cover(blocks, shape, f"{where}: {name}")
        full[name] = tensor
    return full


def _check_cover(blocks: set[tuple[tuple[int, int], ...]], shape: list[int], what: str) -> None:
    """The distinct blocks written must not overlap and must add up to the whole tensor (then they cover it)."""
    ordered = sorted(blocks)
    for i, first in enumerate(ordered):
        for second in ordered[i + 1:]:
            if all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(first, second)):
                raise ValueError(f"{what}: two shards hold overlapping pieces {first} and {second}; the files are from "
                                 "different runs")
    total = sum(math.prod(b - a for a, b in block) for block in blocks)
    if total != math.prod(shape):
        raise ValueError(f"{what}: the shards cover {total} of {math.prod(shape)} values; a rank's file is missing "
                         "or from another run")


def read_rank_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, dict] | None]:
    """A ``model_rank{r}.safetensors``: its tensors and its layout (None where the file has none)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        recorded = (f.metadata() or {}).get(LAYOUT_KEY)
    return load_file(path), None if recorded is None else json.loads(recorded)


def check_safetensors_files(folder: str, what: str = "model folder") -> int:
    """Read the header of every ``*.safetensors`` file in `folder` (no weights loaded) and check that the file is as
    long as the header says; ValueError naming the file if one is truncated or not safetensors. Returns the count."""
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                f.metadata()
        except (OSError, SafetensorError) as e:
            raise ValueError(
                f"{what} {folder}: weights file {path} is unreadable ({e}); it is truncated (an interrupted download "
                "or copy) or not a safetensors file. Fetch or write the file again"
            ) from e
    return len(files)


def _named(model: nn.Module, trainable_only: bool) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]


def _model_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"model_rank{rank}.safetensors")


def _optim_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"optim_rank{rank}.pt")


def save_engine_state(
    directory: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    rank: int,
    world_size: int,
    extra: dict[str, Any] | None = None,
    trainable_only: bool = False,
    meta_extra: dict[str, Any] | None = None,
    save_rng: bool = True,
) -> None:
    """Write this rank's files; every rank calls it (no collectives inside). trainable_only: only the parameters
    that require grad (LoRA: the adapter; the frozen base is the model path's). meta_extra: more keys for meta.json.
    optimizer / lr_scheduler None, save_rng False: that state is left out (veRL's checkpoint.save_contents without
    'optimizer' / 'extra'); meta.json's "contents" says what the files hold."""
    os.makedirs(directory, exist_ok=True)
    named = _named(model, trainable_only)
    weights = {hf_name(n): local_tensor(p.detach()).cpu().contiguous() for n, p in named}
    layout = {hf_name(n): lay for n, p in named if (lay := _layout(p)) is not None}
    save_file(weights, _model_file(directory, rank), metadata={LAYOUT_KEY: json.dumps(layout)})
    umask_modes(_model_file(directory, rank))  # safetensors writes 0600 (common/files.py)
    state: dict[str, Any] = {"extra": dict(extra or {})}
    accelerator = _accelerator_module()
    if save_rng:
        state["rng_cpu"] = torch.get_rng_state()
        if accelerator is not None:
            state["rng_device"] = accelerator.get_rng_state()
    if optimizer is not None:
        index = {id(p): hf_name(n) for n, p in named}
        state["optimizer_state"] = {
            index[id(p)]: {k: local_tensor(v).cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        for g in state["param_groups"]:
            g["betas"] = list(g["betas"])
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    torch.save(state, _optim_file(directory, rank))
    if rank == 0:
        meta = {
            "world_size": world_size,
            "parameters": {hf_name(n): list(p.shape) for n, p in named},
            "has_optimizer": optimizer is not None,
            "contents": ["model"] + (["optimizer"] if optimizer is not None else [])
            + (["extra"] if save_rng or lr_scheduler is not None else []),
            "trainable_only": trainable_only,
            **(meta_extra or {}),
        }
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)


def load_engine_state(
    directory: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    rank: int,
    world_size: int,
    trainable_only: bool = False,
    load_rng: bool = True,
) -> dict[str, Any]:
    """Restore what `save_engine_state` wrote into an engine built with the same config; returns its `extra` dict.
    trainable_only: as it was saved (LoRA: the adapter only, the base comes from the model path).
    optimizer / lr_scheduler None, load_rng False: that state is not restored (it keeps the engine's fresh one); asked
    for but not in the checkpoint, it is a ValueError naming the checkpoint's contents."""
    meta_path = os.path.join(directory, META_FILE)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: {directory!r} is not an engine checkpoint (save_checkpoint)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {directory!r} was written by {meta['world_size']} ranks but this engine has {world_size}; "
            "resume with the same number of ranks, or export it (`hybridflow export CHECKPOINT OUT_DIR`) and start a "
            "new run from OUT_DIR"
        )
    if bool(meta.get("trainable_only", False)) != trainable_only:
        raise ValueError(
            f"checkpoint {directory!r} was written {'with' if meta.get('trainable_only') else 'without'} LoRA "
            f"(adapter-only weights) and this engine is {'with' if trainable_only else 'without'} it; resume with "
            f"the actor_rollout_ref.model.lora_rank it was trained with, or start afresh (trainer.resume_mode=disable)"
        )
    named = _named(model, trainable_only)
    recorded = meta.get("parameters", {})
    for n, p in named:
        shape = recorded.get(hf_name(n))
        if shape is not None and list(shape) != list(p.shape):
            raise ValueError(
                f"checkpoint {directory!r} was written for another model: parameter {hf_name(n)} is "
                f"{tuple(shape)} there and {tuple(p.shape)} here; {_OTHER_MODEL}"
            )
    model_file = _model_file(directory, rank)
    try:
        weights = load_file(model_file)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"checkpoint file {model_file} is unreadable ({e}): it is truncated or corrupt; {_EARLIER}") from e
    missing = [hf_name(n) for n, _ in named if hf_name(n) not in weights]
    if missing:
        raise KeyError(f"checkpoint {directory!r} (rank {rank}) lacks parameters {missing[:5]}; {_OTHER_MODEL}")
    with torch.no_grad():
        for n, p in named:
            dst = local_tensor(p)
            src = weights[hf_name(n)]
            if dst.shape != src.shape:
                raise ValueError(
                    f"checkpoint {directory!r}, parameter {hf_name(n)}: rank {rank}'s shard is {tuple(src.shape)}, "
                    f"the engine's {tuple(dst.shape)}; {_OTHER_MODEL}"
                )
            dst.copy_(src)
    optim_file = _optim_file(directory, rank)
    try:
        state = torch.load(optim_file, weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(
            f"checkpoint file {optim_file} is unreadable or holds more than tensors and plain values ({e}); "
            f"it is truncated, corrupt or not ours, and was not unpickled; {_EARLIER}"
        ) from e
    saved = meta.get("contents", ["model", "optimizer", "extra"])  # older checkpoints held everything
    wanted = ["optimizer"] if optimizer is not None else []
    wanted += ["extra"] if load_rng or lr_scheduler is not None else []
    absent = [c for c in wanted if c not in saved or (c == "optimizer" and "optimizer_state" not in state)
              or (c == "extra" and "rng_cpu" not in state)]
    if absent:
        raise ValueError(
            f"checkpoint {directory!r} holds {saved} but resuming asks for {absent} too (it was saved with "
            "checkpoint.save_contents without them). Resume without them (actor_rollout_ref.actor.checkpoint."
            f"load_contents={[c for c in ['model', 'optimizer', 'extra'] if c in saved]}: they start afresh), from "
            "another checkpoint, or start afresh (trainer.resume_mode=disable)"
        )
    if optimizer is not None:
        by_name = {hf_name(n): p for n, p in named}
        optimizer.state.clear()
        for name, s in state["optimizer_state"].items():
            p = by_name[name]
            optimizer.state[p] = {k: _like_param(v, p, k) if torch.is_tensor(v) else v for k, v in s.items()}
        configured = [{k: g[k] for k in _CONFIGURED if k in g} for g in optimizer.param_groups]
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    if lr_scheduler is not None and "lr_scheduler" in state:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if optimizer is not None:
        _apply_configured(optimizer, lr_scheduler, configured, directory)
    if load_rng:
        torch.set_rng_state(state["rng_cpu"])
        accelerator = _accelerator_module()
        if accelerator is not None and "rng_device" in state:
            accelerator.set_rng_state(state["rng_device"])
    return state.get("extra", {})


# Hyper-parameters the config sets (the optimizer was built from it): a resumed run uses the config's values, not the
# checkpoint's. "initial_lr" is the peak lr the schedule multiplies; "lr" itself is derived from it each step.
_CONFIGURED = ("initial_lr", "betas", "weight_decay", "eps")


def _apply_configured(optimizer: torch.optim.Optimizer, lr_scheduler: Any | None, configured: list[dict],
                      directory: str) -> None:
    """Put back the settings of the current config that differ from the checkpoint's, and say which changed."""
    changes = []
    for i, (group, mine) in enumerate(zip(optimizer.param_groups, configured)):
        for key, value in mine.items():
            old = group.get(key)
            if old is None or _same(old, value):
                continue  # unchanged: keep the checkpoint's bits (bitwise-exact resume)
            changes.append(f"{'lr' if key == 'initial_lr' else key}: {_fmt(old)} -> {_fmt(value)}")
            group[key] = value
            if key == "initial_lr":
                if lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
                    lr_scheduler.base_lrs[i] = value
                lambdas = getattr(lr_scheduler, "lr_lambdas", None)
                step = getattr(lr_scheduler, "last_epoch", 0)
                group["lr"] = value * lambdas[i](step) if lambdas else value
    if changes:
        logger.warning(
            "resuming %s with the optimizer settings of the current config, which differ from the checkpoint's: %s",
            directory, "; ".join(sorted(set(changes))),
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return [float(x) for x in a] == [float(x) for x in b]
    return float(a) == float(b)


def _fmt(v: Any) -> str:
    return f"({', '.join(f'{float(x):g}' for x in v)})" if isinstance(v, (tuple, list)) else f"{float(v):g}"


def _accelerator_module():
    """torch.cuda (or the like) when the engine computes on an accelerator, else None."""
    name = device_name()
    return None if name == "cpu" else getattr(torch, name)


def _like_param(local: torch.Tensor, param: torch.Tensor, key: str) -> torch.Tensor:
    """A saved local shard -> a state tensor laid out like `param` (a DTensor with the same sharding, or plain).

    "step" is a scalar: it goes to the parameters' device (fused AdamW reads it there), unsharded.
    """
    if key == "step":
        return local.to(local_tensor(param).device)
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local.to(param.to_local().device),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
            run_check=False,
        )
    return local.to(param.device)
