"""The reference rollout engine: transformers' own ``generate``, with the rollout log-probs computed from its logits.

Slow but trusted: the native engine is tested against it. A fresh GenerationConfig is built for every call, so the
checkpoint's sampling defaults (repetition penalty, top-k 50, ...) never leak in: only SamplingParams count.
Randomness comes from torch's global generator, seeded with params.seed inside ``fork_rng`` (the caller's RNG state is
left untouched); samples therefore depend on the whole batch, unlike the native engine's per-row streams.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridflow import device as hf_device
from hybridflow.engines.hf_model import from_pretrained, log_probs_from_logits
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.layout import (
    assemble_output,
    read_prompts,
    resolve_dtype,
    special_token_ids,
    warn_if_slow_bf16,
)
from hybridflow.protocol import DataProto

__all__ = ["HFRollout"]


class HFRollout(RolloutEngine):
    """Generation with ``AutoModelForCausalLM.generate`` (any architecture transformers can load)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "fp32",
        seed: int = 0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        attn_implementation: str = "sdpa",
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        hf_device.set_num_threads(num_threads)
        hf_device.keep_freed_host_memory()
        self.device = hf_device.current_device()
        warn_if_slow_bf16(resolve_dtype(dtype), self.device)
        self.model = from_pretrained(  # sdpa, or eager where the model has no sdpa path
            AutoModelForCausalLM, model_path, attn_implementation, dtype=resolve_dtype(dtype)
        ).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:
            generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            generation_config = None
        self.pad_token_id, self.eos_token_ids = special_token_ids(self.tokenizer, generation_config, self.model.config)
        self.max_model_len = int(max_model_len or self.model.config.max_position_embeddings)
        self._seed_source = torch.Generator().manual_seed(int(seed))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()  # views of the live parameters: copy_ writes into the model
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"hf rollout: unknown parameter {name!r}; expected names like {next(iter(state))!r}")
                if state[name].shape != tensor.shape:
                    raise ValueError(f"hf rollout: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(state[name].shape)}")
                state[name].copy_(tensor.detach())

    def release_memory(self) -> None:
        hf_device.empty_cache()

    def _generation_config(self, params: SamplingParams, max_new: int):
        from transformers import GenerationConfig

        sampling = {} if params.greedy else {
            "temperature": params.temperature,
            "top_k": params.top_k if params.top_k > 0 else 0,  # None would let generate() apply its default 50
            "top_p": params.top_p,
        }
        return GenerationConfig(
            do_sample=not params.greedy,
            max_new_tokens=max_new,
            eos_token_id=sorted({*self.eos_token_ids, *params.stop_token_ids}),
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            **sampling,
        )

    @torch.inference_mode()
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        params.validate()
        read = read_prompts(prompts)
        ids, mask, pos = (t.to(self.device) for t in (read.input_ids, read.attention_mask, read.position_ids))
        P = ids.shape[1]
        max_new = min(params.max_new_tokens, self.max_model_len - P)
        if max_new < 1:
            raise ValueError(f"prompts of length {P} leave no room to generate within max_model_len={self.max_model_len}")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
        devices = [torch.cuda.current_device()] if hf_device.is_cuda_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = self.model.generate(
                # rows repeated here rather than num_return_sequences, which greedy decoding refuses
                input_ids=ids.repeat_interleave(params.n, dim=0),
                attention_mask=mask.repeat_interleave(params.n, dim=0),
                position_ids=pos.repeat_interleave(params.n, dim=0),
                generation_config=self._generation_config(params, max_new),
            )
        responses = out.sequences[:, P:]
        temperature = 1.0 if params.greedy else params.temperature
        # log_softmax(logits / T) over the full vocabulary, one step at a time (a [rows, R, V] stack can be huge), by the
        # training engine's formula (see sampling.py on why not torch.log_softmax)
        log_probs = torch.stack(
            [
                log_probs_from_logits(step_logits.float() / temperature, responses[:, t])
                for t, step_logits in enumerate(out.logits)
            ],
            dim=1,
        )
        stop_ids = torch.tensor(sorted({*self.eos_token_ids, *params.stop_token_ids}), device=responses.device)
        is_stop = torch.isin(responses, stop_ids)
        first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1) + 1, responses.shape[1])
        return assemble_output(prompts, read, responses, first_stop, log_probs, params.n, self.pad_token_id)
