"""Reducing metric dicts (per micro-batch, per rank) to one dict of floats."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def reduce_metrics(metrics: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each key over a list of metric dicts (e.g. one per micro-batch or rank); a key counts only where present.

    Keys come out in order of first appearance, so equal inputs give equal (and equally ordered) outputs.
    """
    sums: dict[str, list[float]] = {}
    for m in metrics:
        for k, v in m.items():
            sums.setdefault(k, []).append(float(v.item() if hasattr(v, "item") else v))
    return {k: sum(vs) / len(vs) for k, vs in sums.items()}
