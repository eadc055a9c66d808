"""`hybridflow train`: build data, rewards and worker groups from the config, run the RL loop, survive worker deaths."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from hybridflow.trainer.config import ConfigError, HybridFlowConfig, check_resources, load_config, to_dict

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: str
    global_step: int
    last_metrics: dict[str, float]
    initial_val: dict[str, float]
    restarts: int
    max_restarts: int = 0


def resolve_defaults(cfg: HybridFlowConfig) -> HybridFlowConfig:
    """Fill what the user left empty: the built-in task's data and base model, the critic switch, step counts."""
    from hybridflow.algorithms import get_advantage_estimator
    from hybridflow.data.builtin import builtin_base_model_path, ensure_builtin_task_files
    from hybridflow.engines.checkpoint_io import check_safetensors_files

    if cfg.data.train_files is None or cfg.data.val_files is None:
        train, val = ensure_builtin_task_files()
        cfg.data.train_files = cfg.data.train_files or train
        cfg.data.val_files = cfg.data.val_files or val
    if cfg.actor_rollout_ref.model.path is None:
        cfg.actor_rollout_ref.model.path = builtin_base_model_path()
    path = os.path.expanduser(cfg.actor_rollout_ref.model.path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path!r} is not a folder; point it at a "
            "Hugging Face model folder (config.json + weights + tokenizer), e.g. one written by "
            "`hybridflow make-tiny-model DIR`"
        )
    cfg.actor_rollout_ref.model.path = path
    check_safetensors_files(path, "actor_rollout_ref.model.path")  # a cut-off weights file fails here, named
    if cfg.trainer.resume_mode == "resume_path":  # veRL's spelling of "resume from this checkpoint"
        cfg.trainer.resume_mode = cfg.trainer.resume_from_path
    if cfg.trainer.device == "auto":
        from hybridflow.device import device_name

        cfg.trainer.device = device_name()
    if cfg.critic.enable is None:
        cfg.critic.enable = bool(getattr(get_advantage_estimator(cfg.algorithm.adv_estimator), "needs_critic", False))
    return cfg


def local_cpu_slots(cfg: HybridFlowConfig, roles_per_rank: int) -> int:
    """The logical CPUs a cluster started for this run needs: one per rank and role, plus one per process of the
    rollout group when it is a group of its own (hybrid_engine=false), which placement puts on a pool of its own."""
    slots = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node * roles_per_rank
    if not cfg.actor_rollout_ref.hybrid_engine:
        slots += cfg.actor_rollout_ref.rollout.nnodes * cfg.actor_rollout_ref.rollout.n_gpus_per_node
    return slots


