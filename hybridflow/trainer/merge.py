"""`hybridflow merge`: a sharded FSDP checkpoint -> an ordinary Hugging Face model folder (veRL's model merger's shape).

    hybridflow merge --backend fsdp --local_dir RUN/global_step_10/actor --target_dir OUT

Two layouts are read; both hold weights only as tensors, and both are loaded tensor-only (no pickled code runs):

hybridflow's (``engines/checkpoint_io.py``): ``meta.json`` + ``model_rank{r}.safetensors`` + ``huggingface/``.
veRL's FSDP checkpoint (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``), the ``actor/`` (or ``critic/``) folder
of a ``global_step_N``:
    ``fsdp_config.json``                    ``{"FSDP_version": 1|2, "world_size": W}``
    ``model_world_size_W_rank_R.pt``        rank R's ``model.state_dict()``: DTensors (FSDP2: ``Shard(0)`` over a
                                            ``("fsdp",)`` or ``("ddp", "fsdp")`` mesh) or plain tensor shards
    ``huggingface/``                        the model's config.json and tokenizer (rank 0)
    (``optim_*`` / ``extra_state_*`` files are optimizer and RNG state, not needed for the weights.)

Shards are joined as veRL's merger joins them: a DTensor along the dim of its ``Shard`` placement (a ``Replicate`` one
is taken from the first rank), a plain tensor along dim 0. With a ``("ddp", "fsdp")`` mesh only the first replica
group's ranks are read. Unlike veRL's merger (which always writes bfloat16), the stored dtype is kept unless
``--dtype`` says otherwise, so the merged model gives the checkpoint's own logits.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import torch

from hybridflow.common.files import umask_modes
from hybridflow.trainer.checkpoint import STEP_DIR, CheckpointError, CheckpointManager
from hybridflow.trainer.export import load_full_actor_state, lora_meta, write_lora_folder

logger = logging.getLogger(__name__)

VERL_FSDP_CONFIG = "fsdp_config.json"
VERL_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_weights_dir(path: str) -> tuple[str, str]:
    """(layout, folder) for `path`: a run folder (its latest checkpoint), a ``global_step_N`` folder, or the
    ``actor/`` folder inside one; layout is ``"hybridflow"`` or ``"verl"``."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder; give a global_step_N folder, its actor/ folder or a run folder")
    for candidate in (path, os.path.join(path, "actor")):
        if os.path.exists(os.path.join(candidate, "meta.json")):
            return "hybridflow", candidate
        if os.path.exists(os.path.join(candidate, VERL_FSDP_CONFIG)):
            return "verl", candidate
    latest = CheckpointManager(path).latest()
    if latest is not None:
        return find_weights_dir(latest)
    verl_steps = sorted((int(m.group(1)), n) for n in os.listdir(path) if (m := STEP_DIR.match(n)))
    if verl_steps:  # a veRL run folder (no hybridflow COMPLETE markers): its newest step
        return find_weights_dir(os.path.join(path, verl_steps[-1][1]))
    raise CheckpointError(
        f"{path} holds no checkpoint: expected meta.json (hybridflow) or {VERL_FSDP_CONFIG} (veRL FSDP) in it or in "
        "its actor/ folder, or global_step_N folders"
    )


def load_verl_fsdp_state(actor_dir: str) -> dict[str, torch.Tensor]:
    """Full tensors from veRL's ``model_world_size_W_rank_R.pt`` shards (see the module docstring)."""
    config_path = os.path.join(actor_dir, VERL_FSDP_CONFIG)
    try:
        with open(config_path) as f:
            world_size = int(json.load(f)["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{config_path} is unreadable or has no world_size ({e}); it is not a veRL checkpoint") from e
    paths = [os.path.join(actor_dir, f"model_world_size_{world_size}_rank_{r}.pt") for r in range(world_size)]
    missing = [os.path.basename(p) for p in paths if not os.path.exists(p)]
    if missing:
        raise CheckpointError(f"{actor_dir}: world_size={world_size} but {missing[:4]} are missing; copy every rank's file")
    first = _load_tensors(paths[0])
    ranks = list(range(world_size))
    mesh_names = ("fsdp",)
    dtensor = next((v for v in first.values() if _is_dtensor(v)), None)
    if dtensor is not None:
        mesh_names = tuple(dtensor.device_mesh.mesh_dim_names or ("fsdp",))
        mesh = dtensor.device_mesh.mesh
        if mesh_names == ("ddp", "fsdp"):  # hybrid sharding: every replica holds the model; read the first one
            ranks = mesh[0].tolist()
        elif mesh_names == ("fsdp",) or mesh.dim() == 1:
            ranks = mesh.tolist()
        else:
            raise CheckpointError(
                f"{paths[0]}: device mesh {mesh_names} is not supported (only ('fsdp',) and ('ddp', 'fsdp'); "
                "tensor-parallel checkpoints need veRL's own merger)"
            )
    shards = {0: first} if 0 in ranks else {}
    for r in ranks:
        if r not in shards:
            shards[r] = _load_tensors(paths[r])
    full: dict[str, torch.Tensor] = {}
    for name in first:
        parts = []
        for r in ranks:
            if name not in shards[r]:
                raise CheckpointError(f"{paths[r]} has no {name!r}, which rank 0 has: the shards are from different models")
            parts.append(shards[r][name])
        full[name] = _join(name, parts, mesh_names)
    return full


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


def _join(name: str, parts: list[Any], mesh_names: tuple[str, ...]) -> torch.Tensor:
    if not _is_dtensor(parts[0]):
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    placements = tuple(parts[0].placements)
    if mesh_names == ("ddp", "fsdp"):
        placements = placements[1:]  # the replica dimension
    if len(placements) != 1:
        raise CheckpointError(f"{name}: placements {placements} over more than one mesh dimension are not supported")
    (p,) = placements
    local = [t._local_tensor for t in parts]
    if p.is_replicate():
        return local[0]
    if p.is_shard():
        return torch.cat(local, dim=p.dim).contiguous()
    raise CheckpointError(f"{name}: placement {p} (partial sums) cannot be merged from the saved shards")


def _load_tensors(path: str) -> dict[str, Any]:
    import torch.distributed.tensor  # registers DTensor with the tensor-only unpickler

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # the tensor-only unpickler refuses anything else (code objects, custom classes)
        raise CheckpointError(
            f"{path} could not be read as tensors only ({type(e).__name__}: {str(e)[:300]}); it is truncated, "
            "not a model shard, or holds objects other than tensors"
        ) from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a state dict")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entries {bad[:4]} are not tensors; not a model state dict")
    return state


