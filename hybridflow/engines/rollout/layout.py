"""Shared by every rollout backend: prompt checks, special-token ids, and building the output DataProto.

Keeping this in one place is what makes the backends interchangeable: they differ only in how they produce
``responses [B*n, R]`` and ``rollout_log_probs [B*n, R]``; everything else in the output is derived here.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from hybridflow.protocol import DataProto

__all__ = [
    "RolloutPrompts",
    "assemble_output",
    "read_prompts",
    "resolve_dtype",
    "special_token_ids",
    "warn_if_slow_bf16",
]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'fp32' / 'bf16' (or a torch dtype) -> the torch dtype the engine computes in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        hint = " ('int8' is the native engine's, on CPU)" if dtype == "int8" else ""
        raise ValueError(f"rollout dtype {dtype!r} is not supported by this engine; choose 'fp32' or 'bf16'{hint}")
    return _DTYPES[dtype]


def warn_if_slow_bf16(dtype: torch.dtype, device: torch.device) -> None:
    """Warn when bf16 matmuls would be emulated: on AVX2-only CPUs they ran ~7x slower than fp32 (measured)."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("DEFAULT", "AVX2"):
        warnings.warn(
            f"rollout dtype bf16 on a CPU with {capability} only (no AVX512-BF16/AMX): bf16 matmuls are emulated and "
            "several times slower than fp32 here; use dtype='fp32' on this machine (bf16 pays off on GPUs)",
            stacklevel=3,
        )


class RolloutPrompts:
    """The three prompt tensors, checked: ``input_ids``, ``attention_mask``, ``position_ids``, all ``[B, P]``."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.position_ids = position_ids

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_length(self) -> int:
        return int(self.input_ids.shape[1])


def read_prompts(prompts: DataProto) -> RolloutPrompts:
    """Check the prompt batch against the layout in base.py; missing position_ids are derived from the mask."""
    missing = [k for k in ("input_ids", "attention_mask") if k not in prompts.batch]
    if missing:
        raise KeyError(
            f"rollout prompts lack {missing}; a prompt batch needs input_ids, attention_mask (and position_ids) "
            f"[batch, prompt_len], left-padded; it has {sorted(prompts.batch)}"
        )
    input_ids = prompts.batch["input_ids"].long()
    mask = prompts.batch["attention_mask"].long()
    if input_ids.dim() != 2 or input_ids.shape != mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(mask.shape)} must both be [batch, prompt_len]"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("the rollout got an empty prompt batch")
    lengths = mask.sum(-1)
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no tokens (attention_mask all 0); drop them before the rollout")
    # Left padding means each row's ones form a suffix: the mask never falls from 1 back to 0.
    not_left_padded = ((mask[:, 1:] - mask[:, :-1]) < 0).any(-1).nonzero().flatten().tolist()
    if not_left_padded:
        raise ValueError(
            f"prompt rows {not_left_padded[:8]} are not left-padded (a 0 follows a 1 in attention_mask); tokenize with "
            "padding_side='left'"
        )
    if "position_ids" in prompts.batch:
        position_ids = prompts.batch["position_ids"].long()
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
    else:
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return RolloutPrompts(input_ids, mask, position_ids)


def special_token_ids(tokenizer, generation_config=None, model_config=None) -> tuple[int, list[int]]:
    """(pad_token_id, eos_token_ids) from the checkpoint's tokenizer, generation config and model config.

    eos ids are the union of all three sources (chat models often list several, e.g. <|im_end|> and <|endoftext|>);
    pad falls back to the first eos id when the checkpoint names no pad token.
    """
    eos: list[int] = []
    for source in (tokenizer, generation_config, model_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        for i in [value] if isinstance(value, int) else list(value or []):
            if i is not None and int(i) not in eos:
                eos.append(int(i))
    pad = None
    for source in (tokenizer, generation_config, model_config):
        value = getattr(source, "pad_token_id", None) if source is not None else None
        if isinstance(value, int):
            pad = value
            break
    if pad is None:
        if not eos:
            raise ValueError(
                "the checkpoint defines neither pad_token_id nor eos_token_id; set them in the tokenizer or "
                "generation_config.json"
            )
        pad = eos[0]
    return int(pad), eos


def assemble_output(
    prompts: DataProto,
    read: RolloutPrompts,
    responses: torch.Tensor,
    response_lengths: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    n: int,
    pad_token_id: int,
) -> DataProto:
    """The output layout of base.py from per-row responses.

    responses [B*n, R'] (anything after a row's length is overwritten with pad), response_lengths [B*n] (eos/stop
    token included), rollout_log_probs [B*n, R'] (zeroed after the length). R' is trimmed to the longest response.
    Non-tensor prompt columns follow their samples (repeated n times, interleaved); meta_info is kept.
    """
    device = read.input_ids.device
    rows = read.batch_size * n
    if responses.shape[0] != rows:
        raise AssertionError(f"backend returned {responses.shape[0]} rows, expected batch {read.batch_size} x n {n}")
    R = max(int(response_lengths.max()), 1) if rows else 1
    responses = responses[:, :R].to(device)
    log_probs = rollout_log_probs[:, :R].to(device=device, dtype=torch.float32)
    if responses.shape[1] < R:  # a backend may stop before its longest row's length only if it returned short tensors
        raise AssertionError(f"responses have {responses.shape[1]} columns but a row is {R} tokens long")
    response_mask = (torch.arange(R, device=device)[None, :] < response_lengths.to(device)[:, None]).long()
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    log_probs = log_probs * response_mask

    prompt_ids = read.input_ids.repeat_interleave(n, dim=0)
    prompt_mask = read.attention_mask.repeat_interleave(n, dim=0)
    prompt_pos = read.position_ids.repeat_interleave(n, dim=0)
    response_pos = prompt_pos[:, -1:] + 1 + torch.arange(R, device=device)[None, :]
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors, non_tensors, dict(prompts.meta_info))


def pad_responses(out: DataProto, width: int, pad_token_id: int) -> DataProto:
    """Right-pad a rollout output (the layout above) to `width` response columns; a no-op when it is as wide.

    Ranks that generate separately return responses as wide as their own longest one; gathering them into one batch
    needs one width, so every call pads to its max_new_tokens. Padding columns are masked out (attention_mask,
    response_mask 0, log-probs 0), positions continue, so nothing downstream computes or learns on them.
    """
    b = out.batch
    R = b["responses"].shape[1]
    extra = width - R
    if extra <= 0:
        return out
    rows = b["responses"].shape[0]

    def right(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, t.new_full((rows, extra), value)], dim=1)

    b["responses"] = right(b["responses"], pad_token_id)
    b["input_ids"] = right(b["input_ids"], pad_token_id)
    b["attention_mask"] = right(b["attention_mask"], 0)
    b["response_mask"] = right(b["response_mask"], 0)
    if "rollout_log_probs" in b:
        b["rollout_log_probs"] = right(b["rollout_log_probs"], 0.0)
    if "routed_experts" in b:  # [rows, P + R, layers, k]; -1: not routed (moe.py RouteRecorder)
        routes = b["routed_experts"]
        b["routed_experts"] = torch.cat([routes, routes.new_full((rows, extra, *routes.shape[2:]), -1)], dim=1)
    pos = b["position_ids"]
    b["position_ids"] = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(extra, device=pos.device)[None, :]], dim=1)
    return out
