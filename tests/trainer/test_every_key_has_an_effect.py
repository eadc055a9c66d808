"""Every key of `hybridflow train --print-config` does something, or is refused with a message that names it.

How it is checked, for each key K of the schema:
  * consumed: K is read by the code that *runs* (the driver, the workers, the engines, the reward manager), during
    one of a few short real runs (in-process backend, so the workers' reads are seen too) that together take every
    branch: GRPO with KL loss, entropy, DAPO filtering, overlong shaping, validation and checkpoints; PPO with a critic,
    a reward model, KL in the reward with the adaptive controller, several epochs. Reads made by validation, by the
    config dump into the tracker, or by `--print-config` do not count: a key only validated and dumped is ignored.
  * or refused: setting K to a non-default value fails validation with a message that names K (e.g. a feature
    hybridflow does not have, like actor_rollout_ref.actor.strategy=megatron).
A key that is neither (accepted, never read) fails the test with its name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path

import pytest
from e2e_helpers import tiny_run_overrides

from hybridflow.trainer import config as config_mod
from hybridflow.trainer import main as main_mod
from hybridflow.trainer.config import ConfigError, HybridFlowConfig, load_config

SECTION_CLASSES = [
    obj for obj in vars(config_mod).values() if isinstance(obj, type) and dataclasses.is_dataclass(obj)
]


class ReadRecorder:
    """Records (id(section object), field) for every field read of a config dataclass while `on`."""

    def __init__(self) -> None:
        self.reads: set[tuple[int, str]] = set()
        self.on = False
        self._saved: dict[type, typing.Any] = {}

    def install(self) -> None:
        recorder = self
        for cls in SECTION_CLASSES:
            fields = {f.name for f in dataclasses.fields(cls)}
            original = cls.__getattribute__

            def getattribute(obj, name, _fields=fields, _original=original):
                if recorder.on and name in _fields:
                    recorder.reads.add((id(obj), name))
                return _original(obj, name)

            self._saved[cls] = original
            cls.__getattribute__ = getattribute

    def uninstall(self) -> None:
        for cls, original in self._saved.items():
            cls.__getattribute__ = original

    @contextlib.contextmanager
    def paused(self):
        was, self.on = self.on, False
        try:
            yield
        finally:
            self.on = was


def dotted_reads(cfg: HybridFlowConfig, reads: set[tuple[int, str]]) -> set[str]:
    """Map recorded (object id, field) reads to dotted keys by walking this config object's tree."""
    paths: dict[int, str] = {}

    def walk(node, prefix):
        paths[id(node)] = prefix
        for f in dataclasses.fields(node):
            value = object.__getattribute__(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(cfg, "")
    return {paths[obj] + name for obj, name in reads if obj in paths}


def schema_keys(node_cls=HybridFlowConfig, prefix="") -> dict[str, typing.Any]:
    """dotted leaf key -> (annotation, default) for every leaf of the schema."""
    out = {}
    hints = typing.get_type_hints(node_cls)
    default = node_cls()
    for f in dataclasses.fields(node_cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            out.update(schema_keys(type(value), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (hints[f.name], value)
    return out


RUNS = {
    "grpo_kl_dapo": [
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.001", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.log=true", "data.gen_batch_size=6",
        "trainer.test_freq=1", "trainer.val_before_train=true",
        "trainer.save_freq=1", "trainer.log_samples_freq=1", "data.val_max_samples=8", "data.val_batch_size=8",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=sequence",
        "algorithm.rollout_correction.rollout_rs_threshold=4.0",
        "algorithm.rollout_correction.rollout_rs_threshold_lower=0.1",
        "algorithm.rollout_correction.rollout_is_batch_normalize=true",
        "algorithm.rollout_correction.rollout_token_veto_threshold=0.0001",
        "actor_rollout_ref.actor.entropy_checkpointing=true",
        "actor_rollout_ref.model.use_sequence_packing=true",
    ],
    "ppo_critic_rm": [
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "reward_model.enable=true", "REWARD_MODEL_PATH", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.recompute_old_log_prob=always",
        "critic.ppo_epochs=1", "critic.shuffle=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "critic.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.actor.optim.warmup_style=constant", "trainer.critic_warmup=1",
        "custom_reward_function.path=CUSTOM_REWARD_FILE", "custom_reward_function.name=exact",
        # veRL's profiler keys: step 2 traced on every role (trainer/profiling.py)
        "global_profiler.tool=torch", "global_profiler.steps=[2]", "global_profiler.profile_continuous_steps=true",
        "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.ref.profiler.enable=true",
        "critic.profiler.enable=true",
        # a SandboxFusion service for the code data sources (none in this data: the url is never called)
        "reward_model.sandbox_fusion.url=http://127.0.0.1:9/run_code", "reward_model.sandbox_fusion.max_concurrent=4",
        "reward_model.sandbox_fusion.memory_limit_mb=512",
        # actor, ref and native rollout round alike (engines/batch_invariant.py)
        "actor_rollout_ref.model.batch_invariant=true",
    ],
    # LoRA: the adapter keys, and the reference as the adapter-disabled actor
    "grpo_lora": [
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.model.lora_dropout=0.05", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.model.exclude_modules=[lm_head]", "actor_rollout_ref.actor.use_kl_loss=true",
        # veRL's PF-PPO resampling, the high-diff token dump and the /dev/shm model copy
        "algorithm.use_pf_ppo=true", "algorithm.pf_ppo.reweight_method=max_min", "trainer.dump_high_diff_tokens=true",
        "actor_rollout_ref.model.use_shm=true", "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
    ],
    # multi-turn episodes with a tool (veRL's rollout.multi_turn keys and the loop's limits)
    "grpo_multi_turn": [
        "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tools=[hybridflow.agents.builtin:calculator]",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "trainer.test_freq=1",
        "data.val_max_samples=4",
    ],
    # an epoch-counted run (no total_training_steps) on the Ray backend: the driver's Ray and placement keys
    "epochs_on_ray": [
        "trainer.backend=ray", "trainer.total_training_steps=null", "trainer.total_epochs=1",
        "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.rollout.n=2",
        "trainer.ray_address=auto",
    ],
}
CUSTOM_REWARD_FILE = str(Path(__file__).parent.parent / "rewards" / "custom_reward_fns.py")


@pytest.fixture(scope="module")
def consumed_keys(arithmetic_files, tiny_model_path, tmp_path_factory, ray_session) -> set[str]:
    recorder = ReadRecorder()
    original_to_dict = main_mod.to_dict

    def to_dict_unrecorded(cfg):
        with recorder.paused():
            return original_to_dict(cfg)

    consumed: set[str] = set()
    recorder.install()
    main_mod.to_dict = to_dict_unrecorded
    try:
        for name, extra in RUNS.items():
            run_dir = str(tmp_path_factory.mktemp(name))
            extra = [f"reward_model.model.path={tiny_model_path}" if e == "REWARD_MODEL_PATH" else e for e in extra]
            extra = [e.replace("CUSTOM_REWARD_FILE", CUSTOM_REWARD_FILE) for e in extra]
            cfg = load_config(tiny_run_overrides(arithmetic_files, tiny_model_path, run_dir, "trainer.backend=local",
                                                 *extra))
            recorder.reads.clear()
            recorder.on = True
            try:
                main_mod.run_training(cfg, progress=True)  # progress=True: trainer.progress_bar is then read
            finally:
                recorder.on = False
            consumed |= dotted_reads(cfg, recorder.reads)
    finally:
        recorder.uninstall()
        main_mod.to_dict = original_to_dict
    return consumed


def non_default_value(annotation, default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3 if default >= 0 else 5
    if isinstance(default, float):
        return default * 0.5 if default else 0.25
    if isinstance(default, str):
        return "not_a_real_value"
    if isinstance(default, list):
        return [7]
    if isinstance(default, dict):
        return {"not_a_real_option": 1}
    # default None: pick by the annotation
    text = str(annotation)
    if "bool" in text:
        return True
    if "int" in text:
        return 3
    if "float" in text:
        return 0.5
    return "not_a_real_value"


def refusal_names_key(key: str, value) -> bool:
    rendered = f"{key}={value}".replace("True", "true").replace("False", "false")
    try:
        load_config([rendered])
    except ConfigError as err:
        return key.split(".")[-1] in str(err)
    return False


def test_every_key_is_consumed_or_refused(consumed_keys):
    ignored = []
    for key, (annotation, default) in schema_keys().items():
        if key in consumed_keys:
            continue
        value = non_default_value(annotation, default)
        if not refusal_names_key(key, value):
            ignored.append(f"{key} (tried {value!r})")
    assert not ignored, "accepted but never read by a run, and not refused either:\n  " + "\n  ".join(ignored)


def test_the_recorder_sees_workers_reads(consumed_keys):
    """The check itself can fail: keys only workers read must be seen, and a never-read key must not be."""
    assert "actor_rollout_ref.actor.clip_ratio_c" in consumed_keys  # read by the actor objective on the worker
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu" in consumed_keys  # the log-prob pass sizes
    assert "critic.cliprange_value" in consumed_keys
    assert "actor_rollout_ref.actor.strategy" not in consumed_keys  # only validation reads it: it refuses megatron
