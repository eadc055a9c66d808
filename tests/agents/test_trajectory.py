"""Token-level trajectory assembly: observation deltas, what the model saw == what is trained on, templates that
are not append-only, truncation."""

from __future__ import annotations

import pytest
from agent_helpers import DROP_THINK_TEMPLATE, QWEN_STYLE_TEMPLATE, ScriptedGenerator, assistant_turns, tokenizer_with
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridflow.agents import AgentLoop, AgentLoopConfig, ChatRenderer
from hybridflow.agents.trajectory import TemplateError, truncate_text

EOS = "<|im_end|>"


def test_delta_after_a_stop_token_and_after_a_length_cut(tiny_lm):
    _, tok = tiny_lm
    r = ChatRenderer(tok)
    new = [{"role": "user", "content": "lower"}]
    assert r.delta_text(new, tok.eos_token_id) == "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by its token limit never wrote <|im_end|>: the delta closes it
    assert r.delta_text(new, None) == "<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_plus_turns_equals_the_template_rendering(tiny_model_path):
    """With a template that only appends, the assembled tokens equal the template's rendering of the conversation
    (the character tokenizer makes tokenization boundary-free, so the two can be compared token for token)."""
    tok = tokenizer_with(tiny_model_path, QWEN_STYLE_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    r = ChatRenderer(tok, tools=tools)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    ids = r.prompt_ids(messages)
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    ids += [*r.encode(reply), tok.eos_token_id]
    results = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    delta = r.delta_text(results, tok.eos_token_id)
    assert delta == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
                     "<|im_end|>\n<|im_start|>assistant\n")
    ids += r.encode(delta)
    full = [*messages, {"role": "assistant", "content": reply}, *results]
    assert ids == r.encode(r.render(full, add_generation_prompt=True))
    assert '"name": "add"' in tok.decode(r.prompt_ids(messages))  # the tools reached the system prompt


def test_non_append_only_template_keeps_what_the_model_saw(tiny_lm, tiny_model_path):
    """A template that drops earlier <think> blocks: the loop's trajectory is exactly the generator's contexts and
    outputs, while re-rendering the conversation would have changed the first turn's tokens."""
    model, _ = tiny_lm
    tok = tokenizer_with(tiny_model_path, DROP_THINK_TEMPLATE)

    def script(context: str) -> str:
        return f"<think>plan {assistant_turns(context)}</think>[{assistant_turns(context) + 5}]"

    class Feedback:
        def __init__(self):
            self.n = 0

        def step(self, action):
            self.n += 1
            return f"not {action[-3:]}", 0.0, self.n >= 3, {}

    gen = ScriptedGenerator(model, tok, script)
    loop = AgentLoop(gen, tok, AgentLoopConfig(max_assistant_turns=5), env_factory=Feedback)
    (ep,) = loop.run_sync([{"prompt": [{"role": "user", "content": "guess"}]}])
    traj = ep.trajectory
    assert ep.termination == "env_done" and traj.num_assistant_turns == 3 and len(gen.contexts) == 3
    # every turn was generated from exactly the trajectory's tokens so far ...
    for context, output, turn in zip(gen.contexts, gen.outputs, [t for t in traj.turns if t.kind == "assistant"]):
        assert context == traj.prompt_ids + traj.response_ids[: turn.start]
        assert traj.response_ids[turn.start : turn.end] == output
        assert all(traj.response_mask[turn.start : turn.end])
    # ... the observation spans are the template's deltas, masked out ...
    obs = [t for t in traj.turns if t.kind == "observation"]
    assert [tok.decode(traj.response_ids[t.start : t.end]) for t in obs] == [
        "\n<|im_start|>user\nnot [5]<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nnot [6]<|im_end|>\n<|im_start|>assistant\n"]
    assert not any(any(traj.response_mask[t.start : t.end]) for t in obs)
    # ... and re-rendering the conversation would NOT have reproduced it (the template rewrites earlier turns)
    rerender = ChatRenderer(tok).encode(ChatRenderer(tok).render(ep.conversation, add_generation_prompt=False))
    assert "<think>plan 0</think>" in tok.decode(traj.context_ids())
    assert "<think>plan 0</think>" not in tok.decode(rerender)


def test_template_errors(tiny_model_path):
    tok = tokenizer_with(tiny_model_path, QWEN_STYLE_TEMPLATE)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatRenderer(tok)
    tok.chat_template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                         "{{ raise_exception('only user/assistant') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(TemplateError, match=r"roles \['tool'\].*only user/assistant"):
        ChatRenderer(tok).delta_text([{"role": "tool", "content": "x"}], None)
    tok.chat_template = "{% for m in messages %}{{ m.role }}{% endfor %}"
    with pytest.raises(TemplateError, match="verbatim"):
        ChatRenderer(tok).delta_text([{"role": "user", "content": "x"}], None)


def test_truncate_text_in_tokens(tiny_lm):
    _, tok = tiny_lm
    assert truncate_text(tok, "short", 10) == ("short", False)
    assert truncate_text(tok, "x" * 5_000_000, None)[1] is False
    text, cut = truncate_text(tok, "ab" * 3_000_000, 16)  # megabytes: cut before tokenizing
    assert cut and text == "ab" * 8 + "...(truncated)"


_TEXT = st.text(alphabet=st.characters(codec="ascii", exclude_characters="<>\x00"), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(_TEXT, st.booleans(), st.lists(_TEXT, min_size=1, max_size=3),
                                st.booleans()), min_size=1, max_size=4))
def test_deltas_reproduce_the_template_for_any_conversation(tiny_model_path, turns):
    """For an append-only template the assembled tokens equal the template's own rendering of the conversation, for
    any mix of stopped / length-cut turns and tool or user observations (char tokenizer: comparable token for token)."""
    tok = _qwen_tok(tiny_model_path)
    r = ChatRenderer(tok)
    conversation = [{"role": "user", "content": "start"}]
    ids = r.prompt_ids(conversation)
    for reply, stopped, observations, as_tool in turns:
        ids += r.encode(reply) + ([tok.eos_token_id] if stopped else [])
        new = [{"role": "tool" if as_tool else "user", "content": o} for o in observations]
        if not as_tool:
            new = new[:1]
        ids += r.delta_ids(new, tok.eos_token_id if stopped else None)
        conversation += [{"role": "assistant", "content": reply}, *new]
    assert ids == r.encode(r.render(conversation, add_generation_prompt=True))


_QWEN_TOK = {}


def _qwen_tok(path):
    if path not in _QWEN_TOK:
        _QWEN_TOK[path] = tokenizer_with(path, QWEN_STYLE_TEMPLATE)
    return _QWEN_TOK[path]
