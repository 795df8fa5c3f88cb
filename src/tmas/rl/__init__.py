"""Hybrid-reward RL for TMAS (paper section 3.3): rewards, training data, TRL and verl adapters, GGUF export.

Only :mod:`tmas.rl.trl_train` (and the ``train`` command) imports torch, transformers and TRL (the ``rl`` extra).
"""
