"""veRL's ``trainer.dump_high_diff_tokens``: each step, the tokens whose rollout and actor probabilities differ most.

The train-inference mismatch is logged every step as rollout/mismatch_* (engines/mismatch.py); when it grows, the
question is *which* tokens. With the key on, every step writes ``step_N.jsonl`` under ``trainer.dump_high_diff_dir``
(default ``RUN_DIR/high_diff_tokens``): one line per token, the ``TOP_K`` response tokens of the batch with the
largest ``|p_rollout - p_actor|`` (probabilities of the sampled token, as veRL's rollout_probs_diff), largest first::

    {"step": 3, "row": 5, "uid": "...", "position": 17, "token_id": 42, "token": " the",
     "rollout_log_prob": -0.11, "actor_log_prob": -2.3, "prob_diff": 0.79, "context": "...text before the token"}

The actor's log-probs are those of the old-log-prob pass (the weights that sampled the batch), so the key makes the
driver run that pass even when the update is on-policy (rl_trainer.is_on_policy).
"""

from __future__ import annotations

import json
import os

import torch

from hybridflow.protocol import DataProto

DEFAULT_SUBDIR = "high_diff_tokens"
TOP_K = 32  # tokens per step
CONTEXT_TOKENS = 16  # response tokens before the token, decoded as its context


def high_diff_positions(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, response_mask: torch.Tensor, k: int
) -> list[tuple[int, int, float]]:
    """(row, position, |p_rollout - p_actor|) of the k valid tokens [batch, response_len] that differ most, largest
    first (fewer when the mask holds fewer tokens)."""
    diff = (rollout_log_probs.double().exp() - actor_log_probs.double().exp()).abs()
    diff = torch.where(response_mask.bool(), diff, torch.full_like(diff, -1.0))
    k = min(k, int(response_mask.bool().sum()))
    if k == 0:
        return []
    values, flat = diff.flatten().topk(k)
    width = diff.shape[1]
    return [(int(i) // width, int(i) % width, float(v)) for v, i in zip(values, flat, strict=True)]


class HighDiffTokenDump:
    """Writes one step_N.jsonl per step into `directory` (created; only the step files are written there)."""

    def __init__(self, directory: str, tokenizer, top_k: int = TOP_K):
        self.directory, self.tokenizer, self.top_k = directory, tokenizer, top_k
        os.makedirs(directory, exist_ok=True)

    def write(self, batch: DataProto, step: int) -> dict[str, float]:
        """Dump the step's tokens (the batch needs rollout_log_probs, old_log_probs, responses, response_mask)."""
        b = batch.batch
        picked = high_diff_positions(b["rollout_log_probs"], b["old_log_probs"], b["response_mask"], self.top_k)
        uids = batch.non_tensor_batch.get("uid")
        path = os.path.join(self.directory, f"step_{step}.jsonl")
        with open(path + ".tmp", "w") as f:
            for row, pos, prob_diff in picked:
                token_id = int(b["responses"][row, pos])
                before = b["responses"][row, max(0, pos - CONTEXT_TOKENS):pos].tolist()
                f.write(json.dumps({
                    "step": step, "row": row, "uid": None if uids is None else str(uids[row]), "position": pos,
                    "token_id": token_id, "token": self.tokenizer.decode([token_id]),
                    "rollout_log_prob": float(b["rollout_log_probs"][row, pos]),
                    "actor_log_prob": float(b["old_log_probs"][row, pos]), "prob_diff": prob_diff,
                    "context": self.tokenizer.decode(before),
                }) + "\n")
        os.replace(path + ".tmp", path)  # a crash mid-write leaves no half file
        return {"rollout/high_diff_max_prob_diff": picked[0][2] if picked else 0.0}
