"""A command whose extra is missing names the extra to install: which one, for which module and command."""

from __future__ import annotations

import pytest

from tmas.cli.extras import command_words, missing_extra


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        ("uvicorn", ["serve", "--port", "8080"], "serve"),
        ("starlette.routing", ["view", "runs"], "serve"),
        ("numpy", ["pool", "build", "run", "-o", "p"], "pool"),
        # scikit-learn is the router's; Math-Verify, needed by rl too, is named for rl on an rl command.
        ("sklearn", ["pool", "router", "train", "--single", "a"], "router"),
        ("math_verify", ["rl", "build-data", "run"], "rl"),
        ("math_verify", ["eval", "problems.jsonl"], "eval"),
        ("tokenizers", ["pool", "build", "run"], "pool"),
        ("tokenizers", ["run", "problems.jsonl"], "tokenizer"),
    ],
)
def test_the_extra_named_fits_the_module_and_the_command(module: str, argv: list[str], extra: str) -> None:
    message = missing_extra(module, argv)
    assert message is not None and message.endswith(f"pip install 'tmas[{extra}]'")
    assert message.startswith(f"'tmas {' '.join(command_words(argv))}' needs {module.split('.')[0]}")


def test_a_module_no_extra_installs_is_left_to_its_traceback() -> None:
    assert missing_extra("no_such_module", ["run"]) is None
    assert missing_extra(None, ["run"]) is None


def test_the_command_is_its_words_before_options_and_arguments() -> None:
    assert command_words(["serve", "--base-url", "http://x/v1"]) == ["serve"]
    assert command_words(["pool", "router", "train", "--out", "r.json"]) == ["pool", "router", "train"]
    assert command_words(["run", "problems.jsonl", "-o", "out"]) == ["run"]
    assert command_words(["--version"]) == []
