"""A reward model with a tokenizer of its own reads the conversation re-rendered in its own chat template.

The policy's token ids mean nothing to a reward model trained on another tokenizer (a Llama-3 RM scoring a Qwen
policy, as in veRL's RM examples). Then, as veRL does, each row is rebuilt as text: the prompt's chat messages
(the batch's ``raw_prompt``) plus one assistant message holding the decoded response, rendered with the reward
model's chat template and tokenized by its tokenizer. The prompt part is what the template renders up to the
assistant's turn; the rest is the response part, so ``prompt_length`` / ``response_length`` cut in the reward
model's own tokens.
"""

from __future__ import annotations

from typing import Any


def same_tokenizer(policy: Any, rm: Any) -> bool:
    """The policy's ids can go to the reward model as they are: one vocabulary and one chat template."""
    return policy.get_vocab() == rm.get_vocab() and getattr(policy, "chat_template", None) == getattr(
        rm, "chat_template", None)


def rerendered_rows(
    chats: list[Any], responses: list[str], rm_tokenizer: Any, prompt_length: int | None = None,
    response_length: int | None = None,
) -> list[list[int]]:
    """B chats (lists of ``{"role", "content"}``) and B response texts -> B token lists in the reward model's tokens."""
    rows = []
    for i, (chat, text) in enumerate(zip(chats, responses)):
        if isinstance(chat, str):
            chat = [{"role": "user", "content": chat}]
        if not all(hasattr(m, "keys") and "role" in m for m in chat):
            raise ValueError(f"row {i}: raw_prompt must be a list of chat messages ({{'role', 'content'}}) to "
                             f"re-render for the reward model, got {str(chat)[:80]}")
        chat = [dict(m) for m in chat]  # parquet rows come as numpy arrays of mappings
        head = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        full = rm_tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": text}], tokenize=False)
        prompt = rm_tokenizer(head, add_special_tokens=False)["input_ids"]
        ids = rm_tokenizer(full, add_special_tokens=False)["input_ids"]
        # the longest common start: a template may render the prompt slightly differently once an answer follows
        split = 0
        while split < min(len(prompt), len(ids)) and prompt[split] == ids[split]:
            split += 1
        head_ids, tail_ids = ids[:split], ids[split:]
        if prompt_length is not None:
            head_ids = head_ids[-prompt_length:]
        if response_length is not None:
            tail_ids = tail_ids[:response_length]
        rows.append(head_ids + tail_ids)
    return rows
