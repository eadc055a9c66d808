"""Environments: one instance per episode, made by a factory the loop calls for each row.

An environment may
  * ``reset(**row) -> str | None``: start the episode from the dataset row; a returned string is the first
    observation (appended to the prompt's last user message, or added as a user message);
  * ``step(action_text) -> (observation, reward | None, done, info)``: gym style, called with each assistant turn's
    text when the turn made no tool call; the observation becomes the next user message;
  * ``tools() -> list[Tool]``: tools bound to this episode's instance (TRL-style environments expose their methods);
  * ``get_reward() -> float``: a final reward read when the episode ends;
  * ``close()``: release resources.
Every method is optional and may be sync or async; the ``Environment`` base class only documents the shape (duck
typing works). Failures (a raise, a timeout, a malformed step return) end the episode with the failure reward and
are counted by kind; see loop.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["EnvStep", "Environment", "read_step"]


class EnvStep(NamedTuple):
    observation: str | None
    reward: float | None
    done: bool
    info: dict


class Environment:
    """Base class for episode environments (all methods optional; see the module docstring)."""

    def reset(self, **row: Any) -> str | None:
        return None

    def tools(self) -> list:
        return []


def read_step(value: Any, where: str) -> EnvStep:
    """Check and normalise what ``step`` returned; raises TypeError naming `where` if it is not a 4-tuple."""
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise TypeError(f"{where}.step() must return (observation, reward | None, done, info), got {value!r:.120}")
    obs, reward, done, info = value
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"{where}.step() returned a {type(obs).__name__} observation; return text (or None)")
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}.step() returned reward {reward!r}; return a number or None") from e
    return EnvStep(obs, reward, bool(done), dict(info or {}))
