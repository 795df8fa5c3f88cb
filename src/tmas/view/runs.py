"""What the viewer shows of a run directory, read through a read-only store (another process may be writing it)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tmas.grading.grades import SELECTED, Grades, ItemKey
from tmas.grading.judge import JUDGE_ROLE
from tmas.grading.run_results import load_results, run_method_name
from tmas.llm.local_command import model_alias
from tmas.llm.weights import KNOWN_MODELS
from tmas.methods import method_traits, stored_params
from tmas.problems import Problem
from tmas.reports.frontier import FrontierPoint, run_frontier, votes_frontier
from tmas.reports.metrics import RunMetrics, Spend, compute_metrics, configured_iterations, run_spend
from tmas.reports.reply_quality import role_replies
from tmas.reports.where_lost import WhereLost, where_lost
from tmas.store.records import IterationRecord, ProblemResult, running_result
from tmas.store.run_store import DB_NAME, RunStore
from tmas.sweep import MANIFEST, POINTS_DIR
from tmas.view.bank_diff import BankChange, bank_diffs
from tmas.view.cache import RunCache, file_state
from tmas.view.live_grades import LiveGrades, live_grades
from tmas.view.vote_classes import Classes, VoteClasses


@dataclass(frozen=True)
class RunRef:
    """A run directory and the key that names it in URLs."""

    key: str
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def discover(paths: list[Path]) -> list[RunRef]:
    """The run directories among ``paths``; a directory that is not a run itself contributes its child runs (a
    ``tmas serve`` directory), and a sweep's directory the runs of its points, read anew each time so runs started
    later appear."""
    found: list[Path] = []
    for path in paths:
        if (path / DB_NAME).is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(_child_runs(path))
            if (path / MANIFEST).is_file():
                found.extend(_child_runs(path / POINTS_DIR))
    # A run given twice (itself, and in a directory given too) is listed once, where it came first.
    refs: dict[str, Path] = {}
    for path in found:
        refs.setdefault(hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10], path)
    return [RunRef(key, path) for key, path in refs.items()]


def _child_runs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / DB_NAME).is_file()) if folder.is_dir() else []


# A problem's status on the run page before any iteration of it finished.
PENDING = "pending"


@dataclass
class ProblemRow:
    problem_id: str
    question: str
    reference: str | None
    status: str  # done, failed, running (iterations recorded, no result yet), pending (no iteration yet)
    answer: str | None
    correct: bool | None  # the selected answer's verdict at the last iteration; None: not graded
    grade_source: str | None  # "rules" (graded live by the viewer), else the stored grades' mode
    iterations: int
    # What the problem spent: every call of it the store holds (an iteration a budget or an error cut short, a
    # failure before any iteration, a failed attempt asked again on resume, the calls of a problem still mid-way
    # included; the judge's left out), as tmas report's cost table counts them. ``tokens`` is prompt + completion.
    calls: int
    tokens: int
    completion_tokens: int


@dataclass
class RunSummary:
    method: str
    model: str | None
    model_detail: str | None
    params: dict[str, Any]
    problem_count: int
    status_counts: dict[str, int]
    costs: dict[str, int]

    @property
    def params_line(self) -> str:
        return params_line(self.method, self.params)


@dataclass
class RunOverview:
    method: str
    model: str | None
    # Where the model runs: "embedded: <what the weights are>" or the endpoint's address(es).
    model_detail: str | None
    params: dict[str, Any]
    problems: list[ProblemRow]
    # The run directory, whose store the call costs are read from when first shown.
    run_dir: Path
    status_counts: dict[str, int] = field(default_factory=dict)
    grades: LiveGrades | None = None
    # Why nothing is graded, where ``grades`` is None (:func:`why_not_graded`).
    not_graded: str = ""
    results: list[ProblemResult] = field(default_factory=list)
    # Per problem, its answers' classes as the run's votes group them (vote_classes.py), and how many problems are
    # still being grouped (their votes meanwhile group by spelling and exact numbers).
    classes: Classes = field(default_factory=dict)
    votes_pending: int = 0

    @property
    def params_line(self) -> str:
        """The method's parameters that differ from its defaults, in one line (all of them are in the details)."""
        return params_line(self.method, self.params)

    @functools.cached_property
    def roles(self) -> dict[str, dict[str, int]]:
        """Calls, failed calls and tokens per agent role: one pass over every call of the run, made when first shown
        (a comparison of runs never shows them)."""
        with RunStore(self.run_dir, read_only=True) as store:
            return store.role_costs()

    @functools.cached_property
    def costs(self) -> dict[str, int]:
        """The totals of :attr:`roles` over the method's roles: a judge that graded the run (``tmas report``) wrote its
        calls into the run's store, and they are its own row, not the method's cost."""
        return {key: sum(c[key] for role, c in self.roles.items() if role != JUDGE_ROLE) for key in _COST_KEYS}

    @functools.cached_property
    def spend(self) -> Spend:
        """What each problem's stored calls spent, by iteration (the judge's left out), read when first shown: what
        :attr:`metrics` and :attr:`frontier` count on their token axes, as :attr:`costs` and ``tmas report`` count."""
        with RunStore(self.run_dir, read_only=True) as store:
            return run_spend(store)

    @functools.cached_property
    def metrics(self) -> RunMetrics | None:
        """Accuracy and costs by iteration, worked out when first shown (a comparison of runs never shows them)."""
        if self.grades is None:
            return None
        # Majority vote's iterations add samples to one vote: its MV votes over all drawn so far, as the method does.
        # A run whose problems all stopped early has its tables run to the method's last iteration, as the report's.
        return compute_metrics(
            self.results,
            self.grades.grades,
            iterations=configured_iterations(stored_params(self.method, self.params)),
            classes=self.classes,
            pooled=method_traits(self.method).frontier == "votes",
            spend=self.spend,
        )

    @functools.cached_property
    def frontier(self) -> list[FrontierPoint]:
        """Accuracy against completion tokens (``tmas report``'s frontier), MV@k counting votes as :attr:`metrics`
        does; empty where the run is not graded."""
        if self.grades is None:
            return []
        votes = votes_frontier(self.method, stored_params(self.method, self.params))
        return run_frontier(self.results, self.grades.grades, majority=votes, classes=self.classes, spend=self.spend)

    @property
    def labeled(self) -> int:
        """Its problems with a reference answer: what its accuracies stand on once every problem has finished."""
        return sum(row.reference is not None for row in self.problems)

    @property
    def live_graded(self) -> bool:
        return self.grades is not None and bool(self.grades.live)


