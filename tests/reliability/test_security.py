"""Loading a checkpoint never unpickles arbitrary objects, and Ray starts without its dashboard.

The reward sandbox (time, memory, network, processes, scratch directory) is tested in tests/rewards/test_reward_sandbox.py.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from hybridflow.engines.fsdp_engine import EngineConfig, FSDPEngine
from hybridflow.workers.rank_state import load_rank_state, save_rank_state


class Payload:
    """Unpickling this creates a folder: a harmless stand-in for code a malicious checkpoint would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_engine_checkpoint_is_safetensors_plus_weights_only_state(tiny_model_path, tmp_path):
    engine = FSDPEngine(EngineConfig(model_path=tiny_model_path))
    directory = str(tmp_path / "actor")
    engine.save_checkpoint(directory)
    assert sorted(os.listdir(directory)) == ["meta.json", "model_rank0.safetensors", "optim_rank0.pt"]
    optim = os.path.join(directory, "optim_rank0.pt")
    marker = str(tmp_path / "code_ran")
    state = torch.load(optim, weights_only=True)
    state["extra"]["payload"] = Payload(marker)
    torch.save(state, optim)
    with pytest.raises(Exception, match="Weights only load failed"):
        FSDPEngine(EngineConfig(model_path=tiny_model_path)).load_checkpoint(directory)
    assert not os.path.exists(marker), "loading a checkpoint ran code from it"


def test_rank_state_is_json(tmp_path):
    path = str(tmp_path / "rank_state_0.json")
    save_rank_state(path)
    with open(path) as f:
        assert set(json.load(f)) == {"python", "numpy", "torch"}
    load_rank_state(path)
    import pickle

    marker = str(tmp_path / "code_ran")
    with open(path, "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(ValueError):  # not JSON: refused, nothing unpickled
        load_rank_state(path)
    assert not os.path.exists(marker)


def test_ray_starts_without_the_dashboard():
    """A static check (starting a second Ray cluster here would cost ~20 s): every ray.init in the trainers turns
    the dashboard off."""
    from hybridflow.trainer import main, sft_trainer

    for source in (inspect.getsource(main._init_ray), inspect.getsource(sft_trainer)):
        calls = source.count("ray.init(") + source.count("start_local_ray(")
        assert calls and source.count("include_dashboard=False") == calls
