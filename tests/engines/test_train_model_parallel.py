"""Tensor-parallel and Ulysses sequence-parallel training on 2 and 4 real ranks (Ray actors of the file's rank pool,
gloo, FSDP2 + DTensor) against the same engine on one rank: gradients, grad norm, log-probs/entropy, a training
step, weight export, a checkpoint put together offline and a checkpoint round trip. Start-up errors name the numbers
to change."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from e2e_helpers import make_batch
from rank_pool import on_all

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.hf_model import hf_name
from hybridflow.engines.tensor_parallel_train import check_tensor_parallel
from hybridflow.engines.tiny import TinyModelSpec, make_config, write_tiny_model
from hybridflow.engines.train_mesh import check_mesh_sizes
from hybridflow.engines.ulysses import check_sequence_parallel
from hybridflow.protocol import DataProto
from hybridflow.trainer.export import load_full_actor_state

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# Adam's first step moves each weight by ~lr * g / |g|: where |g| is near eps, float-rounding differences of g show
# up scaled by lr, so the step after the (1e-5-equal) gradients is compared at a small lr.
OPTIM = OptimConfig(lr=1e-4, weight_decay=0.01, grad_clip=1.0)
# token budget: the ranks' shards get different micro-batch counts, which the engine must even out
ENGINE = {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 80}
ROWS = 8


def pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    """Sequence-mean policy-gradient term plus a token-mean entropy bonus: both global counts are used."""
    mask = micro.batch["response_mask"].float()
    loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_seqs"]
    loss = loss - 0.01 * (outputs["entropy"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {"loss": loss.detach()}


def value_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    mask = micro.batch["response_mask"].float()
    err = (outputs["values"] - micro.batch["returns"]) ** 2 * mask
    return err.sum() / micro.meta_info["global_num_tokens"], {}


def full_grads(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.model.named_parameters():
        g = p.grad
        out[hf_name(name)] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


class ParallelRank:
    def __init__(self, path: str, tp: int, sp: int, role: str = "actor", fsdp_size: int = -1) -> None:
        self.engine = FSDPEngine(EngineConfig(model_path=path, role=role, optim=OPTIM, tensor_parallel_size=tp,
                                              ulysses_sequence_parallel_size=sp, fsdp_size=fsdp_size, **ENGINE))
        self.loss = value_loss if role == "critic" else pg_loss

    def values(self, shard: DataProto):
        return self.engine.compute_values(shard)

    def grads(self, shard: DataProto):
        self.engine.forward_backward(shard, self.loss)
        grads = full_grads(self.engine)
        norm = self.engine._clip_grad_norm()
        self.engine.optimizer.zero_grad(set_to_none=True)
        return grads, norm

    def log_probs(self, shard: DataProto):
        return self.engine.compute_log_prob(shard, temperature=0.7, calculate_entropy=True)

    def train(self, shard: DataProto):
        return self.engine.train_step(shard, pg_loss)

    def state(self):
        return self.engine.full_state_dict()

    def q_proj_layout(self):
        p = self.engine.model.hf.model.layers[0].self_attn.q_proj.weight
        return p.device_mesh.mesh_dim_names, tuple(p.to_local().shape), tuple(p.shape)

    def tp_backend(self) -> str:
        import torch.distributed as dist

        return dist.get_backend(self.engine.train_mesh.mesh.get_group("tp"))

    def fsdp_backends(self) -> list[tuple[int, str]]:
        """(ranks, backend) of each dim of the mesh FSDP shards and replicates over."""
        import torch.distributed as dist

        mesh = self.engine.mesh
        return [(mesh.size(d), dist.get_backend(mesh.get_group(d))) for d in range(mesh.ndim)]

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.engine.load_checkpoint(directory)


CASES = [
    # world, tp, sp, arch, tied embeddings
    pytest.param(2, 2, 1, "qwen2", True, id="tp2-qwen2"),
    # per-head q/k RMSNorm weights see only a rank's heads: their gradient must be summed over TP
    pytest.param(2, 2, 1, "qwen3", True, id="tp2-qwen3-qk-norm"),
    pytest.param(2, 2, 1, "gemma3_text", True, id="tp2-gemma3-qk-norm"),
    pytest.param(2, 1, 2, "qwen3", True, id="sp2-qwen3"),
    pytest.param(4, 2, 1, "llama", False, id="tp2xdp2-llama-vocab-parallel-head"),
    pytest.param(4, 1, 4, "qwen2", True, id="sp4-qwen2-kv-heads-repeated"),
    pytest.param(4, 2, 2, "mistral", False, id="tp2xsp2-mistral"),
    # FSDP over the flattened dp x sp group (its own shared-memory group), Ulysses' all-to-alls over sp
    pytest.param(4, 1, 2, "qwen3", True, id="sp2xdp2-qwen3"),
    # a layer without rotary embedding (SmolLM3's NoPE) among rotating ones: each rank with a slice of the heads, or
    # with a piece of every sequence
    pytest.param(2, 2, 1, "smollm3", False, id="tp2-smollm3-nope"),
    pytest.param(2, 1, 2, "smollm3", True, id="sp2-smollm3-nope"),
]


@pytest.mark.parametrize("world, tp, sp, arch, tied", CASES)
def test_model_parallel_training_equals_one_rank(rank_pool, tmp_path, world, tp, sp, arch, tied):
    path = write_tiny_model(tmp_path / "model", TinyModelSpec(arch=arch, tie_word_embeddings=tied), seed=1)
    batch = make_batch(rows=ROWS, prompt_len=8, response_len=16, seed=5)
    probe = make_batch(rows=ROWS, prompt_len=8, response_len=16, seed=6)
    single = FSDPEngine(EngineConfig(model_path=path, optim=OPTIM, **ENGINE))
    single.forward_backward(batch, pg_loss)
    ref_grads, ref_norm = full_grads(single), single._clip_grad_norm()
    single.optimizer.zero_grad(set_to_none=True)
    ref_lp = single.compute_log_prob(probe, temperature=0.7, calculate_entropy=True)
    single.train_step(batch, pg_loss)
    ref_state = single.full_state_dict()

    with rank_pool.spmd(world, ParallelRank, path, tp, sp) as actors:
        per = ROWS // world
        shards = [batch[r * per : (r + 1) * per] for r in range(world)]
        got = on_all(actors, "grads", shards)
        for grads, norm in got:
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            assert grads.keys() == ref_grads.keys()
            worst = max((float((grads[k] - ref_grads[k]).abs().max()), k) for k in grads)
            assert worst[0] <= 1e-5, worst
        names, local, full = on_all(actors, "q_proj_layout")[0]
        if tp > 1:  # really split: each rank holds 1/(tp * fsdp ranks) of q_proj, on a mesh with a tp dim
            assert "tp" in names and local[0] * world == full[0]
            # ranks of one host on CPU: the tp groups' collectives go through shared memory
            assert on_all(actors, "tp_backend") == ["hybridflow_shm"] * world
        if world // (tp * sp) > 1:  # and FSDP's shards over dp
            assert all(b == "hybridflow_shm" for dims in on_all(actors, "fsdp_backends") for _, b in dims)

        outs = on_all(actors, "log_probs", [probe[r * per : (r + 1) * per] for r in range(world)])
        for key in ("log_probs", "entropy"):
            assert float((torch.cat([o[key] for o in outs]) - ref_lp[key]).abs().max()) <= 1e-5

        on_all(actors, "train", shards)
        states = on_all(actors, "state")
        for state in states:
            assert list(state) == list(ref_state)
            assert max(float((state[k] - ref_state[k]).abs().max()) for k in state) <= 1e-5

        # the checkpoint's per-rank files, put together offline (hybridflow export / merge), are the gathered state
        ckpt = str(tmp_path / "ckpt")
        on_all(actors, "save", [ckpt] * world)
        exported = load_full_actor_state(ckpt)
        assert list(exported) == list(states[0])
        assert all(torch.equal(exported[k], states[0][k]) for k in exported)

        if world == 4 and tp > 1 and sp > 1:  # resume: a checkpoint restores the exact sharded state
            on_all(actors, "train", shards)
            assert on_all(actors, "state")[0]["model.norm.weight"].ne(states[0]["model.norm.weight"]).any()
            on_all(actors, "load", [ckpt] * world)
            back = on_all(actors, "state")[0]
            assert all(torch.equal(back[k], states[0][k]) for k in back)


@pytest.mark.parametrize("world, fsdp_size", [(2, 1), (4, 2)], ids=["replicated-2", "2-replicas-of-2-shards"])
def test_hybrid_sharding_trains_like_one_rank_and_its_checkpoint_exports(rank_pool, tmp_path, tiny_model_path, world,
                                                                          fsdp_size):
    """fsdp_size < world: a (replicate, shard) mesh; every replica's files hold the same rows, which export must
    place once (joining them all as rows doubled the embedding)."""
    batch = make_batch(rows=ROWS, prompt_len=8, response_len=16, seed=8)
    single = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM, **ENGINE))
    single.train_step(batch, pg_loss)
    ref_state = single.full_state_dict()
    with rank_pool.spmd(world, ParallelRank, tiny_model_path, 1, 1, "actor", fsdp_size) as actors:
        per = ROWS // world
        on_all(actors, "train", [batch[r * per : (r + 1) * per] for r in range(world)])
        state = on_all(actors, "state")[0]
        assert max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state) <= 1e-5
        # one host's CPUs: FSDP's groups of more than one rank gather and reduce in shared memory
        for dims in on_all(actors, "fsdp_backends"):
            assert all(backend == "hybridflow_shm" for size, backend in dims if size > 1), dims
        ckpt = str(tmp_path / "ckpt")
        on_all(actors, "save", [ckpt] * world)
        exported = load_full_actor_state(ckpt)
        assert all(torch.equal(exported[k], state[k]) for k in state)


@pytest.mark.parametrize("tp, sp", [(2, 1), (1, 2)], ids=["tp2", "sp2"])
def test_critic_values_and_gradients_with_tp_or_sp_equal_one_rank(rank_pool, tiny_model_path, tp, sp):
    batch = make_batch(rows=ROWS, prompt_len=8, response_len=16, seed=7)
    single = FSDPEngine(EngineConfig(model_path=tiny_model_path, role="critic", optim=OPTIM, **ENGINE))
    ref_values = single.compute_values(batch)
    single.forward_backward(batch, value_loss)
    ref_grads = full_grads(single)
    with rank_pool.spmd(2, ParallelRank, tiny_model_path, tp, sp, "critic") as actors:
        shards = [batch[: ROWS // 2], batch[ROWS // 2 :]]
        values = torch.cat(on_all(actors, "values", shards))
        assert float((values - ref_values).abs().max()) <= 1e-5
        grads, _ = on_all(actors, "grads", shards)[0]
        assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) <= 1e-5


def test_start_up_errors_name_the_numbers():
    qwen = make_config(TinyModelSpec(arch="qwen2", num_heads=6, num_kv_heads=2, hidden_size=48,
                                     intermediate_size=96))
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 does not divide the model's "
                                         r"num_attention_heads=6.*choose a size that divides all three: \[1, 2\]"):
        check_tensor_parallel(qwen, 4)
    with pytest.raises(ValueError, match=r"=3 does not divide the model's num_key_value_heads=2"):
        check_tensor_parallel(qwen, 3)
    wide = make_config(TinyModelSpec(arch="llama", num_heads=4, num_kv_heads=4, intermediate_size=90))
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size=90"):
        check_tensor_parallel(wide, 4)
    with pytest.raises(ValueError, match=r"supports model types .* this model is 'phi3'"):
        check_tensor_parallel(make_config(TinyModelSpec(arch="phi3")), 2)
    with pytest.raises(ValueError, match=r"world of 6 ranks is not divisible by tensor_model_parallel_size \(2\) x "
                                         r"ulysses_sequence_parallel_size \(2\) = 4"):
        check_mesh_sizes(6, 2, 2)
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=4 does not divide the 2 attention heads "
                                         r"per tensor-parallel rank \(num_attention_heads=4 / "
                                         r"tensor_model_parallel_size=2\)"):
        check_sequence_parallel(make_config(TinyModelSpec()), 4, tp=2)
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=16\)"):
        check_sequence_parallel(make_config(TinyModelSpec(arch="mistral", sliding_window=16)), 2)


def test_config_refuses_sizes_that_do_not_fit_before_workers_start(tiny_model_path):
    from hybridflow.trainer.config import ConfigError, load_config

    base = [f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.fsdp_config.tensor_model_parallel_size=4.*"
                                          r"world of 2 ranks is not divisible"):
        load_config([*base, "actor_rollout_ref.actor.fsdp_config.tensor_model_parallel_size=4"])
    # the unit model has 2 KV heads; the ref engine's own key is checked on its own
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.ref.ulysses_sequence_parallel_size=2 needs "
                                          r"use_remove_padding"):
        load_config([*base, "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                     "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ConfigError, match=r"with LoRA"):
        load_config([*base, "actor_rollout_ref.actor.fsdp_config.tensor_model_parallel_size=2",
                     "actor_rollout_ref.model.lora_rank=4"])
    # veRL's newer spelling inside fsdp_config reaches the same key
    cfg = load_config([*base, "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                       "critic.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert cfg.critic.ulysses_sequence_parallel_size == 2
