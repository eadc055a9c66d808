"""`hybridflow sft`: supervised fine-tuning with the RL training engine (FSDP2, token budgets), saved in HF format.

    hybridflow sft data.train_files=sft.parquet model.path=BASE_DIR trainer.default_local_dir=OUT \\
        optim.lr=1e-3 trainer.total_epochs=3 data.train_batch_size=64
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow.trainer.config import ConfigError


@dataclass
class SFTMultiturn:
    """veRL's data.multiturn: rows are conversations in a messages column, trained on every assistant turn."""

    enable: bool = False
    messages_key: str = "messages"


@dataclass
class SFTData:
    train_files: Any = None
    val_files: Any = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    # veRL's SFT keys: the prompt / response sit inside a dict column, reached key by key (e.g. extra_info -> question)
    prompt_dict_keys: list = field(default_factory=list)
    response_dict_keys: list = field(default_factory=list)
    max_length: int = 512
    train_batch_size: int = 64
    micro_batch_size_per_gpu: int = 16
    seed: int = 1
    multiturn: SFTMultiturn = field(default_factory=SFTMultiturn)


@dataclass
class SFTModel:
    path: str | None = None  # veRL's model.partial_pretrain is this key
    strategy: str = "fsdp2"  # veRL's key: fsdp / fsdp2 both mean FSDP2 here
    param_dtype: str = "fp32"
    # LoRA SFT (veRL's fsdp_sft_trainer keys; PEFT, engines/lora.py): rank 0 = full fine-tuning. The saved model
    # (trainer.default_local_dir/huggingface) is the base with the adapter merged in, a plain transformers folder.
    lora_rank: int = 0
    lora_alpha: float = 16
    target_modules: Any = "all-linear"
    lora_dropout: float = 0.0
    exclude_modules: Any = None


@dataclass
class SFTOptim:
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.05
    lr_scheduler_type: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclass
class SFTTrainerSection:
    total_epochs: int = 1
    total_training_steps: int | None = None
    default_local_dir: str = "outputs/sft"
    nnodes: int = 1
    n_gpus_per_node: int = 1
    backend: str = "local"  # local | ray
    num_threads_per_worker: int | None = None
    logger: list = field(default_factory=lambda: ["console", "jsonl"])
    log_freq: int = 10
    seed: int = 1
    project_name: str = "hybridflow-sft"  # the trackers' project / run names (veRL's keys)
    experiment_name: str = "sft"


@dataclass
class SFTConfig:
    data: SFTData = field(default_factory=SFTData)
    model: SFTModel = field(default_factory=SFTModel)
    optim: SFTOptim = field(default_factory=SFTOptim)
    trainer: SFTTrainerSection = field(default_factory=SFTTrainerSection)


def load_sft_config(overrides: list[str]) -> SFTConfig:
    from hybridflow.trainer.config import merge_overrides

    cfg = merge_overrides(SFTConfig, overrides, what="SFT config")
    check_sft_config(cfg)
    return cfg


def check_sft_config(cfg: SFTConfig) -> None:
    """ConfigError for what the data is not needed to refuse (load_sft_config and run_sft both ask: a config built
    in code is checked too, before run_sft tokenizes the dataset)."""
    if not cfg.data.train_files or not cfg.model.path:
        raise ConfigError("hybridflow sft needs data.train_files=... and model.path=... (veRL: model.partial_pretrain)")
    from hybridflow.workers.engine_config import STRATEGIES

    if cfg.model.strategy not in STRATEGIES:
        raise ConfigError(f"model.strategy={cfg.model.strategy!r}: hybridflow's SFT trains with FSDP2 only "
                          f"({' / '.join(STRATEGIES)}); remove the key or set it to fsdp2")
    if cfg.model.lora_rank < 0:
        raise ConfigError(f"model.lora_rank={cfg.model.lora_rank}: give 0 (full fine-tuning) or a positive rank")
    d, world = cfg.data, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if d.train_batch_size % world or (d.train_batch_size // world) % d.micro_batch_size_per_gpu:
        raise ConfigError(
            f"data.train_batch_size={d.train_batch_size} must split into {world} ranks x whole micro-batches of "
            f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}"
        )
    from hybridflow.trainer.tracking import logger_errors

    errors = logger_errors(cfg.trainer.logger)
    if errors:
        raise ConfigError("; ".join(errors))


