"""RewardModelWorker: scores whole responses with a sequence-classification model loaded by path."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.device import current_device
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register


class RewardModelWorker(Worker):
    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = self.config.reward_model.model.path
        if not path:
            raise ValueError("reward_model.enable=true needs reward_model.model.path (a sequence-classification model)")
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(current_device()).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @torch.inference_mode()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """rm_scores [B]: the model's scalar for prompt + response (the policy's tokenizer is assumed shared)."""
        mb = self.config.reward_model.micro_batch_size_per_gpu
        scores = []
        for part in data.select(["input_ids", "attention_mask", "position_ids"]).split(mb):
            ids = part.batch["input_ids"].to(current_device())
            mask = part.batch["attention_mask"].to(current_device())
            # Sequence classification pools the rightmost non-pad token: the end of the response here.
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=part.batch["position_ids"]).logits
            scores.append(logits[:, 0].float().cpu())
        return DataProto.from_dict({"rm_scores": torch.cat(scores)})
