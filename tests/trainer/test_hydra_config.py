"""veRL's `--config-path DIR --config-name NAME`: the YAML composed as Hydra does (defaults list, packages, _self_,
override, ${...} interpolations), its keys then taken / renamed / refused like command-line overrides."""

from __future__ import annotations

import textwrap

import pytest

from hybridflow.cli import main
from hybridflow.trainer.config import ConfigError, load_config
from hybridflow.trainer.hydra_config import split_hydra_flags, with_config_file


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def config_dir(tmp_path):
    """A user's config folder as veRL's examples lay them out: a primary config on top of veRL's ppo_trainer."""
    d = tmp_path / "config"
    write(d / "my_grpo.yaml", """\
        hydra:
          searchpath:
            - file://verl/trainer/config
        defaults:
          - ppo_trainer
          - algo@algorithm: gae
          - override algo: grpo
          - sizes
          - _self_
        data:
          max_prompt_length: 24
          train_batch_size: 8
        actor_rollout_ref:
          actor:
            ppo_mini_batch_size: ${data.train_batch_size}
            optim:
              lr: 3e-6
          rollout:
            n: ${algorithm.group_size}
        algorithm:
          group_size: 4
    """)
    write(d / "algo" / "grpo.yaml", "adv_estimator: grpo\nnorm_adv_by_std_in_grpo: false\n")
    write(d / "algo" / "gae.yaml", "adv_estimator: gae\n")
    write(d / "sizes.yaml", "data:\n  max_prompt_length: 99\n  max_response_length: 12\n")  # before _self_: loses
    return d


def test_defaults_list_packages_override_self_and_interpolations(config_dir):
    overrides = with_config_file(str(config_dir), "my_grpo", ["data.max_response_length=10"])
    assert "algorithm.adv_estimator=grpo" in overrides and "algorithm.norm_adv_by_std_in_grpo=false" in overrides
    assert "data.max_prompt_length=24" in overrides and "data.max_prompt_length=99" not in overrides
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=8" in overrides  # ${data.train_batch_size}
    assert "actor_rollout_ref.actor.optim.lr=3.0e-06" in overrides  # a float the override parser reads back
    assert overrides[-1] == "data.max_response_length=10"  # the command line comes last: it wins


def test_unknown_keys_in_a_file_are_errors_like_on_the_command_line(config_dir):
    overrides = with_config_file(str(config_dir), "my_grpo", [])
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.group_size'"):
        load_config(overrides)


def test_a_config_file_run_validates(config_dir):
    (config_dir / "my_grpo.yaml").write_text((config_dir / "my_grpo.yaml").read_text().replace(
        "n: ${algorithm.group_size}", "n: 4").replace("algorithm:\n  group_size: 4\n", ""))
    cfg = load_config(with_config_file(str(config_dir), "my_grpo", ["data.max_response_length=10"]))
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6) and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.max_prompt_length == 24 and cfg.data.max_response_length == 10
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False


def test_refused_keys_in_a_file_are_named_with_their_reason(tmp_path):
    write(tmp_path / "mega.yaml", "actor_rollout_ref:\n  actor:\n    megatron:\n      tensor_model_parallel_size: 2\n")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron.tensor_model_parallel_size: Megatron"):
        load_config(with_config_file(str(tmp_path), "mega", []))


@pytest.mark.parametrize("name, match", [
    ("ppo_megatron_trainer", r"Megatron-LM training is not supported"),
    ("nothing_here", r"config 'nothing_here' not found \(looked for nothing_here.yaml in .*\)"),
    ("sft_trainer", r"veRL's sft config; it does not start a `hybridflow train` run"),
])
def test_missing_and_refused_config_names(tmp_path, name, match):
    with pytest.raises(ConfigError, match=match):
        with_config_file(str(tmp_path), name, [])


def test_verl_base_config_alone_is_hybridflows_defaults():
    assert with_config_file(None, "ppo_trainer", ["data.train_batch_size=8"]) == ["data.train_batch_size=8"]
    # veRL's `--config-path=config` means its own package folder (relative to main_ppo.py), absent here
    assert with_config_file("config", "ppo_trainer.yaml", []) == []
    with pytest.raises(ConfigError, match=r"--config-path config: no such directory"):
        with_config_file("config", "my_own", [])
    with pytest.raises(ConfigError, match="needs --config-name"):
        with_config_file("somewhere", None, [])


def test_bad_defaults_entries_name_the_file(tmp_path):
    write(tmp_path / "bad.yaml", "defaults:\n  - wrong group: x\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: defaults entry .*only 'optional' and 'override'"):
        with_config_file(str(tmp_path), "bad", [])
    write(tmp_path / "loop.yaml", "defaults:\n  - loop\n")
    with pytest.raises(ConfigError, match="includes itself"):
        with_config_file(str(tmp_path), "loop", [])
    write(tmp_path / "interp.yaml", "data:\n  train_batch_size: ${nowhere.key}\n")
    with pytest.raises(ConfigError, match=r"interp.yaml: data.train_batch_size"):
        with_config_file(str(tmp_path), "interp", [])


def test_flags_both_spellings_among_the_overrides():
    assert split_hydra_flags(["a=1", "--config-path=cfg", "b=2", "--config-name", "x", "c=3"]) == (
        "cfg", "x", ["a=1", "b=2", "c=3"])
    assert split_hydra_flags(["-cp", "d", "-cn=y"]) == ("d", "y", [])


def test_cli_dry_run_takes_the_verl_flags(config_dir, capsys):
    (config_dir / "my_grpo.yaml").write_text((config_dir / "my_grpo.yaml").read_text().replace(
        "n: ${algorithm.group_size}", "n: 4").replace("algorithm:\n  group_size: 4\n", ""))
    rc = main(["train", "--dry-run", f"--config-path={config_dir}", "--config-name=my_grpo",
               "data.max_response_length=10"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "- data.train_batch_size" in out and "the configuration is valid" in out
    rc = main(["train", "--dry-run", "--config-path", str(config_dir), "--config-name", "missing"])
    assert rc == 2 and "config 'missing' not found" in capsys.readouterr().err


def test_sft_starts_from_sft_trainer(tmp_path):
    write(tmp_path / "my_sft.yaml", "defaults:\n  - sft_trainer\n  - _self_\ndata:\n  max_length: 64\n")
    assert with_config_file(str(tmp_path), "my_sft", [], "sft") == ["data.max_length=64"]
