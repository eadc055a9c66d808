"""Packed rows that share a prompt computed once: a GRPO micro-batch's n samples of one prompt in one group.

Why: GRPO, RLOO and their relatives draw n responses per prompt, and every training and log-prob pass over a
micro-batch computes the prompt's hidden states n times over, with the same result each time (the same tokens at
the same positions under causal attention). Here the packed row holds each distinct prompt once, followed by the
responses of every row that has that prompt:

    [ prompt A | response A1 | response A2 | ... | prompt B | response B1 | ... ]

and attention keeps the rows apart: a prompt attends causally to itself, a response to its prompt and causally to
itself, never to a sibling response. A response's first token is predicted from its prompt's last hidden state, and
the prompt's hidden states get the gradients of all the rows that read them (autograd sums them). The result is the
unshared computation up to float rounding (tests/engines/test_shared_prompts.py: log-probs, entropy, values and
gradients to 1e-5 in fp32); the tokens computed drop by (n - 1) prompts per group.

Attention takes one of two forms per group (only attention: the projections and MLPs still see each prompt token
once). Where the prompt is no longer than the longest response (RL's usual case) or the row is alone, each row
attends causally over ``[prompt; own response]``, padded to the group's longest response: the prompt's scores are
computed once per row, no mask is needed (padding comes last, so causality hides it), and groups of one padded
length go through one batched call. Where the prompt is longer, the group is two calls: the prompt's causal
self-attention, and its responses as a batch [n, heads, longest response, D] against keys [prompt; own response]
under a boolean mask (lower-right causal, and the padding of a shorter response masked; a padded query still sees
the prompt, so no softmax row is empty). Padded queries' outputs are dropped and get no gradient. One gather per
q/k/v takes every call's operands, one index puts every output back in packed order. The masked form's masks live
as long as the micro-batch's forward and backward, so their size is bounded (MASK_BUDGET): past it, a group's rows
keep a copy of the prompt each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from hybridflow.engines import cpu_flash_attention
from hybridflow.engines.causal_attention import causal_attention
from hybridflow.engines.micro_batch import real_token_spans

__all__ = ["SharedPrompts", "shared_layout", "shared_prompt_attention"]


@dataclass
class SharedPrompts:
    """The groups of one packed row: per group ``(prompt_start, prompt_len, [(response_start, response_len), ...])``,
    positions in the packed row ``[1, T]``. Index tensors for the attention are built on first use and kept (every
    layer reads the same)."""

    groups: list[tuple[int, int, list[tuple[int, int]]]]
    tokens: int
    _plan: dict = field(default_factory=dict, repr=False)

    def flash_layout(self):
        """cpu_flash_attention's layout of these groups (None where they do not cover the row), built once."""
        if "flash" not in self._plan:
            self._plan["flash"] = cpu_flash_attention.shared_layout(self.groups, self.tokens)
        return self._plan["flash"]

    def plan(self, device: torch.device) -> dict:
        if device not in self._plan:
            self._plan[device] = _plan(self, device)
        return self._plan[device]


