"""A rollout engine that is not part of hybridflow, reached by import path only (``rollout.name=<file>:ToyRollout``).

It samples response tokens uniformly at random: enough to show that a user's engine plugs into a GRPO step on Ray
(every worker imports this file itself) without touching hybridflow.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoTokenizer

from hybridflow.engines.rollout import RolloutEngine
from hybridflow.engines.rollout.layout import assemble_output, read_prompts


class ToyRollout(RolloutEngine):
    def __init__(self, model_path, *, dtype="fp32", seed=0, max_model_len=None, vocab_limit: int = 32):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.vocab_limit = vocab_limit
        self.updates = 0

    def generate(self, prompts, params):
        read = read_prompts(prompts)
        rows, R = read.batch_size * params.n, params.max_new_tokens
        g = torch.Generator().manual_seed(params.seed or 0)
        responses = torch.randint(0, self.vocab_limit, (rows, R), generator=g)
        lengths = torch.randint(1, R + 1, (rows,), generator=g)
        log_probs = torch.full((rows, R), -math.log(self.vocab_limit))
        return assemble_output(prompts, read, responses, lengths, log_probs, params.n, self.pad_token_id)

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass
        self.updates += 1
