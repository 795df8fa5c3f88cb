"""The last in-process engine closed, kept loaded (stopped) for the next open of the same checkpoint and options.

Loading the weights is the slow part of opening a model in process (seconds on a CPU, up to minutes for a large
model on a GPU), and one command often opens the same model several times over: ``tmas eval`` for its run and then
its judge, ``--pilot`` for the pilot and then the run, a Python caller for each :func:`tmas.api.solve`. Closing a
model stops its engine and keeps it here; opening the same checkpoint with the same options takes it back and only
starts it again. One engine is kept at most: opening another model releases it before loading, so two models never
share the device's memory, and :func:`release` frees it at once.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path

from tmas.llm.hf_engine import EngineOptions, HFEngine

# A checkpoint folder, when its files last changed, and the options it was loaded with.
Key = tuple[Path, int, EngineOptions]

_kept: tuple[Key, HFEngine] | None = None
_lock = threading.Lock()


def key_of(folder: Path, options: EngineOptions) -> Key:
    """What an engine is kept under: a checkpoint rewritten in place since is loaded anew."""
    changed = max((f.stat().st_mtime_ns for f in folder.iterdir() if f.is_file()), default=0)
    return folder.resolve(), changed, options


def take(key: Key) -> HFEngine | None:
    """The kept engine loaded under ``key`` (no longer kept), or None; an engine kept under another key is released,
    so that the caller's load has the memory."""
    return _swap(None, key)


def keep(key: Key, engine: HFEngine) -> None:
    """Keep the stopped ``engine``, loaded under ``key``, for the next open; one kept before it is released."""
    _swap((key, engine))


def release() -> None:
    """Free the kept engine's memory now (its model and tokenizer; the device's cached blocks too)."""
    _swap(None)


def _swap(new: tuple[Key, HFEngine] | None, wanted: Key | None = None) -> HFEngine | None:
    """Keep ``new`` instead of the engine kept so far, and return that one where it was kept under ``wanted``; else
    it is freed here."""
    global _kept
    with _lock:
        held, _kept = _kept, new
    if held is None:
        return None
    if held[0] == wanted:
        return held[1]
    device = held[1].options.device
    del held  # the last reference: collected now, not at some later collection
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return None
