"""A Generator over any RolloutEngine (native, hf, vllm): concurrent episodes' turns are batched into one call.

Episodes ask for their next turn one by one; this adapter queues the requests, waits ``max_wait_s`` for the other
episodes' requests to arrive, and sends up to ``max_batch_size`` of them (same sampling settings) to
``engine.generate`` as one left-padded prompt batch in the layout of engines/rollout/base.py. Each request gets back
its own row, cut to its own ``max_new_tokens`` (a longer batch limit only lets other rows run on; the first k tokens
of a row are the same draw either way).

What this does not do (yet): keep an episode's KV cache between its turns (each turn re-prefills the whole context),
or take a request out of a running batch while it waits on a tool. Sampling seeds: one per engine call (the first
request's), so a sampled episode's tokens depend on which other requests shared its batch; greedy is unaffected.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from hybridflow.agents.generator import Generation
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.protocol import DataProto

__all__ = ["RolloutEngineGenerator"]


def _batch_key(s: SamplingParams) -> tuple:
    return (s.greedy, s.temperature, s.top_k, s.top_p, tuple(s.stop_token_ids))


class RolloutEngineGenerator:
    """`engine`: a RolloutEngine; `pad_token_id` / `stop_token_ids` default to the engine's own attributes."""

    def __init__(self, engine: RolloutEngine, pad_token_id: int | None = None, stop_token_ids: list[int] | None = None,
                 max_batch_size: int = 64, max_wait_s: float = 0.005):
        self.engine = engine
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
        self.calls = 0  # engine.generate calls made (batches)
        self.requests = 0

    async def generate(self, prompt_token_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> Generation:
        if not prompt_token_ids or max_new_tokens < 1:
            raise ValueError(f"generate() needs a non-empty context and max_new_tokens >= 1, got "
                             f"{len(prompt_token_ids)} tokens, max_new_tokens={max_new_tokens}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
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
