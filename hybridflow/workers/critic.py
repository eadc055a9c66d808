"""CriticWorker: the value model (a scalar head on the policy's backbone family) trained with a clipped value loss."""

from __future__ import annotations

import os
from typing import Any

from hybridflow.algorithms.objective import CriticLossConfig, LossContext, build_critic_objective
from hybridflow.common.metrics import reduce_metrics
from hybridflow.common.seeds import derive_seed
from hybridflow.engines.fsdp_engine import FSDPEngine
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.engine_config import engine_config, optim_config
from hybridflow.workers.profiling import chosen_rank, start_profile, stop_profile
from hybridflow.workers.rank_state import load_rank_state, save_rank_state


class CriticWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.engine: FSDPEngine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed()
        cfg, critic = self.config, self.config.critic
        self.engine = FSDPEngine(
            engine_config(
                model_path=critic.model.path or cfg.actor_rollout_ref.model.path,
                role="critic",
                model=critic.model,
                fsdp=critic.fsdp_config,
                seed=derive_seed(cfg.trainer.seed, 7),
                micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
                use_dynamic_bsz=critic.use_dynamic_bsz,
                max_token_len=critic.ppo_max_token_len_per_gpu,
                infer_micro_batch_size=critic.forward_micro_batch_size_per_gpu,
                infer_max_token_len=critic.forward_max_token_len_per_gpu,
                optim=optim_config(critic.optim, critic.grad_clip, critic.optim.total_training_steps),
                ulysses_sequence_parallel_size=critic.ulysses_sequence_parallel_size,
            )
        )
        self.objective = build_critic_objective(CriticLossConfig(cliprange_value=critic.cliprange_value))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, folder: str) -> None:
        """torch.profiler on the ranks critic.profiler chooses (workers/profiling.py)."""
        if chosen_rank(self.config.critic.profiler, self.rank):
            start_profile("critic", self.rank, folder)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> None:
        stop_profile("critic")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """values [B, R]: V(state before each response token)."""
        return DataProto.from_dict({"values": self.engine.compute_values(data)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        critic = self.config.critic
        actor = self.config.actor_rollout_ref.actor
        n = self.config.actor_rollout_ref.rollout.n
        mini_rows = (critic.ppo_mini_batch_size or actor.ppo_mini_batch_size) * n // self.world_size
        epochs = critic.ppo_epochs or actor.ppo_epochs
        norm_length = data.meta_info.get("max_response_length")

        objective = self.objective

        def loss_fn(micro: DataProto, outputs: dict):
            ctx = LossContext(
                loss_agg_mode=critic.loss_agg_mode,
                global_num_tokens=micro.meta_info.get("global_num_tokens"),
                global_num_seqs=micro.meta_info.get("global_num_seqs"),
                norm_length=norm_length,
            )
            return objective(micro.batch, outputs["values"], ctx)

        step = int(data.meta_info.get("global_step", 0))
        per_step: list[dict[str, float]] = []
        for mb in data.make_iterator(mini_rows, epochs=epochs, shuffle=critic.shuffle, seed=derive_seed(step, 11)):
            mb.meta_info.update(data.meta_info)
            per_step.append({f"critic/{k}": float(v) for k, v in self.engine.train_step(mb, loss_fn).items()})
        out = reduce_metrics(per_step)
        out["critic/lr"] = self.engine.lr_scheduler_step()
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(os.path.join(path, "critic"))
        # config + tokenizer: `hybridflow merge --local_dir STEP/critic` rebuilds the value model from the shards
        self.engine.save_hf_config(os.path.join(path, "critic", "huggingface"))
        save_rank_state(os.path.join(path, "critic", f"rank_state_{self.rank}.json"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(os.path.join(path, "critic"))
        load_rank_state(os.path.join(path, "critic", f"rank_state_{self.rank}.json"))
