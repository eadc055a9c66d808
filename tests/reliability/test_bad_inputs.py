"""Every bad input of issue 10, one test each: a clear error (what, where, how to fix) or a counted, logged skip.

The cases, in order: data files and tokenizers, reward functions, non-finite and exploding updates, checkpoints
(truncated, another model's, disk full), configuration and resources. Cases also covered elsewhere (tests/data,
tests/rewards, tests/trainer/test_config.py, tests/single_controller) are repeated here on purpose, so this file is
the complete list; docs/reliability.md maps each case to its test.

Everything runs at unit level (a one-rank FSDPEngine on the "unit" model, RewardManager with one worker, RLDataset on
a character tokenizer) except one small local-backend run that resumes past a truncated checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import DataConfigError, RLDataset
from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.tiny import TinyModelSpec, build_char_tokenizer, write_tiny_model
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardComputationError, RewardManager, load_custom_reward_fn
from hybridflow.trainer import checkpoint as ckpt_module
from hybridflow.trainer.checkpoint import LATEST_FILE, CheckpointError, CheckpointManager
from hybridflow.trainer.config import ConfigError, check_resources, load_config

HERE = os.path.dirname(__file__)
REWARD_FNS = os.path.join(HERE, "reward_fns.py")


# ============================================================================================ data files, tokenizers
@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def verl_row(question: str, answer: str = "42", source: str = "openai/gsm8k") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": 0},
    }


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_missing_column(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", [{k: v for k, v in verl_row("q").items() if k != "prompt"}])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tokenizer)
    msg = str(e.value)
    assert "d.parquet" in msg and "no column(s) ['prompt']" in msg  # what and where
    assert "prompt_key=" in msg  # how to fix: or name your prompt column


def test_wrong_column_type(tmp_path, tokenizer):
    bad = verl_row("q")
    bad["extra_info"] = "index=3"
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("fine"), bad])
    with pytest.raises(DataConfigError, match=r"d\.jsonl', row 1, column 'extra_info': expected a dict, got str"):
        RLDataset(path, tokenizer)


def test_empty_prompt(tmp_path, tokenizer):
    bad = verl_row("q")
    bad["prompt"] = [{"role": "system", "content": ""}, {"role": "user", "content": "  \n"}]
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("fine"), bad])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tokenizer)
    assert "row 1, column 'prompt': the prompt is empty" in str(e.value) and "drop the row or fill it in" in str(e.value)


def test_prompt_longer_than_limit_is_an_error_naming_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("short"), verl_row("x" * 200)])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tokenizer, max_prompt_length=64, filter_overlong_prompts=False, truncation="error")
    msg = str(e.value)
    assert "row 1" in msg and "longer than max_prompt_length=64" in msg
    assert "raise max_prompt_length" in msg and "filter_overlong_prompts=True" in msg


def test_prompt_longer_than_limit_is_filtered_counted_and_logged(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("short"), verl_row("x" * 200), verl_row("also short")])
    with caplog.at_level(logging.WARNING, logger="hybridflow.data.dataset"):
        ds = RLDataset(path, tokenizer, max_prompt_length=64)
    # Nothing lost silently: every row read is either kept or counted as filtered.
    assert ds.stats["num_rows_read"] == 3 and len(ds) == 2 and ds.stats["num_filtered_overlong"] == 1
    assert any("filtered 1 of 3 prompts longer than max_prompt_length=64" in r.getMessage() for r in caplog.records)


def test_chat_template_missing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("q")])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, build_char_tokenizer(chat_template=None), name="val")
    msg = str(e.value)
    assert msg.startswith("val dataset: the tokenizer has no chat template")
    assert "tokenizer.chat_template" in msg and "apply_chat_template=False" in msg


def test_tokenizer_without_pad_token(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("q")])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tok)
    assert "has no pad token" in str(e.value) and "tokenizer.pad_token = tokenizer.eos_token" in str(e.value)


def test_non_utf8_text(tmp_path, tokenizer):
    good = json.dumps(verl_row("fine")).encode()
    bad = json.dumps(verl_row("na_ve")).encode().replace(b"na_ve", b"na\xefve")
    path = tmp_path / "d.jsonl"
    path.write_bytes(good + b"\n" + good + b"\n" + bad + b"\n")
    with pytest.raises(DataConfigError) as e:
        RLDataset(str(path), tokenizer)
    msg = str(e.value)
    assert "d.jsonl" in msg and "line 3 (row 2)" in msg and "not valid UTF-8" in msg and "re-encode" in msg


def test_duplicate_ground_truth_that_disagrees(tmp_path, tokenizer):
    row = verl_row("q", answer="3")
    row["ground_truth"] = "4"  # a converter wrote the answer twice, differently
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("fine"), row])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tokenizer)
    msg = str(e.value)
    assert "row 1, column 'ground_truth': two different ground truths" in msg
    assert "'4'" in msg and "'3'" in msg and "keep one" in msg


def test_missing_ground_truth(tmp_path, tokenizer):
    row = verl_row("q")
    row["reward_model"] = {"style": "rule", "ground_truth": "   "}
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("fine"), row])
    with pytest.raises(DataConfigError) as e:
        RLDataset(path, tokenizer)
    msg = str(e.value)
    assert "row 1, column 'reward_model': no ground truth" in msg and "fill it in or drop the row" in msg


def test_duplicate_prompts_are_kept_and_counted(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [verl_row("q1"), verl_row("q2"), verl_row("q1"), verl_row("q1")])
    with caplog.at_level(logging.INFO, logger="hybridflow.data.dataset"):
        ds = RLDataset(path, tokenizer)
    assert len(ds) == 4 and ds.stats["num_duplicate_prompts"] == 2
    assert any("2 duplicate prompts (kept)" in r.getMessage() for r in caplog.records)


# ============================================================================================ reward functions
@pytest.fixture(scope="module")
def reward_manager(tokenizer):
    """One scoring worker, a 1 s per-sample timeout; failures score -1 and never stop the batch here."""
    fn = load_custom_reward_fn(f"{REWARD_FNS}:misbehaving")
    with RewardManager(tokenizer, fn, num_workers=1, timeout_s=1.0, failure_score=-1.0, max_failure_fraction=1.0) as rm:
        yield rm


def reward_batch(tokenizer, truths: list[str], data_source: str) -> DataProto:
    """Responses "ok<i>" in the rollout layout (right-padded, response_mask over the tokens)."""
    encoded = [tokenizer(f"ok{i}", add_special_tokens=False)["input_ids"] for i in range(len(truths))]
    width = max(len(e) for e in encoded) + 1
    ids = torch.full((len(truths), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(truths), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
    return DataProto.from_dict(
        {"responses": ids, "response_mask": mask},
        {"data_source": [data_source] * len(truths), "ground_truth": list(truths),
         "extra_info": [{"index": i} for i in range(len(truths))]},
    )


def score_with_one_bad_sample(rm, tokenizer, caplog, kind: str, source: str):
    """Row 1 of 4 misbehaves: it must be scored failure_score, counted, logged; the other rows scored as usual."""
    batch = reward_batch(tokenizer, ["ok", kind, "ok", "ok"], source)
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards.manager"):
        result = rm(batch)
    assert result.scores.tolist() == [1.0, -1.0, 1.0, 1.0]
    assert result.failed.tolist() == [False, True, False, False]
    assert result.metrics["reward/failures"] == 1.0 and result.metrics["reward/failure_fraction"] == 0.25
    # The failure's score sits on the last response token like any other score: nothing is dropped.
    assert result.token_level_scores.sum(-1).tolist() == [1.0, -1.0, 1.0, 1.0]
    logged = [r.getMessage() for r in caplog.records if source in r.getMessage()]
    assert len(logged) == 1, logged
    assert "(batch row 1)" in logged[0] and "scored as -1" in logged[0]
    return result, logged[0]


def test_reward_function_raising(reward_manager, tokenizer, caplog):
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "raise", "bad/raise")
    assert result.metrics["reward/raised"] == 1.0
    assert "reward raised" in log and "ZeroDivisionError: division by zero in the user's scorer" in log


def test_reward_function_hanging(reward_manager, tokenizer, caplog):
    start = time.monotonic()
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "hang", "bad/hang")
    assert time.monotonic() - start < 15  # bounded by timeout_s (1 s) plus a worker restart
    assert result.metrics["reward/timeouts"] == 1.0
    assert "reward timeout" in log and "no result after 1s; the worker was killed" in log
    # The stuck worker was replaced: the next batch scores normally.
    assert reward_manager(reward_batch(tokenizer, ["ok", "ok"], "bad/hang")).scores.tolist() == [1.0, 1.0]


def test_reward_function_returning_none(reward_manager, tokenizer, caplog):
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "none", "bad/none")
    assert result.metrics["reward/invalid"] == 1.0
    assert "reward invalid" in log and "returned NoneType None, not a number" in log


def test_reward_function_returning_nan(reward_manager, tokenizer, caplog):
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "nan", "bad/nan")
    assert result.metrics["reward/invalid"] == 1.0 and "returned nan" in log
    assert torch.isfinite(result.token_level_scores).all()
    inf_result = reward_manager(reward_batch(tokenizer, ["ok", "inf"], "bad/nan"))
    assert inf_result.scores.tolist() == [1.0, -1.0] and inf_result.metrics["reward/invalid"] == 1.0


def test_reward_function_returning_a_string(reward_manager, tokenizer, caplog):
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "string", "bad/string")
    assert result.metrics["reward/invalid"] == 1.0
    assert "returned str '0.75', not a number" in log  # a numeric-looking string is not silently parsed


def test_reward_function_returning_the_wrong_number_of_values(reward_manager, tokenizer, caplog):
    result, log = score_with_one_bad_sample(reward_manager, tokenizer, caplog, "two_values", "bad/two")
    assert result.metrics["reward/invalid"] == 1.0
    assert "returned a list of 2 values; return one number" in log


def test_reward_function_failing_on_most_samples_stops_the_run(tokenizer):
    fn = load_custom_reward_fn(f"{REWARD_FNS}:misbehaving")
    batch = reward_batch(tokenizer, ["none", "raise", "ok", "none"], "bad/most")
    with RewardManager(tokenizer, fn, num_workers=1, max_failure_fraction=0.5) as rm, pytest.raises(
        RewardComputationError
    ) as e:
        rm(batch)
    msg = str(e.value)
    assert "3 of 4 samples could not be scored (raised: 1, invalid: 2)" in msg
    assert "row 0, data_source 'bad/most': invalid - returned NoneType None" in msg
    assert "Fix the reward function" in msg and "max_failure_fraction" in msg


# ============================================================================================ non-finite / exploding
@pytest.fixture(scope="module")
def unit_model(tiny_model_path) -> str:
    """The session's "unit" model (tests/conftest.py): ~0.1M parameters, written once."""
    return tiny_model_path


