"""veRL's profiler keys with tool=torch: torch.profiler traces of the listed steps, per rank, per role; other tools
refused with the reason."""

from __future__ import annotations

import json
import os

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.main import run_training
from hybridflow.trainer.profiling import StepProfiler
from hybridflow.workers.profiling import chosen_rank


def test_listed_steps_are_traced_for_actor_and_critic(arithmetic_files, tiny_model_path, tmp_path):
    run_dir, prof = str(tmp_path / "run"), str(tmp_path / "prof")
    cfg = load_config(tiny_run_overrides(
        arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local", "trainer.total_training_steps=3",
        "algorithm.adv_estimator=gae", "global_profiler.tool=torch", "global_profiler.steps=[2,3]",
        "global_profiler.profile_continuous_steps=true", f"global_profiler.save_path={prof}",
        "actor_rollout_ref.actor.profiler.enable=true", "critic.profiler.enable=true"))
    run_training(cfg, progress=False)
    assert os.listdir(prof) == ["step_2-3"]  # steps 2 and 3 in one trace, step 1 not traced
    # one process holds actor and critic here (in-process backend): one profiler, named after both
    (trace,) = os.listdir(os.path.join(prof, "step_2-3"))
    assert trace == "actor_rollout+critic_rank0.json"  # the workers' roles
    events = json.load(open(os.path.join(prof, "step_2-3", trace)))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::" in n for n in names)  # real operator events were recorded


def test_one_trace_per_step_unless_continuous():
    cfg = load_config(["global_profiler.tool=torch", "global_profiler.steps=[1,2,4]",
                       "actor_rollout_ref.actor.profiler.enable=true"])
    prof = StepProfiler(cfg)
    assert [prof._span(s) for s in (1, 2, 4)] == [(1, 1), (2, 2), (4, 4)]
    cfg.global_profiler.profile_continuous_steps = True
    assert [StepProfiler(cfg)._span(s) for s in (1, 2, 4)] == [(1, 2), (1, 2), (4, 4)]
    assert StepProfiler(cfg).targets == [("actor_rollout", os.path.join(cfg.trainer.default_local_dir, "profile"))]


def test_ranks_are_chosen_as_veRL_chooses_them():
    section = load_config(["global_profiler.tool=torch", "global_profiler.steps=[1]",
                           "actor_rollout_ref.actor.profiler.enable=true", "trainer.n_gpus_per_node=4",
                           "actor_rollout_ref.actor.profiler.ranks=[1,3]"], validate=False).actor_rollout_ref.actor.profiler
    assert [chosen_rank(section, r) for r in range(4)] == [False, True, False, True]
    section.ranks = []
    assert [chosen_rank(section, r) for r in range(4)] == [True, False, False, False]
    section.all_ranks = True
    assert all(chosen_rank(section, r) for r in range(4))
    section.enable = False
    assert not any(chosen_rank(section, r) for r in range(4))


@pytest.mark.parametrize("overrides, match", [
    (["global_profiler.tool=nsys", "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=true"],
     r"global_profiler\.tool='nsys': Nsight Systems capture is not driven by hybridflow"),
    (["global_profiler.tool=npu"], r"global_profiler\.tool='npu': Ascend NPUs are not supported"),
    (["actor_rollout_ref.actor.profiler.tool=torch_memory"], r"profiler\.tool='torch_memory': CUDA memory snapshots"),
    (["global_profiler.tool=torch", "global_profiler.steps=[1]"], r"profiles the roles whose profiler\.enable=true"),
    (["actor_rollout_ref.actor.profiler.enable=true", "global_profiler.steps=[1]"], r"enable=true but no tool"),
    (["global_profiler.tool=torch", "critic.profiler.enable=true"], r"critic\.profiler\.enable=true but .*steps"),
    (["global_profiler.tool=torch", "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=true",
      "actor_rollout_ref.actor.profiler.ranks=[5]"], r"\[5\] not among the 1 ranks"),
    (["global_profiler.steps=[0]"], r"global_profiler\.steps=\[0\]: give global steps"),
    (["global_profiler.global_tool_config.nsys.discrete=true"], r"veRL's nsys / npu / torch_memory tool options"),
    (["critic.profiler.all_ranks=true"], r"critic\.profiler: all_ranks=True set but critic\.profiler\.enable is false"),
    (["global_profiler.profile_continuous_steps=true"], r"profile_continuous_steps=true but .*steps is empty"),
])
def test_bad_profiler_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides)
