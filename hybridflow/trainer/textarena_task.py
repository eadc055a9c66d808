"""The ``textarena_guess_number`` agent task: textarena's ``GuessTheNumber-v0-raw`` game (``pip install textarena``),
played as-is through hybridflow.agents.adapters.textarena_env.TextArenaEnvironment.

* RL rows (data_source ``hybridflow/textarena_guess_number``: the game's reward plus 1 for a win, rewards.registry
  .win_bonus_score - the game pays a loss its closeness, ~0.9, and GRPO on that alone raised the closeness, not the
  wins): a user message naming the
  game (``PROMPT``; the agent loop appends the game's first observation to it) and ``extra_info.seed``, the seed
  textarena's ``reset`` draws the hidden number (1-20) from (``reward_model.ground_truth``: that number, for the
  sample viewer). Held-out rows use seeds the training and SFT games never use.
* SFT rows (``messages``, whole conversations, trained on the assistant turns): games PLAYED on the real
  environment by a noisy bisecting player, rendered as the agent loop shows them - the first observation appended to
  that user message and every observation cut by the same ``truncate_text`` with the preset's
  ``max_tool_response_length`` / ``tool_response_truncate_side`` (default 28, kept side "right": the game's
  508-character first prompt becomes its last 28 characters, its 27-28-character answers stay whole), so the base learns the library's own text. The player guesses ``[k]`` (the game's format):
  the middle of the interval still possible with probability ``bisect_prob`` per turn, else a random number in it;
  it never repeats a guess (textarena counts a repeat as an invalid move). The game is made with ``max_turns =
  guesses - 1`` (textarena ends it after max_turns + 1 guesses) and the preset allows ``guesses + 1`` assistant
  turns (a first invalid move is a warning that takes no turn, a second ends the game): every episode ends by the
  game's own rules with the game's reward - 1 for a win, else the closeness of the last guess ("percentage
  completion"). Cut by the loop's turn limit instead, a lost episode would score 0, below what an invalid move
  (which also ends the game with the closeness reward) earns, and RL learns to end games with invalid moves.

    python -m hybridflow.trainer.make_agent_base textarena_guess_number --data-dir D --out M
"""

from __future__ import annotations

import os
import random
from typing import Any

from hybridflow.data.tasks.arithmetic import write_rows

__all__ = ["ENV_ID", "PROMPT", "TEXTARENA_SOURCE", "demonstration", "generate_textarena_guess_number_task", "hidden_number"]

ENV_ID = "GuessTheNumber-v0-raw"
TEXTARENA_SOURCE = "hybridflow/textarena_guess_number"  # scored: textarena's reward + 1 for a win (win_bonus_score)
PROMPT = f"{ENV_ID}\n"  # the row's own text; hybridflow refuses blank prompts
_VAL_SEED0 = 1_000_000  # held-out seeds start here; training and SFT seeds stay below it


def _truncate(tokenizer: Any, text: str, max_tokens: int | None, side: str) -> str:
    from hybridflow.agents.trajectory import truncate_text

    return truncate_text(tokenizer, text, max_tokens, side=side)[0]


def hidden_number(seed: int, make_kwargs: dict[str, Any] | None = None) -> int:
    """The number textarena's game hides after ``reset(seed=seed)`` (read from the game's state)."""
    from hybridflow.agents.adapters.textarena_env import TextArenaEnvironment

    env = TextArenaEnvironment(ENV_ID, make_kwargs=make_kwargs)
    env.reset(seed=seed)
    return int(env.env.state.game_state["game_number"])


