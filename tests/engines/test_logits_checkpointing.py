"""veRL's model.use_fused_kernels (hf_model.py logits_checkpointing): each chunk's logits are recomputed in backward
instead of kept. The same log-probs, entropies and gradients, bit for bit; no [chunk, vocab] tensor kept for backward."""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig
from hybridflow.engines.hf_model import HeadOnPositions, load_model


def run(path: str, on: bool, entropy: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One forward+backward: the gradients, and the training forward's log-probs (and entropies) per micro-batch."""
    eng = FSDPEngine(EngineConfig(model_path=path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=3,
                                  entropy_chunk_size=16, logits_checkpointing=on))
    assert eng.model.logits_checkpointing is on
    data = make_batch(rows=6, prompt_len=7, response_len=10, seed=3)
    data.meta_info.update(calculate_entropy=entropy, temperature=0.8)
    forwards = []

    def loss_fn(micro, outputs):
        forwards.extend(outputs[k].detach().clone() for k in ("log_probs", "entropy") if k in outputs)
        mask = micro.batch["response_mask"].float()
        total = micro.meta_info["global_num_tokens"]
        loss = -(micro.batch["advantages"] * outputs["log_probs"] * mask).sum() / total
        if entropy:
            loss = loss - 0.1 * (outputs["entropy"] * mask).sum() / total
        return loss, {}

    eng.forward_backward(data, loss_fn)
    return {n: p.grad.clone() for n, p in eng.model.named_parameters()}, forwards


@pytest.mark.parametrize("entropy", [False, True])
def test_the_same_gradients_and_outputs_bit_for_bit(tiny_model_path, entropy):
    (off, out_off), (on, out_on) = run(tiny_model_path, False, entropy), run(tiny_model_path, True, entropy)
    assert off.keys() == on.keys()
    assert all(torch.equal(off[k], on[k]) for k in off)
    assert max(float(g.abs().max()) for g in off.values()) > 1e-4  # the gradients are not all zero
    assert len(out_off) == len(out_on) == (4 if entropy else 2)  # two micro-batches
    assert all(torch.equal(a, b) for a, b in zip(out_off, out_on))


def kept_bytes(head, selected, targets, entropy: bool) -> tuple[int, int]:
    """(bytes, the largest tensor's elements) autograd keeps for backward during one head forward (activations only:
    not parameters, not the input), and runs the backward."""
    seen: dict[int, tuple[int, int]] = {}
    skip = {p.untyped_storage().data_ptr() for p in head.parameters()} | {selected.untyped_storage().data_ptr()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = head.head_outputs(selected, targets, 1.0, entropy, 32, selected[:0, 0].float())
    loss = out["log_probs"].sum() + (out["entropy"].sum() if entropy else 0)
    loss.backward()
    return sum(b for b, _ in seen.values()), max((n for _, n in seen.values()), default=0)


@pytest.mark.parametrize("entropy", [False, True])
def test_backward_keeps_no_chunk_of_logits(tiny_model_path, entropy):
    head = HeadOnPositions(load_model(tiny_model_path, "actor"), is_critic=False)
    vocab, hidden = head.hf.config.vocab_size, head.hf.config.hidden_size
    selected = torch.randn(128, hidden, requires_grad=True)  # 4 chunks of 32
    targets = torch.randint(0, vocab, (128,))
    off_bytes, off_largest = kept_bytes(head, selected, targets, entropy)
    head.logits_checkpointing = True
    on_bytes, on_largest = kept_bytes(head, selected, targets, entropy)
    assert off_largest >= 32 * vocab and off_bytes >= 4 * 32 * vocab * 4  # every chunk's [32, V] logits, fp32
    assert on_largest < 32 * vocab and on_bytes < 32 * vocab * 4  # not one chunk's logits


def test_on_cpu_a_chunk_holds_at_most_2_23_logits(tmp_path):
    # a vocabulary of 2^17 tokens: chunks of 2^23 / 2^17 = 64 rows, not the 2,048 asked for
    from hybridflow.engines.tiny import TinyModelSpec, write_tiny_model

    path = write_tiny_model(str(tmp_path / "wide"), TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1,
                                                                   vocab_size=1 << 17), seed=0)
    head = HeadOnPositions(load_model(path, "actor"), is_critic=False)
    rows = []
    head.hf.get_output_embeddings().register_forward_hook(lambda module, args, out: rows.append(out.shape[0]))
    selected = torch.randn(200, 32)
    targets = torch.randint(0, 1 << 17, (200,))
    with torch.no_grad():
        out = head.head_outputs(selected, targets, 1.0, False, 2048, selected[:0, 0])
    assert rows == [64, 64, 64, 8]
    whole = torch.log_softmax(head.hf.get_output_embeddings()(selected).double(), -1).gather(-1, targets[:, None])
    torch.testing.assert_close(out["log_probs"].double(), whole.squeeze(-1), atol=2e-6, rtol=0)
