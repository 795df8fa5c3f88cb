"""``tmas pool prune``: the pool's lifecycle, which paper 003 names as its limitation (its "Limitations"
paragraph: recency weighting, de-duplication, anomaly screening), in three documented rules applied in this order:

1. **Wrong-correlated entries.** From MATTRL runs graded against gold (wrong: a wrong math answer, or a medicine
   differential without the gold diagnosis first): an entry retrieved (``Utterance.experience_ids``)
   in at least ``min_uses`` problems, whose problems ended wrong at a rate at least ``wrong_margin`` above the
   runs' base wrong rate, is removed. Counting is per problem (one retrieval per problem however many turns used
   it). The entries' ``retrieved`` / ``retrieved_wrong`` counters are set to these counts. Only the problems that
   retrieved from this pool count, here and in the base rate (:attr:`Transcript.pool`; a run recorded before it
   was kept: its ``pool`` parameter): entry ids are unique only within a pool, and pools built from the same runs
   (one per credit scheme, say) share them, so another pool's retrievals would be counted as this one's.
2. **Near-duplicates.** Entries whose embeddings have cosine similarity >= ``duplicate_cosine`` are merged: the one
   with the higher reward (the older on a tie) stays and takes the others' retrieval counters. Only entries that
   retrieval keys alike merge (domain, and education's role, scope, subject and difficulty): a merge across them
   would take from some specialists the only entry they could be given.
3. **Recency.** An entry added at pool version a has weight ``recency_decay ** (V - a)`` at pool version V; entries
   whose weight has fallen below ``min_recency_weight`` are removed (defaults: 0.8 and 0.1, about ten versions).

The pool is saved as a new version unless ``dry_run`` or nothing changed (no entry removed, no counter set anew).
Runs given of which no graded problem retrieved from this pool are an error, and nothing is pruned: they say
nothing of its entries.
A prune holds the lock of the pool's writers (:mod:`tmas.pool.writing`) from reading the pool to saving it, so a
build or another prune of the same pool is refused meanwhile, and a prune is refused while one of them runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tmas.config import Settings
from tmas.errors import InputError
from tmas.grading.registry import GradeMode
from tmas.llm.model import ChatModel
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.pool.outcomes import DiagnosisMatch, load_transcripts
from tmas.pool.writing import writing
from tmas.store.run_store import RunStore, StoreError


class PruneConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duplicate_cosine: float = Field(default=0.92, gt=0.0, le=1.0)
    recency_decay: float = Field(default=0.8, gt=0.0, le=1.0)
    min_recency_weight: float = Field(default=0.1, ge=0.0, le=1.0)
    min_uses: int = Field(default=3, ge=1)
    wrong_margin: float = Field(default=0.3, ge=0.0, le=1.0)
    grade_mode: GradeMode = "combined"
    # Medicine: gold names matched by spelling, then by the diagnosis judge, as in ``tmas pool build``.
    match: DiagnosisMatch = "judge"
    dry_run: bool = False


@dataclass
class EntryUsage:
    uses: int = 0
    wrong: int = 0


@dataclass
class PoolUsage:
    """What the graded problems that retrieved from one pool say of it: per entry id, in how many it was retrieved
    and how many of those ended wrong; and how many problems there were, and how many ended wrong."""

    entries: dict[str, EntryUsage] = field(default_factory=dict)
    problems: int = 0
    wrong: int = 0

    @property
    def base_wrong_rate(self) -> float | None:
        return self.wrong / self.problems if self.problems else None


@dataclass
class PruneSummary:
    pool: Path
    before: int = 0
    after: int = 0
    wrong: list[str] = field(default_factory=list)
    merged: dict[str, list[str]] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)
    base_wrong_rate: float | None = None
    version: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


def recency_weight(entry: PoolEntry, version: int, decay: float) -> float:
    """decay^(V - a): 1 for an entry of the current version, smaller the older it is."""
    return float(decay ** max(0, version - entry.added_version))


async def retrieval_usage(
    run_dirs: list[Path],
    settings: Settings | None,
    grade_mode: GradeMode,
    notes: list[str],
    match: DiagnosisMatch = "judge",
    *,
    model: ChatModel | None = None,
) -> dict[str, PoolUsage]:
    """Per pool the graded problems of ``run_dirs`` retrieved from (its folder, resolved), what they say of it:
    problems that retrieved from none go to ``notes``. The grading's judge is ``model`` where given."""
    cases = await load_transcripts(run_dirs, settings, grade_mode=grade_mode, notes=notes, match=match, model=model)
    configured: dict[str, str | None] = {}
    usage: dict[str, PoolUsage] = {}
    without: dict[str, int] = {}
    for case in cases:
        pool = case.transcript.pool
        if pool is None:
            if case.run not in configured:
                configured[case.run] = configured_pool(Path(case.run))
            pool = configured[case.run]
        if pool is None:
            without[case.run] = without.get(case.run, 0) + 1
            continue
        counts = usage.setdefault(pool, PoolUsage())
        counts.problems += 1
        counts.wrong += _wrong(case.outcome)
        ids = {i for u in case.transcript.utterances for i in u.experience_ids}
        for entry_id in ids:
            entry = counts.entries.setdefault(entry_id, EntryUsage())
            entry.uses += 1
            entry.wrong += _wrong(case.outcome)
    notes.extend(f"{run}: {n} problems retrieved from no experience pool, not counted" for run, n in without.items())
    return usage


