"""Token sampling for the native rollout: temperature, top-k, top-p, greedy, with per-row counter-based randomness.

Randomness. Each running row carries a 32-bit key derived from (seed, prompt row, sample index); the uniform number
used at decode step t is a hash of (key, t). A row's draws therefore depend only on its own key and step, never on
how many other rows are in the batch or when they finished, and there is no Python loop over rows or generators.

Sampling is inverse-CDF: draw u ~ U[0, 1), return the first token whose cumulative (filtered) probability exceeds
u * total. Reported log-probs are always log_softmax(logits / temperature) over the full vocabulary, gathered at the
chosen token (top-k / top-p restrict what can be drawn; they do not renormalise the reported number). They are
computed by the training engine's function (hf_model.log_probs_from_logits: on CPU its C path, elsewhere
``z[token] - logsumexp(z)``), not with ``torch.log_softmax``: on CPU its fp32 kernel is ~10x less exact over a large
vocabulary (up to 1.7e-5 from the fp64 value over SmolLM2's 49,152 tokens, against 2e-6), which alone made the
train-inference mismatch exceed 1e-5.
"""

from __future__ import annotations

import torch

from hybridflow.engines.hf_model import log_prob_kernel_applies, log_probs_from_logits
from hybridflow.engines.rollout import cpu_sampling