def _init_ray(cfg: HybridFlowConfig, roles_per_rank: int) -> None:
    import ray

    from hybridflow.single_controller.local_ray import start_local_ray

    if ray.is_initialized():
        if cfg.trainer.ray_address:
            logger.warning("trainer.ray_address=%s is ignored: Ray is already initialized in this process, and the "
                           "run uses that cluster", cfg.trainer.ray_address)
        return
    if cfg.trainer.ray_address:
        ray.init(address=cfg.trainer.ray_address, include_dashboard=False)
        return
    slots = local_cpu_slots(cfg, roles_per_rank)
    # Ray starts workers at niceness 15; ours do the compute, so at that priority any other process on the machine
    # (even the reward scorers) would take their cores. The raylet reads this when it starts.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Logical CPUs: one per rank and role, so colocated and split placements both fit on a small machine.
    # A cluster started here serves this run only: its servers listen on loopback (see local_ray.py).
    start_local_ray(
        num_cpus=max(os.cpu_count() or 1, slots),
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
    )


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the input is wrong" (config, data, checkpoint, reward file, plugin): the CLI prints their
    message and exits with 2 instead of a traceback."""
    from hybridflow.data.schema import DataConfigError
    from hybridflow.plugins import PluginError
    from hybridflow.rewards.registry import RewardConfigError
    from hybridflow.trainer.checkpoint import CheckpointError
    from hybridflow.trainer.run_dir import RunDirError
    from hybridflow.trainer.tracking import TrackingConfigError

    return (ConfigError, DataConfigError, CheckpointError, RewardConfigError, TrackingConfigError, PluginError,
            RunDirError)


def build_datasets(cfg: HybridFlowConfig, tokenizer):
    """(train loader, validation loader or None) from the data section; DataConfigError names file/row/column.

    Each loader's dataset is ``loader.dataset`` (with its filtered / duplicate counts, ``count_metrics()``)."""
    from hybridflow.data import RLDataLoader, RLDataset

    d = cfg.data
    ds_kwargs = dict(
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong_prompts=d.filter_overlong_prompts,
        num_workers=d.filter_overlong_prompts_workers,
        apply_chat_template_kwargs=dict(d.apply_chat_template_kwargs) or None,
    )

    raw_chat = d.return_raw_chat or cfg.actor_rollout_ref.rollout.multi_turn.enable

    def dataset(files, name):
        if d.custom_cls.path:  # veRL's data.custom_cls: the user's dataset class supplies the prompts
            from hybridflow.data.custom_dataset import CustomClassDataset, load_dataset_class

            cls = load_dataset_class(d.custom_cls.path, d.custom_cls.name)
            return CustomClassDataset(cls, files, tokenizer, d, name=name, require_raw_chat=raw_chat)
        return RLDataset(files, tokenizer, name=name, **ds_kwargs)

    train_ds = dataset(d.train_files, "train")
    from hybridflow.trainer.dynamic_sampling import gen_batch_size

    # one loader batch = one generation batch (data.gen_batch_size; DAPO's dynamic sampling may take several a step)
    from hybridflow.trainer.reward_loop import reward_model_rerenders

    # a reward model with a tokenizer of its own re-renders each conversation: the chat messages must ride along
    raw_chat = d.return_raw_chat or reward_model_rerenders(cfg)
    train_loader = RLDataLoader(train_ds, gen_batch_size(cfg), shuffle=d.shuffle, seed=d.seed, drop_last=True,
                                return_raw_chat=raw_chat)
    val_loader = None
    if d.val_files:
        val_ds = dataset(d.val_files, "val")
        if d.val_max_samples > 0:
            val_ds = val_ds.head(d.val_max_samples)
        val_loader = RLDataLoader(val_ds, d.val_batch_size or len(val_ds), shuffle=False, drop_last=False,
                                  return_raw_chat=raw_chat)
    return train_loader, val_loader


def reward_spec(cfg: HybridFlowConfig, custom: Any = None):
    """The reward keys as a RewardManagerSpec (`custom`: the user's function, already loaded)."""
    from hybridflow.rewards import OverlongShaping, RewardManagerSpec

    rm, crf = cfg.reward_model, cfg.custom_reward_function
    legacy = None
    if rm.overlong_buffer.enable:
        legacy = OverlongShaping(len=rm.overlong_buffer.len, max_resp_len=cfg.data.max_response_length,
                                 penalty_factor=rm.overlong_buffer.penalty_factor, log=rm.overlong_buffer.log)
    options = dict(num_workers=rm.num_workers, timeout_s=rm.timeout_s, failure_score=rm.failure_score,
                   max_failure_fraction=rm.max_failure_fraction, reward_fn_key=cfg.data.reward_fn_key,
                   rm_score_weight=rm.weight)
    fusion = rm.sandbox_fusion
    if fusion.url:  # veRL's sandbox_fusion: the code scorers' cases run on the service (rewards/sandbox_fusion.py)
        from hybridflow.rewards.registry import CODE_DATA_SOURCES
        from hybridflow.rewards.sandbox_fusion import RemoteCodeScorer, RemoteRunner

        runner = RemoteRunner(fusion.url, fusion.max_concurrent, fusion.memory_limit_mb)
        options["scorer_overrides"] = {name: RemoteCodeScorer(runner) for name in CODE_DATA_SOURCES}
        options["num_workers"] = min(rm.num_workers, fusion.max_concurrent)  # one request in flight per worker
    return RewardManagerSpec(
        custom_path=crf.path, custom_name=crf.name, custom_kwargs=dict(crf.reward_kwargs), custom_fn=custom,
        reward_kwargs=dict(rm.reward_kwargs), max_response_length=cfg.data.max_response_length,
        legacy_overlong=legacy, batch_timeout_s=rm.batch_timeout_s, options=options,
    )


