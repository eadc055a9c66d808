"""veRL's fsdp_config.forward_prefetch on 2 ranks (Ray actors, gloo, FSDP2): every decoder layer prefetches the next
one's all-gather, and training and log-probs are those of the engine without it."""

from __future__ import annotations

import sys

import ray
import torch
from rank_pool import on_all
from test_train_distributed import OPTIM, WORLD, make_batch, seq_mean_pg_loss

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.trainer.config import load_config
from hybridflow.workers.engine_config import engine_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PrefetchRank:
    def run(self, model_path: str, prefetch: bool, shards: list, probe) -> dict:
        engine = FSDPEngine(EngineConfig(model_path=model_path, optim=OPTIM, forward_prefetch=prefetch))
        layers = engine.model.hf.model.layers
        # FSDP2 keeps each module's explicit prefetch targets on its state (no public getter)
        targets = [[m for s in layer._get_fsdp_state()._states_to_forward_prefetch for m in s._modules]
                   for layer in layers]
        wired = all(t == [after] for t, after in zip(targets[:-1], layers[1:])) and not targets[-1]
        norms = [engine.train_step(shard, seq_mean_pg_loss)["grad_norm"] for shard in shards]
        log_probs = engine.compute_log_prob(probe, temperature=0.8)["log_probs"]
        return {"wired": wired, "any_prefetch": any(targets), "norms": norms, "log_probs": log_probs,
                "state": engine.full_state_dict()}


def test_two_ranks_prefetch_the_next_layer_and_train_the_same(rank_pool, tiny_model_path):
    batches = [make_batch(rows=8, prompt_len=8, response_len=12, seed=40 + i) for i in range(2)]
    shards = [[b[r * 4 : (r + 1) * 4] for b in batches] for r in range(WORLD)]
    probe = make_batch(rows=4, prompt_len=8, response_len=12, seed=77)
    probes = [probe[0:2], probe[2:4]]
    with rank_pool.spmd(WORLD, PrefetchRank) as actors:
        plain = on_all(actors, "run", [tiny_model_path] * WORLD, [False] * WORLD, shards, probes)
        fetched = on_all(actors, "run", [tiny_model_path] * WORLD, [True] * WORLD, shards, probes)
    assert all(r["wired"] and r["any_prefetch"] for r in fetched) and not any(r["any_prefetch"] for r in plain)
    for a, b in zip(plain, fetched):
        assert a["norms"] == b["norms"]  # the same collectives, earlier: the same numbers
        assert torch.equal(a["log_probs"], b["log_probs"])
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def test_the_keys_reach_each_engine(tiny_model_path):
    arr = load_config(["actor_rollout_ref.actor.fsdp_config.forward_prefetch=true"]).actor_rollout_ref
    common = {"model_path": tiny_model_path, "model": arr.model, "seed": 0, "micro_batch_size": 2,
              "use_dynamic_bsz": False, "max_token_len": 64}
    assert engine_config(role="actor", fsdp=arr.actor.fsdp_config, **common).forward_prefetch is True
    assert engine_config(role="ref", fsdp=arr.ref.fsdp_config, **common).forward_prefetch is False
