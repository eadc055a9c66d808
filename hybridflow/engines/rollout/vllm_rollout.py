"""vLLM as a rollout engine, living in the caller's process (hybrid mode: the actor trains and generates in one process).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so ``update_weights`` hands vLLM the trainer's
tensors directly, with no copy through a socket or a checkpoint on disk.

Log-prob semantics: the engine is built with ``logprobs_mode="processed_logprobs"``, so vLLM reports the log-prob of
each sampled token after temperature, i.e. ``log_softmax(logits / T)`` over the full vocabulary, the same quantity the
training engine computes (vLLM's default, ``raw_logprobs``, is taken *before* temperature). Greedy decoding reports
``log_softmax(logits)`` (T = 1), as base.py specifies. One known departure from base.py: with top-k or top-p switched
on, vLLM renormalises over the tokens that survive the filter, so the reported value is the log-prob under the filtered
sampling distribution (>= the full-vocabulary value); generate warns once when that happens. RL rollouts normally leave
both off, and then the values are exact.

vLLM in-process has three process-wide side effects that would change the training side; this module undoes them:
on CPU it replaces ``torch.set_num_threads`` with a no-op (restored after construction); it re-seeds the global RNGs
(python, numpy, torch) at construction and draws from torch's global generator while sampling (their states are saved
and restored around every call into vLLM); and a model it has no implementation of (SmolLM3 in vLLM 0.32) runs through
its Transformers backend, which decorates the transformers model class itself for torch.compile, replacing its
``__init__`` and ``__call__`` for the whole process: the training engine's instances of that class then fail at their
next forward, and later ones would be built as vLLM modules. The class is restored once vLLM has built its model, and
vLLM's own modules keep the decorated methods through a subclass of their own (`engines/vllm_classes.py`).
Sampling randomness comes from per-request seeds instead of the global RNGs: row r of the output (sample j of prompt
i, r = i*n+j) gets the r-th draw of numpy's default_rng(SamplingParams.seed), or, when that is None, of an
engine-owned generator seeded with the constructor's seed (fresh samples every call).

Install: ``bash scripts/setup_vllm_env.sh`` (a separate .venv-vllm; vLLM pins clash with the main venv) or
``pip install 'hybridflow[vllm]'``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import random
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from hybridflow import device
from hybridflow.engines.moe_train import is_mixture_of_experts
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.layout import assemble_output, read_prompts, special_token_ids
from hybridflow.engines.vllm_classes import CPU_SLEEP_MODE, restore_model_classes, snapshot_model_classes
from hybridflow.protocol import DataProto

_INSTALL_HINT = (
    "actor_rollout_ref.rollout.name=vllm needs vLLM, which is not installed in this Python environment ({python}). "
    "Install it in a separate virtualenv with `bash scripts/setup_vllm_env.sh` (creates .venv-vllm; CPU build), "
    "or `pip install 'hybridflow[vllm]'` on a GPU machine, then run with that environment's python; "
    "or choose actor_rollout_ref.rollout.name=hf / native."
)


def _unlink_shm_segments() -> None:
    """Remove the names of vLLM's CPU shared-memory segments of this rank's parallel groups (the communicator's and
    the broadcast buffer's), once every rank has mapped them (vLLM joins them while the engine starts, behind a
    barrier): the memory stays until the last process unmaps it. vLLM leaves the names in /dev/shm, and a
    tensor-parallel engine's group name is the same in every run with the external launcher, so the next run on the
    machine failed at start-up with "create shm in SHMManager failed. errno: 17" (the name exists); a run killed
    later leaves nothing behind either."""
    from vllm.distributed import parallel_state

    for ref in list(getattr(parallel_state, "_groups", {}).values()):
        group = ref()
        comm = getattr(group, "device_communicator", None)
        name = getattr(getattr(comm, "dist_module", None), "group_name", None)
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", f"{name}_{comm.rank}".lstrip("/")))  # shm_open drops leading /
        # the group's broadcast ring buffer (a multiprocessing SharedMemory, psm_*): its creator drops the name; its
        # own __del__ would unlink it again, so it no longer counts as the creator
        buffer = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
        if buffer is not None and getattr(buffer, "is_creator", False):
            with contextlib.suppress(FileNotFoundError):
                buffer.shared_memory.unlink()
            buffer.is_creator = False


def _raise_picklable(e: Exception) -> None:
    """Re-raise `e`, or, when Ray could not send it to the driver (vLLM's config errors carry pydantic objects that
    do not pickle, and the driver then saw only "cannot pickle 'ArgsKwargs'"), a RuntimeError with its text."""
    import pickle

    try:
        pickle.dumps(e)
    except Exception:
        raise RuntimeError(f"vLLM could not start: {type(e).__name__}: {e}") from None
    raise e


# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


_ADAPTER_DIR_PREFIX = "hybridflow-vllm-lora-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _new_adapter_dir() -> str:
    """This engine's temporary folder for adapter folders, named after this process (<prefix><pid>-<random>).

    Rollout workers are killed (ray.kill) rather than shut down, so an engine's own clean-up (shutdown, the
    finalizer at interpreter exit) may never run; each new one therefore first removes such folders left by
    processes of this machine that are gone. Only folders of that name pattern are touched.
    """
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_ADAPTER_DIR_PREFIX):].split("-", 1)[0]
        if name.startswith(_ADAPTER_DIR_PREFIX) and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_ADAPTER_DIR_PREFIX}{os.getpid()}-")


def _vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    # A bare directory named vllm on sys.path (tests/vllm_rollout, when pytest puts tests/ there) is found as a namespace
    # package with no origin; the real package has an __init__.py.
    return spec is not None and spec.origin is not None


if not _vllm_installed():
    import sys

    raise ImportError(_INSTALL_HINT.format(python=sys.executable), name="vllm")

__all__ = ["VLLMRollout"]

logger = logging.getLogger(__name__)

_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
_SEED_RANGE = 2**31  # vLLM feeds request seeds to torch.Generator.manual_seed; stay well inside int64
# vLLM's parallel groups are process-global and shared by every engine in the process: tear them down with the last.
_live_engines = 0


def _release_engine(llm: Any) -> None:
    """Free one engine's parts; the process-global parallel groups go only with the last live engine.

    Runs from `VLLMRollout.shutdown` or, for an engine dropped without it (a trainer that ends without shutting its
    rollout down), from the engine's `weakref.finalize`. vLLM's own client finalizer is detached at start-up because
    it always runs EngineCore.shutdown, whose `cleanup_dist_env_and_memory` would break every other live engine.
    """
    global _live_engines
    _live_engines -= 1
    client = llm.llm_engine.engine_core  # in-process client around the EngineCore
    if _live_engines > 0:
        core = client.engine_core
        core.model_executor.shutdown()
        core.scheduler.shutdown()
    else:
        client.shutdown()
    del llm, client
    gc.collect()
    device.empty_cache()


def _vllm_dtype(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"VLLMRollout: unknown dtype {dtype!r}; choose one of bf16, fp16, fp32")
    return _DTYPES[name]


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    """Restore the python, numpy and torch (CPU and current CUDA device) global RNG states on exit."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if device.is_cuda_available() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def _set_cpu_env(num_threads: int | None) -> None:
    """CPU-only knobs vLLM reads at engine construction; a value the user already exported wins."""
    # vLLM's default ('auto') keeps one core free for a separate engine process; in-process there is none, and on a
    # 2-core machine that costs ~25% throughput. Bind OMP threads to the cores this process may run on (the first
    # num_threads of them when given).
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))[: num_threads or None]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))


