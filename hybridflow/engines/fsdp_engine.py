"""The training engine: a transformers model sharded with FSDP2 over a data-parallel mesh, SPMD on every rank.

One engine per rank. The driver-side worker hands each rank its shard of a batch (rollout/base.py layout) and calls
  * ``compute_log_prob``  log p(response token | everything before it) at a temperature, optionally entropy;
  * ``compute_values``    the critic's V(state before each response token);
  * ``train_step``        one optimizer step on one mini-batch: micro-batches -> forward -> loss_fn -> backward,
                          then global-norm clipping and AdamW;
  * weight / checkpoint I/O: ``named_full_parameters``, ``full_state_dict``, ``save_checkpoint``, ``save_hf_model``.

Without torch.distributed (or with one rank) the model is a plain module; with more ranks every decoder layer and then
the root are ``fully_shard``-ed over a 1-D ``dp`` mesh (or a 2-D ``(replicate, shard)`` mesh when fsdp_size divides
the world). Rows are stripped to their real tokens and packed end to end into one row per micro-batch (packing.py)
wherever packing applies (``use_sequence_packing`` None, `engine_config.why_not_packed`), else bucketed by length
with the little padding a bucket needs (micro_batch.py). The loss contract: loss_fn returns this micro-batch's share
of the mini-batch mean (divide by ``micro.meta_info["global_num_tokens"]`` or ``["global_num_seqs"]``), so gradients
are summed over micro-batches and ranks as they are, never averaged again. The settings: `EngineConfig`
(engine_config.py).

Offload (accelerators only; on CPU both switches change nothing). ``param_offload``: parameters (and gradients) stay
in host memory between engine calls. Sharded, that is FSDP2's ``CPUOffloadPolicy`` (shards are copied in per layer,
the optimizer steps on the host); on one rank the whole model is moved to the device for each call and back after it.
``optimizer_offload``: the AdamW state is moved to the parameters' device for ``optimizer.step()`` and back to host
memory right after, so between updates (rollout, log-prob passes) it holds no device memory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridflow import device as hf_device
from hybridflow.common.files import umask_modes
from hybridflow.common.metrics import reduce_metrics
from hybridflow.engines import micro_batch as mb
from hybridflow.engines import packing
from hybridflow.engines.batch_invariant import (
    ROW_MULTIPLE,
    enable_batch_invariant_attention,
    onednn_matmuls,
)
from hybridflow.engines.checkpoint_io import load_engine_state, save_engine_state
from hybridflow.engines.cpu_flash_attention import flash_attention_here, use_flash_attention
from hybridflow.engines.cpu_train_ops import fused_ops_here, use_fused_ops
from hybridflow.engines.engine_config import PARAM_DTYPES, EngineConfig, why_not_packed
from hybridflow.engines.hf_model import (
    HeadOnPositions,
    drop_hub_kernels,
    hf_name,
    load_model,
    load_tokenizer,
    store_frozen_projections_in,
)
from hybridflow.engines.lora import adapter_disabled, apply_lora, base_name, merged_parameters
from hybridflow.engines.moe_train import RouterTap, aux_loss_coef, is_mixture_of_experts
from hybridflow.engines.onednn_train import onednn_training, use_onednn_linears
from hybridflow.engines.optim import OptimConfig, build_lr_scheduler, build_optimizer
from hybridflow.protocol import DataProto

__all__ = ["EngineConfig", "FSDPEngine", "LossFn", "OptimConfig"]

logger = logging.getLogger(__name__)

# loss_fn(micro, outputs) -> (loss, metrics). outputs: {"log_probs": [b, R], "entropy": [b, R]} or {"values": [b, R]}.
LossFn = Callable[[DataProto, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]]


class FSDPEngine:
    """Holds the (sharded) model, optimizer and LR schedule of one rank. See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        hf_device.set_num_threads(config.num_threads)
        hf_device.keep_freed_host_memory()
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.device = hf_device.current_device()
        self.compute_dtype = PARAM_DTYPES[config.param_dtype]
        self.is_critic = config.role == "critic"
        self.trainable = config.role != "ref"

        self.train_mesh = self._build_train_mesh()
        self.tokenizer = load_tokenizer(config.model_path)
        torch.manual_seed(config.seed)  # a fresh value head must be identical on every rank
        hf_model = load_model(config.model_path, config.role, dtype=PARAM_DTYPES[config.model_dtype])
        if self.device.type == "cpu":
            drop_hub_kernels(hf_model)
        if config.buffer_dtype != "fp32":
            _cast_buffers(hf_model, PARAM_DTYPES[config.buffer_dtype])
        self.hf_config = hf_model.config
        # MoE routers: load-balancing loss and balance statistics in training (an empty tap on dense models)
        self.router_tap = RouterTap(hf_model, aux_loss_coef(hf_model.config, config.router_aux_loss_coef)
                                    if self.trainable and not self.is_critic else 0.0)
        self._router_terms: tuple[torch.Tensor | None, dict[str, float]] = (None, {})
        if config.router_replay and not len(self.router_tap):
            raise ValueError(f"router_replay is on but {config.model_path} ({hf_model.config.model_type}) has no "
                             "MoE routers; turn actor_rollout_ref.actor.router_replay.mode off (disabled)")
        # PEFT injects its layers into hf_model in place; the PeftModel wrapper is kept outside the module tree (its
        # parameters are hf_model's) for disable_adapter() and its adapter save_pretrained.
        self.peft_model = apply_lora(hf_model, config.lora) if config.lora.enabled else None
        if config.gradient_checkpointing and self.trainable:
            # Non-reentrant recompute composes with FSDP2's hooks; transformers 5 renamed the switch.
            if hasattr(hf_model, "activation_checkpointing_enable"):
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.trainable:
            hf_model.requires_grad_(False)
        self.packing = self._choose_packing(hf_model)
        self.share_prompts = self._choose_prompt_sharing(hf_model)
        if config.batch_invariant:
            enable_batch_invariant_attention(hf_model)
        # fp32 products by oneDNN (onednn_train.py); batch-invariant mode needs the rollout's kernels where it has them
        linears = onednn_matmuls(self.device) if config.batch_invariant else config.onednn_linears
        hidden = getattr(hf_model.config.get_text_config(), "hidden_size", None)
        if config.tensor_parallel_size == 1 and onednn_training(self.device, self.compute_dtype, linears, hidden):
            use_onednn_linears(hf_model)
        if (config.tensor_parallel_size == 1 and not config.batch_invariant
                and fused_ops_here(self.device, self.compute_dtype, config.fused_cpu_ops)):
            use_fused_ops(hf_model)
        if (self.packing and not config.batch_invariant
                and flash_attention_here(self.device, config.cpu_flash_attention)):
            use_flash_attention(hf_model)
        self.model: nn.Module = self._wrap(hf_model)
        self._module_list: list[nn.Module] | None = None  # _set_training's, listed on first use
        self.model.entropy_checkpointing = config.entropy_checkpointing
        self.model.logits_checkpointing = config.logits_checkpointing
        self.model.row_multiple = ROW_MULTIPLE if config.batch_invariant else 1
        self.sharded = self.distributed and self.world_size > 1
        if (not self.trainable or self.peft_model is not None) and self.train_mesh is None:
            store_frozen_projections_in(hf_model, self.compute_dtype)  # before sharding: bf16 shards
        offload = self.device.type != "cpu"
        # param_offload on one rank: no FSDP offload policy to do it, so the engine moves the model per call
        self._move_params = offload and config.param_offload and not self.sharded
        self._offload_optimizer = offload and config.optimizer_offload
        if self.sharded:
            self._shard()
        elif not self._move_params:
            self.model.to(self.device)

        self.optimizer = build_optimizer(self.model.parameters(), config.optim) if self.trainable else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.optim) if self.trainable else None
        self.global_step = 0

    # ------------------------------------------------------------------ setup
    def _choose_prompt_sharing(self, hf_model: nn.Module) -> bool:
        """EngineConfig.share_prompts resolved: why not, where it cannot run (packing off, flash-attn's varlen kernel
        on CUDA, router replay, a mixture-of-experts model, whose router statistics count tokens)."""
        c = self.config
        moe = is_mixture_of_experts(hf_model.config)
        flash = self.device.type == "cuda" and packing._flash_varlen() is not None
        reason = ("the engine does not pack (use_sequence_packing)" if not self.packing else
                  "flash-attn's varlen kernel runs the packed attention" if flash else
                  "router replay is on" if c.router_replay else "the model routes experts" if moe else None)
        if c.share_prompts and reason is not None:
            raise ValueError(f"share_prompts=True cannot run here: {reason}; leave it unset (None) to choose")
        return reason is None if c.share_prompts is None else bool(c.share_prompts)

    def _choose_packing(self, hf_model: nn.Module) -> bool:
        """Switch `hf_model` to packed attention when use_sequence_packing is True, or None and packing applies
        (`why_not_packed` is None); returns whether this engine packs its micro-batches."""
        c = self.config
        if c.use_sequence_packing is None:
            why_not = why_not_packed(c, hf_model.config)
            if why_not:
                logger.info("%s engine: micro-batches bucketed by length, not packed: %s", c.role, why_not)
                return False
        elif not c.use_sequence_packing:
            return False
        try:
            packing.enable_packed_attention(hf_model)
        except ValueError as err:
            if c.use_sequence_packing:
                raise
            logger.info("%s engine: micro-batches bucketed by length, not packed: %s", c.role, err)
            return False
        return True

    def _build_train_mesh(self):
        """The (dp, sp, tp) mesh when tensor or sequence parallelism is on, else None (plain FSDP below)."""
        tp, sp = self.config.tensor_parallel_size, self.config.ulysses_sequence_parallel_size
        if tp == 1 and sp == 1:
            return None
        from hybridflow.engines.train_mesh import build_train_mesh, check_mesh_sizes

        check_mesh_sizes(self.world_size, tp, sp, self.config.fsdp_size, where=f"{self.config.role} engine")
        if not self.distributed:
            raise ValueError(f"tensor_model_parallel_size={tp} / ulysses_sequence_parallel_size={sp} need "
                             "torch.distributed with tp * sp ranks; this engine runs without a process group")
        return build_train_mesh(hf_device.device_name(), self.world_size, self.rank, tp, sp)

    def _wrap(self, hf_model: nn.Module) -> nn.Module:
        """HeadOnPositions, tensor-parallel projections (before FSDP) and the sequence-parallel head where asked."""
        mesh = self.train_mesh
        if mesh is None:
            return HeadOnPositions(hf_model, is_critic=self.is_critic)
        from hybridflow.engines.tensor_parallel_train import apply_tensor_parallel, check_tensor_parallel
        from hybridflow.engines.ulysses import SequenceParallelHead, check_sequence_parallel

        check_tensor_parallel(hf_model.config, mesh.tp_size)
        check_sequence_parallel(hf_model.config, mesh.sp_size, mesh.tp_size)
        if mesh.tp_size > 1:
            apply_tensor_parallel(hf_model, mesh.tp_mesh)
        if mesh.sp_size > 1:
            return SequenceParallelHead(hf_model, self.is_critic, mesh.sp_group, mesh.sp_size, mesh.sp_rank)
        return HeadOnPositions(hf_model, is_critic=self.is_critic)

    @property
    def _grad_ranks(self) -> int:
        """Ranks FSDP averages gradients over (the loss is scaled by it so that they add up instead)."""
        return self.train_mesh.fsdp_size if self.train_mesh is not None else self.world_size

    def _gather_rows(self, data: DataProto) -> tuple[DataProto, slice]:
        """The rows this rank computes (its model group's) and where its own rows sit in them."""
        if self.train_mesh is None:
            return data, slice(0, len(data))
        return self.train_mesh.gather_rows(data)

    def _shard(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        fsdp_size = self.config.fsdp_size if self.config.fsdp_size > 0 else self.world_size
        if self.world_size % fsdp_size:
            raise ValueError(f"fsdp_size {fsdp_size} must divide the world size {self.world_size}")
        kind = hf_device.device_name()
        if self.train_mesh is not None:
            self.mesh = self.train_mesh.fsdp_mesh  # TP parameters are DTensors on the tp dim of the same mesh
        else:
            from hybridflow.engines.shm_process_group import shm_backend_override

            sizes = ({"dp": self.world_size} if fsdp_size == self.world_size
                     else {"replicate": self.world_size // fsdp_size, "shard": fsdp_size})
            # on one host's CPUs FSDP's all-gathers and reduce-scatters go through shared memory, not gloo's TCP
            override = shm_backend_override(kind, sizes) if self.distributed else None
            self.mesh = init_device_mesh(kind, tuple(sizes.values()), mesh_dim_names=tuple(sizes),
                                         backend_override=override)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        reduce = PARAM_DTYPES[self.config.reduce_dtype]
        if self.compute_dtype != torch.float32 or reduce != torch.float32:
            # Gather parameters in bf16 for compute; reduce gradients in fp32 (unless reduce_dtype says bf16) into
            # the master shards.
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype, reduce_dtype=reduce)
        if self.config.param_offload and kind != "cpu":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        backbone = getattr(self.model.hf, self.model.hf.base_model_prefix)
        layers = getattr(backbone, "layers", None)
        if layers is None:
            raise ValueError(
                f"{type(backbone).__name__} has no .layers list of decoder layers to shard; "
                "the engine supports Llama/Qwen2-style models"
            )
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(self.model, **kwargs)
        if self.config.forward_prefetch:
            # layer i+1's parameters are gathered while layer i computes, instead of when layer i+1 is reached
            for here, after in itertools.pairwise(layers):
                here.set_modules_to_forward_prefetch([after])

    def _reshard(self) -> None:
        """Put every FSDP module back to its sharded parameters.

        FSDP2 leaves the root unsharded after a forward without backward (to save an all-gather before the backward);
        weight I/O and the optimizer expect the sharded parameters, so no-grad passes end here.
        """
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """All-reduce a small cpu tensor over all ranks (through the device: nccl only reduces device tensors)."""
        if not (self.distributed and self.world_size > 1):
            return t
        on_device = t.to(self.device)
        dist.all_reduce(on_device, op=op or dist.ReduceOp.SUM)
        return on_device.cpu()

    # ------------------------------------------------------------------ micro-batches
    def _plan(self, data: DataProto, *, inference: bool = False) -> list[list[int]]:
        """Row groups of this rank's shard; every rank gets the same number of groups. inference=True: the
        forward-only sizes (``infer_*``) where set."""
        c = self.config
        dynamic, budget, rows = c.use_dynamic_bsz, c.max_tokens_per_micro_batch, c.micro_batch_size_per_gpu
        if inference:
            dynamic = dynamic if c.infer_use_dynamic_bsz is None else c.infer_use_dynamic_bsz
            budget = budget if c.infer_max_tokens_per_micro_batch is None else c.infer_max_tokens_per_micro_batch
            rows = rows if c.infer_micro_batch_size_per_gpu is None else c.infer_micro_batch_size_per_gpu
        attention_mask = data.batch["attention_mask"]
        starts, ends = mb.real_token_spans(attention_mask)
        if self.config.use_remove_padding or self.packing:
            lengths = (ends - starts).tolist()
        else:
            lengths = [attention_mask.shape[1]] * len(data)
        packed_budget = dynamic and self.packing  # a packed micro-batch holds its rows' summed length: no padding
        if packed_budget:
            groups = mb.packed_micro_batches(lengths, budget)
        elif dynamic:
            groups = mb.token_budget_micro_batches(lengths, budget)
        else:
            groups = mb.fixed_size_micro_batches(lengths, rows, sort=True)
        # Each micro-batch forward is a collective under FSDP: all ranks must run the same number of them.
        count = int(self._all_reduce(torch.tensor([len(groups)]), dist.ReduceOp.MAX).item())
        if count != len(groups):
            if packed_budget:
                groups = mb.packed_micro_batches(lengths, budget, num_micro_batches=count)
            else:
                groups = mb.split_to_count(groups, lengths, count)
        return groups

    def _forward(self, rows: DataProto, *, temperature: float, calculate_entropy: bool,
                 calculate_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """One micro-batch forward -> outputs laid out ``[b, R]`` (zeros past each response)."""
        batch = rows.batch
        responses = batch["responses"]
        b, resp_len = responses.shape
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = (batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        args = (batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device), position_ids.to(self.device))
        pad = self.tokenizer.pad_token_id or 0
        if self.packing:
            bucket = packing.build_packed(*args, resp_len, pad_token_id=pad, share_prompts=self.share_prompts)
            attention_kwargs = bucket.attention_kwargs()
        else:
            bucket = mb.build_bucket(*args, resp_len, remove_padding=self.config.use_remove_padding, pad_token_id=pad,
                                     width_multiple=ROW_MULTIPLE if self.config.batch_invariant else 1)
            attention_kwargs = None
        self.router_tap.set_replay(self._replay_routes(batch, bucket) if self.config.router_replay else None)
        with self._autocast(), self.router_tap.capture():
            flat = self.model(
                bucket.input_ids,
                bucket.position_ids,
                bucket.attention_mask,
                bucket.select_rows,
                bucket.select_cols,
                bucket.target_ids,
                temperature=temperature,
                calculate_entropy=calculate_entropy,
                chunk_size=self.config.entropy_chunk_size,
                **({"attention_kwargs": attention_kwargs} if attention_kwargs is not None else {}),
                **({"calculate_sum_pi_squared": True} if calculate_sum_pi_squared else {}),
            )
        if self.model.training and len(self.router_tap):
            mask = bucket.attention_mask
            if self.packing:  # one row of real tokens only
                mask = None
            elif mask is None:  # rows stripped to their real tokens, then right-padded to the longest: route only those
                starts, ends = mb.real_token_spans(batch["attention_mask"])
                width = bucket.input_ids.shape[1]
                mask = (torch.arange(width)[None, :] < (ends - starts)[:, None]).to(self.device)
            self._router_terms = (self.router_tap.aux_loss(mask), self.router_tap.stats(mask))
        out = {}
        for key, values in flat.items():
            grid = values.new_zeros(b, resp_len)
            out[key] = grid.index_put((bucket.out_rows, bucket.out_cols), values)
        return out

    def _replay_routes(self, batch, bucket: mb.Bucket) -> torch.Tensor:
        """The rollout's routes ``routed_experts [b, S, layers, k]`` in the bucket's token order -> ``[T, layers, k]``
        (-1 at padding: routed freely, never used)."""
        routes = batch.get("routed_experts")
        if routes is None:
            raise ValueError("router_replay is on but the batch has no routed_experts column: the rollout records "
                             "them (actor_rollout_ref.rollout.name=native with router_replay.mode=R3)")
        if routes.shape[:2] != batch["attention_mask"].shape:
            raise ValueError(f"routing replay: routed_experts covers {tuple(routes.shape[:2])} [rows, tokens] but the "
                             f"batch is {tuple(batch['attention_mask'].shape)}; the routes must come with their rows")
        if bucket.attention_mask is None:  # rows stripped to their real tokens, right-padded to the longest
            starts, ends = mb.real_token_spans(batch["attention_mask"])
            packed = self.packing  # bucket [1, T]: the rows' real tokens, in row order
            width = int((ends - starts).max()) if packed else bucket.input_ids.shape[1]
            cols = torch.arange(width, device=routes.device)
            src = (starts[:, None] + cols[None, :]).clamp(max=routes.shape[1] - 1)
            routes = routes.gather(1, src[:, :, None, None].expand(-1, -1, *routes.shape[2:]))
            padding = cols[None, :] >= (ends - starts)[:, None]
            if packed:
                return routes[~padding].to(self.device)
            routes = routes.masked_fill(padding[:, :, None, None], -1)
        return routes.reshape(-1, *routes.shape[2:]).to(self.device)

    def _set_training(self, mode: bool) -> None:
        """model.train(mode) where some module is in the other mode: each call walks the whole module tree through
        transformers' override (68 us on the tiny two-layer model, against ~2 us for this check). The tree is fixed
        once the engine is built, so its modules are listed once."""
        if self._module_list is None:
            self._module_list = list(self.model.modules())
        if any(module.training != mode for module in self._module_list):
            self.model.train(mode)

    @contextlib.contextmanager
    def _params_on_device(self):
        """param_offload on one rank: bring the model to the device for one call, send it back to host after."""
        if not self._move_params:
            yield
            return
        self.model.to(self.device)
        try:
            yield
        finally:
            self.model.to("cpu")
            hf_device.empty_cache()

    def _run_no_grad(self, data: DataProto, **kwargs: Any) -> dict[str, torch.Tensor]:
        data, own = self._gather_rows(data)
        self._set_training(False)
        results: dict[str, torch.Tensor] = {}
        with torch.no_grad(), self._params_on_device():
            for group in self._plan(data, inference=True):
                outs = self._forward(data[group], **kwargs)
                for key, value in outs.items():
                    if key not in results:
                        results[key] = value.new_zeros(len(data), value.shape[1])
                    results[key][torch.as_tensor(group, device=value.device)] = value
        self._reshard()
        return {k: v[own].cpu() for k, v in results.items()}

    # ------------------------------------------------------------------ forward-only operations
    def compute_log_prob(
        self, data: DataProto, *, temperature: float, calculate_entropy: bool = False, base: bool = False
    ) -> dict[str, torch.Tensor]:
        """``{"log_probs": [B, R], "entropy": [B, R] (if asked)}`` float32 on cpu; rows in `data`'s order.

        ``log_probs[:, t]`` = log softmax(logits / temperature)[responses[:, t]] given everything before it; 0 past
        the end of each response. No grad, eval mode. base=True: with the LoRA adapter disabled (the reference
        policy of a LoRA run); the same as base=False without LoRA.
        """
        if self.is_critic:
            raise ValueError("compute_log_prob was called on a critic engine; use compute_values")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature} (greedy rollouts score at temperature 1)")
        with adapter_disabled(self.peft_model if base else None):
            return self._run_no_grad(data, temperature=temperature, calculate_entropy=calculate_entropy)

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Critic ``values [B, R]`` float32 on cpu: ``values[:, t]`` = V(hidden state at position P - 1 + t)."""
        if not self.is_critic:
            raise ValueError(f"compute_values needs a critic engine, this one is role={self.config.role!r}")
        return self._run_no_grad(data, temperature=1.0, calculate_entropy=False)["values"]

    # ------------------------------------------------------------------ training
    def train_step(self, data: DataProto, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on this rank's shard of one mini-batch.

        Sets ``micro.meta_info["global_num_tokens"]`` (response_mask summed over the mini-batch on all ranks),
        ``["global_num_seqs"]`` and ``["dp_size"]`` before each ``loss_fn(micro, outputs)`` call. Returns
        ``grad_norm`` (before clipping), ``lr`` (used by this step), ``skipped_nonfinite`` (1.0 when a non-finite loss or
        gradient norm skipped the update) and this rank's mean over micro-batches of loss_fn's numeric metrics.
        """
        if not self.trainable:
            raise ValueError("train_step was called on a ref engine (no optimizer); build it with role='actor'")
        self.optimizer.zero_grad(set_to_none=True)
        with self._params_on_device():
            result, local_nonfinite = self._accumulate(data, loss_fn)
            grad_norm = self._clip_grad_norm()
            nonfinite = self._all_reduce(torch.tensor([local_nonfinite]), dist.ReduceOp.MAX).item()
            lr = float(self.optimizer.param_groups[0]["lr"])
            skipped = nonfinite > 0 or not math.isfinite(grad_norm)
            if not skipped:
                self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        result.update({"grad_norm": grad_norm, "lr": lr, "skipped_nonfinite": 1.0 if skipped else 0.0})
        return result

    def forward_backward(self, data: DataProto, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients of one mini-batch shard into ``.grad`` without stepping (train_step minus the update).

        Same micro-batching and loss contract as `train_step`; returns the mean of loss_fn's numeric metrics.
        """
        if not self.trainable:
            raise ValueError("forward_backward was called on a ref engine (no optimizer); build it with role='actor'")
        with self._params_on_device():
            return self._accumulate(data, loss_fn)[0]

    def _optimizer_step(self) -> None:
        """optimizer.step(), with the AdamW state brought to the parameters' device first under optimizer_offload."""
        if not self._offload_optimizer:
            self.optimizer.step()
            return
        param_device = next(p for p in self.model.parameters() if p.requires_grad).device
        _move_optimizer_state(self.optimizer, param_device)
        self.optimizer.step()
        _move_optimizer_state(self.optimizer, torch.device("cpu"))
        hf_device.empty_cache()

    def _accumulate(self, data: DataProto, loss_fn: LossFn) -> tuple[dict[str, float], float]:
        temperature = float(data.meta_info.get("temperature", 1.0))
        calculate_entropy = bool(data.meta_info.get("calculate_entropy", False))
        sum_pi_squared = bool(data.meta_info.get("calculate_sum_pi_squared", False))  # veRL's diagnostic
        response_mask = data.batch.get("response_mask")
        if response_mask is None:
            response_mask = data.batch["attention_mask"][:, -data.batch["responses"].shape[1] :]
        totals = torch.tensor([float(response_mask.sum()), float(len(data))], dtype=torch.float64)
        totals = self._all_reduce(totals)
        global_meta = {
            "global_num_tokens": float(totals[0]),
            "global_num_seqs": float(totals[1]),
            "dp_size": self.world_size if self.train_mesh is None else self.train_mesh.dp_size,
        }
        data, _ = self._gather_rows(data)  # after the global counts: those count each row once

        self._set_training(True)
        per_micro: list[dict[str, float]] = []
        local_nonfinite = 0.0
        for group in self._plan(data):
            micro = data[group].to(self.device)  # loss_fn mixes its columns with the outputs: same device
            micro.meta_info.update(global_meta)
            outputs = self._forward(micro, temperature=temperature, calculate_entropy=calculate_entropy,
                                    calculate_sum_pi_squared=sum_pi_squared)
            loss, metrics = loss_fn(micro, outputs)
            loss, metrics = self._add_router_terms(micro, loss, dict(metrics or {}), global_meta["global_num_tokens"])
            if not torch.isfinite(loss.detach()).all():
                local_nonfinite = 1.0
            # FSDP averages gradients over ranks; loss_fn already divided by the global count, so undo the average.
            (loss * self._grad_ranks).backward()
            numbers = {key: _as_number(value) for key, value in (metrics or {}).items()}
            per_micro.append({key: number for key, number in numbers.items() if number is not None})

        return reduce_metrics(per_micro), local_nonfinite

    def _add_router_terms(self, micro: DataProto, loss: torch.Tensor, metrics: dict[str, Any],
                          global_tokens: float) -> tuple[torch.Tensor, dict[str, Any]]:
        """MoE: add this micro-batch's share (its response tokens over the mini-batch's) of the weighted router
        load-balancing loss, so the summed gradient is that of the token-weighted mean; log the router stats."""
        aux, stats = self._router_terms
        self._router_terms = (None, {})
        metrics.update(stats)
        if aux is not None:
            mask = micro.batch.get("response_mask")
            if mask is None:
                mask = micro.batch["attention_mask"][:, -micro.batch["responses"].shape[1] :]
            share = float(mask.sum()) / max(global_tokens, 1.0)
            loss = loss + self.router_tap.coef * share * aux
            metrics["router/aux_loss"] = float(aux.detach())
        return loss, metrics

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.config.optim.grad_clip if self.config.optim.grad_clip > 0 else float("inf")
        if self.train_mesh is not None:
            from hybridflow.engines.train_mesh import clip_grads_

            return clip_grads_(params, max_norm, self.device)
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False, foreach=True)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded gradients: a DTensor
        # clip_grad_norm_'s coefficient, computed as it does; at 1 (a norm under max_norm, RL's usual case) its
        # multiply changes no bit and only passes every gradient through memory, so it is skipped
        if not bool(torch.clamp(max_norm / (full + 1e-6), max=1.0) == 1.0):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return float(full)

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one training step; returns the new learning rate."""
        if self.lr_scheduler is None:
            raise ValueError("lr_scheduler_step was called on a ref engine (no optimizer)")
        self.lr_scheduler.step()
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weights out / in
    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full fp32 tensor on the engine device)``, one parameter at a time; call on every rank.

        Names are the transformers state_dict names; a tied output embedding appears once (under the input
        embedding's name). Each yielded tensor is a fresh gather: drop it before asking for the next one.
        With LoRA: the plain model's names and merged weights ``W + (alpha / r) B A`` (lora.py), no adapter tensors.
        """
        if self.peft_model is not None:  # in the weights' dtype, also those stored in the compute dtype
            yield from merged_parameters(self.model.named_parameters(), self.model, self._gather, prefix="hf.",
                                         dtype=PARAM_DTYPES[self.config.model_dtype])
            return
        for name, param in self.model.named_parameters():
            yield hf_name(name), self._gather(param)

    def _gather(self, param: torch.Tensor) -> torch.Tensor:
        if hasattr(param, "full_tensor"):
            # CPUOffloadPolicy keeps shards in host memory: gather on the device (nccl), not through gloo
            return param.detach().to(self.device).full_tensor()
        return param.detach()

    def named_parameter_shapes(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, parameter)`` in named_full_parameters' order, without gathering: ``.shape`` / ``.dtype`` of a
        sharded parameter are those of the full tensor (what a weight receiver must allocate)."""
        dtype = PARAM_DTYPES[self.config.model_dtype]
        for name, param in self.model.named_parameters():
            plain = base_name(hf_name(name))
            if plain is None:  # LoRA: the adapter tensors are folded into their base weights
                continue
            if self.peft_model is not None and param.dtype != dtype:  # a frozen base weight kept in compute dtype
                param = torch.empty(param.shape, dtype=dtype, device="meta")
            yield plain, param

    def save_adapter(self, directory: str, every_rank: bool = False) -> None:
        """LoRA: the adapter alone as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``), for a
        rollout engine that applies adapters itself (vLLM with enable_lora). Every rank gathers; rank 0 writes, or
        each rank into its own `directory` (every_rank: each rank's colocated rollout engine reads its own copy)."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        if self.peft_model is None:
            raise ValueError("save_adapter: this engine has no LoRA adapter (actor_rollout_ref.model.lora_rank=0)")
        state = {"base_model.model." + hf_name(n): self._gather(p).detach().cpu().contiguous()
                 for n, p in self.model.named_parameters() if ".lora_" in n}
        if self.rank == 0 or every_rank:
            os.makedirs(directory, exist_ok=True)
            adapter = get_peft_model_state_dict(self.peft_model, state_dict=state)
            save_file(adapter, os.path.join(directory, "adapter_model.safetensors"))
            umask_modes(directory)  # safetensors writes 0600 (common/files.py)
            config = self.peft_model.peft_config["default"]
            config.base_model_name_or_path = os.path.abspath(self.config.model_path)
            config.save_pretrained(directory)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter as a full cpu tensor (HF names, tied weights once); call on every rank."""
        return {name: t.cpu().clone() for name, t in self.named_full_parameters()}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy full tensors (HF names; every rank passes the same dict) into this rank's shards. Does not mutate it."""
        if self.peft_model is not None:
            raise ValueError("load_full_state_dict loads plain (merged) weights, but this engine trains a LoRA "
                             "adapter on a frozen base; load an adapter checkpoint with load_checkpoint instead")
        self._reshard()
        named = list(self.model.named_parameters())
        missing = [hf_name(n) for n, _ in named if hf_name(n) not in state_dict]
        if missing:
            raise KeyError(f"load_full_state_dict: missing {missing[:5]} (of {len(missing)}); keys use HF names")
        with torch.no_grad():
            for name, param in named:
                full = state_dict[hf_name(name)]
                if tuple(full.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{hf_name(name)}: got shape {tuple(full.shape)}, the model has {tuple(param.shape)}"
                    )
                if hasattr(param, "to_local"):
                    from torch.distributed.tensor import distribute_tensor

                    shard = distribute_tensor(
                        full.to(param.device_mesh.device_type), param.device_mesh, param.placements
                    )
                    param.to_local().copy_(shard.to_local())
                else:
                    param.copy_(full.to(param.device))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str, contents: tuple[str, ...] = ("model", "optimizer", "extra")) -> None:
        """Per-rank model/optimizer/LR-schedule/RNG state (checkpoint_io.py); every rank calls it. `contents` (veRL's
        checkpoint.save_contents): "optimizer" / "extra" (LR schedule + RNG) left out when absent; "hf_model" also
        writes the full model in transformers format to ``directory/huggingface``."""
        self._reshard()
        save_engine_state(
            directory,
            self.model,
            self.optimizer if "optimizer" in contents else None,
            self.lr_scheduler if "extra" in contents else None,
            self.rank,
            self.world_size,
            extra={"global_step": self.global_step},
            trainable_only=self.peft_model is not None,
            meta_extra=self._lora_meta(),
            save_rng="extra" in contents,
        )
        if "hf_model" in contents:
            self.save_hf_model(os.path.join(directory, "huggingface"))
        self._barrier()

    def load_checkpoint(self, directory: str, contents: tuple[str, ...] = ("model", "optimizer", "extra")) -> None:
        """Restore a `save_checkpoint` of an engine with the same config and world size; bitwise exact. `contents`
        (veRL's checkpoint.load_contents): without "optimizer" / "extra", AdamW / the LR schedule and RNG keep their
        fresh state; asking for one the checkpoint lacks is a ValueError."""
        self._reshard()
        extra = load_engine_state(
            directory, self.model, self.optimizer if "optimizer" in contents else None,
            self.lr_scheduler if "extra" in contents else None, self.rank, self.world_size,
            trainable_only=self.peft_model is not None, load_rng="extra" in contents,
        )
        self.global_step = int(extra.get("global_step", 0))
        skipped = [c for c in ("optimizer", "extra") if c not in contents] if self.trainable else []
        if skipped and self.rank == 0:
            logger.warning("resumed %s without its %s (checkpoint.load_contents=%s): they start afresh", directory,
                           " and ".join(skipped), list(contents))
        self._barrier()

    def _lora_meta(self) -> dict[str, Any] | None:
        """What `hybridflow export` needs to rebuild the adapter: the base model and PEFT's LoraConfig."""
        if self.peft_model is None:
            return None
        lora_config = self.peft_model.peft_config["default"].to_dict()
        lora_config = {k: sorted(v) if isinstance(v, set) else v for k, v in lora_config.items()}
        return {"lora": {"base_model_path": os.path.abspath(self.config.model_path), "peft_config": lora_config}}

    def save_hf_config(self, directory: str) -> None:
        """The model's config (its transformers class as ``architectures``: a critic's value head is
        ``*ForTokenClassification``) and tokenizer, on rank 0: what `hybridflow export` / `merge` need beside the
        checkpoint's shards to rebuild the model."""
        if self.rank != 0:
            return
        import copy

        config = copy.deepcopy(self.hf_config)
        # FSDP2 swaps in a subclass of its own: the first class of the MRO that transformers defines is the model's
        cls = next(c for c in type(self.model.hf).__mro__ if c.__module__.startswith("transformers."))
        config.architectures = [cls.__name__]
        config.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    def save_hf_model(self, directory: str) -> None:
        """transformers format (safetensors + config + tokenizer) on rank 0; every rank calls it (it gathers)."""
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        state = self.full_state_dict()
        if self.rank == 0:
            auto = AutoModelForTokenClassification if self.is_critic else AutoModelForCausalLM
            model = auto.from_config(self.hf_config, dtype=torch.float32)
            result = model.load_state_dict(state, strict=False)
            model.tie_weights()  # a tied output embedding is stored once, under the input embedding's name
            missing = [name for name, _ in model.named_parameters() if name not in state]
            if result.unexpected_keys or missing:
                raise KeyError(f"save_hf_model: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}")
            os.makedirs(directory, exist_ok=True)
            model.save_pretrained(directory, safe_serialization=True)
            umask_modes(directory)
            self.tokenizer.save_pretrained(directory)
            if getattr(self.model.hf, "generation_config", None) is not None and not self.is_critic:
                self.model.hf.generation_config.save_pretrained(directory)
        del state
        self._barrier()

    def _barrier(self) -> None:
        if self.distributed and self.world_size > 1:
            dist.barrier()


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating buffer of `model` (RoPE's inv_freq, ...) to `dtype`, in place (veRL's buffer_dtype)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                module._buffers[name] = buf.to(dtype)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every state tensor to `device`, "step" included: fused AdamW wants it beside the parameters."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                state[key] = value.to(device)


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if torch.is_tensor(value) and value.numel() == 1:
        return float(value.detach())
    return None