def load_reward_function(cfg: HybridFlowConfig):
    """The user's custom_reward_function as the chosen reward manager calls it (per batch for reward_manager=batch,
    with custom_reward_function.reward_kwargs), boxed with reward_model.sandbox; None: the rule scorers."""
    from hybridflow.rewards.managers import load_user_function

    rm, crf = cfg.reward_model, cfg.custom_reward_function
    if crf.path and rm.sandbox:  # never imported here: each call runs boxed
        if rm.reward_manager == "batch" or crf.reward_kwargs:
            raise ConfigError(
                "reward_model.sandbox=true runs a per-sample custom_reward_function without extra arguments; it does "
                "not take reward_model.reward_manager=batch or custom_reward_function.reward_kwargs (drop one)"
            )
        from hybridflow.rewards.sandboxed_custom import load_sandboxed_reward_fn

        return load_sandboxed_reward_fn(crf.path, crf.name, time_limit_s=max(0.5, 0.8 * rm.timeout_s))
    if crf.path:  # the user's own code, with the driver's rights (docs/reliability.md)
        return load_user_function(rm.reward_manager, reward_spec(cfg))
    return None


def build_reward_fn(cfg: HybridFlowConfig, tokenizer: Any, custom: Any = None):
    """The reward manager named by reward_model.reward_manager (rewards/managers.py), from the config's reward keys."""
    from hybridflow.rewards import build_reward_manager

    manager = build_reward_manager(cfg.reward_model.reward_manager, tokenizer, reward_spec(cfg, custom))
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:  # episode records in extra_info + the environment's reward
        from hybridflow.trainer.agent_rewards import AgentRewardFn

        return AgentRewardFn(manager)
    return manager


def total_steps_of(cfg: HybridFlowConfig, train_loader) -> int:
    t = cfg.trainer
    return t.total_training_steps or len(train_loader) * t.total_epochs