def demonstration(seed: int, rng: random.Random, tokenizer: Any, *, max_tokens: int | None, side: str,
                  bisect_prob: float, max_turns: int, make_kwargs: dict[str, Any] | None = None,
                  ) -> tuple[list[dict[str, str]], float | None]:
    """Play one game on the real environment (``textarena.make(ENV_ID, **make_kwargs)``) -> (messages as the agent
    loop renders them, the env's reward or None when the game was not over within `max_turns` guesses)."""
    from hybridflow.agents.adapters.textarena_env import TextArenaEnvironment

    env = TextArenaEnvironment(ENV_ID, make_kwargs=make_kwargs)
    first = env.reset(seed=seed)
    messages = [{"role": "user", "content": PROMPT + _truncate(tokenizer, first, max_tokens, side)}]
    lo, hi, reward = 1, 20, None
    for _ in range(max_turns):
        guess = (lo + hi) // 2 if rng.random() < bisect_prob else rng.randint(lo, hi)
        action = f"[{guess}]"
        messages.append({"role": "assistant", "content": action})
        obs, r, done, _ = env.step(action)
        if done:
            reward = r
            break
        messages.append({"role": "user", "content": _truncate(tokenizer, obs, max_tokens, side)})
        # the game's own words decide the interval: the player reads the observation, not the hidden number
        if "higher" in obs:
            lo = guess + 1
        elif "lower" in obs:
            hi = guess - 1
        else:
            raise RuntimeError(f"textarena {ENV_ID} seed {seed}: unexpected observation {obs!r} after {action}")
    if messages[-1]["role"] == "user":  # the loop ends an episode on an assistant turn (max_assistant_turns)
        messages.pop()
    return messages, reward


def generate_textarena_guess_number_task(out_dir: str, *, num_train: int = 2000, num_val: int = 128,
                                         num_sft_games: int = 6000, bisect_prob: float = 0.5, max_turns: int = 6,
                                         max_observation_tokens: int | None = 28, truncate_side: str = "right",
                                         make_kwargs: dict[str, Any] | None = None, seed: int = 0) -> dict[str, str]:
    """Write train/val (RL) and sft parquet files under `out_dir`; returns their paths. `max_observation_tokens` /
    `truncate_side` must be the preset's ``max_tool_response_length`` / ``tool_response_truncate_side`` (character
    tokenizer: tokens = characters); `max_turns`: the game's guesses, `make_kwargs` the preset's
    ``environment_kwargs.make_kwargs`` (default ``{"max_turns": max_turns - 1}``: textarena's game ends after
    ``max_turns + 1`` guesses, so the game itself ends the demonstration and pays its own reward)."""
    make_kwargs = {"max_turns": max_turns - 1} if make_kwargs is None else dict(make_kwargs)
    from hybridflow.engines.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rng = random.Random(seed)
    if num_sft_games + num_train >= _VAL_SEED0:
        raise ValueError(f"textarena_guess_number: num_train + num_sft_games must stay below {_VAL_SEED0} (the "
                         "held-out seeds start there)")

    def rl_row(i: int, game_seed: int, split: str) -> dict[str, Any]:
        # ground truth: the number textarena hides for this seed (for the sample viewer; the env gives the reward)
        return {"data_source": TEXTARENA_SOURCE, "prompt": [{"role": "user", "content": PROMPT}], "ability": "game",
                "reward_model": {"style": "env", "ground_truth": str(hidden_number(game_seed, make_kwargs))},
                "extra_info": {"index": i, "split": split, "seed": game_seed}}

    val = [rl_row(i, _VAL_SEED0 + i, "val") for i in range(num_val)]
    train = [rl_row(i, i, "train") for i in range(num_train)]
    sft = [{"messages": demonstration(num_train + g, rng, tokenizer, max_tokens=max_observation_tokens,
                                      side=truncate_side, bisect_prob=bisect_prob, max_turns=max_turns,
                                      make_kwargs=make_kwargs)[0]}
           for g in range(num_sft_games)]
    os.makedirs(out_dir, exist_ok=True)
    return {"train": write_rows(train, os.path.join(out_dir, "train.parquet")),
            "val": write_rows(val, os.path.join(out_dir, "val.parquet")),
            "sft": write_rows(sft, os.path.join(out_dir, "sft.parquet"))}
