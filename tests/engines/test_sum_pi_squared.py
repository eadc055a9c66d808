"""veRL's actor.calculate_sum_pi_squared: sum_v pi(v)^2 per response token from the chunked head, against the plain
transformers model's full logits."""

from __future__ import annotations

import torch
from test_train_distributed import make_batch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine, OptimConfig


def reference(model, micro, temperature: float) -> torch.Tensor:
    """[b, R]: sum over the vocabulary of softmax(logits / T)^2 at the position before each response token."""
    b = micro.batch
    resp_len = b["responses"].shape[1]
    prompt_len = b["input_ids"].shape[1] - resp_len
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.float()
    probs = torch.softmax(logits[:, prompt_len - 1 : prompt_len - 1 + resp_len] / temperature, dim=-1)
    return probs.square().sum(-1)


def test_sum_pi_squared_matches_the_full_softmax(tiny_model_path):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    # small chunks: the value must not depend on how the head's rows are chunked
    engine = FSDPEngine(EngineConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-3), micro_batch_size_per_gpu=4,
                                     entropy_chunk_size=5))
    batch = make_batch(rows=8, prompt_len=8, response_len=12, seed=4)
    batch.meta_info.update(temperature=0.7, calculate_sum_pi_squared=True)
    seen = []

    def loss_fn(micro, outputs):
        if not seen:  # the first micro-batch runs on the loaded weights (the update comes after the backward)
            mask = micro.batch["response_mask"].bool()
            want = reference(plain, micro.to("cpu"), 0.7)
            got = outputs["sum_pi_squared"].detach().cpu()
            seen.append(float((got - want)[mask].abs().max()))
            assert (got[~mask] == 0).all() and not outputs["sum_pi_squared"].requires_grad
            assert ((got[mask] > 0) & (got[mask] <= 1)).all()
        return outputs["log_probs"].sum() * 0.0, {}

    engine.train_step(batch, loss_fn)
    assert seen and seen[0] <= 1e-5, seen
    # off by default: no extra output
    batch.meta_info["calculate_sum_pi_squared"] = False
    keys = []
    engine.train_step(batch, lambda m, o: (keys.append(set(o)) or o["log_probs"].sum() * 0.0, {}))
    assert all("sum_pi_squared" not in k for k in keys)
