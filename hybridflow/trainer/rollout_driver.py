"""Where a step's responses come from and how the rollout gets the trained weights (``trainer.rollout_mode``).

The driver's step (rl_trainer.py) asks ``rollout.next_prompts()`` for its prompts, ``rollout.generate(gen_in)`` for
their responses and, after the actor update, ``rollout.sync_weights()``; the mode decides when the generation runs:

* ``sync`` — generate now, with the weights of the last update (any placement; the default).
* ``one_step_off`` — the generation of step k+1 is started (non-blocking, on the separate rollout group) right after
  step k takes its own, so it runs while the actor trains on step k; weights are synced at the step boundary, so step
  k+1 trains on samples one policy version old. Seeds depend on the step only: a run and its resume are bitwise equal.
* ``async`` — a producer thread keeps the rollout group generating into a bounded buffer
  (``trainer.rollout_buffer_batches`` batches, generated or in flight); the step takes the oldest batch. A batch
  whose policy version is more than ``trainer.max_staleness`` behind the actor is dropped and counted. A rollout
  rank that dies is replaced (a new group, a new transfer group, the current weights) and its batch regenerated.

Every generated row carries ``non_tensor_batch["rollout_version"]``: the policy version (number of weight syncs)
its rollout engine held. Weight syncs: ``WeightSync`` — in the hybrid engine one call on the actor group; with a
separate rollout group, bucketed broadcasts from actor rank 0 to every rollout rank (engines/weight_transfer.py).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hybridflow.protocol import DataProto
from hybridflow.single_controller import WorkerGroupError

logger = logging.getLogger(__name__)

ROLLOUT_MODES = ("sync", "one_step_off", "async")
GenInput = Callable[[DataProto, int], DataProto]  # (prompts, step) -> the generation input for that step


class WeightSync:
    """Actor weights -> the rollout engines, stamped with a policy version; see the module docstring."""

    def __init__(self, groups: Any):
        self.groups = groups
        # one transfer at a time: the trainer's sync vs a rollout-rank replacement (which pushes while holding it)
        self.lock = threading.RLock()
        self.retries = 0

    @property
    def separate(self) -> bool:
        return self.groups.separate_rollout is not None

    def connect(self) -> None:
        """Separate rollout: join actor rank 0 and every rollout rank in a transfer group (all calls in flight at
        once: joining blocks until everyone has joined)."""
        if not self.separate:
            return
        actor, rollout = self.groups.actor_rollout, self.groups.separate_rollout
        info = actor.weight_transfer_manifest()
        world = 1 + rollout.world_size
        futures = [g.join_weight_transfer(info["addr"], info["port"], world, info["manifest"]) for g in (actor, rollout)]
        for f in futures:
            f.get()

    def push(self, version: int) -> dict[str, float]:
        """Send the actor's current weights as `version`; -> transfer metrics (time, MB/s, buckets)."""
        with self.lock:
            if not self.separate:
                seconds = max(self.groups.actor_rollout.sync_rollout_weights(version))
                return {"timing/weight_transfer": seconds}
            for attempt in range(2):
                send = self.groups.actor_rollout.send_weights(version)
                recv = self.groups.separate_rollout.receive_weights()
                received, recv_err = _get(recv)
                sent, send_err = _get(send)
                if recv_err is not None and recv_err.kind != "raised":
                    raise recv_err  # a rollout rank died (the sender then fails too): the mode decides what to do
                if send_err is not None:
                    raise send_err
                if recv_err is None:
                    break
                if attempt:  # a bucket failed its checksum twice in a row
                    raise recv_err
                self.retries += 1
                logger.warning("weight transfer of version %d failed on the rollout (%s); sending it again",
                               version, recv_err)
            sent = sent[0]
            versions = {int(r["version"]) for r in received}
            if versions != {version}:
                raise RuntimeError(f"rollout ranks hold versions {sorted(versions)} after sending version {version}")
            # The receivers' time: from their first byte to the engine loaded. The sender's also counts waiting for
            # the rollout to finish a generation call in flight (one_step_off, async).
            seconds = max(r["seconds"] for r in received)
            return {
                "timing/weight_transfer": seconds,
                "timing/weight_transfer_sender": sent["seconds"],
                "perf/weight_transfer_MBps": sent["bytes"] / max(seconds, 1e-9) / 1e6,
                "perf/weight_transfer_MB": sent["bytes"] / 1e6,
                "weights/buckets": sent["buckets"],
                "weights/transfer_retries": float(self.retries),
            }


def _get(future: Any) -> tuple[Any, WorkerGroupError | None]:
    try:
        return future.get(), None
    except WorkerGroupError as err:
        return None, err


