"""Configuration: veRL key names, clear errors before any worker starts, and example scripts that stay valid."""

from __future__ import annotations

import glob
import os
import shlex
import subprocess
import sys

import pytest

from hybridflow.trainer.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_verl_key_names_are_accepted():
    cfg = load_config([
        "data.train_files=a.parquet", "actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.optim.lr=3e-6",
        "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=rloo", "trainer.total_training_steps=7",
        "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    ])
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.trainer.total_training_steps == 7


def test_verl_rollout_engine_switches_reach_the_engine():
    from hybridflow.engines.rollout.registry import rollout_engine_kwargs

    base = ["actor_rollout_ref.rollout.enforce_eager=False", "actor_rollout_ref.rollout.free_cache_engine=True"]
    native = load_config(base).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(native) == {"decode": "graph", "free_cache_engine": True}
    # vllm's switches: tests/vllm_rollout/test_install_hint.py (run in the vLLM virtualenv)
    assert rollout_engine_kwargs(load_config(["actor_rollout_ref.rollout.name=hf"]).actor_rollout_ref.rollout) == {}
    eager = load_config(["actor_rollout_ref.rollout.enforce_eager=True"]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(eager) == {"decode": "eager"}
    assert rollout_engine_kwargs(load_config([]).actor_rollout_ref.rollout) == {}  # unset: the engine's defaults
    explicit = load_config(["actor_rollout_ref.rollout.enforce_eager=True",
                            "+actor_rollout_ref.rollout.engine_kwargs.decode=static"]).actor_rollout_ref.rollout
    assert rollout_engine_kwargs(explicit) == {"decode": "static"}  # engine_kwargs win
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"])


def test_each_rollout_engine_rejects_what_it_cannot_honour():
    """The engine answers for its own options: a switch or an engine_kwargs key it does not read is an error."""
    for overrides, match in [
        (["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"], r"gpu_memory_utilization has no effect.*native"),
        (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.enforce_eager=true"],
         r"enforce_eager has no effect.*name=hf"),
        (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=int8"], r"dtype='int8'.*\['fp32', 'bf16'\]"),
        (["+actor_rollout_ref.rollout.engine_kwargs.decod=eager"], r"engine_kwargs\.decod: .*options: .*'decode'"),
        (["actor_rollout_ref.rollout.name=sglang"], r"rollout.name='sglang'.*known: .*hf, .*native"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(overrides)


def test_misspelled_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError) as e:
        load_config(["actor_rollout_ref.rollout.temprature=0.7"])
    assert "actor_rollout_ref.rollout.temperature" in str(e.value)


def test_wrong_value_type_is_reported():
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        load_config(["actor_rollout_ref.rollout.n=many"])
    # an unset shell variable in a veRL script (`use_kl_loss=${use_kl_loss}`): one line naming the key and the fix
    with pytest.raises(ConfigError) as e:
        load_config(["actor_rollout_ref.actor.use_kl_loss="])
    assert str(e.value).startswith("invalid config value for actor_rollout_ref.actor.use_kl_loss: Value '' is not a "
                                   "valid bool") and "\n" not in str(e.value) and "--print-config" in str(e.value)


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        load_config(["algorithm.adv_estimator=grpoo"])
    assert "grpo" in str(e.value) and "rloo" in str(e.value)


def test_impossible_batch_sizes_say_which_numbers_to_change():
    with pytest.raises(ConfigError) as e:
        load_config(["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert "data.train_batch_size=10" in str(e.value) and "ppo_mini_batch_size=4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                     "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=2"])
    assert "does not split evenly over 2 ranks" in str(e.value)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["actor_rollout_ref.rollout.n"])


def test_cli_misspelled_override_fails_before_any_worker_starts():
    out = subprocess.run([sys.executable, "-m", "hybridflow", "train", "trainer.total_trainig_steps=3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "trainer.total_training_steps" in out.stderr
    assert "ray" not in out.stderr.lower()  # no cluster was started


def test_hydra_dict_values_and_deletions():
    """Hydra's `{a:1}` is a dict (YAML alone reads the key 'a:1'); `~key` drops a free-form dict's entry (a preset's)
    or sets a key back to its default."""
    env = "actor_rollout_ref.rollout.multi_turn.environment_kwargs"
    cfg = load_config([f"{env}={{bonus:0.5,nested:{{url:http://h:8}},'k:1':2}}"], validate=False)
    assert cfg.actor_rollout_ref.rollout.multi_turn.environment_kwargs == {
        "bonus": 0.5, "nested": {"url": "http://h:8"}, "k:1": 2}
    cfg = load_config([f"{env}={{a:1,b:2}}", f"~{env}.a", "actor_rollout_ref.rollout.n=5",
                       "~actor_rollout_ref.rollout.n"], validate=False)
    assert cfg.actor_rollout_ref.rollout.multi_turn.environment_kwargs == {"b": 2}
    assert cfg.actor_rollout_ref.rollout.n == load_config([], validate=False).actor_rollout_ref.rollout.n
    cfg = load_config([f"{env}={{a:1}}", f"~{env}", f"+{env}={{c:3}}"], validate=False)  # replace a dict
    assert cfg.actor_rollout_ref.rollout.multi_turn.environment_kwargs == {"c": 3}
    with pytest.raises(ConfigError, match=r"~actor_rollout_ref.rollout.multi_turn.environment_kwargs.zz: there is no"):
        load_config([f"~{env}.zz"], validate=False)
    # kwargs the environment's constructor does not take are named at load, not in every episode after start
    with pytest.raises(ConfigError, match=r"GuessNumberEnv\(turn_penalty.*does not take them .*'turn_penaltyy'"):
        load_config(["data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                     "actor_rollout_ref.rollout.multi_turn.environment=guess_number", f"{env}={{turn_penaltyy:0.1}}"])


def test_zero_ranks_is_one_message_and_a_missing_checkpoint_to_export_is_exit_2(tmp_path, capsys):
    from hybridflow.cli import main

    with pytest.raises(ConfigError) as e:
        load_config(["trainer.n_gpus_per_node=0"])
    assert str(e.value).count("\n  - ") == 1 and "trainer.n_gpus_per_node=0 must be >= 1" in str(e.value)
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "hybridflow export: " in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_cli_takes_overrides_on_both_sides_of_a_flag(capsys):
    """`bash examples/X.sh --dry-run key=value`: the script's own overrides, then "$@" with a flag first."""
    from hybridflow.cli import main

    assert main(["train", "trainer.total_training_steps=2", "--dry-run", "actor_rollout_ref.rollout.n=3",
                 "--print-config", "data.train_batch_size=12"]) == 0
    printed = capsys.readouterr().out
    assert "total_training_steps: 2" in printed and "n: 3" in printed and "train_batch_size: 12" in printed
    with pytest.raises(SystemExit):
        main(["train", "trainer.total_training_steps=2", "--no-such-flag"])


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(REPO, "examples", "*.sh"))), ids=os.path.basename)
def test_example_scripts_hold_valid_overrides(script):
    text = open(script).read()
    args = shlex.split(text.split("hybridflow train", 1)[1].replace("\\\n", " ").split('"$@"')[0])
    preset = None
    if args[:1] == ["--config"]:  # a preset file of hybridflow/config (the agent tasks' scripts)
        preset, args = os.path.join(REPO, args[1]), args[2:]
    cfg = load_config(args, preset=preset)
    assert cfg.trainer.experiment_name == os.path.basename(script)[:-3]
