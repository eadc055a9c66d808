"""FSDPEngine on 2 ranks: two real Ray actors (the file's rank pool), a gloo process group, FSDP2 sharding.
Compared against world size 1."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from rank_pool import on_all

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.protocol import DataProto

# Ray workers cannot import this test module by name (pytest put its folder on sys.path only here): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 2
OPTIM = OptimConfig(lr=1e-4, weight_decay=0.01, lr_warmup_steps=1, lr_scheduler_type="cosine", total_training_steps=5)


def make_batch(rows: int, prompt_len: int, response_len: int, seed: int) -> DataProto:
    """Rollout-layout rows (left-padded prompts, right-padded responses of 4x-varying length)."""
    g = torch.Generator().manual_seed(seed)
    seq = prompt_len + response_len
    input_ids = torch.randint(4, 250, (rows, seq), generator=g)
    attention_mask = torch.zeros(rows, seq, dtype=torch.long)
    prompt_lens = torch.randint(2, prompt_len + 1, (rows,), generator=g)
    resp_lens = torch.randint(max(1, response_len // 4), response_len + 1, (rows,), generator=g)
    for i in range(rows):
        attention_mask[i, prompt_len - prompt_lens[i] : prompt_len + resp_lens[i]] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    response_mask = attention_mask[:, prompt_len:]
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt_len:],
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response_len, generator=g) * response_mask,
        },
        meta_info={"temperature": 0.8, "calculate_entropy": True},
    )


def seq_mean_pg_loss(micro: DataProto, outputs: dict[str, torch.Tensor]):
    """Sequence-mean-of-token-sums loss plus entropy: exercises both global counts the engine provides."""
    mask = micro.batch["response_mask"].float()
    per_seq = (micro.batch["advantages"] * outputs["log_probs"] * mask).sum(-1)
    loss = -per_seq.sum() / micro.meta_info["global_num_seqs"]
    loss = loss - 0.01 * (outputs["entropy"] * mask).sum() / micro.meta_info["global_num_tokens"]
    return loss, {"loss": loss.detach(), "dp_size": micro.meta_info["dp_size"]}


class EngineRank:
    """One SPMD rank's FSDPEngine (on a process of the rank pool, in its gloo group)."""

    def __init__(self) -> None:
        self.engine = None

    def build(self, model_path: str, **overrides) -> None:
        self.engine = FSDPEngine(EngineConfig(model_path=model_path, optim=OPTIM, **overrides))

    def onednn_linears(self) -> int:
        return sum(type(m).__name__ == "OneDNNLinear" for m in self.engine.model.modules())

    def train(self, shards: list[DataProto]) -> list[dict]:
        out = []
        for shard in shards:
            out.append(self.engine.train_step(shard, seq_mean_pg_loss))
            self.engine.lr_scheduler_step()
        return out

    def log_probs(self, shard: DataProto, base: bool = False) -> dict:
        return self.engine.compute_log_prob(shard, temperature=0.8, calculate_entropy=True, base=base)

    def local_lora_shards(self) -> dict[str, torch.Tensor]:
        return {n: p.to_local().clone() for n, p in self.engine.model.named_parameters() if ".lora_" in n}

    def full_state_dict(self) -> dict:
        return self.engine.full_state_dict()

    def names(self) -> list[str]:
        return [name for name, _ in self.engine.named_full_parameters()]

    def local_dtypes(self) -> dict[str, torch.dtype]:
        return {n: p.dtype for n, p in self.engine.model.named_parameters()}

    def local_numel(self) -> int:
        return sum(p.to_local().numel() for p in self.engine.model.parameters())

    def save(self, directory: str) -> None:
        self.engine.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.engine.load_checkpoint(directory)


@pytest.fixture(scope="module")
def ranks(rank_pool):
    with rank_pool.spmd(WORLD, EngineRank) as actors:
        yield actors


