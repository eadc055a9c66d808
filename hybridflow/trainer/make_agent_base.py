"""Base policies of the built-in agent tasks: generated demonstrations + `hybridflow sft` on a random-init tiny model.

    python -m hybridflow.trainer.make_agent_base calculator --data-dir data/agent_calculator --out models/calc_base
    python -m hybridflow.trainer.make_agent_base guess_number --data-dir data/agent_guess --out models/guess_base
    python -m hybridflow.trainer.make_agent_base textarena_guess_number --data-dir data/ta_guess --out models/ta_base

Writes the task's parquet files (hybridflow/data/tasks/agent_tasks.py) into --data-dir, then runs SFT (the same
trainer as `hybridflow sft`, one process) on its ``sft.parquet`` from the built-in task's tiny Qwen2 shape
(make_base_model.BASE_SPEC, character tokenizer) and copies the final model to --out, with ``hybridflow_base.json``
(steps, loss, wall time). ``--init MODEL`` continues from a model (a second SFT stage; examples/agent_calculator.sh
runs two). The RL presets (hybridflow/config/agent_*.yaml) measure the base with
``trainer.val_before_train``; examples/agent_*.sh run both steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time

from hybridflow.data.tasks.agent_tasks import TASKS as DATA_TASKS
from hybridflow.engines.tiny import SIZES, write_tiny_model
from hybridflow.trainer.make_base_model import BASE_SPEC


def _textarena_guess_number(out_dir: str, **kwargs):
    from hybridflow.trainer.textarena_task import generate_textarena_guess_number_task  # imports textarena

    return generate_textarena_guess_number_task(out_dir, **kwargs)


# the data layer's generated tasks, and the one that plays a real environment library (trainer/textarena_task.py)
TASKS = {**DATA_TASKS, "textarena_guess_number": _textarena_guess_number}

_CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")

# per task: SFT steps, learning rate, the longest demonstration (tokens), how its SFT rows are laid out (whole
# conversations in `messages`, trained on every assistant turn; or one prompt -> next turn per row), its RL preset
RECIPES = {"calculator": {"steps": 480, "lr": 3e-3, "max_length": 192, "layout": "conversation",
                          "preset": os.path.join(_CONFIG_DIR, "agent_calculator_grpo.yaml")},
           "guess_number": {"steps": 400, "lr": 3e-3, "max_length": 256, "layout": "turns",
                            "preset": os.path.join(_CONFIG_DIR, "agent_guess_number_grpo.yaml")},
           # textarena's game: ~53 tokens a turn (its observations are kept whole), 6 turns -> 512 positions
           "textarena_guess_number": {"steps": 400, "lr": 3e-3, "max_length": 400, "layout": "conversation",
                                      "batch_size": 32, "max_position_embeddings": 512,
                                      "preset": os.path.join(_CONFIG_DIR, "agent_textarena_guess_number_grpo.yaml")}}
SIZE_NAMES = ("base", *SIZES)  # base: the built-in task's shape (make_base_model.BASE_SPEC)


def make_agent_base(task: str, data_dir: str, out_dir: str, *, steps: int | None = None, seed: int = 0,
                    batch_size: int | None = None, threads: int | None = None, init: str | None = None,
                    lr: float | None = None, task_kwargs: dict | None = None, size: str = "base",
                    eval_every: int = 0, evaluate: bool = False) -> dict:
    """`init`: continue from this model instead of a random-init one of `size` (a second SFT stage).
    `eval_every`: measure the held-out numbers (agent_eval.agent_heldout, the preset's sampling) every that many
    steps (``probes`` in the result); `evaluate`: also measure the final base (``heldout``)."""
    from hybridflow.trainer.sft_trainer import load_sft_config, run_sft

    if size not in SIZE_NAMES:
        raise ValueError(f"make_agent_base: unknown size {size!r}; choose one of {list(SIZE_NAMES)}")
    recipe = dict(RECIPES[task])
    steps = steps or recipe["steps"]
    batch_size = batch_size or recipe.get("batch_size", 64)
    files = TASKS[task](data_dir, seed=seed, **dict(task_kwargs or {}))
    work = tempfile.mkdtemp(prefix=f"hybridflow-{task}-base-")
    start = time.perf_counter()
    probes: list[dict] = []

    def heldout(model_dir: str) -> dict:
        from hybridflow.trainer.agent_eval import agent_heldout

        return agent_heldout(model_dir, files["val"], recipe["preset"], seed=seed)

    def probe(model_dir: str, step: int) -> bool:
        probes.append({"step": step, "wall_s": round(time.perf_counter() - start, 1), **heldout(model_dir)})
        print(f"SFT step {step}: held-out {json.dumps(probes[-1])}", flush=True)
        return False

    layout = (["data.multiturn.enable=true", "data.multiturn.messages_key=messages"]
              if recipe["layout"] == "conversation" else ["data.prompt_key=prompt", "data.response_key=response"])
    try:
        lr = lr or recipe["lr"]
        spec = BASE_SPEC if size == "base" else SIZES[size]
        if "max_position_embeddings" in recipe:  # RoPE: positions are not learned, the limit is the config's
            spec = dataclasses.replace(spec, max_position_embeddings=recipe["max_position_embeddings"])
        init = init or write_tiny_model(os.path.join(work, "init"), spec, seed=seed)
        cfg = load_sft_config([
            f"data.train_files={files['sft']}", *layout,
            f"data.max_length={recipe['max_length']}", f"data.train_batch_size={batch_size}",
            f"data.micro_batch_size_per_gpu={batch_size}", f"model.path={init}", f"optim.lr={lr}",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={os.path.join(work, 'sft')}",
            "trainer.backend=local", f"trainer.seed={seed}", "trainer.logger=[jsonl]",
            "optim.lr_scheduler_type=cosine", "optim.warmup_ratio=0.02",
            *([f"trainer.num_threads_per_worker={threads}"] if threads else []),
        ])
        summary = run_sft(cfg, eval_every=eval_every, stop_when=probe if eval_every else None)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        shutil.copytree(summary["model_dir"], out_dir)
        info = {"task": task, "init": init if init and "hybridflow-" not in init else "random", "size": size,
                "sft_steps": summary["steps"], "batch_size": batch_size, "lr": lr, "seed": seed,
                "final_nll": summary["final_nll"], "wall_s": round(time.perf_counter() - start, 1),
                "task_kwargs": dict(task_kwargs or {}), "data": files, "probes": probes}
        if evaluate:
            info["heldout"] = heldout(out_dir)
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
                   help='options of the data generator as JSON, e.g. \'{"tool_fraction": 0.3}\'')
    p.add_argument("--size", default="base", choices=SIZE_NAMES, help="random-init model shape (default: base)")
    p.add_argument("--batch-size", type=int, default=None, help="SFT batch (default: the task's recipe, else 64)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="measure held-out accuracy / tool-call rate every N SFT steps (agent_eval, the preset's sampling)")
    p.add_argument("--evaluate", action="store_true", help="measure the finished base the same way (hybridflow_base.json)")
    a = p.parse_args(argv)
    info = make_agent_base(a.task, a.data_dir, a.out, steps=a.steps, seed=a.seed, threads=a.threads, init=a.init,
                           lr=a.lr, task_kwargs=a.task_kwargs, size=a.size, batch_size=a.batch_size,
                           eval_every=a.eval_every, evaluate=a.evaluate)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
