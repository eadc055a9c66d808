"""The registries: listing, lookup errors that help, registering a new algorithm."""

from __future__ import annotations

import pytest
import torch

from hybridflow.algorithms import (
    AdvantageEstimator,
    available_advantage_estimators,
    available_policy_losses,
    get_advantage_estimator,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from hybridflow.algorithms.registry import ADVANTAGE_ESTIMATORS


def test_builtin_names_are_listed():
    assert available_advantage_estimators() == sorted(
        ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
    )
    assert set(available_policy_losses()) >= {"ppo", "gspo", "cispo", "reinforce"}


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grp0'.*dr_grpo, gae, grpo"):
        get_advantage_estimator("grp0")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*cispo, gspo, ppo, reinforce"):
        get_policy_loss("ppo2")


@pytest.fixture
def throwaway_name():
    name = "test_only_constant"
    yield name
    ADVANTAGE_ESTIMATORS.remove(name)  # leave the registry as other tests expect it


def test_register_a_new_estimator_and_refuse_duplicates(throwaway_name):
    @register_advantage(throwaway_name, needs_group_index=True)
    def constant(token_level_rewards, response_mask, *, index=None, **_):
        """Advantage 1 on every valid token."""
        adv = response_mask.to(token_level_rewards.dtype)
        return adv, adv

    assert isinstance(constant, AdvantageEstimator) and constant.needs_group_index
    assert throwaway_name in available_advantage_estimators()
    est = get_advantage_estimator(throwaway_name)
    adv, _ = est(torch.zeros(1, 2), torch.tensor([[1, 0]]), gamma=0.9, values=None)  # unused kwargs are ignored
    assert adv.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("gae")(lambda *a, **k: None)
    register_advantage(throwaway_name, override=True)(constant.fn)  # replacing is explicit


def test_policy_loss_metadata():
    gspo = get_policy_loss("gspo")
    assert gspo.recommended["clip_ratio_low"] == 3e-4 and gspo.recommended["clip_ratio_high"] == 4e-4
    assert dict(get_policy_loss("ppo").recommended) == {}
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo")(lambda *a, **k: None)


def test_an_import_path_resolves_to_a_plugin(tmp_path, monkeypatch):
    """A name of the form 'package.module:attr' (or 'file.py:attr') is imported by whichever process looks it up."""
    (tmp_path / "my_plugin_adv.py").write_text(
        "def half(token_level_rewards, response_mask, **_):\n"
        "    adv = 0.5 * response_mask.to(token_level_rewards.dtype)\n"
        "    return adv, adv\n"
        "half.needs_group_index = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        est = get_advantage_estimator("my_plugin_adv:half")
        assert isinstance(est, AdvantageEstimator) and est.needs_group_index
        assert est(torch.zeros(1, 2), torch.tensor([[1, 1]]))[0].tolist() == [[0.5, 0.5]]
        by_file = get_advantage_estimator(f"{tmp_path}/my_plugin_adv.py:half")
        assert by_file(torch.zeros(1, 1), torch.tensor([[1]]))[0].tolist() == [[0.5]]
        with pytest.raises(ValueError, match=r"has no attribute 'missing'.*half"):
            get_advantage_estimator("my_plugin_adv:missing")
        with pytest.raises(ValueError, match=r"could not be imported.*PYTHONPATH"):
            get_policy_loss("no_such_module_xyz:loss")
    finally:
        for name in ("my_plugin_adv:half", f"{tmp_path}/my_plugin_adv.py:half"):
            if name in ADVANTAGE_ESTIMATORS:
                ADVANTAGE_ESTIMATORS.remove(name)
