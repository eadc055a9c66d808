"""Reduce a per-token loss matrix [B, T] to the scalar that is back-propagated.

Why global counts: a PPO mini-batch is split into micro-batches (gradient accumulation) and over data-parallel ranks.
If each micro-batch divided by its *own* token count, a short micro-batch would weigh as much as a long one and the
gradient would depend on the split. So the caller passes the counts of the WHOLE mini-batch and each call returns
only this micro-batch's share: summing the returned values over all micro-batches and all ranks gives exactly the
mini-batch loss, whatever the split. (With DDP/FSDP, which average gradients over ranks, multiply by the DP world size
before backward to turn that average back into the sum.)

Modes, with M the 0/1 loss mask, L the loss matrix, N_tok / N_seq the mini-batch's valid tokens / rows:
  token-mean               sum_{i,t} M L / N_tok                          every token weighs the same (DAPO)
  seq-mean-token-sum       sum_i (sum_t M L) / N_seq                      sum over tokens, mean over sequences
  seq-mean-token-mean      sum_i (sum_t M L / sum_t M) / N_seq            mean over tokens, then over sequences (GRPO)
  seq-mean-token-sum-norm  sum_i (sum_t M L / norm_length) / N_seq        constant length norm (Dr. GRPO, Liu et al. 2025)
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def count_tokens_and_seqs(loss_mask: torch.Tensor) -> tuple[float, float]:
    """(number of valid tokens, number of sequences = rows) of a mask [B, T]; rows without valid tokens count too.

    Sum these over every micro-batch and DP rank of a mini-batch to get `global_num_tokens` / `global_num_seqs`.
    """
    return float(loss_mask.bool().sum().item()), float(loss_mask.shape[0])


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss -> [].

    loss_mat, loss_mask: [B, T]. global_num_tokens: valid tokens in the whole mini-batch (all micro-batches, all
    ranks); global_num_seqs: sequences (rows) in the whole mini-batch (see `count_tokens_and_seqs`).
    Either left None means "this batch is the whole mini-batch" and its own count is used (a plain mean).
    norm_length: the constant divisor of seq-mean-token-sum-norm (default T, the padded response length).
    """
    if loss_mat.dim() != 2:
        raise ValueError(f"agg_loss expects a loss matrix [batch, response_len], got shape {tuple(loss_mat.shape)}")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        num_tokens = global_num_tokens if global_num_tokens is not None else mask.sum().item()
        return masked_sum(loss_mat, mask) / max(float(num_tokens), 1.0)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss_agg_mode {loss_agg_mode!r}; known: {', '.join(LOSS_AGG_MODES)}. Fix it in the actor/critic config"
        )

    num_seqs = global_num_seqs if global_num_seqs is not None else loss_mat.shape[0]
    token_sums = masked_sum(loss_mat, mask, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        # A row without valid tokens has token_sum 0; clamping its length to 1 keeps it at 0 instead of NaN.
        seq_losses = token_sums / mask.sum(dim=-1).clamp_min(1.0)
    else:  # seq-mean-token-sum-norm
        length = float(norm_length) if norm_length is not None else float(loss_mat.shape[-1])
        if length <= 0:
            raise ValueError(f"norm_length must be > 0 for seq-mean-token-sum-norm, got {norm_length}")
        seq_losses = token_sums / length
    return seq_losses.sum() / max(float(num_seqs), 1.0)