def run_training(cfg: HybridFlowConfig, *, progress: bool = True) -> TrainResult:
    """Everything `hybridflow train` does after parsing the command line."""
    from hybridflow.single_controller import WorkerGroupError
    from hybridflow.trainer.metrics import machine_peak_flops
    from hybridflow.trainer.placement import build_worker_groups
    from hybridflow.trainer.preflight import preflight_errors
    from hybridflow.trainer.progress import ProgressBar
    from hybridflow.trainer.rl_trainer import RLTrainer
    from hybridflow.trainer.run_dir import prepare_run_dir
    from hybridflow.trainer.samples import RolloutSampleWriter
    from hybridflow.trainer.tracking import Tracking
    from hybridflow.trainer.validation import Validator

    cfg = resolve_defaults(cfg)
    t, rm = cfg.trainer, cfg.reward_model
    _, tokenizer = load_policy_files(cfg.actor_rollout_ref.model.path)
    train_loader, val_loader = build_datasets(cfg, tokenizer)
    train_ds, val_ds = train_loader.dataset, (val_loader.dataset if val_loader else None)
    data_metrics = train_ds.count_metrics()
    print(train_ds.describe(), flush=True)  # on the console, not in an INFO log
    if val_ds is not None:
        data_metrics.update(val_ds.count_metrics())
        print(val_ds.describe(), flush=True)
    total_steps = total_steps_of(cfg, train_loader)
    cfg.actor_rollout_ref.actor.optim.total_training_steps = total_steps
    cfg.critic.optim.total_training_steps = total_steps
    _raise_preflight(preflight_errors(cfg, train_ds=train_ds, val_ds=val_ds))  # before any process starts
    run_dir = t.default_local_dir
    # One folder, one history: refuse (or, with trainer.overwrite, archive) an old run before anything is written.
    plan = prepare_run_dir(run_dir, resume_mode=t.resume_mode, overwrite=t.overwrite, total_steps=total_steps,
                           save_freq=t.save_freq)
    if plan.start_step >= total_steps and not t.val_only:
        # resuming a run that already took its last step: say so before Ray and the workers start, and stop
        print(f"{run_dir} is already at step {plan.start_step} of {total_steps} (trainer.total_training_steps or the "
              "epochs' steps): nothing to train. Raise trainer.total_training_steps to train on, use "
              "trainer.val_only=true to validate the checkpoint, start again with trainer.resume_mode=disable "
              "trainer.overwrite=true (the old run is moved aside), or choose another trainer.default_local_dir",
              flush=True)
        first, last = logged_validation(run_dir)
        return TrainResult(run_dir, plan.start_step, last, first, 0, t.max_restarts)
    from hybridflow.trainer.shm_model import apply_use_shm
    from hybridflow.trainer.verl_model_keys import apply_model_overrides

    shm_copy = contextlib.ExitStack()  # model.use_shm: the /dev/shm copy, removed when the run ends
    apply_use_shm(cfg, shm_copy)
    apply_model_overrides(cfg, run_dir)  # model.override_config: actor, ref and rollout load RUN_DIR/model_override
    custom = load_reward_function(cfg)  # a bad reward file fails here, before Ray starts
    need_ref = cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
    roles = 1 + int(bool(cfg.critic.enable)) + int(rm.enable)
    if t.backend == "ray":
        import ray

        if not t.ray_address and not ray.is_initialized():  # a local cluster: check against this machine
            check_resources(cfg, os.cpu_count() or 1, _local_gpu_count())
        _init_ray(cfg, roles)
        res = ray.cluster_resources()
        _raise_preflight(preflight_errors(cfg, cluster_resources=res))
        check_resources(cfg, res.get("CPU", 0), res.get("GPU", 0))

    reward_fn = build_reward_fn(cfg, tokenizer, custom)  # its scoring processes start once the cluster checks pass
    tracker = Tracking(run_dir, list(t.logger), project=t.project_name, experiment=t.experiment_name, config=to_dict(cfg))
    restarts, initial_val, max_restarts = 0, {}, t.max_restarts
    # One rank's matmul peak: measured at a rank's thread count; MFU divides the step's FLOPs by ranks * this.
    peak_flops = None
    if t.device != "cuda":
        from hybridflow.trainer.placement import threads_per_rank

        peak_flops = machine_peak_flops(
            dtype=_dtype(cfg.actor_rollout_ref.actor.fsdp_config.param_dtype), num_threads=threads_per_rank(cfg)
        )
    try:
        while True:
            groups = build_worker_groups(cfg, need_ref=need_ref, need_critic=bool(cfg.critic.enable), need_rm=rm.enable)
            try:
                rank_infos = groups.init_models()  # groups on processes of their own build at once
                rank_infos = rank_infos[0]  # the actor's ranks (groups.all() lists the actor first)
                if peak_flops is not None:  # the best measurement: one taken at a busy moment must not inflate MFU
                    peak_flops = max([peak_flops, *(i.get("peak_flops") or 0.0 for i in rank_infos)])
                validator = Validator(
                    cfg, groups.rollout, val_loader, reward_fn, tokenizer=tokenizer,
                    sample_writer=RolloutSampleWriter(run_dir) if t.log_val_generations else None,
                ) if val_loader else None
                bar = ProgressBar(total_steps, disable=not (progress and t.progress_bar))
                trainer = RLTrainer(
                    cfg, groups, train_loader, reward_fn, validator, tracker, tokenizer, progress=bar,
                    sample_writer=RolloutSampleWriter(run_dir, every_n_steps=t.log_samples_freq),
                    num_params=count_parameters(cfg.actor_rollout_ref.model.path), peak_flops=peak_flops,
                )
                trainer.run_metrics = {"training/restarts": restarts, **data_metrics}
                resume_from = trainer.ckpt.resolve("auto" if restarts else t.resume_mode)
                if resume_from:
                    logger.warning("resuming from %s", resume_from)
                    trainer.load_checkpoint(resume_from)
                if resume_from or restarts:
                    tracker.rewind(trainer.global_step)  # drop rows logged after the checkpoint by a crashed run
                    bar.start_at(trainer.global_step)
                    initial_val = initial_val or logged_validation(run_dir)[0]  # the summary's "before"
                if validator is not None and trainer.global_step == 0 and t.val_before_train:
                    initial_val = validator.run(0)
                    tracker.log(initial_val, step=0)
                    cfg.trainer.val_before_train = False  # logged once; fit() must not repeat it
                last = trainer.fit(total_steps) if not t.val_only else initial_val
                bar.close()
                return TrainResult(run_dir, trainer.global_step, last, initial_val, restarts, max_restarts)
            except WorkerGroupError as err:
                # A rank that *raised* hit a deterministic error (bad checkpoint, bad data): a restart would repeat it.
                # A rank whose collective failed because a peer died is classified "died" by the group (errors.py).
                if err.kind == "raised":
                    raise
                if restarts >= max_restarts:
                    raise WorkerGroupError(
                        f"{err}\n\nGave up after {restarts} restart(s) (trainer.max_restarts={max_restarts}); raise "
                        "trainer.max_restarts to survive more worker deaths",
                        group=err.group, method=err.method, rank=err.rank, node_ip=err.node_ip, pid=err.pid,
                        kind=err.kind,
                    ) from err
                restarts += 1
                logger.error("a worker failed (%s); restart %d/%d from the latest checkpoint", err, restarts,
                             max_restarts)
            finally:
                groups.shutdown()
    finally:
        tracker.finish()
        reward_fn.close()
        shm_copy.close()


