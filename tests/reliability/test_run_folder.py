"""A run folder has one history (issue 23, item 3): a fresh start into a folder that holds a run is refused or, with
trainer.overwrite=true, archives the old run beside it; damaged checkpoints stop the run instead of silently starting
over; folders hybridflow did not write are never touched; a resumed optimizer takes the config's settings."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.engines.checkpoint_io import load_engine_state, save_engine_state
from hybridflow.engines.optim import OptimConfig, build_lr_scheduler, build_optimizer, lr_multiplier
from hybridflow.trainer.checkpoint import CheckpointError, CheckpointManager
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training, user_errors
from hybridflow.trainer.run_dir import RunDirError, prepare_run_dir


def _local(files, model, run_dir, *extra):
    return load_config(tiny_run_overrides(files, model, run_dir, "trainer.backend=local", "trainer.total_training_steps=1",
                                          "trainer.save_freq=1", *extra))


def _steps(run_dir: str) -> list[int]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def _commit(mgr: CheckpointManager, step: int) -> str:
    """A small real checkpoint folder written through the manager (a weights-like file, then commit)."""
    tmp = mgr.staging_dir(step)
    os.makedirs(os.path.join(tmp, "actor"))
    with open(os.path.join(tmp, "actor", "model_rank0.safetensors"), "wb") as f:
        f.write(os.urandom(4096))
    return mgr.commit(tmp, step, {"global_step": step})


def test_fresh_start_into_a_run_is_refused_and_overwrite_archives_it(arithmetic_files, tiny_model_path, tmp_path,
                                                                     capsys):
    run_dir = str(tmp_path / "run")
    run_training(_local(arithmetic_files, tiny_model_path, run_dir), progress=False)
    with open(os.path.join(run_dir, "notes.txt"), "w") as f:  # the user's own file: never moved, never deleted
        f.write("mine")
    with pytest.raises(RunDirError) as e:
        run_training(_local(arithmetic_files, tiny_model_path, run_dir), progress=False)
    msg = str(e.value)
    assert run_dir in msg and "1 metrics rows" in msg and "global_step_1" in msg
    assert "trainer.overwrite=true" in msg and "trainer.resume_mode=auto" in msg
    assert isinstance(e.value, user_errors())  # the CLI prints this message and exits 2, no traceback
    assert _steps(run_dir) == [1]  # nothing was appended by the refused run

    result = run_training(_local(arithmetic_files, tiny_model_path, run_dir, "trainer.overwrite=true"), progress=False)
    assert result.global_step == 1 and _steps(run_dir) == [1]  # one history, not 1 1
    archives = [n for n in os.listdir(tmp_path) if n.startswith("run.archived-")]
    assert len(archives) == 1, os.listdir(tmp_path)
    archive = tmp_path / archives[0]
    assert archives[0] in capsys.readouterr().out  # said so
    assert _steps(str(archive)) == [1] and (archive / "global_step_1" / "COMPLETE").exists()
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine" and not (archive / "notes.txt").exists()


def test_auto_resume_with_nothing_to_resume_beside_old_rows_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # a run with save_freq=-1
    with pytest.raises(RunDirError, match="there is no checkpoint to resume from"):
        prepare_run_dir(str(run_dir), resume_mode="auto", overwrite=False, total_steps=3, save_freq=-1)


def test_what_a_run_that_stopped_before_its_first_step_leaves_does_not_block_the_next(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")  # the tracker opened it, then the workers failed to start
    plan = prepare_run_dir(str(run_dir), resume_mode="auto", overwrite=False, total_steps=3, save_freq=-1)
    assert plan.archived_to is None and plan.start_step == 0
    assert "stopped before its first step" in capsys.readouterr().out
    assert sorted(os.listdir(run_dir)) == ["metrics.jsonl", "tensorboard"]  # nothing moved or deleted
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # one step taken: a history again
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(str(run_dir), resume_mode="auto", overwrite=False, total_steps=3, save_freq=-1)


def test_a_run_already_at_its_last_step_says_so_and_starts_nothing(arithmetic_files, tiny_model_path, tmp_path,
                                                                   capsys):
    run_dir = str(tmp_path / "run")
    cfg = _local(arithmetic_files, tiny_model_path, run_dir, "trainer.val_before_train=true", "trainer.test_freq=1")
    first = run_training(cfg, progress=False)
    capsys.readouterr()
    again = run_training(_local(arithmetic_files, tiny_model_path, run_dir, "trainer.val_before_train=true",
                                "trainer.test_freq=1", "trainer.resume_mode=auto"), progress=False)
    out = capsys.readouterr().out
    assert f"{run_dir} is already at step 1 of 1" in out and "Raise trainer.total_training_steps" in out
    assert "resuming" not in out and again.global_step == 1 and _steps(run_dir) == [0, 1]  # no row added
    assert again.initial_val == first.initial_val and again.initial_val  # the summary's "before" from the log
    assert again.last_metrics == {k: v for k, v in first.last_metrics.items() if k.startswith("val/")}
    # --dry-run runs the same folder checks and creates, moves and prints nothing
    from hybridflow.trainer.dry_run import dry_run

    plan = dry_run(_local(arithmetic_files, tiny_model_path, run_dir, "trainer.resume_mode=auto"))["plan"]
    assert plan["run_dir"] == {"path": run_dir, "start_step": 1, "nothing_to_train": True}
    with pytest.raises(RunDirError, match="already holds a run"):
        dry_run(_local(arithmetic_files, tiny_model_path, run_dir, "trainer.resume_mode=disable"))
    moved = dry_run(_local(arithmetic_files, tiny_model_path, run_dir, "trainer.resume_mode=disable",
                           "trainer.overwrite=true"))["plan"]["run_dir"]
    assert moved["old_run_moves_to"].endswith("run.archived-<time>") and _steps(run_dir) == [0, 1]
    fresh = str(tmp_path / "not_yet")
    assert dry_run(_local(arithmetic_files, tiny_model_path, fresh))["plan"]["run_dir"]["start_step"] == 0
    assert not os.path.exists(fresh)


def test_a_checkpoint_of_another_rank_count_is_named_before_the_workers_start(tmp_path):
    from hybridflow.trainer.preflight import preflight_errors

    run_dir = str(tmp_path / "run")
    step = _commit(CheckpointManager(run_dir), 3)
    with open(os.path.join(step, "actor", "meta.json"), "w") as f:
        json.dump({"world_size": 2}, f)
    base = ["actor_rollout_ref.rollout.n=2", f"trainer.default_local_dir={run_dir}"]
    for mode in ("auto", step):
        [msg] = preflight_errors(load_config([*base, f"trainer.resume_mode={mode}"]))
        assert f"{step}, holds actor shards of 2 ranks and this run has 1" in msg
        assert f"`hybridflow export {step} OUT_DIR`" in msg
    assert preflight_errors(load_config([*base, "trainer.resume_mode=auto", "trainer.n_gpus_per_node=2"])) == []
    assert preflight_errors(load_config([*base, "trainer.resume_mode=disable"])) == []


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), max_to_keep=None)
    paths = [_commit(mgr, s) for s in (1, 2)]
    for p in paths:
        weights = os.path.join(p, "actor", "model_rank0.safetensors")
        with open(weights, "r+b") as f:
            f.truncate(100)
    with pytest.raises(CheckpointError) as e:
        mgr.resolve("auto")
    msg = str(e.value)
    assert "every checkpoint" in msg and all(p in msg for p in paths) and "trainer.resume_mode=disable" in msg
    with pytest.raises(CheckpointError, match="every checkpoint"):  # and the run stops before any step
        prepare_run_dir(mgr.root, resume_mode="auto", overwrite=False, total_steps=3, save_freq=1)


def test_folders_hybridflow_did_not_write_are_left_alone_and_named(tmp_path, caplog):
    root = tmp_path / "run"
    mgr = CheckpointManager(str(root), max_to_keep=1)
    verl = root / "global_step_3" / "actor"  # veRL's layout: no COMPLETE marker, no manifest
    verl.mkdir(parents=True)
    (verl / "model_world_size_1_rank_0.pt").write_bytes(b"verl weights")
    with caplog.at_level(logging.WARNING):
        prepare_run_dir(str(root), resume_mode="auto", overwrite=False, total_steps=2, save_freq=1)
    assert any("global_step_3" in r.getMessage() and "left untouched" in r.getMessage() for r in caplog.records)
    # A save plan that would land on it is refused before the first step ...
    with pytest.raises(RunDirError, match=r"global_step_3 .*not written by hybridflow"):
        prepare_run_dir(str(root), resume_mode="auto", overwrite=False, total_steps=3, save_freq=1)
    # ... and the manager itself never replaces it, nor prunes it.
    _commit(mgr, 1)
    _commit(mgr, 2)
    tmp = mgr.staging_dir(3)
    with pytest.raises(CheckpointError, match="left untouched"):
        mgr.commit(tmp, 3, {"global_step": 3})
    assert (verl / "model_world_size_1_rank_0.pt").read_bytes() == b"verl weights"
    assert sorted(os.listdir(root)) == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    # overwrite=true archives hybridflow's files only
    plan = prepare_run_dir(str(root), resume_mode="disable", overwrite=True, total_steps=2, save_freq=1)
    assert sorted(os.listdir(root)) == ["global_step_3"] and plan.foreign == ["global_step_3"]
    assert sorted(os.listdir(plan.archived_to)) == ["global_step_2", "latest_checkpointed_iteration.txt"]


def test_a_pointer_hybridflow_did_not_write_is_not_overwritten(tmp_path):
    root = tmp_path / "run"
    (root / "global_step_5" / "actor").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("5")  # veRL's pointer to veRL's folder
    with pytest.raises(RunDirError, match=r"latest_checkpointed_iteration\.txt was not written by hybridflow"):
        prepare_run_dir(str(root), resume_mode="auto", overwrite=True, total_steps=2, save_freq=1)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"


def _optimizer(cfg: OptimConfig):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = build_optimizer(model.parameters(), cfg)
    return model, opt, build_lr_scheduler(opt, cfg)


def test_resume_applies_changed_optimizer_settings_and_logs_the_diff(tmp_path, caplog):
    old = OptimConfig(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, lr_scheduler_type="cosine",
                      total_training_steps=10)
    model, opt, sched = _optimizer(old)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        sched.step()
    save_engine_state(str(tmp_path), model, opt, sched, rank=0, world_size=1)

    # Unchanged settings: the checkpoint's values, bit for bit.
    model2, opt2, sched2 = _optimizer(old)
    load_engine_state(str(tmp_path), model2, opt2, sched2, rank=0, world_size=1)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

    new = OptimConfig(lr=2e-3, betas=(0.8, 0.99), weight_decay=0.1, lr_scheduler_type="cosine", total_training_steps=10)
    model3, opt3, sched3 = _optimizer(new)
    with caplog.at_level(logging.WARNING):
        load_engine_state(str(tmp_path), model3, opt3, sched3, rank=0, world_size=1)
    g = opt3.param_groups[0]
    assert g["betas"] == (0.8, 0.99) and g["weight_decay"] == 0.1 and g["initial_lr"] == 2e-3
    assert sched3.last_epoch == 3 and g["lr"] == pytest.approx(2e-3 * lr_multiplier(3, new), rel=1e-12)
    model3(torch.ones(2, 4)).sum().backward()
    opt3.step()
    sched3.step()  # the schedule continues from the new peak
    assert opt3.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_multiplier(4, new), rel=1e-12)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "lr: 0.001 -> 0.002" in text and "betas: (0.9, 0.999) -> (0.8, 0.99)" in text
    assert "weight_decay: 0.01 -> 0.1" in text


def test_resumed_run_trains_at_the_new_learning_rate(arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    run_training(_local(arithmetic_files, tiny_model_path, run_dir), progress=False)
    cfg = _local(arithmetic_files, tiny_model_path, run_dir, "trainer.resume_mode=auto",
                 "trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.lr=3e-3")
    run_training(cfg, progress=False)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    assert rows[1]["actor/lr"] == pytest.approx(1e-3) and rows[2]["actor/lr"] == pytest.approx(3e-3)
