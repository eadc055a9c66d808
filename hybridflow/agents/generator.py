"""The generation interface the agent loop drives, and a reference implementation over a transformers model.

``Generator.generate(prompt_token_ids, max_new_tokens, sampling) -> Generation(token_ids, log_probs, finish_reason)``
takes the episode's whole context as token ids and returns only the new tokens, their log-probs (the convention of
engines/rollout/base.py: log_softmax(logits / temperature) over the full vocabulary at the sampled token; greedy:
temperature 1) and why it stopped: ``"stop"`` (the last token is an eos / stop token) or ``"length"``.

``HFGenerator`` is the reference: a plain prefill + KV-cache decode loop over a transformers causal LM, one request
at a time (a lock), run in a thread so the event loop keeps serving tools and environments meanwhile. The rollout
engines (native, hf, vllm) serve the same protocol through engine_generator.RolloutEngineGenerator, with batching.

Optional: a generator whose ``supports_sessions`` is true also takes ``generate(..., session=<key>)`` (one key per
episode, its turns one after another) and ``end_session(key)`` when the episode ends, so that it can keep the
episode's K/V between turns; the agent loop passes both.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.sampling import row_keys, sample_tokens

__all__ = ["Generation", "Generator", "HFGenerator"]


class Generation(NamedTuple):
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class Generator(Protocol):
    async def generate(
        self, prompt_token_ids: list[int], max_new_tokens: int, sampling: SamplingParams
    ) -> Generation: ...


class HFGenerator:
    """Greedy or sampled decoding with a transformers model (eval mode, no grad), one context at a time.

    `stop_token_ids`: the eos ids (tokenizer, generation config and model config, as the rollout engines read them)
    plus any extra stop ids; `sampling.stop_token_ids` add to them per call.
    """

    def __init__(self, model: Any, stop_token_ids: list[int], device: str | torch.device = "cpu"):
        if not stop_token_ids:
            raise ValueError("HFGenerator needs at least one stop token id (the tokenizer's eos)")
        self.model = model.eval()
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.device = torch.device(device)
        self._locks: dict[int, asyncio.Lock] = {}  # one per event loop: a Lock may not cross loops
        self._seed_source = torch.Generator().manual_seed(0)
        # transformers renamed the KV-cache argument and output field from past_key_values to cache (5.x)
        self._cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> HFGenerator:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        from hybridflow.engines.rollout.layout import special_token_ids

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        try:
            gen_config = GenerationConfig.from_pretrained(path)
        except OSError:
            gen_config = None
        _, eos = special_token_ids(tokenizer, gen_config, model.config)
        return cls(model, eos, device)

    async def generate(self, prompt_token_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> Generation:
        if not prompt_token_ids:
            raise ValueError("generate() got an empty context")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        loop_id = id(asyncio.get_running_loop())
        lock = self._locks.get(loop_id)
        if lock is None:
            self._locks = {loop_id: (lock := asyncio.Lock())}  # earlier loops are finished; drop their locks
        async with lock:
            return await asyncio.to_thread(self._decode, list(prompt_token_ids), max_new_tokens, sampling)

    @torch.no_grad()
    def _decode(self, context: list[int], max_new_tokens: int, sampling: SamplingParams) -> Generation:
        stops = set(self.stop_token_ids) | {int(t) for t in sampling.stop_token_ids}
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,),
                                                                                generator=self._seed_source))
        keys = None if sampling.greedy else row_keys(seed, torch.zeros(1, dtype=torch.long),
                                                     torch.zeros(1, dtype=torch.long))
        out = self.model(input_ids=torch.tensor([context], device=self.device), use_cache=True)
        tokens: list[int] = []
        log_probs: list[float] = []
        finish = "length"
        for step in range(max_new_tokens):
            token, log_prob = sample_tokens(
                out.logits[:, -1, :], greedy=sampling.greedy, temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, keys=keys, step=step,
            )
            tokens.append(int(token[0]))
            log_probs.append(float(log_prob[0]))
            if tokens[-1] in stops:
                finish = "stop"
                break
            if step + 1 < max_new_tokens:
                cache = {self._cache_name: getattr(out, self._cache_name)}
                out = self.model(input_ids=token.view(1, 1).to(self.device), use_cache=True, **cache)
        return Generation(tokens, log_probs, finish)
