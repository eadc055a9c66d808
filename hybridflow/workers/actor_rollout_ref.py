"""ActorRolloutRefWorker: the policy's training engine, its rollout engine and the frozen reference, per rank.

The role string picks what one process hosts: ``actor``, ``rollout``, ``ref``, or combinations such as
``actor_rollout`` and ``actor_rollout_ref`` (the hybrid engine: the rollout engine lives next to the actor and gets its
weights after every update through ``sync_rollout_weights``, no second process, no disk round trip).

Primitive APIs (each a group method on the driver side):
  init_model, generate_sequences, compute_log_prob, compute_ref_log_prob, update_actor, sync_rollout_weights,
  get_actor_weights / load_rollout_weights (for split placement), save_checkpoint, load_checkpoint.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from hybridflow.algorithms import agg_loss, get_policy_loss, kl_penalty, masked_mean
from hybridflow.engines.fsdp_engine import FSDPEngine
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Execute, Worker, register
from hybridflow.workers.engine_config import engine_config, optim_config, rollout_engine_kwargs
from hybridflow.workers.fault import maybe_inject_fault, step_of
from hybridflow.workers.rank_state import load_rank_state, save_rank_state

VALID_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref", "actor_ref")


def derive_seed(*parts: int) -> int:
    """A deterministic 31-bit seed from integers (base seed, step, rank, ...)."""
    h = 0x9E3779B1
    for p in parts:
        h = (h * 0x01000193 ^ (int(p) & 0xFFFFFFFF)) & 0xFFFFFFFF
    return h & 0x7FFFFFFF


class ActorRolloutRefWorker(Worker):
    def __init__(self, config: Any, role: str = "actor_rollout_ref"):
        super().__init__()
        if role not in VALID_ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose one of {VALID_ROLES}")
        self.config = config
        self.role = role
        self.is_actor = "actor" in role
        self.is_rollout = "rollout" in role
        self.is_ref = "ref" in role
        self.actor: FSDPEngine | None = None
        self.ref: FSDPEngine | None = None
        self.rollout = None

    # ------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        self.init_distributed()
        cfg = self.config
        arr = cfg.actor_rollout_ref
        path = arr.model.path
        torch.manual_seed(derive_seed(cfg.trainer.seed, self.rank))
        if self.is_actor:
            actor = arr.actor
            self.actor = FSDPEngine(
                engine_config(
                    model_path=path,
                    role="actor",
                    model=arr.model,
                    fsdp=actor.fsdp_config,
                    seed=cfg.trainer.seed,
                    micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
                    use_dynamic_bsz=actor.use_dynamic_bsz,
                    max_token_len=actor.ppo_max_token_len_per_gpu,
                    optim=optim_config(actor.optim, actor.grad_clip, actor.optim.total_training_steps),
                )
            )
        if self.is_ref:
            self.ref = FSDPEngine(
                engine_config(
                    model_path=path,
                    role="ref",
                    model=arr.model,
                    fsdp=arr.ref.fsdp_config,
                    seed=cfg.trainer.seed,
                    micro_batch_size=arr.ref.log_prob_micro_batch_size_per_gpu,
                    use_dynamic_bsz=arr.ref.log_prob_use_dynamic_bsz,
                    max_token_len=arr.ref.log_prob_max_token_len_per_gpu,
                )
            )
        if self.is_rollout:
            r = arr.rollout
            self.rollout = create_rollout_engine(
                r.name,
                path,
                dtype=r.dtype,
                seed=cfg.trainer.seed,
                max_model_len=cfg.data.max_prompt_length + cfg.data.max_response_length,
                **rollout_engine_kwargs(r),
            )
        return {"rank": self.rank, "pid": os.getpid(), "threads": torch.get_num_threads()}

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts [B, P] -> B * n responses; meta_info carries the sampling parameters and the step's seed."""
        self._fault_point("generate_sequences", prompts)
        m = prompts.meta_info
        params = SamplingParams(
            temperature=m.get("temperature", 1.0),
            top_k=m.get("top_k", -1),
            top_p=m.get("top_p", 1.0),
            greedy=m.get("greedy", False),
            n=m.get("n", 1),
            max_new_tokens=m["max_new_tokens"],
            stop_token_ids=list(m.get("stop_token_ids", [])),
            seed=derive_seed(m.get("seed", 0), self.rank),
        )
        start = time.perf_counter()
        out = self.rollout.generate(prompts.select(["input_ids", "attention_mask", "position_ids"]), params)
        self.rollout.release_memory()
        out.meta_info = {"generate_time_s": time.perf_counter() - start, "temperature": params.temperature}
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self) -> float:
        """Hybrid engine: gather the actor's FSDP2 shards one tensor at a time into the rollout engine."""
        start = time.perf_counter()
        self.rollout.update_weights(self.actor.named_full_parameters())
        return time.perf_counter() - start

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def get_actor_weights(self) -> dict[str, torch.Tensor]:
        """Split placement: the full actor state dict (rank 0's copy), to be loaded into a separate rollout group."""
        return self.actor.full_state_dict()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.rollout.update_weights(state_dict.items())

    # ------------------------------------------------------------------ log-probs
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """old_log_probs [B, R] (and entropys [B, R]) under the current actor, at the rollout temperature."""
        self._fault_point("compute_log_prob", data)
        out = self.actor.compute_log_prob(
            data, temperature=data.meta_info["temperature"], calculate_entropy=data.meta_info.get("with_entropy", True)
        )
        tensors = {"old_log_probs": out["log_probs"]}
        if "entropy" in out:
            tensors["entropys"] = out["entropy"]
        return DataProto.from_dict(tensors)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        engine = self.ref if self.ref is not None else self.actor
        out = engine.compute_log_prob(data, temperature=data.meta_info["temperature"], calculate_entropy=False)
        return DataProto.from_dict({"ref_log_probs": out["log_probs"]})

    # ------------------------------------------------------------------ training
    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's shard; one LR-schedule step per call."""
        actor = self.config.actor_rollout_ref.actor
        n = self.config.actor_rollout_ref.rollout.n
        self._fault_point("update_actor", data)
        mini_rows = actor.ppo_mini_batch_size * n // self.world_size
        data.meta_info.setdefault("calculate_entropy", actor.entropy_coeff != 0)
        loss_fn = self._make_policy_loss_fn(data.meta_info)
        metrics: dict[str, list[float]] = {}
        step = int(data.meta_info.get("global_step", 0))
        for mb in data.make_iterator(
            mini_rows, epochs=actor.ppo_epochs, shuffle=actor.shuffle, seed=derive_seed(self.config.trainer.seed, step)
        ):
            mb.meta_info.update(data.meta_info)
            for k, v in self.actor.train_step(mb, loss_fn).items():
                metrics.setdefault(f"actor/{k}", []).append(float(v))
        lr = self.actor.lr_scheduler_step()
        out = {k: sum(v) / len(v) for k, v in metrics.items()}
        out["actor/lr"] = lr
        return out

    def _fault_point(self, method: str, data: DataProto | str) -> None:
        t = self.config.trainer
        maybe_inject_fault(t.fault_injection, t.default_local_dir, method, self.rank, step_of(data))

    def _make_policy_loss_fn(self, meta: dict):
        from hybridflow.trainer.config import resolve_policy_loss_name  # a pure helper; no trainer state

        actor = self.config.actor_rollout_ref.actor
        policy_loss = get_policy_loss(resolve_policy_loss_name(actor.policy_loss.loss_mode))
        low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
        high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
        norm_length = meta.get("max_response_length")

        def loss_fn(micro: DataProto, outputs: dict[str, torch.Tensor]):
            mask = micro.batch["response_mask"].to(outputs["log_probs"].dtype)
            log_prob = outputs["log_probs"]
            on_policy = "old_log_probs" not in micro.batch
            old = log_prob.detach() if on_policy else micro.batch["old_log_probs"]
            counts = dict(
                global_num_tokens=micro.meta_info.get("global_num_tokens"),
                global_num_seqs=micro.meta_info.get("global_num_seqs"),
                norm_length=norm_length,
            )
            pg_loss, pg_metrics = policy_loss(
                old,
                log_prob,
                micro.batch["advantages"],
                mask,
                loss_agg_mode=actor.loss_agg_mode,
                clip_ratio_low=low,
                clip_ratio_high=high,
                clip_ratio_c=actor.clip_ratio_c,
                **counts,
            )
            loss = pg_loss
            metrics = {k: float(v) for k, v in pg_metrics.items()}
            metrics["pg_loss"] = local_loss_value(pg_loss.detach(), counts, mask, actor.loss_agg_mode)
            if "entropy" in outputs:
                entropy = agg_loss(outputs["entropy"], mask, actor.loss_agg_mode, **counts)
                metrics["entropy"] = float(masked_mean(outputs["entropy"].detach(), mask))
                loss = loss - actor.entropy_coeff * entropy
            if actor.use_kl_loss:
                kl = kl_penalty(log_prob, micro.batch["ref_log_probs"], actor.kl_loss_type)
                loss = loss + actor.kl_loss_coef * agg_loss(kl, mask, actor.loss_agg_mode, **counts)
                metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
            if on_policy and "rollout_log_probs" in micro.batch:
                # The first forward of an on-policy update is the training engine's view of the rollout's tokens.
                mm = logprob_mismatch(micro.batch["rollout_log_probs"], log_prob.detach(), mask)
                metrics.update({f"rollout_{k.replace('/', '_')}": v for k, v in mm.items()})
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        if self.actor is not None:
            self.actor.save_checkpoint(os.path.join(path, "actor"))
            self._fault_point("save_checkpoint", path)  # after the shards, before the rank state: a half-written save
            if self.rank == 0:  # config + tokenizer only; `hybridflow export` assembles the weights from the shards
                hf_dir = os.path.join(path, "actor", "huggingface")
                self.actor.hf_config.save_pretrained(hf_dir)
                self.actor.tokenizer.save_pretrained(hf_dir)
        save_rank_state(os.path.join(path, "actor", f"rank_state_{self.rank}.json"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        if self.actor is not None:
            self.actor.load_checkpoint(os.path.join(path, "actor"))
        load_rank_state(os.path.join(path, "actor", f"rank_state_{self.rank}.json"))
        if self.actor is not None and self.rollout is not None:
            self.rollout.update_weights(self.actor.named_full_parameters())


def local_loss_value(loss: torch.Tensor, counts: dict, mask: torch.Tensor, loss_agg_mode: str) -> float:
    """A micro-batch's share of the mini-batch loss, turned back into this micro-batch's own mean (for logging)."""
    if loss_agg_mode == "token-mean":
        total, local = counts.get("global_num_tokens"), float(mask.sum())
    else:
        total, local = counts.get("global_num_seqs"), float(mask.shape[0])
    return float(loss) * (float(total) / local if total and local else 1.0)
