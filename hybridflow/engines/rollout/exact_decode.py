"""The native rollout's batch-invariant steps: prefill and decode whose fp32 rounding is the training engine's.

Used instead of the eager steps (native_rollout._EagerSteps) when ``actor_rollout_ref.model.batch_invariant=true``.
Three things differ from them, each for the reason given in engines/batch_invariant.py:

* the cache is left-aligned: a row's prompt tokens sit at columns 0..len-1 and its generated tokens follow, as the
  training engine strips a row to its real tokens, so key j is column j on both sides;
* attention is `invariant_attention` in the prefill and in every step;
* every matmul sees a multiple of ROW_MULTIPLE rows: the prefill's columns are padded to one, and the decode
  batch carries up to ROW_MULTIPLE - 1 dummy rows (they attend to their own key 0 and are never read).

The projections are the decoder's own (native_model.py): the engine builds it with the training engine's
library (batch_invariant.onednn_matmuls: oneDNN-packed weights on a CPU that has oneDNN, F.linear elsewhere).

Sampling is the eager steps' (sampling.sample_tokens): its reported log-probs are the training engine's function of
the logits (hf_model.log_probs_from_logits), bit for bit, on the C path and on torch's.

The prompt K/V are copied to each of a prompt's n samples (no shared-prompt segment: a row's keys are one run of
columns, as in the training forward); this costs the cache memory n-fold, which is what fidelity costs here.
"""

from __future__ import annotations

import torch

from hybridflow.engines.batch_invariant import (
    KEY_MULTIPLE,
    ROW_MULTIPLE,
    causal_allowed,
    invariant_attention,
    pad_rows,
    round_up,
)
from hybridflow.engines.rollout.chunked_prefill import prefill_groups

__all__ = ["BatchInvariantSteps", "batch_invariant_refusal"]


def batch_invariant_refusal(model, *, decode: str, int8: bool, tensor_parallel: bool) -> str | None:
    """None, or why the native decoder cannot run batch-invariant steps with these settings."""
    if model.shape.moe:
        return ("routed experts see per-expert token counts that differ between the rollout and the training "
                "forward, so their matmuls round differently; use routing replay for MoE "
                "(actor_rollout_ref.actor.router_replay.mode=R3)")
    if int8:
        return "int8 weights are not the training engine's fp32 weights; use dtype=fp32"
    if tensor_parallel:
        return "a tensor-parallel rollout sums partial products across ranks; use tensor_model_parallel_size=1"
    if decode not in ("auto", "eager"):
        return f"decode={decode!r} runs fixed-shape steps; batch-invariant steps are eager (enforce_eager=true)"
    if model.dtype != torch.float32:
        return f"the rollout computes in {model.dtype}; the bit-for-bit guarantee is for fp32 (dtype=fp32)"
    return None


