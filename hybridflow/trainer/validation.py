"""Validation: generate on the held-out set (greedy and/or n samples), score, and aggregate per data_source."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.common.seeds import derive_seed
from hybridflow.protocol import DataProto
from hybridflow.trainer import agent_rewards
from hybridflow.trainer.metrics import compute_validation_metrics
from hybridflow.workers.agent_rollout import agent_batch_metrics


class Validator:
    """sample_writer + tokenizer: the first ``trainer.log_val_generations`` validation samples of each validation go to
    samples.jsonl (split "val": prompt, response, score, ground truth)."""

    def __init__(self, cfg: Any, actor_rollout_group, val_loader, reward_fn, *, tokenizer: Any = None,
                 sample_writer: Any = None):
        self.cfg = cfg
        self.group = actor_rollout_group
        self.loader = val_loader
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.sample_writer = sample_writer

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
        logged: dict[str, list] = {"prompts": [], "responses": [], "scores": [], "ground_truths": []}
        episodes: list[tuple[DataProto, torch.Tensor]] = []
        to_log = self.cfg.trainer.log_val_generations if self.sample_writer is not None else 0
        for batch in self.loader:
            gen_in = batch.select(["input_ids", "attention_mask", "position_ids"], meta_keys=[])
            gen_in.meta_info = self.sampling_meta(step)
            if self.cfg.actor_rollout_ref.rollout.multi_turn.enable:
                gen_in = agent_rewards.generation_input(batch, gen_in)
            gen = self.group.generate_sequences(gen_in)
            rows = batch.select([], non_tensor_keys=list(batch.non_tensor_batch)).repeat(n, interleave=True)
            rows.union(DataProto(batch=gen.batch))
            agent_rewards.merge_generation(rows, gen)
            rows.batch["response_mask"] = rows.batch["response_mask"].float()
            result = self.reward_fn(rows)
            if "agent_metrics" in rows.non_tensor_batch:
                episodes.append((rows.select([], non_tensor_keys=["agent_metrics", "termination", "tool_calls",
                                                                  "agent_reward"]), result.scores))
            sources += list(rows.non_tensor_batch["data_source"])
            prompt_ids += [int(i) for i in rows.non_tensor_batch["index"]]
            scores += result.scores.tolist()
            preds = (result.extra or {}).get("pred")
            answers += list(preds) if preds is not None else [t.strip() for t in result.responses_text]
            take = min(len(rows), to_log - len(logged["prompts"]))
            if take > 0:
                mask = rows.batch["attention_mask"]
                for i in range(take):
                    p = rows.batch["prompts"][i]
                    logged["prompts"].append(self.tokenizer.decode(p[mask[i, : p.shape[0]].bool()]))
                logged["responses"] += list(result.responses_text[:take])
                logged["scores"] += result.scores[:take].tolist()
                gts = rows.non_tensor_batch.get("ground_truth")
                logged["ground_truths"] += list(gts[:take]) if gts is not None else [None] * take
                records = agent_rewards.episode_records(rows)
                if records is not None:
                    logged.setdefault("episodes", []).extend(records[:take])
        metrics = compute_validation_metrics(sources, prompt_ids, scores, answers=answers, n=n, seed=self.cfg.trainer.seed)
        metrics["val/score_mean"] = float(np.mean(scores)) if scores else 0.0
        if episodes:  # multi-turn: turns, tool calls, terminations, solved fraction on the held-out set
            rows = DataProto.concat([e[0] for e in episodes])
            agent = agent_batch_metrics(rows, torch.cat([e[1] for e in episodes]))
            metrics.update({f"val/{k}": v for k, v in agent.items()})
        if logged["prompts"]:
            self.sample_writer.write(step, logged["prompts"], logged["responses"], logged["scores"],
                                     ground_truths=logged["ground_truths"], split="val",
                                     episodes=logged.get("episodes"))
        return metrics
