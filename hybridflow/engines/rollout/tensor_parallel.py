"""Tensor-parallel native rollout: each rank of a TP group holds 1/t of the attention heads, MLP columns and vocabulary.

Layout (Megatron-style; the collectives are shm_collectives.TPCollectives': shared memory on one host's CPUs,
``torch.distributed`` otherwise, so that the decode loop of native_rollout.py runs unchanged on every rank):
  * q/k/v projections are column-parallel by head: TP rank r holds query heads ``[r*H/t, (r+1)*H/t)`` and KV heads
    ``[r*KV/t, (r+1)*KV/t)``, so grouped-query attention stays local (query head h reads KV head h // (H/KV)) and so
    does the rank's KV cache (1/t of it);
  * gate/up are column-parallel over the intermediate size, down and o_proj row-parallel: one all-reduce after each
    of o_proj and down_proj per layer (their biases are held by TP rank 0 only, so the sum adds them once);
  * MoE layers: every expert's gate/up/down split over its intermediate size the same way, the router replicated;
  * the embedding and the output head are vocabulary-parallel: rank r holds rows ``[r*Vp, (r+1)*Vp)`` with
    ``Vp = ceil(V/t)`` (the last slice zero-padded); a lookup outside a rank's rows gives zeros and one all-reduce
    sums the slices, and the output head's partial logits ``[rows, Vp]`` are all-gathered into ``[rows, V]``;
  * norms, rotary tables and q/k norms are replicated.
Every rank therefore sees the same full logits and the same sampled tokens: the rows' random streams are the same
(the same call seed on every rank), and the sampled tokens are broadcast from TP rank 0 anyway, so one rounding
difference between ranks can never make their decode loops diverge. Only TP rank 0 of a group returns results to
the driver (the worker's mesh-aware dispatch, ``mesh_name="rollout"``).

``tp_pieces`` says which part of every HF tensor a rank holds; weight resharding (engines/resharding.py) moves
exactly those parts out of the training engine's FSDP2 shards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.engines.rollout.arch_specs import DecoderShape, resolve
from hybridflow.engines.rollout.native_model import _EXPERT_NAME, _LAYER_NAME, NativeDecoder
from hybridflow.engines.rollout.shm_collectives import TPCollectives

__all__ = ["TPGroup", "TensorParallelDecoder", "tensor_parallel_errors", "tp_group_of"]

VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# (dim, [(start, stop), ...]) in the full tensor's coordinates: the rank's slice is the concatenation of the ranges
# along dim; None: the whole tensor (replicated)
Pieces = tuple[int, list[tuple[int, int]]] | None


@dataclass(frozen=True)
class TPGroup:
    """One rank's tensor-parallel group: consecutive global ranks ``[dp_rank*size, (dp_rank+1)*size)``."""

    size: int
    rank: int  # position in the TP group
    dp_rank: int  # which TP group (the rollout's data-parallel rank)
    dp_size: int
    group: object  # the torch.distributed process group of the TP ranks
    src: int  # global rank of TP rank 0 (broadcast source)


_GROUPS: dict[int, TPGroup] = {}


