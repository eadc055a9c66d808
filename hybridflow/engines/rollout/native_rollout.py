"""The native rollout engine: our own batched decoder loop around NativeDecoder (Qwen2 / Llama checkpoints).

One ``generate`` call:
  1. prefill the B unique prompts once; their K/V are stored once, shared by their n samples (kv_cache.py);
  2. decode all B*n rows together, one token per step, into a KV cache allocated once per call;
  3. rows that hit eos / a stop token are dropped from the running batch: once enough have finished, the live rows
     are moved to the front of the cache (``compact_fraction`` trades copy cost against computing dead rows).
Sampling and per-row random streams are in sampling.py; the output layout is built by layout.py.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable

import torch

from hybridflow import device as hf_device
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows
from hybridflow.engines.rollout.layout import (
    assemble_output,
    read_prompts,
    resolve_dtype,
    special_token_ids,
    warn_if_slow_bf16,
)
from hybridflow.engines.rollout.native_model import NativeDecoder
from hybridflow.engines.rollout.sampling import row_keys, sample_tokens
from hybridflow.protocol import DataProto

__all__ = ["NativeRollout", "resolve_dtype"]

def iter_checkpoint_tensors(model_path: str):
    """(name, tensor) pairs from the checkpoint's safetensors files, one tensor in memory at a time."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted({os.path.join(model_path, v) for v in json.load(f)["weight_map"].values()})
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_path}; the native rollout reads safetensors only "
            "(re-save the model with save_pretrained(path, safe_serialization=True))"
        )
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


class NativeRollout(RolloutEngine):
    """Batched generation for Qwen2 / Llama checkpoints with a pre-allocated KV cache; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "fp32",
        seed: int = 0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        compact_fraction: float = 0.25,
    ):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        hf_device.set_num_threads(num_threads)
        self.model_path = model_path
        self.device = hf_device.current_device()
        # 'int8': int8 weights in the layer matmuls, everything else in fp32 (see int8_linear.py)
        self.int8 = dtype == "int8"
        self.dtype = torch.float32 if self.int8 else resolve_dtype(dtype)
        warn_if_slow_bf16(self.dtype, self.device)
        self.config = AutoConfig.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        try:
            self.generation_config = GenerationConfig.from_pretrained(model_path)
        except OSError:
            self.generation_config = None
        self.pad_token_id, self.eos_token_ids = special_token_ids(self.tokenizer, self.generation_config, self.config)
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        self.compact_fraction = float(compact_fraction)
        self._seed_source = torch.Generator().manual_seed(int(seed))
        self.model = NativeDecoder(self.config, self.dtype, self.device, self.max_model_len, int8=self.int8)
        loaded = {name for name, tensor in iter_checkpoint_tensors(model_path) if self.model.load(name, tensor)}
        missing = sorted(self.model.expected_names() - loaded)
        if missing:
            raise ValueError(f"checkpoint {model_path} lacks {len(missing)} tensors the decoder needs: {missing[:6]}")

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors (any device/dtype) into the fused weights, one at a time."""
        for name, tensor in named_tensors:
            self.model.load(name, tensor)

    def release_memory(self) -> None:
        # The KV cache lives only inside generate(); give the allocator's cached blocks back to the device.
        hf_device.empty_cache()

    # ------------------------------------------------------------------ generation
    def _call_seed(self, params: SamplingParams) -> int:
        if params.seed is not None:
            return int(params.seed)
        # No seed given: the engine's own generator (seeded at construction) supplies one per call.
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_source))

    @torch.inference_mode()
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        params.validate()
        read = read_prompts(prompts)
        ids, mask, pos = (t.to(self.device) for t in (read.input_ids, read.attention_mask, read.position_ids))
        B, P = ids.shape
        n = params.n
        max_new = min(params.max_new_tokens, self.max_model_len - P)
        if max_new < 1 or int(pos.max()) + max_new > self.max_model_len:
            raise ValueError(
                f"prompts of length {P} (max position {int(pos.max())}) leave no room to generate within "
                f"max_model_len={self.max_model_len}; shorten the prompts or raise max_model_len"
            )
        rows = B * n
        stop_ids = torch.tensor(sorted({*self.eos_token_ids, *params.stop_token_ids}), device=self.device)
        row_index = torch.arange(rows, device=self.device)  # original output row of each running slot
        keys = None
        if not params.greedy:
            keys = row_keys(self._call_seed(params), row_index // n, row_index % n)

        shape = self.model.shape
        cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, prompts=B, prompt_len=P, n=n,
                        max_new=max_new, dtype=self.dtype, device=self.device)
        # additive mask of each prompt slot's keys: 0, or -inf at left padding
        prompt_bias = torch.zeros(B, P, dtype=self.dtype, device=self.device)
        prompt_bias.masked_fill_(~mask.bool(), float("-inf"))
        running = RunningRows(prompt_index=row_index // n, sample_index=row_index % n, n=n)
        row_bias = prompt_bias[running.prompt_index]  # [rows, P], follows the rows through compaction
        logits = self.model.prefill(ids, pos, mask, cache).repeat_interleave(n, dim=0)
        positions = pos[:, -1].repeat_interleave(n) + 1

        tokens_out = torch.full((rows, max_new), self.pad_token_id, dtype=torch.long, device=self.device)
        log_probs_out = torch.zeros(rows, max_new, dtype=torch.float32, device=self.device)
        lengths = torch.full((rows,), max_new, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)  # per running slot
        for step in range(max_new):
            tokens, log_probs = sample_tokens(
                logits,
                greedy=params.greedy,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                keys=keys,
                step=step,
            )
            # Finished-but-not-yet-dropped slots write past their length; assemble_output masks that away.
            tokens_out[row_index, step] = tokens
            log_probs_out[row_index, step] = log_probs
            stopped = torch.isin(tokens, stop_ids) & ~done
            lengths[row_index[stopped]] = step + 1
            done |= stopped
            n_done = int(done.sum())
            if step == max_new - 1 or n_done == done.numel():
                break
            if n_done and n_done >= self.compact_fraction * done.numel():
                keep = (~done).nonzero().squeeze(-1)
                cache.compact(keep, step)
                # a prompt's samples may finish at different steps: shared prompt K/V is found by index from now on
                running = RunningRows(running.prompt_index[keep], running.sample_index[keep], n, grouped=False)
                row_index, positions, tokens, done = row_index[keep], positions[keep], tokens[keep], done[keep]
                row_bias = row_bias[keep]
                keys = keys[keep] if keys is not None else None
            logits = self.model.decode(tokens, positions, cache, running, row_bias, column=step)
            positions = positions + 1
        return assemble_output(prompts, read, tokens_out, lengths, log_probs_out, n, self.pad_token_id)
