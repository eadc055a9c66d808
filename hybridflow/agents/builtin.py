"""Built-in pieces of the two agent tasks, and the registry that names environments in the config.

* ``calculator(expression)``: a tool (typed function) that evaluates integer arithmetic (``+ - * //`` and
  parentheses) without ``eval``: the tool of the calculator task (hybridflow/data/tasks/agent_tasks.py).
* ``GuessNumberEnv``: find a hidden integer in ``[low, high]`` from "higher" / "lower" answers. Each assistant turn
  is a guess (the last integer in its text); a correct guess ends the episode with reward
  ``max(min_reward, 1 - turn_penalty * (guesses - 1))``, so solving in fewer guesses is worth more; an episode that
  runs out of turns gets nothing. The secret and the range come from the row's ``extra_info``.
* ``ENVIRONMENTS``: ``actor_rollout_ref.rollout.multi_turn.environment`` names an entry (``guess_number``,
  ``textarena``) or a ``package.module:Class`` / ``path/to/file.py:Class`` path. An entry is called with the
  ``environment_kwargs`` once per episode; a TRL-style class (public methods as tools, no ``step``) is wrapped by
  the TRL adapter.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from hybridflow.agents.environment import Environment
from hybridflow.plugins import Registry

__all__ = ["ENVIRONMENTS", "GuessNumberEnv", "VerlCalculatorTool", "calculator", "environment_factory", "register_environment"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod}
_MAX_DIGITS = 64  # a result past this is refused (a model asking for 9**9**9 must not stall the tool thread)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        value = _OPS[type(node.op)](left, right)
        if len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * // % and parentheses, e.g. "123*456".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from e
    return str(_evaluate(tree))


class VerlCalculatorTool:
    """``calculator`` as a veRL tool class (``class_name`` in a ``tool_config_path`` file): async create / execute /
    release, ``execute -> (text, reward, metrics)``."""

    def __init__(self, config: dict, tool_schema: Any):
        self.config, self.tool_schema = config, tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or "calculator"

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[str, float, dict]:
        try:
            return calculator(str(parameters.get("expression", ""))), 0.0, {}
        except ValueError as e:
            return f"Error: {e}", 0.0, {"error": 1.0}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


_INT = re.compile(r"-?\d+")


class GuessNumberEnv(Environment):
    """One game of higher/lower. Row: ``extra_info = {"secret": int, "low": int, "high": int}``."""

    def __init__(self, turn_penalty: float = 0.1, min_reward: float = 0.5):
        if not 0 <= min_reward <= 1 or turn_penalty < 0:
            raise ValueError(f"GuessNumberEnv: need 0 <= min_reward <= 1 and turn_penalty >= 0, got {min_reward}, "
                             f"{turn_penalty}")
        self.turn_penalty, self.min_reward = float(turn_penalty), float(min_reward)
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, **row: Any) -> None:
        info = dict(row.get("extra_info") or {})
        if "secret" not in info:
            raise ValueError("GuessNumberEnv needs extra_info.secret in each row (make the data with "
                             "python -m hybridflow.data.tasks.agent_tasks guess_number)")
        self.secret, self.low, self.high = int(info["secret"]), int(info.get("low", 1)), int(info.get("high", 100))
        self.guesses = 0
        return None  # the prompt already states the rules

    def step(self, action_text: str) -> tuple[str | None, float | None, bool, dict]:
        found = _INT.findall(action_text)
        if not found:
            return f"Say a number between {self.low} and {self.high}.", None, False, {"valid": False}
        guess = int(found[-1])
        self.guesses += 1
        if guess == self.secret:
            reward = max(self.min_reward, 1.0 - self.turn_penalty * (self.guesses - 1))
            return None, reward, True, {"guesses": self.guesses}
        return ("higher" if guess < self.secret else "lower"), None, False, {"guesses": self.guesses}


def _textarena(env_id: str = "GuessTheNumber-v0-raw", **kwargs: Any) -> Environment:
    from hybridflow.agents.adapters.textarena_env import TextArenaEnvironment

    return TextArenaEnvironment(env_id, **kwargs)


ENVIRONMENTS: Registry[Callable[..., Any]] = Registry(
    "agent environment", "hybridflow.agents.builtin.register_environment(name, cls)")
ENVIRONMENTS.add("guess_number", GuessNumberEnv)
ENVIRONMENTS.add("textarena", _textarena)


def register_environment(name: str, factory: Callable[..., Any], *, override: bool = False) -> None:
    ENVIRONMENTS.add(name, factory, override=override)


def environment_factory(name: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """The per-episode factory for a registered name or import path; a TRL-style class (no ``step``, public methods
    as tools) goes through the TRL adapter. Raises (naming the entry) when it cannot be found or described."""
    from hybridflow.agents.adapters.trl_env import trl_environment_factory

    entry = ENVIRONMENTS.get(name)
    kwargs = dict(kwargs or {})
    if isinstance(entry, type) and not issubclass(entry, Environment) and not hasattr(entry, "step"):
        return trl_environment_factory(lambda: entry(**kwargs)) if kwargs else trl_environment_factory(entry)
    return lambda: entry(**kwargs)
