"""`hybridflow export`: a checkpoint's weight shards become a Hugging Face model with the trained actor's log-probs."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from e2e_helpers import tiny_run_overrides

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.protocol import DataProto
from hybridflow.trainer.config import load_config
from hybridflow.trainer.main import run_training


def _batch(tokenizer, n: int = 4) -> DataProto:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, 90, (n, 6), generator=g)
    responses = torch.randint(5, 90, (n, 5), generator=g)
    ids = torch.cat([prompts, responses], 1)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": ids, "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1), "response_mask": torch.ones_like(responses, dtype=torch.float32),
    })


def test_exported_model_has_the_trained_actors_log_probs(arithmetic_files, tiny_model_path, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                                         "trainer.save_freq=2"))
    run_training(cfg, progress=False)
    ckpt = os.path.join(run_dir, "global_step_2")
    out = str(tmp_path / "exported")
    subprocess.run([sys.executable, "-m", "hybridflow", "export", ckpt, out], check=True, capture_output=True)

    actor = FSDPEngine(EngineConfig(model_path=tiny_model_path, role="actor"))
    actor.load_checkpoint(os.path.join(ckpt, "actor"))
    batch = _batch(actor.tokenizer)
    expected = actor.compute_log_prob(batch, temperature=1.0)["log_probs"]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"]).logits
    resp_logits = logits[:, batch.batch["prompts"].shape[1] - 1 : -1].float()
    got = torch.log_softmax(resp_logits, -1).gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)  # it was trained

    # veRL's habit: the actor/ folder itself; and the veRL-shaped merge command on the same checkpoint
    from safetensors.torch import load_file

    from hybridflow.cli import main as cli

    assert cli(["export", os.path.join(ckpt, "actor"), str(tmp_path / "from_actor")]) == 0
    assert cli(["merge", "--backend", "fsdp", "--local_dir", os.path.join(ckpt, "actor"),
                "--target_dir", str(tmp_path / "merged")]) == 0
    reference = load_file(os.path.join(out, "model.safetensors"))
    for other in ("from_actor", "merged"):
        weights = load_file(str(tmp_path / other / "model.safetensors"))
        assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)

    # every weights file written gets the umask's mode, like the config beside it (safetensors alone writes 0600)
    from hybridflow.common.files import process_umask

    mode = 0o666 & ~process_umask()
    written = [os.path.join(out, "model.safetensors"), os.path.join(ckpt, "actor", "model_rank0.safetensors"),
               *(str(tmp_path / other / "model.safetensors") for other in ("from_actor", "merged"))]
    assert {w: oct(os.stat(w).st_mode & 0o777) for w in written} == {w: oct(mode) for w in written}
    assert os.stat(os.path.join(out, "config.json")).st_mode & 0o777 == mode
