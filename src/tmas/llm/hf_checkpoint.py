"""A Hugging Face checkpoint for the in-process engine (:mod:`tmas.llm.hf_model`): a checkpoint folder is used as it
is; a GGUF (a file, or a known embedded model's name) is dequantised once into the cache with its tokenizer saved
beside it, so no later start converts it again.

Reading a GGUF with transformers takes most of its time in converting the tokenizer (82 s for the 0.5B model on a
GPU machine, most of it there). A folder that already holds the model's tokenizer (``tokenizer``: one written by an
earlier conversion, carried to a machine without network access) is read instead of converting it.

The converted checkpoint lives in ``<cache>/hf/<name>-<digest>-<dtype>/`` (``cache`` as the GGUF cache:
:func:`tmas.llm.weights.cache_dir`), written under a lock into a temporary folder that is renamed when complete, so
two processes never convert the same file at once and a stopped conversion leaves nothing that looks finished.
``digest`` is the known model's SHA-256, or for any other GGUF a hash of its path, size and modification time.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

from tmas.errors import LocalModelError
from tmas.files import sync_dir, sync_tree
from tmas.llm.weights import KNOWN_MODELS, cache_dir, locked, resolve_model

# What marks a finished checkpoint folder (written by save_pretrained, the tokenizer last).
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer_config.json"
# The files transformers reads a tokenizer's vocabulary from (a SentencePiece model is any *.model: tokenizer.model,
# spiece.model, ...); a folder with none of them loads as an empty tokenizer.
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tekken.json", "*.model", "*.tiktoken")
INSTALL_HINT = "pip install 'tmas[hf]'"


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def check_folder(path: Path) -> None:
    """Raise :class:`LocalModelError` unless ``path`` is a checkpoint folder with a tokenizer: without its files,
    transformers loads an empty tokenizer there without a word, and every call would fail or read garbage."""
    if not is_checkpoint(path):
        raise LocalModelError(f"{path} is not a Hugging Face checkpoint folder (it has no {CONFIG_FILE})")
    if not any(found.is_file() for pattern in VOCABULARY_FILES for found in path.glob(pattern)):
        raise LocalModelError(
            f"{path} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)}): save the model's tokenizer into it"
        )


def checkpoint_name(spec: str) -> str:
    """The model's name as calls record it: a known model's name, else the folder's or file's stem."""
    if spec in KNOWN_MODELS:
        return spec
    path = Path(spec).expanduser()
    return path.name if path.is_dir() else path.stem


def checkpoint(spec: str, *, dtype: str, tokenizer: str | None = None) -> Path:
    """The checkpoint folder of ``spec`` (a checkpoint folder, a GGUF file or a known model name), converting a GGUF
    into the cache in ``dtype`` (a torch dtype name) the first time; ``tokenizer`` is a folder whose saved tokenizer
    goes with a conversion instead of the GGUF's own."""
    path = Path(spec).expanduser()
    if path.is_dir():
        check_folder(path)
        return path
    gguf = resolve_model(spec)
    target = cache_dir() / "hf" / f"{checkpoint_name(spec)}-{_digest(spec, gguf)[:12]}-{dtype}"
    if _finished(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LocalModelError(f"cannot create the checkpoint cache {target.parent}: {exc.strerror}") from None
    with locked(target.parent / f"{target.name}.lock"):
        if not _finished(target):  # another process may have converted it while this one waited
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            convert(gguf, partial, dtype=dtype, tokenizer=Path(tokenizer).expanduser() if tokenizer else None)
            # On disk before its finished name: a power loss never leaves a finished folder of empty files.
            sync_tree(partial)
            partial.rename(target)
            sync_dir(target.parent)
    return target


def _finished(target: Path) -> bool:
    return is_checkpoint(target) and (target / TOKENIZER_FILE).is_file()


def _digest(spec: str, gguf: Path) -> str:
    known = KNOWN_MODELS.get(spec)
    if known is not None:
        return known.sha256
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()


def convert(gguf: Path, out: Path, *, dtype: str, tokenizer: Path | None = None) -> None:
    """``gguf`` dequantised into a checkpoint in ``out`` (weights in ``dtype``), its tokenizer beside it: read from
    ``tokenizer`` where given, else converted from the GGUF (the slow part)."""
    try:
        import torch
        from transformers import AutoTokenizer
    except ImportError:
        raise LocalModelError(f"running a model in process needs torch and transformers: {INSTALL_HINT}") from None
    # A tokenizer folder that holds none is said before the weights are unpacked (minutes for a large model).
    if tokenizer is not None and not (tokenizer / TOKENIZER_FILE).is_file():
        raise LocalModelError(f"{tokenizer} holds no saved tokenizer (no {TOKENIZER_FILE})")
    model = load_gguf(gguf, dtype=getattr(torch, dtype))
    if tokenizer is not None:
        tok: Any = AutoTokenizer.from_pretrained(tokenizer)
    else:
        tok = gguf_tokenizer(gguf)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def load_gguf(gguf: Path, *, dtype: Any) -> Any:
    """The model of ``gguf`` with every weight unpacked into a dense tensor of ``dtype`` (not kept in GGUF blocks),
    the GGUF quantizer dropped since nothing is left quantized (so it can be saved and trained)."""
    try:
        from transformers import AutoModelForCausalLM, GgufConfig
    except ImportError:
        raise LocalModelError(f"reading a GGUF needs transformers and gguf: {INSTALL_HINT}") from None
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=dtype
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model


def gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer of ``gguf``, converted from the file, ending text where the file's chat model does."""
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The tokenizer read from a GGUF may end text where the file's chat model does not (Qwen2.5 instruct:
    # <|endoftext|>, not <|im_end|>; SmolLM2: <|im_start|>): the file's own end-of-generation token is the one.
    eos = gguf_eos_id(gguf)
    if eos is not None and tok.eos_token_id != eos:
        tok.eos_token = tok.convert_ids_to_tokens(eos)
    return tok


def gguf_eos_id(path: Path) -> int | None:
    """The end-of-generation token a GGUF file names (``tokenizer.ggml.eos_token_id``)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("tokenizer.ggml.eos_token_id")
    return int(field.parts[field.data[0]][0]) if field is not None else None


def write_tokenizer(gguf: Path, out: Path) -> None:
    """The tokenizer of ``gguf``, converted once, saved in ``out``: carried beside the GGUF to a machine without
    network access, it goes with that machine's conversion (``tokenizer``) instead of converting it there."""
    out.mkdir(parents=True, exist_ok=True)
    gguf_tokenizer(gguf).save_pretrained(out)
