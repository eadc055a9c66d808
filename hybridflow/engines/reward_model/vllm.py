"""vLLM's pooling runner as a reward-model engine (``reward_model.rollout.name=vllm``).

The reward model (a decoder ``...ForSequenceClassification`` folder) is loaded by ``vllm.LLM(runner="pooling")``; each
row is sent as token ids (the same rows the hf engine scores, ``inputs.rm_token_rows``) to ``LLM.classify`` with the
activation off, so a row's score is the head's raw output at the row's last token, as in veRL's reward loop
(``activation: False``) and as the hf engine computes it.

What the keys become: ``tensor_model_parallel_size`` -> ``tensor_parallel_size``; ``gpu_memory_utilization`` as it is
(on CPU vLLM reads it as a share of host memory, so an explicit KV-cache size replaces it there, as for the
rollout); ``micro_batch_size_per_gpu`` -> ``max_num_seqs`` (rows in one forward); ``max_model_len`` = the longest
row the truncation lets through; ``param_offload`` -> vLLM's sleep mode (weights to host memory between calls; GPUs
only: on CPU they are in host memory anyway). vLLM is imported only when this engine is built.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch

from hybridflow import device
from hybridflow.engines.vllm_classes import restore_model_classes, snapshot_model_classes

VLLM_MISSING = (
    "reward_model.rollout.name=vllm needs vLLM, which is not installed in this Python environment ({python}); build "
    "the vLLM virtualenv (`bash scripts/setup_vllm_env.sh`) and run with its python, or use "
    "reward_model.rollout.name=hf"
)
_CPU_KV_CACHE_GIB = 0.25  # a pooling model keeps no KV cache between requests; one batch's worth is plenty


def _max_positions(path: str) -> int:
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 0)


def vllm_available() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a bare `vllm/` test folder is a namespace package


class VLLMRewardScorer:
    def __init__(self, path: str, *, max_model_len: int | None, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_num_seqs: int = 256, param_offload: bool = False,
                 dtype: str = "float32", num_threads: int | None = None, engine_kwargs: dict[str, Any] | None = None):
        if not vllm_available():
            raise ImportError(VLLM_MISSING.format(python=sys.executable), name="vllm")
        from vllm import LLM

        self.on_gpu = device.is_cuda_available()
        self.sleep_between_calls = param_offload and self.on_gpu
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: this worker is the engine's only client
        kw: dict[str, Any] = dict(
            model=path, runner="pooling", dtype=dtype, max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, enable_sleep_mode=self.sleep_between_calls,
        )
        if not self.on_gpu:
            if hasattr(os, "sched_getaffinity"):  # bind vLLM's OMP threads to this process's cores
                cores = sorted(os.sched_getaffinity(0))[: num_threads or None]
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            kw["kv_cache_memory_bytes"] = int(_CPU_KV_CACHE_GIB * 2**30)
            longest = max_model_len or _max_positions(path)
            kw["max_num_batched_tokens"] = max(longest, 2048)  # a whole row fits one step without chunking
        kw.update(engine_kwargs or {})
        set_num_threads = torch.set_num_threads
        try:
            classes = snapshot_model_classes(path)  # a model run by vLLM's Transformers backend: vllm_classes.py
            self.llm = LLM(**kw)
            restore_model_classes(self.llm, classes)
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with a no-op process-wide
        self.engine_kwargs = kw
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        if self.sleep_between_calls:
            self.llm.sleep(level=1)

    def score(self, rows: list[list[int]]) -> torch.Tensor:
        """B token lists -> scores [B] float32: the classification head's first output at each row's last token."""
        if not rows:
            return torch.zeros(0, dtype=torch.float32)
        too_long = [i for i, r in enumerate(rows) if len(r) > self.max_model_len]
        if too_long:  # rm_token_rows bounds every row; a longer one means the bound and the engine disagree
            raise ValueError(f"reward-model rows {too_long[:5]} are longer than the engine's max_model_len "
                             f"{self.max_model_len}; set reward_model.rollout.prompt_length/response_length")
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        if self.sleep_between_calls:
            self.llm.wake_up()
        try:
            outputs = self.llm.classify([TokensPrompt(prompt_token_ids=r) for r in rows],
                                        pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        finally:
            if self.sleep_between_calls:
                self.llm.sleep(level=1)
        return torch.tensor([float(o.outputs.probs[0]) for o in outputs], dtype=torch.float32)