def test_two_ranks_train_like_one_rank_on_the_same_global_batch(ranks, tiny_model_path, tmp_path):
    overrides = {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 80}
    batches = [make_batch(rows=8, prompt_len=8, response_len=16, seed=20 + i) for i in range(3)]
    single = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM, **overrides))
    single_metrics = []
    for batch in batches:
        single_metrics.append(single.train_step(batch, seq_mean_pg_loss))
        single.lr_scheduler_step()

    on_all(ranks, "build", [tiny_model_path] * WORLD, **overrides)
    # The model really is sharded: each rank holds about half of the parameters.
    total = sum(t.numel() for t in single.full_state_dict().values())
    assert all(n < 0.6 * total for n in on_all(ranks, "local_numel"))
    # Rank 0's shard holds rows 0-3 and rank 1's rows 4-7 of each batch; the response lengths differ per shard, so
    # the token budget alone would give the ranks different micro-batch counts.
    shards = [[b[r * 4 : (r + 1) * 4] for b in batches] for r in range(WORLD)]
    metrics = on_all(ranks, "train", shards)
    for step in range(3):
        assert metrics[0][step]["grad_norm"] == pytest.approx(single_metrics[step]["grad_norm"], rel=1e-5)
        assert metrics[0][step]["grad_norm"] == metrics[1][step]["grad_norm"]
        assert metrics[0][step]["dp_size"] == WORLD and metrics[0][step]["skipped_nonfinite"] == 0.0
    expected = single.full_state_dict()
    for state in on_all(ranks, "full_state_dict"):
        assert state.keys() == expected.keys()
        assert max(float((state[k] - expected[k]).abs().max()) for k in state) <= 1e-5
    assert on_all(ranks, "names")[0] == list(expected)

    probe = make_batch(rows=6, prompt_len=8, response_len=16, seed=99)
    outs = on_all(ranks, "log_probs", [probe[0:3], probe[3:6]])
    mine = single.compute_log_prob(probe, temperature=0.8, calculate_entropy=True)
    for key in ("log_probs", "entropy"):
        both = torch.cat([outs[0][key], outs[1][key]])
        assert float((both - mine[key]).abs().max()) <= 1e-5

    # Checkpoint on 2 ranks, take one more step, then rebuild, load and repeat the step: bitwise equal.
    ckpt = str(tmp_path / "ckpt")
    on_all(ranks, "save", [ckpt] * WORLD)
    extra = make_batch(rows=8, prompt_len=8, response_len=16, seed=30)
    extra_shards = [[extra[0:4]], [extra[4:8]]]
    first = on_all(ranks, "train", extra_shards)
    after = on_all(ranks, "full_state_dict")[0]
    on_all(ranks, "build", [tiny_model_path] * WORLD, **overrides)
    on_all(ranks, "load", [ckpt] * WORLD)
    second = on_all(ranks, "train", extra_shards)
    assert second[0][0]["lr"] == first[0][0]["lr"] and second[0][0]["grad_norm"] == first[0][0]["grad_norm"]
    resumed = on_all(ranks, "full_state_dict")[0]
    assert all(torch.equal(after[k], resumed[k]) for k in after)