def load_policy_files(path: str) -> tuple[Any, Any]:
    """(transformers config, tokenizer) of the policy's folder; one transformers cannot read is a ConfigError naming
    the key (no traceback). The run and --dry-run both start here."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        return AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"actor_rollout_ref.model.path={path!r} does not load as a Hugging Face model: {err}") from err


def logged_validation(run_dir: str) -> tuple[dict[str, float], dict[str, float]]:
    """(the validation metrics logged at step 0, the last ones logged) from the run's metrics.jsonl; {} when none."""
    from hybridflow.trainer.report import load_jsonl

    path = os.path.join(run_dir, "metrics.jsonl")
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for row in load_jsonl(path) if os.path.exists(path) else []:
        val = {k: v for k, v in row.items() if k.startswith("val/")}
        if val:
            first = val if row.get("step") == 0 else first
            last = val
    return first, last


def _raise_preflight(problems: list[str]) -> None:
    if problems:
        raise ConfigError("cannot start the run:\n  - " + "\n  - ".join(problems))


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _dtype(name: str):
    import torch

    return torch.bfloat16 if name == "bf16" else torch.float32


def count_parameters(model_path: str) -> int:
    """Parameters of a safetensors checkpoint, read from the file headers (no weights loaded)."""
    import glob

    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model_path, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= int(d)
                total += n
    return total


BUILTIN_PRESET = os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "arithmetic_grpo.yaml")


def train_preset(overrides: list[str], preset: str | None) -> str | None:
    """With no data and no model given, the built-in task's preset sits under the overrides."""
    names_data = any(o.split("=", 1)[0].lstrip("+") in ("data.train_files", "actor_rollout_ref.model.path")
                     for o in overrides)
    return BUILTIN_PRESET if preset is None and not names_data else preset


def train_main(overrides: list[str], preset: str | None = None) -> TrainResult:
    """`hybridflow train`."""
    cfg = load_config(overrides, preset=train_preset(overrides, preset))
    result = run_training(cfg)
    _print_summary(result)
    return result


def _print_summary(result: TrainResult) -> None:
    def acc(metrics: dict[str, Any]) -> dict[str, float]:
        return {k: v for k, v in metrics.items() if k.startswith("val/") and "/mean@" in k}

    before, after = acc(result.initial_val), acc(result.last_metrics)
    held = [name for name in ("metrics.jsonl", "samples.jsonl") if os.path.exists(os.path.join(result.run_dir, name))]
    if any(n.startswith("global_step_") for n in (os.listdir(result.run_dir) if os.path.isdir(result.run_dir) else [])):
        held.append("checkpoints")
    print(f"\nrun directory: {result.run_dir} ({', '.join(held) or 'empty'})")
    print(f"restarts: {result.restarts} (trainer.max_restarts={result.max_restarts})"
          + (" - worker deaths recovered from the latest checkpoint" if result.restarts else ""))
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        # a mean of 0/1 verdicts reads as an accuracy; other rewards (an environment's return) as they are
        rate = all(0.0 <= x <= 1.0 for x in (b, a) if x is not None)
        print(f"held-out {'accuracy' if rate else 'mean score'} {key}: before {_shown(b, rate)} -> after "
              f"{_shown(a, rate)}")


def _shown(x: float | None, rate: bool) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%" if rate else f"{x:.4g}"
