"""A progress bar over training steps: ETA plus a few headline metrics.

On a terminal it is a tqdm bar redrawn in place. When the stream is not a TTY (CI logs, `nohup`, Ray job logs) carriage
returns would turn into thousands of lines, so it prints one short plain line every `print_every` steps instead.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

__all__ = ["DEFAULT_HEADLINE_KEYS", "ProgressBar"]

DEFAULT_HEADLINE_KEYS = ("critic/score/mean", "response_length/mean", "actor/entropy", "actor/pg_loss")


def _short(key: str) -> str:
    # "critic/score/mean" -> "score", "actor/entropy" -> "entropy": enough to recognise in a one-line bar.
    parts = [p for p in key.split("/") if p not in ("mean", "critic", "actor")]
    return "/".join(parts) or key


def _fmt_value(v: Any) -> str:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"


def _fmt_seconds(s: float) -> str:
    s = round(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}"


def _terminal_columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class ProgressBar:
    """Progress over `total_steps` training steps, starting at `initial` (the resumed step).

    `update(step, metrics)` marks `step` as done (steps are absolute, 1-based: after step k, k of total are done).
    `print_every` (non-TTY only) defaults to about 20 lines per run; the last step is always printed.
    """

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        headline_keys: Sequence[str] | None = None,
        disable: bool = False,
        *,
        stream: TextIO | None = None,
        print_every: int | None = None,
        desc: str = "training",
    ) -> None:
        self.total = int(total_steps)
        self.initial = int(initial)
        self.done = self.initial
        self.keys = list(headline_keys) if headline_keys is not None else list(DEFAULT_HEADLINE_KEYS)
        self.disable = disable
        self.stream = stream if stream is not None else sys.stderr
        self.desc = desc
        self.print_every = print_every or max(1, self.total // 20)
        self._start = time.monotonic()
        self._bar = None
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty())
        if not disable and self.interactive:
            from tqdm import tqdm

            # A terminal that reports 0 columns (some container ttys) would get an empty bar: use a fixed width there.
            sized = _terminal_columns(self.stream) > 0
            self._bar = tqdm(
                total=self.total,
                initial=self.initial,
                desc=desc,
                file=self.stream,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
            )

    def start_at(self, step: int) -> None:
        """Declare `step` steps already done (after loading a checkpoint); the ETA counts from now."""
        self.initial = self.done = int(step)
        self._start = time.monotonic()
        if self._bar is not None:
            self._bar.reset(total=self.total)
            self._bar.update(self.done)

    def _headline(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        return {_short(k): _fmt_value(metrics[k]) for k in self.keys if k in metrics}

    def eta_seconds(self) -> float | None:
        """Seconds left at the average pace of the steps done in this session; None before the first step."""
        done_here = self.done - self.initial
        if done_here <= 0:
            return None
        return (time.monotonic() - self._start) / done_here * max(self.total - self.done, 0)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        metrics = metrics or {}
        advance = int(step) - self.done
        self.done = int(step)
        if self.disable:
            return
        if self._bar is not None:
            self._bar.set_postfix(self._headline(metrics), refresh=False)
            self._bar.update(advance)
            return
        if self.done % self.print_every and self.done != self.total:
            return
        eta = self.eta_seconds()
        parts = [
            f"{self.desc} step {self.done}/{self.total} ({100.0 * self.done / max(self.total, 1):.0f}%)",
            f"elapsed {_fmt_seconds(time.monotonic() - self._start)}",
            f"eta {_fmt_seconds(eta) if eta is not None else '?'}",
        ]
        parts += [f"{k} {v}" for k, v in self._headline(metrics).items()]
        self.stream.write(" | ".join(parts) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
