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
        """rm_scores [B]: the model's scalar for prompt + response (the policy's tokenizer is assumed shared).

        With ``reward_model.model.use_remove_padding`` (default) rows are grouped by length into micro-batches and
        each micro-batch is cut to the columns some row uses, so no compute goes to the batch's padding; without it
        every micro-batch runs at the full padded width.
        """
        rm = self.config.reward_model
        mb = rm.micro_batch_size_per_gpu
        data = data.select(["input_ids", "attention_mask", "position_ids"])
        mask_all = data.batch["attention_mask"]
        order = torch.arange(len(data))
        if rm.model.use_remove_padding:
            order = torch.argsort(mask_all.sum(-1), stable=True)
        scores = torch.zeros(len(data), dtype=torch.float32)
        for start in range(0, len(data), mb):
            rows = order[start : start + mb]
            ids, mask, pos = (data.batch[k][rows] for k in ("input_ids", "attention_mask", "position_ids"))
            if rm.model.use_remove_padding:
                used = mask.any(0).nonzero().squeeze(-1)
                cols = slice(int(used[0]), int(used[-1]) + 1) if len(used) else slice(0, 1)
                ids, mask, pos = ids[:, cols], mask[:, cols], pos[:, cols]
            dev = current_device()
            # Sequence classification pools the rightmost non-pad token: the end of the response here.
            logits = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev)).logits
            scores[rows] = logits[:, 0].float().cpu()
        return DataProto.from_dict({"rm_scores": scores})
