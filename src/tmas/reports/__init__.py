"""Reports of graded runs: metrics, analyses, the accuracy-vs-tokens frontier, plots, the papers' numbers beside
ours, and the report document ``tmas eval`` and ``tmas report`` write.

Plots and the statistical test need the ``eval`` extra (matplotlib, scipy).
"""
