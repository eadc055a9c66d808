"""Fixed-shape decode steps for the native rollout, replayed as CUDA graphs on GPUs.

On a GPU a decode step of a small or mid-sized model is a few hundred tiny kernels, and launching them from Python
costs more than running them: the eager loop of native_rollout.py ran at 12.7k new tokens/s at batch 64 on an H200
(5 ms a step), hf ``generate`` at 8.9k. Capturing the step once as a CUDA graph and replaying it launches the whole
step at once.

A graph replays fixed shapes at fixed addresses, so this path keeps everything a step touches in persistent buffers
(``StepBuffers``), one set per (row bucket, length bucket):
  * rows are padded to a power of two; padding rows compute garbage that is never read;
  * the KV cache is ``[rows, kv_heads, length, head_dim]`` per layer, with length a power of two >= prompt +
    max_new_tokens; attention always spans the whole length, and ``key_valid`` masks the left padding and the
    columns not generated yet (one more column turns valid each step, inside the graph);
  * the step's inputs (tokens, positions, the cache column to write) are copied into the buffers before a replay and
    its logits read from ``logits`` after it.
Each prompt is prefilled once and its K/V copied into its n samples' rows. When at most half of a bucket's rows are
still running, the live rows move to the next smaller bucket (its graph is captured on first use).

Buffers and graphs persist between ``generate`` calls (a training loop repeats the same shapes): the KV cache is not
freed after generation on this path unless the engine has ``free_cache_engine=True`` (then the next call allocates
and captures again). ``decode="eager"`` frees it and uses no graphs. ``decode="static"`` runs the same
fixed-shape step without capturing it (any device): that is how the CPU tests check this path's arithmetic.
``decode="compiled"`` runs the step compiled by torch.compile (compiled_step.py), the CPU counterpart of a graph;
``decode="graph"`` is whichever of the two the device has (CUDA graphs on GPUs, compiled on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DECODE_MODES", "GraphDecoder", "StepBuffers", "bucket"]

DECODE_MODES = ("auto", "eager", "static", "compiled", "cuda_graph", "graph")
_MIN_LENGTH = 64


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


@dataclass
class StepBuffers:
    """Everything one fixed-shape decode step reads or writes (see the module docstring)."""

    keys: list[torch.Tensor]  # per layer [rows, kv_heads, length, head_dim]
    values: list[torch.Tensor]
    key_valid: torch.Tensor  # [rows, length] bool: prompt tokens and generated tokens so far
    tokens: torch.Tensor  # [rows] long, the tokens to feed
    positions: torch.Tensor  # [rows] long, their positions
    column: torch.Tensor  # [1] long, the cache column this step writes
    logits: torch.Tensor  # [rows, vocab] fp32, the step's output
    graph: object | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.key_valid.shape[1]


@dataclass
class _PromptWriter:
    """The prefill's cache interface (``write_prompts``), writing each prompt's K/V into its n samples' rows."""

    buffers: StepBuffers
    n: int

    def write_prompts(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        rows, P = keys.shape[0] * self.n, keys.shape[2]
        self.buffers.keys[layer][:rows, :, :P] = keys.repeat_interleave(self.n, dim=0)
        self.buffers.values[layer][:rows, :, :P] = values.repeat_interleave(self.n, dim=0)


@dataclass
class GraphDecoder:
    """Step buffers (and CUDA graphs, when ``capture``) of one NativeDecoder, kept across generate calls."""

    model: object  # NativeDecoder
    capture: bool
    compiled: bool = False  # run the step compiled by inductor (compiled_step.py) instead of capturing it
    _buffers: dict[tuple[int, int], StepBuffers] = field(default_factory=dict)
    _pool: object | None = None
    _compiled_step: object | None = None

    def buffers(self, rows: int, length: int) -> StepBuffers:
        key = (bucket(rows), bucket(length, _MIN_LENGTH))
        if key not in self._buffers:
            self._buffers[key] = self._allocate(*key)
        return self._buffers[key]

    def _allocate(self, rows: int, length: int) -> StepBuffers:
        m = self.model
        s, dtype, device = m.shape, m.dtype, m.device

        def cache() -> list[torch.Tensor]:
            return [torch.zeros(rows, s.num_kv_heads, length, s.head_dim, dtype=dtype, device=device)
                    for _ in range(s.num_layers)]

        return StepBuffers(
            keys=cache(),
            values=cache(),
            key_valid=torch.zeros(rows, length, dtype=torch.bool, device=device),
            tokens=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            column=torch.zeros(1, dtype=torch.long, device=device),
            # a tensor-parallel decoder's shape holds its vocabulary slice; its logits are the full vocabulary
            logits=torch.zeros(rows, getattr(m, "full_shape", s).vocab_size, dtype=torch.float32, device=device),
        )

    def prompt_writer(self, buffers: StepBuffers, prompt_mask: torch.Tensor, n: int) -> _PromptWriter:
        """Reset `buffers` for a call whose prompts have mask [B, P]; the prefill then writes through the result."""
        rows, P = prompt_mask.shape[0] * n, prompt_mask.shape[1]
        buffers.key_valid.zero_()
        buffers.key_valid[:rows, :P] = prompt_mask.bool().repeat_interleave(n, dim=0)
        buffers.key_valid[rows:, 0] = True  # padding rows attend to something: finite garbage instead of NaN
        return _PromptWriter(buffers, n)

    def step(self, buffers: StepBuffers, tokens: torch.Tensor, positions: torch.Tensor, column: int) -> torch.Tensor:
        """Feed tokens/positions [r] (r <= rows) into cache column `column`; returns the logits [r, vocab]."""
        r = tokens.shape[0]
        buffers.tokens[:r] = tokens
        buffers.positions[:r] = positions
        buffers.column.fill_(column)
        if self.compiled:
            if self._compiled_step is None:
                from hybridflow.engines.rollout.compiled_step import compile_decode_step

                self._compiled_step = compile_decode_step(self.model)
            self._compiled_step(buffers)
        elif not self.capture:
            self.model.decode_static(buffers)
        elif buffers.graph is None:
            self._capture(buffers)
        else:
            buffers.graph.replay()
        return buffers.logits[:r]

    def _capture(self, buffers: StepBuffers) -> None:
        """Warm up on a side stream, capture one step, then replay it (capturing runs no kernels)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.decode_static(buffers)  # idempotent: the same step again, same column, same values
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: they share one pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.model.decode_static(buffers)
        graph.replay()
        buffers.graph = graph

    def shrink(self, buffers: StepBuffers, keep: torch.Tensor, columns: int) -> StepBuffers:
        """Move rows `keep` (their first `columns` cache columns) to the front of a smaller bucket's buffers."""
        m = keep.numel()
        target = self.buffers(m, buffers.length)
        if target is buffers:
            return buffers
        for src, dst in zip((*buffers.keys, *buffers.values), (*target.keys, *target.values)):
            dst[:m, :, :columns] = src[keep, :, :columns]
        target.key_valid.zero_()
        target.key_valid[:m, :columns] = buffers.key_valid[keep, :columns]
        target.key_valid[m:, 0] = True
        return target

    def release(self) -> None:
        self._buffers.clear()
        self._pool = None
