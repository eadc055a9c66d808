"""The transformers engine of a reward model: ``AutoModelForSequenceClassification`` scoring token rows.

A row's score is the classification head applied to the hidden state of the row's *last* token (the end of the
response), whatever that token's id: transformers' own pooling looks for the last token that is not the pad id,
which picks the wrong position when the response ends in an eos that is also the pad token. vLLM's pooling runner
also pools the last token, so both engines give the same score to the same row.

``param_offload`` (veRL's ``reward_model.model.fsdp_config.param_offload``): the weights live in host memory between
calls; each call moves them to the compute device and back. On a CPU device both places are the same.
"""

from __future__ import annotations

import torch

from hybridflow.device import current_device
from hybridflow.engines.reward_model.inputs import pad_rows


class HFRewardScorer:
    def __init__(self, path: str, *, micro_batch_size: int, use_remove_padding: bool = True,
                 param_offload: bool = False, device: torch.device | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if micro_batch_size < 1:
            raise ValueError(f"reward_model.micro_batch_size_per_gpu={micro_batch_size} must be >= 1")
        self.device = device if device is not None else current_device()
        self.micro_batch_size = micro_batch_size
        self.use_remove_padding = use_remove_padding
        self.param_offload = param_offload
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
        self.head = getattr(self.model, "score", None)
        self.base = getattr(self.model, self.model.base_model_prefix, None)
        if not isinstance(self.head, torch.nn.Module) or self.base is None:
            raise ValueError(
                f"reward model {path!r} ({type(self.model).__name__}) has no `score` head over a decoder: hybridflow "
                "(like vLLM's pooling runner) scores decoder ForSequenceClassification models (Llama, Qwen2, Mistral, "
                "Gemma ...); convert the model, or score with a custom_reward_function"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad) if pad is not None else 0  # masked out and never pooled: any id will do
        self.model.to("cpu" if param_offload else self.device)
        self.forward_shapes: list[tuple[int, int]] = []  # [rows, width] of each forward of the last call

    @torch.inference_mode()
    def score(self, rows: list[list[int]], padded_width: int | None = None) -> torch.Tensor:
        """B token lists -> scores [B] float32 (on CPU).

        Rows go through in micro-batches of ``micro_batch_size``; with ``use_remove_padding`` they are grouped by
        length so each micro-batch is only as wide as its own longest row, otherwise every micro-batch is
        ``padded_width`` wide (the batch's columns; default: its longest row).
        """
        scores = torch.zeros(len(rows), dtype=torch.float32)
        if not rows:
            return scores
        order = sorted(range(len(rows)), key=lambda i: len(rows[i])) if self.use_remove_padding else list(
            range(len(rows)))
        width = max(max(len(r) for r in rows), padded_width or 0)
        self.forward_shapes = []
        if self.param_offload:
            self.model.to(self.device)
        try:
            for start in range(0, len(rows), self.micro_batch_size):
                idx = order[start : start + self.micro_batch_size]
                ids, mask, last = pad_rows([rows[i] for i in idx], self.pad_token_id)
                if not self.use_remove_padding and ids.shape[1] < width:  # the full padded width, as asked
                    extra = width - ids.shape[1]
                    ids = torch.nn.functional.pad(ids, (0, extra), value=self.pad_token_id)
                    mask = torch.nn.functional.pad(mask, (0, extra), value=0)
                self.forward_shapes.append(tuple(ids.shape))
                hidden = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
                pooled = hidden[torch.arange(len(idx), device=hidden.device), last.to(hidden.device)]
                scores[torch.tensor(idx)] = self.head(pooled)[:, 0].float().cpu()
        finally:
            if self.param_offload:  # back to host memory until the next call
                self.model.to("cpu")
        return scores

    def parameter_devices(self) -> set[str]:
        """Where the weights are now (``{"cpu"}`` between calls with param_offload)."""
        return {p.device.type for p in self.model.parameters()}
