"""The native rollout's compiled decode step (compiled_step.py): torch.compile (inductor) of the fixed-shape step.

Compiled == eager token for token, with the packed matmuls reached through the hybridflow::packed_linear op and with
plain F.linear traced by the compiler; a weight update after compiling is seen without recompiling; veRL's
enforce_eager=false selects it on CPU. (The arithmetic of the fixed-shape step itself: test_rollout_static.py.)"""

from __future__ import annotations

import pytest
import torch
from test_native_archs import write_arch_model
from test_rollout_engines import make_prompts, write_model
from transformers import AutoModelForCausalLM

from hybridflow import device
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.engines.rollout.registry import rollout_engine_kwargs
from hybridflow.trainer.config import load_config

pytestmark = pytest.mark.skipif(device.is_cuda_available(), reason="on GPUs decode='graph' means CUDA graphs")

CASES = [SamplingParams(greedy=True, max_new_tokens=16),
         SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=5)]


def assert_same_generations(engine, eager, prompts, cases=CASES) -> None:
    for params in cases:
        want, got = eager.generate(prompts, params), engine.generate(prompts, params)
        assert torch.equal(got.batch["responses"], want.batch["responses"]), params
        assert torch.equal(got.batch["response_mask"], want.batch["response_mask"]), params
        torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"], atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("prepack", [True, False])
def test_compiled_step_gives_the_eager_tokens_and_follows_weight_updates(tmp_path, prepack):
    path = write_model(tmp_path / "llama", "llama", seed=2, tie=False)  # untied head: the packed lm_head is used
    engine = create_rollout_engine("native", path, num_threads=1, decode="compiled", prepack=prepack)
    eager = create_rollout_engine("native", path, num_threads=1, decode="eager", prepack=prepack)
    assert engine.model.prepacked == prepack and engine.decode == "compiled"
    prompts = make_prompts(engine.tokenizer)
    assert_same_generations(engine, eager, prompts)
    # an update re-packs the weights and writes the others in place: the compiled step must see both
    other = AutoModelForCausalLM.from_pretrained(write_model(tmp_path / "other", "llama", seed=9, tie=False))
    for e in (engine, eager):
        e.update_weights(other.state_dict().items())
    before = engine._graphs._compiled_step
    assert_same_generations(engine, eager, prompts, CASES[:1])
    assert engine._graphs._compiled_step is before


def test_compiled_step_of_a_moe_and_a_soft_capped_model(tmp_path):
    """Qwen3-MoE's dispatch reads group sizes on the host (a graph break); Gemma 2 soft-caps scores and logits."""
    for arch in ("qwen3_moe", "gemma2"):
        path = write_arch_model(tmp_path / arch, arch, seed=1)
        engine = create_rollout_engine("native", path, num_threads=1, decode="compiled", prepack=True)
        eager = create_rollout_engine("native", path, num_threads=1, decode="eager", prepack=True)
        assert_same_generations(engine, eager, make_prompts(engine.tokenizer), CASES[:1])


def test_enforce_eager_false_selects_the_compiled_step_on_cpu(tmp_path):
    rollout = load_config(["actor_rollout_ref.rollout.enforce_eager=False"]).actor_rollout_ref.rollout
    kwargs = rollout_engine_kwargs(rollout)
    assert kwargs == {"decode": "graph"}
    path = write_model(tmp_path / "qwen2", "qwen2", seed=0)
    assert create_rollout_engine("native", path, num_threads=1, **kwargs).decode == "compiled"
    assert create_rollout_engine("native", path, num_threads=1).decode == "eager"  # unset: the CPU default