def load_weights(layout: str, weights_dir: str) -> dict[str, torch.Tensor]:
    return load_verl_fsdp_state(weights_dir) if layout == "verl" else load_full_actor_state(weights_dir)


def write_hf_folder(
    state: dict[str, torch.Tensor], hf_dir: str, out_dir: str, *, dtype: str = "auto", trust_remote_code: bool = False
) -> str:
    """Build the model of ``hf_dir/config.json``, load `state` into it (every parameter must be there), save it
    with the tokenizer (and generation config) of `hf_dir` to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {list(DTYPES)}")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        raise CheckpointError(f"{hf_dir}/config.json is missing: the checkpoint does not say which model it is")
    config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust_remote_code)
    architectures = list(getattr(config, "architectures", None) or [])
    # A value model (veRL's critic) is a token-classification head; everything else here is a causal LM.
    auto = AutoModelForTokenClassification if any("TokenClassification" in a for a in architectures) else AutoModelForCausalLM
    target = DTYPES[dtype] or next(iter(state.values())).dtype
    model = auto.from_config(config, dtype=target, trust_remote_code=trust_remote_code)
    state = {k: v.to(target) for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    model.tie_weights()
    missing = [n for n, _ in model.named_parameters() if n not in state]  # a tied lm_head is listed once, as embed
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"the weights do not fit the model of {hf_dir}/config.json: missing {missing[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}"
        )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    umask_modes(out_dir)  # safetensors writes 0600 (common/files.py)
    try:
        AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=trust_remote_code).save_pretrained(out_dir)
    except (OSError, ValueError) as e:
        logger.warning("no tokenizer copied from %s (%s); the merged model folder has none", hf_dir, e)
    gen = os.path.join(hf_dir, "generation_config.json")
    if os.path.exists(gen):
        shutil.copy(gen, os.path.join(out_dir, "generation_config.json"))
    return out_dir


def merge_checkpoint(local_dir: str, target_dir: str, *, dtype: str = "auto", trust_remote_code: bool = False) -> str:
    """`hybridflow merge`: the weights of `local_dir` (either layout) as a Hugging Face folder at `target_dir`."""
    layout, weights_dir = find_weights_dir(local_dir)
    step_dir = os.path.dirname(weights_dir)
    if layout == "hybridflow" and STEP_DIR.match(os.path.basename(step_dir)):  # a copied-out actor/ has no marker
        problem = CheckpointManager.verify(step_dir)
        if problem is not None:
            raise CheckpointError(f"cannot merge {step_dir}: {problem}")
    state = load_weights(layout, weights_dir)
    lora = lora_meta(weights_dir) if layout == "hybridflow" else None
    if lora is not None:  # a LoRA checkpoint holds the adapter only: merge it into its base model
        logger.info("merging a LoRA adapter (%d tensors) from %s into %s", len(state), weights_dir,
                    lora["base_model_path"])
        return write_lora_folder(state, lora, weights_dir, target_dir, adapter=False, dtype=dtype)
    logger.info("merging %d tensors from %s (%s layout)", len(state), weights_dir, layout)
    return write_hf_folder(state, os.path.join(weights_dir, "huggingface"), target_dir, dtype=dtype,
                           trust_remote_code=trust_remote_code)
