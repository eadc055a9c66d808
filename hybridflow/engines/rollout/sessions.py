"""Multi-turn generation on the native engine: each episode's KV kept between its turns, turns batched continuously.

A *session* is one episode. Each of its turns is a ``TurnRequest``: the episode's whole context so far (token ids,
token-in/token-out: the previous context, the tokens generated for it, then the observation) and a token budget.

``SessionEngine.step()`` is one iteration of a continuous-batching scheduler:
  1. **admit** waiting turns into the running batch (up to ``max_batch_size`` rows, within the memory cap). A turn
     whose session is *parked* gets that session's kept K/V copied into its row and prefills only the tokens after
     the kept ones (the last generated token of its previous turn and the observation); a new session, or one whose
     KV was evicted or does not match, prefills its whole context. Turns join a running decode: a step's new rows are
     prefilled while the others decode (``stats['joined_running']`` counts those);
  2. **decode** one token for every row that already has one pending;
  3. **sample** every row with its own random stream (sampling.py's counter-based keys from the turn's seed, drawn at
     the row's own step), so a row's tokens never depend on which other rows share the batch;
  4. rows that stopped (eos/stop token or their budget) **leave** the batch: their K/V is parked under the session,
     to rejoin when the episode's next turn arrives (the episode may now wait on a tool for as long as it likes,
     costing no decode work).

Memory. ``end_session`` frees a finished episode's K/V. ``max_cached_tokens`` caps the K/V tokens held: parked
sessions plus each running row's reservation (its context + budget). Admitting a turn that would pass the cap first
evicts parked sessions, least recently parked first (an evicted session's next turn re-prefills its whole context:
``stats['evictions']`` / ``stats['reprefills_after_eviction']``); if the running rows' reservations alone leave no
room, the turn waits for rows to finish; a turn that cannot fit even alone fails with an error naming the numbers.
New weights (``NativeRollout.update_weights``) invalidate every parked session (their K/V came from the old weights).

Exactness: greedy turns pick the tokens of a re-prefill of the whole context (same arithmetic, up to fp rounding of
attention over kept vs recomputed K/V), and the log-probs are those of one forward over the final trajectory
(tests/engines/test_rollout_sessions.py). The decode runs eagerly (no CUDA graphs) with dynamic shapes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.sampling import row_keys, sample_tokens
from hybridflow.engines.rollout.session_cache import BatchCache

__all__ = ["SessionEngine", "SessionMemoryError", "TurnRequest"]


class SessionMemoryError(ValueError):
    """A turn cannot fit the session cache's token cap even with nothing else held."""


@dataclass(eq=False)
class TurnRequest:
    """One turn of a session (``session=None``: a one-off turn whose K/V is not kept). ``tag``: the caller's handle.

    Filled by the engine: ``token_ids`` / ``log_probs`` of the generated tokens (log_softmax(logits / temperature) at
    the chosen token; greedy: temperature 1), ``finish_reason`` ("stop" | "length"), or ``error``.
    """

    session: Hashable | None
    context: list[int]
    max_new_tokens: int
    sampling: SamplingParams  # its seed seeds this turn's random stream (None: the engine draws one)
    tag: Any = None
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None


@dataclass
class _Parked:
    tokens: list[int]  # the tokens whose K/V is held (the context and all generated tokens but the last)
    kv: torch.Tensor  # [layers, 2, kv_heads, len(tokens), head_dim]


@dataclass(eq=False)
class _Row:
    request: TurnRequest
    length: int  # K/V columns filled
    budget: int  # max new tokens of this turn (within max_model_len)
    key: int | None  # the row's random-stream key (None: greedy)
    stops: frozenset[int]
    kept: int = 0  # columns loaded from the parked session at admission
    pending: int | None = None  # the last sampled token, fed at the next decode step
    saved: torch.Tensor | None = None  # the parked K/V, until it is loaded into the row


def _sampling_key(s: SamplingParams) -> tuple:
    return (s.greedy, s.temperature, s.top_k, s.top_p)


