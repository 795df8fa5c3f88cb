"""Files put in place whole (tmas.files): the old contents stay until the new are complete, and the file's data and
its folder's entry are synced to disk before the write returns. Checked for the shared writer and for the pool's
save, credits, the router and a sweep's manifest that use it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from tmas.files import replacing, write_atomic
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry


class Boom(Exception):
    pass


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (device, inode) of each file or folder synced to disk, in order."""
    seen: list[tuple[int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        stat = os.fstat(fd)
        seen.append((stat.st_dev, stat.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _id(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_dev, stat.st_ino


def test_a_write_that_fails_part_way_leaves_the_old_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "credits.jsonl"
    path.write_text("old\n", encoding="utf-8")
    with pytest.raises(Boom), replacing(path) as handle:
        handle.write("new, half")
        raise Boom
    assert path.read_text(encoding="utf-8") == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["credits.jsonl"]


def test_a_write_syncs_the_file_then_its_folder(tmp_path: Path, synced: list[tuple[int, int]]) -> None:
    path = tmp_path / "manifest.json"
    path.write_text("old", encoding="utf-8")
    write_atomic(path, "new")
    assert path.read_text(encoding="utf-8") == "new"
    # The new file's data before the rename, the folder (the rename itself) after it.
    assert synced == [_id(path), _id(tmp_path)]


def test_bytes_go_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "vectors.f32"
    write_atomic(path, b"\x00\xff\x10")
    assert path.read_bytes() == b"\x00\xff\x10"


def test_a_pool_save_leaves_its_files_and_their_renames_on_disk(tmp_path: Path, synced: list[tuple[int, int]]) -> None:
    async def embed(texts: Sequence[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in texts]

    pool = Pool.create(tmp_path / "pool", "test-embedder")
    entry = PoolEntry(id="e1", action="Check the units", experience="Units disagree where a step went wrong.")
    asyncio.run(pool.add([entry], embed))
    synced.clear()
    pool.save()
    folder = tmp_path / "pool"
    files = {_id(folder / name) for name in ("entries.jsonl", "vectors.f32", "meta.json")}
    assert files <= set(synced)
    # The folder is synced after the last rename put the version in place.
    assert synced[-1] == _id(folder)
    assert Pool.open(folder, "test-embedder").entries[0].id == "e1"


def test_a_saved_router_and_a_sweep_manifest_are_synced(tmp_path: Path, synced: list[tuple[int, int]]) -> None:
    from tmas.pool.router import RouterModel, save_router
    from tmas.sweep import MANIFEST, _write_manifest

    names = ["log_chars", "log_words", "numbers", "latex_commands", "operators", "sentences", "topic_proof"]
    names += ["topic_counting", "topic_probability", "topic_geometry", "topic_number_theory"]
    ones = [1.0] * len(names)
    router = RouterModel(features=names, domain="math", mean=ones, scale=ones, weights=ones, intercept=0.0)
    save_router(router, tmp_path / "router.json")
    _write_manifest(tmp_path, {"runs": []})
    assert json.loads((tmp_path / MANIFEST).read_text(encoding="utf-8")) == {"runs": []}
    assert synced == [_id(tmp_path / "router.json"), _id(tmp_path), _id(tmp_path / MANIFEST), _id(tmp_path)]


def test_a_converted_checkpoint_is_on_disk_before_it_takes_its_finished_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synced: list[tuple[int, int]]
) -> None:
    # The conversion's files (written by transformers and torch, never synced by them) and their folder are synced
    # before the rename that marks the checkpoint finished, and the cache folder after it.
    from tmas.llm import hf_checkpoint

    monkeypatch.setenv("TMAS_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")

    def convert(source: Path, out: Path, *, dtype: str, tokenizer: Path | None = None) -> None:
        (out / "weights").mkdir(parents=True)
        (out / "config.json").write_text("{}", encoding="utf-8")
        (out / "tokenizer_config.json").write_text("{}", encoding="utf-8")
        (out / "weights" / "model.safetensors").write_bytes(b"\x00" * 8)

    monkeypatch.setattr(hf_checkpoint, "convert", convert)
    target = hf_checkpoint.checkpoint(str(gguf), dtype="float32")
    written = [target / "config.json", target / "tokenizer_config.json", target / "weights" / "model.safetensors"]
    assert {_id(p) for p in written} | {_id(target / "weights"), _id(target)} <= set(synced)
    assert synced[-1] == _id(target.parent)