@pytest.mark.parametrize("onednn_linears", [None, True], ids=["default-linears", "onednn-linears"])
def test_two_ranks_train_lora_like_one_rank(ranks, tiny_model_path, tmp_path, onednn_linears):
    """PEFT-wrapped decoder layers shard per layer like plain ones: same updates, merged weights and adapter resume;
    also with the linears on oneDNN (onednn_train.py: FSDP2 shards, PEFT wraps and resume see no difference)."""
    from hybridflow.engines.lora import LoraSettings
    from hybridflow.engines.rollout.onednn_linear import onednn_available

    if onednn_linears and not onednn_available(torch.float32):
        pytest.skip("this torch build has no working oneDNN fp32 linear")
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    overrides = {"micro_batch_size_per_gpu": 2, "lora": lora, "onednn_linears": onednn_linears}
    batches = [make_batch(rows=8, prompt_len=8, response_len=16, seed=40 + i) for i in range(3)]
    single = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM, **overrides))
    single_metrics = []
    for batch in batches:
        single_metrics.append(single.train_step(batch, seq_mean_pg_loss))
        single.lr_scheduler_step()
    on_all(ranks, "build", [tiny_model_path] * WORLD, **overrides)
    assert all((n > 0) == bool(onednn_linears) for n in on_all(ranks, "onednn_linears"))
    metrics = on_all(ranks, "train", [[b[r * 4 : (r + 1) * 4] for b in batches] for r in range(WORLD)])
    for step in range(3):
        assert metrics[0][step]["grad_norm"] == pytest.approx(single_metrics[step]["grad_norm"], rel=1e-5)
    expected = single.full_state_dict()  # merged, base names
    for state in on_all(ranks, "full_state_dict"):
        assert state.keys() == expected.keys()
        assert max(float((state[k] - expected[k]).abs().max()) for k in state) <= 1e-5
    probe = make_batch(rows=6, prompt_len=8, response_len=16, seed=98)
    outs = on_all(ranks, "log_probs", [probe[0:3], probe[3:6]])
    mine = single.compute_log_prob(probe, temperature=0.8, calculate_entropy=True)
    assert float((torch.cat([outs[0]["log_probs"], outs[1]["log_probs"]]) - mine["log_probs"]).abs().max()) <= 1e-5

    ckpt = str(tmp_path / "lora_ckpt")
    on_all(ranks, "save", [ckpt] * WORLD)
    extra_shards = [[batches[0][0:4]], [batches[0][4:8]]]
    first = on_all(ranks, "train", extra_shards)
    after = on_all(ranks, "full_state_dict")[0]
    on_all(ranks, "build", [tiny_model_path] * WORLD, **overrides)
    on_all(ranks, "load", [ckpt] * WORLD)
    second = on_all(ranks, "train", extra_shards)
    assert second[0][0]["grad_norm"] == first[0][0]["grad_norm"]
    resumed = on_all(ranks, "full_state_dict")[0]
    assert all(torch.equal(after[k], resumed[k]) for k in after)


def test_two_ranks_lora_in_bf16_train_after_the_reference_pass(ranks, tiny_model_path):
    """bf16 compute on sharded ranks (FSDP2 gathers bf16 parameters, reduces gradients in fp32 into the fp32 master
    shards) with LoRA, where the actor's first forward is the reference pass with the adapter disabled, as in a
    GRPO step with KL: PEFT freezes a disabled adapter, and FSDP2 fixes at its first forward which parameters train
    and casts only their reduced gradients back to fp32. The updates then match one rank's within bf16 rounding."""
    from hybridflow.engines.lora import LoraSettings

    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    overrides = {"micro_batch_size_per_gpu": 2, "lora": lora, "param_dtype": "bf16"}
    batches = [make_batch(rows=8, prompt_len=8, response_len=16, seed=60 + i) for i in range(2)]
    single = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OPTIM, **overrides))
    base_single = single.compute_log_prob(batches[0], temperature=0.8, base=True)["log_probs"]
    single_metrics = [single.train_step(batch, seq_mean_pg_loss) for batch in batches]
    on_all(ranks, "build", [tiny_model_path] * WORLD, **overrides)
    for dtypes in on_all(ranks, "local_dtypes"):  # the frozen base's projections sharded in bf16, adapters fp32
        assert {d for n, d in dtypes.items() if ".base_layer." in n} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if ".lora_" in n or "norm" in n} == {torch.float32}
    base = on_all(ranks, "log_probs", [batches[0][0:4], batches[0][4:8]], base=True)
    assert float((torch.cat([b["log_probs"] for b in base]) - base_single).abs().max()) <= 0.05
    before = on_all(ranks, "local_lora_shards")
    metrics = on_all(ranks, "train", [[b[r * 4 : (r + 1) * 4] for b in batches] for r in range(WORLD)])
    for old, new in zip(before, on_all(ranks, "local_lora_shards")):
        assert old.keys() == new.keys() and {t.dtype for t in new.values()} == {torch.float32}
        assert any(not torch.equal(old[k], new[k]) for k in new)
    for step in range(2):
        assert metrics[0][step]["grad_norm"] == pytest.approx(single_metrics[step]["grad_norm"], rel=0.05)
