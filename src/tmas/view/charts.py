"""The run page's two charts as PNG bytes, drawn by the evaluation harness's own plots (``tmas.reports.plots``)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmas.reports.frontier import FrontierPoint
from tmas.reports.metrics import RunMetrics
from tmas.reports.plots import plot_frontier, plot_pass1


def _png(draw: Callable[[Path], Any]) -> bytes:
    with tempfile.TemporaryDirectory(prefix="tmas-view-") as scratch:
        path = Path(scratch) / "chart.png"
        draw(path)
        return path.read_bytes()


def pass1_by_iteration_png(label: str, metrics: RunMetrics) -> bytes:
    return _png(lambda path: plot_pass1([(label, metrics)], "Pass@1 against iteration", path))


def accuracy_by_tokens_png(label: str, points: list[FrontierPoint]) -> bytes:
    """The report's frontier: the returned answer's accuracy against completion tokens per problem."""
    return _png(lambda path: plot_frontier([(label, points)], "Accuracy against completion tokens per problem", path))


def frontiers_png(runs: list[tuple[str, list[FrontierPoint]]]) -> bytes:
    """The comparison page's chart: every run's frontier on one plot."""
    return _png(lambda path: plot_frontier(runs, "Accuracy against completion tokens per problem", path))
