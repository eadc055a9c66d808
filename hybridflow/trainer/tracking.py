"""Experiment tracking: one `Tracking` object fans each step's metrics out to the chosen loggers.

Loggers (``trainer.logger``):
  * ``console``     a compact table, one row of headline metrics per step (validation mean@1 / mean@n per data
                    source on a line of their own);
  * ``jsonl``       ``<run_dir>/metrics.jsonl``, one JSON object per `log` call: ``{"step": int, **metrics}`` with keys
                    sorted, so rows are byte-identical whenever the metric values are. Always on (it is what
                    ``hybridflow report`` and the resume test read), flushed after every row so a crash loses nothing;
  * ``tensorboard`` event files under ``<run_dir>/tensorboard``;
  * ``wandb``       a run under ``<run_dir>/wandb``; set ``WANDB_MODE=offline`` to run with no network
                    (``wandb sync`` uploads it later);
  * ``mlflow``      a run in ``$MLFLOW_TRACKING_URI`` if set, else a local file store ``<run_dir>/mlruns``
                    (this sets ``MLFLOW_ALLOW_FILE_STORE=true`` in the process, which MLflow >= 3.7 requires).

The optional loggers need ``pip install 'hybridflow[tracking]'``; asking for one whose package is missing raises
`TrackingConfigError` at construction, not at the first step.

Wall-clock quantities belong under ``timing/`` (seconds) and ``perf/`` (throughput, MFU): they differ between two
otherwise identical runs, and comparisons (the deterministic-resume test) drop them with
`hybridflow.trainer.metrics.without_timing`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

__all__ = ["DEFAULT_CONSOLE_KEYS", "LOGGERS", "Tracking", "TrackingConfigError", "logger_errors", "mlflow_metric_name"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # logger -> the module it imports

# Headline metrics for the console table, in column order. An entry ending in "/" is a prefix (all keys under it).
DEFAULT_CONSOLE_KEYS = (
    "critic/score/mean",
    "critic/rewards/mean",
    "response_length/mean",
    "response_length/clip_ratio",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/grad_norm",
    "critic/vf_loss",
    "perf/tokens_per_s",
    "timing/step",
)

_INSTALL_HINT = "pip install 'hybridflow[tracking]'"
_IDS_FILE = "tracking_ids.json"  # wandb / mlflow run ids, so a resumed run continues the same remote run


class TrackingConfigError(ValueError):
    """The logger list asks for something unknown or for a logger whose package is not installed."""


# ---------------------------------------------------------------------------------------------------- helpers
def _to_number(key: str, value: Any) -> int | float:
    """A metric value as a plain Python int or float (tensors, numpy scalars and bools included)."""
    if hasattr(value, "item"):  # torch / numpy scalars
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"metric {key!r} has a value of type {type(value).__name__} ({value!r}); metrics must be numbers "
            "(log strings and tables to the rollout samples file instead)"
        ) from None


def _json_number(value: int | float) -> int | float | None:
    # JSON has no NaN/Infinity; null keeps the file readable by strict parsers (jq, JavaScript).
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _plain_config(config: Any) -> dict[str, Any]:
    """A config (dict, dataclass or OmegaConf node) as nested plain dicts, for the trackers that store it."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    if isinstance(config, Mapping):
        return {str(k): v for k, v in config.items()}
    raise TypeError(f"config must be a dict, a dataclass or an OmegaConf node, got {type(config).__name__}")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _logger_names(loggers: Sequence[str] | str) -> list[str]:
    return [s.strip() for s in loggers.split(",")] if isinstance(loggers, str) else [str(s) for s in loggers]


def _unknown_error(names: list[str]) -> str | None:
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        return f"unknown logger(s) {unknown} in trainer.logger={names}; valid loggers are {list(LOGGERS)}"
    return None


def _missing_error(logger: str, package: str, why: str) -> str:
    return (f"logger {logger!r} needs the {package!r} package, which could not be imported ({why}); "
            f"install the tracking extra: {_INSTALL_HINT} (or pip install {package}), "
            f"or remove {logger!r} from trainer.logger")


def logger_errors(loggers: Sequence[str] | str) -> list[str]:
    """What `Tracking` would refuse in this logger list, found without importing the loggers' packages (so that
    ``--dry-run`` and the checks before Ray starts name a missing ``wandb`` instead of the run failing after)."""
    import importlib.util

    names = _logger_names(loggers)
    unknown = _unknown_error(names)
    if unknown:
        return [unknown]
    return [_missing_error(n, _PACKAGES[n], f"No module named {_PACKAGES[n]!r}")
            for n in dict.fromkeys(names) if n in _PACKAGES and importlib.util.find_spec(_PACKAGES[n]) is None]


