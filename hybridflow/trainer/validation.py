"""Validation: generate on the held-out set (greedy and/or n samples), score, and aggregate per data_source."""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridflow.common.seeds import derive_seed
from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import compute_validation_metrics


class Validator:
    def __init__(self, cfg: Any, actor_rollout_group, val_loader, reward_fn):
        self.cfg = cfg
        self.group = actor_rollout_group
        self.loader = val_loader
        self.reward_fn = reward_fn

    def sampling_meta(self, step: int) -> dict[str, Any]:
        v = self.cfg.actor_rollout_ref.rollout.val_kwargs
        return {
            "temperature": v.temperature if v.do_sample else 1.0,
            "top_k": v.top_k,
            "top_p": v.top_p,
            "greedy": not v.do_sample,
            "n": v.n,
            "max_new_tokens": self.cfg.data.max_response_length,
            "stop_token_ids": list(self.cfg.actor_rollout_ref.rollout.stop_token_ids),
            "seed": derive_seed(self.cfg.trainer.seed, step, 0xBEEF),
        }

    def run(self, step: int) -> dict[str, float]:
        n = self.cfg.actor_rollout_ref.rollout.val_kwargs.n
        sources, prompt_ids, scores, answers = [], [], [], []
        for batch in self.loader:
            gen_in = batch.select(["input_ids", "attention_mask", "position_ids"], meta_keys=[])
            gen_in.meta_info = self.sampling_meta(step)
            gen = self.group.generate_sequences(gen_in)
            rows = batch.select([], non_tensor_keys=list(batch.non_tensor_batch)).repeat(n, interleave=True)
            rows.union(DataProto(batch=gen.batch))
            rows.batch["response_mask"] = rows.batch["response_mask"].float()
            result = self.reward_fn(rows)
            sources += list(rows.non_tensor_batch["data_source"])
            prompt_ids += [int(i) for i in rows.non_tensor_batch["index"]]
            scores += result.scores.tolist()
            preds = (result.extra or {}).get("pred")
            answers += list(preds) if preds is not None else [t.strip() for t in result.responses_text]
        metrics = compute_validation_metrics(sources, prompt_ids, scores, answers=answers, n=n, seed=self.cfg.trainer.seed)
        metrics["val/score_mean"] = float(np.mean(scores)) if scores else 0.0
        return metrics
