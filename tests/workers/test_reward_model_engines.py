"""The reward model's engine pieces: what a row is (truncation), the hf engine's last-token score, and param_offload."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.device import current_device
from hybridflow.engines.reward_model.hf import HFRewardScorer
from hybridflow.engines.reward_model.inputs import rm_token_rows
from hybridflow.engines.tiny import write_tiny_reward_model
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.workers.reward_model import RewardLoopWorker, RewardModelWorker


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> str:
    return write_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), seed=5)


def rollout_batch(prompts: list[list[int]], responses: list[list[int]]) -> DataProto:
    """Left-padded prompts, right-padded responses (the rollout's layout) from token lists."""
    p, r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(len(prompts), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (pr, rs) in enumerate(zip(prompts, responses)):
        ids[i, p - len(pr) : p], mask[i, p - len(pr) : p] = torch.tensor(pr), 1
        ids[i, p : p + len(rs)], mask[i, p : p + len(rs)] = torch.tensor(rs), 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, p:],
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


def test_rows_keep_the_prompts_end_and_the_responses_start():
    b = rollout_batch([[11, 12, 13, 14, 15], [21, 22]], [[31, 32, 33, 34], [41]])
    ids, mask = b.batch["input_ids"], b.batch["attention_mask"]
    assert rm_token_rows(ids, mask, 4) == [[11, 12, 13, 14, 15, 31, 32, 33, 34], [21, 22, 41]]
    assert rm_token_rows(ids, mask, 4, prompt_length=3, response_length=2) == [[13, 14, 15, 31, 32], [21, 22, 41]]
    with pytest.raises(ValueError, match="prompt_length=0 must be >= 1"):
        rm_token_rows(ids, mask, 4, prompt_length=0)


def test_hf_engine_scores_the_last_token_of_each_row_whatever_the_padding(rm_path):
    """Same score as the model on the row alone, batched with rows of other lengths, in any micro-batch size, and
    also when the row ends in the pad id (transformers' own pooling would skip that token)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    rows = [[5, 6, 7, 8, 9, 10], [40, 41], [70, 71, 72, 0]]  # 0 is the tokenizer's pad (and the tiny eos is 3)
    alone = []
    for r in rows:
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([r])).last_hidden_state
            alone.append(float(model.score(hidden[0, -1])[0]))
    for mb in (1, 2, 3):
        got = HFRewardScorer(rm_path, micro_batch_size=mb).score(rows)
        torch.testing.assert_close(got, torch.tensor(alone), atol=1e-5, rtol=0)
    # rows without the pad id: the model's own pooled logits agree
    with torch.no_grad():
        assert abs(float(model(input_ids=torch.tensor([rows[0]])).logits[0, 0]) - alone[0]) < 1e-5


def test_a_long_response_is_scored_on_its_truncation(rm_path):
    """reward_model.rollout.response_length / prompt_length: the model reads the prompt's last N tokens and the
    response's first M, so a long response scores as its first M tokens would."""
    prompt, response = list(range(20, 32)), list(range(50, 90))
    full = rollout_batch([prompt], [response])
    cut = rollout_batch([prompt[-4:]], [response[:6]])
    cfg = load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true",
                       "reward_model.rollout.prompt_length=4", "reward_model.rollout.response_length=6"])
    plain = load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true"])
    scores = {}
    for name, c in (("truncating", cfg), ("plain", plain)):
        w = RewardModelWorker(c)
        w.init_model()
        scores[name, "full"] = float(w.compute_rm_score(full).batch["rm_scores"][0])
        scores[name, "cut"] = float(w.compute_rm_score(cut).batch["rm_scores"][0])
    assert scores["truncating", "full"] == pytest.approx(scores["plain", "cut"], abs=1e-5)
    assert scores["truncating", "full"] != pytest.approx(scores["plain", "full"], abs=1e-3)