def configured_pool(run_dir: Path) -> str | None:
    """The pool folder (resolved) of a run's ``pool`` parameter, as its store records it: what a run recorded before
    its transcripts named their pool retrieved from. None for a run without one."""
    try:
        store = RunStore(run_dir, create=False)
    except StoreError as exc:
        raise InputError(str(exc)) from None
    with store:
        method = store.get_meta("method")
    params = method.get("params") if isinstance(method, dict) else None
    pool = params.get("pool") if isinstance(params, dict) else None
    return _resolved(Path(pool)) if isinstance(pool, str) and pool else None


def _resolved(path: Path) -> str:
    """A pool folder as runs name it in their transcripts (:attr:`Transcript.pool`)."""
    return str(path.resolve())


def _wrong(outcome: float) -> bool:
    """Not fully right: a wrong math answer, or a differential without the gold diagnosis first."""
    return outcome < 1.0


def wrong_correlated(usage: dict[str, EntryUsage], base_wrong_rate: float, min_uses: int, margin: float) -> list[str]:
    """Rule 1: ids used in >= ``min_uses`` problems with wrong rate >= base + ``margin``."""
    return sorted(
        entry_id
        for entry_id, u in usage.items()
        if u.uses >= min_uses and u.wrong / u.uses >= base_wrong_rate + margin - 1e-12
    )


def retrieval_keys(entry: PoolEntry) -> tuple[str, ...]:
    """What retrieval reads of an entry besides its text (:meth:`tmas.methods.mattrl_domains.Domain.retrieval_tier`):
    entries that differ in it are given to different specialists, or ranked apart."""
    return (entry.domain, entry.role, entry.scope, entry.subject, entry.difficulty)


def duplicate_groups(entries: list[PoolEntry], vectors: np.ndarray, threshold: float) -> dict[str, list[str]]:
    """Rule 2: keeper id -> ids merged into it. Entries are visited best first (reward, then age) and each joins
    the first kept entry of the same :func:`retrieval_keys` it is at least ``threshold`` similar to (rows of
    ``vectors`` are unit length)."""
    order = sorted(range(len(entries)), key=lambda i: (-entries[i].reward, entries[i].added_version, i))
    keepers: list[int] = []
    groups: dict[str, list[str]] = {}
    for i in order:
        keys = retrieval_keys(entries[i])
        similar = [
            k
            for k in keepers
            if retrieval_keys(entries[k]) == keys and float(vectors[i] @ vectors[k]) >= threshold - 1e-6
        ]
        if similar:
            groups.setdefault(entries[similar[0]].id, []).append(entries[i].id)
        else:
            keepers.append(i)
    return groups


