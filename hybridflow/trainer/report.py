"""`hybridflow report <run_dir>`: pictures of a run, from the files its trackers wrote.

Reads ``<run_dir>/metrics.jsonl`` (and ``samples.jsonl`` if present) and writes, into ``<run_dir>/report`` by default:
  reward.png           score / reward vs step and vs wall time
  val_accuracy.png     ``val/<source>/mean@1`` vs step and vs wall time
  response_length.png  mean and max response length (and clip ratio) vs step
  kl.png               ``actor/*kl*`` and ``critic/*kl*`` vs step
  entropy.png          ``actor/entropy*`` vs step
  timing.png           stacked bars: seconds per stage (``timing/<stage>``) of each step
  report.html          one self-contained page: the plots (embedded as base64) and the best/worst samples per step
A plot whose metrics are not in the file is skipped. Wall time is the ``wall_time`` metric if logged (seconds),
else the running sum of ``timing/step``.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["load_jsonl", "main", "make_report", "metrics_by_step"]


# ---------------------------------------------------------------------------------------------------- reading
def load_jsonl(path: str) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line that does not parse (a run killed mid-write) is skipped with a warning."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{lineno}: skipping a line that is not valid JSON", stacklevel=2)
    return rows


def metrics_by_step(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Rows merged per step (a step logged twice, e.g. training then validation, becomes one dict), steps sorted.

    Values that are not finite numbers (null for NaN, strings) are dropped.
    """
    merged: dict[int, dict[str, float]] = {}
    for row in rows:
        if "step" not in row:
            continue
        step = int(row["step"])
        dst = merged.setdefault(step, {})
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                dst[k] = float(v)
    return dict(sorted(merged.items()))


def _wall_time(by_step: dict[int, dict[str, float]]) -> dict[int, float] | None:
    """Seconds since the start of the run at the end of each step, or None if the run logged no timing."""
    if any("wall_time" in m for m in by_step.values()):
        stamps = {s: m["wall_time"] for s, m in by_step.items() if "wall_time" in m}
        t0 = min(stamps.values())
        return {s: t - t0 for s, t in stamps.items()}
    if not any("timing/step" in m for m in by_step.values()):
        return None
    total, out = 0.0, {}
    for s, m in by_step.items():
        total += m.get("timing/step", 0.0)
        out[s] = total
    return out


# ---------------------------------------------------------------------------------------------------- plots
def _require_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"hybridflow report draws its plots with matplotlib, which could not be imported ({e}); "
            "install it with: pip install 'hybridflow[plot]'"
        ) from e
    return Figure, FigureCanvasAgg


def _time_axis(seconds: list[float]) -> tuple[list[float], str]:
    top = max(seconds, default=0.0)
    if top >= 2 * 3600:
        return [s / 3600 for s in seconds], "wall time (h)"
    if top >= 2 * 60:
        return [s / 60 for s in seconds], "wall time (min)"
    return seconds, "wall time (s)"