def _require(module: str, logger: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackingConfigError(_missing_error(logger, package, str(e))) from e


def _read_ids(run_dir: str) -> dict[str, str]:
    path = os.path.join(run_dir, _IDS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_id(run_dir: str, logger: str, run_id: str) -> None:
    ids = _read_ids(run_dir)
    ids[logger] = run_id
    tmp = os.path.join(run_dir, _IDS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ids, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(run_dir, _IDS_FILE))


# ---------------------------------------------------------------------------------------------------- loggers
class _JsonlLogger:
    """``metrics.jsonl``: one sorted-key JSON object per `log` call, flushed at once."""

    def __init__(self, run_dir: str, resume_from_step: int | None) -> None:
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if resume_from_step is not None and os.path.exists(self.path):
            _drop_rows_after(self.path, resume_from_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open for the whole run

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        row = {"step": step, **{k: _json_number(metrics[k]) for k in sorted(metrics)}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def rewind(self, step: int) -> None:
        self._file.close()
        _drop_rows_after(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def finish(self, failed: bool) -> None:
        self._file.close()


def _drop_rows_after(path: str, step: int) -> None:
    """Rewrite a JSONL file without the rows whose "step" is larger than `step` (atomically).

    A run that crashed after its last checkpoint logged steps that the resumed run will log again.
    """
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
            if row.get("step", -1) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _ConsoleLogger:
    """A fixed-width table: a header, then one row per step; the header repeats when the columns change."""

    HEADER_EVERY = 25
    VAL_HEADLINE = re.compile(r"^val/.+/mean@\d+$")  # mean@1 and mean@n per data source; the rest is in the JSONL

    def __init__(self, keys: Sequence[str], stream: TextIO | None) -> None:
        self.keys = list(keys)
        self.stream = stream
        self._columns: list[str] | None = None
        self._rows_since_header = 0

    def _selected(self, metrics: Mapping[str, Any]) -> list[str]:
        cols: list[str] = []
        for want in self.keys:
            if want.endswith("/"):
                cols += [k for k in metrics if k.startswith(want) and k not in cols]
            elif want in metrics and want not in cols:
                cols.append(want)
        return cols

    @staticmethod
    def _label(key: str) -> str:
        # "critic/score/mean" -> "score/mean": the role prefix is implied by the column set.
        parts = key.split("/")
        return "/".join(parts[-2:]) if len(parts) > 2 else key

    @staticmethod
    def _fmt(v: int | float) -> str:
        if isinstance(v, int):
            return str(v)
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        # tqdm.write keeps an active progress bar intact (it clears and redraws it around the line).
        tqdm.write(line, file=self.stream if self.stream is not None else sys.stdout)

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        cols = self._selected(metrics)
        if cols:
            widths = [max(10, len(self._label(c))) for c in cols]
            if cols != self._columns or self._rows_since_header >= self.HEADER_EVERY:
                self._write(" ".join(["step".rjust(6)] + [self._label(c).rjust(w) for c, w in zip(cols, widths)]))
                self._columns, self._rows_since_header = cols, 0
            self._write(" ".join([str(step).rjust(6)] + [self._fmt(metrics[c]).rjust(w) for c, w in zip(cols, widths)]))
            self._rows_since_header += 1
        val = [k for k in metrics if self.VAL_HEADLINE.match(k)]
        if val:
            self._write(
                f"{'':6} validation @ step {step}: " + "  ".join(f"{k[4:]}={self._fmt(metrics[k])}" for k in val)
            )

    def finish(self, failed: bool) -> None:
        pass


class _TensorBoardLogger:
    def __init__(self, run_dir: str, config: dict[str, Any]) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")
        summary = _require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        if config:
            text = json.dumps(config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", "```\n" + text + "\n```", global_step=0)

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


class _WandbLogger:
    def __init__(self, run_dir: str, project: str, experiment: str, config: dict[str, Any]) -> None:
        wandb = _require("wandb", "wandb", "wandb")
        # Reuse the run id of an earlier session in this run_dir, so that a resumed run continues the same wandb run.
        run_id = _read_ids(run_dir).get("wandb") or secrets.token_hex(4)
        _write_id(run_dir, "wandb", run_id)
        self.run = wandb.init(
            project=project,
            name=experiment,
            id=run_id,
            resume="allow",
            dir=run_dir,  # wandb puts its files in <dir>/wandb
            config=config,
        )

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, failed: bool) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        # run.finish() can return before the service has written the run's last records to disk (seen in offline
        # mode); teardown waits for the service, so the run directory is complete when Tracking.finish returns.
        wandb.teardown()


_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(key: str) -> str:
    """MLflow allows only ``[/\\w.\\- :]`` in metric names: "val/gsm8k/pass@4" -> "val/gsm8k/pass_at_4"."""
    return _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))


class _MlflowLogger:
    def __init__(self, run_dir: str, project: str, experiment: str, config: dict[str, Any]) -> None:
        _require("mlflow", "mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
            # MLflow >= 3.7 refuses file stores unless this is set; a database store costs ~20 s of schema migration
            # per new run directory. Set MLFLOW_TRACKING_URI (e.g. sqlite:///mlflow.db) to use a database instead.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        run_id = _read_ids(run_dir).get("mlflow")
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=experiment).info.run_id
            _write_id(run_dir, "mlflow", run_id)
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow caps a batch at 100 params
                self.client.log_batch(run_id, params=params[i : i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, metrics: dict[str, int | float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def finish(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# ---------------------------------------------------------------------------------------------------- front door
class Tracking:
    """Send every step's metrics to the chosen loggers; the JSONL file is always written.

    Args:
        run_dir: the run directory (created if missing).
        loggers: names from `LOGGERS` (a comma-separated string works too); "jsonl" is added if absent.
        project / experiment: wandb project and run name, MLflow experiment and run name.
        config: the run's config (dict, dataclass or OmegaConf), stored by tensorboard, wandb and mlflow.
        console_keys: columns of the console table: exact keys, or prefixes ending in "/" (default
            `DEFAULT_CONSOLE_KEYS`); validation mean@1 and mean@n are printed on a line of their own.
        console_stream: where the console table goes (default: stdout).
        resume_from_step: when resuming from a checkpoint taken at this step, first drop the JSONL rows with a larger
            step that the interrupted run wrote after the checkpoint, so every step appears once.

    Use as a context manager, or call `finish` at the end.
    """

    def __init__(
        self,
        run_dir: str,
        loggers: Sequence[str] | str = ("console", "jsonl"),
        *,
        project: str = "hybridflow",
        experiment: str = "run",
        config: Any = None,
        console_keys: Sequence[str] | None = None,
        console_stream: TextIO | None = None,
        resume_from_step: int | None = None,
    ) -> None:
        names = _logger_names(loggers)
        unknown = _unknown_error(names)
        if unknown:
            raise TrackingConfigError(unknown)
        if "jsonl" not in names:
            names.append("jsonl")
        self.run_dir = str(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        plain = _plain_config(config)
        self.loggers: dict[str, Any] = {}
        self._finished = False
        try:
            for name in dict.fromkeys(names):  # de-duplicated, order kept
                if name == "jsonl":
                    self.loggers[name] = _JsonlLogger(self.run_dir, resume_from_step)
                elif name == "console":
                    self.loggers[name] = _ConsoleLogger(console_keys or DEFAULT_CONSOLE_KEYS, console_stream)
                elif name == "tensorboard":
                    self.loggers[name] = _TensorBoardLogger(self.run_dir, plain)
                elif name == "wandb":
                    self.loggers[name] = _WandbLogger(self.run_dir, project, experiment, plain)
                elif name == "mlflow":
                    self.loggers[name] = _MlflowLogger(self.run_dir, project, experiment, plain)
        except BaseException:
            self.finish(failed=True)  # close what was opened before the failure
            raise

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.jsonl")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record `metrics` (name -> number) for training step `step` in every logger."""
        if self._finished:
            raise RuntimeError("Tracking.log called after finish(); create a new Tracking to log more")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; pass it as the step argument, not as a metric")
        clean = {str(k): _to_number(str(k), v) for k, v in metrics.items()}
        for logger in self.loggers.values():
            logger.log(clean, int(step))

    def rewind(self, step: int) -> None:
        """Drop the JSONL rows with a step larger than `step`: call after loading a checkpoint taken at `step`,
        before logging again (same as passing ``resume_from_step`` to the constructor)."""
        self.loggers["jsonl"].rewind(int(step))

    def finish(self, failed: bool = False) -> None:
        """Close every logger (idempotent); `failed` marks the wandb/MLflow run as failed."""
        if self._finished:
            return
        self._finished = True
        errors = []
        for name, logger in self.loggers.items():
            try:
                logger.finish(failed)
            except Exception as e:  # close the others even if one fails
                errors.append(f"{name}: {e}")
        if errors:
            raise RuntimeError("closing loggers failed: " + "; ".join(errors))

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(failed=exc_type is not None)