__all__ = ["NOT_A_DISTRIBUTION", "StepUniforms", "row_keys", "sample_tokens", "uniform_from_keys", "uniform_table"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer avalanche hash (xor-shift-multiply rounds) on int64 tensors holding values in [0, 2^32).

    int64 multiplication wraps on overflow, and the low 32 bits of a wrapped product are the true ones, so masking
    after each multiply gives exact uint32 arithmetic.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seed: int, prompt_index: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """Per-row random keys [rows] (int64 in [0, 2^32)) from a seed and each row's (prompt, sample) indices [rows]."""
    base = _mix32(torch.full_like(prompt_index, int(seed) & _MASK32) ^ 0x9E3779B9)
    h = _mix32(base ^ ((int(seed) >> 32) & _MASK32))
    h = _mix32(h ^ prompt_index.long())
    return _mix32(h ^ (sample_index.long() * 0x85EBCA6B & _MASK32))


def uniform_from_keys(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """U[0, 1) as float64 [rows] for decode step `step` (one int, or each row's own [rows]: continuous batching),
    53 random bits from two hash draws per row."""
    steps = torch.full_like(keys, step) if isinstance(step, int) else step.to(keys.dtype)
    h = _mix32(keys ^ _mix32(steps))
    hi = _mix32(h ^ 0x68E31DA4) >> 5  # 27 bits
    lo = _mix32(h ^ 0xB5297A4D) >> 6  # 26 bits
    return (hi.double() * 67108864.0 + lo.double()) / 9007199254740992.0


class StepUniforms:
    """The draws of a decode loop's running rows, step by step: ``at(step)`` is ``uniform_from_keys(keys, step)``,
    hashed `chunk` steps at a time (uniform_table: at 16 rows the per-step hashing was half of a tiny model's
    sampling time); ``keep(index)`` follows the rows when stopped ones are dropped."""

    def __init__(self, keys: torch.Tensor, steps: int, chunk: int = 64):
        self.keys, self.steps, self.chunk = keys, steps, chunk
        self.first, self.table = 0, None  # table: [steps, rows], so that a step's draws are one contiguous row

    def at(self, step: int) -> torch.Tensor:
        if self.table is None or not self.first <= step < self.first + self.table.shape[0]:
            chunk = uniform_table(self.keys, step, max(1, min(self.chunk, self.steps - step)))
            self.first, self.table = step, chunk.t().contiguous()
        return self.table[step - self.first]

    def block(self, step: int) -> tuple[torch.Tensor, int]:
        """The draws of steps `step`, `step` + 1, ... as one contiguous [steps, rows] table, and the step after its
        last (a C decode loop reads them in place: cpu_decode_layer.py)."""
        self.at(step)
        return self.table[step - self.first :], self.first + self.table.shape[0]

    def keep(self, index: torch.Tensor) -> None:
        self.keys = self.keys[index]
        if self.table is not None:
            self.table = self.table[:, index].contiguous()


# Rows are sampled in chunks of about this many logits, so that a chunk's probabilities and fp64 cumulative sums stay
# in cache: at 64 rows of Qwen3's 151,936 tokens, one pass over all rows took 3.5x as long as chunks of 6 rows.
_CHUNK_ELEMENTS = 1 << 20

# A top-p draw first sorts this many candidates (a `topk`), not the whole vocabulary: a stable sort of Qwen3's
# 151,936 tokens took 0.5 s a step at 64 rows.
_CANDIDATES = 1024


NOT_A_DISTRIBUTION = ("sampling: a row of the model's logits holds a NaN or +inf, or only -inf, so it is no distribution "
                       "to sample from; the weights have likely diverged (check the actor's grad_norm and learning "
                       "rate in the run's metrics, and resume from the last good checkpoint)")


def _filters(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether top-k or top-p restricts what can be drawn from a vocabulary of `vocab` tokens."""
    return 0 < top_k < vocab or top_p < 1.0


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [rows] of the first position whose cumulative probability exceeds u * total; never a zero-prob one.

    probs [rows, n] (fp32 or fp64) is summed in fp64: the cumulative sum converts as it goes, the same bits as
    ``probs.double().cumsum(-1)`` without an fp64 copy of [rows, n].
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    idx = torch.searchsorted(cdf, u.unsqueeze(-1) * total, right=True)
    # a guard for u * total >= total (u < 1 keeps it below in IEEE arithmetic): the first position where the cdf
    # reaches the total, which has a positive probability since it raised the cdf. A search, not a pass over the
    # vocabulary: a cumulative count of the positive tokens took 7 ms a step at 16 rows of SmolLM2's 49,152.
    reach = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(idx, reach).squeeze(-1)


def _stable_top(probs: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` positions of ``probs.sort(descending=True, stable=True)`` as (values, indices) [rows, width],
    except that where values tie across the cut, the tied ones at the end may be other indices of the same value.
    ``topk`` picks the candidates (it leaves the order of equal values open); sorting them by index and then stably
    by value gives equal values in index order, as the stable sort of the whole row does."""
    if width >= probs.shape[-1]:
        return probs.sort(dim=-1, descending=True, stable=True)
    values, indices = probs.topk(width, dim=-1)
    indices, by_index = indices.sort(dim=-1)
    values, by_value = values.gather(-1, by_index).sort(dim=-1, descending=True, stable=True)
    return values, indices.gather(-1, by_value)


def _draw_filtered(
    probs: torch.Tensor, u: torch.Tensor, top_k: int, top_p: float, first_width: int = 0
) -> torch.Tensor:
    """Tokens [rows] drawn by inverse CDF from probs [rows, V] restricted to the top-k, then to the smallest prefix of
    those (descending, equal values in index order) whose mass reaches top_p of the total (the first token is
    always kept). The total is the top-k's sum when top-k filters, else the whole row's, summed in vocabulary order.

    These are the tokens of filtering the stably sorted whole row, which only the last resort sorts: the first try
    sorts top_k + 1 candidates when top-k filters, else `first_width` (default 1024), and a row is redrawn with 8x
    as many (then the whole row) when a kept, drawable token has the candidates' smallest value, since values equal
    to it may lie outside them. Rows of up to 4,096 tokens, or with candidates past a quarter of them, are sorted
    whole at once.
    """
    rows, vocab = probs.shape
    top_k = top_k if 0 < top_k < vocab else vocab
    total = probs.sum(-1, keepdim=True, dtype=torch.float64) if top_p < 1.0 and top_k == vocab else None
    width = top_k + 1 if top_k < vocab else first_width or _CANDIDATES  # the top-k's mass needs all k of them
    tokens, todo = None, None  # todo: the rows left to draw (None: all of them)
    while True:
        full = width * 4 > vocab or vocab <= 4 * _CANDIDATES  # the whole row is sorted: every row is exact
        if todo is None:
            sub, sub_u, sub_total = probs, u, total
        else:
            sub, sub_u, sub_total = probs[todo], u[todo], None if total is None else total[todo]
        candidates, indices = _stable_top(sub, vocab if full else width)
        values = candidates.double()
        if top_k < values.shape[-1]:
            values[:, top_k:] = 0
        if top_p < 1.0:
            mass = values[:, :top_k].sum(-1, keepdim=True) if sub_total is None else sub_total
            before = values.cumsum(-1) - values  # mass strictly above each token
            values = values.masked_fill(before >= top_p * mass, 0)
            values[:, 0] = values[:, 0].clamp(min=torch.finfo(values.dtype).tiny)
        drawn = indices.gather(-1, _inverse_cdf(values, sub_u)[:, None]).squeeze(-1)
        if full and todo is None:
            return drawn
        if tokens is None:
            tokens, todo = torch.empty_like(drawn), torch.arange(rows, device=probs.device)
        if full:
            tokens[todo] = drawn
            return tokens
        # exact where every drawable token is above the candidates' smallest value (all of those are candidates)
        exact = (values > 0).sum(-1) <= (candidates > candidates[:, -1:]).sum(-1)
        tokens[todo[exact]] = drawn[exact]
        todo, width = todo[~exact], width * 8
        if not todo.numel():
            return tokens


def uniform_table(keys: torch.Tensor, first_step: int, steps: int) -> torch.Tensor:
    """uniform_from_keys(keys, t) for t in [first_step, first_step + steps) as [rows, steps] float64: one batch of
    hash ops for many decode steps instead of one per step."""
    step_index = torch.arange(first_step, first_step + steps, device=keys.device)
    rows = keys.shape[0]
    return uniform_from_keys(keys.repeat_interleave(steps), step_index.repeat(rows)).view(rows, steps)


def sample_tokens(
    logits: torch.Tensor,
    *,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    keys: torch.Tensor | None,
    step: int | torch.Tensor,
    uniforms: torch.Tensor | None = None,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row. logits [rows, V] (any float dtype) -> (tokens [rows] int64, log_probs [rows] fp32).

    Greedy: argmax, log-prob under the temperature-1 distribution. Sampling: temperature, then top-k, then top-p,
    with the draws ``uniform_from_keys(keys, step)``, or ``uniforms`` [rows] float64 when given (taken from a
    ``uniform_table`` of the same keys). Each row's result depends on that row alone, so rows go in chunks.
    On CPU one C call chooses, top-k and top-p included (cpu_sampling.py: the same distribution and the same tokens,
    rounded differently); ``kernel=False`` keeps torch's ops. Either way the log-probs are the training engine's
    (hf_model.log_probs_from_logits of logits / temperature) bit for bit.
    """
    if keys is None and uniforms is None and not greedy:
        raise ValueError("sampling needs per-row random keys; pass keys=row_keys(...)")
    u = None if greedy else uniform_from_keys(keys, step) if uniforms is None else uniforms
    rows, vocab = logits.shape
    if kernel and logits.device.type == "cpu" and (fast := cpu_sampling.load()):
        chosen = fast.choose(logits, u, 1.0 if greedy else temperature, top_k, top_p)
        if chosen is None:
            raise ValueError(NOT_A_DISTRIBUTION)
        return chosen
    chunks = -(-rows * vocab // _CHUNK_ELEMENTS)
    if chunks <= 1 or rows == 1:
        return _sample_rows(logits, u, greedy, temperature, top_k, top_p)
    parts = []
    for i in range(chunks):  # near-equal chunks (never one short chunk left over at the end)
        rows_i = slice(i * rows // chunks, (i + 1) * rows // chunks)
        parts.append(_sample_rows(logits[rows_i], None if u is None else u[rows_i], greedy, temperature, top_k, top_p))
    return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])


def _sample_rows(
    logits: torch.Tensor, u: torch.Tensor | None, greedy: bool, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if greedy:
        tokens = logits.argmax(-1)
        log_probs = log_probs_from_logits(logits, tokens)  # finite for the argmax of any distribution
        if not bool(torch.isfinite(log_probs).all()):
            raise ValueError(NOT_A_DISTRIBUTION)
        return tokens, log_probs
    scaled = logits if temperature == 1.0 else logits / temperature  # x / 1.0 == x: skip a pass over [rows, V]
    # one logsumexp for the draw and the reported log-prob (log_probs_from_logits' formula, the same bits); the
    # draw's probabilities are exp'd in fp32 and summed in fp64 (an fp64 exp over 49,152 tokens cost 3x as much);
    # fp32 values order as their fp64 copies do, so candidates are chosen and sorted in fp32
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    if not bool(torch.isfinite(lse).all()):
        raise ValueError(NOT_A_DISTRIBUTION)
    probs = (scaled - lse).exp_()
    if _filters(top_k, top_p, logits.shape[-1]):
        tokens = _draw_filtered(probs, u, top_k, top_p)
    else:
        tokens = _inverse_cdf(probs, u)
    if log_prob_kernel_applies(scaled):  # the training engine's C path there: its value, bit for bit
        return tokens, log_probs_from_logits(scaled, tokens)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse.squeeze(-1)
