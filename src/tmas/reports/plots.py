"""PNG plots (matplotlib, Agg): Pass@1 against iteration, and each run's accuracy-against-tokens frontier.

Each plot function returns the series it drew, read back from the figure, so a report can store them next to the
image and tests can check what is plotted rather than pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.answer_rules import MissingExtra
from tmas.reports.frontier import FrontierPoint
from tmas.reports.metrics import RunMetrics


@dataclass(frozen=True)
class Series:
    label: str
    x: list[float]
    y: list[float]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("plots need matplotlib: pip install 'tmas[eval]'") from None
    matplotlib.use("Agg")  # no display here, and none needed
    # Titles and labels are benchmark, run and method names: a "$" in one is text, not the start of a formula.
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def plot_pass1(runs: list[tuple[str, RunMetrics]], title: str, path: Path) -> list[Series]:
    """Pass@1 (%) against iteration, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, metrics in runs:
        # An iteration only unlabeled problems reached has no Pass@1 to draw.
        rows = [m for m in metrics.iterations if m.problems]
        if rows:
            ys = [100 * m.pass1 for m in rows]
            ax.plot([m.iteration for m in rows], ys, marker="o", markersize=3, label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("Pass@1 (%)")
    return _save(plt, fig, ax, title, path)


def plot_frontier(runs: list[tuple[str, list[FrontierPoint]]], title: str, path: Path) -> list[Series]:
    """Accuracy (%) of the returned answer against mean cumulative completion tokens per problem, one line per run,
    with a band of one standard error across problems. The x axis is logarithmic where any point spent tokens; the
    points at 0 tokens (a server that reported no usage) then have no place on it and are left out of the lines
    (:func:`off_log_axis` names them)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    log = _log_axis(runs)
    for label, every in runs:
        points = [p for p in every if p.tokens > 0] if log else every
        if not points:
            continue
        xs = [p.tokens for p in points]
        ys = [100 * p.accuracy for p in points]
        (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=label)
        low = [100 * (p.accuracy - p.stderr) for p in points]
        high = [100 * (p.accuracy + p.stderr) for p in points]
        ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        if len({p.problems for p in points}) > 1:
            # A run still mid-way: say how many problems each point stands on.
            for p, x, y in zip(points, xs, ys, strict=True):
                ax.annotate(f"n={p.problems}", (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
    if log:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax.set_xscale("log", base=2)
        # The log scale's own labels are formulas ("2^5" in mathtext), which the plain text set in _pyplot would print
        # as their source: token counts instead.
        ax.xaxis.set_major_formatter(FuncFormatter(token_tick))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("completion tokens per problem (cumulative)")
    ax.set_ylabel("accuracy of the returned answer (%)")
    return _save(plt, fig, ax, title, path)


def token_tick(value: float, _position: object = None) -> str:
    """A tick of the token axis: its count, with thousands separated."""
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def _log_axis(runs: list[tuple[str, list[FrontierPoint]]]) -> bool:
    return any(p.tokens > 0 for _, points in runs for p in points)


def off_log_axis(runs: list[tuple[str, list[FrontierPoint]]]) -> dict[str, list[str]]:
    """Per run, the labels of the points :func:`plot_frontier` leaves out: those at 0 tokens, where the axis is
    logarithmic (empty where it is not: then every point is drawn)."""
    if not _log_axis(runs):
        return {}
    off = {label: [p.label for p in points if p.tokens <= 0] for label, points in runs}
    return {label: labels for label, labels in off.items() if labels}


def _save(plt: Any, fig: Any, ax: Any, title: str, path: Path) -> list[Series]:
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    drawn = [
        Series(str(line.get_label()), [float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
        for line in ax.lines
    ]
    plt.close(fig)
    return drawn