def test_param_offload_keeps_the_weights_on_the_host_between_calls(rm_path):
    """reward_model.model.fsdp_config.param_offload: weights on cpu after init and after each call, on the compute
    device during the forward (on a CPU machine the two are the same place; on a GPU the forward sees cuda)."""
    cfg = load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true",
                       "reward_model.model.fsdp_config.param_offload=true"])
    worker = RewardModelWorker(cfg)
    worker.init_model()
    assert worker.scorer.parameter_devices() == {"cpu"}
    during: list[str] = []
    worker.scorer.base.register_forward_pre_hook(
        lambda module, args: during.append(next(module.parameters()).device.type))
    worker.compute_rm_score(make_batch(5, 6, 4, seed=2))
    assert during == [current_device().type] and worker.scorer.parameter_devices() == {"cpu"}
    kept = RewardModelWorker(load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true"]))
    kept.init_model()
    assert kept.scorer.parameter_devices() == {current_device().type}  # without offload it stays on the device


def test_reward_loop_worker_returns_the_same_scores_without_blocking(rm_path):
    """use_reward_loop=true, rollout.name=hf: the same scores as the legacy worker; its group call is non-blocking."""
    from hybridflow.single_controller import ClassWithInitArgs, WorkerGroup
    from hybridflow.single_controller.future import DataProtoFuture

    batch = make_batch(6, 8, 5, seed=4)
    legacy = RewardModelWorker(load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true"]))
    legacy.init_model()
    cfg = load_config([f"reward_model.model.path={rm_path}", "reward_model.enable=true",
                       "reward_model.use_reward_loop=true", "reward_model.rollout.name=hf"])
    group = WorkerGroup(None, ClassWithInitArgs(RewardLoopWorker, cfg), name_prefix="rm_loop", backend="local")
    group.init_model()
    out = group.compute_rm_score(batch)
    assert isinstance(out, DataProtoFuture)
    torch.testing.assert_close(out.get().batch["rm_scores"], legacy.compute_rm_score(batch).batch["rm_scores"])


OTHER_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper + ': ' + m['content'] + '\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}")


@pytest.fixture(scope="module")
def other_template_rm(tmp_path_factory) -> str:
    """A reward model whose tokenizer renders chats its own way (as a Llama RM scoring a Qwen policy would)."""
    from transformers import AutoTokenizer

    path = write_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm_other"), seed=6)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = OTHER_TEMPLATE
    tok.save_pretrained(path)
    return path


def policy_batch(tokenizer, chats: list[list[dict]], responses: list[str]) -> DataProto:
    """What the rollout hands over: the policy's rendering of each chat, its response tokens (+ eos), raw_prompt."""
    import numpy as np

    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    batch = rollout_batch([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
                          [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                           for r in responses])
    raw = np.empty(len(chats), dtype=object)  # one chat (a numpy array of message dicts, as parquet gives) per row
    raw[:] = [np.array(c, dtype=object) for c in chats]
    batch.non_tensor_batch["raw_prompt"] = raw
    return batch


def test_a_reward_model_with_its_own_chat_template_reads_the_conversation_rerendered(
        tiny_model_path, other_template_rm):
    """The reward model's tokenizer is not the policy's: each row is raw_prompt + the decoded response in the reward
    model's template (veRL's behaviour); prompt_length / response_length cut in its tokens."""
    from transformers import AutoTokenizer

    policy_tok, rm_tok = AutoTokenizer.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(other_template_rm)
    chats = [[{"role": "user", "content": "what is 6*7?"}], [{"role": "user", "content": "2+2"}]]
    batch = policy_batch(policy_tok, chats, ["42", "four, I think"])
    worker = RewardModelWorker(load_config([f"reward_model.model.path={other_template_rm}", "reward_model.enable=true",
                                            f"actor_rollout_ref.model.path={tiny_model_path}",
                                            "reward_model.rollout.response_length=6"]))
    worker.init_model()
    assert worker.rerender
    got = worker.compute_rm_score(batch).batch["rm_scores"]
    heads = [rm_tok("USER: " + c[0]["content"] + "\nASSISTANT: ", add_special_tokens=False)["input_ids"] for c in chats]
    tails = [rm_tok(t + "\n", add_special_tokens=False)["input_ids"][:6] for t in ("42", "four, I think")]
    expected = worker.scorer.score([h + t for h, t in zip(heads, tails)])
    torch.testing.assert_close(got, expected)
    same = RewardModelWorker(load_config([f"reward_model.model.path={tiny_model_path}", "reward_model.enable=true",
                                          f"actor_rollout_ref.model.path={tiny_model_path}"]))
    same.init_model()
    assert not same.rerender  # one tokenizer, one template: the policy's ids as they are
    del batch.non_tensor_batch["raw_prompt"]
    with pytest.raises(ValueError, match=r"set data\.return_raw_chat=true"):
        worker.compute_rm_score(batch)
