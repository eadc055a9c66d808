"""The RL driver: one process writes the algorithm as a dataflow over worker groups.

One training step (``RLTrainer.train_step``) is, line for line, the HybridFlow dataflow:

    generate -> reward -> old log-probs -> ref log-probs -> values -> advantages -> update critic -> update actor
    -> sync weights

(with reward_model.launch_reward_fn_async the rule scores are computed while the log-prob and value passes run).

Where and when the generation runs (the hybrid engine, a rollout group of its own, overlapped with training one
step ahead or produced continuously into a buffer) is the rollout driver's business (rollout_driver.py); the step
reads the same in every mode.

Every algorithm (PPO, GRPO, Dr.GRPO, RLOO, REINFORCE++, ReMax, DAPO, GSPO) is this same loop with different registered
pieces chosen by config: the advantage estimator, the policy loss, KL in the reward or in the loss, the group filter.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hybridflow.algorithms import (
    apply_kl_penalty,
    get_advantage_estimator,
    get_kl_controller,
    masked_mean,
)
from hybridflow.common.seeds import derive_seed
from hybridflow.engines.mismatch import logprob_mismatch
from hybridflow.protocol import DataProto
from hybridflow.single_controller.future import DataProtoFuture
from hybridflow.trainer import agent_rewards
from hybridflow.trainer.balance import balance_batch
from hybridflow.trainer.batch_reweight import pf_ppo_resample
from hybridflow.trainer.checkpoint import CheckpointManager
from hybridflow.trainer.dynamic_sampling import fill_step_with_informative_groups
from hybridflow.trainer.high_diff_tokens import DEFAULT_SUBDIR as HIGH_DIFF_SUBDIR
from hybridflow.trainer.high_diff_tokens import HighDiffTokenDump
from hybridflow.trainer.metrics import (
    Timer,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    dense_transformer_flops,
    reduce_metrics,
)
from hybridflow.trainer.placement import WorkerGroups, start_rollout_group
from hybridflow.trainer.profiling import StepProfiler
from hybridflow.trainer.reward_loop import LateRMScores
from hybridflow.trainer.rollout_driver import SyncRollout, build_rollout_driver
from hybridflow.trainer.validation import Validator
from hybridflow.workers.agent_rollout import agent_batch_metrics

logger = logging.getLogger(__name__)
ROLLOUT_STATE_FILE = "rollout_state.pt"  # the rollout driver's state (policy version, pending / buffered batches)


def is_on_policy(cfg: Any) -> bool:
    """The update is exactly on-policy when one optimizer step consumes the whole batch once: the log-probs of the
    first forward in update_actor *are* the old log-probs, so the extra old-log-prob pass is skipped."""
    actor = cfg.actor_rollout_ref.actor
    return (
        actor.recompute_old_log_prob == "auto"
        and actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size == cfg.data.train_batch_size
        and not cfg.algorithm.use_kl_in_reward
        # the batch mean of the IS weights needs every row's pi_old before the first micro-batch
        and not cfg.algorithm.rollout_correction.rollout_is_batch_normalize
        # overlapped modes train on samples of an older policy: the first forward is not the behaviour policy
        and cfg.trainer.rollout_mode == "sync"
        # dumping high-diff tokens needs the actor's per-token log-probs before the update (high_diff_tokens.py)
        and not cfg.trainer.dump_high_diff_tokens
    )


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


class RLTrainer:
    def __init__(self, cfg: Any, groups: WorkerGroups, train_loader, reward_fn, validator: Validator | None,
                 tracker, tokenizer, progress=None, sample_writer=None, num_params: int | None = None,
                 peak_flops: float | None = None):
        self.cfg = cfg
        self.groups = groups
        self.loader = train_loader
        self.reward_fn = reward_fn
        self.validator = validator
        self.tracker = tracker
        self.tokenizer = tokenizer
        self.progress = progress
        self.sample_writer = sample_writer
        self.num_params = num_params
        self.peak_flops = peak_flops
        alg = cfg.algorithm
        self.estimator = get_advantage_estimator(alg.adv_estimator)
        self.kl_ctrl = get_kl_controller(alg.kl_ctrl.type, alg.kl_ctrl.kl_coef, alg.kl_ctrl.target_kl, alg.kl_ctrl.horizon)
        self.ckpt = CheckpointManager(cfg.trainer.default_local_dir, cfg.trainer.max_ckpt_to_keep)
        self.global_step = 0
        self.nonfinite_in_a_row = 0
        # Facts about the run logged in every step row (run_training sets them): training/restarts, data filter counts
        self.run_metrics: dict[str, float] = {}
        self.on_policy = is_on_policy(cfg)
        t = cfg.trainer
        self.high_diff_dump = HighDiffTokenDump(
            t.dump_high_diff_dir or os.path.join(t.default_local_dir, HIGH_DIFF_SUBDIR), tokenizer
        ) if t.dump_high_diff_tokens else None
        if t.dump_high_diff_dir and not t.dump_high_diff_tokens:  # veRL's recipes set the dir with dumping off
            logger.warning("trainer.dump_high_diff_dir=%s: nothing is dumped while trainer.dump_high_diff_tokens=false",
                           t.dump_high_diff_dir)
        self.profiler = StepProfiler(cfg)  # veRL's profiler keys, tool=torch (profiling.py)
        self.rollout: SyncRollout | None = None  # built by fit(): it owns the prompt stream
        # reward_model.launch_reward_fn_async: the thread that waits for the rule scores while the passes run
        self.reward_thread = ThreadPoolExecutor(1, thread_name_prefix="hybridflow-reward") if (
            cfg.reward_model.launch_reward_fn_async) else None
        self._rollout_state: dict | None = None  # from a checkpoint, until fit() builds the rollout driver

    # ------------------------------------------------------------------------------------------- one step
    def train_step(self, prompts: DataProto) -> tuple[dict[str, float], DataProto]:
        """One step of the dataflow -> (metrics, the trained batch: every row with its own text, scores, uid...)."""
        cfg, g, timing, metrics = self.cfg, self.groups, {}, {}
        step_start = time.perf_counter()
        if self.reward_thread is not None:  # reward_model.launch_reward_fn_async: scored alongside the passes below
            batch, reward_metrics = self.generate_once(prompts, salt=0, timing=timing), {}
        else:
            batch, reward_metrics = self.rollout_and_score(prompts, timing)  # times "generate" and "reward"
        metrics.update(self.rollout.metrics(batch))
        if cfg.trainer.balance_batch:
            metrics.update(balance_batch(batch, g.actor_rollout.world_size))
        batch.meta_info.update(self.step_meta())
        scoring = self.score_in_background(batch) if self.reward_thread is not None else None
        if self.cfg.algorithm.rollout_correction.bypass_mode:  # the behaviour policy is the old policy
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        elif not self.on_policy:
            with Timer("old_log_prob", timing):
                batch = batch.union(g.actor_rollout.compute_log_prob(batch))
            metrics.update(self.mismatch_metrics(batch))
            if self.high_diff_dump is not None and "rollout_log_probs" in batch.batch:
                metrics.update(self.high_diff_dump.write(batch, self.global_step + 1))
        if self.need_ref:
            with Timer("ref", timing):
                batch = batch.union(g.actor_rollout.compute_ref_log_prob(batch))
        if g.critic is not None:
            with Timer("values", timing):
                batch = batch.union(g.critic.compute_values(batch))
        if scoring is not None:
            with Timer("reward", timing):  # the wait only: the scores were computed alongside the passes above
                batch = self.join_scores(batch, scoring, reward_metrics)
        metrics.update(reward_metrics)
        metrics.update(agent_batch_metrics(batch, batch.batch.get("scores")))  # multi-turn rows only
        with Timer("adv", timing):
            metrics.update(self.compute_advantage(batch))
            if cfg.algorithm.use_pf_ppo:  # PF-PPO: train on a reward-weighted resample of the rows
                metrics.update(pf_ppo_resample(batch, cfg.algorithm, cfg.trainer.seed, self.global_step + 1))
        if g.critic is not None:
            with Timer("update_critic", timing):
                metrics.update(_mean_over_ranks(g.critic.update_critic(batch)))
        if self.global_step >= cfg.trainer.critic_warmup:
            with Timer("update_actor", timing):
                actor_metrics = _mean_over_ranks(g.actor_rollout.update_actor(batch))
                # On-policy updates measure the train-inference mismatch in their first forward (no extra pass).
                metrics.update({k.replace("actor/rollout_mismatch_", "rollout/mismatch_"): v for k, v in actor_metrics.items()})
            self.check_finite(metrics)
            with Timer("sync_weights", timing):
                metrics.update(self.rollout.sync_weights())
        timing["step"] = time.perf_counter() - step_start
        num_tokens = int(batch.batch["attention_mask"].sum())
        metrics.update(compute_data_metrics(batch, use_critic=g.critic is not None))
        metrics.update(compute_timing_metrics(timing, num_tokens))
        flops = None
        if self.num_params:
            # The step's model FLOPs (docs/architecture.md, Observability): forward+backward of each update (actor,
            # critic) on every token, each forward-only pass this step ran, and generation (each prompt prefilled
            # once for its n samples, one forward per generated token).
            passes = int(not self.on_policy) + int(self.need_ref) + int(g.critic is not None)
            updates = 1 + int(g.critic is not None)
            n = cfg.actor_rollout_ref.rollout.n
            generated = float(batch.batch["response_mask"].sum())
            prompt_tokens = float(batch.batch["attention_mask"].sum()) - generated
            flops = (
                dense_transformer_flops(self.num_params, num_tokens * updates, training=True)
                + dense_transformer_flops(self.num_params, num_tokens * passes, training=False)
                + dense_transformer_flops(self.num_params, int(generated + prompt_tokens / n), training=False)
            )
        metrics.update(
            compute_throughput_metrics(timing, num_tokens, g.actor_rollout.world_size, flops, self.peak_flops)
        )
        return metrics, batch

    # ------------------------------------------------------------------------------------------- stages
    def step_meta(self) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        return {
            "temperature": r.temperature,
            "global_step": self.global_step + 1,  # the step being computed, as in the metrics rows
            "max_response_length": self.cfg.data.max_response_length,
            "with_entropy": True,
            "calculate_entropy": self.cfg.actor_rollout_ref.actor.entropy_coeff != 0,
        }

    def generation_input(self, prompts: DataProto, step: int, salt: int = 0) -> DataProto:
        """What the rollout gets for the prompts of step `step` (counted from 1): token columns + sampling meta."""
        gen_in = prompts.select(["input_ids", "attention_mask", "position_ids"], meta_keys=[])
        gen_in.meta_info = self.sampling_meta(salt=salt, step=step)
        gen_in.meta_info.update(global_step=step, salt=salt)
        if self.cfg.actor_rollout_ref.rollout.multi_turn.enable:  # episodes read the prompts' chat, data_source...
            gen_in = agent_rewards.generation_input(prompts, gen_in)
        return gen_in

    def sampling_meta(self, *, greedy: bool = False, n: int | None = None, salt: int = 0,
                      step: int | None = None) -> dict[str, Any]:
        r = self.cfg.actor_rollout_ref.rollout
        return {
            "temperature": r.temperature,
            "top_k": r.top_k,
            "top_p": r.top_p,
            "greedy": greedy or not r.do_sample,
            "n": r.n if n is None else n,
            "max_new_tokens": self.cfg.data.max_response_length,
            "stop_token_ids": list(r.stop_token_ids),
            # the step's seed: steps count from 1, the seed stream from 0 (step - 1 == global_step before the step)
            "seed": derive_seed(self.cfg.trainer.seed, self.global_step if step is None else step - 1, salt),
            "global_step": self.global_step + 1 if step is None else step,  # the step being computed (fault points)
        }

    def rollout_and_score(self, prompts: DataProto, timing: dict) -> tuple[DataProto, dict]:
        """Generate n responses per prompt and score them; with DAPO dynamic sampling (trainer/dynamic_sampling.py),
        keep generating from fresh prompts until the batch holds train_batch_size groups whose rewards differ."""
        fg = self.cfg.algorithm.filter_groups
        metrics: dict[str, float] = {}
        if not fg.enable:
            return self.generate_and_score_once(prompts, salt=0, metrics=metrics, timing=timing), metrics
        batch, dapo_metrics = fill_step_with_informative_groups(
            prompts, self.next_prompts,
            lambda p, attempt: self.generate_and_score_once(p, salt=attempt, metrics=metrics, timing=timing),
            lambda b: self.filter_values(b, fg.metric),
            groups_needed=self.cfg.data.train_batch_size, n=self.cfg.actor_rollout_ref.rollout.n,
            max_gen_batches=fg.max_num_gen_batches,
        )
        metrics.update(dapo_metrics)
        return batch, metrics

    def generate_and_score_once(self, prompts: DataProto, *, salt: int, metrics: dict, timing: dict) -> DataProto:
        batch = self.generate_once(prompts, salt=salt, timing=timing)
        with Timer("reward", timing):
            return self.score(batch, metrics)

    def generate_once(self, prompts: DataProto, *, salt: int, timing: dict) -> DataProto:
        """n responses per prompt, as rows of the step's batch (not scored yet)."""
        n = self.cfg.actor_rollout_ref.rollout.n
        prompts.non_tensor_batch["uid"] = np.array(
            [f"{self.global_step}-{salt}-{i}" for i in range(len(prompts))], dtype=object
        )
        gen_in = self.generation_input(prompts, self.global_step + 1, salt)
        with Timer("generate", timing):
            gen = self.rollout.generate(gen_in)
        batch = prompts.select([], non_tensor_keys=list(prompts.non_tensor_batch)).repeat(n, interleave=True)
        version = {"rollout_version": gen.non_tensor_batch["rollout_version"]}
        batch.union(DataProto(batch=gen.batch, non_tensor_batch=version, meta_info={}))
        agent_rewards.merge_generation(batch, gen)  # multi-turn: each row's turns, tool calls, termination
        batch.batch["response_mask"] = batch.batch["response_mask"].float()
        if self.estimator_needs_greedy_baseline:
            with Timer("generate_baseline", timing):
                batch.batch["reward_baselines"] = self.greedy_baseline(prompts, salt).repeat_interleave(n)
        return batch

    def greedy_baseline(self, prompts: DataProto, salt: int) -> torch.Tensor:
        """ReMax: the reward of the greedy response to each prompt, [B]."""
        baseline_in = prompts.select(["input_ids", "attention_mask", "position_ids"], meta_keys=[])
        baseline_in.meta_info = self.sampling_meta(greedy=True, n=1, salt=salt)
        if self.cfg.actor_rollout_ref.rollout.multi_turn.enable:  # the greedy baseline is an episode too
            baseline_in = agent_rewards.generation_input(prompts, baseline_in)
        base = self.groups.rollout.generate_sequences(baseline_in)
        episodes = {k: v for k, v in base.non_tensor_batch.items() if k in agent_rewards.EPISODE_COLUMNS}
        base.non_tensor_batch = {**prompts.non_tensor_batch, **episodes}
        base.batch["response_mask"] = base.batch["response_mask"].float()
        return self.score(base).batch["token_level_scores"].sum(-1)

    @staticmethod
    def filter_values(batch: DataProto, metric: str) -> np.ndarray:
        """What DAPO's group filter compares per row (config.FILTER_METRICS), read from the row's own columns."""
        if metric == "acc":
            if "acc" not in batch.batch:
                raise ValueError(
                    "algorithm.filter_groups.metric=acc needs a scorer that returns a dict with an 'acc' field "
                    "({'score': ..., 'acc': ...}); this batch's scorer returned none. Use metric=score instead"
                )
            return batch.batch["acc"].numpy()
        if metric == "score":
            return batch.batch["scores"].numpy()
        return batch.batch["token_level_scores"].sum(-1).numpy()  # seq_reward / seq_final_reward: shaped score

    def score(self, batch: DataProto, metrics: dict | None = None) -> DataProto:
        """Rule scores (and reward-model scores) -> token_level_scores [B, R], shaped by the reward manager (e.g.
        DAPO's overlong penalty, see hybridflow/rewards/managers.py).

        Each row keeps what was scored with it: ``response_text`` (non-tensor), ``scores`` [B] (before shaping),
        ``acc`` [B] when the scorer or the manager gives one.
        """
        batch, late = self.with_rm_scores(batch)
        return self.apply_scores(batch, self.rule_scores(batch, late), metrics)

    def with_rm_scores(self, batch: DataProto) -> tuple[DataProto, LateRMScores | None]:
        """The reward model's scores on the batch, or on their way (the reward loop: ``late``, read when needed)."""
        late = None
        if self.groups.reward_model is not None:
            rm_out = self.groups.reward_model.compute_rm_score(batch)
            if isinstance(rm_out, DataProtoFuture):  # the reward loop: the model scores in its own processes ...
                late = LateRMScores(rm_out)
            else:
                batch = batch.union(rm_out)
        return batch, late

    def rule_scores(self, batch: DataProto, late: LateRMScores | None):
        """The reward manager's result (rewards/manager.RewardResult) for the batch."""
        if late is not None and getattr(self.reward_fn, "takes_late_rm_scores", False):
            return self.reward_fn(batch, rm_scores=late)  # ... while the rule scores are computed
        if late is not None:
            batch.batch["rm_scores"] = late()
        return self.reward_fn(batch)

    def score_in_background(self, batch: DataProto) -> Future:
        """veRL's reward_model.launch_reward_fn_async: the reward model's part as usual, then the rule scores in the
        reward thread, on a view of the batch (its own column dicts: the passes meanwhile add columns to `batch`);
        `join_scores` waits for them. The scorers themselves run in the reward manager's worker processes."""
        batch, late = self.with_rm_scores(batch)
        view = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch, meta_info=batch.meta_info)
        return self.reward_thread.submit(lambda: (view, self.rule_scores(view, late)))

    def join_scores(self, batch: DataProto, scoring: Future, metrics: dict) -> DataProto:
        """`score_in_background`'s scores (and the reward model's, where the manager read them late) on the batch."""
        view, result = scoring.result()
        if "rm_scores" in view.batch and "rm_scores" not in batch.batch:
            batch.batch["rm_scores"] = view.batch["rm_scores"]
        return self.apply_scores(batch, result, metrics)

    def apply_scores(self, batch: DataProto, result, metrics: dict | None = None) -> DataProto:
        """The reward manager's result as the batch's columns (and its metrics into `metrics`)."""
        batch.batch["token_level_scores"] = result.token_level_scores
        batch.batch["scores"] = result.scores
        if "acc" in result.extra and all(v is not None for v in result.extra["acc"]):
            batch.batch["acc"] = torch.tensor([float(v) for v in result.extra["acc"]], dtype=torch.float32)
        batch.non_tensor_batch["response_text"] = np.array(result.responses_text, dtype=object)
        if metrics is not None:
            metrics.update(result.metrics)
        return batch

    def compute_advantage(self, batch: DataProto) -> dict[str, float]:
        alg, metrics = self.cfg.algorithm, {}
        mask = batch.batch["response_mask"]
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(
                batch.batch["token_level_scores"], batch.batch["old_log_probs"], batch.batch["ref_log_probs"],
                mask, self.kl_ctrl.value, alg.kl_penalty,
            )
            current_kl = float(kl_metrics.get("actor/reward_kl_penalty", 0.0))
            self.kl_ctrl.update(current_kl, n_steps=len(batch))
            metrics.update(kl_metrics)
        else:
            rewards = batch.batch["token_level_scores"]
        batch.batch["token_level_rewards"] = rewards
        adv, ret = self.estimator(
            rewards, mask, index=batch.non_tensor_batch["uid"], values=batch.batch.get("values"),
            reward_baselines=batch.batch.get("reward_baselines"), gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
        batch.batch["advantages"], batch.batch["returns"] = adv, ret
        if "ref_log_probs" in batch.batch and "old_log_probs" in batch.batch:
            kl = batch.batch["old_log_probs"] - batch.batch["ref_log_probs"]
            metrics["actor/kl_to_ref"] = float(masked_mean(kl, mask))
        return metrics

    def mismatch_metrics(self, batch: DataProto) -> dict[str, float]:
        if "rollout_log_probs" not in batch.batch:
            return {}
        mm = logprob_mismatch(batch.batch["rollout_log_probs"], batch.batch["old_log_probs"], batch.batch["response_mask"])
        return {f"rollout/mismatch_{k.split('/')[-1]}": v for k, v in mm.items()}

    def check_finite(self, metrics: dict[str, float]) -> None:
        skipped = metrics.get("actor/skipped_nonfinite", 0.0)
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped > 0 else 0
        if self.nonfinite_in_a_row >= self.cfg.trainer.max_consecutive_nonfinite:
            raise NonFiniteUpdateError(
                f"{self.nonfinite_in_a_row} consecutive actor updates had a non-finite loss or gradient and were "
                "skipped; lower actor_rollout_ref.actor.optim.lr, check the rewards for NaN/inf, or raise "
                "trainer.max_consecutive_nonfinite"
            )

    @property
    def need_ref(self) -> bool:
        return self.cfg.algorithm.use_kl_in_reward or self.cfg.actor_rollout_ref.actor.use_kl_loss

    @property
    def estimator_needs_greedy_baseline(self) -> bool:
        return bool(getattr(self.estimator, "needs_greedy_baseline", False))

    def next_prompts(self) -> DataProto:
        return self.rollout.next_prompts(self.global_step + 1)

    def replace_rollout_group(self):
        """A new rollout group for one whose rank died (async mode); validation generates on it from now on."""
        group = start_rollout_group(self.cfg)
        if self.validator is not None:
            self.validator.group = group
        return group

    def start_rollout(self, total_steps: int) -> None:
        """The rollout driver for trainer.rollout_mode, over the loader's batches; restored from a checkpoint."""
        self.rollout = build_rollout_driver(
            self.cfg, self.groups, self.loader.iter_batches(), self.generation_input, total_steps,
            rebuild_rollout=self.replace_rollout_group,
        )
        if self._rollout_state is not None:
            self.rollout.load_state_dict(self._rollout_state)
        self.rollout.start(self.rollout.version)

    # ------------------------------------------------------------------------------------------- the loop
    def fit(self, total_steps: int) -> dict[str, float]:
        """Train until `total_steps`, validating and checkpointing on schedule; returns the last metrics."""
        self.start_rollout(total_steps)
        try:
            return self._fit(total_steps)
        finally:
            self.rollout.close()
            if self.reward_thread is not None:
                self.reward_thread.shutdown(wait=True)

    def _fit(self, total_steps: int) -> dict[str, float]:
        t = self.cfg.trainer
        last: dict[str, float] = {}
        if self.validator is not None and t.val_before_train and self.global_step == 0:
            last = self.validator.run(self.global_step)
            self.tracker.log(last, step=self.global_step)
        while self.global_step < total_steps:
            prompts = self.next_prompts()
            with self.profiler.step(self.global_step + 1, self.groups):
                metrics, batch = self.train_step(prompts)
            self.global_step += 1
            metrics["training/global_step"] = self.global_step
            metrics.update(self.run_metrics)
            metrics["training/epoch"] = float(self.loader.state_dict().get("epoch", 0))
            is_last = self.global_step == total_steps
            if self.validator is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or is_last):
                metrics.update(self.validator.run(self.global_step))
            writer = self.sample_writer
            if writer is not None and self.global_step % writer.every_n_steps == 0:  # decode only when writing
                self.write_samples(batch)
            self.tracker.log(metrics, step=self.global_step)
            if self.progress is not None:
                self.progress.update(self.global_step, metrics)
            if (t.save_freq > 0 and self.global_step % t.save_freq == 0) or (is_last and t.save_freq != 0):
                self.save_checkpoint()
            last = metrics
        return last

    def write_samples(self, b: DataProto) -> None:
        """Each written sample is one row of the trained batch: its prompt, the response scored with it, its score."""
        prompts = [self.tokenizer.decode(p[m.bool()[: p.shape[0]]]) for p, m in zip(b.batch["prompts"], b.batch["attention_mask"])]
        scores = b.batch["token_level_scores"].sum(-1).tolist()
        gts = list(b.non_tensor_batch.get("ground_truth", [None] * len(b)))
        texts = list(b.non_tensor_batch["response_text"])
        episodes = agent_rewards.episode_records(b)  # multi-turn: the conversation turn by turn
        self.sample_writer.maybe_write(self.global_step, prompts, texts, scores, None, gts, episodes=episodes)

    # ------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        tmp = self.ckpt.staging_dir(self.global_step)
        for group in (self.groups.actor_rollout, self.groups.critic):
            if group is not None:
                group.save_checkpoint(tmp)
        # first: an async producer stops taking prompts here, so the loader position below matches the buffer
        torch.save(self.rollout.state_dict(), os.path.join(tmp, ROLLOUT_STATE_FILE))
        state = {
            "global_step": self.global_step,
            "dataloader": self.loader.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        path = self.ckpt.commit(tmp, self.global_step, state)
        self.rollout.after_save()
        return path

    def load_checkpoint(self, path: str) -> None:
        state = self.ckpt.read_trainer_state(path)
        for group in (self.groups.actor_rollout, self.groups.critic):
            if group is not None:
                group.load_checkpoint(path)
        self.loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.global_step = int(state["global_step"])
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        rollout_file = os.path.join(path, ROLLOUT_STATE_FILE)
        if os.path.exists(rollout_file):  # generated batches are plain tensors/arrays: weights_only stays off
            self._rollout_state = torch.load(rollout_file, weights_only=False)


def _mean_over_ranks(per_rank: list[dict[str, float]] | dict[str, float]) -> dict[str, float]:
    return per_rank if isinstance(per_rank, dict) else reduce_metrics(per_rank)