def _line_plot(
    path: str,
    title: str,
    keys: list[str],
    by_step: dict[int, dict[str, float]],
    wall: dict[int, float] | None,
) -> None:
    """One panel vs step, and a second vs wall time when `wall` is given."""
    Figure, FigureCanvasAgg = _require_matplotlib()
    panels = 2 if wall else 1
    fig = Figure(figsize=(6.0 * panels, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    for key in keys:
        steps = [s for s, m in by_step.items() if key in m]
        values = [by_step[s][key] for s in steps]
        marker = "o" if len(steps) < 30 else None
        axes[0].plot(steps, values, marker=marker, markersize=3, label=key)
        if wall:
            timed = [s for s in steps if s in wall]
            xs, xlabel = _time_axis([wall[s] for s in timed])
            axes[1].plot(xs, [by_step[s][key] for s in timed], marker=marker, markersize=3, label=key)
            axes[1].set_xlabel(xlabel)
    axes[0].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def _timing_plot(path: str, stages: list[str], by_step: dict[int, dict[str, float]]) -> None:
    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(8.0, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    steps = [s for s, m in by_step.items() if any(f"timing/{st}" in m for st in stages)]
    bottom = [0.0] * len(steps)
    for stage in stages:
        heights = [by_step[s].get(f"timing/{stage}", 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=stage, width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    # What the step took beyond its named stages: driver overhead, data loading, logging, checkpoints.
    other = [max(by_step[s].get("timing/step", 0.0) - b, 0.0) for s, b in zip(steps, bottom)]
    if any(o > 0 for o in other):
        ax.bar(steps, other, bottom=bottom, label="other", width=0.8, color="lightgray")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per stage")
    handles, labels = ax.get_legend_handles_labels()  # legend top-down = stack top-down
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=100)


def _keys(by_step: dict[int, dict[str, float]], match: Callable[[str], bool]) -> list[str]:
    seen: dict[str, None] = {}
    for m in by_step.values():
        for k in m:
            if match(k):
                seen[k] = None
    return sorted(seen)


# The dataflow order of one RL step (bottom to top in the stacked bars); other stages follow alphabetically.
STAGE_ORDER = (
    "generate",
    "generate_baseline",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
    "sync_weights",
    "validation",
    "save_checkpoint",
)

_KL = re.compile(r"^(actor|critic)/[^/]*kl")


def _plot_specs(by_step: dict[int, dict[str, float]]) -> list[tuple[str, str, list[str], bool]]:
    """(file stem, title, keys, also vs wall time) of each line plot whose keys are present."""
    specs = [
        ("reward", "score and reward (sequence mean)", ["critic/score/mean", "critic/rewards/mean"], True),
        (
            "val_accuracy",
            "validation accuracy (mean@1)",
            _keys(by_step, lambda k: bool(re.fullmatch(r"val/.+/mean@1", k))),
            True,
        ),
        ("response_length", "response length (tokens)", ["response_length/mean", "response_length/max"], False),
        ("kl", "KL", _keys(by_step, lambda k: bool(_KL.match(k)) and "coef" not in k), False),
        ("entropy", "policy entropy", _keys(by_step, lambda k: k.startswith("actor/entropy")), False),
        ("agent", "multi-turn episodes (per episode)",
         ["agent/assistant_turns/mean", "agent/tool_calls/mean", "agent/observation_token_share/mean",
          "agent/solved_fraction", "val/agent/solved_fraction", "val/agent/assistant_turns_when_solved/mean"], True),
    ]
    present = set().union(*by_step.values()) if by_step else set()
    return [(stem, title, [k for k in keys if k in present], wall) for stem, title, keys, wall in specs]


# ---------------------------------------------------------------------------------------------------- HTML
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; border-bottom: 1px solid #eee; text-align: left; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: 0.5em; margin: 0.2em 0; }
.best { border-left: 4px solid #2a2; padding-left: 0.6em; } .worst { border-left: 4px solid #c33; padding-left: 0.6em; }
"""


def _sample_html(row: dict[str, Any], kind: str) -> str:
    def num(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)

    meta = f"{kind} · row {row.get('index', '?')} · score {num(row.get('score'))}"
    if "reward" in row:
        meta += f" · reward {num(row['reward'])}"
    if "ground_truth" in row:
        meta += f" · ground truth {json.dumps(row['ground_truth'], ensure_ascii=False)}"
    if "conversation" in row:  # a multi-turn episode: one block per turn, tool results and feedback included
        meta += f" · {row.get('num_turns', '?')} turns · ended by {row.get('termination', '?')}"
        turns = "".join(f"<pre><i>{html.escape(str(m.get('role', '?')))}</i>\n{html.escape(str(m.get('content', '')))}"
                        "</pre>" for m in row["conversation"])
        return f'<div class="{kind}"><b>{html.escape(meta)}</b>{turns}</div>'
    return (
        f'<div class="{kind}"><b>{html.escape(meta)}</b>'
        f"<pre>{html.escape(str(row.get('prompt', '')))}</pre>"
        f"<pre>{html.escape(str(row.get('response', '')))}</pre></div>"
    )


def _samples_section(samples: list[dict[str, Any]], per_step: int, max_steps: int) -> str:
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in samples:
        if "step" in row:
            groups.setdefault((str(row.get("split", "train")), int(row["step"])), []).append(row)
    keys = sorted(groups, key=lambda sk: (sk[0] != "train", sk[0], sk[1]))
    if len(keys) > max_steps:  # evenly spaced steps, the last one included
        keys = (
            [keys[round(i * (len(keys) - 1) / (max_steps - 1))] for i in range(max_steps)]
            if max_steps > 1
            else keys[-1:]
        )
    parts = ["<h2>Rollout samples: best and worst per step</h2>"]
    for split, step in keys:

        def score(r: dict[str, Any]) -> float:
            s = r.get("score")
            return float(s) if isinstance(s, (int, float)) and math.isfinite(s) else -math.inf

        rows = sorted(groups[(split, step)], key=lambda r: (-score(r), r.get("index", 0)))
        best = rows[:per_step]
        worst = [r for r in reversed(rows) if r not in best][:per_step]
        parts.append(f"<details><summary>{html.escape(split)} step {step} ({len(rows)} samples)</summary>")
        parts += [_sample_html(r, "best") for r in best] + [_sample_html(r, "worst") for r in worst]
        parts.append("</details>")
    return "\n".join(parts)


def _summary_table(by_step: dict[int, dict[str, float]]) -> str:
    from hybridflow.trainer.tracking import DEFAULT_CONSOLE_KEYS

    last: dict[str, tuple[int, float]] = {}
    for s, m in by_step.items():
        for k, v in m.items():
            last[k] = (s, v)
    keys = [k for k in DEFAULT_CONSOLE_KEYS if k in last] + sorted(k for k in last if re.fullmatch(r"val/.+/mean@1", k))
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{last[k][1]:.6g}</td><td>{last[k][0]}</td></tr>" for k in keys)
    return f"<table><tr><th>metric</th><th>last value</th><th>at step</th></tr>{rows}</table>"


def make_report(
    run_dir: str, out_dir: str | None = None, *, samples_per_step: int = 1, max_sample_steps: int = 50
) -> dict[str, str]:
    """Write the plots and ``report.html`` for `run_dir`; returns {plot name or "html": path written}."""
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path):
        raise FileNotFoundError(
            f"{metrics_path} not found: `hybridflow report` needs the run directory of a training run "
            "(the folder holding metrics.jsonl, i.e. trainer.default_local_dir)"
        )
    by_step = metrics_by_step(load_jsonl(metrics_path))
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    wall = _wall_time(by_step)

    written: dict[str, str] = {}
    titles: dict[str, str] = {}
    for stem, title, keys, vs_time in _plot_specs(by_step):
        if keys:
            path = os.path.join(out_dir, f"{stem}.png")
            _line_plot(path, title, keys, by_step, wall if vs_time else None)
            written[stem], titles[stem] = path, title
    logged = [
        k.removeprefix("timing/") for k in _keys(by_step, lambda k: k.startswith("timing/") and k != "timing/step")
    ]
    stages = [st for st in STAGE_ORDER if st in logged] + [st for st in logged if st not in STAGE_ORDER]
    if stages:
        path = os.path.join(out_dir, "timing.png")
        _timing_plot(path, stages, by_step)
        written["timing"], titles["timing"] = path, "time per stage"

    samples_path = os.path.join(run_dir, "samples.jsonl")
    samples = load_jsonl(samples_path) if os.path.exists(samples_path) else []

    body = [
        f"<h1>hybridflow run report</h1><p>{html.escape(os.path.abspath(run_dir))} · "
        f"{len(by_step)} logged steps · generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC</p>",
        _summary_table(by_step),
    ]
    for stem, path in written.items():
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        body.append(f'<h2>{html.escape(titles[stem])}</h2><img alt="{stem}" src="data:image/png;base64,{data}">')
    if not written:
        body.append("<p>No plottable metrics found in metrics.jsonl.</p>")
    if samples:
        body.append(_samples_section(samples, samples_per_step, max_sample_steps))
    page = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>hybridflow report</title>'
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    html_path = os.path.join(out_dir, "report.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
    written["html"] = html_path
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """`hybridflow report <run_dir> [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="hybridflow report", description="Plots and an HTML page for a training run.")
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="where to write the report (default: <run_dir>/report)")
    parser.add_argument("--samples-per-step", type=int, default=1, help="best and worst samples shown per step")
    args = parser.parse_args(argv)
    try:
        written = make_report(args.run_dir, args.out, samples_per_step=args.samples_per_step)
    except (FileNotFoundError, ImportError) as e:
        print(f"hybridflow report: {e}", file=sys.stderr)
        return 1
    for name, path in written.items():
        print(f"{name:>16}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
