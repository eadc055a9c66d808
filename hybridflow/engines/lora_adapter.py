"""Starting LoRA training from a saved PEFT adapter (veRL's ``actor_rollout_ref.model.lora_adapter_path``).

The adapter layers are built from the config's keys as for a fresh run (lora_rank, lora_alpha, target_modules,
exclude_modules, lora_dropout: `lora.apply_lora`), then the folder's tensors are copied into them, so the policy at
step 0 is the saved one (base + the adapter). The folder is a PEFT adapter: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), as written by ``hybridflow export --adapter``, the engine's
``save_adapter`` or PEFT's ``save_pretrained``. Disagreement is an error, never a silent re-init:
  * rank or alpha in ``adapter_config.json`` differ from lora_rank / lora_alpha (alpha / rank is the scaling);
  * the folder's tensors and the adapter layers the keys build are not the same set (other target modules).
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch import nn

__all__ = ["adapter_config_errors", "load_adapter_weights", "read_adapter_config"]

KEY = "actor_rollout_ref.model.lora_adapter_path"
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def read_adapter_config(path: str) -> dict[str, Any]:
    """The folder's adapter_config.json as a dict; ValueError naming the folder when it is not a PEFT adapter."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"{KEY}={path!r} is not a folder; give a PEFT adapter folder (hybridflow export --adapter)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{KEY}: {file} cannot be read as a PEFT adapter config ({err})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or "r" not in config:
        raise ValueError(f"{KEY}: {file} is not a LoRA adapter (peft_type={config.get('peft_type')!r}, no 'r')")
    return config


def adapter_config_errors(path: str, rank: int, alpha: float) -> list[str]:
    """What stops the adapter at `path` from starting a run with lora_rank=`rank`, lora_alpha=`alpha` (configs only)."""
    try:
        config = read_adapter_config(path)
    except ValueError as err:
        return [str(err)]
    errors = []
    if not any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES):
        errors.append(f"{KEY}: {path} has no adapter weights ({' or '.join(WEIGHT_FILES)})")
    if rank <= 0:
        errors.append(f"{KEY} needs LoRA on: set actor_rollout_ref.model.lora_rank={config['r']} (the adapter's r)")
    elif int(config["r"]) != int(rank):
        errors.append(f"{KEY}: the adapter has r={config['r']} but actor_rollout_ref.model.lora_rank={rank}; set "
                      f"lora_rank={config['r']}")
    saved_alpha = config.get("lora_alpha")
    if rank > 0 and saved_alpha is not None and float(saved_alpha) != float(alpha):
        errors.append(f"{KEY}: the adapter has lora_alpha={saved_alpha} but actor_rollout_ref.model.lora_alpha="
                      f"{alpha}; set lora_alpha={saved_alpha} (alpha / rank scales the update it learned)")
    return errors


def _load_tensors(path: str) -> dict:
    safetensors_file = os.path.join(path, WEIGHT_FILES[0])
    if os.path.exists(safetensors_file):
        from safetensors.torch import load_file

        return load_file(safetensors_file)
    import torch

    return torch.load(os.path.join(path, WEIGHT_FILES[1]), map_location="cpu", weights_only=True)


def load_adapter_weights(peft_model: nn.Module, settings: Any) -> None:
    """Copy the adapter folder's tensors into `peft_model`'s freshly built adapter layers (before FSDP sharding).

    settings: the engine's LoraSettings (rank, alpha, adapter_path). ValueError when the folder's config or tensors
    do not match the layers the keys built."""
    from peft import set_peft_model_state_dict

    path = settings.adapter_path
    if errors := adapter_config_errors(path, settings.rank, settings.alpha):
        raise ValueError("; ".join(errors))
    tensors = _load_tensors(path)
    result = set_peft_model_state_dict(peft_model, tensors)
    own = {n for n, _ in peft_model.named_parameters() if ".lora_" in n}
    missing = sorted(k for k in result.missing_keys if k in own)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise ValueError(
            f"{KEY}: the adapter in {path} does not fit the LoRA layers of actor_rollout_ref.model.target_modules="
            f"{settings.target_modules!r} (exclude_modules={settings.exclude_modules!r}): "
            f"{len(missing)} layer tensors have no saved value (e.g. {missing[:2]}), {len(unexpected)} saved tensors "
            f"have no layer (e.g. {unexpected[:2]}); set target_modules to the adapter's "
            f"{read_adapter_config(path).get('target_modules')}"
        )
