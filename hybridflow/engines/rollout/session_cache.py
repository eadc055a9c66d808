"""The running batch's KV cache for multi-turn sessions (sessions.py), and its two attention steps.

Layout: one tensor ``kv [layers, 2 (keys, values), rows, kv_heads, length, head_dim]``; row i holds one running turn's
keys/values left-aligned in columns ``[0, lengths[i])``, with no padding inside a row (a session's positions are
0, 1, 2, ... and equal its columns). Rows have different lengths; attention masks each row's columns past its own
length. Rows join at the end of the batch and leave by swap-remove, so the running rows are always ``[0, r)`` and
every step reads plain views of the buffer. The buffer grows by doubling when a row needs more rows or columns.

Two steps, both written into the decoder's one layer loop (``NativeDecoder._layers``, which stores K/V through the
``attend`` callback it is given):
  * ``extend``: a group of rows appends T new tokens each (a new prompt, or a turn's observation after its kept
    history): causal attention over the row's kept columns and the new ones;
  * ``decode``: every running row appends its one pending token.
The G query heads that share a KV head are grouped as in kv_cache.py; sliding windows and Gemma 2's soft-capping
follow NativeDecoder's prefill/decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engines.rollout.kv_cache import softcap_scores

__all__ = ["BatchCache"]

_COLUMN_QUANTUM = 64  # columns are allocated in multiples of this, so a growing turn rarely reallocates


class BatchCache:
    """K/V of the running rows; see the module docstring. ``model``: a NativeDecoder."""

    def __init__(self, model):
        s = model.shape
        self.model, self.shape = model, s
        self.layers, self.kv_heads, self.head_dim = s.num_layers, s.num_kv_heads, s.head_dim
        self.group = s.num_heads // s.num_kv_heads
        self.kv = torch.empty(self.layers, 2, 0, self.kv_heads, 0, self.head_dim, dtype=model.dtype,
                              device=model.device)

    @property
    def capacity(self) -> tuple[int, int]:
        return self.kv.shape[2], self.kv.shape[4]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def ensure(self, rows: int, length: int, used_rows: int, used_length: int) -> None:
        """Room for `rows` rows of `length` columns, keeping rows [0, used_rows) x columns [0, used_length)."""
        cap_rows, cap_len = self.capacity
        if rows <= cap_rows and length <= cap_len:
            return
        new_rows = max(rows, min(2 * cap_rows, rows + cap_rows)) if rows > cap_rows else cap_rows
        new_len = max(length, 2 * cap_len) if length > cap_len else cap_len
        new_len = -(-new_len // _COLUMN_QUANTUM) * _COLUMN_QUANTUM
        # zeros, not empty: masked columns are still multiplied by 0 in the attention, and 0 * NaN (garbage
        # memory) is NaN; every later write is a real K/V, so columns past a row's length stay finite
        grown = torch.zeros(self.layers, 2, new_rows, self.kv_heads, new_len, self.head_dim, dtype=self.kv.dtype,
                            device=self.kv.device)
        if used_rows and used_length:
            grown[:, :, :used_rows, :, :used_length] = self.kv[:, :, :used_rows, :, :used_length]
        self.kv = grown

    def release(self) -> None:
        """Drop the buffer (nothing running)."""
        self.kv = self.kv.new_empty(self.layers, 2, 0, self.kv_heads, 0, self.head_dim)

    def load(self, row: int, saved: torch.Tensor) -> None:
        """Put a parked session's K/V [layers, 2, kv_heads, n, head_dim] into columns [0, n) of `row`."""
        self.kv[:, :, row, :, : saved.shape[3]] = saved

    def save(self, row: int, length: int) -> torch.Tensor:
        """A copy of `row`'s first `length` columns, [layers, 2, kv_heads, length, head_dim]."""
        return self.kv[:, :, row, :, :length].clone()

    def move(self, src: int, dst: int, length: int) -> None:
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    # ------------------------------------------------------------------ attention steps
    def _allowed(self, query_columns: torch.Tensor, key_end: torch.Tensor, width: int, window: int | None):
        """Bool [..., width]: key column c is visible from query column q iff c <= q, c < the row's end, and (sliding
        layers) q - c < window. query_columns [...]; key_end broadcastable to it."""
        c = torch.arange(width, device=query_columns.device)
        q = query_columns[..., None]
        allowed = (c <= q) & (c < key_end[..., None])
        if window is not None:
            allowed &= q - c < window
        return allowed

    def extend(self, first_row: int, tokens: torch.Tensor, kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Append new tokens to rows [first_row, first_row + B) whose first `kept[b]` columns hold kept K/V.

        tokens [B, T] (right-padded past new[b]); kept, new [B] int64 (new >= 1). Writes the new tokens' K/V into
        columns [kept[b], kept[b] + new[b]) and returns fp32 logits at each row's last new token [B, V].
        """
        s, model = self.shape, self.model
        B, T = tokens.shape
        device = tokens.device
        steps = torch.arange(T, device=device)
        query_columns = kept[:, None] + steps[None]  # [B, T]; a session's positions are its columns
        end = kept + new
        width = int(end.max())
        valid = steps[None] < new[:, None]  # [B, T] real (not padding) query tokens
        b_idx, j_idx = valid.nonzero(as_tuple=True)
        rows, cols = first_row + b_idx, query_columns[b_idx, j_idx]
        masks = {w: self._allowed(query_columns, end[:, None], width, w)[:, None] for w in s.windows}  # [B,1,T,W]
        positions = query_columns.clamp(max=model.max_positions - 1)  # padding queries: any valid position

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.kv[li, 0], self.kv[li, 1]
            keys[rows, :, cols] = k[b_idx, j_idx]  # [N, kv, D]: only the real tokens are stored
            values[rows, :, cols] = v[b_idx, j_idx]
            span = slice(first_row, first_row + B)
            k_all = keys[span, :, :width].repeat_interleave(self.group, dim=1)  # [B, heads, width, D]
            v_all = values[span, :, :width].repeat_interleave(self.group, dim=1)
            q = q.transpose(1, 2)  # [B, heads, T, D]
            mask = masks[s.layers[li].window]
            if s.attn_softcap is None:
                out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=s.attention_scale)
            else:  # SDPA cannot soft-cap: the eager form, as NativeDecoder.prefill
                scores = softcap_scores(torch.matmul(q, k_all.transpose(-1, -2)) * s.attention_scale, s.attn_softcap)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
                out = torch.matmul(probs.to(q.dtype), v_all)
            return out.transpose(1, 2).reshape(B, T, model.q_size)

        hidden = model._layers(tokens, positions, attend)  # [B, T, hidden]
        return model._logits(hidden[torch.arange(B, device=device), new - 1])

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One step for rows [0, r): token [r] goes to column lengths[r] (its position). Returns fp32 logits [r, V]."""
        s, model = self.shape, self.model
        r, kv, G, D = tokens.shape[0], self.kv_heads, self.group, self.head_dim
        width = int(lengths.max()) + 1
        row_index = torch.arange(r, device=tokens.device)
        biases = {}
        for w in s.windows:
            allowed = self._allowed(lengths, lengths + 1, width, w)  # [r, width]
            bias = torch.zeros(r, width, dtype=model.dtype, device=tokens.device).masked_fill_(~allowed, float("-inf"))
            biases[w] = bias[:, None, :].expand(r, kv, width).reshape(r * kv, 1, width)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.kv[li, 0], self.kv[li, 1]
            keys[row_index, :, lengths] = k  # [r, kv, D]
            values[row_index, :, lengths] = v
            k_view = keys[:r, :, :width].reshape(r * kv, width, D).transpose(1, 2)  # a view, no copy
            bias = biases[s.layers[li].window]
            q = q.reshape(r * kv, G, D)
            if s.attn_softcap is None:
                scores = torch.baddbmm(bias, q, k_view, alpha=s.attention_scale)
            else:
                scores = softcap_scores(torch.bmm(q, k_view) * s.attention_scale, s.attn_softcap) + bias
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            return torch.bmm(probs, values[:r, :, :width].reshape(r * kv, width, D)).view(r, model.q_size)

        return model._logits(model._layers(tokens, lengths, attend))