class SessionEngine:
    """Sessions over one NativeRollout (``engine.model``, ``engine.max_model_len``, ``engine.eos_token_ids``).

    Single-threaded: submit / end_session / step are called from one thread (agents/engine_generator.py runs them in
    its serving thread).
    """

    def __init__(self, engine, *, max_batch_size: int = 64, max_cached_tokens: int | None = None,
                 stop_token_ids: list[int] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"native sessions: max_batch_size must be >= 1, got {max_batch_size}")
        if max_cached_tokens is not None and max_cached_tokens < 1:
            raise ValueError(f"native sessions: max_cached_tokens must be >= 1 or None, got {max_cached_tokens}")
        self.engine, self.model = engine, engine.model
        self.max_batch_size, self.max_cached_tokens = int(max_batch_size), max_cached_tokens
        stops = engine.eos_token_ids if stop_token_ids is None else stop_token_ids
        self.stop_token_ids = frozenset(int(t) for t in stops)
        self.cache = BatchCache(self.model)
        self.rows: list[_Row] = []
        self.waiting: deque[TurnRequest] = deque()
        self.parked: OrderedDict[Hashable, _Parked] = OrderedDict()  # least recently parked first
        self.evicted: set[Hashable] = set()
        self.closing: set[Hashable] = set()  # sessions ended while a turn of theirs was waiting or running
        self.parked_tokens = 0
        self.stats: Counter = Counter()
        self._weights_version = getattr(engine, "weights_version", 0)

    # ------------------------------------------------------------------ caller side
    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    @property
    def reserved_tokens(self) -> int:
        return sum(len(r.request.context) + r.budget for r in self.rows)

    def submit(self, request: TurnRequest) -> None:
        busy = {r.request.session for r in self.rows} | {w.session for w in self.waiting}
        if request.session is not None and request.session in busy:
            raise ValueError(f"native sessions: session {request.session!r} already has a turn waiting or running; "
                             "a session's turns must come one after another")
        if not request.context:
            raise ValueError("native sessions: a turn needs a non-empty context")
        request.sampling.validate()
        self.waiting.append(request)

    def end_session(self, session: Hashable) -> None:
        """Free the session's K/V (now, or when its running turn ends)."""
        self.evicted.discard(session)
        parked = self.parked.pop(session, None)
        if parked is not None:
            self.parked_tokens -= len(parked.tokens)
        elif any(r.request.session == session for r in self.rows) or any(w.session == session for w in self.waiting):
            self.closing.add(session)

    def abort(self) -> list[TurnRequest]:
        """Drop every running and waiting turn (after an engine error) and every parked session; returns the turns."""
        dropped = [r.request for r in self.rows] + list(self.waiting)
        self.rows, self.waiting = [], deque()
        self.clear()
        return dropped

    def clear(self) -> None:
        """Drop every parked session and the batch buffer (nothing may be running)."""
        if self.rows:
            raise RuntimeError("native sessions: clear() while turns are running")
        self.parked.clear()
        self.evicted.clear()
        self.parked_tokens = 0
        self.cache.release()

    def memory(self) -> dict[str, int]:
        """Tokens held (parked, reserved by running rows) and the batch buffer's size in bytes."""
        return {"parked_sessions": len(self.parked), "parked_tokens": self.parked_tokens,
                "reserved_tokens": self.reserved_tokens, "running_rows": len(self.rows),
                "batch_buffer_bytes": self.cache.nbytes()}

    # ------------------------------------------------------------------ one scheduler iteration
    @torch.inference_mode()
    def step(self) -> list[TurnRequest]:
        """Admit, decode, sample; returns the turns that finished in this step (and any refused with an error)."""
        self._check_weights()
        refused: list[TurnRequest] = []
        decoding = len(self.rows)
        joiners = self._admit(refused)
        logits = []
        if decoding:
            rows = self.rows[:decoding]
            tokens = torch.tensor([r.pending for r in rows], device=self.engine.device)
            lengths = torch.tensor([r.length for r in rows], device=self.engine.device)
            logits.append(self.cache.decode(tokens, lengths))
            for r in rows:
                r.length += 1
            self.stats["decode_steps"] += 1
        if joiners:
            logits.append(self._prefill(decoding, joiners))
            self.stats["joined_running"] += len(joiners) if decoding else 0
        if not logits:
            return refused
        finished = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0])
        self.stats["max_running_rows"] = max(self.stats["max_running_rows"], len(self.rows))
        self._leave(finished)
        if not self.rows and not self.waiting:
            self.cache.release()  # idle: give the buffer back (parked sessions keep their own copies)
        return refused + [r.request for r in finished]

    def _check_weights(self) -> None:
        version = getattr(self.engine, "weights_version", 0)
        if version != self._weights_version:
            self._weights_version = version
            self.stats["invalidated"] += len(self.parked)
            self.evicted.update(self.parked)
            self.parked.clear()
            self.parked_tokens = 0

    # ------------------------------------------------------------------ admission and memory
    def _admit(self, refused: list[TurnRequest]) -> list[_Row]:
        joiners: list[_Row] = []
        while self.waiting and len(self.rows) < self.max_batch_size:
            request = self.waiting[0]
            budget = min(request.max_new_tokens, self.engine.max_model_len - len(request.context))
            if budget < 1:
                self.waiting.popleft()
                request.error = ValueError(
                    f"native sessions: a context of {len(request.context)} tokens leaves no room to generate within "
                    f"max_model_len={self.engine.max_model_len}; shorten the episode (max_response_tokens) or raise "
                    "max_model_len")
                refused.append(request)
                continue
            fits = self._make_room(request, len(request.context) + budget)
            if fits is None:  # an error: it cannot fit alone
                self.waiting.popleft()
                refused.append(request)
                continue
            if not fits:
                break  # wait for running rows to finish
            self.waiting.popleft()
            joiners.append(self._start_row(request, budget))
        return joiners

    def _make_room(self, request: TurnRequest, need: int) -> bool | None:
        """Evict parked sessions (LRU, never the request's own) until `need` tokens fit; False: wait; None: refused."""
        cap = self.max_cached_tokens
        if cap is None:
            return True
        own = self.parked.get(request.session) if request.session is not None else None
        own_tokens = len(own.tokens) if own is not None else 0

        def free() -> int:
            return cap - (self.parked_tokens - own_tokens) - self.reserved_tokens

        while need > free():
            victim = next((k for k in self.parked if k != request.session), None)
            if victim is None:
                break
            gone = self.parked.pop(victim)
            self.parked_tokens -= len(gone.tokens)
            self.evicted.add(victim)
            self.stats["evictions"] += 1
            self.stats["evicted_tokens"] += len(gone.tokens)
        if need <= free():
            return True
        if self.rows:
            return False
        request.error = SessionMemoryError(
            f"native sessions: a turn needs {need} tokens of KV cache (context {len(request.context)} + "
            f"max_new_tokens {need - len(request.context)}) but max_cached_tokens={cap}; raise max_cached_tokens "
            "or lower the episode's max_response_tokens / max_tokens_per_turn")
        return None

    def _start_row(self, request: TurnRequest, budget: int) -> _Row:
        key = None
        if not request.sampling.greedy:
            zero = torch.zeros(1, dtype=torch.long)
            seed = request.sampling.seed
            if seed is None:
                seed = self.engine._call_seed(request.sampling)  # the engine's own seeded draw, as generate() does
            key = int(row_keys(seed, zero, zero)[0])  # the stream HFGenerator uses for one context
        stops = self.stop_token_ids | {int(t) for t in request.sampling.stop_token_ids}
        row = _Row(request, length=0, budget=budget, key=key, stops=frozenset(stops))
        parked = self.parked.pop(request.session, None) if request.session is not None else None
        if parked is not None:
            self.parked_tokens -= len(parked.tokens)
            n = len(parked.tokens)
            if request.context[:n] == parked.tokens:
                row.kept = min(n, len(request.context) - 1)  # at least one new token: its logits start the turn
            else:  # the caller changed history: the kept K/V belongs to other tokens
                self.stats["mismatches"] += 1
            row.saved = parked.kv
        elif request.session is not None and request.session in self.evicted:
            self.evicted.discard(request.session)
            self.stats["reprefills_after_eviction"] += 1
        self.rows.append(row)
        return row

    # ------------------------------------------------------------------ the steps
    def _prefill(self, first: int, joiners: list[_Row]) -> torch.Tensor:
        """Load the joiners' kept K/V into rows [first, ...) and prefill their new tokens; fp32 logits [B, V]."""
        device = self.engine.device
        longest = max(len(r.request.context) + r.budget for r in self.rows)
        self.cache.ensure(len(self.rows), longest, first, max((r.length for r in self.rows[:first]), default=0) + 1)
        new = [r.request.context[r.kept:] for r in joiners]
        tokens = torch.full((len(joiners), max(map(len, new))), int(self.engine.pad_token_id), dtype=torch.long)
        for b, (row, ids) in enumerate(zip(joiners, new)):
            tokens[b, : len(ids)] = torch.tensor(ids)
            if row.kept:
                self.cache.load(first + b, row.saved[:, :, :, : row.kept])
            row.saved = None
            self.stats["reused_tokens"] += row.kept
            self.stats["prefill_tokens"] += len(ids)
        kept = torch.tensor([r.kept for r in joiners], device=device)
        lengths = torch.tensor([len(ids) for ids in new], device=device)
        logits = self.cache.extend(first, tokens.to(device), kept, lengths)
        for row, ids in zip(joiners, new):
            row.length = row.kept + len(ids)
        return logits

    def _sample(self, logits: torch.Tensor) -> list[_Row]:
        """Sample every row [r] from logits [r, V]; returns the rows whose turn ended."""
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            groups.setdefault(_sampling_key(row.request.sampling), []).append(i)
        tokens = torch.empty(len(self.rows), dtype=torch.long, device=logits.device)
        log_probs = torch.empty(len(self.rows), dtype=torch.float32, device=logits.device)
        for (greedy, temperature, top_k, top_p), index in groups.items():
            rows = [self.rows[i] for i in index]
            idx = torch.tensor(index, device=logits.device)
            keys = steps = None
            if not greedy:
                keys = torch.tensor([r.key for r in rows], device=logits.device)
                steps = torch.tensor([len(r.request.token_ids) for r in rows], device=logits.device)
            t, lp = sample_tokens(logits[idx], greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                                  keys=keys, step=steps if steps is not None else 0)
            tokens[idx], log_probs[idx] = t, lp
        finished = []
        for row, token, log_prob in zip(self.rows, tokens.tolist(), log_probs.tolist()):
            request = row.request
            request.token_ids.append(token)
            request.log_probs.append(log_prob)
            if token in row.stops:
                request.finish_reason = "stop"
            elif len(request.token_ids) >= row.budget:
                request.finish_reason = "length"
            else:
                row.pending = token
                continue
            finished.append(row)
        return finished

    def _leave(self, finished: list[_Row]) -> None:
        """Park the finished rows' K/V under their sessions and swap-remove them from the batch."""
        if not finished:
            return
        gone = set(map(id, finished))
        for i, row in enumerate(self.rows):
            if id(row) not in gone:
                continue
            self.stats["turns"] += 1
            session = row.request.session
            if session is None or session in self.closing:
                self.closing.discard(session)
                continue
            tokens = row.request.context + row.request.token_ids[:-1]  # the last token was never fed
            assert len(tokens) == row.length, (len(tokens), row.length)
            self.parked[session] = _Parked(tokens, self.cache.save(i, row.length))
            self.parked_tokens += row.length
        keep = [r for r in self.rows if id(r) not in gone]
        # swap-remove: fill each hole below len(keep) with a kept row from the tail
        holes = [i for i in range(len(keep)) if id(self.rows[i]) in gone]
        tail = [i for i in range(len(keep), len(self.rows)) if id(self.rows[i]) not in gone]
        order = list(self.rows)
        for hole, src in zip(holes, tail):
            self.cache.move(src, hole, order[src].length)
            order[hole] = order[src]
        self.rows = order[: len(keep)]
