"""Reward-model workers: score whole responses with a sequence-classification model loaded by path.

``RewardModelWorker`` (``reward_model.use_reward_loop=false``, veRL's legacy worker): the transformers engine in the
processes of the other roles (colocated with the actor), called synchronously by the driver.

``RewardLoopWorker`` (``use_reward_loop=true``, veRL's reward loop): an engine of its own — transformers (``hf``) or
vLLM's pooling runner (``vllm``), ``reward_model.rollout.name`` — in processes apart from the actor's
(trainer/placement.py). Its call does not block: the driver hands the batch over, scores the rule rewards in the
meantime and collects the model's scores after (RLTrainer.score).

Both score the same rows: the prompt's last ``reward_model.rollout.prompt_length`` tokens and the response's first
``response_length`` tokens (engines/reward_model/inputs.py), the policy's tokens as they are (the reward model must
share the policy's tokenizer).
"""

from __future__ import annotations

import os
from typing import Any

from hybridflow.engines.reward_model.inputs import rm_token_rows
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.single_controller.worker import NUM_THREADS_ENV


class RewardModelWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.scorer = None

    def engine_name(self) -> str:
        return "hf"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        rm = self.config.reward_model
        if not rm.model.path:
            raise ValueError("reward_model.enable=true needs reward_model.model.path (a sequence-classification model)")
        if self.engine_name() == "vllm":
            from hybridflow.engines.reward_model.vllm import VLLMRewardScorer

            self.scorer = VLLMRewardScorer(
                rm.model.path, max_model_len=max_row_length(self.config),
                tensor_parallel_size=rm.rollout.tensor_model_parallel_size,
                gpu_memory_utilization=rm.rollout.gpu_memory_utilization or 0.5,  # veRL's reward-loop default
                max_num_seqs=rm.micro_batch_size_per_gpu, param_offload=rm.model.fsdp_config.param_offload,
                dtype="auto", num_threads=self.num_threads(),
            )
        else:
            from hybridflow.engines.reward_model.hf import HFRewardScorer

            self.scorer = HFRewardScorer(
                rm.model.path, micro_batch_size=rm.micro_batch_size_per_gpu,
                use_remove_padding=rm.model.use_remove_padding, param_offload=rm.model.fsdp_config.param_offload,
            )

    @staticmethod
    def num_threads() -> int | None:
        value = os.environ.get(NUM_THREADS_ENV)
        return int(value) if value else None

    def score_rows(self, data: DataProto) -> DataProto:
        """rm_scores [B]: the model's scalar at the last token of each row's (truncated) prompt + response."""
        r = self.config.reward_model.rollout
        width, response_width = data.batch["input_ids"].shape[1], data.batch["responses"].shape[1]
        rows = rm_token_rows(data.batch["input_ids"], data.batch["attention_mask"], response_width,
                             r.prompt_length, r.response_length)
        if self.engine_name() == "vllm":  # packed rows: there is no padded width
            return DataProto.from_dict({"rm_scores": self.scorer.score(rows)})
        # the batch's columns, after the cut: what a forward without padding removal computes
        padded = min(width - response_width, r.prompt_length or width) + min(response_width, r.response_length or width)
        return DataProto.from_dict({"rm_scores": self.scorer.score(rows, padded_width=padded)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        return self.score_rows(data)


class RewardLoopWorker(RewardModelWorker):
    """use_reward_loop=true: the engine named by reward_model.rollout.name, called without blocking the driver."""

    def engine_name(self) -> str:
        return self.config.reward_model.rollout.name

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        return self.score_rows(data)


def max_row_length(cfg: Any) -> int:
    """The longest row the reward model can be sent: the kept prompt plus the kept response."""
    r, d = cfg.reward_model.rollout, cfg.data
    prompt = min(r.prompt_length, d.max_prompt_length) if r.prompt_length else d.max_prompt_length
    response = min(r.response_length, d.max_response_length) if r.response_length else d.max_response_length
    return prompt + response