class BatchInvariantSteps:
    """Prefill at construction (``prefill_logits [rows, V]``), then ``decode(tokens [r], positions [r], step)`` ->
    fp32 logits [r, V] for the r running rows; ``maybe_drop_stopped`` compacts finished rows away."""

    def __init__(self, engine, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, n: int, max_new: int):
        model = self.model = engine.model
        s = model.shape
        B, P = ids.shape
        self.compact_fraction = engine.compact_fraction
        lens = mask.sum(-1)
        width = round_up(P, ROW_MULTIPLE)  # B * width prefill rows: a multiple of ROW_MULTIPLE
        cols = torch.arange(width, device=ids.device)
        src = ((P - lens)[:, None] + cols[None, :]).clamp(max=P - 1)  # left padding -> left-aligned
        real = cols[None, :] < lens[:, None]
        aligned_ids = torch.where(real, ids.gather(1, src), torch.zeros_like(src))
        aligned_pos = torch.where(real, pos.gather(1, src), torch.zeros_like(src))
        rows = B * n
        slots = round_up(rows, ROW_MULTIPLE)

        def alloc() -> list[torch.Tensor]:
            # a whole number of KEY_MULTIPLE columns: each step attends over a canonical length, no padding copy
            length = round_up(width + max_new, KEY_MULTIPLE)
            return [torch.zeros(slots, s.num_kv_heads, length, s.head_dim, dtype=model.dtype, device=ids.device)
                    for _ in range(s.num_layers)]

        self.keys, self.values = alloc(), alloc()
        logits = []
        for lo, hi in prefill_groups(B, width, engine.max_num_batched_tokens):
            logits.append(self._prefill(aligned_ids[lo:hi], aligned_pos[lo:hi], lens[lo:hi], lo, n))
        self.prefill_logits = torch.cat(logits).repeat_interleave(n, dim=0)
        # the column the next token of each running row is written to (= its number of keys so far)
        self.length = lens.repeat_interleave(n)

    def _prefill(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """Prompts ids, pos [b, width] (left-aligned) -> logits at their last real token [b, V]; their K/V go to
        slots first * n onwards, n copies each."""
        model, s = self.model, self.model.shape
        b, width = ids.shape
        allowed = {w: causal_allowed(width, width, ids.device, w)[None, None].expand(b, 1, width, width)
                   for w in s.windows}

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, width, D]
            self.keys[li][first * n : (first + b) * n, :, :width] = k.repeat_interleave(n, dim=0)
            self.values[li][first * n : (first + b) * n, :, :width] = v.repeat_interleave(n, dim=0)
            out = invariant_attention(q, k, v, allowed[s.layers[li].window], s.attention_scale, s.attn_softcap)
            return out.transpose(1, 2).reshape(b, width, model.q_size)

        hidden = model._layers(ids, pos, attend)
        last = hidden[torch.arange(b, device=ids.device), lens - 1]
        return model._logits(pad_rows(last))[:b]

    def maybe_drop_stopped(self, out, step: int) -> torch.Tensor | None:
        if not (out.n_done and out.n_done >= self.compact_fraction * out.running):
            return None
        keep = out.keep_running()
        # the kept rows first, then copies of the first as dummy rows up to a multiple of ROW_MULTIPLE
        slots = torch.cat((keep, keep[:1].expand(round_up(len(keep), ROW_MULTIPLE) - len(keep))))
        self.keys = [k.index_select(0, slots) for k in self.keys]
        self.values = [v.index_select(0, slots) for v in self.values]
        self.length = self.length[keep]
        return keep

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
        model, s = self.model, self.model.shape
        r, slots = tokens.shape[0], self.keys[0].shape[0]
        # the dummy rows (slots - r of them) feed token 0 at position 0 and write and read their column 0
        column, tokens, positions = (torch.cat((x, x.new_zeros(slots - r))) for x in (self.length, tokens, positions))
        L = round_up(int(column.max()) + 1, KEY_MULTIPLE)
        keys = torch.arange(L, device=tokens.device)[None, :]
        allowed = {}
        for window in s.windows:
            visible = keys <= column[:, None]
            if window is not None:
                visible = visible & (column[:, None] - keys < window)
            allowed[window] = visible[:, None, None, :]  # [slots, 1, 1, L]
        # row i's new K/V go to its own column: a scatter along the length axis (advanced-index assignment of the
        # same write measured 16x slower)
        where = column.view(slots, 1, 1, 1).expand(slots, s.num_kv_heads, 1, s.head_dim)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.keys[li].scatter_(2, where, k[:, :, None])
            self.values[li].scatter_(2, where, v[:, :, None])
            out = invariant_attention(q[:, :, None], self.keys[li][:, :, :L], self.values[li][:, :, :L],
                                      allowed[s.layers[li].window], s.attention_scale, s.attn_softcap)
            return out.reshape(slots, model.q_size)

        logits = model._logits(model._layers(tokens, positions, attend))[:r]
        self.length = self.length + 1
        return logits
