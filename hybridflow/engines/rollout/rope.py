"""Rotary embedding tables for the native decoder, computed exactly as transformers' rotary embedding modules do.

One table per rope the checkpoint uses: ``"default"`` for most models, one per layer type when ``rope_parameters`` is
keyed by layer type (Gemma 3: local rope on sliding layers, global rope, possibly scaled, on full ones). Static
scalings (linear, llama3, yarn, ...) come from transformers' own ``ROPE_INIT_FUNCTIONS``; ``partial_rotary_factor``
< 1 rotates only the first part of each head (Phi-3/Phi-4 style).

A layer without a position embedding (``arch_specs.NO_ROPE``: SmolLM3's NoPE layers) gets a table of cos 1 and sin
0 over the same rotary width: every decode path rotates every layer alike, and this rotation leaves q and k as they
are (x * 1 + y * 0 is x).

``longrope`` (Phi-3's, "su" in older configs) switches from its short to its long factors once a forward pass
covers more than ``original_max_position_embeddings`` positions, decided per call by the longest sequence in the
batch, so the answer depends on what else is in the batch. The decoder uses the short factors and refuses to
generate past that length (``RotaryTables.limit``); ``dynamic`` rope rescales by the running length and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.engines.rollout.arch_specs import NO_ROPE

__all__ = ["RotaryTables", "rotary_tables"]


@dataclass
class RotaryTables:
    """cos and signed sin [max_positions, rotary_dim] per rope key, in the decoder's dtype."""

    cos: dict[str, torch.Tensor]
    sin: dict[str, torch.Tensor]  # rotate_half's sign folded in: [-sin[:half], sin[half:]]
    rotary_dim: int
    limit: int | None  # positions must stay below this (longrope's short range); None: max_positions


def _one_table(config, params: dict, layer_type: str | None, head_dim: int, max_positions: int):
    rope_type = params.get("rope_type", "default")
    factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    dim = int(head_dim * factor)
    limit = None
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    elif rope_type == "dynamic":
        raise ValueError("native rollout: rope_type='dynamic' rescales with the running sequence length; use the "
                         "'hf' engine (actor_rollout_ref.rollout.name=hf)")
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"native rollout: unknown rope_type={rope_type!r}; known: "
                             f"{['default', *ROPE_INIT_FUNCTIONS]}")
        kwargs = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)  # longrope: the short factors
        if rope_type == "longrope":
            limit = int(params["original_max_position_embeddings"])
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling, int(inv_freq.numel()) * 2, limit


def rotary_tables(config, rope_keys: set[str], head_dim: int, max_positions: int, dtype: torch.dtype,
                  device: torch.device) -> RotaryTables:
    """Tables for each key in ``rope_keys`` ("default", or layer types when rope_parameters is keyed by them)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # pre-5 configs: rope_theta at the top level
        params = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    cos, sin, dims, limits = {}, {}, set(), set()
    for key in sorted(rope_keys - {NO_ROPE}):
        per_type = key != "default"
        c, s, dim, limit = _one_table(config, params[key] if per_type else params, key if per_type else None,
                                      head_dim, max_positions)
        half = dim // 2
        # HF casts cos/sin to the activation dtype before using them
        cos[key] = c.to(device=device, dtype=dtype)
        sin[key] = torch.cat((-s[:, :half], s[:, half:]), dim=-1).to(device=device, dtype=dtype)
        dims.add(dim)
        if limit is not None:
            limits.add(limit)
    if len(dims) > 1:
        raise ValueError(f"native rollout: layer types rotate different head fractions {sorted(dims)}; use 'hf'")
    dim = dims.pop() if dims else head_dim
    if NO_ROPE in rope_keys:
        cos[NO_ROPE] = torch.ones(max_positions, dim, device=device, dtype=dtype)
        sin[NO_ROPE] = torch.zeros(max_positions, dim, device=device, dtype=dtype)
    return RotaryTables(cos, sin, dim, min(limits) if limits else None)