def tp_group_of(size: int) -> TPGroup:
    """This rank's TP group of `size` consecutive ranks; collective over the default group on first use (every rank
    creates every group, in the same order, as torch.distributed.new_group requires)."""
    if size in _GROUPS:
        return _GROUPS[size]
    if not dist.is_initialized():
        raise RuntimeError(f"tensor_parallel_size={size} needs torch.distributed initialised (a worker group's ranks)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the {world} ranks of this group; "
                         "set actor_rollout_ref.rollout.tensor_model_parallel_size to a divisor of it")
    mine = None
    for d in range(world // size):
        ranks = list(range(d * size, (d + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = TPGroup(size, rank - d * size, d, world // size, group, ranks[0])
    _GROUPS[size] = mine
    return mine


def tensor_parallel_errors(config, size: int) -> list[str]:
    """What stops a checkpoint's config from splitting over `size` TP ranks (each message names the numbers)."""
    if size <= 1:
        return []
    s = resolve(config)
    fix = f"set actor_rollout_ref.rollout.tensor_model_parallel_size to a divisor of it (now {size})"
    checks = [("num_attention_heads", s.num_heads), ("num_key_value_heads", s.num_kv_heads)]
    if any(not layer.moe for layer in s.layers):
        checks.append(("intermediate_size", s.intermediate_size))
    if s.moe:
        checks.append(("moe_intermediate_size", s.moe_intermediate_size))
    return [f"the model's {key}={value} does not split over {size} tensor-parallel ranks; {fix}"
            for key, value in checks if value % size]


class TensorParallelDecoder(NativeDecoder):
    """NativeDecoder holding TP rank ``tp.rank``'s slice of every weight; ``load`` takes full HF tensors (and slices
    them), ``load_slice`` takes the slice itself (resharded weights, engines/resharding.py)."""

    def __init__(self, config, dtype, device, max_positions, *, tp: TPGroup, collectives: TPCollectives,
                 int8=False, prepack=None, linear_kernel=None, huge_pages=None):
        problems = tensor_parallel_errors(config, tp.size)
        if problems:
            raise ValueError("native rollout: " + "; ".join(problems))
        self.tp, self.collectives = tp, collectives
        self.full_shape = resolve(config)
        super().__init__(config, dtype, device, max_positions, int8=int8, prepack=prepack, linear_kernel=linear_kernel,
                         huge_pages=huge_pages)
        s, t = self.full_shape, tp.size
        self.vocab_rows = math.ceil(s.vocab_size / t)  # rows per rank (the last slice is padded)
        self.vocab_start = tp.rank * self.vocab_rows
        self.vocab_stop = min(s.vocab_size, self.vocab_start + self.vocab_rows)

    def _resolve_shape(self, config) -> DecoderShape:
        s, t = resolve(config), self.tp.size
        return dataclasses.replace(
            s, vocab_size=math.ceil(s.vocab_size / t), num_heads=s.num_heads // t, num_kv_heads=s.num_kv_heads // t,
            intermediate_size=s.intermediate_size // t, moe_intermediate_size=s.moe_intermediate_size // t)

    # ------------------------------------------------------------------ which slice of each tensor
    def tp_pieces(self, name: str, tp_rank: int | None = None) -> Pieces:
        """The part of HF tensor `name` that TP rank `tp_rank` (default: this one) holds; None: all of it."""
        r = self.tp.rank if tp_rank is None else tp_rank
        s, t = self.full_shape, self.tp.size
        if name in VOCAB_NAMES:
            rows = math.ceil(s.vocab_size / t)
            return 0, [(min(s.vocab_size, r * rows), min(s.vocab_size, (r + 1) * rows))]
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            return None
        rest = match.group(2)
        q, kv, D = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.head_dim

        def part(offset: int, total: int) -> tuple[int, int]:
            return offset + r * total // t, offset + (r + 1) * total // t

        heads_q, heads_kv = part(0, s.num_heads), part(0, s.num_kv_heads)
        q_range, kv_range = (heads_q[0] * D, heads_q[1] * D), (heads_kv[0] * D, heads_kv[1] * D)
        mi = s.moe_intermediate_size
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused [E, 2I, H] / [E, H, I]
            return (1, [part(0, mi), part(mi, mi)]) if rest.endswith("gate_up_proj") else (2, [part(0, mi)])
        expert = _EXPERT_NAME.fullmatch(rest)
        if expert is not None:
            return (1, [part(0, mi)]) if expert.group(2) == "down_proj" else (0, [part(0, mi)])
        module, _, kind = rest.rpartition(".")
        if module not in self.spec.projections:
            return None  # norms, the router
        fused, which = self.spec.projections[module]
        inter = s.intermediate_size
        if fused == "qkv":
            ranges = {"q": [q_range], "k": [kv_range], "v": [kv_range],
                      None: [q_range, (q + kv_range[0], q + kv_range[1]), (q + kv + kv_range[0], q + kv + kv_range[1])]}
            return 0, ranges[which]
        if fused == "gate_up":
            return 0, [part(0, inter)] if which in ("gate", "up") else [part(0, inter), part(inter, inter)]
        if kind == "bias":
            return None  # o_proj / down_proj bias: whole, held by TP rank 0 (load_slice)
        return 1, [q_range] if fused == "o" else [part(0, inter)]

    @staticmethod
    def take(tensor: torch.Tensor, pieces: Pieces) -> torch.Tensor:
        """The slice `pieces` of a full tensor."""
        if pieces is None:
            return tensor
        dim, ranges = pieces
        parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    # ------------------------------------------------------------------ loading
    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """A full HF tensor (checkpoint, or a full gather): keep this rank's slice."""
        return self.load_slice(name, self.take(tensor, self.tp_pieces(name)))

    def load_slice(self, name: str, part: torch.Tensor) -> bool:
        """This rank's slice of HF tensor `name` (what tp_pieces names)."""
        if name in VOCAB_NAMES and part.shape[0] < self.vocab_rows:  # the last slice: zero rows past the vocabulary
            part = torch.cat([part, part.new_zeros(self.vocab_rows - part.shape[0], *part.shape[1:])])
        match = _LAYER_NAME.fullmatch(name)
        module, _, kind = match.group(2).rpartition(".") if match else ("", "", "")
        row_parallel = self.spec.projections.get(module, ("", None))[0] in ("o", "down")
        if kind == "bias" and row_parallel and self.tp.rank != 0:
            part = torch.zeros_like(part)  # summed by the all-reduce: the bias counts once
        return super().load(name, part)

    # ------------------------------------------------------------------ the collectives
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(x)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_stop - self.vocab_start)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self._all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def _linear(self, li: int, name: str, x: torch.Tensor) -> torch.Tensor:
        out = super()._linear(li, name, x)
        return self._all_reduce(out) if name in ("o", "down") else out

    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        out = super()._mlp(li, x)  # dense layers reduced in _linear("down") already
        return self._all_reduce(out) if self.shape.layers[li].moe else out

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V]: this rank's vocabulary slice of the output head, all-gathered."""
        h = self._rms(h, self.norm)
        if self.prepacked:
            local = self.packed_linear(-1, "lm_head", h).float()
        else:
            local = F.linear(h, self.lm_head).float()
        logits = torch.cat(self.collectives.all_gather(local), dim=-1)[..., : self.full_shape.vocab_size]
        cap = self.shape.final_softcap
        if cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits


def same_tokens(tokens: torch.Tensor, collectives: TPCollectives | None) -> torch.Tensor:
    """The sampled tokens [rows] of TP rank 0 on every rank of the group (identity without TP)."""
    if collectives is None or collectives.tp.size == 1:
        return tokens
    return collectives.from_first_rank(tokens)
