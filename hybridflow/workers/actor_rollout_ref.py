"""ActorRolloutRefWorker: the policy's training engine, its rollout engine and the frozen reference, per rank.

The role string picks what one process hosts: ``actor``, ``rollout``, ``ref``, or combinations such as
``actor_rollout`` and ``actor_rollout_ref`` (the hybrid engine: the rollout engine lives next to the actor and gets its
weights after every update through ``sync_rollout_weights``, no second process, no disk round trip).

Primitive APIs (each a group method on the driver side):
  init_model, generate_sequences, compute_log_prob, compute_ref_log_prob, update_actor, sync_rollout_weights,
  save_checkpoint, load_checkpoint; with the rollout in a group of its own (``hybrid_engine=false``, role "rollout"),
  weight_transfer_manifest / join_weight_transfer / send_weights (actor) and join_weight_transfer / receive_weights
  (rollout) stream the weights over a process group spanning the actor's rank 0 and the rollout ranks
  (engines/weight_transfer.py).

Every generated row carries the policy version its rollout engine held (``non_tensor_batch["rollout_version"]``).

The worker reads its own config sections and builds its pieces from them; what the loss *is* lives in
``algorithms/objective.py`` (built once from the actor keys), the worker only runs it on each micro-batch.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms.objective import ActorLossConfig, LossContext, build_actor_objective
from hybridflow.algorithms.off_policy import CorrectionSettings, is_weight_batch_stats
from hybridflow.common.metrics import machine_peak_flops, reduce_metrics
from hybridflow.common.ports import hold_free_port
from hybridflow.common.seeds import derive_seed
from hybridflow.engines.fsdp_engine import FSDPEngine
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.engines.moe_train import is_mixture_of_experts
from hybridflow.engines.resharding import sync_tensor_parallel
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.layout import pad_responses
from hybridflow.engines.rollout.registry import rollout_engine_kwargs
from hybridflow.engines.weight_transfer import ReceivedWeights, TransferGroup, manifest_of, send_weights
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Execute, Worker, register
from hybridflow.workers.engine_config import engine_config, optim_config
from hybridflow.workers.fault import maybe_inject_fault, step_of
from hybridflow.workers.profiling import chosen_rank, start_profile, stop_profile
from hybridflow.workers.rank_state import load_rank_state, save_rank_state

VALID_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref", "actor_ref")


def actor_loss_config(actor: Any, correction: Any = None) -> ActorLossConfig:
    """The actor section's loss keys as the objective's settings (clip_ratio_low/high default to clip_ratio);
    `correction`: the algorithm.rollout_correction section (None: off)."""
    settings = CorrectionSettings()
    if correction is not None:
        settings = CorrectionSettings(
            is_level=correction.rollout_is, is_threshold=correction.rollout_is_threshold,
            rs_level=correction.rollout_rs, rs_upper=correction.rollout_rs_threshold,
            rs_lower=correction.rollout_rs_threshold_lower,
            veto_threshold=correction.rollout_token_veto_threshold,
            batch_normalize=correction.rollout_is_batch_normalize,
        )
    return ActorLossConfig(
        policy_loss=actor.policy_loss.loss_mode,
        clip_ratio_low=actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        correction=settings,
    )


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
        self.agent = None  # AgentRollout when rollout.multi_turn.enable: episodes over self.rollout
        self.policy_version = 0  # the version of the weights the rollout engine holds (0: the initial checkpoint)
        self.weights_valid = True  # False after a failed transfer: no generation until a full one succeeds
        self.transfer: TransferGroup | None = None
        self.manifest = None

    # ------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        self.init_distributed(timeout_s=float(self.config.actor_rollout_ref.nccl_timeout))
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
                    # old log-probs are a forward-only pass: veRL sizes it with the rollout's log_prob_* keys
                    infer_micro_batch_size=arr.rollout.log_prob_micro_batch_size_per_gpu,
                    infer_use_dynamic_bsz=arr.rollout.log_prob_use_dynamic_bsz,
                    infer_max_token_len=arr.rollout.log_prob_max_token_len_per_gpu,
                    router_aux_loss_coef=actor.router_aux_loss_coef,
                    router_replay=actor.router_replay.mode == "R3",
                    ulysses_sequence_parallel_size=actor.ulysses_sequence_parallel_size,
                    entropy_checkpointing=actor.entropy_checkpointing,
                    share_prompts=actor.use_prefix_grouper,
                )
            )
            self.objective = build_actor_objective(actor_loss_config(actor, cfg.algorithm.rollout_correction))
        # LoRA: the reference is the actor's own base weights with the adapter disabled, no second copy.
        if self.is_ref and not (self.actor is not None and self.actor.peft_model is not None):
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
                    ulysses_sequence_parallel_size=arr.ref.ulysses_sequence_parallel_size,
                )
            )
        if self.is_rollout:
            r = arr.rollout
            self.rollout = create_rollout_engine(
                r.name,
                path,
                dtype=r.dtype,
                seed=cfg.trainer.seed,
                max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
                **rollout_engine_kwargs(r),
                # routing replay: the rollout records each token's experts for the actor's forwards
                **({"record_routes": True} if arr.actor.router_replay.mode == "R3" else {}),
                # the training engine's rounding, bit for bit (engines/rollout/exact_decode.py)
                **({"batch_invariant": True} if arr.model.batch_invariant else {}),
                # LoRA in the hybrid engine with vLLM: vLLM applies the adapter itself, syncs send only the adapter
                **({"lora_rank": int(arr.model.lora_rank)} if self._adapter_sync_wanted() else {}),
            )
            # tensor-parallel rollout: consecutive ranks form a TP group; each group gets one chunk of the prompts
            # and its TP rank 0 returns the rows (generate_sequences' mesh_name="rollout")
            t = int(r.tensor_model_parallel_size)
            self.register_dp_mesh("rollout", self.rank // t, self.world_size // t, self.rank % t == 0)
            if r.multi_turn.enable:
                from hybridflow.workers.agent_rollout import AgentRollout, TensorParallelLink

                link = None
                if t > 1:  # the group's first rank runs the episodes, the others replay its engine ops
                    import torch.distributed as dist

                    groups = [dist.new_group(list(range(g * t, (g + 1) * t)), backend="gloo")
                              for g in range(self.world_size // t)]  # every rank makes every group, in order
                    first = self.rank - self.rank % t
                    link = TensorParallelLink(groups[self.rank // t], first, self.rank == first)
                self.agent = AgentRollout.from_config(cfg, self.rollout, path, tensor_parallel=link)
        info = {"rank": self.rank, "pid": os.getpid(), "threads": torch.get_num_threads()}
        if self.actor is not None and self.actor.device.type == "cpu":
            # The matmul peak at this rank's own thread count (the driver asks at the configured one); measured once
            # per machine and dtype, then read from the machine's file. MFU uses the best of the driver's and ranks'.
            info["peak_flops"] = machine_peak_flops(self.actor.device, dtype=self.actor.compute_dtype)
        return info

    # ------------------------------------------------------------------ rollout
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts [B, P] -> B * n responses; meta_info carries the sampling parameters and the step's seed."""
        return self._generate(prompts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, mesh_name="rollout", blocking=False)
    def generate_sequences_async(self, prompts: DataProto) -> DataProto:
        """generate_sequences as a non-blocking group call (a DataProtoFuture): the separate rollout group generates
        while the driver goes on with the actor (trainer.rollout_mode=one_step_off / async)."""
        return self._generate(prompts)

    def _generate(self, prompts: DataProto) -> DataProto:
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
            # one random stream per TP group (its data-parallel rank): every TP rank samples the same tokens
            seed=derive_seed(m.get("seed", 0), self.get_dp_mesh("rollout").dp_rank),
        )
        if not self.weights_valid:
            raise RuntimeError(
                f"rollout rank {self.rank}: the last weight transfer failed its checks, so this engine's weights are "
                "inconsistent; it must receive a full transfer (receive_weights) before it generates"
            )
        start = time.perf_counter()
        if self.agent is not None:  # multi-turn episodes (tools, environments) over the same engine
            out = self.agent.generate(prompts, params)
            if out is None:  # a tensor-parallel group's other rank: its first rank returns the rows (the collector)
                self.rollout.release_memory()
                return DataProto()
        else:
            out = self.rollout.generate(prompts.select(["input_ids", "attention_mask", "position_ids"]), params)
        # One response width per call, whatever this rank's longest response: the driver gathers every rank's rows
        # into one batch, which needs one width.
        out = pad_responses(out, params.max_new_tokens, getattr(self.rollout, "pad_token_id", 0))
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            out.batch.pop("rollout_log_probs", None)
        self.rollout.release_memory()
        out.meta_info = {"generate_time_s": time.perf_counter() - start, "temperature": params.temperature}
        out.non_tensor_batch["rollout_version"] = np.full(len(out), self.policy_version, dtype=np.int64)
        return out

    def _adapter_sync_wanted(self) -> bool:
        """LoRA with the vLLM rollout: vLLM applies the adapter itself, except for a mixture-of-experts model, which
        takes the merged weights as the other engines do: PEFT adapts its fused experts through parameter wrappers,
        gate_up_proj at twice lora_rank (its rank_pattern), above the max_lora_rank vLLM was started with."""
        arr = self.config.actor_rollout_ref
        if not (self.is_actor and arr.rollout.name == "vllm" and int(arr.model.lora_rank) > 0):
            return False
        return not is_mixture_of_experts(self.actor.hf_config)

    def _push_to_rollout(self) -> None:
        """Hybrid engine: the actor's weights into the rollout engine -- the LoRA adapter alone when the engine
        applies adapters itself (vLLM), else the full (merged) tensors, gathered one at a time from the shards."""
        if getattr(self.rollout, "adapter_sync", False):
            folder = self.rollout.adapter_folder()
            self.actor.save_adapter(folder, every_rank=True)
            self.rollout.load_adapter(folder)
        else:
            self.rollout.update_weights(self.actor.named_full_parameters())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, version: int | None = None) -> float:
        """Hybrid engine: the actor's FSDP2 shards into the rollout engine, one tensor at a time (full tensors; a
        tensor-parallel native rollout receives only its slice of each, engines/resharding.py)."""
        start = time.perf_counter()
        if getattr(self.rollout, "tensor_parallel", None) is not None and self.actor.peft_model is None:
            # each rank receives only its TP slice of each tensor, straight from the FSDP2 shards
            sync_tensor_parallel(self.actor.model, self.rollout)
        else:
            self._push_to_rollout()
        if version is not None:
            self.policy_version = int(version)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ weights to a rollout group of its own
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO_ONLY)
    def weight_transfer_manifest(self) -> dict:
        """Actor rank 0: the transfer group's rendezvous (this node, a free port) and the tensors it will send."""
        shapes = [(n, tuple(p.shape), p.dtype) for n, p in self.actor.named_parameter_shapes()]
        return {"addr": self.master_addr, "port": hold_free_port(self.master_addr), "manifest": manifest_of(shapes)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def join_weight_transfer(self, addr: str, port: int, world_size: int, manifest: list) -> int:
        """Actor rank 0 joins as transfer rank 0, rollout rank r as 1 + r; other actor ranks only gather."""
        if self.transfer is not None:
            self.transfer = None  # a new group replaces the old one (a rollout rank was replaced)
        self.manifest = manifest
        rank = 0 if self.is_actor else 1 + self.rank
        if self.is_actor and self.rank != 0:
            return -1
        timeout = float(self.config.trainer.call_timeout_s)
        self.transfer = TransferGroup.join(addr, port, rank, world_size, timeout_s=timeout)
        return rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int) -> dict[str, float]:
        """Actor: every rank gathers the full tensors (FSDP2 all-gather); rank 0 broadcasts them in buckets."""
        named = self.actor.named_full_parameters()
        if self.rank != 0:
            for _ in named:  # take part in each gather, keep nothing
                pass
            return {}
        return send_weights(self.transfer, named, self.manifest, version=int(version), bucket_bytes=self._bucket_bytes())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self) -> dict[str, float]:
        """Rollout: receive one transfer, verify every bucket, load the tensors into the engine as they arrive."""
        start = time.perf_counter()
        self.weights_valid = False
        incoming = ReceivedWeights(self.transfer, self.manifest, bucket_bytes=self._bucket_bytes())
        self.rollout.update_weights(incoming)
        self.weights_valid, self.policy_version = True, incoming.version
        return {"version": float(incoming.version), "seconds": time.perf_counter() - start,
                "buckets": float(incoming.buckets_checked)}

    def _bucket_bytes(self) -> int:
        return int(self.config.actor_rollout_ref.rollout.update_weights_bucket_megabytes * (1 << 20))

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
        """ref_log_probs [B, R]: the reference engine's, or with LoRA the actor's with its adapter disabled."""
        engine = self.ref if self.ref is not None else self.actor
        if engine is self.actor:
            # the ref's log_prob_* keys size this pass, as they would a reference engine of its own
            ref = self.config.actor_rollout_ref.ref
            c = self.actor.config
            saved = (c.infer_micro_batch_size_per_gpu, c.infer_use_dynamic_bsz, c.infer_max_tokens_per_micro_batch)
            c.infer_micro_batch_size_per_gpu = ref.log_prob_micro_batch_size_per_gpu
            c.infer_use_dynamic_bsz = ref.log_prob_use_dynamic_bsz
            c.infer_max_tokens_per_micro_batch = ref.log_prob_max_token_len_per_gpu
            try:
                out = engine.compute_log_prob(
                    data, temperature=data.meta_info["temperature"], calculate_entropy=False, base=True
                )
            finally:
                (c.infer_micro_batch_size_per_gpu, c.infer_use_dynamic_bsz,
                 c.infer_max_tokens_per_micro_batch) = saved
            return DataProto.from_dict({"ref_log_probs": out["log_probs"]})
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
        data.meta_info.setdefault("calculate_sum_pi_squared", actor.calculate_sum_pi_squared)
        if self.objective.config.correction.batch_normalize and self.objective.config.correction.is_level:
            data.meta_info["rollout_is_batch_mean"] = self._is_batch_mean(data)
        loss_fn = self._loss_fn(actor.loss_agg_mode, data.meta_info.get("max_response_length"))
        per_step: list[dict[str, float]] = []
        step = int(data.meta_info.get("global_step", 0))
        for mb in data.make_iterator(
            mini_rows, epochs=actor.ppo_epochs, shuffle=actor.shuffle, seed=derive_seed(self.config.trainer.seed, step)
        ):
            mb.meta_info.update(data.meta_info)
            per_step.append({f"actor/{k}": float(v) for k, v in self.actor.train_step(mb, loss_fn).items()})
        out = reduce_metrics(per_step)
        out["actor/lr"] = self.actor.lr_scheduler_step()
        return out

    def _is_batch_mean(self, data: DataProto) -> float:
        """The mean truncated IS weight over the whole step batch (every rank's rows), from the old log-probs."""
        if "old_log_probs" not in data.batch:
            raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize needs the old log-probs of every "
                             "row before the update; this batch has none (the trainer computes them when it is set)")
        stats = is_weight_batch_stats(data.batch["old_log_probs"], data.batch["rollout_log_probs"],
                                      data.batch["response_mask"], self.objective.config.correction)
        if torch.distributed.is_initialized() and self.world_size > 1:
            stats = stats.to(self.actor.device)  # nccl reduces device tensors only
            torch.distributed.all_reduce(stats)
        total, count = stats.cpu().tolist()
        return total / count if count else 1.0

    def _fault_point(self, method: str, data: DataProto | str) -> None:
        t = self.config.trainer
        maybe_inject_fault(t.fault_injection, t.default_local_dir, method, self.rank, step_of(data))

    def _loss_fn(self, loss_agg_mode: str, norm_length: int | None):
        """The engine's loss_fn(micro, outputs): the actor objective under this mini-batch's global counts."""
        objective = self.objective

        def loss_fn(micro: DataProto, outputs: dict[str, torch.Tensor]):
            ctx = LossContext(
                loss_agg_mode=loss_agg_mode,
                global_num_tokens=micro.meta_info.get("global_num_tokens"),
                global_num_seqs=micro.meta_info.get("global_num_seqs"),
                norm_length=norm_length,
                is_batch_mean=micro.meta_info.get("rollout_is_batch_mean"),
            )
            log_prob = outputs["log_probs"]
            loss, metrics = objective(micro.batch, log_prob, outputs.get("entropy"), ctx)
            if "old_log_probs" not in micro.batch and "rollout_log_probs" in micro.batch:
                # The first forward of an on-policy update is the training engine's view of the rollout's tokens.
                mask = micro.batch["response_mask"].to(log_prob.dtype)
                mm = logprob_mismatch(micro.batch["rollout_log_probs"], log_prob.detach(), mask)
                metrics.update({f"rollout_{k.replace('/', '_')}": v for k, v in mm.items()})
            if "sum_pi_squared" in outputs:  # veRL's calculate_sum_pi_squared: mean over the response tokens
                mask = micro.batch["response_mask"].to(log_prob.dtype)
                metrics["sum_pi_squared"] = float((outputs["sum_pi_squared"] * mask).sum() / mask.sum().clamp(min=1))
            return loss, metrics

        return loss_fn

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        if self.actor is not None:
            self.actor.save_checkpoint(os.path.join(path, "actor"), self._checkpoint_contents()[0])
            self._fault_point("save_checkpoint", path)  # after the shards, before the rank state: a half-written save
            # config + tokenizer only; `hybridflow export` assembles the weights from the shards
            self.actor.save_hf_config(os.path.join(path, "actor", "huggingface"))
        save_rank_state(os.path.join(path, "actor", f"rank_state_{self.rank}.json"))

    # ------------------------------------------------------------------ profiling (trainer/profiling.py)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, folder: str) -> None:
        arr = self.config.actor_rollout_ref
        if chosen_rank(arr.actor.profiler, self.rank) or chosen_rank(arr.ref.profiler, self.rank):
            start_profile(self.role, self.rank, folder)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> None:
        stop_profile(self.role)

    def _checkpoint_contents(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(what the actor's checkpoint holds, what a resume restores): veRL's checkpoint.save/load_contents."""
        ck = self.config.actor_rollout_ref.actor.checkpoint
        load = ck.load_contents if ck.load_contents is not None else ck.save_contents  # veRL: ${.save_contents}
        # an hf_model inherited from save_contents is an export copy: a resume reads the shards
        return tuple(ck.save_contents), tuple(c for c in load if c != "hf_model")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        if self.actor is not None:
            self.actor.load_checkpoint(os.path.join(path, "actor"), self._checkpoint_contents()[1])
        load_rank_state(os.path.join(path, "actor", f"rank_state_{self.rank}.json"))
        if self.actor is not None and self.rollout is not None:
            self._push_to_rollout()
