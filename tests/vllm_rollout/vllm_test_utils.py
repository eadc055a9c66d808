"""Helpers shared by the vLLM tests: tiny models with peaked logits, prompt batches, and transformers references."""

from __future__ import annotations

import torch

# 2 layers, head_dim 32 (vLLM's CPU attention supports head sizes 32, 64, 80, ...; the "unit" size has 16).
MODEL_SIZE = "tiny"
MAX_MODEL_LEN = 512
KV_CACHE_GIB = 0.25


def write_peaked_model(path, seed: int) -> str:
    """A random-init tiny Qwen2, rescaled so that its layers matter and its next-token logits are peaked.

    Plain random init (std 0.02) gives a model whose greedy output copies the last prompt token with nearly flat
    logits: two seeds give the same greedy text, and near-ties decide argmax. Scaling the layers' matrices x5 and the
    final norm x8 gives prompt-dependent text, different per seed, with logit std ~2 (top-2 gaps ~0.5).
    """
    from transformers import AutoModelForCausalLM

    from hybridflow.engines.tiny import write_tiny_model

    write_tiny_model(path, spec=MODEL_SIZE, seed=seed, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".layers." in name and param.dim() == 2:
                param.mul_(5.0)
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def encode_prompts(texts: list[str]):
    """Left-padded prompts in the rollout input layout -> (DataProto, tokenizer)."""
    from hybridflow.engines.tiny import build_char_tokenizer
    from hybridflow.protocol import DataProto

    tok = build_char_tokenizer()
    enc = tok(texts, return_tensors="pt", padding=True)
    mask = enc.attention_mask
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = DataProto.from_dict(
        {"input_ids": enc.input_ids, "attention_mask": mask, "position_ids": position_ids},
        {"uid": [f"p{i}" for i in range(len(texts))]},
    )
    return batch, tok


@torch.no_grad()
def hf_token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, temperature):
    """log_softmax(logits / T) of each response token under an HF forward, [rows, response_len] (the training side's
    quantity)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    logits = logits[:, -response_len - 1 : -1] / temperature
    targets = input_ids[:, -response_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def hf_greedy(model, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers generate, one unpadded prompt at a time, cut after eos (the reference for greedy checks)."""
    from hybridflow.engines.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    out = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        out.append(gen[: gen.index(tok.eos_token_id) + 1] if tok.eos_token_id in gen else gen)
    return out