def _with_tied_lm_head(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the weights, then ``lm_head.weight`` = the input embedding if the caller sent only the latter.

    ``named_parameters()`` of a model with tied embeddings lists the shared tensor once, as the embedding. vLLM's CPU
    reload then leaves the output projection broken (not stale: wrong), so the tied copy is sent explicitly.
    """
    embedding, sent_lm_head = None, False
    for name, tensor in named_tensors:
        if name == "lm_head.weight":
            sent_lm_head = True
        elif name.endswith("embed_tokens.weight"):
            embedding = tensor
        yield name, tensor
    if embedding is not None and not sent_lm_head:
        yield "lm_head.weight", embedding


class VLLMRollout(RolloutEngine):
    """Rollout engine backed by an in-process ``vllm.LLM``.

    Args:
        model_path: a Hugging Face checkpoint directory (config, safetensors, tokenizer).
        dtype: "bf16" | "fp16" | "fp32" (or the torch dtype).
        seed: seeds vLLM and the engine-owned generator that draws per-request seeds when SamplingParams.seed is None.
        max_model_len: longest prompt + response in tokens; None: the model's max_position_embeddings.
        gpu_memory_utilization: on GPUs, the fraction of GPU memory vLLM may take (weights + KV cache).
        kv_cache_space_gib: on CPU, the KV cache size in GiB (vLLM otherwise reserves a large share of host memory).
            An exported VLLM_CPU_KVCACHE_SPACE overrides it (vLLM's own rule).
        enforce_eager: skip CUDA graphs / torch.compile: faster start-up, and weights can be swapped freely.
        num_threads: on CPU, bind vLLM's OMP threads to this many cores (default: all this process may use);
            an exported VLLM_CPU_OMP_THREADS_BIND wins.
        **kw: passed to ``vllm.LLM`` unchanged (e.g. enable_sleep_mode=True on GPUs, tensor_parallel_size;
            enable_prefix_caching=False to turn prefix caching off, which is on by default here).
    """

    name = "vllm"
    DTYPES = ("fp32", "bf16", "fp16")
    SWITCHES = ("enforce_eager", "free_cache_engine", "gpu_memory_utilization", "quantization", "enable_prefix_caching",
                "max_num_seqs")
    TENSOR_PARALLEL = True

    @classmethod
    def options_from_config(cls, rollout: Any) -> dict[str, Any]:
        """veRL's switches: enforce_eager and gpu_memory_utilization as they are; free_cache_engine -> sleep mode
        (weights offloaded and KV freed between generations, GPUs only)."""
        kwargs: dict[str, Any] = {}
        if rollout.enforce_eager is not None:
            kwargs["enforce_eager"] = bool(rollout.enforce_eager)
        if rollout.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(rollout.gpu_memory_utilization)
        if rollout.free_cache_engine is not None:
            kwargs["enable_sleep_mode"] = bool(rollout.free_cache_engine)
        # veRL's vLLM knobs, passed to vllm.LLM as they are (getattr: plugin configs may lack them)
        if getattr(rollout, "quantization", None) is not None:
            kwargs["quantization"] = str(rollout.quantization)
        if getattr(rollout, "enable_prefix_caching", None) is not None:
            kwargs["enable_prefix_caching"] = bool(rollout.enable_prefix_caching)
        if getattr(rollout, "max_num_seqs", None) is not None:  # vLLM's own cap on the sequences of one batch
            kwargs["max_num_seqs"] = int(rollout.max_num_seqs)
        if rollout.tensor_model_parallel_size > 1:
            # every rank of a TP group builds the engine in its own worker process, on the ranks' torch.distributed
            # world (vLLM's external launcher), and gets the same prompts; the worker returns TP rank 0's rows
            kwargs["tensor_parallel_size"] = int(rollout.tensor_model_parallel_size)
            kwargs["distributed_executor_backend"] = "external_launcher"
        return kwargs

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str | torch.dtype = "bf16",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_space_gib: float = 1,
        enforce_eager: bool = True,
        num_threads: int | None = None,
        lora_rank: int = 0,
        **kw: Any,
    ) -> None:
        self.model_path = str(model_path)
        # LoRA with adapter-only sync: vLLM applies the policy's adapter itself (enable_lora); each sync hands it a
        # PEFT adapter folder (load_adapter) instead of streaming merged weights. 0: no LoRA in vLLM.
        self.adapter_sync = lora_rank > 0
        self._lora_request = None
        self._adapter_dir = _new_adapter_dir() if self.adapter_sync else None
        if self._adapter_dir is not None:
            self._remove_adapter_dir = weakref.finalize(self, shutil.rmtree, self._adapter_dir, ignore_errors=True)
        self.on_gpu = device.is_cuda_available()
        if kw.get("enable_sleep_mode") and not self.on_gpu:
            raise ValueError(CPU_SLEEP_MODE)
        self._asleep = False
        self._sleep_mode = bool(kw.get("enable_sleep_mode", False)) and self.on_gpu
        self._seed_rng = np.random.default_rng(seed)
        self.last_update_seconds: float | None = None
        self._warned_filtered_log_probs = False

        # In-process engine: the only mode in which update_weights can hand over tensors without serialising them.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        engine_kw: dict[str, Any] = dict(
            model=self.model_path,
            dtype=_vllm_dtype(dtype),
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",  # log_softmax(logits / T): see the module docstring
            gpu_memory_utilization=gpu_memory_utilization,
            # multi-turn episodes re-send their whole history each turn (agents/engine_generator.py): prefix caching
            # reuses its KV blocks instead of recomputing them; update_weights resets the cache. kw may turn it off.
            enable_prefix_caching=True,
        )
        if not self.on_gpu:
            _set_cpu_env(num_threads)
            # On CPU gpu_memory_utilization is a share of *host* memory; an explicit KV size replaces that reservation.
            engine_kw["kv_cache_memory_bytes"] = int(kv_cache_space_gib * 2**30)
            # Chunked prefill + per-request seeds crash on CPU: vLLM rewinds a seeded generator after a partial
            # prefill with set_offset, which CPU generators lack ("CPU Generator does not use offset"). Without
            # chunking, prompts are scheduled whole; the token budget must then hold the longest sequence.
            from transformers import AutoConfig

            longest = max_model_len or getattr(
                AutoConfig.from_pretrained(self.model_path), "max_position_embeddings", 0
            )
            engine_kw["enable_chunked_prefill"] = False
            engine_kw["max_num_batched_tokens"] = max(int(longest or 0), 8192)
        if self.adapter_sync:
            allowed = [r for r in _VLLM_LORA_RANKS if r >= lora_rank]
            if not allowed:
                raise ValueError(f"vllm rollout: LoRA rank {lora_rank} is above vLLM's largest ({_VLLM_LORA_RANKS[-1]})")
            engine_kw.update(enable_lora=True, max_lora_rank=allowed[0], max_loras=1)
        engine_kw.update(kw)

        set_num_threads = torch.set_num_threads
        threads_before = torch.get_num_threads()
        try:
            with _preserved_rng():
                try:
                    from vllm import LLM
                except ImportError as e:  # installed but broken: usually CUDA torchvision/torchaudio next to CPU torch
                    raise ImportError(
                        f"vLLM is installed but failed to import ({e}). On CPU machines uninstall the CUDA builds it "
                        "pulls in: `pip uninstall -y torchvision torchaudio torchcodec` (scripts/setup_vllm_env.sh "
                        "does this)."
                    ) from e
                start = time.perf_counter()
                classes = snapshot_model_classes(self.model_path)
                try:
                    self.llm = LLM(**engine_kw)
                except Exception as e:
                    _raise_picklable(e)
                if not self.on_gpu:
                    _unlink_shm_segments()
                restore_model_classes(self.llm, classes)
                global _live_engines
                _live_engines += 1
                vllm_finalizer = getattr(self.llm.llm_engine.engine_core, "_finalizer", None)
                if vllm_finalizer is not None:
                    vllm_finalizer.detach()
                self._release = weakref.finalize(self, _release_engine, self.llm)
                self.startup_seconds = time.perf_counter() - start
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process.
            torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads_before:
            logger.info("vLLM set torch's intra-op threads %d -> %d", threads_before, torch.get_num_threads())

        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.mixture_of_experts = is_mixture_of_experts(hf_config)  # update_weights refuses these on CPU
        from transformers import GenerationConfig

        try:
            generation_config = GenerationConfig.from_pretrained(self.model_path)
        except OSError:
            generation_config = None
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_token_id, self.eos_token_ids = special_token_ids(self.tokenizer, generation_config, hf_config)
        logger.info("vLLM engine for %s ready in %.1f s", self.model_path, self.startup_seconds)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: DataProto, params: SamplingParams) -> DataProto:
        """``input_ids/attention_mask [B, P]`` (left-padded) -> B * n rows in the layout of base.py."""
        params.validate()
        if (params.top_k > 0 or params.top_p < 1) and not params.greedy and not self._warned_filtered_log_probs:
            logger.warning(
                "vllm rollout with top_k=%s/top_p=%s: rollout_log_probs are vLLM's, renormalised over the kept tokens "
                "(>= the full-vocabulary log-probs base.py specifies); switch top-k/top-p off to compare them with "
                "the training engine token by token",
                params.top_k,
                params.top_p,
            )
            self._warned_filtered_log_probs = True
        self._wake_up()
        read = read_prompts(prompts)
        input_ids, mask = read.input_ids.cpu(), read.attention_mask.cpu()
        n = params.n
        # One n=1 request per output row (sample j of prompt i is row i*n+j), each with its own seed: a row's samples
        # do not depend on the other rows, and vLLM returns outputs in request order.
        requests = [{"prompt_token_ids": ids[m.bool()].tolist()} for ids, m in zip(input_ids, mask) for _ in range(n)]
        seed_source = np.random.default_rng(params.seed) if params.seed is not None else self._seed_rng
        seeds = seed_source.integers(0, _SEED_RANGE, size=len(requests)).tolist()
        vllm_params = [self._vllm_sampling_params(params, seed) for seed in seeds]

        start = time.perf_counter()
        with _preserved_rng():
            outputs = self.llm.generate(requests, vllm_params, use_tqdm=False, lora_request=self._lora_request)
        seconds = time.perf_counter() - start

        completions = [out.outputs[0] for out in outputs]
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        width = max(int(lengths.max()), 1)
        responses = torch.full((len(completions), width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(completions), width, dtype=torch.float32)
        for row, c in enumerate(completions):
            tokens = list(c.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            # logprobs=0: each position holds just the sampled token's entry.
            log_probs[row, : len(tokens)] = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(tokens)])
        out = assemble_output(prompts, read, responses, lengths, log_probs, n, self.pad_token_id)
        new_tokens = int(lengths.sum())
        out.meta_info["rollout_stats"] = {
            "engine": self.name,
            "generate_seconds": seconds,
            "new_tokens": new_tokens,
            "new_tokens_per_s": new_tokens / max(seconds, 1e-9),
        }
        return out

    def _vllm_sampling_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VllmSamplingParams

        stop = list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))  # eos ids from all the sources
        return VllmSamplingParams(
            n=1,
            temperature=0.0 if params.greedy else params.temperature,
            top_k=0 if params.greedy or params.top_k <= 0 else params.top_k,  # vLLM: 0 turns top-k off
            top_p=1.0 if params.greedy else params.top_p,
            max_tokens=params.max_new_tokens,
            stop_token_ids=stop,
            logprobs=0,  # only the sampled token's log-prob
            seed=seed,
            detokenize=False,  # token ids are all the rollout needs; skip the detokenizer's per-token work
        )

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place (HF parameter names, any dtype/device) and drop the prefix cache.

        A subset of the weights may be sent (the rest stay as they are). The prefix cache must go: its KV blocks were
        computed with the old weights, and a later prompt sharing a prefix would reuse them. Time taken is kept in
        ``last_update_seconds``.
        """
        if self.mixture_of_experts and not self.on_gpu:
            import vllm

            # Checked with vLLM 0.32.0: reloading a Qwen3-MoE checkpoint's own tensors in place, even one expert's,
            # moves the log-probs of its samples by 0.4-1.2 (attention or router weights alone: 1e-6).
            raise ValueError(
                f"vllm rollout: on CPU, vLLM {vllm.__version__} computes with wrong experts after an in-place weight "
                "update of a mixture-of-experts model, so it cannot follow the policy being trained; use "
                "actor_rollout_ref.rollout.name=native for MoE policies on CPU (or vLLM on a GPU)"
            )
        start = time.perf_counter()
        self._wake_up()
        weights = _with_tied_lm_head(named_tensors) if self.tie_word_embeddings else iter(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMRollout.update_weights: vLLM refused to reset its prefix cache (requests running?)")
        self.last_update_seconds = time.perf_counter() - start
        logger.info("vLLM weights updated in %.3f s", self.last_update_seconds)

    def adapter_folder(self) -> str:
        """A fresh folder (inside this engine's own temporary directory) for the next adapter to load."""
        if not self.adapter_sync:
            raise ValueError("vllm rollout: adapter_folder() needs an engine built with lora_rank > 0")
        return tempfile.mkdtemp(dir=self._adapter_dir)

    def load_adapter(self, folder: str) -> None:
        """Generate with the PEFT adapter in `folder` from now on (the base weights stay as they are); the previous
        adapter is dropped from vLLM and its folder deleted (only folders of adapter_folder() are accepted)."""
        from vllm.lora.request import LoRARequest

        if os.path.dirname(os.path.abspath(folder)) != self._adapter_dir:
            raise ValueError(f"vllm rollout: load_adapter takes folders made by adapter_folder(), not {folder!r}")
        start = time.perf_counter()
        self._wake_up()
        previous = self._lora_request
        lora_id = previous.lora_int_id + 1 if previous is not None else 1
        self._lora_request = LoRARequest(f"policy-{lora_id}", lora_id, folder)
        if not self.llm.llm_engine.add_lora(self._lora_request):
            raise RuntimeError(f"vllm rollout: vLLM did not load the adapter in {folder}")
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        # the prefix cache holds K/V computed under the previous adapter
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm rollout: vLLM refused to reset its prefix cache (requests running?)")
        self.last_update_seconds = time.perf_counter() - start

    def release_memory(self) -> None:
        """GPU with enable_sleep_mode=True: offload weights and free the KV cache until the next call.

        Otherwise (and always on CPU, where vLLM's sleep does nothing) the KV pool stays allocated; only the prefix
        cache is dropped.
        """
        if self._sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True
        elif not self._sleep_mode:
            self.llm.reset_prefix_cache()

    def _wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the object is unusable afterwards."""
        llm = self.__dict__.pop("llm", None)
        if self._adapter_dir is not None:
            self._remove_adapter_dir()  # this engine's own temporary adapter folders
            self._adapter_dir = None
        if llm is None:
            return
        del llm
        self._release()  # once: the finalizer is dead afterwards
