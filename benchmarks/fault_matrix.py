"""The fault matrix of docs/reliability.md, run for real: one line per fault (what was done, what happened, whether
nothing was lost), then one JSON document with the same rows.

    python benchmarks/fault_matrix.py            # everything (~5 min on 2 cores: three 2-rank Ray runs)
    python benchmarks/fault_matrix.py --quick    # the faults that need no Ray cluster (~1 min)

Each fault builds what it needs in a temporary folder (a tiny random model, the arithmetic task) and checks the
outcome the way the tests in tests/reliability and tests/trainer do; a fault whose outcome is not the documented one
prints ``LOST`` / ``UNEXPECTED`` and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from _common import ROOT, document, emit

sys.path.insert(0, os.path.join(ROOT, "tests"))

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from e2e_helpers import tiny_run_overrides
from safetensors.torch import load_file

from hybridflow.data import RLDataset
from hybridflow.data.tasks.arithmetic import generate_arithmetic_task
from hybridflow.engines.tiny import build_char_tokenizer, write_tiny_model
from hybridflow.trainer.checkpoint import LATEST_FILE, CheckpointManager
from hybridflow.trainer.config import load_config
from hybridflow.trainer.export import export_checkpoint
from hybridflow.trainer.main import resolve_defaults, run_training
from hybridflow.trainer.metrics import without_timing

ROWS: list[dict] = []


def record(fault: str, done: str, happened: str, nothing_lost: bool, expected: bool = True) -> None:
    ok = nothing_lost and expected
    ROWS.append({"fault": fault, "done": done, "happened": happened, "nothing_lost": nothing_lost,
                 "as_documented": expected})
    flag = "ok  " if ok else ("LOST" if not nothing_lost else "UNEXPECTED")
    print(f"{flag} {fault}: {done} -> {happened}", flush=True)


def count_lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def outcome_of(fn) -> tuple[bool, str]:
    """(raised, what): the exception's type and first line, or 'no error'."""
    try:
        fn()
    except Exception as e:  # the matrix reports whatever happens
        lines = [ln.strip(" -") for ln in str(e).splitlines() if ln.strip()]
        head = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
        return True, f"{type(e).__name__}: {head[:160]}"
    return False, "no error"


def rows_and_weights(run_dir: str, tmp: str):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        by_step = {r["step"]: {k: v for k, v in without_timing(r).items() if k != "training/restarts"}
                   for r in map(json.loads, f)}
    out = export_checkpoint(run_dir, os.path.join(tmp, "export-" + os.path.basename(run_dir)))
    return [by_step[s] for s in sorted(by_step)], load_file(os.path.join(out, "model.safetensors"))