async def prune_pool(
    pool_path: Path,
    run_dirs: list[Path],
    settings: Settings | None,
    config: PruneConfig,
    *,
    model: ChatModel | None = None,
) -> PruneSummary:
    """Prune the pool at ``pool_path`` by ``config``, counting each entry's uses (and wrong ones) in ``run_dirs``;
    their grading's judge asks the endpoint of ``settings``, or ``model``, the caller's own."""
    if config.dry_run:  # it saves nothing: a reader, beside any writer
        return await _prune(pool_path, run_dirs, settings, config, model)
    Pool.check_folder(pool_path)  # no build store made beside a folder that holds no pool
    # One writer of a pool at a time (a build or a prune): the pool is read, pruned and saved under the lock, or a
    # build's entries saved meanwhile would be lost to this save.
    with writing(pool_path, "tmas pool prune"):
        return await _prune(pool_path, run_dirs, settings, config, model)


async def _prune(
    pool_path: Path, run_dirs: list[Path], settings: Settings | None, config: PruneConfig, model: ChatModel | None
) -> PruneSummary:
    pool = Pool.open(pool_path)
    summary = PruneSummary(pool=pool_path, before=len(pool))
    counters = {e.id: (e.retrieved, e.retrieved_wrong) for e in pool.entries}
    if run_dirs:
        by_pool = await retrieval_usage(run_dirs, settings, config.grade_mode, summary.notes, config.match, model=model)
        # Counted only from the problems that retrieved from this pool (see rule 1).
        own = by_pool.pop(_resolved(pool_path), PoolUsage())
        if not own.problems:
            # Every counter would be set to 0 from no evidence, and the save would age every entry by a version.
            others = f" (they retrieved from {', '.join(sorted(by_pool))})" if by_pool else ""
            raise InputError(
                f"{pool_path}: no graded problem of the runs {', '.join(str(r) for r in run_dirs)} retrieved from "
                f"this pool{others}; nothing pruned"
            )
        summary.notes.extend(
            f"{u.problems} problems retrieved from another pool, {other}: not counted" for other, u in by_pool.items()
        )
        base = summary.base_wrong_rate = own.base_wrong_rate
        counted = []
        for entry in pool.entries:
            u = own.entries.get(entry.id, EntryUsage())
            counted.append(entry.model_copy(update={"retrieved": u.uses, "retrieved_wrong": u.wrong}))
        pool.update(counted)
        if base is not None:
            summary.wrong = [
                i for i in wrong_correlated(own.entries, base, config.min_uses, config.wrong_margin) if pool.get(i)
            ]
            pool.remove(summary.wrong)
    summary.merged = duplicate_groups(pool.entries, pool.vectors, config.duplicate_cosine)
    merged_away = {i: keeper for keeper, ids in summary.merged.items() for i in ids}
    if merged_away:
        totals: dict[str, tuple[int, int]] = {}
        for entry in pool.entries:
            if entry.id in merged_away:
                keeper = merged_away[entry.id]
                uses, wrong = totals.get(keeper, (0, 0))
                totals[keeper] = (uses + entry.retrieved, wrong + entry.retrieved_wrong)
        pool.update(
            e.model_copy(
                update={
                    "retrieved": e.retrieved + totals[e.id][0],
                    "retrieved_wrong": e.retrieved_wrong + totals[e.id][1],
                }
            )
            for e in pool.entries
            if e.id in totals
        )
        pool.remove(merged_away)
    version = pool.meta.version
    summary.stale = [
        e.id for e in pool.entries if recency_weight(e, version, config.recency_decay) < config.min_recency_weight
    ]
    pool.remove(summary.stale)
    summary.after = len(pool)
    # A prune that changes nothing saves no version: each would age every entry by one, and prunes alone (run on a
    # schedule, say) would drop the whole pool at the recency rule with nothing new added.
    now = {e.id: (e.retrieved, e.retrieved_wrong) for e in pool.entries}
    changed = summary.after != summary.before or any(now[i] != counters[i] for i in now)
    summary.version = pool.save() if changed and not config.dry_run else version
    return summary
