"""textarena games (``pip install textarena``) as episode environments, in-process.

``TextArenaEnvironment("GuessTheNumber-v0-raw")``: ``reset(**row)`` makes the game with ``textarena.make``, resets
it with the row's ``seed`` (or ``extra_info.seed``) and returns the game's prompt; ``step(text)`` plays the
assistant's turn and returns the game's new messages, and at the end the player's reward from ``close()``.
Use the ``-raw`` game ids: the default wrappers re-send the whole game history in every observation, which in a
token-in/token-out chat would repeat it every turn. The model plays player 0; games with other players need their
moves played by ``opponents`` (callables ``observation text -> action``), one per other player id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hybridflow.agents.environment import Environment

__all__ = ["TextArenaEnvironment"]

# textarena seeds Python's global `random` in reset(); concurrent resets in threads would interleave the draws.
_RESET_LOCK = threading.Lock()


class TextArenaEnvironment(Environment):
    def __init__(self, env_id: str, num_players: int = 1, opponents: dict[int, Callable[[str], str]] | None = None,
                 make_kwargs: dict[str, Any] | None = None):
        self.env_id = env_id
        self.num_players = num_players
        self.opponents = dict(opponents or {})
        self.make_kwargs = dict(make_kwargs or {})
        missing = [p for p in range(1, num_players) if p not in self.opponents]
        if missing:
            raise ValueError(f"textarena game {env_id!r} with {num_players} players needs opponents for player ids "
                             f"{missing}")
        self.env: Any = None
        self.player_id = 0
        self.game_info: dict = {}

    @staticmethod
    def _text(observation: Any, player_id: int) -> str:
        if isinstance(observation, str):
            return observation
        import textarena as ta

        parts = [msg for sender, msg, kind in observation
                 if not (kind == ta.ObservationType.PLAYER_ACTION and sender == player_id)]  # our own move, echoed
        return "\n".join(parts)

    def reset(self, **row: Any) -> str:
        import textarena as ta

        seed = row.get("seed", (row.get("extra_info") or {}).get("seed"))
        with _RESET_LOCK:
            self.env = ta.make(self.env_id, **self.make_kwargs)
            self.env.reset(num_players=self.num_players, seed=seed)
        return self._advance_to_player()[1]

    def _advance_to_player(self) -> tuple[bool, str]:
        """Let the opponents move until it is player 0's turn -> (done, observation text for player 0)."""
        while True:
            pid, obs = self.env.get_observation()
            if pid == self.player_id:
                return False, self._text(obs, pid)
            done, _ = self.env.step(self.opponents[pid](self._text(obs, pid)))
            if done:
                return True, ""

    def step(self, action_text: str) -> tuple[str | None, float | None, bool, dict]:
        done, info = self.env.step(action_text)
        if not done:
            done, obs = self._advance_to_player()
            if not done:
                return obs, None, False, dict(info or {})
        closed = self.env.close()  # (rewards, game_info) in textarena 0.7; just rewards in some games
        rewards, game_info = closed if isinstance(closed, tuple) else (closed, {})
        self.game_info = dict(game_info or {})
        return None, float(rewards.get(self.player_id, 0.0)), True, {**dict(info or {}), **self.game_info}