def make_engine(path: str, **optim) -> FSDPEngine:
    return FSDPEngine(EngineConfig(model_path=path, micro_batch_size_per_gpu=4, optim=OptimConfig(lr=1e-3, **optim)))


def train_batch(rows: int = 4, prompt: int = 4, response: int = 6, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 250, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1),
            "responses": ids[:, prompt:],
            "response_mask": mask[:, prompt:],
            "advantages": torch.randn(rows, response, generator=g),
        },
        meta_info={"temperature": 1.0},
    )


def scaled_pg_loss(scale: float):
    def loss_fn(micro: DataProto, outputs: dict[str, torch.Tensor]):
        mask = micro.batch["response_mask"].float()
        loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / micro.meta_info["global_num_tokens"]
        return loss * scale, {"pg_loss": float(loss.detach())}

    return loss_fn


def snapshot(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_nonfinite_loss_skips_the_update_and_counts_it(unit_model, bad):
    engine = make_engine(unit_model)
    before = snapshot(engine)
    metrics = engine.train_step(train_batch(), scaled_pg_loss(bad))
    assert metrics["skipped_nonfinite"] == 1.0
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite update changed the weights"
    assert not engine.optimizer.state, "a skipped step must not touch the AdamW moments"
    # The next finite step trains as usual.
    ok = engine.train_step(train_batch(seed=1), scaled_pg_loss(1.0))
    assert ok["skipped_nonfinite"] == 0.0 and math.isfinite(ok["grad_norm"])
    assert any(not torch.equal(before[k], v) for k, v in engine.full_state_dict().items())


def test_nonfinite_updates_stop_the_run_after_k_in_a_row(tmp_path):
    from hybridflow.trainer.rl_trainer import NonFiniteUpdateError, RLTrainer

    cfg = load_config(["trainer.max_consecutive_nonfinite=3", f"trainer.default_local_dir={tmp_path}"])
    trainer = RLTrainer(cfg, groups=None, train_loader=None, reward_fn=None, validator=None, tracker=None,
                        tokenizer=None)
    skipped, finite = {"actor/skipped_nonfinite": 1.0}, {"actor/skipped_nonfinite": 0.0}
    trainer.check_finite(skipped)
    trainer.check_finite(skipped)
    trainer.check_finite(finite)  # a good step resets the count
    assert trainer.nonfinite_in_a_row == 0
    trainer.check_finite(skipped)
    trainer.check_finite(skipped)
    with pytest.raises(NonFiniteUpdateError) as e:
        trainer.check_finite(skipped)
    msg = str(e.value)
    assert "3 consecutive actor updates had a non-finite loss or gradient" in msg
    assert "actor_rollout_ref.actor.optim.lr" in msg and "trainer.max_consecutive_nonfinite" in msg


def test_gradient_norm_explosion_is_clipped_and_reported(unit_model):
    """A finite but huge gradient: the norm is reported before clipping, the update stays small and finite.

    There is no separate "explosion" guard: clipping to grad_clip (1.0) is what keeps the step bounded, and the
    pre-clip norm is logged as actor/grad_norm for the user to see.
    """
    normal, exploding = make_engine(unit_model), make_engine(unit_model)
    before = snapshot(exploding)
    base = normal.train_step(train_batch(), scaled_pg_loss(1.0))
    huge = exploding.train_step(train_batch(), scaled_pg_loss(1e12))
    assert huge["skipped_nonfinite"] == 0.0 and math.isfinite(huge["grad_norm"])
    assert huge["grad_norm"] == pytest.approx(base["grad_norm"] * 1e12, rel=1e-3)
    after = exploding.full_state_dict()
    step = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert math.isfinite(step) and step <= 2e-3  # about lr=1e-3: clipped, not blown up


def test_gradient_overflowing_to_inf_skips_the_update(unit_model):
    engine = make_engine(unit_model)
    before = snapshot(engine)
    metrics = engine.train_step(train_batch(), scaled_pg_loss(1e38))  # loss finite, gradient norm overflows
    assert metrics["skipped_nonfinite"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())


# ============================================================================================ checkpoints
def save_step(mgr: CheckpointManager, engine: FSDPEngine, step: int) -> str:
    """What RLTrainer.save_checkpoint does for a one-rank actor: shards into the staging folder, then commit."""
    tmp = mgr.staging_dir(step)
    engine.save_checkpoint(os.path.join(tmp, "actor"))
    return mgr.commit(tmp, step, {"global_step": step})


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_truncated_checkpoint_auto_resume_falls_back_to_the_previous_one(unit_model, tmp_path, caplog):
    engine = make_engine(unit_model)
    mgr = CheckpointManager(str(tmp_path / "run"))
    first = save_step(mgr, engine, 1)
    engine.train_step(train_batch(), scaled_pg_loss(1.0))
    second = save_step(mgr, engine, 2)
    weights = os.path.join(second, "actor", "model_rank0.safetensors")
    truncate(weights)
    with caplog.at_level(logging.WARNING, logger="hybridflow.trainer.checkpoint"):
        assert mgr.resolve("auto") == first
    assert any("skipping checkpoint" in r.getMessage() and weights in r.getMessage() and "truncated" in r.getMessage()
               for r in caplog.records)
    make_engine(unit_model).load_checkpoint(os.path.join(first, "actor"))  # the fallback really loads


def test_truncated_checkpoint_named_explicitly_is_a_clear_error(unit_model, tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    path = save_step(mgr, make_engine(unit_model), 1)
    weights = os.path.join(path, "actor", "model_rank0.safetensors")
    truncate(weights)
    with pytest.raises(CheckpointError) as e:
        mgr.resolve(path)
    msg = str(e.value)
    assert weights in msg and "truncated" in msg and "trainer.resume_mode" in msg


def test_truncated_weights_file_fails_to_load_naming_the_file(unit_model, tmp_path):
    """Below the manager (a checkpoint without a manifest, or `hybridflow export`): the loader itself must say which
    file is broken, not just what the safetensors parser saw."""
    engine = make_engine(unit_model)
    directory = str(tmp_path / "actor")
    engine.save_checkpoint(directory)
    weights = os.path.join(directory, "model_rank0.safetensors")
    truncate(weights)
    with pytest.raises(Exception) as e:  # any type: the test is about the message
        make_engine(unit_model).load_checkpoint(directory)
    msg = str(e.value)
    assert weights in msg, f"{type(e.value).__name__}: {msg}"


def test_export_of_a_truncated_checkpoint(unit_model, tmp_path):
    """`hybridflow export RUN_DIR` takes the newest intact checkpoint; naming the truncated one is a clear error."""
    from hybridflow.trainer.export import export_checkpoint

    engine = make_engine(unit_model)
    mgr = CheckpointManager(str(tmp_path / "run"))

    def save_with_hf_config(step: int) -> str:  # as ActorRolloutRefWorker.save_checkpoint lays it out
        tmp = mgr.staging_dir(step)
        engine.save_checkpoint(os.path.join(tmp, "actor"))
        engine.hf_config.save_pretrained(os.path.join(tmp, "actor", "huggingface"))
        engine.tokenizer.save_pretrained(os.path.join(tmp, "actor", "huggingface"))
        return mgr.commit(tmp, step, {"global_step": step})

    save_with_hf_config(1)
    second = save_with_hf_config(2)
    weights = os.path.join(second, "actor", "model_rank0.safetensors")
    truncate(weights)
    out = export_checkpoint(mgr.root, str(tmp_path / "exported"))  # falls back to global_step_1
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    with pytest.raises(Exception) as e:  # any type: the test is about the message
        export_checkpoint(second, str(tmp_path / "exported_bad"))
    assert weights in str(e.value), f"{type(e.value).__name__}: {e.value}"


def test_checkpoint_from_another_model_shape(unit_model, tmp_path):
    other = write_tiny_model(tmp_path / "narrow", TinyModelSpec(hidden_size=32), seed=0)
    directory = str(tmp_path / "actor")
    make_engine(unit_model).save_checkpoint(directory)
    with pytest.raises((ValueError, KeyError)) as e:
        make_engine(other).load_checkpoint(directory)
    msg = str(e.value)
    assert "model.embed_tokens.weight" in msg and "288, 64" in msg and "288, 32" in msg  # what
    assert directory in msg, f"the error does not say which checkpoint: {msg}"  # where
    assert "model.path" in msg or "resume_mode" in msg, f"the error does not say what to do: {msg}"  # how to fix


class _DiskFull:
    """`open` for the checkpoint module only: writing a file whose name is in `names` fails with ENOSPC after half
    the data, as a full disk does. Reads, and every other module's writes (the engine's shards), are untouched."""

    def __init__(self, names: set[str]):
        self.names = names

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" not in mode or os.path.basename(path) not in self.names:
            return f
        real_write = f.write

        def write(data):
            real_write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        f.write = write
        return f


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(unit_model, tmp_path, monkeypatch):
    engine = make_engine(unit_model)
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root)
    first = save_step(mgr, engine, 1)
    pointer = os.path.join(root, LATEST_FILE)
    engine.train_step(train_batch(), scaled_pg_loss(1.0))

    # 1. The disk fills while the trainer state is written: the save fails loudly, the staging folder is removed.
    monkeypatch.setattr(ckpt_module, "open", _DiskFull({"trainer_state.json"}), raising=False)
    with pytest.raises(OSError) as e:
        save_step(mgr, engine, 2)
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(root)) == ["global_step_1", LATEST_FILE]
    assert read_text(pointer) == "1" and mgr.resolve("auto") == first

    # 2. The disk fills while the pointer is moved: step 2 is in place, the pointer still names step 1.
    monkeypatch.setattr(ckpt_module, "open", _DiskFull({LATEST_FILE + ".tmp"}), raising=False)
    with pytest.raises(OSError):
        save_step(mgr, engine, 2)
    assert read_text(pointer) == "1" and mgr.resolve("auto") == first
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", LATEST_FILE]  # no half-written pointer
    monkeypatch.undo()

    make_engine(unit_model).load_checkpoint(os.path.join(mgr.resolve("auto"), "actor"))
    assert mgr.read_trainer_state(first) == {"global_step": 1}
    # Space is back: the next save succeeds and moves the pointer.
    third = save_step(mgr, engine, 3)
    assert read_text(pointer) == "3" and mgr.resolve("auto") == third


