"""Which rule scorer handles which ``data_source``, and the veRL-compatible ``default_compute_score``.

Every registered function has the custom-reward signature
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` (a dict holds ``"score"`` plus any
extra per-sample values to log). Add your own with ``register_scorer("my/source", fn)``; ``fn`` must be a module-level
function (or a ``functools.partial`` of one) because scoring runs in worker processes that receive it by pickling.
To change a built-in's options, replace it explicitly, e.g.
``register_scorer("hybridflow/arithmetic", functools.partial(arithmetic_score, format_score=0.1), override=True)``.
The table is a `hybridflow.plugins.Registry` like every other one (same duplicate rule, same messages).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any

from hybridflow.plugins import Registry
from hybridflow.rewards.scorers import arithmetic, code, countdown, gsm8k, math_answer, reasoning_gym_tasks

__all__ = [
    "RewardConfigError",
    "ScorerTable",
    "arithmetic_score",
    "available_scorers",
    "code_score",
    "countdown_score",
    "default_compute_score",
    "find_scorer",
    "gsm8k_lenient_score",
    "gsm8k_score",
    "math_score",
    "reasoning_gym_score",
    "register_scorer",
    "unknown_data_source",
]

Scorer = Callable[..., Any]


class RewardConfigError(ValueError):
    """A reward function could not be found, loaded or used; the message says what to change."""


def gsm8k_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, method: str = "strict"
) -> float:
    """veRL's rule by default (``strict``); ``method="lenient"`` compares numbers by value (see scorers/gsm8k.py)."""
    return gsm8k.compute_score(solution_str, ground_truth, method=method)


def gsm8k_lenient_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method="lenient")


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return math_answer.compute_score(solution_str, ground_truth)


def countdown_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return countdown.compute_score(solution_str, ground_truth)


def arithmetic_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, format_score: float = 0.0
) -> float:
    return arithmetic.compute_score(solution_str, ground_truth, format_score=format_score)


def environment_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """0: rows whose reward comes from their environment (multi-turn episodes add the environment's reward to the
    score; see trainer/agent_rewards.py), e.g. the guess-the-number task."""
    return 0.0


def win_bonus_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1 when the episode's environment paid its full reward (a won game), else 0; the environment's own reward is
    added to it (trainer/agent_rewards.py). For games that pay partial rewards for a loss (textarena's
    GuessTheNumber pays the last guess's closeness, ~0.9 on average), where a loss would otherwise cost RL little."""
    return 1.0 if float((extra_info or {}).get("env_reward", 0.0)) >= 1.0 else 0.0


def code_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> dict[str, float]:
    return code.compute_score(solution_str, ground_truth)


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    return reasoning_gym_tasks.compute_score(solution_str, extra_info)


SCORERS: Registry[Scorer] = Registry("scorer for data_source", "hybridflow.rewards.register_scorer(data_source, fn)")


def register_scorer(data_sources: str | Iterable[str], fn: Scorer, *, override: bool = False) -> None:
    """Score rows whose data_source is one of `data_sources` with `fn` (custom-reward signature). A name ending
    in ``/*`` (e.g. ``reasoning_gym/*``) covers every data_source under that prefix that has no scorer of its own.

    A data_source that has a scorer already is an error unless override=True.
    """
    names = [data_sources] if isinstance(data_sources, str) else list(data_sources)
    if not callable(fn):
        raise RewardConfigError(f"register_scorer({names}): {fn!r} is not callable")
    try:
        pickle.dumps(fn)
    except Exception as e:
        raise RewardConfigError(
            f"register_scorer({names}): {fn!r} cannot be pickled ({e}), so worker processes cannot receive it; "
            "define it at module level (not a lambda or a nested function)"
        ) from e
    for name in names:
        if name in SCORERS and not override:
            raise RewardConfigError(
                f"a scorer for data_source {name!r} is registered already ({SCORERS.get(name)!r}); pass "
                "override=True to replace it"
            )
    for name in names:
        SCORERS.add(name, fn, override=True)


def _table() -> dict[str, Scorer]:
    return {name: SCORERS.get(name) for name in SCORERS.names()}


def available_scorers() -> list[str]:
    """The data_source names default_compute_score knows."""
    return SCORERS.names()


register_scorer(["openai/gsm8k", "gsm8k"], gsm8k_score)
register_scorer(["hybridflow/gsm8k_lenient"], gsm8k_lenient_score)
register_scorer(
    ["math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math500",
     "EleutherAI/hendrycks_math"],
    math_score,
)
register_scorer(["countdown", "Jiayi-Pan/Countdown-Tasks-3to4"], countdown_score)
register_scorer(["hybridflow/arithmetic"], arithmetic_score)
register_scorer(["hybridflow/agent_calculator"], arithmetic_score)  # the last "#### N" of the generated turns
register_scorer(["hybridflow/agent_guess_number"], environment_score)
register_scorer(["textarena/*"], environment_score)
register_scorer(["hybridflow/textarena_guess_number"], win_bonus_score)  # textarena games (agents/adapters/textarena_env.py) give the reward
CODE_DATA_SOURCES = ("code", "codecontests", "apps", "taco")  # scored by running the response against test cases
register_scorer(list(CODE_DATA_SOURCES), code_score)
register_scorer(["reasoning_gym/*"], reasoning_gym_score)  # every task, by the task's own score_answer


def find_scorer(table: dict[str, Scorer], data_source: str) -> Scorer | None:
    """`data_source`'s own scorer, else the one of the longest ``prefix/*`` family it falls in, else None."""
    if data_source in table:
        return table[data_source]
    families = [n for n in table if n.endswith("/*") and data_source.startswith(n[:-1])]
    return table[max(families, key=len)] if families else None


def unknown_data_source(data_source: str, known: Iterable[str]) -> RewardConfigError:
    return RewardConfigError(
        f"no reward function for data_source {data_source!r}; known: {sorted(known)}. Either write a function "
        "fn(data_source, solution_str, ground_truth, extra_info=None) -> float and pass it as "
        "custom_reward_function.path=path/to/file.py custom_reward_function.name=fn, or call "
        "hybridflow.rewards.register_scorer(data_source, fn) before training"
    )


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
    """Score one response with the rule scorer registered for its data_source (veRL's signature)."""
    fn = find_scorer(_table(), data_source)
    if fn is None:
        raise unknown_data_source(data_source, SCORERS.names())
    return fn(data_source, solution_str, ground_truth, extra_info)


class ScorerTable:
    """A picklable snapshot of the registry: what worker processes use, so scorers registered at run time in the
    driver are known there too (a worker imports this module fresh and would only see the built-ins)."""

    def __init__(self, scorers: dict[str, Scorer] | None = None) -> None:
        self.scorers = dict(_table() if scorers is None else scorers)

    def knows(self, data_source: str) -> bool:
        return find_scorer(self.scorers, data_source) is not None

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        fn = find_scorer(self.scorers, data_source)
        if fn is None:
            raise unknown_data_source(data_source, self.scorers)
        return fn(data_source, solution_str, ground_truth, extra_info)