def shared_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                  response_length: int) -> dict | None:
    """The packed layout of padded rows ``[b, P+R]`` (rollout layout: left-padded prompts, right-padded responses)
    with rows of identical prompts (token ids and positions) grouped, or None when no two rows share a prompt or a
    row has no prompt token. Returns ``input_ids`` / ``position_ids [1, T]``, per row ``prompt_last [b]`` (the packed
    position of its prompt's last token) and ``response_start [b]`` (of its first response token), ``cu_seq_lens``
    (the groups' bounds, int32), ``max_length`` and ``shared`` (SharedPrompts)."""
    b, seq = input_ids.shape
    prompt_len = seq - response_length
    starts, ends = (t.numpy(force=True) for t in real_token_spans(attention_mask))
    if prompt_len < 1 or bool((starts >= prompt_len).any()):
        return None
    # Index arithmetic on [b] vectors in numpy: a few dozen torch ops on tensors this small cost ~10 us each in
    # dispatch alone, and this runs once a micro-batch.
    # rows of one prompt: the same left-padded ids, mask and positions over the prompt columns
    prompts = np.concatenate([np.where(attention_mask[:, :prompt_len].numpy(force=True) == 0, -1,
                                       input_ids[:, :prompt_len].numpy(force=True)),
                              position_ids[:, :prompt_len].numpy(force=True)], axis=1).astype(np.int64)
    first_of: dict[bytes, int] = {}
    group_of = np.array([first_of.setdefault(row.tobytes(), i) for i, row in enumerate(prompts)], dtype=np.int64)
    resp_lens = np.clip(ends - prompt_len, 0, response_length)
    group_of = _within_mask_budget(group_of, prompt_len - starts, resp_lens)
    if len(np.unique(group_of)) == b:
        return None
    # groups in the order of their first row, rows of a group in their order (group_of holds each group's first
    # row, or a fresh id past b for a row split off its group, which then is its own first row)
    first_row = np.where(group_of < b, group_of, np.arange(b))
    rank = np.argsort(first_row * b + np.arange(b))  # rows sorted by (group's first row, row)
    ordered_groups = first_row[rank]
    leaders = np.ones(b, dtype=bool)
    leaders[1:] = ordered_groups[1:] != ordered_groups[:-1]
    prompt_lens = (prompt_len - starts)[rank]
    # packed length of each row in group order: its response, plus its group's prompt when it leads the group
    lead_prompt_lens = np.where(leaders, prompt_lens, 0)
    span = resp_lens[rank] + lead_prompt_lens
    offset = np.cumsum(span) - span
    group_start = np.maximum.accumulate(np.where(leaders, offset, 0))  # the leader's offset, carried forward
    resp_start_sorted = offset + lead_prompt_lens
    resp_start, prompt_last = np.empty(b, dtype=np.int64), np.empty(b, dtype=np.int64)
    resp_start[rank] = resp_start_sorted
    prompt_last[rank] = group_start + prompt_lens - 1
    # the source of every packed token in the flattened [b, seq] input: leaders' prompts, then each row's response
    src_row = np.repeat(rank, span)
    within = np.arange(int(span.sum())) - np.repeat(offset, span)
    lead_prompt = np.repeat(lead_prompt_lens, span)
    col = np.where(within < lead_prompt, starts[src_row] + within, prompt_len + within - lead_prompt)
    index = torch.from_numpy(src_row * seq + col).to(input_ids.device)
    groups, bounds = [], [0]
    lead_at = [*np.flatnonzero(leaders).tolist(), b]
    starts_l, plens_l, rs_l, rl_l = (group_start.tolist(), prompt_lens.tolist(), resp_start_sorted.tolist(),
                                     resp_lens[rank].tolist())
    for lo, hi in itertools.pairwise(lead_at):
        groups.append((starts_l[lo], plens_l[lo], [(rs_l[i], rl_l[i]) for i in range(lo, hi)]))
        bounds.append(starts_l[lo] + plens_l[lo] + sum(rl_l[lo:hi]))
    return {
        "input_ids": input_ids.reshape(-1)[index][None, :],
        "position_ids": position_ids.reshape(-1)[index][None, :],
        "prompt_last": torch.from_numpy(prompt_last).to(input_ids.device),
        "response_start": torch.from_numpy(resp_start).to(input_ids.device),
        "cu_seq_lens": torch.tensor(bounds, dtype=torch.int32, device=input_ids.device),
        "max_length": max(hi - lo for lo, hi in itertools.pairwise(bounds)),
        "shared": SharedPrompts(groups=groups, tokens=bounds[-1]),
    }


# The response call of a masked-form group of n rows masks [n, longest response, prompt + longest response]
# query-key pairs (one boolean each, kept for the whole forward and backward of the micro-batch). Groups are shared
# while the micro-batch's masks stay within this many elements; the rows of a group past it keep their own copy of
# the prompt (one causal call each, no mask), so long responses cost no large mask.
MASK_BUDGET = 1 << 26


def _within_mask_budget(group_of: np.ndarray, prompt_lens: np.ndarray, resp_lens: np.ndarray) -> np.ndarray:
    """`group_of` [b] (numpy) with the masked-form groups whose masks would pass MASK_BUDGET (in order of their first
    row) split into single rows, each under a fresh id (b and up)."""
    group_of = group_of.copy()
    used, next_id = 0, len(group_of)
    for group in dict.fromkeys(group_of.tolist()):  # in order of their first row
        rows = np.flatnonzero(group_of == group)
        if len(rows) < 2:
            continue
        lengths = resp_lens[rows]
        longest = int(lengths.max())
        prompt = int(prompt_lens[rows[0]])
        if longest == 0 or _repeat_form(prompt, len(rows), longest):
            continue  # no mask
        size = (1 if bool((lengths == longest).all()) else len(rows)) * longest * (prompt + longest)
        if used + size <= MASK_BUDGET:
            used += size
            continue
        group_of[rows[1:]] = np.arange(next_id, next_id + len(rows) - 1)
        next_id += len(rows) - 1
    return group_of


def _repeat_form(prompt_len: int, rows: int, longest: int) -> bool:
    """Whether a group's rows attend as whole sequences ``[prompt; own response]`` (the prompt's attention computed
    once per row, causal, no mask) rather than as a prompt call plus a masked response call: for a lone row, and
    where the prompt is no longer than the longest response. The repeated prompt queries cost ``n * (p + r)^2 / 2``
    scores against ``p^2 / 2 + n * r * (p + r)`` for the masked form (which computes its whole rectangle): the repeat
    form costs no more whenever ``p <= r`` (and stays cheaper while ``n * (p^2 - r^2) <= p^2``, a little past it for
    small n; the rule keeps the simple bound), and it needs no mask and no key concatenation."""
    return rows == 1 or prompt_len <= longest