def run_sft(cfg: SFTConfig, *, eval_every: int = 0, stop_when=None) -> dict[str, Any]:
    """Train, then write the final model (HF format) to trainer.default_local_dir/huggingface; returns a summary.

    With `eval_every` and `stop_when(model_dir, step) -> bool`, the model is written every `eval_every` steps and
    training stops early the first time `stop_when` says so (e.g. a target held-out accuracy is reached).
    """
    from transformers import AutoTokenizer

    from hybridflow.data.sft_dataset import SFTDataset
    from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from hybridflow.trainer.progress import ProgressBar
    from hybridflow.trainer.tracking import Tracking
    from hybridflow.workers.engine_config import lora_settings
    from hybridflow.workers.sft import SFTWorker, make_sft_engine_config

    check_sft_config(cfg)
    d, t = cfg.data, cfg.trainer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    train = SFTDataset(d.train_files, tokenizer, prompt_key=d.prompt_key, response_key=d.response_key,
                       max_length=d.max_length, prompt_dict_keys=tuple(d.prompt_dict_keys),
                       response_dict_keys=tuple(d.response_dict_keys),
                       messages_key=d.multiturn.messages_key if d.multiturn.enable else None)
    world = t.nnodes * t.n_gpus_per_node
    steps_per_epoch = len(train) // d.train_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} is larger than the dataset ({len(train)} rows)")
    total = t.total_training_steps or steps_per_epoch * t.total_epochs
    engine_cfg = make_sft_engine_config(cfg.model.path, cfg.optim, d.micro_batch_size_per_gpu, t.seed,
                                        cfg.model.param_dtype, total, lora=lora_settings(cfg.model))
    pool = None
    if t.backend == "ray":
        import ray

        from hybridflow.single_controller.local_ray import start_local_ray

        if not ray.is_initialized():  # a cluster for this run only: loopback
            start_local_ray(num_cpus=max(os.cpu_count() or 1, world), include_dashboard=False)
        pool = ResourcePool(process_on_nodes=[t.n_gpus_per_node] * t.nnodes, use_gpu=False, num_cpus_per_process=1)
    threads = t.num_threads_per_worker or max(1, (os.cpu_count() or 1) // world)
    wg = WorkerGroup(resource_pool=pool, cls_with_init=ClassWithInitArgs(SFTWorker, engine_cfg), name_prefix="sft",
                     backend=t.backend, num_threads=threads)
    os.makedirs(t.default_local_dir, exist_ok=True)
    tracker = Tracking(t.default_local_dir, list(t.logger), project=t.project_name, experiment=t.experiment_name)
    bar = ProgressBar(total, headline_keys=["train/nll"])
    rng = np.random.default_rng(d.seed)
    try:
        wg.init_model()
        step, order = 0, np.array([], dtype=np.int64)
        while step < total:
            if len(order) < d.train_batch_size:
                order = rng.permutation(len(train))
            idx, order = order[: d.train_batch_size], order[d.train_batch_size:]
            per_rank = wg.train_batch(train.collate(idx))
            per_rank = per_rank if isinstance(per_rank, list) else [per_rank]
            step += 1
            metrics = {f"train/{k}": float(np.mean([m[k] for m in per_rank])) for k in per_rank[0]}
            if step % t.log_freq == 0 or step == total:
                tracker.log(metrics, step=step)
            bar.update(step, metrics)
            if eval_every and stop_when is not None and step % eval_every == 0 and step < total:
                probe = os.path.join(t.default_local_dir, f"step_{step}")
                wg.save_hf_model(probe)
                if stop_when(probe, step):
                    break
        out = os.path.join(t.default_local_dir, "huggingface")
        wg.save_hf_model(out)
    finally:
        bar.close()
        tracker.finish()
        wg.shutdown()
    return {"model_dir": out, "steps": step, "final_nll": metrics.get("train/nll", math.nan)}


def sft_main(overrides: list[str]) -> dict[str, Any]:
    torch.manual_seed(0)
    summary = run_sft(load_sft_config(overrides))
    print(f"SFT finished after {summary['steps']} steps (nll {summary['final_nll']:.4f}); model: {summary['model_dir']}")
    return summary
