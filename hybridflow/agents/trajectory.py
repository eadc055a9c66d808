"""Token-in/token-out trajectories: the token ids the model saw, kept from the first prompt to the episode's end.

An episode's tokens are ``prompt_ids`` (the chat template applied once to the row's messages, generation prompt
included) followed by the *response*: each assistant turn's generated tokens exactly as sampled, and between turns
the observation tokens (tool results, environment messages). Nothing already in the trajectory is ever re-rendered
or re-tokenized; the next generation's context is always ``prompt_ids + response_ids``. So what the model saw is,
token for token, what the trainer is given.

Observations are rendered *as a delta*: the tokens to append after the model's last generated token so that the
context reads as the chat template would render "... assistant turn, new messages, generation prompt". The delta is
cut from a rendering of a fixed two-message conversation (user, assistant with a marker content) followed by the new
messages: everything after the marker is the assistant's end-of-turn, the new messages and the next generation
prompt. Because only the text after the marker is used, templates that are not append-only (they rewrite earlier
turns, e.g. drop the reasoning of past assistant turns, or change the system prompt when a tool message appears)
cannot change tokens the model already saw. If the turn ended with a stop token that the template also writes after
an assistant message (``<|im_end|>``), that token is already in the trajectory and is not repeated; if the turn was
cut by its token limit, the delta closes it the way the template would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChatRenderer", "TemplateError", "Trajectory", "TurnSpan", "truncate_text"]

_MARKER = "<<hybridflow-assistant-turn-7c1e>>"
_USER = "<<hybridflow-user-turn>>"


class TemplateError(ValueError):
    """The chat template cannot render an observation delta (it rejects a role, or hides the assistant turn)."""


class ChatRenderer:
    """Chat template -> token ids: ``prompt_ids(messages)`` once per episode, then ``delta_ids(new_messages, ...)``.

    ``tools``: OpenAI function schemas passed to the template (rendered into the prompt by templates that support
    them); ``chat_template_kwargs``: extra template variables (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; multi-turn rollouts render tool and "
                "environment messages with it - set tokenizer.chat_template (or use a chat model's tokenizer)"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.kwargs = dict(chat_template_kwargs or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        # The template wrote the special tokens as text; the tokenizer must not add a BOS of its own.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first context: the row's messages with the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def delta_text(self, new_messages: list[dict[str, Any]], stop_token_id: int | None) -> str:
        """Text to append after an assistant turn: its end-of-turn, `new_messages`, the next generation prompt.

        `stop_token_id`: the turn's last token if the turn ended on a stop token (None if cut by its length limit).
        """
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MARKER}]
        try:
            full = self.render(base + list(new_messages), add_generation_prompt=True)
        except Exception as e:  # jinja raises on roles a template does not know (e.g. 'tool')
            roles = [m.get("role") for m in new_messages]
            raise TemplateError(f"the chat template cannot render messages with roles {roles} after an assistant "
                                f"turn: {type(e).__name__}: {e}") from e
        if full.count(_MARKER) != 1:
            raise TemplateError("the chat template does not render an assistant message's content verbatim; "
                                "observation deltas cannot be cut from it")
        tail = full[full.index(_MARKER) + len(_MARKER):]
        if stop_token_id is not None:
            stop_text = self.tokenizer.decode([stop_token_id], skip_special_tokens=False)
            if stop_text and tail.startswith(stop_text):
                tail = tail[len(stop_text):]
        return tail

    def delta_ids(self, new_messages: list[dict[str, Any]], stop_token_id: int | None) -> list[int]:
        return self.encode(self.delta_text(new_messages, stop_token_id))

    def truncate(self, text: str, max_tokens: int | None, side: str = "left") -> tuple[str, bool]:
        return truncate_text(self.tokenizer, text, max_tokens, side=side)


TRUNCATE_SIDES = ("left", "middle", "right")


def truncate_text(tokenizer: Any, text: str, max_tokens: int | None, marker: str = "...(truncated)",
                  side: str = "left") -> tuple[str, bool]:
    """Cut an observation's content to `max_tokens` tokens (None: no limit) -> (text, truncated?).

    `side` names what is kept, as veRL's ``tool_response_truncate_side``: ``left`` the first tokens, ``right`` the
    last ones, ``middle`` half from each end (the marker stands where the cut was)."""
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if max_tokens is None:
        return text, False
    # Tokenizing megabytes costs seconds; a token spans at most a few dozen characters, so cut the text first.
    reach = max_tokens * 64 + 64

    def ids(part: str) -> list[int]:
        return list(tokenizer(part, add_special_tokens=False)["input_ids"])

    def dec(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False)

    head = ids(text[:reach])
    if len(text) <= reach and len(head) <= max_tokens:
        return text, False
    tail = ids(text[-reach:]) if side != "left" else []
    keep_head = {"left": max_tokens, "middle": (max_tokens + 1) // 2, "right": 0}[side]
    keep_tail = max_tokens - keep_head
    return dec(head[:keep_head]) + marker + (dec(tail[len(tail) - keep_tail:]) if keep_tail else ""), True


@dataclass
class TurnSpan:
    """One stretch of the response: an assistant generation or an observation, ``[start, end)`` in response tokens."""

    kind: str  # "assistant" | "observation"
    start: int
    end: int
    finish_reason: str | None = None  # assistant turns: "stop" | "length"
    role: str | None = None  # observations: "tool" | "user"


@dataclass
class Trajectory:
    """prompt ids + response ids, with ``response_mask`` (1 = generated) and ``log_probs`` (0 on observations)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)

    def context_ids(self) -> list[int]:
        """What the model sees for its next turn."""
        return self.prompt_ids + self.response_ids

    def add_generation(self, token_ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        if len(token_ids) != len(log_probs):
            raise ValueError(f"a generation returned {len(token_ids)} tokens but {len(log_probs)} log-probs")
        start = len(self.response_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.response_mask.extend([1] * len(token_ids))
        self.log_probs.extend(float(x) for x in log_probs)
        self.turns.append(TurnSpan("assistant", start, len(self.response_ids), finish_reason=finish_reason))

    def add_observation(self, token_ids: list[int], role: str) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(int(t) for t in token_ids)
        self.response_mask.extend([0] * len(token_ids))
        self.log_probs.extend([0.0] * len(token_ids))
        self.turns.append(TurnSpan("observation", start, len(self.response_ids), role=role))

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.response_mask)

    @property
    def num_observation_tokens(self) -> int:
        return len(self.response_mask) - sum(self.response_mask)

    @property
    def num_assistant_turns(self) -> int:
        return sum(t.kind == "assistant" for t in self.turns)