def _plan(shared: SharedPrompts, device: torch.device) -> dict:
    """The attention calls of a packed row of groups, as gather indices into it and an index back.

    Each call is ``(b, query length, key length, mask)``: a repeat-form group's rows are sequences of their prompt
    and their response padded to the group's longest (batched with every other group of the same padded length,
    causal); a masked-form group is its prompt's causal call and its responses' call against ``[prompt; own
    response]`` keys under a boolean mask [n (1 when all are equal), 1, longest, prompt + longest]. ``q_index`` and
    ``kv_index`` gather the calls' queries and keys from the packed row, in call order; ``slot`` picks each packed
    position's output from the concatenated outputs (a prompt's from its group's first row). Padding slots read the
    prompt's last token: under the causal mask no real query sees them, their outputs are dropped, and they get no
    gradient."""
    q_index, kv_index, out_order, calls = [], [], [], []
    by_length: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # repeat form: padded length -> (seqs, outs)
    for start, plen, responses in shared.groups:
        n = len(responses)
        lengths = torch.tensor([r for _, r in responses])
        longest = int(lengths.max())
        cols = torch.arange(longest)
        firsts = torch.tensor([s for s, _ in responses])
        valid = cols[None, :] < lengths[:, None]  # [n, longest]
        prompt = torch.arange(start, start + plen)
        resp = torch.where(valid, firsts[:, None] + cols, start + plen - 1)
        kept = torch.where(valid, firsts[:, None] + cols, -1)
        if longest == 0:  # no response token in the group: its prompt alone
            by_length.setdefault(plen, []).append((prompt[None], prompt[None]))
        elif _repeat_form(plen, n, longest):
            seqs = torch.cat((prompt.expand(n, plen), resp), dim=1)
            prompt_out = torch.cat((prompt[None], torch.full((n - 1, plen), -1, dtype=torch.long)))
            by_length.setdefault(plen + longest, []).append((seqs, torch.cat((prompt_out, kept), dim=1)))
        else:
            q_index += [prompt, resp.reshape(-1)]
            kv_index += [prompt, torch.cat((prompt.expand(n, plen), resp), dim=1).reshape(-1)]
            out_order += [prompt, kept.reshape(-1)]
            # a response query sees the prompt and its own response causally (lower-right causal over [prompt;
            # response]), and none of the padding keys of a shorter response
            own = torch.arange(plen + longest)[None, None, :] - plen  # a key's index in the response; < 0: the prompt
            mask = (own < 0) | ((own <= cols[None, :, None]) & (own < lengths[:, None, None]))
            if bool(valid.all()):
                mask = mask[:1]  # the same for every response
            calls += [(1, plen, plen, None), (n, longest, plen + longest, mask[:, None].to(device))]
    for length, items in by_length.items():
        seqs, outs = torch.cat([s for s, _ in items]), torch.cat([o for _, o in items])
        q_index.append(seqs.reshape(-1))
        kv_index.append(seqs.reshape(-1))
        out_order.append(outs.reshape(-1))
        calls.append((seqs.shape[0], length, length, None))
    order = torch.cat(out_order)
    slot = torch.empty(shared.tokens, dtype=torch.long)
    kept = order >= 0
    slot[order[kept]] = torch.arange(order.numel())[kept]
    return {"q_index": torch.cat(q_index).to(device), "kv_index": torch.cat(kv_index).to(device), "calls": calls,
            "q_sizes": [b * sq for b, sq, _, _ in calls], "kv_sizes": [b * skv for b, _, skv, _ in calls],
            "slot": slot.to(device)}


def shared_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrompts,
                            dropout: float, scaling: float | None, groups: int) -> torch.Tensor:
    """Attention of a packed row of shared-prompt groups: ``query [1, H, T, D]``, ``key/value [1, Hkv, T, D]`` ->
    ``[1, T, H, D]`` (see the module docstring). Tokens are gathered whole ([T, heads, D] rows), so each call's
    operands are views [b, heads, length, D] of one gather, and one index puts the outputs back in packed order."""
    plan = shared.plan(query.device)
    heads, dim = query.shape[1], query.shape[3]
    q = query[0].transpose(0, 1).index_select(0, plan["q_index"])  # [Nq, heads, D]
    k, v = (t[0].transpose(0, 1).index_select(0, plan["kv_index"]) for t in (key, value))
    outs = []
    for (b, sq, skv, mask), rq, rk, rv in zip(plan["calls"], q.split(plan["q_sizes"]), k.split(plan["kv_sizes"]),
                                              v.split(plan["kv_sizes"])):
        rq = rq.view(b, sq, heads, dim).transpose(1, 2)
        rk, rv = (t.view(b, skv, -1, dim).transpose(1, 2) for t in (rk, rv))
        if mask is None:
            out = causal_attention(rq, rk, rv, dropout, scaling, groups > 1)
        else:
            out = F.scaled_dot_product_attention(rq, rk, rv, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 enable_gqa=groups > 1)
        outs.append(out.transpose(1, 2).reshape(b * sq, heads, dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, plan["slot"])[None]
