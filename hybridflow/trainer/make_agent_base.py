"""Base policies of the built-in agent tasks: generated demonstrations + `hybridflow sft` on a random-init tiny model.

    python -m hybridflow.trainer.make_agent_base calculator --data-dir data/agent_calculator --out models/calc_base
    python -m hybridflow.trainer.make_agent_base guess_number --data-dir data/agent_guess --out models/guess_base

Writes the task's parquet files (hybridflow/data/tasks/agent_tasks.py) into --data-dir, then runs SFT (the same
trainer as `hybridflow sft`, one process) on its ``sft.parquet`` from the built-in task's tiny Qwen2 shape
(make_base_model.BASE_SPEC, character tokenizer) and copies the final model to --out, with ``hybridflow_base.json``
(steps, loss, wall time). ``--init MODEL`` continues from a model (a second SFT stage; examples/agent_calculator.sh
runs two). The RL presets (hybridflow/config/agent_*.yaml) measure the base with
``trainer.val_before_train``; examples/agent_*.sh run both steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from hybridflow.data.tasks.agent_tasks import TASKS
from hybridflow.engines.tiny import write_tiny_model
from hybridflow.trainer.make_base_model import BASE_SPEC

# per task: SFT steps, learning rate, the longest demonstration (tokens)
RECIPES = {"calculator": {"steps": 300, "lr": 3e-3, "max_length": 160},
           "guess_number": {"steps": 400, "lr": 3e-3, "max_length": 256}}


def make_agent_base(task: str, data_dir: str, out_dir: str, *, steps: int | None = None, seed: int = 0,
                    batch_size: int = 64, threads: int | None = None, init: str | None = None,
                    lr: float | None = None, task_kwargs: dict | None = None) -> dict:
    """`init`: continue from this model instead of a random-init one (a second SFT stage)."""
    from hybridflow.trainer.sft_trainer import load_sft_config, run_sft

    recipe = dict(RECIPES[task])
    steps = steps or recipe["steps"]
    files = TASKS[task](data_dir, seed=seed, **dict(task_kwargs or {}))
    work = tempfile.mkdtemp(prefix=f"hybridflow-{task}-base-")
    start = time.perf_counter()
    try:
        lr = lr or recipe["lr"]
        init = init or write_tiny_model(os.path.join(work, "init"), BASE_SPEC, seed=seed)
        cfg = load_sft_config([
            f"data.train_files={files['sft']}", "data.prompt_key=prompt", "data.response_key=response",
            f"data.max_length={recipe['max_length']}", f"data.train_batch_size={batch_size}",
            f"data.micro_batch_size_per_gpu={batch_size}", f"model.path={init}", f"optim.lr={lr}",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={os.path.join(work, 'sft')}",
            "trainer.backend=local", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
            "optim.lr_scheduler_type=cosine", "optim.warmup_ratio=0.02",
            *([f"trainer.num_threads_per_worker={threads}"] if threads else []),
        ])
        summary = run_sft(cfg)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        shutil.copytree(summary["model_dir"], out_dir)
        info = {"task": task, "init": init if init and "hybridflow-" not in init else "random", "sft_steps": summary["steps"],
                "batch_size": batch_size, "lr": lr,
                "seed": seed, "final_nll": summary["final_nll"], "wall_s": round(time.perf_counter() - start, 1),
                "data": files}
        with open(os.path.join(out_dir, "hybridflow_base.json"), "w") as f:
            json.dump(info, f, indent=1)
        return info
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=sorted(RECIPES))
    p.add_argument("--data-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: the task's recipe)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--init", default=None, help="continue SFT from this model folder (default: random init)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--task-kwargs", type=json.loads, default=None,
                   help='options of the data generator as JSON, e.g. \'{"answer_repeats": 1}\'')
    a = p.parse_args(argv)
    info = make_agent_base(a.task, a.data_dir, a.out, steps=a.steps, seed=a.seed, threads=a.threads, init=a.init,
                           lr=a.lr, task_kwargs=a.task_kwargs)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
