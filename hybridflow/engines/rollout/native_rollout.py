"""The native rollout engine: our own batched decoder loop around NativeDecoder (the architectures of arch_specs.py).

One ``generate`` call:
  1. prefill the B unique prompts once; their K/V are stored once, shared by their n samples (kv_cache.py);
  2. decode all B*n rows together, one token per step, into a KV cache allocated once per call;
  3. rows that hit eos / a stop token are dropped from the running batch: once enough have finished, the live rows
     are moved to the front of the cache (``compact_fraction`` trades copy cost against computing dead rows).
Sampling and per-row random streams are in sampling.py; the output layout is built by layout.py.

``max_num_seqs`` (veRL's rollout.max_num_seqs) caps the rows of one decode batch: prompts are generated in successive
groups of ``max_num_seqs // n`` prompts (a prompt's n samples stay together: they share its K/V). Each row keeps its
random stream (sampling.py keys rows by prompt and sample index in the whole call), so the samples are the same as
one uncapped call's; the groups' responses are padded to one width and joined in order.

``decode`` picks how step 2 runs: ``eager`` (the loop above, dynamic shapes; the default on CPU) or ``cuda_graph``
(fixed-shape steps replayed as CUDA graphs, the default on GPUs: static_decode.py); ``static`` runs the fixed-shape
step without graphs (for testing that path on CPU); ``compiled`` runs it compiled by torch.compile (compiled_step.py;
chosen on CPU by ``graph``, which is veRL's ``enforce_eager=false``).

``attention_kernel``: on CPU the eager steps' decode attention can run as one C kernel (cpu_attention.py) instead
of torch matmuls. None (default): on CPU in fp32 and bf16, where it builds (in fp32 it gained 3-14% a generate call
once the projections ran on cpu_linear.py's kernel, docs/benchmarks.md); True: the same, and an error where it cannot
run; False: never.

``linear_kernel``: on CPU the projections of packed weights run as one C kernel instead of oneDNN's packed matmul:
in fp32 the panel kernel (cpu_linear.py), in bf16 the bf16 tiles (cpu_bf16_linear.py). None (default): where it
builds (fp32: AVX-512, or AVX2 with FMA: cpu_linear.kernel_for; bf16: CPUs with AMX or AVX512-BF16), except with
``batch_invariant`` (which needs the training engine's oneDNN products); True: the same, and an error where it
cannot run; False: oneDNN.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable

import torch

from hybridflow import device as hf_device
from hybridflow.engines.batch_invariant import onednn_matmuls
from hybridflow.engines.rollout import cpu_attention, cpu_bf16_step, cpu_decode_layer, cpu_sampling, cpu_step_ops
from hybridflow.engines.rollout.arch_specs import resolve
from hybridflow.engines.rollout.base import RolloutEngine, SamplingParams
from hybridflow.engines.rollout.chunked_prefill import chunked_prefill
from hybridflow.engines.rollout.exact_decode import BatchInvariantSteps, batch_invariant_refusal
from hybridflow.engines.rollout.kv_cache import KVCache, RunningRows
from hybridflow.engines.rollout.layout import (
    assemble_output,
    pad_responses,
    read_prompts,
    resolve_dtype,
    special_token_ids,
    warn_if_slow_bf16,
)
from hybridflow.engines.rollout.moe import RouteRecorder
from hybridflow.engines.rollout.native_model import NativeDecoder
from hybridflow.engines.rollout.sampling import StepUniforms, row_keys, sample_tokens
from hybridflow.engines.rollout.shm_collectives import MODES as TP_COLLECTIVE_MODES
from hybridflow.engines.rollout.shm_collectives import TPCollectives
from hybridflow.engines.rollout.static_decode import DECODE_MODES, GraphDecoder
from hybridflow.engines.rollout.tensor_parallel import TensorParallelDecoder, same_tokens, tp_group_of
from hybridflow.protocol import DataProto

__all__ = ["NativeRollout", "resolve_dtype"]

logger = logging.getLogger(__name__)

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
    """Batched generation with a pre-allocated KV cache for the architectures in arch_specs.py; see the module
    docstring."""

    DTYPES = ("fp32", "bf16", "int8")
    SWITCHES = ("enforce_eager", "free_cache_engine", "enable_chunked_prefill", "max_num_batched_tokens",
                "max_num_seqs")
    DEFAULT_PREFILL_BUDGET = 8192  # veRL's max_num_batched_tokens default, used when only chunking is switched on
    TENSOR_PARALLEL = True  # tensor_parallel.py

    @classmethod
    def model_errors(cls, model_path: str) -> list[str]:
        """The model's architecture must be one of arch_specs.py's (checked before any worker starts)."""
        from transformers import AutoConfig

        try:
            resolve(AutoConfig.from_pretrained(model_path))
        except ValueError as err:
            return [str(err)]
        return []

    @classmethod
    def options_from_config(cls, rollout) -> dict:
        """veRL's switches: enforce_eager -> decode ("eager", or "graph": CUDA graphs on GPUs, the compiled step on
        CPU); free_cache_engine -> free the fixed-shape decode buffers after each generation."""
        kwargs = {}
        if rollout.enforce_eager is not None:
            kwargs["decode"] = "eager" if rollout.enforce_eager else "graph"
        if rollout.free_cache_engine is not None:
            kwargs["free_cache_engine"] = bool(rollout.free_cache_engine)
        if rollout.tensor_model_parallel_size > 1:
            kwargs["tensor_parallel_size"] = int(rollout.tensor_model_parallel_size)
        # a prefill token budget (chunked_prefill.py): max_num_batched_tokens, or the default when only
        # enable_chunked_prefill=true is given
        budget = getattr(rollout, "max_num_batched_tokens", None)
        if budget is None and getattr(rollout, "enable_chunked_prefill", None):
            budget = cls.DEFAULT_PREFILL_BUDGET
        if budget is not None:
            kwargs["max_num_batched_tokens"] = int(budget)
        if getattr(rollout, "max_num_seqs", None) is not None:
            kwargs["max_num_seqs"] = int(rollout.max_num_seqs)
        return kwargs

    @classmethod
    def config_errors(cls, rollout) -> list[str]:
        errors = super().config_errors(rollout)
        cap = getattr(rollout, "max_num_seqs", None)
        if cap is not None and cap < rollout.n:
            errors.append(f"actor_rollout_ref.rollout.max_num_seqs={cap} is below actor_rollout_ref.rollout.n="
                          f"{rollout.n}: the native engine decodes a prompt's n samples together (they share its "
                          "K/V); give at least n")
        return errors

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "fp32",
        seed: int = 0,
        max_model_len: int | None = None,
        num_threads: int | None = None,
        compact_fraction: float = 0.25,
        prepack: bool | None = None,
        decode: str = "auto",
        free_cache_engine: bool = False,
        record_routes: bool = False,
        tensor_parallel_size: int = 1,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        batch_invariant: bool = False,
        attention_kernel: bool | None = None,
        linear_kernel: bool | None = None,
        huge_pages: bool | None = None,
        tp_collectives: str = "auto",
    ):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        hf_device.set_num_threads(num_threads)
        hf_device.keep_freed_host_memory()
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
        if max_num_batched_tokens is not None and int(max_num_batched_tokens) <= 0:
            raise ValueError(f"native rollout: max_num_batched_tokens={max_num_batched_tokens}; give a positive "
                             "prefill token budget or leave it unset")
        self.max_num_batched_tokens = None if max_num_batched_tokens is None else int(max_num_batched_tokens)
        if max_num_seqs is not None and int(max_num_seqs) <= 0:
            raise ValueError(f"native rollout: max_num_seqs={max_num_seqs}; give a positive row cap or leave it unset")
        self.max_num_seqs = None if max_num_seqs is None else int(max_num_seqs)
        self._seed_source = torch.Generator().manual_seed(int(seed))
        # prepack: on CPU, matmul weights packed once for a kernel: fp32 -> cpu_linear.py's panels (oneDNN's layout
        # with linear_kernel=False or where that kernel cannot be built), bf16 -> the bf16 tiles (cpu_bf16_linear.py)
        # where the CPU has AMX or AVX512-BF16, else oneDNN's layout where it has bf16 units; False: plain F.linear;
        # None: packed from the hidden size where it was measured to pay (128 for the panel kernel and the bf16 tiles,
        # 256 for oneDNN)
        # huge_pages: the fp32 panels in transparent huge pages (native_model.NativeDecoder; None: where the machine
        # allows them)
        # tensor_parallel_size > 1: this rank holds its TP slice of every weight (tensor_parallel.py)
        self.tensor_parallel = tp_group_of(tensor_parallel_size) if tensor_parallel_size > 1 else None
        # tp_collectives: the TP group's all-reduce / all-gather / broadcast in shared memory where every rank is on
        # this host's CPUs ("auto"; "shm": or an error), or torch.distributed's ("torch"; GPUs)
        if tp_collectives not in TP_COLLECTIVE_MODES:
            raise ValueError(f"native rollout: tp_collectives={tp_collectives!r}; choose one of "
                             f"{list(TP_COLLECTIVE_MODES)}")
        self.tp_collectives = None if self.tensor_parallel is None else TPCollectives(
            self.tensor_parallel, self.device, tp_collectives)
        # batch_invariant: the training engine's rounding, bit for bit in fp32 (exact_decode.py): plain F.linear
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:  # the training engine's projection kernels (batch_invariant.onednn_matmuls)
            same = onednn_matmuls(self.device)
            if prepack is not None and bool(prepack) != same:
                raise ValueError(f"native rollout: batch_invariant=true computes its projections as the training engine "
                                 f"does here ({'oneDNN, packed' if same else 'F.linear'}); drop prepack={prepack}")
            prepack = same
            if linear_kernel:
                raise ValueError("native rollout: batch_invariant=true computes its projections with the training "
                                 "engine's oneDNN products; drop linear_kernel=True")
            linear_kernel = False
        if self.tensor_parallel is None:
            self.model = NativeDecoder(self.config, self.dtype, self.device, self.max_model_len, int8=self.int8,
                                       prepack=prepack, linear_kernel=linear_kernel, huge_pages=huge_pages)
        else:
            self.model = TensorParallelDecoder(self.config, self.dtype, self.device, self.max_model_len,
                                               tp=self.tensor_parallel, collectives=self.tp_collectives,
                                               int8=self.int8, prepack=prepack,
                                               linear_kernel=linear_kernel, huge_pages=huge_pages)
        self.model.attention_kernel = self._attention_kernel(attention_kernel)
        # the eager decode steps' rotary embedding and RMSNorm (torch's bits in fp32) as one C call each (cpu_step_ops.py)
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and not self.batch_invariant:
            self.model.step_ops = cpu_step_ops.load()
            # and each layer as two C calls in fp32, where those kernels all run; in bf16 the MLP gate as one, between
            # torch's projections (cpu_decode_layer.py, cpu_bf16_step.py)
            if self.tensor_parallel is None:
                self.model.layer_kernel = cpu_decode_layer.load()
            cpu_sampling.load()  # built now, not inside the first generate call (sampling.py takes it from there)
        if self.model.max_positions < self.max_model_len:  # longrope: its short factors only (rope.py)
            logger.warning("native rollout: %s's rope switches factors past %d positions; generating within "
                           "max_model_len=%d instead of %d", self.config.model_type, self.model.max_positions,
                           self.model.max_positions, self.max_model_len)
            self.max_model_len = self.model.max_positions
        loaded = {name for name, tensor in iter_checkpoint_tensors(model_path) if self.model.load(name, tensor)}
        if decode not in DECODE_MODES:
            raise ValueError(f"native rollout: decode={decode!r}; choose one of {list(DECODE_MODES)}")
        if decode == "graph":  # the device's fixed-shape replay (veRL's enforce_eager=false): on CPU the compiled step
            decode = "auto" if self.device.type == "cuda" else "compiled"
            decode = "eager" if self.tensor_parallel is not None else decode  # TP collectives are not compiled
        if decode == "auto":  # MoE expert dispatch has data-dependent shapes, which a CUDA graph cannot replay
            decode = "cuda_graph" if self.device.type == "cuda" and not self.model.shape.moe else "eager"
            decode = "eager" if self.tensor_parallel is not None else decode  # TP collectives are not captured
        if decode == "compiled" and self.tensor_parallel is not None:
            raise ValueError("native rollout: decode='compiled' does not compile the tensor-parallel collectives; "
                             "use decode='eager' (actor_rollout_ref.rollout.enforce_eager=true)")
        if decode == "cuda_graph" and self.tensor_parallel is not None:
            raise ValueError("native rollout: decode='cuda_graph' does not capture the tensor-parallel collectives; "
                             "use decode='eager' (actor_rollout_ref.rollout.enforce_eager=true)")
        if decode == "cuda_graph" and self.model.shape.moe:
            raise ValueError("native rollout: decode='cuda_graph' cannot capture the expert dispatch of a "
                             f"{self.config.model_type} checkpoint (data-dependent group sizes); use decode='eager' "
                             "(actor_rollout_ref.rollout.enforce_eager=true)")
        if decode == "cuda_graph" and self.device.type != "cuda":
            raise ValueError(f"native rollout: decode='cuda_graph' needs a CUDA device, this worker computes on "
                             f"{self.device.type}; use decode='eager' (or 'static' to test the fixed-shape step)")
        if self.batch_invariant:
            why = batch_invariant_refusal(self.model, decode=decode, int8=self.int8,
                                          tensor_parallel=self.tensor_parallel is not None)
            if why:
                raise ValueError(f"native rollout: actor_rollout_ref.model.batch_invariant=true, but {why}")
            decode = "eager"
        self.decode = decode
        self.free_cache_engine = bool(free_cache_engine)  # fixed-shape decode: drop its buffers after each call
        self._graphs = None if decode == "eager" else GraphDecoder(self.model, capture=decode == "cuda_graph",
                                                                     compiled=decode == "compiled")
        # routing replay (R3): the experts of every token go out with the batch as `routed_experts` (moe.py)
        if record_routes and not self.model.shape.moe:
            raise ValueError(f"native rollout: routing replay records MoE routes, but {model_path} "
                             f"({self.config.model_type}) has no routed experts; turn router_replay off")
        self.record_routes = bool(record_routes)
        missing = self.model.missing_names(loaded)
        if missing:
            raise ValueError(f"checkpoint {model_path} lacks {len(missing)} tensors the decoder needs: {missing[:6]}")

    def _attention_kernel(self, setting: bool | None):
        """cpu_attention's kernel for the eager decode steps, or None (torch matmuls); see the module docstring."""
        possible = self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
        if setting is None:
            return cpu_attention.load() if possible else None
        if not setting:
            return None
        if not possible:
            raise ValueError(f"native rollout: attention_kernel=True is the CPU kernel for fp32/bf16 caches; this "
                             f"engine computes on {self.device.type} in {self.dtype}. Leave it unset to choose by device")
        kernel = cpu_attention.load()
        if kernel is None:
            raise ValueError("native rollout: attention_kernel=True, but the CPU decode-attention kernel could not be "
                             "built (the warning above says why); leave it unset to fall back to torch matmuls")
        return kernel

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors (any device/dtype) into the fused weights, one at a time."""
        for name, tensor in named_tensors:
            self.model.load(name, tensor)
        self.weights_version = getattr(self, "weights_version", 0) + 1  # kept session K/V is stale (sessions.py)

    def open_sessions(self, **kwargs):
        """Multi-turn generation with each episode's K/V kept between its turns and turns batched continuously:
        a SessionEngine (sessions.py; kwargs: max_batch_size, max_cached_tokens, stop_token_ids)."""
        from hybridflow.engines.rollout.sessions import SessionEngine

        if self.batch_invariant:
            raise ValueError("native rollout: multi-turn sessions keep their own K/V layout, which is not the "
                             "batch-invariant one; set actor_rollout_ref.model.batch_invariant=false for agent runs")
        return SessionEngine(self, **kwargs)

    def update_weight_slices(self, named_slices: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensor parallel: this rank's slices of HF-named tensors (TensorParallelDecoder.tp_pieces), one at a time."""
        for name, part in named_slices:
            self.model.load_slice(name, part)

    def release_memory(self) -> None:
        # Eager decoding: the KV cache lives only inside generate(); give the allocator's cached blocks back.
        # Fixed-shape decoding keeps its step buffers, which its CUDA graphs point at (static_decode.py), unless
        # free_cache_engine: then they go too, and the next call allocates and captures again.
        if self._graphs is not None and self.free_cache_engine:
            self._graphs.release()
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
        seed = None if params.greedy else self._call_seed(params)
        cap, n = self.max_num_seqs, params.n
        if cap is None or len(prompts) * n <= cap:
            return self._generate(prompts, params, seed, 0)
        if cap < n:
            raise ValueError(f"native rollout: max_num_seqs={cap} is below n={n}; a prompt's samples decode together")
        per = cap // n  # prompts per decode batch
        parts = [self._generate(prompts[lo : lo + per], params, seed, lo) for lo in range(0, len(prompts), per)]
        width = max(p.batch["responses"].shape[1] for p in parts)
        return DataProto.concat([pad_responses(p, width, self.pad_token_id) for p in parts])

    def _generate(self, prompts: DataProto, params: SamplingParams, seed: int | None, first_prompt: int) -> DataProto:
        """One decode batch; `first_prompt`: the index of its first prompt in the whole call (its rows' streams)."""
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
        draws = None
        if seed is not None:
            draws = StepUniforms(row_keys(seed, first_prompt + row_index // n, row_index % n), max_new)

        routes = RouteRecorder(self.model, rows, P, max_new, n) if self.record_routes else None
        if routes is not None:
            routes.start()
        if self.batch_invariant:
            steps = BatchInvariantSteps(self, ids, pos, mask, n, max_new)
        elif self._graphs is None or routes is not None:  # recording reads each step's routes: the eager steps
            steps = _EagerSteps(self, ids, pos, mask, n, max_new)
        else:
            steps = _StaticSteps(self, ids, pos, mask, n, max_new)
        if routes is not None:
            routes.prefill_done(B)
        logits = steps.prefill_logits
        positions = pos[:, -1].repeat_interleave(n) + 1
        out = _Responses(rows, max_new, self.pad_token_id, stop_ids)
        in_c = None
        if type(steps) is _EagerSteps and routes is None and self.tensor_parallel is None:
            in_c = steps.c_loop(params, stop_ids, max_new)
        step = 0
        while True:
            if in_c is not None:  # choose, record and decode in C up to the end, or until stopped rows are dropped
                step, tokens, finished = in_c.run(steps.running, steps.row_bias, logits, positions, step, out, draws)
            else:
                tokens = out.record(step, *self._sample(logits, params, draws, step))
                finished = out.finished(step)
            if finished:
                break
            keep = steps.maybe_drop_stopped(out, step)
            if keep is not None:
                positions, tokens = positions[keep], tokens[keep]
                if draws is not None:
                    draws.keep(keep)
            if routes is not None:
                routes.start()
            logits = steps.decode(tokens, positions, step)
            if routes is not None:
                routes.step_done(out.row_index, step)
            positions = positions + 1
            step += 1
        result = assemble_output(prompts, read, out.tokens, out.lengths, out.log_probs, n, self.pad_token_id)
        if routes is not None:
            mask = result.batch["attention_mask"]
            recorded = routes.routes[:, : mask.shape[1]].to(mask.device)
            # padding (and what stopped rows computed after their stop) was routed too: not part of any row
            result.batch["routed_experts"] = recorded.masked_fill(~mask.bool()[:, :, None, None], -1)
        return result

    def _sample(self, logits: torch.Tensor, params: SamplingParams, draws: StepUniforms | None, step: int):
        tokens, log_probs = sample_tokens(logits, greedy=params.greedy, temperature=params.temperature,
                                          top_k=params.top_k, top_p=params.top_p, keys=None, step=step,
                                          uniforms=None if draws is None else draws.at(step))
        return same_tokens(tokens, self.tp_collectives), log_probs


class _Responses:
    """What a decode loop has produced: per output row the tokens, log-probs and length so far; per running slot
    its output row and whether it has stopped. Slots that stopped but still run write past their length;
    assemble_output masks that away."""

    def __init__(self, rows: int, max_new: int, pad_token_id: int, stop_ids: torch.Tensor):
        device = stop_ids.device
        self.tokens = torch.full((rows, max_new), pad_token_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(rows, max_new, dtype=torch.float32, device=device)
        self.lengths = torch.full((rows,), max_new, dtype=torch.long, device=device)
        self.row_index = torch.arange(rows, device=device)  # output row of each running slot
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stop_ids, self.max_new, self.n_done = stop_ids, max_new, 0

    @property
    def running(self) -> int:
        return self.done.numel()

    def record(self, step: int, tokens: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
        """Store step `step`'s sampled tokens [running] and their log-probs; returns the tokens."""
        if self.row_index.numel() == self.tokens.shape[0]:  # no slot dropped yet: slot i is row i
            self.tokens[:, step] = tokens
            self.log_probs[:, step] = log_probs
        else:
            self.tokens[self.row_index, step] = tokens
            self.log_probs[self.row_index, step] = log_probs
        stopped = torch.isin(tokens, self.stop_ids) & ~self.done
        stops = int(stopped.sum())
        if stops:
            self.lengths[self.row_index[stopped]] = step + 1
            self.done |= stopped
            self.n_done += stops
        return tokens

    def finished(self, step: int) -> bool:
        return step == self.max_new - 1 or self.n_done == self.running

    def keep_running(self) -> torch.Tensor:
        """Drop the stopped slots; returns the indices of the kept ones (to apply to the loop's own per-slot state)."""
        keep = (~self.done).nonzero().squeeze(-1)
        self.row_index, self.done, self.n_done = self.row_index[keep], self.done[keep], 0
        return keep


class _EagerSteps:
    """Decode steps with dynamic shapes: a KV cache sized for this call (kv_cache.py), stopped rows compacted away."""

    def __init__(self, engine: NativeRollout, ids, pos, mask, n: int, max_new: int):
        B, P = ids.shape
        shape, self.model, self.n = engine.model.shape, engine.model, n
        self.compact_fraction = engine.compact_fraction
        self.cache = KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, prompts=B, prompt_len=P, n=n,
                             max_new=max_new, dtype=engine.dtype, device=engine.device)
        # additive mask of each prompt slot's keys: 0, or -inf at left padding
        prompt_bias = torch.zeros(B, P, dtype=engine.dtype, device=engine.device)
        prompt_bias.masked_fill_(~mask.bool(), float("-inf"))
        rows = torch.arange(B * n, device=engine.device)
        self.running = RunningRows(prompt_index=rows // n, sample_index=rows % n, n=n)
        self.row_bias = prompt_bias[self.running.prompt_index]  # [rows, P], follows the rows through compaction
        self.prefill_logits = chunked_prefill(self.model, ids, pos, mask, self.cache,
                                              engine.max_num_batched_tokens).repeat_interleave(n, dim=0)

    def maybe_drop_stopped(self, out: _Responses, step: int) -> torch.Tensor | None:
        if not (out.n_done and out.n_done >= self.compact_fraction * out.running):
            return None
        keep = out.keep_running()
        self.cache.compact(keep, step)
        # a prompt's samples may finish at different steps: shared prompt K/V is found by index from now on
        self.running = RunningRows(self.running.prompt_index[keep], self.running.sample_index[keep], self.n,
                                   grouped=False)
        self.row_bias = self.row_bias[keep]
        return keep

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
        return self.model.decode(tokens, positions, self.cache, self.running, self.row_bias, column=step)

    def c_loop(self, params: SamplingParams, stop_ids: torch.Tensor, max_new: int):
        """The decode loop in C (cpu_decode_layer.DecodeLoop; in bf16 cpu_bf16_step.loop) where its steps are one C
        call each; None elsewhere (the loop stays in Python)."""
        kernel = self.model.layer_kernel
        if not isinstance(kernel, cpu_decode_layer.DecodeLayerKernel):
            return None
        options = dict(greedy=params.greedy, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       stop_ids=stop_ids, max_new=max_new, compact_fraction=self.compact_fraction)
        if self.model.dtype == torch.bfloat16:
            return cpu_bf16_step.loop(self.model, self.cache, self.row_bias, kernel, **options)
        return kernel.loop(self.model, self.cache, self.row_bias, **options)


class _StaticSteps:
    """Decode steps on fixed-shape buffers kept across calls (static_decode.py): CUDA graphs on GPUs."""

    def __init__(self, engine: NativeRollout, ids, pos, mask, n: int, max_new: int):
        B, P = ids.shape
        self.graphs, self.prompt_len = engine._graphs, P
        self.buffers = self.graphs.buffers(B * n, P + max_new)
        writer = self.graphs.prompt_writer(self.buffers, mask, n)
        self.prefill_logits = chunked_prefill(engine.model, ids, pos, mask, writer,
                                              engine.max_num_batched_tokens).repeat_interleave(n, dim=0)

    def maybe_drop_stopped(self, out: _Responses, step: int) -> torch.Tensor | None:
        if out.running - out.n_done > self.buffers.rows // 2:
            return None
        keep = out.keep_running()  # the live rows fit a smaller bucket: move there
        self.buffers = self.graphs.shrink(self.buffers, keep, self.prompt_len + step)
        return keep

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
        return self.graphs.step(self.buffers, tokens, positions, column=self.prompt_len + step)
