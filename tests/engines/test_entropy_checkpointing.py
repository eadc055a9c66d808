"""veRL's actor.entropy_checkpointing: the entropy of each logits chunk is recomputed in backward instead of kept.
Same gradients as without it; fewer bytes saved for backward."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.trainer.config import ConfigError, load_config


def entropy_bonus_loss(micro, outputs):
    mask = micro.batch["response_mask"].float()
    total = micro.meta_info["global_num_tokens"]
    pg = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
    return pg - 0.1 * (outputs["entropy"] * mask).sum() / total, {}


def gradients(path: str, on: bool) -> dict[str, torch.Tensor]:
    eng = FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=3,
                                  entropy_chunk_size=16, entropy_checkpointing=on))
    assert eng.model.entropy_checkpointing is on
    data = make_batch(rows=6, prompt_len=7, response_len=10, seed=3)
    data.meta_info.update(calculate_entropy=True, temperature=0.8)
    eng.forward_backward(data, entropy_bonus_loss)
    return {n: p.grad.clone() for n, p in eng.model.named_parameters()}


def test_gradients_are_the_same_with_and_without_entropy_checkpointing(tiny_model_path):
    torch.manual_seed(0)
    off, on = gradients(tiny_model_path, False), gradients(tiny_model_path, True)
    assert off.keys() == on.keys()
    assert max(float((off[k] - on[k]).abs().max()) for k in off) <= 1e-6
    assert max(float(g.abs().max()) for g in off.values()) > 1e-4  # the gradients are not all zero


def saved_bytes(head, selected, targets) -> int:
    """Bytes of the distinct activations (not parameters, not the input) autograd keeps for backward during one head
    forward with entropy."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in head.parameters()} | {selected.untyped_storage().data_ptr()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = head.head_outputs(selected, targets, 1.0, True, 64, selected[:0, 0].float())
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    return sum(seen.values())


@pytest.mark.parametrize("c_path", [False, True], ids=["torch-ops", "cpu-c-call"])
def test_checkpointing_keeps_one_logits_copy_instead_of_the_softmax_activations(tiny_model_path, monkeypatch, c_path):
    from hybridflow.engines import hf_model
    from hybridflow.engines.hf_model import HeadOnPositions, load_model

    if not c_path:  # the path of other devices (and of a CPU without a C compiler)
        monkeypatch.setattr(hf_model, "log_prob_kernel_applies", lambda logits: False)
    elif not hf_model.log_prob_kernel_applies(torch.zeros(1, 2)):
        pytest.skip("no C compiler here: the CPU takes torch's ops")
    head = HeadOnPositions(load_model(tiny_model_path, "actor"), is_critic=False)
    vocab, hidden = head.hf.config.vocab_size, head.hf.config.hidden_size
    selected = torch.randn(64, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (64,))
    off = saved_bytes(head, selected, targets)
    head.entropy_checkpointing = True
    on = saved_bytes(head, selected, targets)
    chunk_logits = 64 * vocab * 4  # one [chunk, V] float32 tensor
    # with: the logits alone (the entropy's activations are recomputed in backward); without, torch's ops keep the
    # log-softmax and the probabilities [chunk, V] too, where the CPU's C call keeps only the logits already
    assert on <= 1.1 * chunk_logits
    assert off <= 1.1 * chunk_logits if c_path else off >= 2 * chunk_logits


def test_the_keys():
    assert load_config(["actor_rollout_ref.actor.entropy_checkpointing=true"]
                       ).actor_rollout_ref.actor.entropy_checkpointing is True
    with pytest.raises(ConfigError, match=r"ref\.entropy_checkpointing=true: the reference computes log-probs only"):
        load_config(["actor_rollout_ref.ref.entropy_checkpointing=true"])
