"""A Generator over any RolloutEngine (native, hf, vllm): concurrent episodes' turns share the engine.

Two ways, chosen by what the engine offers (``keep_kv``: None picks the first the engine has):

* **sessions** (engines with ``open_sessions``: the native one, engines/rollout/sessions.py). Each episode is a
  session: its K/V stays on the engine between turns, and a turn prefills only the tokens after the kept ones (the
  last generated token and the observation). One serving thread runs the engine's continuous-batching step loop
  while the event loop keeps running tools and environments: a turn that finishes leaves the decode batch at once
  (its episode may now wait on a tool), a turn that arrives joins the running decode at the next step. Each turn
  samples with its own seed (sampling.seed, else one drawn by the engine) in its own random stream, the stream
  HFGenerator uses, so an episode's tokens do not depend on the other episodes. The loop passes
  ``session=<episode>`` and calls ``end_session`` when the episode ends (its K/V is freed); a turn without a session
  is served the same way and its K/V dropped when it ends.
* **re-prefill** (hf, vllm, plugins; or ``keep_kv=False``): requests are queued, the adapter waits ``max_wait_s``
  for the other episodes' requests and sends up to ``max_batch_size`` of them (same sampling settings) to
  ``engine.generate`` as one left-padded batch (engines/rollout/base.py's layout); each turn re-prefills its whole
  context (vllm's prefix caching reuses the shared prefix). Each request gets back its own row, cut to its own
  ``max_new_tokens``. Seeds: one per engine call (the first request's), so a sampled episode's tokens depend on
  which other requests shared its batch; greedy is unaffected.

**Tensor-parallel engines** (``mirror``): the ranks of a tensor-parallel group must make the same engine calls in the
same order, but episodes' tools and environments finish in any order. So one rank (the group's first) runs the
loop, and its generator hands every engine operation, in the order it applies them (a turn submitted, a session
ended, a scheduler step, an ``engine.generate`` batch), to ``mirror(ops)``; the other ranks replay them with `follow`
on a generator of their own over their shard of the same model, so the collectives inside each step line up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from hybridflow.agents.generator import Generation
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.sessions import TurnRequest
from hybridflow.protocol import DataProto

__all__ = ["STOP", "RolloutEngineGenerator"]

STOP = "stop"  # the op that ends `follow`; its payload is what follow returns (None, or the first rank's error)


def _batch_key(s: SamplingParams) -> tuple:
    return (s.greedy, s.temperature, s.top_k, s.top_p, tuple(s.stop_token_ids))


class RolloutEngineGenerator:
    """`engine`: a RolloutEngine; `pad_token_id` / `stop_token_ids` default to the engine's own attributes.

    `keep_kv`: None (keep each episode's K/V when the engine can), True (require it), False (re-prefill every turn).
    `max_cached_tokens`: the session engine's cap on K/V tokens held (None: no cap; see sessions.py for eviction).
    """

    def __init__(self, engine: RolloutEngine, pad_token_id: int | None = None, stop_token_ids: list[int] | None = None,
                 max_batch_size: int = 64, max_wait_s: float = 0.005, keep_kv: bool | None = None,
                 max_cached_tokens: int | None = None, mirror: Callable[[list[tuple]], None] | None = None):
        self.engine = engine
        self.mirror = mirror  # a tensor-parallel group's first rank: each engine op goes to the others first
        self._session_ids: dict[Any, int] = {}  # mirrored sessions travel as numbers (an episode does not pickle)
        self._next_session_id = itertools.count()
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else engine.pad_token_id)  # type: ignore[attr-defined]
        stops = stop_token_ids if stop_token_ids is not None else getattr(engine, "eos_token_ids", None)
        if not stops:
            raise ValueError("RolloutEngineGenerator needs the stop token ids (the engine has no eos_token_ids)")
        self.stop_token_ids = [int(t) for t in stops]
        if max_batch_size < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_wait_s >= 0, got {max_batch_size}, {max_wait_s}")
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_s
        self._pending: list[tuple[list[int], int, SamplingParams, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.calls = 0  # engine.generate calls made (batches); sessions: decode/prefill steps
        self.requests = 0
        can_keep = callable(getattr(engine, "open_sessions", None))
        if keep_kv and not can_keep:
            raise ValueError(f"RolloutEngineGenerator(keep_kv=True): the {type(engine).__name__} engine cannot keep "
                             "K/V between turns (no open_sessions); use keep_kv=None/False or the native engine")
        if max_cached_tokens is not None and not (keep_kv or (keep_kv is None and can_keep)):
            raise ValueError("RolloutEngineGenerator: max_cached_tokens caps kept K/V, but this generator re-prefills "
                             "every turn (keep_kv=False or an engine without sessions); drop max_cached_tokens")
        self.sessions = None
        if keep_kv or (keep_kv is None and can_keep):
            self.sessions = engine.open_sessions(  # type: ignore[attr-defined]
                max_batch_size=max_batch_size, max_cached_tokens=max_cached_tokens, stop_token_ids=self.stop_token_ids)
        self._inbox: list[tuple[str, Any]] = []  # (op, payload) from the event loop to the serving thread
        self._lock = threading.Lock()
        self._serving = False  # a serving thread is running (or about to start)
        self._server: asyncio.Task | None = None

    @property
    def supports_sessions(self) -> bool:
        """True when turns of one episode should pass session=<key> (and end_session at the end)."""
        return self.sessions is not None

    @property
    def stats(self) -> dict[str, int]:
        """The session engine's counters (sessions.py: prefill_tokens, reused_tokens, evictions, ...); {} otherwise."""
        return dict(self.sessions.stats) if self.sessions is not None else {}

    def end_session(self, session: Hashable) -> None:
        """The episode is over: free its K/V (thread-safe; a no-op without sessions)."""
        if self.sessions is not None:
            with self._lock:
                if self._serving:  # the serving thread owns the sessions: it applies this before its next step
                    self._inbox.append(("end", session))
                else:
                    self._send([self._end_op(session)])
                    self.sessions.end_session(session)

    # ------------------------------------------------------------------ tensor parallel: the ops other ranks replay
    def _send(self, ops: list[tuple]) -> None:
        if self.mirror is not None and ops:
            self.mirror(ops)

    def _sid(self, session: Hashable | None) -> int | None:
        if session is None or self.mirror is None:
            return None
        return self._session_ids.setdefault(session, next(self._next_session_id))

    def _end_op(self, session: Hashable) -> tuple:
        return ("end", self._session_ids.pop(session, None)) if self.mirror is not None else ("end", None)

    def follow(self, receive: Callable[[], list[tuple]]) -> Any:
        """A tensor-parallel group's other ranks: replay the first rank's engine ops (`receive` blocks for the next
        list) on this rank's engine until the STOP op; returns its payload. Errors are the first rank's to report:
        an op that fails here failed there too (same state, same inputs), and the replay goes on as it does."""
        while True:
            for op in receive():
                kind = op[0]
                if kind == STOP:
                    return op[1]
                if kind == "generate":
                    with contextlib.suppress(Exception):
                        self.engine.generate(op[1], op[2])
                    continue
                assert self.sessions is not None, f"a {kind!r} op for a generator without sessions"
                if kind == "turn":
                    with contextlib.suppress(Exception):
                        self.sessions.submit(TurnRequest(op[1], op[2], op[3], op[4]))
                elif kind == "end":
                    if op[1] is not None:
                        self.sessions.end_session(op[1])
                elif kind == "step":
                    try:
                        self.sessions.step()
                    except Exception:
                        self.sessions.abort()
                else:
                    raise ValueError(f"follow: unknown engine op {kind!r}")

    async def generate(self, prompt_token_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
                       session: Hashable | None = None) -> Generation:
        if not prompt_token_ids or max_new_tokens < 1:
            raise ValueError(f"generate() needs a non-empty context and max_new_tokens >= 1, got "
                             f"{len(prompt_token_ids)} tokens, max_new_tokens={max_new_tokens}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        if self.sessions is not None:
            return await self._generate_in_session(list(prompt_token_ids), int(max_new_tokens), sampling, session,
                                                   future)
        self._pending.append((list(prompt_token_ids), int(max_new_tokens), sampling, future))
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.max_wait_s)  # let the other episodes' requests join this batch
            key = _batch_key(self._pending[0][2])
            batch = [r for r in self._pending if _batch_key(r[2]) == key][: self.max_batch_size]
            taken = {id(r) for r in batch}
            self._pending = [r for r in self._pending if id(r) not in taken]
            try:
                results = await asyncio.to_thread(self._run, batch)
            except Exception as e:
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (*_, future), result in zip(batch, results):
                if not future.done():
                    future.set_result(result)

    def _run(self, batch: list[tuple[list[int], int, SamplingParams, Any]]) -> list[Generation]:
        B = len(batch)
        P = max(len(r[0]) for r in batch)
        ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, (context, *_rest) in enumerate(batch):
            ids[i, P - len(context):] = torch.tensor(context)
            mask[i, P - len(context):] = 1
        prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                       "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
        params = dataclasses.replace(batch[0][2], n=1, max_new_tokens=max(r[1] for r in batch))
        self._send([("generate", prompts, params)])
        out = self.engine.generate(prompts, params)
        self.calls += 1
        self.requests += B
        stops = set(self.stop_token_ids) | {int(t) for t in params.stop_token_ids}
        lengths = out.batch["response_mask"].sum(-1).tolist()
        results = []
        for i, (_, limit, _, _) in enumerate(batch):
            n = min(int(lengths[i]), limit)
            tokens = out.batch["responses"][i, :n].tolist()
            log_probs = out.batch["rollout_log_probs"][i, :n].tolist()
            finish = "stop" if tokens and tokens[-1] in stops else "length"
            results.append(Generation(tokens, log_probs, finish))
        return results

    # ------------------------------------------------------------------ sessions: one serving thread
    async def _generate_in_session(self, context: list[int], max_new_tokens: int, sampling: SamplingParams,
                                   session: Hashable | None, future: asyncio.Future) -> Generation:
        request = TurnRequest(session, context, max_new_tokens, sampling, tag=(asyncio.get_running_loop(), future))
        with self._lock:
            self._inbox.append(("turn", request))
            start, self._serving = not self._serving, True
        if start:
            self._server = asyncio.get_running_loop().create_task(self._serve_soon())
        result = await future
        self.requests += 1
        return result

    async def _serve_soon(self) -> None:
        try:
            await asyncio.sleep(self.max_wait_s)  # let the other episodes' first turns arrive and prefill together
        except asyncio.CancelledError:
            # the run that started us ended (e.g. an episode raised) before the thread began: no thread will serve,
            # so the next generate() must start one; turns of the cancelled run are dropped with it
            with self._lock:
                self._serving = False
                self._inbox = [(op, payload) for op, payload in self._inbox if op == "end"]
            raise
        await asyncio.to_thread(self._serve)

    def _serve(self) -> None:
        """Run scheduler steps until nothing is waiting or running; hand each finished turn back to its loop."""
        try:
            self._serve_steps()  # returns with _serving reset under the lock (idle, or after an engine error)
        except BaseException:  # anything else ends it too: the next generate() must start a new serving thread
            with self._lock:
                self._serving = False
            raise

    def _serve_steps(self) -> None:
        sessions = self.sessions
        assert sessions is not None
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                ops: list[tuple] = []
                for op, payload in inbox:
                    if op == "end":
                        ops.append(self._end_op(payload))
                        sessions.end_session(payload)
                    else:
                        ops.append(("turn", self._sid(payload.session), payload.context, payload.max_new_tokens,
                                    payload.sampling))
                        try:
                            sessions.submit(payload)
                        except Exception as e:  # a bad request fails its own turn only
                            payload.error = e
                            _deliver(payload)
                if sessions.idle:
                    self._send(ops)
                    self._serving = False  # the next generate() starts a new serving thread
                    return
                self._send([*ops, ("step",)])  # in order, before this rank's step: the group steps together
            try:
                done = sessions.step()
            except Exception as e:  # an engine error fails every turn it holds (raised in each episode)
                with self._lock:
                    for request in sessions.abort():
                        request.error = e
                        _deliver(request)
                    for op, payload in self._inbox:
                        if op == "turn":
                            payload.error = e
                            _deliver(payload)
                    self._inbox, self._serving = [], False
                return
            self.calls += 1
            for request in done:
                _deliver(request)


def _deliver(request: TurnRequest) -> None:
    """Complete the request's future on its own event loop (from the serving thread)."""
    loop, future = request.tag

    def complete() -> None:
        if future.done():  # the episode was cancelled meanwhile
            return
        if request.error is not None:
            future.set_exception(request.error)
        else:
            future.set_result(Generation(list(request.token_ids), list(request.log_probs),
                                         request.finish_reason or "length"))

    # RuntimeError: that run's event loop is closed (the run ended early), so nobody waits for this turn
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(complete)