def same_run(a: str, b: str, tmp: str) -> bool:
    (ra, wa), (rb, wb) = rows_and_weights(a, tmp), rows_and_weights(b, tmp)
    return ra == rb and wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the faults that need a Ray cluster")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tempfile.mkdtemp(prefix="hybridflow-faults-")
    try:
        model = write_tiny_model(os.path.join(tmp, "model"), spec="unit", seed=0)
        files = generate_arithmetic_task(os.path.join(tmp, "data"), num_train=64, num_val=8, seed=0, max_operands=2)
        local = ("trainer.backend=local", "trainer.save_freq=1", "trainer.total_training_steps=2")

        def cfg(run_dir, *extra):
            return load_config(tiny_run_overrides(files, model, run_dir, *local, *extra))

        # --- run folders and checkpoints -------------------------------------------------------------------------
        run = os.path.join(tmp, "run")
        run_training(cfg(run), progress=False)
        raised, what = outcome_of(lambda: run_training(cfg(run), progress=False))
        rows = count_lines(os.path.join(run, "metrics.jsonl"))
        record("fresh start into a run folder", "same command again, resume_mode=disable", what, rows == 2, raised)
        run_training(cfg(run, "trainer.overwrite=true"), progress=False)
        archive = [n for n in os.listdir(tmp) if n.startswith("run.archived-")]
        kept = bool(archive) and count_lines(os.path.join(tmp, archive[0], "metrics.jsonl")) == 2
        record("fresh start with trainer.overwrite=true", "same command, overwrite=true",
               f"old run moved to {archive[0] if archive else '?'}", kept, bool(archive))

        verl = os.path.join(run, "global_step_9", "actor")
        os.makedirs(verl)
        write_bytes(os.path.join(verl, "model_world_size_1_rank_0.pt"), b"verl")
        run_training(cfg(run, "trainer.resume_mode=auto", "trainer.total_training_steps=3"), progress=False)
        record("foreign global_step_N in the run folder", "a veRL-style folder beside ours, then resume",
               "left untouched and named in a warning", os.path.exists(os.path.join(verl, "model_world_size_1_rank_0.pt")))

        mgr = CheckpointManager(run)
        newest = mgr.latest()
        weights = os.path.join(newest, "actor", "model_rank0.safetensors")
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
        fallback = mgr.latest()
        record("newest checkpoint truncated", "cut model_rank0.safetensors in half",
               f"resume takes {os.path.basename(fallback or 'nothing')}", fallback is not None and fallback != newest)
        for step_dir in os.listdir(run):
            if step_dir.startswith("global_step_") and step_dir != "global_step_9":
                w = os.path.join(run, step_dir, "actor", "model_rank0.safetensors")
                with open(w, "r+b") as f:
                    f.truncate(100)
        raised, what = outcome_of(lambda: mgr.resolve("auto"))
        record("every checkpoint damaged", "truncate all of them, resume_mode=auto", what,
               os.path.exists(weights), raised and "every checkpoint" in what)

        pointer_run = os.path.join(tmp, "pointer")
        run_training(cfg(pointer_run, "trainer.total_training_steps=1"), progress=False)
        write_bytes(os.path.join(pointer_run, LATEST_FILE), b"\xff\xfe garbage")
        raised, what = outcome_of(lambda: CheckpointManager(pointer_run).resolve("auto"))
        record("garbage in the latest pointer", "binary bytes in latest_checkpointed_iteration.txt", what, True,
               raised and LATEST_FILE in what)
        raised, what = outcome_of(lambda: CheckpointManager(pointer_run).resolve(pointer_run))
        record("run folder given as the checkpoint", "trainer.resume_mode=<run folder>", what, True,
               raised and "run folder, not a checkpoint" in what)

        cut_model = os.path.join(tmp, "cut_model")
        shutil.copytree(model, cut_model)
        st = os.path.join(cut_model, "model.safetensors")
        with open(st, "r+b") as f:
            f.truncate(os.path.getsize(st) // 2)
        raised, what = outcome_of(lambda: resolve_defaults(load_config(
            [f"actor_rollout_ref.model.path={cut_model}", f"data.train_files={files[0]}", f"data.val_files={files[1]}"])))
        record("truncated model .safetensors", "base model weights cut in half", what, True, raised and st in what)

        # --- data ----------------------------------------------------------------------------------------------
        empty = os.path.join(tmp, "empty.parquet")
        pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("data_source", pa.string()),
                                                                    ("prompt", pa.string())])), empty)
        raised, what = outcome_of(lambda: RLDataset(empty, build_char_tokenizer()))
        record("empty parquet", "a parquet file with columns and no rows", what, True, raised and empty in what)

        huge = os.path.join(tmp, "huge.jsonl")
        row = pq.read_table(files[0]).to_pylist()[0]
        with open(huge, "w") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.write(json.dumps({**row, "prompt": [{"role": "user", "content": "x" * 10_000_000}]}, default=str) + "\n")
        probe = ("import json,resource,sys;from hybridflow.data import RLDataset;"
                 "from hybridflow.engines.tiny import build_char_tokenizer;t=build_char_tokenizer();"
                 "a=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss;d=RLDataset(sys.argv[1],t,max_prompt_length=512);"
                 "print(json.dumps([d.stats['num_filtered_by_length_bound'],"
                 "(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss-a)/1024]))")
        out = subprocess.run([sys.executable, "-c", probe, huge], capture_output=True, text=True, cwd=ROOT)
        filtered, delta_mb = json.loads(out.stdout.strip().splitlines()[-1])
        record("10 MB prompt", "one 10 MB row among normal ones",
               f"filtered on its length, peak RSS +{delta_mb:.0f} MB", True, filtered == 1 and delta_mb < 300)

        # --- configuration found before the first step ------------------------------------------------------------
        val = os.path.join(tmp, "val.jsonl")
        with open(val, "w") as f:
            f.write(json.dumps({**row, "data_source": "nobody/knows"}, default=str) + "\n")
        t0 = time.monotonic()
        raised, what = outcome_of(lambda: run_training(load_config(tiny_run_overrides(
            (files[0], val), model, os.path.join(tmp, "noscorer"), *local)), progress=False))
        record("validation data source without a scorer", "val file with data_source nobody/knows",
               f"{what[:90]}... after {time.monotonic() - t0:.1f} s, before step 1", True, raised)
        for override in ("actor_rollout_ref.actor.optim.lr=0", "trainer.total_training_steps=0",
                         "trainer.total_training_steps=-1", "trainer.n_gpus_per_node=0"):
            raised, what = outcome_of(lambda o=override: load_config([o]))
            record(f"config {override}", "load the config", what, True, raised)
        from hybridflow.trainer.preflight import preflight_errors

        problems = preflight_errors(load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"]))
        record("config grpo with rollout.n=1", "preflight", problems[0][:120] if problems else "accepted", True,
               bool(problems))

        # --- rewards --------------------------------------------------------------------------------------------
        from hybridflow.rewards.custom import load_custom_reward_fn
        from hybridflow.rewards.pool import score_one
        from hybridflow.rewards.sandboxed_custom import load_sandboxed_reward_fn

        snoop = os.path.join(ROOT, "tests", "reliability", "sandboxed_rewards.py")
        server = socket.create_server(("127.0.0.1", 0))
        task = {"data_source": "t", "solution_str": str(server.getsockname()[1]), "ground_truth": "socket",
                "extra_info": None}
        plain = score_one(load_custom_reward_fn(f"{snoop}:snoop"), task)
        boxed = score_one(load_sandboxed_reward_fn(snoop, "snoop", time_limit_s=3), task)
        server.close()
        record("custom reward opens a socket", "reward_model.sandbox=false, then true",
               f"unboxed: {plain.kind}; boxed: {boxed.kind} ({boxed.message[-60:]})", True,
               plain.kind == "ok" and boxed.kind == "raised")

        if not args.quick:
            ray_faults(tmp, files, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit(document("fault_matrix", {"quick": args.quick}, {"faults": ROWS}))
    return 0 if all(r["nothing_lost"] and r["as_documented"] for r in ROWS) else 1


def ray_faults(tmp: str, files, model: str) -> None:
    import ray

    from hybridflow.single_controller.local_ray import start_local_ray

    ray_args = ("trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.total_training_steps=3",
                "trainer.save_freq=1", "trainer.call_timeout_s=900")
    start_local_ray(num_cpus=8, include_dashboard=False)
    try:
        straight = os.path.join(tmp, "straight")
        run_training(load_config(tiny_run_overrides(files, model, straight, *ray_args)), progress=False)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for fault in ("generate_sequences:1:2", "update_actor:1:2", "save_checkpoint:1:2"):
                run_dir = os.path.join(tmp, "killed-" + fault.split(":")[0])
                result = run_training(load_config(tiny_run_overrides(
                    files, model, run_dir, *ray_args, f"trainer.fault_injection={fault}")), progress=False)
                record(f"SIGKILL rank 1 in {fault.split(':')[0]}", "at step 2, beside a CPU-burning process",
                       f"{result.restarts} restart(s), rows and weights vs an uninterrupted run",
                       same_run(straight, run_dir, tmp), result.restarts == 1)
        finally:
            busy.kill()
    finally:
        ray.shutdown()

    run_dir = os.path.join(tmp, "driver")
    cmd = [sys.executable, "-m", "hybridflow", "train",
           *tiny_run_overrides(files, model, run_dir, *ray_args, "trainer.total_training_steps=20")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import psutil

    seen: dict[int, str] = {}
    listeners = set()
    while proc.poll() is None and not os.path.exists(os.path.join(run_dir, "global_step_2")):
        try:
            root = psutil.Process(proc.pid)
            for p in [root, *root.children(recursive=True)]:
                seen[p.pid] = p.name()
        except psutil.Error:
            pass
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.pid in seen:
                listeners.add((seen[c.pid], c.laddr.ip))
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    open_ = sorted(x for x in listeners if not x[1].startswith(("127.", "::1", "::ffff:127.")))
    record("listeners during a run", f"{len(listeners)} listening sockets of the run's processes",
           f"{len(open_)} beyond loopback {open_[:3]}", True, not open_ and bool(listeners))
    time.sleep(5)
    left = [n for pid, n in seen.items() if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    record("driver SIGKILLed", "kill -9 of `hybridflow train` mid-run", f"{len(left)} process(es) left after 5 s {left}",
           True, not left)


if __name__ == "__main__":
    sys.exit(main())
