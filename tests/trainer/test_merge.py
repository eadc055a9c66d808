"""`hybridflow merge`: checkpoints in veRL's FSDP layout (written here by real FSDP2 ranks, and as plain dim-0 shards)
become Hugging Face folders that give the original model's logits; shards are read tensor-only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.cli import main as cli
from hybridflow.trainer.checkpoint import CheckpointError
from hybridflow.trainer.merge import find_weights_dir, merge_checkpoint

WRITER = os.path.join(os.path.dirname(__file__), "write_verl_checkpoint.py")


def _logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def verl_run(tiny_model_path, tmp_path_factory) -> str:
    """A veRL run folder: global_step_3/actor written by two FSDP2 ranks (DTensor Shard(0) shards)."""
    run = tmp_path_factory.mktemp("verl_run")
    actor = run / "global_step_3" / "actor"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, WRITER, tiny_model_path, str(actor), "--world-size", "2"], check=True, env=env,
                   capture_output=True, timeout=300)
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    return str(run)


def test_merges_a_verl_fsdp2_checkpoint_to_the_original_logits(verl_run, tiny_model_path, tmp_path):
    actor = os.path.join(verl_run, "global_step_3", "actor")
    shard = torch.load(os.path.join(actor, "model_world_size_2_rank_1.pt"), weights_only=True)
    emb = shard["model.embed_tokens.weight"]
    assert type(emb).__name__ == "DTensor" and emb._local_tensor.shape[0] * 2 == emb.shape[0]  # really sharded

    out = str(tmp_path / "merged")
    assert cli(["merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", out]) == 0
    ids = torch.randint(5, 80, (3, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(out, ids), _logits(tiny_model_path, ids))
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    # global_step_N and the run folder (its newest step) name the same weights
    assert find_weights_dir(os.path.join(verl_run, "global_step_3")) == ("verl", actor)
    assert find_weights_dir(verl_run) == ("verl", actor)
    # `hybridflow export` reads it too
    assert cli(["export", os.path.join(verl_run, "global_step_3"), str(tmp_path / "exported")]) == 0
    assert torch.equal(_logits(str(tmp_path / "exported"), ids), _logits(out, ids))


def _plain_shards(model_path: str, out: str, world_size: int) -> dict[str, torch.Tensor]:
    """veRL's non-DTensor case: each rank holds a plain dim-0 chunk of every tensor."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    full = model.state_dict()
    os.makedirs(out, exist_ok=True)
    for r in range(world_size):
        torch.save({k: v.chunk(world_size, dim=0)[r].clone() if v.shape[0] >= world_size else v.clone()
                    for k, v in full.items() if v.shape[0] >= world_size},
                   os.path.join(out, f"model_world_size_{world_size}_rank_{r}.pt"))
    with open(os.path.join(out, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 1, "world_size": world_size}, f)
    model.config.save_pretrained(os.path.join(out, "huggingface"))
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_path).save_pretrained(os.path.join(out, "huggingface"))
    return full


def test_merges_plain_tensor_shards(tiny_model_path, tmp_path):
    ckpt = str(tmp_path / "global_step_1" / "actor")
    _plain_shards(tiny_model_path, ckpt, world_size=2)
    out = merge_checkpoint(ckpt, str(tmp_path / "out"), dtype="auto")
    ids = torch.randint(5, 80, (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(out, ids), _logits(tiny_model_path, ids))
    bf16 = merge_checkpoint(ckpt, str(tmp_path / "out_bf16"), dtype="bf16")  # veRL's merger's dtype, on request
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16


class NotATensor:  # a pickled object of a class: what a tensor-only load must refuse
    def __init__(self) -> None:
        self.x = 1


def test_bad_verl_checkpoints_are_named(tiny_model_path, tmp_path):
    ckpt = str(tmp_path / "ck")
    _plain_shards(tiny_model_path, ckpt, world_size=2)
    rank1 = os.path.join(ckpt, "model_world_size_2_rank_1.pt")
    saved = torch.load(rank1, weights_only=True)
    torch.save({**saved, "evil": NotATensor()}, rank1)
    with pytest.raises(CheckpointError, match=r"model_world_size_2_rank_1\.pt could not be read as tensors only"):
        merge_checkpoint(ckpt, str(tmp_path / "o1"))
    torch.save({**saved, "note": "text"}, rank1)
    with pytest.raises(CheckpointError, match=r"entries \['note'\] are not tensors"):
        merge_checkpoint(ckpt, str(tmp_path / "o2"))
    os.remove(rank1)
    with pytest.raises(CheckpointError, match=r"world_size=2 but \['model_world_size_2_rank_1\.pt'\] are missing"):
        merge_checkpoint(ckpt, str(tmp_path / "o3"))
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        merge_checkpoint(str(tmp_path), str(tmp_path / "o4"))
    assert cli(["merge", "--backend", "megatron", "--local_dir", ckpt, "--target_dir", str(tmp_path / "o5")]) == 2
