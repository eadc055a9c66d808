"""SFTDataset's single-turn rows: the ids it keeps are the chat-templated prompt's and the response's plus eos, as
tokenizing each row on its own gives them (the dataset tokenizes all rows in one call), truncation included."""

from __future__ import annotations

import json

from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.engines.tiny import build_char_tokenizer


def test_rows_tokenized_together_equal_rows_tokenized_one_by_one(tmp_path):
    tokenizer = build_char_tokenizer()
    prompts = ["What is 2 + 3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
               "x" * 40]
    responses = ["5", "Hello there", "y" * 40]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in zip(prompts, responses)))
    ds = SFTDataset(str(path), tokenizer, max_length=64)
    assert len(ds) == 3 and ds.num_truncated == 1  # the third row: 40 + 40 characters and the template's
    for (prompt_ids, response_ids, mask), prompt, response in zip(ds.examples, prompts, responses):
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        want_prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        want_response = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert prompt_ids == want_prompt and mask is None
        assert response_ids == want_response[: max(1, 64 - len(want_prompt))]
