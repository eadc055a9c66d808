"""Reward-model workers: score whole responses with a sequence-classification model loaded by path.

``RewardModelWorker`` (``reward_model.use_reward_loop=false``, veRL's legacy worker): the transformers engine in the
processes of the other roles (colocated with the actor), called synchronously by the driver.

``RewardLoopWorker`` (``use_reward_loop=true``, veRL's reward loop): an engine of its own — transformers (``hf``) or
vLLM's pooling runner (``vllm``), ``reward_model.rollout.name`` — in processes apart from the actor's
(trainer/placement.py). Its call does not block: the driver hands the batch over, scores the rule rewards in the
meantime and collects the model's scores after (RLTrainer.score).

Both score the same rows: the prompt's last ``reward_model.rollout.prompt_length`` tokens and the response's first
``response_length`` tokens (engines/reward_model/inputs.py): the policy's tokens as they are when the reward model
has the policy's tokenizer, else the conversation re-rendered in the reward model's chat template and tokens
(engines/reward_model/chat.py), as veRL does.
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
        from transformers import AutoTokenizer

        from hybridflow.engines.reward_model.chat import same_tokenizer

        self.rm_tokenizer = AutoTokenizer.from_pretrained(rm.model.path)
        policy_path = self.config.actor_rollout_ref.model.path
        self.policy_tokenizer = AutoTokenizer.from_pretrained(policy_path) if policy_path else None
        self.rerender = self.policy_tokenizer is not None and not same_tokenizer(self.policy_tokenizer,
                                                                                 self.rm_tokenizer)
        if self.engine_name() == "vllm":
            from hybridflow.engines.reward_model.vllm import VLLMRewardScorer

            self.scorer = VLLMRewardScorer(
                rm.model.path, max_model_len=max_row_length(self.config, self.rerender),
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
        if self.rerender:
            rows = self.rerendered(data)
        else:
            rows = rm_token_rows(data.batch["input_ids"], data.batch["attention_mask"], response_width,
                                 r.prompt_length, r.response_length)
        if self.engine_name() == "vllm" or self.rerender:  # packed / re-tokenized rows: no padded width
            return DataProto.from_dict({"rm_scores": self.scorer.score(rows)})
        # the batch's columns, after the cut: what a forward without padding removal computes
        padded = min(width - response_width, r.prompt_length or width) + min(response_width, r.response_length or width)
        return DataProto.from_dict({"rm_scores": self.scorer.score(rows, padded_width=padded)})

    def rerendered(self, data: DataProto) -> list[list[int]]:
        """The rows in the reward model's own chat template and tokens: raw_prompt + the decoded response."""
        from hybridflow.engines.reward_model.chat import rerendered_rows

        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError(
                "the reward model's tokenizer is not the policy's, so it reads each conversation re-rendered in its "
                "own chat template, but the batch carries no 'raw_prompt' column; set data.return_raw_chat=true"
            )
        responses = data.batch["responses"]
        mask = data.batch["attention_mask"][:, -responses.shape[1]:].bool()
        texts = self.policy_tokenizer.batch_decode([row[m].tolist() for row, m in zip(responses.cpu(), mask.cpu())],
                                                   skip_special_tokens=True)
        r = self.config.reward_model.rollout
        return rerendered_rows(list(data.non_tensor_batch["raw_prompt"]), texts, self.rm_tokenizer,
                               r.prompt_length, r.response_length)

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


def max_row_length(cfg: Any, rerender: bool = False) -> int | None:
    """The longest row the reward model can be sent: the kept prompt plus the kept response (None: the model's own
    limit, for re-rendered rows without both cuts)."""
    r, d = cfg.reward_model.rollout, cfg.data
    if rerender:  # rows in the reward model's tokens: only the cuts bound them
        return r.prompt_length + r.response_length if r.prompt_length and r.response_length else None
    prompt = min(r.prompt_length, d.max_prompt_length) if r.prompt_length else d.max_prompt_length
    response = min(r.response_length, d.max_response_length) if r.response_length else d.max_response_length
    return prompt + response
