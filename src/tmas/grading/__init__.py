"""Grading: is an answer right? The Math-Verify rules, the paper's LLM judge and both combined over a run's
candidates (grades are stored in the run and reused), the medicine and education domains' own metrics, and one
rollout's correctness for RL rewards.

Grading by rules needs the ``eval`` extra (math-verify).
"""
