"""Helpers for the agent tests: chat templates, and a generator that plays scripted assistant turns through a real
model (tokens from the script, log-probs from the model)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

# A Qwen2.5-style template written for these tests: tools listed in the system prompt, tool results sent back as a
# user turn wrapping each result in <tool_response>, consecutive tool messages grouped in one turn.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Not append-only (like Qwen3's): an assistant turn's <think>...</think> is dropped once a later user turn exists,
# so rendering the whole conversation again changes tokens that the model saw earlier.
DROP_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_with(tiny_model_path: str, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = template
    return tok


class ScriptedGenerator:
    """A Generator whose turns come from `script(context_text) -> reply text`, forced through the real model.

    The reply is tokenized and followed by eos; the log-probs are the model's (one forward pass over context + reply,
    log_softmax(logits / temperature)). `contexts` and `outputs` record exactly what each call saw and returned.
    """

    def __init__(self, model, tokenizer, script: Callable[[str], str]):
        self.model, self.tokenizer, self.script = model, tokenizer, script
        self.contexts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, prompt_token_ids, max_new_tokens, sampling):
        from hybridflow.agents import Generation

        self.contexts.append(list(prompt_token_ids))
        reply = self.script(self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        tokens = [*self.tokenizer(reply, add_special_tokens=False)["input_ids"], self.tokenizer.eos_token_id]
        finish = "stop"
        if len(tokens) > max_new_tokens:
            tokens, finish = tokens[:max_new_tokens], "length"
        ids = torch.tensor([list(prompt_token_ids) + tokens])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0].float()
        temperature = 1.0 if sampling.greedy else sampling.temperature
        lp = torch.log_softmax(logits[len(prompt_token_ids) - 1 : -1] / temperature, -1)
        lp = lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()
        self.outputs.append(tokens)
        return Generation(tokens, lp, finish)


def assistant_turns(context: str) -> int:
    """How many assistant turns the context already holds (the generation prompt not counted)."""
    return len(re.findall(r"<\|im_start\|>assistant\n", context)) - 1


class Countdown:
    """Answers every turn with the turns left; ends after three steps."""

    def __init__(self):
        self.left = 3

    def reset(self, **row):
        return f" Start at {row['start']}."

    def step(self, action):
        self.left -= 1
        return f"{self.left} left", float(len(action) % 2), self.left == 0, {}
