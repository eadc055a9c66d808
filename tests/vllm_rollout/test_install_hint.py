"""Without vLLM, importing the adapter fails with an ImportError that says how to install it."""

from __future__ import annotations

import subprocess
import sys

HIDE_VLLM_AND_IMPORT = """
import sys
sys.modules["vllm"] = None  # what an environment without vLLM looks like to importlib
try:
    import hybridflow.engines.rollout.vllm_rollout
except ImportError as e:
    print("ImportError:", e)
else:
    print("imported")
"""


def test_import_without_vllm_names_the_install_command():
    out = subprocess.run([sys.executable, "-c", HIDE_VLLM_AND_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout
    assert "bash scripts/setup_vllm_env.sh" in out.stdout and "hybridflow[vllm]" in out.stdout


def test_verl_switches_reach_vllm():
    """The vllm engine reads veRL's rollout switches itself (validation asks it, not a list kept elsewhere)."""
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs
    from hybridflow.trainer.config import load_config

    rollout = load_config([
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=False",
        "actor_rollout_ref.rollout.free_cache_engine=True", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    ]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(rollout) == {"enforce_eager": False, "gpu_memory_utilization": 0.6,
                                              "enable_sleep_mode": True}


def test_free_cache_engine_on_cpu_is_refused_before_the_run_and_by_the_engine(model_path):
    """veRL's scripts set free_cache_engine=True for vLLM's sleep mode, which vLLM runs on GPUs only: on CPU the
    start-up checks name the key (before: vLLM's pydantic error, which Ray could not send: "cannot pickle
    'ArgsKwargs'")."""
    import pytest

    from hybridflow.engines.rollout.vllm_rollout import VLLMRollout
    from hybridflow.engines.vllm_classes import CPU_SLEEP_MODE
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.preflight import preflight_errors

    base = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=2", "trainer.device=cpu"]
    on = load_config([*base, "actor_rollout_ref.rollout.free_cache_engine=True"])
    assert preflight_errors(on) == [CPU_SLEEP_MODE]
    assert preflight_errors(load_config([*base, "actor_rollout_ref.rollout.free_cache_engine=False"])) == []
    with pytest.raises(ValueError, match="free_cache_engine=true asks vLLM for its sleep mode"):
        VLLMRollout(model_path, dtype="fp32", enable_sleep_mode=True)


def test_tensor_parallel_size_reaches_vllm():
    """rollout.tensor_model_parallel_size becomes vLLM's tensor_parallel_size, on the workers' own torch.distributed
    world (every TP rank runs the engine in its worker process: vLLM's external launcher)."""
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs
    from hybridflow.trainer.config import load_config

    rollout = load_config(["actor_rollout_ref.rollout.name=vllm", "trainer.n_gpus_per_node=2",
                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(rollout) == {"tensor_parallel_size": 2,
                                              "distributed_executor_backend": "external_launcher"}


def test_verl_vllm_knobs_reach_vllm():
    """rollout.quantization and enable_prefix_caching become vllm.LLM's own arguments (engine_kwargs.vllm.* still win);
    unset, vLLM keeps hybridflow's defaults (prefix caching on)."""
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs
    from hybridflow.trainer.config import load_config

    rollout = load_config([
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization=fp8",
        "actor_rollout_ref.rollout.enable_prefix_caching=false",
    ]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(rollout) == {"quantization": "fp8", "enable_prefix_caching": False}
    explicit = load_config(["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization=fp8",
                            "+actor_rollout_ref.rollout.engine_kwargs.vllm.quantization=awq"]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(explicit) == {"quantization": "awq"}
    assert rollout_engine_kwargs(load_config(["actor_rollout_ref.rollout.name=vllm"]).actor_rollout_ref.rollout) == {}
