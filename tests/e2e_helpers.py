"""Shared test helpers: overrides for small end-to-end RL runs on the arithmetic task, rollout-layout batches."""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto


def tiny_run_overrides(files: tuple[str, str], model_path: str, run_dir: str, *extra: str) -> list[str]:
    train, val = files
    return [
        f"data.train_files={train}", f"data.val_files={val}", f"actor_rollout_ref.model.path={model_path}",
        "data.train_batch_size=4", "data.max_prompt_length=32", "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-3",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=0",
        "trainer.logger=[jsonl]", "trainer.progress_bar=false", "reward_model.num_workers=1",
        "trainer.num_threads_per_worker=1", *extra,
    ]


def make_batch(rows: int, prompt_len: int, response_len: int, seed: int, vocab: int = 250) -> DataProto:
    """Rollout-layout rows: left-padded prompts (2..P tokens), right-padded responses whose lengths vary 4x."""
    g = torch.Generator().manual_seed(seed)
    seq = prompt_len + response_len
    input_ids = torch.randint(4, vocab, (rows, seq), generator=g)
    attention_mask = torch.zeros(rows, seq, dtype=torch.long)
    prompt_lens = torch.randint(2, prompt_len + 1, (rows,), generator=g)
    resp_lens = torch.randint(max(1, response_len // 4), response_len + 1, (rows,), generator=g)
    resp_lens[0] = response_len  # R is the longest response, as the rollout makes it
    for i in range(rows):
        attention_mask[i, prompt_len - prompt_lens[i] : prompt_len + resp_lens[i]] = 1
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, prompt_len:]
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": input_ids[:, prompt_len:],
            "response_mask": response_mask,
            "advantages": torch.randn(rows, response_len, generator=g) * response_mask,
            "returns": torch.randn(rows, response_len, generator=g) * response_mask,
        },
        meta_info={"temperature": 0.7, "calculate_entropy": True},
    )
