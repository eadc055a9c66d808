"""Tensor-parallel native rollout on a real 2-rank Ray group (gloo): TP 2 decodes what TP 1 decodes, token for token;
after each resharded sync (FSDP2 shards -> TP slices) its log-probs equal the training engine's; the slices moved are
the rank's own, not the full model; its collectives in shared memory give gloo's bits."""

from __future__ import annotations

import pytest
import torch
from tp_workers import TPCheckWorker, ship_by_value

from hybridflow.protocol import DataProto
from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup


def prompts(rows: int = 5, length: int = 7) -> DataProto:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : i % 4] = 0  # left padding of several widths
    ids = ids.masked_fill(mask == 0, 0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks_odd_vocab"])
def group(request, ray_session, tiny_model_path, tmp_path_factory):
    """2 ranks: one TP-2 group over 2 FSDP2 shards. 4 ranks: two TP-2 groups over 4 shards, with a vocabulary of
    289 rows (uneven FSDP2 chunks 73/73/73/70 and an uneven vocabulary split 145/144)."""
    from hybridflow.engines.tiny import TinyModelSpec, write_tiny_model

    world = request.param
    path = tiny_model_path
    if world == 4:
        path = write_tiny_model(tmp_path_factory.mktemp("odd_vocab"), TinyModelSpec(vocab_size=289), seed=0)
    ship_by_value()
    wg = WorkerGroup(ResourcePool([world], num_cpus_per_process=0.5, name=f"tp_rollout{world}"),
                     ClassWithInitArgs(TPCheckWorker), name_prefix=f"tprl{world}", num_threads=1)
    info = wg.setup(path, 2)
    assert info[0]["sharded_params"] == info[0]["params"]  # the actor really is FSDP2-sharded over the ranks
    # ranks of one host on CPU: the TP engines' collectives go through shared memory unless told otherwise
    assert all(i["collectives"] == {2: "shm", "static": "shm", "torch": "torch"} for i in info), info
    yield wg
    wg.shutdown()


def check_tp_matches_tp1_and_actor(wg) -> None:
    batch = prompts()
    for greedy in (True, False):
        tp1, tp2 = wg.generate(batch, 1, greedy), wg.generate(batch, 2, greedy)
        # every TP rank produced the same rows (one random stream per group, tokens broadcast from TP rank 0), and
        # so did every group (the same prompts and seed here)
        for other in tp2[1:]:
            assert torch.equal(tp2[0].batch["responses"], other.batch["responses"])
        assert torch.equal(tp1[0].batch["responses"], tp2[0].batch["responses"]), f"greedy={greedy}"
        assert torch.allclose(tp1[0].batch["rollout_log_probs"], tp2[0].batch["rollout_log_probs"], atol=1e-5)
        out = tp2[0]
        temperature = 1.0 if greedy else 0.9
        actor = wg.actor_log_probs(out, temperature)[0]
        mask = out.batch["response_mask"].bool()
        assert mask.sum() > 0
        gap = (actor - out.batch["rollout_log_probs"]).abs()[mask].max().item()
        assert gap <= 1e-5, f"rollout vs actor log-prob gap {gap} (greedy={greedy})"


def test_tp2_rollout_matches_tp1_and_the_actor_after_each_resharded_sync(group):
    wg = group
    # before any sync: the fixed-shape TP step decodes what the eager TP-1 loop decodes
    batch = prompts()
    static, eager = wg.generate(batch, "static", True)[0], wg.generate(batch, 1, True)[0]
    assert torch.equal(static.batch["responses"], eager.batch["responses"])
    # shared memory and gloo sum two ranks' partial results in the one order two values have: the same bits
    for greedy in (True, False):
        shm, gloo = wg.generate(batch, 2, greedy)[0], wg.generate(batch, "torch", greedy)[0]
        for key in ("responses", "rollout_log_probs"):
            assert torch.equal(shm.batch[key], gloo.batch[key]), (key, greedy)
    stats = wg.sync(2)  # start from the actor's weights (the engines loaded the checkpoint: the same values)
    check_tp_matches_tp1_and_actor(wg)
    for seed in (5, 6):  # two updates, each followed by a resharded sync
        wg.perturb(seed)
        stats = wg.sync(2)
        check_tp_matches_tp1_and_actor(wg)
    for rank_stats in stats:
        r, f = rank_stats["reshard"], rank_stats["full"]
        assert r["tensors"] == f["tensors"] > 0 and r["fallback_tensors"] == 0
        # each rank keeps about half of the model and receives less than the all-gather baseline
        assert r["bytes_kept"] < 0.6 * f["bytes_kept"]
        assert 0 < r["bytes_received"] < f["bytes_received"]
        assert r["peak_transient_bytes"] <= f["peak_transient_bytes"] * 2


@pytest.mark.parametrize("placement", [
    ("trainer.n_gpus_per_node=2",),  # hybrid engine: the actor's 2 FSDP2 ranks generate as one TP-2 group
    # a rollout group of its own (2 ranks, one TP-2 group) fed full tensors by a 1-rank actor: each keeps its slice
    ("actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.n_gpus_per_node=2"),
    # LoRA: the merged weights W + (alpha/r) B A are gathered whole (lora.py) and each TP rank keeps its slice
    ("trainer.n_gpus_per_node=2", "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"),
], ids=["hybrid_fsdp2", "separate_rollout_group", "hybrid_lora"])
def test_grpo_steps_with_tp2_rollout(ray_session, arithmetic_files, tiny_model_path, tmp_path, placement):
    """The main job with a TP-2 rollout: one chunk per TP group, rows from its TP rank 0, exact log-probs."""
    import json

    from e2e_helpers import tiny_run_overrides

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=ray",
                                         *placement, "trainer.total_training_steps=3",
                                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    assert run_training(cfg, progress=False).global_step == 3
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert len(rows) == 3
    for row in rows:  # steps 2 and 3 generate with resharded weights: the actor re-scores them exactly
        assert row["rollout/mismatch_max_abs"] <= 1e-5, row["rollout/mismatch_max_abs"]
        assert row["response_length/mean"] > 0


def test_a_tp_rank_killed_in_generation_restarts_the_run(ray_session, arithmetic_files, tiny_model_path, tmp_path):
    """TP rank 1 dies at the start of step 2's generation while TP rank 0 waits for it inside a collective (in shared
    memory on CPU): the driver sees the death, the run resumes from step 1's checkpoint and finishes."""
    import json

    from e2e_helpers import tiny_run_overrides

    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=ray",
                                         "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3",
                                         "trainer.save_freq=1", "trainer.fault_injection=generate_sequences:1:2",
                                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2"))
    assert run_training(cfg, progress=False).global_step == 3
    rows = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [row.get("training/global_step", row.get("step")) for row in rows][-1] == 3
    assert rows[-1]["training/restarts"] == 1
