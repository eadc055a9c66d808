"""DAPO's dynamic sampling: fill one training step with groups whose responses do not all score the same.

A group whose n responses share one value of ``algorithm.filter_groups.metric`` gets advantage 0 for every response
under the group-normalised estimators, so it carries no policy gradient. With ``algorithm.filter_groups.enable`` the
driver generates ``data.gen_batch_size`` prompts at a time (veRL's key; default ``data.train_batch_size``), drops
such groups, and generates again from fresh prompts until ``data.train_batch_size`` groups are kept or
``max_num_gen_batches`` generation batches were made (0: no limit). The step then trains on exactly
``train_batch_size * n`` rows; when the budget ran out first, the shortfall is made up with filtered groups (in
generation order), counted in ``dapo/topped_up_groups`` and warned about, instead of veRL's error that ends the run.

Every row keeps its group (``uid``) and its own scores: the filter works on whole groups, and because a group's n
rows are contiguous (the prompts are repeated interleaved), every cut below falls on a group boundary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import filter_groups
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


def gen_batch_size(cfg: Any) -> int:
    """Prompts per generation batch: data.gen_batch_size, or data.train_batch_size when unset."""
    d = cfg.data
    return d.train_batch_size if d.gen_batch_size is None else d.gen_batch_size


def dynamic_sampling_errors(cfg: Any) -> list[str]:
    """data.gen_batch_size against the step's size and the filter's budget (validated before any worker starts)."""
    d, fg = cfg.data, cfg.algorithm.filter_groups
    if d.gen_batch_size is None:
        return []
    gen, train = d.gen_batch_size, d.train_batch_size
    if gen < 1:
        return [f"data.gen_batch_size={gen} must be >= 1 (prompts per generation batch), or unset it"]
    if not fg.enable and gen != train:
        return [
            f"data.gen_batch_size={gen} differs from data.train_batch_size={train}: a generation batch of another "
            "size than the step is only read by DAPO's dynamic sampling (algorithm.filter_groups.enable=true), which "
            "fills a step from several filtered generation batches; enable it, or drop data.gen_batch_size"
        ]
    if fg.enable and fg.max_num_gen_batches > 0 and gen * fg.max_num_gen_batches < train:
        return [
            f"data.gen_batch_size={gen} x algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} "
            f"prompts can never fill data.train_batch_size={train} groups; raise one of the two (or set "
            "max_num_gen_batches=0 for no limit)"
        ]
    return []


def fill_step_with_informative_groups(
    first_prompts: DataProto,
    next_prompts: Callable[[], DataProto],
    generate_and_score: Callable[[DataProto, int], DataProto],
    filter_values: Callable[[DataProto], np.ndarray],
    *,
    groups_needed: int,
    n: int,
    max_gen_batches: int,
) -> tuple[DataProto, dict[str, float]]:
    """Generate (and score) batches until `groups_needed` groups of `n` rows have non-identical filter values.

    generate_and_score(prompts, attempt) -> the scored batch of ``len(prompts) * n`` rows with ``uid`` per row;
    filter_values(batch) -> [rows] the values compared within a group. Returns (the step's batch of exactly
    ``groups_needed * n`` rows, the ``dapo/*`` counters of this step).
    """
    kept: list[DataProto] = []
    dropped: list[DataProto] = []
    kept_groups = dropped_groups = attempts = 0
    prompts = first_prompts
    while True:
        if attempts:
            prompts = next_prompts()
        batch = generate_and_score(prompts, attempts)
        attempts += 1
        keep = filter_groups(batch.non_tensor_batch["uid"], filter_values(batch))
        kept.append(batch[keep])
        dropped.append(batch[~keep])
        kept_groups += int(keep.sum()) // n
        dropped_groups += int((~keep).sum()) // n
        if kept_groups >= groups_needed or (max_gen_batches and attempts >= max_gen_batches):
            break
    target = groups_needed * n
    parts = [b for b in kept if len(b)]
    topped_up = max(groups_needed - kept_groups, 0)
    if topped_up:
        logger.warning(
            "dynamic sampling: %d of %d groups had non-identical rewards after %d generation batches "
            "(algorithm.filter_groups.max_num_gen_batches); training on %d filtered groups as well (their advantages "
            "are 0). Raise max_num_gen_batches or data.gen_batch_size if this happens often.",
            kept_groups, groups_needed, attempts, topped_up,
        )
        parts += [b for b in dropped if len(b)]
    merged = parts[0] if len(parts) == 1 else DataProto.concat(left_pad_to_common_prompt_width(parts))
    if len(merged) < target:  # config validation makes the budget large enough; this guards hand-made configs
        raise RuntimeError(
            f"dynamic sampling produced {len(merged)} rows for a step of {target} "
            f"({attempts} generation batches); raise data.gen_batch_size or algorithm.filter_groups.max_num_gen_batches"
        )
    generated = kept_groups + dropped_groups
    metrics = {
        "dapo/num_gen_batches": float(attempts),
        "dapo/generated_groups": float(generated),
        "dapo/kept_groups": float(kept_groups),
        "dapo/dropped_groups": float(dropped_groups),
        "dapo/kept_group_fraction": kept_groups / max(generated, 1),
        "dapo/topped_up_groups": float(topped_up),
    }
    return merged[:target], metrics


# columns laid out [prompt | response]: a generation batch is left-padded to its own longest prompt
_PROMPT_SIDE = ("prompts", "input_ids", "attention_mask", "position_ids")


def left_pad_to_common_prompt_width(batches: list[DataProto]) -> list[DataProto]:
    """Batches from different loader batches, their prompt columns left-padded to the widest prompt among them.

    ``prompts`` is [B, P] and input_ids / attention_mask / position_ids are [B, P + R]; R (the responses) is the same
    in every batch. The new columns are masked out (attention_mask 0, position 0), so no model pass sees them.
    """
    if not all("prompts" in b.batch for b in batches):
        return batches
    width = max(b.batch["prompts"].shape[1] for b in batches)
    out = []
    for b in batches:
        extra = width - b.batch["prompts"].shape[1]
        if extra:
            b = b.select()  # new column dicts: the caller's batch keeps its own tensors
            ids, mask = b.batch["input_ids"], b.batch["attention_mask"]
            pad_id = int(ids[mask == 0][0]) if bool((mask == 0).any()) else 0  # the batch's own padding token
            for key in _PROMPT_SIDE:
                if key in b.batch:
                    col = b.batch[key]
                    value = pad_id if key in ("prompts", "input_ids") else 0
                    b.batch[key] = torch.cat([col.new_full((col.shape[0], extra), value), col], dim=1)
        out.append(b)
    return out