def test_resume_from_a_path_that_is_not_a_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=r"trainer\.resume_mode='/no/such/ckpt' is neither auto, disable nor"):
        mgr.resolve("/no/such/ckpt")
    cut = tmp_path / "run" / "global_step_4"
    cut.mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"global_step_4 is not a complete checkpoint \(no COMPLETE marker\)"):
        mgr.resolve(str(cut))


# ============================================================================================ configuration, resources
def test_misspelled_config_key():
    with pytest.raises(ConfigError) as e:
        load_config(["actor_rollout_ref.actor.ppo_mini_bach_size=8"])
    msg = str(e.value)
    assert "unknown config key 'actor_rollout_ref.actor.ppo_mini_bach_size'" in msg
    assert "Did you mean actor_rollout_ref.actor.ppo_mini_batch_size" in msg and "--print-config" in msg


def test_impossible_batch_sizes():
    with pytest.raises(ConfigError) as e:
        load_config(["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                     "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"])
    msg = str(e.value)
    assert "ppo_mini_batch_size=16 is larger than data.train_batch_size=8" in msg
    assert "not a multiple of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5" in msg
    assert "use_dynamic_bsz=true" in msg  # how to fix


def test_more_ranks_than_cpus_or_gpus():
    cfg = load_config(["trainer.n_gpus_per_node=16", "data.train_batch_size=16",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
    with pytest.raises(ConfigError) as e:
        check_resources(cfg, available_cpus=2, available_gpus=0)
    assert "asks for 16 ranks but the cluster has 2 CPUs" in str(e.value) and "trainer.n_gpus_per_node" in str(e.value)
    cfg.trainer.device = "cuda"
    with pytest.raises(ConfigError, match=r"asks for 16 GPU ranks .* has 8 GPUs; lower trainer\.n_gpus_per_node"):
        check_resources(cfg, available_cpus=64, available_gpus=8)
    check_resources(load_config([]), available_cpus=2, available_gpus=0)  # one rank fits


def test_model_path_missing(tmp_path):
    from hybridflow.trainer.main import resolve_defaults

    missing = str(tmp_path / "no_model")
    cfg = load_config([f"actor_rollout_ref.model.path={missing}", f"data.train_files={tmp_path / 't.parquet'}",
                       f"data.val_files={tmp_path / 'v.parquet'}"])
    with pytest.raises(ConfigError) as e:  # a user error: the CLI prints it and exits 2 (--dry-run too)
        resolve_defaults(cfg)
    msg = str(e.value)
    assert f"actor_rollout_ref.model.path={missing!r} is not a folder" in msg and "make-tiny-model" in msg
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        FSDPEngine(EngineConfig(model_path=missing))


def test_fault_injection_spec_typo():
    from hybridflow.workers.fault import maybe_inject_fault, parse_fault_spec, parse_fault_specs

    assert parse_fault_spec("update_actor:1:3") == ("update_actor", 1, 3)
    assert parse_fault_specs("generate_sequences:1:2, update_actor:1:2") == [("generate_sequences", 1, 2),
                                                                             ("update_actor", 1, 2)]
    with pytest.raises(ValueError, match="has no fault point"):  # the bad one of several is named
        parse_fault_specs("update_actor:1:2,update_actr:1:2")
    with pytest.raises(ValueError, match="the same fault twice"):
        parse_fault_specs("update_actor:1:2,update_actor:1:2")
    for spec, why in [("update_actor:1", "method:rank:step"), ("update_actor:one:3", "must be integers"),
                      ("compute_values:0:1", "has no fault point"), ("update_actor:0:0", "step >= 1")]:
        with pytest.raises(ValueError, match=why):
            parse_fault_spec(spec)
    with pytest.raises(ValueError, match="no fault point"):  # a typo no longer waits silently for a call that never comes
        maybe_inject_fault("update_actr:0:1", "/nonexistent", "update_actor", 0, 1)


def test_placement_no_node_can_satisfy_fails_at_once(ray_session):
    from hybridflow.single_controller import ClassWithInitArgs, ResourcePool, WorkerGroup

    start = time.monotonic()
    pool = ResourcePool([3], num_cpus_per_process=4, name="too_big")  # 12 CPUs on one node; the node has 8
    with pytest.raises(ValueError) as e:
        WorkerGroup(pool, ClassWithInitArgs(dict))
    msg = str(e.value)
    assert "resource pool 'too_big': 3 processes on one node need CPU=12" in msg and "no node has that much" in msg
    assert "Use fewer processes per node" in msg
    with pytest.raises(ValueError, match=r"GPU=1.*use_gpu=True"):  # a GPU pool on a CPU-only cluster
        ResourcePool([1], use_gpu=True, name="gpu").slots()
    assert time.monotonic() - start < 10


def test_placement_blocked_by_other_groups_times_out(ray_session):
    from ray.util.placement_group import placement_group, remove_placement_group

    from hybridflow.single_controller import ResourcePool

    holder = placement_group([{"CPU": 6}], strategy="STRICT_PACK")
    ray_session.get(holder.ready(), timeout=30)
    try:
        pool = ResourcePool([4], name="blocked", pg_timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            pool.slots()  # fits the node (8 CPUs), but 6 are taken: it would wait forever without the bound
        assert time.monotonic() - start < 15
        msg = str(e.value)
        assert "resource pool 'blocked'" in msg and "not scheduled within 1 s" in msg and "free resources now" in msg
    finally:
        remove_placement_group(holder)


# ============================================================================================ one small run
@pytest.fixture(scope="module")
def arithmetic_files(tmp_path_factory) -> tuple[str, str]:
    from hybridflow.data.tasks.arithmetic import generate_arithmetic_task

    return generate_arithmetic_task(tmp_path_factory.mktemp("arith"), num_train=32, num_val=4, seed=0, max_operands=2)


def test_training_resumes_past_a_truncated_checkpoint(arithmetic_files, unit_model, tmp_path, caplog):
    """End to end (local backend): the newest checkpoint's weights are cut short; the same command resumes from the
    one before it, says so, and finishes the run."""
    from hybridflow.trainer.main import run_training

    run_dir = str(tmp_path / "run")
    train, val = arithmetic_files

    def overrides(steps: int) -> list[str]:
        return [
            f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={unit_model}",
            "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=4",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=auto", "trainer.save_freq=1",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
            "trainer.progress_bar=false", "reward_model.num_workers=0", "trainer.backend=local",
            "trainer.num_threads_per_worker=1",
        ]

    run_training(load_config(overrides(2)), progress=False)
    truncate(os.path.join(run_dir, "global_step_2", "actor", "model_rank0.safetensors"))
    with caplog.at_level(logging.WARNING):
        result = run_training(load_config(overrides(3)), progress=False)
    assert result.global_step == 3
    messages = [r.getMessage() for r in caplog.records]
    assert any("skipping checkpoint" in m and "global_step_2" in m for m in messages)
    assert any(m.startswith("resuming from") and m.endswith("global_step_1") for m in messages)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert sorted(set(steps)) == [1, 2, 3]  # step 2 was trained again after the rewind; nothing is missing
    shutil.rmtree(run_dir)
