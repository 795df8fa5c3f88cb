"""PNG plots of Pass@1 against iteration and against cumulative tokens, one line per run (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tmas.eval.metrics import RunMetrics
from tmas.eval.rules import MissingExtra


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("plots need matplotlib: pip install 'tmas[eval]'") from None
    matplotlib.use("Agg")  # no display here, and none needed
    import matplotlib.pyplot as plt

    return plt


def plot_pass1(runs: list[tuple[str, RunMetrics]], title: str, path: Path, *, x: str = "iteration") -> Path:
    """One figure: Pass@1 (%) against ``x`` ("iteration" or "tokens", mean cumulative tokens per problem)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, metrics in runs:
        if not metrics.iterations:
            continue
        ys = [100 * m.pass1 for m in metrics.iterations]
        xs = (
            [m.iteration for m in metrics.iterations]
            if x == "iteration"
            else [m.tokens_per_problem for m in metrics.iterations]
        )
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlabel("iteration" if x == "iteration" else "cumulative tokens per problem")
    ax.set_ylabel("Pass@1 (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if x == "tokens":
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
