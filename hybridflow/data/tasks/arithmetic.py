"""The built-in task: short integer arithmetic with a verifiable answer, sized for a tiny character-level model.

A prompt is a chain like ``12+35-7`` (one user message); the SFT target works it out left to right, one operation a
line, and ends with the answer line the scorer reads (data_source ``hybridflow/arithmetic``)::

    12+35=47
    47-7=40
    #### 40

Prompts stay under ~20 characters and targets under ~40 with the defaults, so a 1-5M-parameter model learns the
format in minutes and then gets a fraction of the answers right - room for RL to improve. The knobs below set the
difficulty. Files are written in veRL's schema; ``extra_info`` holds ``question`` and ``response`` (the SFT target),
so the same files serve SFT (prompt + ``extra_info.response``) and RL (prompt + ``reward_model.ground_truth``).
Validation questions never appear in the training file.

    python -m hybridflow.data.tasks.arithmetic --out-dir data/arithmetic --num-train 20000 --num-val 500
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DATA_SOURCE", "ArithmeticConfig", "generate_arithmetic_task", "main", "make_problem", "write_rows"]

DATA_SOURCE = "hybridflow/arithmetic"


@dataclass
class ArithmeticConfig:
    """Difficulty knobs. Operands have ``min_digits``..``max_digits`` digits (uniform over digit counts, then values)."""

    min_operands: int = 2
    max_operands: int = 3
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"  # any of "+-*"
    allow_negative: bool = False  # if False, every intermediate result is >= 0 (problems are resampled otherwise)
    worked_solution: bool = True  # SFT target shows one line per operation before "#### answer"
    prompt_format: str = "{question}"  # e.g. "Compute {question}" to add an instruction
    # Fraction of SFT targets that end "answer: N" instead of "#### N". The verifier accepts only "#### N", so a
    # model fine-tuned on such a mix knows answers it does not always state verifiably (as base models often do).
    alt_answer_fraction: float = 0.0

    def validate(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(f"need 2 <= min_operands <= max_operands, got {self.min_operands}, {self.max_operands}")
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 18, got {self.min_digits}, {self.max_digits}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty string of '+', '-', '*', got {self.operators!r}")
        if not 0.0 <= self.alt_answer_fraction < 1.0:
            raise ValueError(f"alt_answer_fraction must be in [0, 1), got {self.alt_answer_fraction}")
        if "{question}" not in self.prompt_format:
            raise ValueError(f"prompt_format must contain '{{question}}', got {self.prompt_format!r}")


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, str, int]:
    """One problem: (question, SFT target text, answer). Evaluated left to right (no precedence)."""
    while True:
        n = rng.randint(cfg.min_operands, cfg.max_operands)
        nums = []
        for _ in range(n):
            d = rng.randint(cfg.min_digits, cfg.max_digits)
            nums.append(rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1))
        ops = [rng.choice(cfg.operators) for _ in range(n - 1)]
        lines, acc, ok = [], nums[0], True
        for op, b in zip(ops, nums[1:]):
            new = _apply(acc, op, b)
            if new < 0 and not cfg.allow_negative:
                ok = False
                break
            lines.append(f"{acc}{op}{b}={new}")
            acc = new
        if ok:
            break
    question = str(nums[0]) + "".join(f"{op}{b}" for op, b in zip(ops, nums[1:]))
    steps = "\n".join(lines) + "\n" if cfg.worked_solution else ""
    # Only draw when asked, so the problems of the default settings do not depend on this option.
    final = f"answer: {acc}" if cfg.alt_answer_fraction > 0 and rng.random() < cfg.alt_answer_fraction else f"#### {acc}"
    return question, f"{steps}{final}", acc


def _row(question: str, response: str, answer: int, index: int, split: str, cfg: ArithmeticConfig) -> dict[str, Any]:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": cfg.prompt_format.format(question=question)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "split": split, "question": question, "response": response},
    }


def write_rows(rows: list[dict[str, Any]], path: str) -> str:
    """Write rows in veRL's schema to a parquet file; returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def generate_arithmetic_task(
    out_dir: str | os.PathLike,
    *,
    num_train: int = 20000,
    num_val: int = 500,
    seed: int = 0,
    **difficulty: Any,
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``val.parquet`` under `out_dir`; returns their paths.

    `difficulty` are ArithmeticConfig fields (min_operands, max_operands, min_digits, max_digits, operators,
    allow_negative, worked_solution, prompt_format). Validation questions are distinct from each other and from
    every training question; training questions may repeat when the problem space is small.
    """
    unknown = set(difficulty) - set(ArithmeticConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"unknown arithmetic task option(s) {sorted(unknown)}; choose from {sorted(ArithmeticConfig.__dataclass_fields__)}"
        )
    cfg = ArithmeticConfig(**difficulty)
    cfg.validate()
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train and num_val must be >= 1, got {num_train}, {num_val}")
    rng = random.Random(seed)
    val_rows, val_questions = [], set()
    attempts = 0
    while len(val_rows) < num_val:
        attempts += 1
        if attempts > 100 * num_val + 1000:
            raise ValueError(
                f"could not draw {num_val} distinct validation problems with {asdict(cfg)}; "
                "the problem space is too small - raise max_digits/max_operands or lower num_val"
            )
        q, resp, ans = make_problem(rng, cfg)
        if q not in val_questions:
            val_questions.add(q)
            val_rows.append(_row(q, resp, ans, len(val_rows), "val", cfg))
    train_rows = []
    attempts = 0
    while len(train_rows) < num_train:
        attempts += 1
        if attempts > 100 * num_train + 1000:
            raise ValueError(
                f"the validation set covers almost every problem with {asdict(cfg)}; lower num_val or make the "
                "task bigger"
            )
        q, resp, ans = make_problem(rng, cfg)
        if q not in val_questions:
            train_rows.append(_row(q, resp, ans, len(train_rows), "train", cfg))
    out_dir = os.fspath(out_dir)
    train_path = write_rows(train_rows, os.path.join(out_dir, "train.parquet"))
    val_path = write_rows(val_rows, os.path.join(out_dir, "val.parquet"))
    return train_path, val_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: write the task files and print their paths."""
    defaults = ArithmeticConfig()
    p = argparse.ArgumentParser(prog="hybridflow-arithmetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--num-train", type=int, default=20000)
    p.add_argument("--num-val", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-operands", type=int, default=defaults.min_operands)
    p.add_argument("--max-operands", type=int, default=defaults.max_operands)
    p.add_argument("--min-digits", type=int, default=defaults.min_digits)
    p.add_argument("--max-digits", type=int, default=defaults.max_digits)
    p.add_argument("--operators", default=defaults.operators)
    p.add_argument("--allow-negative", action="store_true")
    p.add_argument("--no-worked-solution", dest="worked_solution", action="store_false")
    p.add_argument("--prompt-format", default=defaults.prompt_format)
    args = vars(p.parse_args(argv))
    out_dir, num_train, num_val, seed = args.pop("out_dir"), args.pop("num_train"), args.pop("num_val"), args.pop("seed")
    train_path, val_path = generate_arithmetic_task(out_dir, num_train=num_train, num_val=num_val, seed=seed, **args)
    print(f"train: {train_path}\nval:   {val_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
