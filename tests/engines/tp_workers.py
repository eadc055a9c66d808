"""A Ray worker for the tensor-parallel rollout tests: an FSDP2 actor and a TP-1 and a TP-t native rollout per rank."""

from __future__ import annotations

import sys

import torch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.engines.hf_model import hf_name
from hybridflow.engines.resharding import SyncStats, full_gather_parameters, sync_tensor_parallel
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.native_rollout import NativeRollout
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register


def ship_by_value() -> None:
    """pytest's test modules are not importable inside Ray workers: pickle this module by value."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TPCheckWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup(self, model_path: str, tp: int) -> dict:
        self.init_distributed()
        torch.manual_seed(0)
        self.actor = FSDPEngine(EngineConfig(model_path=model_path, micro_batch_size_per_gpu=8))
        self.rollouts = {1: NativeRollout(model_path, decode="eager"),
                         tp: NativeRollout(model_path, decode="eager", tensor_parallel_size=tp),
                         # the fixed-shape decode step (CUDA graphs' path, uncaptured), loaded from the checkpoint
                         "static": NativeRollout(model_path, decode="static", tensor_parallel_size=tp),
                         # the TP-t engine with torch.distributed's collectives (gloo) instead of shared memory
                         "torch": NativeRollout(model_path, decode="eager", tensor_parallel_size=tp,
                                                tp_collectives="torch")}
        sharded = sum(hasattr(p, "to_local") for p in self.actor.model.parameters())
        return {"sharded_params": sharded, "params": len(list(self.actor.model.parameters())),
                "collectives": {k: self.rollouts[k].tp_collectives.kind for k in (tp, "static", "torch")}}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate(self, prompts: DataProto, tp: int | str, greedy: bool) -> DataProto:
        params = SamplingParams(greedy=greedy, temperature=0.9, top_k=50, n=2, max_new_tokens=12, seed=11)
        return self.rollouts[tp].generate(prompts, params)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def perturb(self, seed: int) -> None:
        """Move the actor's weights (each rank its own shard), as an update would."""
        g = torch.Generator().manual_seed(seed + self.rank)
        with torch.no_grad():
            for p in self.actor.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.randn(local.shape, generator=g) * 0.05)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync(self, tp: int) -> dict:
        """Resharded sync into the TP engine, the full gather into the TP-1 one; both stats."""
        stats = sync_tensor_parallel(self.actor.model, self.rollouts[tp])
        full = SyncStats()
        named = ((hf_name(n), p) for n, p in self.actor.model.named_parameters())
        self.rollouts[1].update_weights(full_gather_parameters(named, full))
        kept = sum(t.numel() * t.element_size() for layer in self.rollouts[tp].model.layers for t in layer.values()
                   if t is not None)
        return {"reshard": stats.as_dict(), "full": full.as_dict(), "tp_layer_bytes": kept}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def actor_log_probs(self, data: DataProto, temperature: float) -> torch.Tensor:
        return self.actor.compute_log_prob(data, temperature=temperature)["log_probs"]
