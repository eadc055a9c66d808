"""The two built-in agent tasks: prompt files (veRL's schema) for RL and demonstration files for SFT.

* ``calculator`` (data_source ``hybridflow/agent_calculator``): multiply two 3-digit numbers whose product has 6
  digits. A tiny model cannot do it in its head, but can with the ``calculator`` tool
  (hybridflow.agents.builtin:calculator). The demonstrations call the tool for a fraction ``tool_fraction`` of the
  problems (a ``<tool_call>`` turn, then ``#### <result>`` after the tool's answer) and answer directly otherwise,
  so the SFT base calls the tool only sometimes; the direct answers are right in the demonstrations but a tiny model
  only imitates their shape. The verifier reads the last ``#### N`` of the generated text.
* ``guess_number`` (data_source ``hybridflow/agent_guess_number``): find a hidden integer in ``[low, high]`` from
  "higher"/"lower" answers (hybridflow.agents.builtin.GuessNumberEnv, which gives the reward). The demonstrations
  are games played by a mix of players: bisection (fraction ``bisect_fraction``), a player guessing at random
  within the interval still possible, and one guessing at random in the whole range; each turn of each game is one
  SFT example (the conversation so far -> the next guess).

(The third task, ``textarena_guess_number``, plays a real environment library's game through hybridflow.agents, so
it lives a layer up: hybridflow/trainer/textarena_task.py; make_agent_base knows all three.)

SFT files hold ``messages`` (calculator: whole conversations) or ``prompt`` (chat messages) and ``response`` (the
next assistant turn; guess_number); RL files hold ``prompt``,
``reward_model.ground_truth`` and ``extra_info``. Validation problems never appear in the training files.

    python -m hybridflow.data.tasks.agent_tasks calculator --out-dir data/agent_calculator
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Sequence
from typing import Any

from hybridflow.data.tasks.arithmetic import write_rows

__all__ = ["CALCULATOR_SOURCE", "GUESS_SOURCE", "generate_calculator_task", "generate_guess_number_task", "main"]

CALCULATOR_SOURCE = "hybridflow/agent_calculator"
GUESS_SOURCE = "hybridflow/agent_guess_number"


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A Hermes/Qwen tool call, as the ``hermes`` parser reads it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


# ----------------------------------------------------------------------------------------------- calculator
def generate_calculator_task(out_dir: str, *, num_train: int = 4000, num_val: int = 256, num_sft: int = 20000,
                             tool_fraction: float = 0.4, digits: int = 3, min_product: int | None = None,
                             seed: int = 0) -> dict[str, str]:
    """Write train/val (RL) and sft parquet files under `out_dir`; returns their paths.

    Problems are ``a*b`` with `digits`-digit operands and a product of at least `min_product` (default
    ``10 ** (2 * digits - 1)``: every product has ``2 * digits`` digits, so the tool's result and the answer sit
    at the same distance from each other in every episode, which is what lets a 2-layer model learn to copy it).
    SFT rows are whole conversations (``messages``: user, assistant tool call, tool result, assistant answer; or
    user, direct answer), trained on the assistant turns (``data.multiturn``)."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    low, high = 10 ** (digits - 1), 10 ** digits - 1
    min_product = 10 ** (2 * digits - 1) if min_product is None else int(min_product)
    if min_product > high * high:
        raise ValueError(f"calculator task: min_product={min_product} is above the largest product {high * high} "
                         f"of {digits}-digit numbers")

    def problem() -> tuple[int, int]:
        while True:
            a, b = rng.randint(low, high), rng.randint(low, high)
            if a * b >= min_product and (a, b) not in seen:
                seen.add((a, b))
                return a, b

    def rl_row(a: int, b: int, i: int, split: str) -> dict[str, Any]:
        q = f"{a}*{b}"
        return {"data_source": CALCULATOR_SOURCE, "prompt": [_user(q)], "ability": "tool_use",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {"index": i, "split": split, "question": q}}

    val = [rl_row(*problem(), i, "val") for i in range(num_val)]
    train = [rl_row(*problem(), i, "train") for i in range(num_train)]
    sft = []
    for _ in range(num_sft):
        a, b = problem()
        q = f"{a}*{b}"
        if rng.random() < tool_fraction:
            call = tool_call_text("calculator", {"expression": q})
            messages = [_user(q), {"role": "assistant", "content": call}, {"role": "tool", "content": str(a * b)}]
        else:
            messages = [_user(q)]
        sft.append({"messages": [*messages, {"role": "assistant", "content": f"#### {a * b}"}]})
    os.makedirs(out_dir, exist_ok=True)
    return {"train": write_rows(train, os.path.join(out_dir, "train.parquet")),
            "val": write_rows(val, os.path.join(out_dir, "val.parquet")),
            "sft": write_rows(sft, os.path.join(out_dir, "sft.parquet"))}


# ----------------------------------------------------------------------------------------------- guess the number
def _play(rng: random.Random, secret: int, low: int, high: int, player: str, max_turns: int) -> list[int]:
    """The guesses of one demonstration game (ends at the secret, or after max_turns guesses)."""
    lo, hi, guesses = low, high, []
    while len(guesses) < max_turns:
        if player == "bisect":
            g = (lo + hi) // 2
        elif player == "interval":
            g = rng.randint(lo, hi)
        else:
            g = rng.randint(low, high)
        guesses.append(g)
        if g == secret:
            break
        lo, hi = (max(lo, g + 1), hi) if g < secret else (lo, min(hi, g - 1))
    return guesses


def generate_guess_number_task(out_dir: str, *, low: int = 1, high: int = 20, num_train: int = 2000,
                               num_val: int = 256, num_sft_games: int = 3000, bisect_fraction: float = 0.3,
                               interval_fraction: float = 0.4, max_turns: int = 6, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    prompt = f"Guess my number ({low}-{high})."

    def rl_row(i: int, split: str) -> dict[str, Any]:
        secret = rng.randint(low, high)
        return {"data_source": GUESS_SOURCE, "prompt": [_user(prompt)], "ability": "game",
                "reward_model": {"style": "env", "ground_truth": str(secret)},
                "extra_info": {"index": i, "split": split, "secret": secret, "low": low, "high": high}}

    # secrets repeat (the range is small); the held-out set differs in its games' seeds, not in its secrets
    val = [rl_row(i, "val") for i in range(num_val)]
    train = [rl_row(i, "train") for i in range(num_train)]
    sft = []
    for _ in range(num_sft_games):
        r = rng.random()
        player = "bisect" if r < bisect_fraction else "interval" if r < bisect_fraction + interval_fraction else "any"
        secret = rng.randint(low, high)
        messages = [_user(prompt)]
        for g in _play(rng, secret, low, high, player, max_turns):
            sft.append({"prompt": [dict(m) for m in messages], "response": str(g)})
            messages.append({"role": "assistant", "content": str(g)})
            if g != secret:
                messages.append(_user("higher" if g < secret else "lower"))
    os.makedirs(out_dir, exist_ok=True)
    return {"train": write_rows(train, os.path.join(out_dir, "train.parquet")),
            "val": write_rows(val, os.path.join(out_dir, "val.parquet")),
            "sft": write_rows(sft, os.path.join(out_dir, "sft.parquet"))}


TASKS = {"calculator": generate_calculator_task, "guess_number": generate_guess_number_task}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(json.dumps(TASKS[a.task](a.out_dir, seed=a.seed), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