class SyncRollout:
    """trainer.rollout_mode=sync: prompts from the loader, generation now."""

    mode = "sync"

    def __init__(self, cfg: Any, groups: Any, batches: Iterator[DataProto], gen_input: GenInput):
        self.cfg, self.groups, self.batches, self.gen_input = cfg, groups, batches, gen_input
        self.weights = WeightSync(groups)
        self.version = 0  # policy version the rollout holds: the number of weight syncs so far

    def start(self, version: int) -> None:
        """Connect the transfer group and send the actor's weights (after a resume: the restored ones)."""
        self.version = version
        self.weights.connect()
        self.weights.push(version)  # the engines then hold the actor's weights and know their version

    def next_prompts(self, step: int) -> DataProto:
        return next(self.batches)

    def generate(self, gen_in: DataProto) -> DataProto:
        return self.groups.rollout.generate_sequences(gen_in)

    def sync_weights(self) -> dict[str, float]:
        self.version += 1
        metrics = self.weights.push(self.version)
        metrics["weights/version"] = float(self.version)
        return metrics

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """How many policy versions behind the trained batch's samples are (at the update, which comes next)."""
        lag = self.version - batch.non_tensor_batch["rollout_version"].astype("float64")
        return {"rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max())}

    def after_save(self) -> None:
        """The checkpoint is committed (the async producer goes on)."""

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode", "sync") != self.mode:
            raise ValueError(
                f"the checkpoint was written with trainer.rollout_mode={state.get('mode')}, this run uses {self.mode}; "
                "resume with the same mode"
            )
        self.version = int(state.get("version", 0))

    def close(self) -> None:
        pass


class OneStepOffRollout(SyncRollout):
    """trainer.rollout_mode=one_step_off: step k+1's generation runs while step k trains (module docstring)."""

    mode = "one_step_off"

    def __init__(self, cfg, groups, batches, gen_input, total_steps: int):
        super().__init__(cfg, groups, batches, gen_input)
        self.total_steps = total_steps
        self.pending: tuple[int, DataProto, Any] | None = None  # (step, prompts, future or DataProto)

    def next_prompts(self, step: int) -> DataProto:
        if self.pending is not None:
            pending_step, prompts, _ = self.pending
            if pending_step != step:
                raise RuntimeError(f"one_step_off: step {step} asked for prompts, the pending generation is for "
                                   f"step {pending_step}")
            return prompts
        return next(self.batches)

    def generate(self, gen_in: DataProto) -> DataProto:
        step = int(gen_in.meta_info["global_step"])
        if self.pending is not None and self.pending[0] == step:
            out = self.pending[2]
            out = out if isinstance(out, DataProto) else out.get()
        else:  # the first step (or a DAPO re-generation): nothing was started for it
            out = self.groups.rollout.generate_sequences(gen_in)
        self.pending = None
        if step < self.total_steps and gen_in.meta_info.get("salt", 0) == 0:
            prompts = next(self.batches)
            self.pending = (step + 1, prompts, self.groups.rollout.generate_sequences_async(
                self.gen_input(prompts, step + 1)))
        return out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.pending is not None:  # the checkpoint holds the started generation: resume does not redo it
            step, prompts, out = self.pending
            out = out if isinstance(out, DataProto) else out.get()
            self.pending = (step, prompts, out)
            state["pending"] = (step, prompts, out)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending = state.get("pending")


class AsyncRollout(SyncRollout):
    """trainer.rollout_mode=async: a producer thread fills a bounded buffer (module docstring)."""

    mode = "async"

    def __init__(self, cfg, groups, batches, gen_input, rebuild_rollout: Callable[[], Any]):
        super().__init__(cfg, groups, batches, gen_input)
        t = cfg.trainer
        self.capacity, self.max_staleness = t.rollout_buffer_batches, t.max_staleness
        self.rebuild_rollout = rebuild_rollout
        self.buffer: collections.deque[tuple[DataProto, DataProto]] = collections.deque()
        self.cond = threading.Condition()
        self.in_flight = 0
        self.produced = 0  # batches generated: the seed of each comes from this counter
        self.paused = False
        self.stopped = False
        self.error: BaseException | None = None
        self.counts = {"dropped_stale_samples": 0, "replaced_rollout_ranks": 0, "dropped_stale_batches": 0}
        self.staleness: collections.Counter[int] = collections.Counter()
        self.ready: DataProto | None = None
        self.thread: threading.Thread | None = None
        self.wait_s = 0.0

    def start(self, version: int) -> None:
        super().start(version)
        self.thread = threading.Thread(target=self._produce, name="hybridflow-rollout-producer", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ producer (its own thread)
    def _produce(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or (
                        not self.paused and len(self.buffer) + self.in_flight < self.capacity))
                    if self.stopped:
                        return
                    self.in_flight += 1
                    index = self.produced
                    self.produced += 1
                    prompts = next(self.batches)
                gen = self._generate_replacing_dead_ranks(self.gen_input(prompts, index + 1))
                with self.cond:
                    self.buffer.append((prompts, gen))
                    self.in_flight -= 1
                    self.cond.notify_all()
        except BaseException as e:  # handed to the trainer thread at its next take
            with self.cond:
                self.error, self.in_flight = e, 0
                self.cond.notify_all()

    def _generate_replacing_dead_ranks(self, gen_in: DataProto) -> DataProto:
        while True:
            try:
                return self.groups.rollout.generate_sequences(gen_in)
            except WorkerGroupError as err:
                if err.kind == "raised":  # a deterministic error: a new process would raise it again
                    raise
                self.counts["replaced_rollout_ranks"] += 1
                logger.error("rollout rank lost (%s); replacing the rollout group and regenerating the batch", err)
                with self.weights.lock:  # the trainer's sync waits: it must not send to the old group meanwhile
                    self.groups.separate_rollout.shutdown()
                    self.groups.separate_rollout = self.rebuild_rollout()
                    self.weights.connect()
                    self.weights.push(self.version)

    def sync_weights(self) -> dict[str, float]:
        try:
            return super().sync_weights()
        except WorkerGroupError as err:
            if err.kind == "raised" or not err.group.startswith("rollout"):
                raise
            # A rollout rank died under this transfer: the producer finds the dead group at its next call, replaces
            # it, and sends the new group the current version (self.version, already counted) itself.
            logger.error("weight transfer of version %d: a rollout rank is gone (%s); the replacement gets it",
                         self.version, err)
            return {"weights/version": float(self.version), "async/transfer_lost_to_dead_rank": 1.0}

    # ------------------------------------------------------------------ trainer side
    def next_prompts(self, step: int) -> DataProto:
        start = time.perf_counter()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.buffer or self.error is not None)
                if self.error is not None:
                    raise self.error
                prompts, gen = self.buffer.popleft()
                self.cond.notify_all()
            age = self.version - int(gen.non_tensor_batch["rollout_version"].min())
            if age <= self.max_staleness:
                break
            self.counts["dropped_stale_samples"] += len(gen)
            self.counts["dropped_stale_batches"] += 1
            logger.warning("dropped a batch of %d samples %d policy versions old (trainer.max_staleness=%d)",
                           len(gen), age, self.max_staleness)
        self.staleness[age] += len(gen)
        self.wait_s = time.perf_counter() - start
        self.ready = gen
        return prompts

    def generate(self, gen_in: DataProto) -> DataProto:
        out, self.ready = self.ready, None
        if out is None:
            raise RuntimeError("async rollout: generate() without next_prompts() (DAPO re-generation is refused "
                               "by the config check for this mode)")
        return out

    def metrics(self, batch: DataProto) -> dict[str, float]:
        out = super().metrics(batch)
        out.update({f"async/{k}": float(v) for k, v in self.counts.items()})
        out["async/buffer_batches"] = float(len(self.buffer))
        out["timing/wait_for_rollout"] = self.wait_s
        total = sum(self.staleness.values()) or 1
        for age, count in sorted(self.staleness.items()):
            out[f"async/staleness_{age}_fraction"] = count / total
        return out

    def _quiesce(self) -> None:
        """Stop starting generations and wait for the ones in flight to land in the buffer."""
        with self.cond:
            self.paused = True
            self.cond.wait_for(lambda: self.in_flight == 0 or self.error is not None)

    def _resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """The buffer, the production counter and the counts; the loader's position (saved by the trainer) is then
        exactly after the last batch the buffer holds, so a resume neither loses nor repeats a prompt."""
        self._quiesce()
        state = super().state_dict()
        state.update(buffer=list(self.buffer), produced=self.produced, counts=dict(self.counts),
                     staleness=dict(self.staleness))
        return state

    def after_save(self) -> None:
        self._resume()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer = collections.deque(state.get("buffer", []))
        self.produced = int(state.get("produced", 0))
        self.counts.update(state.get("counts", {}))
        self.staleness = collections.Counter({int(k): v for k, v in state.get("staleness", {}).items()})

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=self.cfg.trainer.call_timeout_s)


def build_rollout_driver(cfg: Any, groups: Any, batches: Iterator[DataProto], gen_input: GenInput,
                         total_steps: int, rebuild_rollout: Callable[[], Any]) -> SyncRollout:
    mode = cfg.trainer.rollout_mode
    if mode == "one_step_off":
        return OneStepOffRollout(cfg, groups, batches, gen_input, total_steps)
    if mode == "async":
        return AsyncRollout(cfg, groups, batches, gen_input, rebuild_rollout)
    return SyncRollout(cfg, groups, batches, gen_input)
