"""The built-in task: where its data files and its shipped base policy live, and how they are made.

The data is generated on first use (deterministic, a few seconds) into ``$HYBRIDFLOW_CACHE`` (default
``~/.cache/hybridflow``). The base policy ships inside the package (``hybridflow/assets/arithmetic_base``); the exact
command that regenerates it is ``python -m hybridflow.trainer.make_base_model`` (see that module).
"""

from __future__ import annotations

import os

from hybridflow.data.tasks.arithmetic import generate_arithmetic_task

# The task's knobs: the base model was trained on data from exactly these settings.
TASK_VERSION = "arith-v2"
# Two-operand addition/subtraction of 1-2 digit numbers; 40% of the SFT targets state the answer as "answer: N",
# which the verifier does not accept (it wants "#### N"), so the base knows more than it states verifiably.
TASK_KWARGS: dict = dict(min_operands=2, max_operands=2, min_digits=1, max_digits=2, operators="+-",
                         worked_solution=False, alt_answer_fraction=0.4)
NUM_TRAIN = 20000
NUM_VAL = 256
SEED = 0

ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("HYBRIDFLOW_CACHE", "~/.cache/hybridflow"))


def write_builtin_task(out_dir: str) -> tuple[str, str]:
    """Write train.parquet / val.parquet of the built-in task into `out_dir`."""
    return generate_arithmetic_task(out_dir, num_train=NUM_TRAIN, num_val=NUM_VAL, seed=SEED, **TASK_KWARGS)


def ensure_builtin_task_files() -> tuple[str, str]:
    """The built-in task's train/val parquet paths, generated once into the cache."""
    out = os.path.join(cache_dir(), TASK_VERSION)
    train, val = os.path.join(out, "train.parquet"), os.path.join(out, "val.parquet")
    if not (os.path.exists(train) and os.path.exists(val)):
        tmp = f"{out}.tmp-{os.getpid()}"
        write_builtin_task(tmp)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        if not os.path.exists(out):
            os.replace(tmp, out)
    return train, val


def builtin_base_model_path() -> str:
    path = os.path.join(ASSETS, "arithmetic_base")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"the shipped base model is missing at {path}; regenerate it with `python -m hybridflow.trainer.make_base_model`"
            " or pass actor_rollout_ref.model.path=<a model folder>"
        )
    return path