@dataclass
class LostAnswers:
    """The run's "where it loses" page: its method, the figures (with no problem graded, only the reply counts),
    whether its answers are graded (why not, where not: none has a reference answer, or the run is in proof mode, as
    ``tmas report`` leaves it ungraded), and whether any verdict is the viewer's own exact rule (live_grades.py)."""

    method: str
    lost: WhereLost
    graded: bool
    live_graded: bool
    why_not_graded: str = ""


# Why a run's pages grade none of its answers (its "where it loses" page then shows its reply counts alone).
PROOF_NOT_GRADED = "The run is in proof mode: its answers are proofs, not graded (as tmas report leaves them)"
UNLABELED_NOT_GRADED = "No problem of this run has a reference answer: nothing to grade"


def why_not_graded(method: str, params: dict[str, Any], labeled: bool) -> str:
    """Why none of a run's answers is graded, as ``tmas report`` leaves such a run ungraded; "" where they are.
    ``labeled``: whether any of its problems has a reference answer. A proof-mode run's candidates hold proofs, no
    answers: graded against references, every one would read as wrong."""
    if stored_params(method, params).get("mode") == "proof":
        return PROOF_NOT_GRADED
    if not labeled:
        return UNLABELED_NOT_GRADED
    return ""


_COST_KEYS = ("calls", "failed", "asked_again", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")


def params_line(method: str, params: dict[str, Any]) -> str:
    """``k=4, style=concise``: the scalar parameters a run set away from the method's defaults (all scalar ones
    when the method is unknown here)."""
    from tmas.methods import METHODS

    cls = METHODS.get(method)
    try:
        defaults = cls.Params().model_dump(mode="json") if cls is not None else {}
    except ValueError:  # a method whose parameters have required fields: show them all
        defaults = {}
    return ", ".join(
        f"{k}={v}"
        for k, v in params.items()
        if isinstance(v, str | int | float | bool) and (k not in defaults or defaults[k] != v)
    )


def describe_model(settings: dict[str, Any], call_model: str | None) -> tuple[str | None, str | None]:
    """The run's model name and where it runs, from its stored settings (else the first call's model)."""
    endpoint = settings.get("endpoint") or {}
    urls = [str(u) for u in endpoint.get("base_url") or []]
    if urls or not settings:
        return endpoint.get("model") or call_model, ", ".join(urls) or None
    local = str((settings.get("local") or {}).get("model") or "")
    if not local:
        return call_model, "embedded model"
    known = KNOWN_MODELS.get(local)
    if known is None:
        return model_alias(local), f"embedded: {local}"
    # The GGUF file: assembled into the model cache under the model's name, or the one file its package holds.
    file = f"{known.name}.gguf" if known.assemble else Path(known.files[0][1]).name
    return model_alias(local), f"embedded: {known.description}; file {file}"


def verdict(grades: Grades | None, key: tuple[str, int, int]) -> bool | None:
    """Correct when at least half of the judge runs say so, an undecided run counting against, as ``tmas report``
    labels a candidate (:meth:`Grades.majority_correct`); None when ungraded or undecided in every run."""
    if grades is None or key not in grades.verdicts:
        return None
    if all(v is None for v in grades.verdicts[key]):
        return None
    return grades.majority_correct(key)


def returned_nothing(result: ProblemResult | None, problem: Problem, grades: Grades | None) -> bool | None:
    """The verdict of a problem without a finished iteration: wrong where it ended so (it failed before any: it
    returned nothing, as ``tmas report`` counts it) in a graded run and has a reference answer; else none (pending, or
    not graded)."""
    ended = result is not None and not result.in_progress
    return False if ended and grades is not None and problem.answer is not None else None


class RunReader:
    """One page's view of a run: open it, read, close (``with RunReader(ref) as run: ...``)."""

    def __init__(self, ref: RunRef, cache: RunCache | None = None) -> None:
        self.ref = ref
        self.store = RunStore(ref.path, read_only=True)
        self.cache = cache

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.close()

    def results(self) -> list[ProblemResult]:
        """Finished problems' results and running problems' iterations so far (without texts when cached)."""
        return self.cache.results(self.store) if self.cache is not None else load_results(self.store)

    def not_graded(self) -> str:
        """Why none of the run's answers is graded (:func:`why_not_graded`); "" where they are. Every page that
        shows a verdict asks it first: two short queries, no problem read."""
        method_meta = self.store.get_meta("method") or {}
        params = dict(method_meta.get("params") or {})
        return why_not_graded(run_method_name(self.store), params, self.store.any_labeled())

    def grades(self, results: list[ProblemResult] | None = None) -> LiveGrades | None:
        """Stored grades, and the viewer's own exact-rule verdicts where there are none (see live_grades.py); None
        where the run is not graded (:meth:`not_graded`)."""
        if self.not_graded():
            return None
        memo = self.cache.verdicts(self.ref.path) if self.cache is not None and results is not None else None
        return live_grades(self.store, self.store.problems(), self.results() if results is None else results, memo)

    def problem_grades(
        self, problem: Problem, result: ProblemResult | None, records: list[IterationRecord]
    ) -> LiveGrades | None:
        """Grades of one problem's page (only its own answers are checked); None where the run is not graded."""
        if self.not_graded():
            return None
        if result is None:
            result = running_result(problem.problem_id, self._names()[0], records)
        return live_grades(self.store, [problem], [result], one_problem=True)

    def first_call_model(self) -> str | None:
        first = self.store.call(1)
        return first.model if first is not None else None

    def summary(self) -> RunSummary:
        """What the runs page shows: cheap (counts in SQL), nothing graded."""
        store = self.store
        method, params, model, detail = self._names()
        counts = RunCache.status_counts(store)
        costs = store.call_counts(JUDGE_ROLE, other_roles=True)
        return RunSummary(method, model, detail, params, store.problem_count(), counts, costs)

    def _names(self) -> tuple[str, dict[str, Any], str | None, str | None]:
        method_meta = self.store.get_meta("method") or {}
        settings = self.store.get_meta("settings") or {}
        model, detail = describe_model(settings, self.first_call_model())
        return run_method_name(self.store), dict(method_meta.get("params") or {}), model, detail

    def overview(self) -> RunOverview:
        """Everything the run page shows; with a cache, reused until the run's files change."""
        if self.cache is None:
            return self._overview()
        return self.cache.reuse(self.ref.path, "overview", self._state(), self._overview)

    def _overview(self) -> RunOverview:
        store = self.store
        method, params, model, detail = self._names()
        # Finished problems with their results, problems being solved with the iterations they finished so far.
        results = self.results()
        live = self.grades(results)
        grades = live.grades if live is not None else None
        classes, pending = self._classes(results) if live is not None else ({}, 0)
        by_id = {r.problem_id: r for r in results}
        # What each problem spent, counted in SQL as the run's cost table and tmas report count it.
        spent = store.problem_costs(JUDGE_ROLE, other_roles=True)
        rows = []
        for problem in store.iter_problems():
            pid = problem.problem_id
            result = by_id.get(pid)
            records = result.iterations if result is not None else []
            last = records[-1] if records else None
            cost = spent.get(pid) or {}
            key: ItemKey | None = (pid, last.iteration, SELECTED) if last else None
            rows.append(
                ProblemRow(
                    problem_id=pid,
                    question=problem.question,
                    reference=problem.answer,
                    status=result.status if result is not None else PENDING,
                    answer=result.answer if result is not None else None,
                    correct=verdict(grades, key) if key else returned_nothing(result, problem, grades),
                    grade_source=live.source(key) if live is not None and key else None,
                    iterations=len(records),
                    calls=cost.get("calls", 0),
                    tokens=cost.get("prompt_tokens", 0) + cost.get("completion_tokens", 0),
                    completion_tokens=cost.get("completion_tokens", 0),
                )
            )
        counts: dict[str, int] = {}
        for row in rows:
            counts[row.status] = counts.get(row.status, 0) + 1
        return RunOverview(
            method=method,
            model=model,
            model_detail=detail,
            params=params,
            problems=rows,
            run_dir=self.ref.path,
            status_counts=counts,
            grades=live,
            not_graded=self.not_graded() if live is None else "",
            results=results,
            classes=classes,
            votes_pending=pending,
        )

    def _classes(self, results: list[ProblemResult]) -> tuple[Classes, int]:
        """The answers' classes the run's votes group by: worked out in the background with a cache (until then a
        problem's votes group by spelling and exact numbers), at once without one."""
        if self.cache is not None:
            return self.cache.votes.classes(self.ref.path, results)
        votes = VoteClasses()
        votes.classes(self.ref.path, results)
        votes.wait()
        return votes.classes(self.ref.path, results)

    def marker(self) -> str:
        """The run's change marker, moving also when the viewer has grouped more of its votes (pages reload)."""
        marker = self.store.change_marker()
        grouped = self.cache.votes.version(self.ref.path) if self.cache is not None else 0
        return f"{marker}-v{grouped}" if grouped else marker

    def where_lost(self) -> LostAnswers:
        """Where the run loses its answers (tmas.reports.where_lost). Read from the full records (the overview's
        summaries leave out the candidates' verifications and the reply counts), so only when asked; with a cache,
        reused until the run's files change."""
        if self.cache is None:
            return self._where_lost()
        return self.cache.reuse(self.ref.path, "where_lost", self._state(), self._where_lost)

    def _state(self) -> tuple[object, ...]:
        """What a reused page is keyed by: the run's files (any write, settings included) and its change marker. The
        files alone can miss a write: once its WAL has restarted after a checkpoint, the WAL file keeps its size, and
        a write within the filesystem's time resolution of the last one leaves both unchanged."""
        return file_state(self.ref.path), self.marker()

    def _where_lost(self) -> LostAnswers:
        method = self._names()[0]
        replies = role_replies(self.store)
        reason = self.not_graded()
        if reason:
            return LostAnswers(method, WhereLost(replies=replies), False, False, reason)
        results = load_results(self.store)
        # No memo: it keeps the verdicts of the overview's summaries, and these are other result objects.
        live = live_grades(self.store, self.store.problems(), results)
        if live is None:
            return LostAnswers(method, WhereLost(replies=replies), False, False, UNLABELED_NOT_GRADED)
        lost = where_lost(method, results, live.grades, replies)
        return LostAnswers(method, lost, graded=True, live_graded=bool(live.live))

    def solved(self, problem_id: str) -> tuple[ProblemResult | None, list[IterationRecord]]:
        """The problem's result (None while it is being solved) and its iteration records: the result's when
        finished, else as stored so far. The result is read once (a thinking model's is megabytes)."""
        result = self.store.result(problem_id)
        return result, result.iterations if result else self.store.iterations(problem_id)

    def records(self, problem_id: str) -> list[IterationRecord]:
        """The problem's iteration records (:meth:`solved`)."""
        return self.solved(problem_id)[1]

    @staticmethod
    def iteration(
        records: list[IterationRecord], iteration: int
    ) -> tuple[IterationRecord, dict[str, list[BankChange]]] | None:
        """One iteration's record among the problem's ``records`` and what it changed in each memory bank."""
        index = next((i for i, r in enumerate(records) if r.iteration == iteration), None)
        if index is None:
            return None
        previous = records[index - 1].state if index > 0 else None
        return records[index], bank_diffs(previous, records[index].state)
