"""Grading: is an answer right? The Math-Verify rules, the paper's LLM judge and both combined over a run's
candidates (grades are stored in the run and reused), the medicine and education domains' graders and metrics, all
behind one :class:`tmas.grading.grader.Grader` seam and registered by name (:mod:`tmas.grading.registry`).

Grading by rules needs the ``eval`` extra (math-verify).
"""
