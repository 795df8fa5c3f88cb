"""MATTRL's test-time experience pool (paper 003, section 3.4 and A.7): distilled entries, their embeddings and a
FAISS ``IndexFlatIP`` over L2-normalised float32 vectors, so inner product is cosine similarity.

A pool is a folder:

- ``entries.jsonl``: one :class:`PoolEntry` a line;
- ``vectors.f32``: the entries' embeddings, row i for line i, raw little-endian float32 (``count x dim``);
- ``meta.json``: format name, version (bumped by every :meth:`Pool.save`), embedding model name and dim, and the ids
  of the entries removed from the pool (so a rebuild from the same runs does not bring back what a prune dropped).

The embedding model is part of the pool: vectors from another model live in another space, so opening a pool for a
different embedder is an error naming both. A save stages all three files beside their places first, meta last, then
renames them into place: a save cut short before its staged meta was complete leaves the previous version as it was,
and one cut short later (some files renamed, others not) is read as the version it staged, and completed by the next
save. Readers take no lock and rename nothing: one that a save overlaps (its files of two versions) sees where the
files are, or the meta they start from, change under it, and reads the pool again.

``embed`` is any async callable ``texts -> vectors`` (see :mod:`tmas.memory.embedders`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from tmas.errors import InputError, first_error
from tmas.files import replacing, sync_dir
from tmas.memory.embedders import UNNAMED
from tmas.memory.pool_entry import PoolEntry

EmbedFn = Callable[[Sequence[str]], Awaitable[list[list[float]]]]

FORMAT = "tmas-experience-pool"  # the on-disk format name: kept, so pools written before the rename still open
ENTRIES, VECTORS, META = "entries.jsonl", "vectors.f32", "meta.json"
_BOM = b"\xef\xbb\xbf"
# The entry fields a retrieval keys or ranks by, or a hint shows (beside the text and the vector).
_RETRIEVED_FIELDS = {
    "id",
    "scope",
    "domain",
    "specialty",
    "role",
    "subject",
    "difficulty",
    "category",
    "source_question",
}
# How many times a reader reads a pool that saves keep changing under it before it gives up.
READ_TRIES = 8


class PoolError(InputError):
    """A pool folder that is missing, corrupt, or built with another embedding model."""


class PoolMeta(BaseModel):
    format: str = FORMAT
    version: int = 0
    embedder: str
    dim: int | None = Field(default=None, ge=1)  # None until the first entries are embedded
    count: int = 0
    # Ids of entries removed (by a prune), oldest first; an entry added again under its id leaves the list.
    removed: list[str] = Field(default_factory=list)


def _faiss() -> Any:
    try:
        import faiss
    except ImportError:
        raise PoolError("the experience pool needs faiss: pip install 'tmas[pool]'") from None
    return faiss


def _staged(path: Path, name: str) -> Path:
    return path / f".{name}.staged"


def _finish_save(path: Path) -> None:
    """Put a save's staged files in place, meta last, once its staged meta exists (see :meth:`Pool._write`); staged
    files without it are an unfinished save's, left for the next save to write over. Only a writer (holding the lock
    of :mod:`tmas.pool.writing`) calls it."""
    if not _staged(path, META).exists():
        return
    for name in (ENTRIES, VECTORS, META):
        # A save cut short between its renames left some in place already.
        with contextlib.suppress(FileNotFoundError):
            _staged(path, name).replace(path / name)
    sync_dir(path)  # the renames, on disk: a power loss now finds this version, not some of its files staged


def _current(path: Path) -> dict[str, Path]:
    """Where each file of the pool's version is now: a save whose staged meta exists is done, and its files not yet
    renamed are still staged."""
    if not _staged(path, META).exists():
        return {name: path / name for name in (ENTRIES, VECTORS, META)}
    return {
        name: staged if (staged := _staged(path, name)).exists() else path / name for name in (ENTRIES, VECTORS, META)
    }


def _stamp(path: Path) -> tuple[tuple[Path, ...], bytes | None]:
    """Where the pool's files are now, and what its meta holds (None where it cannot be read): each rename of a save
    changes one or the other."""
    files = _current(path)
    try:
        meta = files[META].read_bytes()
    except OSError:
        meta = None
    return tuple(files.values()), meta


def normalized(vectors: Sequence[Sequence[float]] | np.ndarray, where: str) -> np.ndarray:
    """``vectors`` as a float32 matrix with unit rows (A.7: u_i = E(k_i) / ||E(k_i)||_2); zero rows stay zero."""
    matrix = np.asarray(vectors, dtype=np.float32)
    if matrix.ndim != 2 or not matrix.shape[1] or not np.isfinite(matrix).all():
        raise PoolError(f"{where} must be a finite matrix of at least one column, got shape {matrix.shape}")
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return np.asarray(matrix / np.where(norms == 0.0, 1.0, norms), dtype=np.float32)


class Pool:
    """Entries with their vectors, searchable by cosine similarity. Changes are in memory until :meth:`save`."""

    def __init__(self, path: Path, meta: PoolMeta, entries: list[PoolEntry], vectors: np.ndarray) -> None:
        self.path = path
        self.meta = meta
        self.entries = entries
        self.vectors = vectors
        self._index: Any = None

    # ---- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str | Path, embedder_name: str) -> Pool:
        """A new, empty pool at ``path`` (written at once, version 0); an existing pool there is an error."""
        path = Path(path)
        if (path / META).exists():  # a create cut short (no meta in place yet) is made again
            raise PoolError(f"{path}: already holds an experience pool")
        pool = cls(path, PoolMeta(embedder=embedder_name), [], np.zeros((0, 0), dtype=np.float32))
        pool._write()
        return pool

    @classmethod
    def open(cls, path: str | Path, embedder_name: str | None = None) -> Pool:
        """The pool at ``path``; with ``embedder_name``, an error unless the pool was built with that model."""
        path = Path(path)
        for _ in range(READ_TRIES):
            before = _stamp(path)
            try:
                pool = cls._read(path)
            except PoolError:
                if _stamp(path) == before:
                    raise  # the files of one version: their own fault
                continue  # a save renamed some of them meanwhile: read the version it made
            if _stamp(path) == before:
                break
        else:
            raise PoolError(f"{path}: saves kept changing the pool while it was read ({READ_TRIES} tries)")
        if embedder_name is not None:
            pool.check_embedder(embedder_name)
        return pool

    @classmethod
    def _read(cls, path: Path) -> Pool:
        files = _current(path)
        meta = cls._read_meta(path, files[META])
        entries, vectors = cls._read_entries(files[ENTRIES], meta), cls._read_vectors(files[VECTORS], meta)
        cls._check_vectors(path, entries, vectors)
        return cls(path, meta, entries, vectors)

    @classmethod
    def check_folder(cls, path: str | Path) -> None:
        """An error unless ``path`` holds a pool whose metadata reads (what a run checks before its first call); a
        save's staged metadata stands for it."""
        path = Path(path)
        cls._read_meta(path, _current(path)[META])

    def check_embedder(self, embedder_name: str) -> None:
        """An error unless the pool was built with the embedding model ``embedder_name``. Where that is an endpoint's
        model not known yet (:data:`UNNAMED`: its role names none), the first embedding's reply says (:meth:`_embed`).
        A pool of an endpoint's model no reply named (a server that names none, or a pool saved before tmas recorded
        the served model) answers only to another such endpoint, or, while it holds no entries, takes the model its
        first entries are embedded with."""
        if embedder_name in (UNNAMED, self.meta.embedder) or (self.meta.embedder == UNNAMED and not self.entries):
            return
        if self.meta.embedder == UNNAMED:
            raise PoolError(
                f"{self.path}: pool built with an embedding model no reply named ({UNNAMED!r}), but the embedding role"
                f' now gets {embedder_name!r}; if {embedder_name!r} built it, set "embedder" to {embedder_name!r}'
                f" in {self.path / META}, else build the pool again"
            )
        raise PoolError(
            f"{self.path}: pool built with embedding model {self.meta.embedder!r}, "
            f"but the embedding role now gets {embedder_name!r}"
        )

    async def check_served(self, embed: EmbedFn) -> None:
        """An error unless the model that embeds now is the one whose vectors the pool holds, by name and dimension:
        one request, of the pool's first entry's text, for an embedder that knows its model only from a reply (an
        endpoint role that names none, :data:`UNNAMED`). A pool without entries takes any model."""
        if self.entries:
            await self._embed([self.entries[0].text], embed, "pool's first entry")

    @staticmethod
    def _read_meta(path: Path, file: Path) -> PoolMeta:
        try:
            meta = PoolMeta.model_validate_json(file.read_bytes())
        except FileNotFoundError:
            raise PoolError(f"{path}: no experience pool here (no {META})") from None
        except (ValidationError, ValueError) as exc:
            raise PoolError(f"{file}: corrupt pool metadata: {first_error(exc)}") from None
        except OSError as exc:
            raise PoolError(f"{file}: cannot read pool metadata: {exc.strerror or exc}") from None
        if meta.format != FORMAT:
            raise PoolError(f"{file}: not an experience pool (format {meta.format!r})")
        return meta

    @staticmethod
    def _read_entries(file: Path, meta: PoolMeta) -> list[PoolEntry]:
        entries: list[PoolEntry] = []
        try:
            data = file.read_bytes()
        except OSError as exc:
            raise PoolError(f"{file}: cannot read pool entries: {exc.strerror or exc}") from None
        # An id names one entry (in a run's record of what it retrieved, in update and remove): the line of each.
        seen: dict[str, int] = {}
        # Split at line feeds alone: an entry's text may hold U+2028, U+0085 and the like, which JSON writes as they
        # are and str.splitlines() would split the entry's line at. A byte-order mark an editor put first is no part
        # of the first entry.
        for number, raw in enumerate(data.removeprefix(_BOM).split(b"\n"), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PoolError(f"{file}:{number}: not valid UTF-8 (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                entry = PoolEntry.model_validate_json(line)
            except ValidationError as exc:
                raise PoolError(f"{file}:{number}: corrupt pool entry: {first_error(exc)}") from None
            if entry.id in seen:
                raise PoolError(f"{file}:{number}: entry id {entry.id!r} repeats line {seen[entry.id]}")
            seen[entry.id] = number
            entries.append(entry)
        if len(entries) != meta.count:
            raise PoolError(f"{file}: {len(entries)} entries, but {META} says {meta.count}")
        return entries

    @staticmethod
    def _read_vectors(file: Path, meta: PoolMeta) -> np.ndarray:
        if meta.count == 0:
            return np.zeros((0, meta.dim or 0), dtype=np.float32)
        try:
            raw = np.fromfile(file, dtype="<f4")
        except (OSError, ValueError) as exc:
            raise PoolError(f"{file}: cannot read pool vectors: {exc}") from None
        if not meta.dim or raw.size != meta.count * meta.dim:
            raise PoolError(f"{file}: {raw.size} floats, expected {meta.count} x {meta.dim}")
        return raw.reshape(meta.count, meta.dim).astype(np.float32)

    @staticmethod
    def _check_vectors(path: Path, entries: list[PoolEntry], vectors: np.ndarray) -> None:
        """Every row finite (a damaged file's NaN would rank its entry anywhere in every search)."""
        bad = np.flatnonzero(~np.isfinite(vectors).all(axis=1))
        if bad.size:
            row = int(bad[0])
            raise PoolError(f"{path / VECTORS}: row {row + 1} (entry {entries[row].id!r}) is not finite")

    def save(self) -> int:
        """Write the pool as a new version; returns that version."""
        self.meta.version += 1
        self._write()
        return self.meta.version

    def _write(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        # A save cut short after its meta was staged is the version read: in place before its staged files are
        # written over (a reader reading them meanwhile would take this save's for that one's).
        _finish_save(self.path)
        self.meta.count = len(self.entries)
        lines = "".join(entry.model_dump_json() + "\n" for entry in self.entries)
        self._stage(ENTRIES, lines.encode("utf-8"))
        self._stage(VECTORS, self.vectors.astype("<f4").tobytes())
        # Last, and complete before it has its staged name: from then on the save is done, whatever stops it.
        self._stage(META, self.meta.model_dump_json(indent=2).encode())
        _finish_save(self.path)

    def _stage(self, name: str, data: bytes) -> None:
        with replacing(_staged(self.path, name), "wb") as handle:
            handle.write(data)

    # ---- contents -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def content_digest(self) -> str:
        """An identity of what a retrieval reads from the pool: its embedding model, and each entry's id, text, keys
        (scope, domain, specialty, role, subject, difficulty, category, source question) and vector, in order. A
        build, an add or a prune that removes entries changes it; the lifecycle counters a prune sets (and the
        version a save bumps) do not, since no retrieval reads them. Hex SHA-256, 16 digits."""
        digest = hashlib.sha256(json.dumps([FORMAT, self.meta.embedder, self.meta.dim]).encode())
        for entry in self.entries:
            fields = entry.model_dump(include=_RETRIEVED_FIELDS)
            digest.update(json.dumps([fields, entry.text], sort_keys=True).encode() + b"\n")
        digest.update(self.vectors.astype("<f4").tobytes())
        return digest.hexdigest()[:16]

    def get(self, entry_id: str) -> PoolEntry | None:
        return next((e for e in self.entries if e.id == entry_id), None)

    async def add(self, entries: list[PoolEntry], embed: EmbedFn) -> None:
        """Embed ``entries`` (their :attr:`PoolEntry.text`) and add them; an id already present is an error."""
        if not entries:
            return
        known = {e.id for e in self.entries}
        for entry in entries:
            if entry.id in known:
                raise PoolError(f"{self.path}: entry id {entry.id!r} is already in the pool (use update)")
            known.add(entry.id)
        vectors = await self._embed([e.text for e in entries], embed, "entries")
        for entry in entries:
            entry.added_version = self.meta.version + 1
        if self.meta.removed:
            self.meta.removed = [i for i in self.meta.removed if i not in known]
        self.entries.extend(entries)
        self.vectors = vectors if not len(self.vectors) else np.vstack([self.vectors, vectors])
        self._index = None

    async def search(
        self, query: str, k: int, embed: EmbedFn, tier: Callable[[PoolEntry], int | None] | None = None
    ) -> list[tuple[PoolEntry, float]]:
        """The ``k`` entries nearest to ``query`` by cosine similarity (A.7: s_i = q^T u_i), best first, entries of
        one score in the order they were added.

        With ``tier``, entries are keyed before they are ranked: an entry whose tier is None is never returned, and
        a lower tier always comes before a higher one, cosine similarity ordering entries within a tier (education
        keys retrieval by role, subject and difficulty this way)."""
        if not self.entries or k <= 0:
            return []
        [q] = await self._embed([query], embed, "query")
        if tier is None:
            return self.nearest(q, k)
        tiers = [tier(e) for e in self.entries]
        rows = [i for i, t in enumerate(tiers) if t is not None]
        if not rows:
            return []
        if len(rows) == len(tiers) and len(set(tiers)) == 1:
            return self.nearest(q, k)  # every entry in one tier: the index's ranking
        scores = self.vectors[rows] @ q
        ranked = sorted(range(len(rows)), key=lambda j: (tiers[rows[j]], -float(scores[j]), rows[j]))[:k]
        return [(self.entries[rows[j]], float(scores[j])) for j in ranked]

    def nearest(self, query_vector: np.ndarray, k: int) -> list[tuple[PoolEntry, float]]:
        """:meth:`search` for an already embedded, normalised query vector."""
        if self._index is None:
            self._index = _faiss().IndexFlatIP(self.vectors.shape[1])
            self._index.add(self.vectors)
        scores, rows = self._index.search(query_vector.reshape(1, -1), min(k, len(self.entries)))
        # FAISS lists entries of one score newest first; the keyed ranking (and the prune) put the older first.
        found = sorted((-float(s), int(r)) for s, r in zip(scores[0], rows[0], strict=True) if r >= 0)
        return [(self.entries[r], -s) for s, r in found]

    def remove(self, ids: Iterable[str]) -> int:
        """Drop the entries with these ids (remembered in :attr:`PoolMeta.removed`); returns how many were dropped."""
        gone = set(ids)
        keep = [i for i, e in enumerate(self.entries) if e.id not in gone]
        dropped = len(self.entries) - len(keep)
        listed = set(self.meta.removed)
        self.meta.removed += [e.id for e in self.entries if e.id in gone and e.id not in listed]
        self.entries = [self.entries[i] for i in keep]
        self.vectors = self.vectors[keep] if keep else np.zeros((0, self.vectors.shape[1]), dtype=np.float32)
        self._index = None
        return dropped

    def update(self, entries: Iterable[PoolEntry]) -> None:
        """Replace entries by id (counters, reward, tags...). The embedded text must not change: that is a new
        entry (remove, then add), since its vector would no longer match."""
        position = {e.id: i for i, e in enumerate(self.entries)}
        for entry in entries:
            i = position.get(entry.id)
            if i is None:
                raise PoolError(f"{self.path}: no entry {entry.id!r} to update")
            if entry.text != self.entries[i].text:
                raise PoolError(f"{self.path}: entry {entry.id!r}: text changed; remove it and add the new one")
            self.entries[i] = entry

    async def _embed(self, texts: list[str], embed: EmbedFn, what: str) -> np.ndarray:
        # The model the embedder names before it is asked (an endpoint's role that names none: not known yet, so
        # nothing refused), then the one its reply named.
        self._take_embedder(embed)
        raw = await embed(texts)
        self._take_embedder(embed)
        vectors = normalized(raw, f"{self.path}: embeddings of the {what}")
        if len(vectors) != len(texts):
            raise PoolError(f"{self.path}: the embedder gave {len(vectors)} vectors for {len(texts)} {what}")
        dim = int(vectors.shape[1])
        if self.meta.dim is None:
            self.meta.dim = dim
        elif dim != self.meta.dim:
            raise PoolError(
                f"{self.path}: embeddings of dimension {dim}, but the pool's ({self.meta.embedder!r}) are "
                f"{self.meta.dim}: is another embedding model configured?"
            )
        return vectors

    def _take_embedder(self, embed: EmbedFn) -> None:
        """An error unless ``embed``'s model (its ``name``, where it has one) is the pool's; a new pool's model where
        no reply named it yet."""
        name = getattr(embed, "name", None)
        if isinstance(name, str) and self.meta.embedder == UNNAMED and not self.entries:
            self.meta.embedder = name
        elif isinstance(name, str):
            self.check_embedder(name)


def pool_summary(pool: Pool) -> dict[str, Any]:
    """What ``tmas pool show`` prints about the pool as a whole."""
    by_scope: dict[str, int] = {}
    for entry in pool.entries:
        by_scope[entry.scope] = by_scope.get(entry.scope, 0) + 1
    return {**pool.meta.model_dump(mode="json"), "path": str(pool.path), "by_scope": by_scope}
