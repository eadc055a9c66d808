"""SFTWorker: the RL training engine driven with a cross-entropy loss on response tokens."""

from __future__ import annotations

from typing import Any

from hybridflow.algorithms import agg_loss, masked_mean
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.lora import LoraSettings
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register


def sft_loss_fn(micro: DataProto, outputs: dict):
    """Mean negative log-likelihood over the mini-batch's response tokens (global count, so splits don't matter)."""
    mask = micro.batch["response_mask"].to(outputs["log_probs"].dtype)
    nll = -outputs["log_probs"]
    loss = agg_loss(
        nll, mask, "token-mean",
        global_num_tokens=micro.meta_info.get("global_num_tokens"),
        global_num_seqs=micro.meta_info.get("global_num_seqs"),
    )
    return loss, {"nll": float(masked_mean(nll.detach(), mask))}


class SFTWorker(Worker):
    def __init__(self, engine_config: EngineConfig):
        super().__init__()
        self.engine_config = engine_config
        self.engine: FSDPEngine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed()
        self.engine = FSDPEngine(self.engine_config)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def train_batch(self, data: DataProto) -> dict[str, float]:
        data.meta_info.setdefault("temperature", 1.0)
        metrics = self.engine.train_step(data, sft_loss_fn)
        metrics["lr"] = self.engine.lr_scheduler_step()
        return metrics

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_nll(self, data: DataProto) -> DataProto:
        out = self.engine.compute_log_prob(data, temperature=1.0)
        return DataProto.from_dict({"log_probs": out["log_probs"]})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str) -> None:
        self.engine.save_hf_model(path)  # every rank joins the gathers; rank 0 writes


def make_sft_engine_config(model_path: str, optim: Any, micro_batch_size: int, seed: int, param_dtype: str,
                           total_steps: int, lora: LoraSettings | None = None) -> EngineConfig:
    return EngineConfig(
        lora=lora or LoraSettings(),
        model_path=model_path,
        role="actor",
        param_dtype=param_dtype,
        micro_batch_size_per_gpu=micro_batch_size,
        seed=seed,
        optim=OptimConfig(
            lr=optim.lr, weight_decay=optim.weight_decay, lr_warmup_steps_ratio=optim.warmup_ratio,
            lr_scheduler_type=optim.lr_scheduler_type, min_lr_ratio=optim.min_lr_ratio,
            total_training_steps=total_steps, grad_clip=optim.grad_clip,
        ),
    )
