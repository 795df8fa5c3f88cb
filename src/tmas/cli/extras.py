"""Which optional extra a missing module belongs to, so that a command run without it says what to install.

The core install (``pip install tmas``) holds what ``solve``, ``run``, ``export``, ``models`` and the simulator need;
everything else comes with an extra. A command that imports a module of an extra that is not installed ends with one
line naming the extra (``pip install 'tmas[serve]'``), never a traceback.
"""

from __future__ import annotations

# The exit code of a command whose extra is missing (as a configuration error's).
MISSING_EXTRA_EXIT = 2

# Top-level module -> the extra that installs it. Where a module is in several extras, the one whose commands use it
# most; ``COMMAND_EXTRA`` below wins when the command's own extra holds the module.
EXTRA_OF_MODULE: dict[str, str] = {
    "starlette": "serve",
    "uvicorn": "serve",
    "latex2mathml": "serve",
    "prometheus_client": "serve",
    "math_verify": "eval",
    "matplotlib": "eval",
    "scipy": "eval",
    "faiss": "pool",
    "numpy": "pool",
    "threadpoolctl": "pool",
    "tokenizers": "tokenizer",
    # A model run in process (--hf-model) needs these five; `rl` commands name their own extra (COMMAND_EXTRA).
    "torch": "hf",
    "transformers": "hf",
    "accelerate": "hf",
    "gguf": "hf",
    "llguidance": "hf",
    "trl": "rl",
    "datasets": "rl",
    "pyarrow": "rl",
    "sentencepiece": "rl",
    "peft": "rl",
    "requests": "rl",
    "sklearn": "router",
    "llama_cpp": "llama-cpp-python",
}

# The extra each command group is built on, and the modules it brings (to pick it over EXTRA_OF_MODULE's choice).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "serve": frozenset({"starlette", "uvicorn", "latex2mathml", "prometheus_client"}),
    "eval": frozenset({"math_verify", "matplotlib", "scipy"}),
    "pool": frozenset({"faiss", "numpy", "tokenizers", "threadpoolctl"}),
    "rl": frozenset(
        {"torch", "trl", "transformers", "accelerate", "datasets", "pyarrow", "gguf", "sentencepiece", "requests"}
        | {"math_verify", "peft", "matplotlib"}
    ),
    "router": frozenset({"sklearn"}),
}
# Command groups: the word after one of them names a subcommand.
GROUPS = frozenset({"data", "pool", "experience", "router", "cases", "rl", "prompts"})
COMMAND_EXTRA: dict[str, str] = {
    "serve": "serve",
    "view": "serve",
    "pool": "pool",
    "experience": "pool",
    "rl": "rl",
    "report": "eval",
    "eval": "eval",
    "sweep": "eval",
}


def missing_extra(module: str | None, argv: list[str]) -> str | None:
    """The one-line error for ``module`` missing while running ``tmas ARGV``; None when no extra installs it (then
    it is a real bug, and its traceback is the useful report)."""
    if not module:
        return None
    top = module.split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    words = command_words(argv)
    # `tmas pool router train` needs scikit-learn: the most specific group named on the line that holds it wins.
    for word in reversed(words):
        candidate = COMMAND_EXTRA.get(word) or (word if word in EXTRA_MODULES else None)
        if candidate is not None and top in EXTRA_MODULES.get(candidate, frozenset()):
            extra = candidate
            break
    command = f"'tmas {' '.join(words)}'" if words else "this command"
    return f"{command} needs {top}, which is not installed: pip install 'tmas[{extra}]'"


def command_words(argv: list[str]) -> list[str]:
    """The command's name on the line (``pool router train``), without its options and arguments."""
    words: list[str] = []
    for arg in argv:
        if arg.startswith("-") or (words and words[-1] not in GROUPS):
            break
        words.append(arg)
    return words
