"""Fixtures for the agent tests: the shared tiny transformers model and its character tokenizer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_path):
    """(model, tokenizer): the shared tiny random-init Qwen2 and its character tokenizer (ChatML template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    return model, tokenizer
