"""``tmas report``: grade runs, compute their metrics and analyses, and write Markdown + HTML reports with plots.

Runs on the same problems (the same benchmark) share one table like the paper's Table 1 (selected iterations) and
one like Tables 3-10 (every iteration), a plot of Pass@1 against iteration, and the accuracy-against-completion-tokens
frontier of every run (reports/frontier.py) with its equal-budget table. Each run then gets its own section; a run still
mid-way is reported from the iterations it finished (grading/run_results.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tmas.answer_rules import RuleEquivalence, math_verify_installed
from tmas.config import Settings
from tmas.errors import InputError
from tmas.grading.cases import case_metrics
from tmas.grading.grades import GradeConfig, Grades
from tmas.grading.judge import JUDGE_ROLE, judge_route
from tmas.grading.run_results import load_results, run_method_name
from tmas.grading.runs import grade_run, load_grades, load_last_grades
from tmas.llm.types import DOWNGRADES, Usage
from tmas.methods import method_traits, stored_params
from tmas.methods.base import ProblemResult, ReplyTally
from tmas.methods.selection import SELECT_FROM, SELECT_RULES, SelectFrom, SelectRule
from tmas.problems import Problem
from tmas.reports.analysis import (
    ExperienceTrace,
    GuidelineDiversity,
    ScoreDynamics,
    StoppingSummary,
    experience_trace,
    most_improved,
    score_dynamics,
    stopping_summary,
    stopping_tradeoff,
    unique_guidelines,
)
from tmas.reports.budget_table import BudgetSpend, budget_section, budget_spend
from tmas.reports.case_table import case_section
from tmas.reports.document import Bullets, Document, Heading, Image, Paragraph, Table
from tmas.reports.frontier import BUDGETS, FrontierPoint, equal_budget, run_frontier, votes_frontier
from tmas.reports.metrics import (
    RunMetrics,
    Spend,
    answer_classes_of,
    compute_metrics,
    configured_iterations,
    run_spend,
    short_of,
    stands_on,
)
from tmas.reports.paper_table import paper_section
from tmas.reports.plots import Series, off_log_axis, plot_frontier, plot_pass1
from tmas.reports.reply_quality import reply_quality_section, role_replies
from tmas.reports.roc import ScoreSeparation, confidence_separation, score_separation
from tmas.reports.selection_table import SelectionTable, has_scores, selection_table
from tmas.reports.where_lost import WhereLost, where_lost, where_lost_section
from tmas.store.run_store import DB_NAME, RunStore, StoreError, check_began, resolved_once

# At most this many columns in the "selected iterations" table (the paper shows six).
SELECTED_COLUMNS = 6
# At most this many iteration columns in the selection-rule table.
RULE_COLUMNS = 10


@dataclass
class RunEvaluation:
    run_dir: Path
    label: str
    benchmark: str
    method: str
    # The method's parameters as stored, with the defaults of those the run did not store (stored_params).
    params: dict[str, Any]
    model: str | None
    problems: int
    done: int
    failed: int
    metrics: RunMetrics
    grades: Grades | None
    not_graded_reason: str = ""
    cost: RunCost = field(default_factory=lambda: RunCost())
    dynamics: ScoreDynamics | None = None
    guidelines: GuidelineDiversity | None = None
    trace: ExperienceTrace | None = None
    stopping: StoppingSummary | None = None
    # Problems with finished iterations but no result yet (the run was stopped or is still going).
    running: int = 0
    frontier: list[FrontierPoint] = field(default_factory=list)
    selection: SelectionTable | None = None
    separation: ScoreSeparation | None = None
    replies: dict[str, ReplyTally] = field(default_factory=dict)
    # Kind -> where (the endpoint URL and the model refused) -> the server's refusal, for what the run went on without
    # (tmas.llm.types.DOWNGRADES).
    downgrades: dict[str, dict[str, str]] = field(default_factory=dict)
    # The run's one-line notices (e.g. confidence rules on a server without log-probabilities).
    notices: dict[str, str] = field(default_factory=dict)
    # Failed calls (``failed``: never asked again; ``asked_again``: failed, then asked again) and retried
    # attempts (``retried``) by cause, over the run's calls; the judge's apart.
    causes: dict[str, dict[str, int]] = field(default_factory=dict)
    judge_causes: dict[str, dict[str, int]] = field(default_factory=dict)
    # Seconds the run's finished calls (the judge's left out) waited inside tmas (``queued``) and for the server's
    # first chunk (``first_token``).
    waits: dict[str, list[float]] = field(default_factory=dict)
    # Whether the candidates' confidence (DeepConf) tells right from wrong, where the run recorded confidence.
    confidence: ScoreSeparation | None = None
    # The paper's name of the run's benchmark, where a paper grid set it (reports/paper_numbers.py).
    paper_benchmark: str | None = None
    # A medicine or education run's own metrics (grading/cases.py), with ``cases``, their count.
    cases: dict[str, Any] | None = None
    # The run's budget per problem and what its problems spent, as the budget counts (None: no budget).
    budget: BudgetSpend | None = None
    # A digest of its problem ids (problem_set): runs share tables only on the same problems.
    problem_set: str = ""
    # Its problems with a reference answer: what its accuracies stand on once every problem has finished.
    labeled_problems: int = 0
    # Candidates whose call failed (Pass@1 counts each as a wrong rollout; MV@all gives it no vote); a sample stopped
    # by online stopping is none (no rollout: the stopping summary counts it).
    failed_rollouts: int = 0
    # Where it loses its answers (None: not graded), from the records its grades were given on: a run still going
    # has finished more since, which no grade covers.
    losses: WhereLost | None = None


def benchmark_name(store: RunStore) -> str:
    """The run's dataset name when recorded, else a name fixed by its problem ids (so equal sets group)."""
    name = store.get_meta("dataset")
    if isinstance(name, str) and name:
        return name
    return f"problems-{len(store.problems())}-{problem_set(store)}"


def problem_set(store: RunStore) -> str:
    """A digest of the run's problem ids: runs share tables only on the same problems."""
    ids = [p.problem_id for p in store.problems()]
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:8]


def benchmark_groups(evaluations: list[RunEvaluation]) -> dict[str, list[RunEvaluation]]:
    """The runs by the problems they solved, under their benchmark's name; runs of one benchmark on other problems
    (a --limit, another filter) are other groups, named with their number of problems (and digest where that ties)."""
    groups: dict[tuple[str, str], list[RunEvaluation]] = defaultdict(list)
    for e in evaluations:
        groups[e.benchmark, e.problem_set].append(e)
    sets = Counter(bench for bench, _ in groups)
    sizes = Counter((bench, runs[0].problems) for (bench, _), runs in groups.items())
    named: dict[str, list[RunEvaluation]] = {}
    for (bench, digest), runs in groups.items():
        name = bench
        if sets[bench] > 1:
            size = runs[0].problems
            plural = "" if size == 1 else "s"
            name = f"{bench} ({size} problem{plural}{f', {digest}' if sizes[bench, size] > 1 else ''})"
        named[name] = runs
    return named


async def _answer_classes(results: list[ProblemResult], config: GradeConfig) -> dict[str, dict[str, str]] | None:
    """Candidate answers grouped by the grading rules' equivalence, so MV@k counts votes as the methods do; None
    without Math-Verify (votes then group by spelling and exact numbers)."""
    if not math_verify_installed():
        return None
    equivalence = RuleEquivalence(workers=config.workers, timeout_s=config.rule_timeout_s)
    try:
        return await answer_classes_of(results, equivalence)
    finally:
        await equivalence.aclose()


def _label(method: str, model: str | None) -> str:
    return method + (f" [{model}]" if model else "")


@dataclass
class StoredSetup:
    """What a run's store says of its setup: the method and its parameters (stored_params), the settings as
    stored, and the model."""

    method: str
    params: dict[str, Any]
    settings: dict[str, Any]
    meta: dict[str, Any]
    model: str | None

    @classmethod
    def read(cls, store: RunStore) -> StoredSetup:
        meta = store.get_meta("method") or {}
        settings = store.get_meta("settings") or {}
        method = run_method_name(store)
        # The endpoint's model, or the one run in process (--hf-model).
        model = (settings.get("endpoint") or {}).get("model") or (settings.get("hf") or {}).get("model")
        return cls(method, stored_params(method, meta.get("params")), settings, meta, model)


async def evaluate_run(
    run_dir: Path,
    config: GradeConfig | None,
    settings: Settings | None,
    *,
    grade: bool = True,
    on_read: Callable[[bool, str], None] | None = None,
) -> RunEvaluation:
    """Grade (or read stored grades of) one run and compute everything the report shows. ``config`` None: grade with
    the default grader, or with ``grade`` off read the stored grades as the run's last grading read them.
    ``on_read`` hears, before the run's results are read, whether it is graded now and, where it never is, why."""
    check_began(run_dir, "report")  # before it is opened: an empty store file is left as it is
    with RunStore(run_dir, create=False) as store:
        setup = StoredSetup.read(store)
        if store.get_meta("settings") is None and not store.call_counts()["calls"]:
            # A store a run left before its setup and first call (stopped while it stored its problems, or an empty
            # file): a report of it would show a run of no method, "unlabeled", for a run that never began.
            raise StoreError(f"{run_dir}: holds no run to report: it was stopped before its first call")
        problems = store.problems()
        if on_read is not None:
            never = _never_graded(setup, problems)
            on_read(grade and not never, never)
        results = load_results(store)
        grades, reason = await _grades(store, setup, problems, config, settings, grade=grade)
        classes = await _answer_classes(results, config or GradeConfig())
        # Every table and plot on a token axis reads what the problems' stored calls spent, as the cost table does.
        spend = run_spend(store)
        evaluation = RunEvaluation(
            run_dir=run_dir,
            label=_label(setup.method, setup.model),
            benchmark=benchmark_name(store),
            problem_set=problem_set(store),
            method=setup.method,
            params=setup.params,
            model=setup.model,
            problems=len(problems),
            labeled_problems=sum(p.answer is not None for p in problems),
            failed_rollouts=sum(
                c.error is not None and not c.meta.stopped_early
                for r in results
                for rec in r.iterations
                for c in rec.candidates
            ),
            done=sum(r.status == "done" for r in results),
            failed=sum(r.status != "done" and not r.in_progress for r in results),
            running=sum(r.in_progress for r in results),
            metrics=compute_metrics(
                results,
                grades,
                iterations=configured_iterations(setup.params),
                classes=classes,
                pooled=method_traits(setup.method).frontier == "votes",
                spend=spend,
            ),
            grades=None if reason else grades,
            not_graded_reason=reason,
            cost=run_cost(results, store),
        )
        if not reason:
            _graded_analyses(evaluation, results, grades, classes, spend)
        _run_records(evaluation, store, results, setup, spend)
        if not reason:
            evaluation.losses = where_lost(setup.method, results, grades, evaluation.replies)
    # Medicine names match by spelling, then by the judge role, unless grading by rules alone or nothing new.
    mode = (config or GradeConfig()).mode
    judge = _judge_settings(settings, setup.settings) if grade and mode != "rules" else None
    evaluation.cases = await case_metrics(run_dir, setup.params, judge)
    return evaluation


async def _grades(
    store: RunStore,
    setup: StoredSetup,
    problems: list[Problem],
    config: GradeConfig | None,
    settings: Settings | None,
    *,
    grade: bool,
) -> tuple[Grades, str]:
    """The run's grades (graded now, or as stored with ``grade`` off: as ``config`` grades, as many judge runs as it
    asks for, or without one as the run's last grading read them), and why there are none where there are not (then
    grades that only name the unlabeled problems)."""
    grades: Grades | None = None
    reason = _never_graded(setup, problems)
    if not reason and grade:
        grades = await grade_run(store, config or GradeConfig(), _judge_settings(settings, setup.settings))
    elif not reason:
        grades = load_last_grades(store) if config is None else load_grades(store, config, runs=config.judge_runs)
        if grades is None:
            reason = "not graded yet (run 'tmas report' without --no-grade)"
    if grades is None:
        grades = Grades(runs=1, unlabeled=[p.problem_id for p in problems if p.answer is None])
    return grades, reason


def _never_graded(setup: StoredSetup, problems: list[Problem]) -> str:
    """Why no grading ever reads the run's answers ("" where one can): proofs, or no problem with a reference."""
    if setup.params["mode"] == "proof":
        return "proof mode: answers are proofs, not graded"
    if not any(p.answer is not None for p in problems):
        return "no problem has a reference answer (unlabeled): nothing graded"
    return ""


def _graded_analyses(
    e: RunEvaluation,
    results: list[ProblemResult],
    grades: Grades,
    classes: dict[str, dict[str, str]] | None,
    spend: Spend,
) -> None:
    """What only a graded run shows: its frontier, the selection rules and the scores' separation, the confidence's,
    the score dynamics and the trace of its most improved problem."""
    votes = votes_frontier(e.method, e.params)
    e.frontier = run_frontier(results, grades, majority=votes, classes=classes, spend=spend)
    if has_scores(results):
        e.selection = selection_table(
            results,
            grades,
            str(e.params["mode"]),
            classes=classes,
            # Replayed as the run selected: with the answer fallback only where the run had it.
            fallback=e.params.get("answer_fallback") is True,
            own=own_rule(e.method, e.params),
        )
        e.separation = score_separation(results, grades)
    # Confidence, by the measure the run's rules read (a method without confidence parameters has none).
    measure = e.params.get("confidence_measure")
    measured = confidence_separation(results, grades, str(measure)) if measure is not None else None
    e.confidence = measured if measured is not None and measured.available else None
    e.dynamics = score_dynamics(results, grades)
    improved = most_improved(results, grades)
    e.trace = experience_trace(improved, grades) if improved else None


def own_rule(method: str, params: dict[str, Any]) -> tuple[SelectRule, SelectFrom] | None:
    """The selection rule and candidates a run of ``method`` returned its answer by (its stored ``select`` and
    ``select_from``), where its method declares that its answer follows them; None otherwise."""
    rule, pool = params.get("select"), params.get("select_from")
    if not method_traits(method).selects or rule not in SELECT_RULES or pool not in SELECT_FROM:
        return None
    return rule, pool


def _run_records(
    e: RunEvaluation, store: RunStore, results: list[ProblemResult], setup: StoredSetup, spend: Spend
) -> None:
    """What every run shows, graded or not, read from its store."""
    paper_benchmark = store.get_meta("paper_benchmark")
    e.paper_benchmark = paper_benchmark if isinstance(paper_benchmark, str) else None
    e.guidelines = unique_guidelines(results, setup.meta)
    e.stopping = stopping_summary(results)
    again = {pid: c["asked_again"] for pid, c in store.problem_costs(JUDGE_ROLE, other_roles=True).items()}
    e.budget = budget_spend(setup.settings, results, spend, again)
    e.replies = role_replies(store)
    e.downgrades = store.downgrade_messages()
    e.notices = store.notices()
    # The judge's calls, stored in the run by its grading, are not the method's: counted apart, as in the cost table.
    e.causes = store.call_causes(JUDGE_ROLE, other_roles=True)
    e.judge_causes = store.call_causes(JUDGE_ROLE)
    e.waits = store.call_waits(JUDGE_ROLE, other_roles=True)


@dataclass
class RunCost:
    """A run's calls and tokens, as its store counts them (the viewer and the run's summary count the same): every
    call of the method's roles, and the judge's apart. ``failed_calls``: those the run was left with; ``asked_again``:
    those that failed and were asked again (a resume asks each failed call once more), counted in ``calls`` and
    ``usage`` (they spent what the server generated) but no failure of the run. ``problems``: how many problems they
    were spent on (a run stopped early has started only some)."""

    problems: int = 0
    calls: int = 0
    failed_calls: int = 0
    asked_again: int = 0
    usage: Usage = field(default_factory=Usage)
    judge_calls: int = 0
    judge_tokens: int = 0


def run_cost(results: list[ProblemResult], store: RunStore) -> RunCost:
    # Counted in SQL: reading the calls themselves would decompress every reply's text (a thinking model's run holds
    # gigabytes of reasoning).
    spent = store.call_counts(JUDGE_ROLE, other_roles=True)
    started = {r.problem_id for r in results} | store.called_problems(JUDGE_ROLE, other_roles=True)
    cost = RunCost(
        problems=len(started),
        calls=spent["calls"],
        failed_calls=spent["failed"],
        asked_again=spent["asked_again"],
        usage=Usage(
            prompt_tokens=spent["prompt_tokens"],
            completion_tokens=spent["completion_tokens"],
            reasoning_tokens=spent["reasoning_tokens"],
            cached_prompt_tokens=spent["cached_prompt_tokens"],
        ),
    )
    judged = store.role_costs().get(JUDGE_ROLE)
    if judged is not None:
        cost.judge_calls = judged["calls"]
        cost.judge_tokens = judged["prompt_tokens"] + judged["completion_tokens"]
    return cost


def _judge_settings(given: Settings | None, stored: dict[str, Any]) -> Settings | None:
    """The settings the judge uses: those given when they name a judge (:func:`tmas.grading.judge.judge_route`),
    else the run's own with the judge role given (``--judge-model``, ``[roles.judge]``) on top of the run's."""
    if judge_route(given) is not None:
        return given
    try:
        run = Settings.model_validate(stored) if stored else None
    except ValidationError:
        run = None
    if run is None or given is None or JUDGE_ROLE not in given.roles:
        return run or given
    data = run.model_dump(mode="json")
    judge = given.roles[JUDGE_ROLE].model_dump(mode="json", exclude_unset=True)
    data["roles"][JUDGE_ROLE] = {**data["roles"].get(JUDGE_ROLE, {}), **judge}
    return Settings.model_validate(data)


def _unique_labels(evaluations: list[RunEvaluation]) -> None:
    """Runs that share a label are told apart by the parameters that differ between them, else by directory."""
    groups: dict[str, list[RunEvaluation]] = defaultdict(list)
    for e in evaluations:
        groups[e.label].append(e)
    for label, members in groups.items():
        if len(members) < 2:
            continue
        keys = sorted({k for e in members for k in e.params})
        differing = [k for k in keys if len({repr(e.params.get(k)) for e in members}) > 1]
        for e in members:
            shown = ", ".join(f"{k}={e.params.get(k)}" for k in differing)
            e.label = f"{label} ({shown})" if shown else label
        if len({e.label for e in members}) < len(members):
            for e in members:
                e.label = f"{e.label} <{e.run_dir.name}>"


def selected_iterations(last: int, columns: int = SELECTED_COLUMNS) -> list[int]:
    """Evenly spread iterations from 0 to ``last`` (all of them when few), like Table 1's representative columns."""
    if last + 1 <= columns:
        return list(range(last + 1))
    return sorted({round(i * last / (columns - 1)) for i in range(columns)})


def cached_share(cached: int, prompt: int) -> str:
    """The share of prompt tokens served from the servers' prompt caches, with the count ("-" without prompt)."""
    return f"{100 * cached / prompt:.1f}% ({cached})" if prompt else "-"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "benchmark"


def _file_names(benchmarks: list[str]) -> dict[str, str]:
    """Each benchmark's part of its plots' file names: its slug, with a digest of its name where two slugs meet
    ("a b" and "a_b"; names in another script, which have no letters a slug keeps)."""
    slugs = {bench: _slug(bench) for bench in benchmarks}
    taken = Counter(slugs.values())
    digest = {bench: hashlib.sha256(bench.encode()).hexdigest()[:6] for bench in benchmarks}
    return {bench: slug if taken[slug] == 1 else f"{slug}-{digest[bench]}" for bench, slug in slugs.items()}


def write_report(evaluations: list[RunEvaluation], out_dir: Path, *, paper_model: str | None = None) -> dict[str, Path]:
    """Write report.md, report.html and the PNG plots into ``out_dir``; returns the paths by kind. ``paper_model``:
    the paper's model the runs stand for, where their model names do not say (see reports/paper_numbers.py)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _unique_labels(evaluations)
    doc = Document("tmas evaluation report")
    written: dict[str, Path] = {}
    by_benchmark = benchmark_groups(evaluations)
    files = _file_names(list(by_benchmark))
    doc.add(
        Paragraph(
            "Pass@1 as in the TMAS paper (A.2): per problem the share of rollouts judged correct, "
            "averaged over problems, then over judge runs; a rollout without an answer, or whose call failed, counts "
            "as wrong; a sample stopped while it streamed (online_stop, DeepConf) is no rollout and is left out, "
            "of MV@all and the frontier's MV@k too (no vote, and no wrong one). "
            "Values in %. In each run's per-iteration table, Pass@1 "
            "std. error is its standard error across problems (as the frontier's band); MV@all is what plain majority "
            "vote over the iteration's candidates gives (for majority vote, over every sample drawn up to it, as the "
            "method votes), ties between answers split evenly: the frontier's MV@k at every sample; Selected is the "
            "answer the method returned, by its own rule and tie-break."
        )
    )
    for bench, runs in by_benchmark.items():
        doc.add(Heading(2, f"Benchmark: {bench}"))
        graded = [e for e in runs if e.grades is not None]
        for e in runs:
            if e.not_graded_reason:
                doc.add(Paragraph(f"{e.label}: {e.not_graded_reason}."))
        if graded:
            _benchmark_tables(doc, graded)
            case_section(doc, graded)
            paper_section(doc, graded, paper_model)
            name = f"pass1_vs_iteration_{files[bench]}.png"
            plot_pass1([(e.label, e.metrics) for e in graded], f"{bench}: Pass@1 vs iteration", out_dir / name)
            written[name] = out_dir / name
            doc.add(Image(name, f"Pass@1 against iteration on {bench}"))
            written.update(_frontier_part(doc, graded, bench, files[bench], out_dir))
            _stopping_comparisons(graded)
            where_lost_section(doc, graded)
        for e in runs:
            _run_section(doc, e)
    written["markdown"] = out_dir / "report.md"
    written["html"] = out_dir / "report.html"
    written["markdown"].write_text(doc.markdown(), encoding="utf-8")
    written["html"].write_text(doc.html(), encoding="utf-8")
    return written


def _frontier_part(doc: Document, runs: list[RunEvaluation], bench: str, slug: str, out_dir: Path) -> dict[str, Path]:
    """The frontier plot (and the data it plots, as JSON) and the equal-budget table read off it."""
    doc.add(Heading(3, "Accuracy against completion tokens"))
    doc.add(
        Paragraph(
            "Accuracy of the answer each run returns against the mean cumulative completion tokens per problem: one "
            "point per iteration; for majority vote MV@k (k = 1, 2, 4, ...) as the exact expectation over random "
            "k-subsets of its stored samples (ties between answers split evenly), at k samples' expected tokens. "
            "The band is one standard error across problems. Per-point problem counts are in each run's section. "
            "Tokens are those of every call the run stored, as the cost table counts them: a call that failed, was "
            "cancelled, or failed and was asked again on resume is charged what the server generated for it."
        )
    )
    image, data = f"frontier_{slug}.png", f"frontier_{slug}.json"
    drawn = plot_frontier(
        [(e.label, e.frontier) for e in runs], f"{bench}: accuracy vs completion tokens", out_dir / image
    )
    _write_series(out_dir / data, drawn, {e.label: e.frontier for e in runs})
    doc.add(Image(image, f"Accuracy against completion tokens per problem on {bench}"))
    off = off_log_axis([(e.label, e.frontier) for e in runs])
    if off:
        named = "; ".join(f"{label}: {', '.join(points)}" for label, points in off.items())
        doc.add(
            Paragraph(
                f"Not drawn, at 0 completion tokens per problem (the server reported no token usage), which the "
                f"plot's logarithmic axis has no place for: {named}. They are in each run's frontier points and in "
                "the equal-budget table."
            )
        )
    doc.add(Heading(3, "Accuracy (%) at equal completion-token budgets"))
    doc.add(
        Paragraph(
            "Per budget (completion tokens per problem), the best frontier point at or under it; "
            "'-' where the run never spent that little."
        )
    )
    rows = []
    for e in runs:
        # A point of a run short of problems says on how many it stands, as the Pass@1 tables' cells do.
        cells = [_pct(p.accuracy) + stands_on(p, e.labeled_problems) if p else "-" for p in equal_budget(e.frontier)]
        rows.append([e.label, *cells])
    doc.add(Table(["Method", *[f"<= {b // 1000}k" for b in BUDGETS]], rows))
    return {image: out_dir / image, data: out_dir / data}


def _write_series(path: Path, drawn: list[Series], points: dict[str, list[FrontierPoint]]) -> None:
    """What the frontier plot drew, with every point's label, band and problem count."""
    lines = {s.label: s for s in drawn}
    # A run with no point drawn (every one at 0 tokens on a logarithmic axis) keeps its points, with no line.
    payload = {
        label: {
            "x": lines[label].x if label in lines else [],
            "y": lines[label].y if label in lines else [],
            "points": [dataclasses.asdict(p) for p in run_points],
        }
        for label, run_points in points.items()
        if run_points
    }
    path.write_text(json.dumps(payload, indent=2), encoding="utf-8")


def _benchmark_tables(doc: Document, runs: list[RunEvaluation]) -> None:
    last = max((e.metrics.iterations[-1].iteration for e in runs if e.metrics.iterations), default=0)
    chosen = selected_iterations(last)
    doc.add(Heading(3, "Pass@1 (%) at selected iterations"))
    rows = [[e.label, *[_pass1_cell(e, t) for t in chosen]] for e in runs]
    doc.add(Table(["Method", *[f"It{t}" for t in chosen]], rows))
    doc.add(Heading(3, "Pass@1 (%) at every iteration"))
    rows = [[e.label, *[_pass1_cell(e, t) for t in range(last + 1)]] for e in runs]
    doc.add(Table(["Method", *[f"It{t}" for t in range(last + 1)]], rows))
    partial = [e for e in runs if short_of(e.metrics, e.labeled_problems)]
    if partial:
        held = "; ".join(
            f"{e.label} holds {e.problems} problem{'' if e.problems == 1 else 's'} ({_problem_states(e)})"
            for e in partial
        )
        doc.add(
            Paragraph(
                f"Not every run stands on every problem: {held}. Such a run is reported from the problems it "
                "reached, its cells above saying how many; its figures here and in the plots and tables below are "
                "over fewer problems than a finished run's, not a comparison with them."
            )
        )
    doc.add(Heading(3, "Cost"))
    rows = []
    for e in runs:
        c, u = e.cost, e.cost.usage
        rows.append(
            [
                e.label,
                str(c.calls),
                str(c.failed_calls),
                str(c.asked_again),
                str(u.prompt_tokens),
                cached_share(u.cached_prompt_tokens, u.prompt_tokens),
                str(u.completion_tokens),
                str(u.reasoning_tokens),
                f"{u.completion_tokens / max(1, c.problems):.0f}",
                f"{(u.prompt_tokens + u.completion_tokens) / max(1, c.problems):.0f}",
                str(c.judge_calls),
                str(c.judge_tokens),
            ]
        )
    headers = ["Method", "Calls", "Failed", "Failed, then asked again", "Prompt tokens", "Cached prompt"]
    headers += ["Completion tokens", "Reasoning tokens"]
    per_problem = ["Completion tokens/problem", "Prompt + completion tokens/problem"]
    doc.add(Table([*headers, *per_problem, "Judge calls", "Judge prompt + completion tokens"], rows))
    doc.add(
        Paragraph(
            "Every call of the method's roles, the judge's apart, as the viewer and the run's summary count them. "
            "Failed: the calls the run was left with failed. Failed, then asked again: attempts that failed and were "
            "asked again later (a resume asks each failed call once more), counted in calls and tokens (they spent "
            "what the server generated for them) but no failure of the run. Reasoning tokens are part of completion "
            "tokens, "
            "where the server reports them. Cached prompt: the share of prompt tokens the server took from its prompt "
            "cache instead of computing them, as it reported them (0 where it did not). Per problem: over the problems "
            "the run started. Completion tokens/problem is what the frontier, the equal-budget table and the budget "
            "table count, over the same calls (failed attempts asked again included; a problem still mid-way counts "
            "there only the iterations it finished); "
            "prompt + completion tokens/problem is what a hosted API bills."
        )
    )
    budget_section(doc, runs)


def _pass1_cell(e: RunEvaluation, iteration: int) -> str:
    """A run's Pass@1 at ``iteration`` in a table shared with other runs: "-" beyond its last iteration (as the paper
    shows non-iterative baselines) or where no labeled problem reached it, and the problems it stands on where they are
    fewer than the run's labeled problems (a run still mid-way, or stopped before every problem started)."""
    m = e.metrics.at(iteration)
    if m is None or not m.problems:
        return "-"
    return _pct(m.pass1) + stands_on(m, e.labeled_problems)


def _stopping_comparisons(runs: list[RunEvaluation]) -> None:
    """For a run that stopped problems or samples early, compare with a run of the same method and parameters, its
    stopping rules aside, that stopped none (by a budget neither)."""
    for e in runs:
        if e.stopping is None or not e.stopping.any:
            continue
        full = next(
            (
                o
                for o in runs
                if o is not e
                and o.method == e.method
                and without_stopping(o.params) == without_stopping(e.params)
                and o.stopping
                and not o.stopping.any
                and not (o.budget and o.budget.stopped)
            ),
            None,
        )
        if full is not None:
            stopping_tradeoff(e.stopping, e.metrics, full.metrics)


def without_stopping(params: dict[str, Any]) -> dict[str, Any]:
    """A method's parameters but its rules for stopping early (TMAS's early_stop*, majority vote's stop, rounds and
    online stopping)."""
    rules = ("early_stop", "stop", "online_", "warmup", "round_size")
    return {key: value for key, value in params.items() if not key.startswith(rules)}


def _run_section(doc: Document, e: RunEvaluation) -> None:
    doc.add(Heading(3, f"Run: {e.label}"))
    g = e.grades
    items = [
        f"run directory: {e.run_dir}",
        f"method: {e.method}; parameters: {e.params or '{}'}; model: {e.model or '(default)'}",
        _problems_line(e),
    ]
    if g is not None:
        items.append(f"grading: {g.described()}; {g.undecided()} undecided verdicts (counted incorrect)")
        if g.not_graded:
            held = len({key[0] for key in g.not_graded})
            items.append(
                f"not graded yet: {len(g.not_graded)} answers (candidates and returned answers) of {held} "
                f"problem{'' if held == 1 else 's'}, solved after the run's last grading, counted incorrect in every "
                "figure ('tmas report' without --no-grade grades them)"
            )
        items += g.notes
        if e.failed_rollouts:
            items.append(
                f"candidates whose call failed: {e.failed_rollouts} (Pass@1 counts each as a wrong rollout, one of its "
                "problem's n_i; MV@all gives it no vote; 'tmas run --resume' asks them again)"
            )
    if e.metrics.unlabeled:
        items.append(f"{e.metrics.unlabeled} problems have no reference answer: solved but not graded")
    if e.not_graded_reason:
        items.append(e.not_graded_reason)
    prompt = e.cost.usage.prompt_tokens
    if prompt:
        share = cached_share(e.cost.usage.cached_prompt_tokens, prompt)
        items.append(f"prompt tokens served from the servers' prompt caches: {share} of {prompt}")
    for kind, refusals in e.downgrades.items():
        for url, message in refusals.items():
            items.append(f"{kind.replace('_', ' ')}: {url} {DOWNGRADES.get(kind, 'refused a request')} ({message})")
    items += [f"notice: {message}" for message in e.notices.values()]
    items += _calls_lines(e)
    doc.add(Bullets(items))
    if e.metrics.iterations:
        rows = []
        for m in e.metrics.iterations:
            # Accuracies over no labeled problem (only unlabeled ones got this far) are none, not 0.
            graded = g is not None and m.problems > 0
            spread = f"{_pct(min(m.pass1_runs))}-{_pct(max(m.pass1_runs))}" if m.pass1_runs and graded else "-"
            rows.append(
                [
                    f"It{m.iteration}",
                    str(m.problems),
                    _pct(m.pass1) if graded else "-",
                    _pct(m.pass1_stderr) if graded else "-",
                    spread,
                    _pct(m.mv) if graded else "-",
                    _pct(m.selected) if graded else "-",
                    str(m.calls),
                    str(m.prompt_tokens),
                    str(m.completion_tokens),
                    str(m.reasoning_tokens),
                    f"{m.tokens_per_problem:.0f}",
                ]
            )
        headers = [
            "Iteration",
            "Problems",
            "Pass@1",
            "Pass@1 std. error",
            "Pass@1 over judge runs",
            "MV@all",
            "Selected",
        ]
        costs = [
            "Calls",
            "Prompt tokens",
            "Completion tokens",
            "Reasoning tokens",
            "Cum. prompt + completion tokens/problem",
        ]
        doc.add(Table([*headers, *costs], rows))
    for section in RUN_SECTIONS:
        section(doc, e)


def _problems_line(e: RunEvaluation) -> str:
    """How many problems the run holds and how far each got; those it never started count in no figure."""
    return f"problems: {e.problems} ({_problem_states(e)})"


def _problem_states(e: RunEvaluation) -> str:
    """How far the run's problems got: ``D done, F failed``, with those mid-way and those never started."""
    parts = [f"{e.done} done", f"{e.failed} failed"]
    if e.running:
        parts.append(f"{e.running} mid-way: reported from their finished iterations")
    not_started = e.problems - e.done - e.failed - e.running
    if not_started > 0:
        parts.append(f"{not_started} not started: left out of every figure")
    return ", ".join(parts)


def _calls_lines(e: RunEvaluation) -> list[str]:
    """Retries and failures by cause (the judge's apart), and where the method's calls' time went."""
    lines = []
    for causes, who in ((e.causes, ""), (e.judge_causes, "judge ")):
        for what, label in (
            ("retried", "attempts sent again"),
            ("failed", "calls failed"),
            ("asked_again", "calls failed, then asked again"),
        ):
            counts = causes.get(what) or {}
            if counts:
                by_cause = ", ".join(f"{cause} {n}" for cause, n in counts.items())
                lines.append(f"{who}{label}: {sum(counts.values())} ({by_cause})")
    for key, label in (
        ("first_token", "time to the first chunk (the server's queue and prefill)"),
        ("queued", "time waiting inside tmas for a slot"),
    ):
        values = sorted(e.waits.get(key) or [])
        if values:
            # The median (the mean of the middle two of an even count); p95 by nearest rank: the smallest value
            # with at least 95% of the values at or below it, the ceil(0.95 n)-th.
            median, p95 = statistics.median(values), values[math.ceil(0.95 * len(values)) - 1]
            lines.append(f"{label}: median {median:.2f} s, p95 {p95:.2f} s, longest {values[-1]:.2f} s")
    return lines


def _frontier_points(doc: Document, e: RunEvaluation) -> None:
    if not e.frontier:
        return
    doc.add(Heading(4, "Frontier points"))
    rows = [[p.label, f"{p.tokens:.0f}", _pct(p.accuracy), _pct(p.stderr), str(p.problems)] for p in e.frontier]
    headers = ["Point", "Completion tokens/problem", "Accuracy", "Std. error", "Problems reached"]
    doc.add(Table(headers, rows))


def _selection_rules(doc: Document, e: RunEvaluation) -> None:
    table = e.selection
    if table is None or not table.iterations:
        return
    doc.add(Heading(4, "Accuracy (%) of every selection rule, from the stored scores"))
    if table.own is not None:
        doc.add(
            Paragraph(
                "This run's rule is what the run returned after each iteration, as it stored it; every other rule "
                "is replayed on the stored candidates and scores."
            )
        )
    # Methods with select and select_from parameters (old names and missing keys read by stored_params): mark the
    # rule the run itself used.
    columns = selected_iterations(table.iterations[-1], columns=RULE_COLUMNS)
    rows = []
    for rule in SELECT_RULES:
        for candidates in SELECT_FROM:
            values = table.accuracy[(rule, candidates)]
            name = f"{rule} / {candidates}" + (" (this run's rule)" if (rule, candidates) == table.own else "")
            rows.append([name, *[_pct(values[t]) for t in columns]])
    rows.append(["problems", *[str(table.problems[t]) for t in columns]])
    doc.add(Table(["Rule / candidates from", *[f"It{t}" for t in columns]], rows))


def _reply_quality(doc: Document, e: RunEvaluation) -> None:
    reply_quality_section(doc, e.replies)


def _score_separation(doc: Document, e: RunEvaluation) -> None:
    s = e.separation
    if s is not None:
        doc.add(Heading(4, "Can the verifier carry selection? ROC area of candidate scores (B.4)"))
        doc.add(Paragraph(_separation_text(s, "scored", "score")))
    c = e.confidence
    if c is not None:
        measure = e.params.get("confidence_measure")
        doc.add(Heading(4, "Does the model's confidence tell right from wrong? ROC area of candidate confidence"))
        doc.add(Paragraph(_separation_text(c, "measured", f"{measure} confidence (DeepConf)")))


def _separation_text(s: ScoreSeparation, done: str, what: str) -> str:
    unread = (
        f"; {s.unread} verifications without a score (failed or unreadable) left out, each candidate scored by its "
        "readable ones"
        if s.unread
        else ""
    )
    if not s.available:
        return f"Not available: {s.reason}{unread}."
    auc = "-" if s.auc is None else f"{s.auc:.3f}"

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    text = (
        f"ROC area {auc} over {s.right} right and {s.wrong} wrong {done} candidates; mean {what} right "
        f"{fmt(s.right_mean)}, wrong {fmt(s.wrong_mean)}; {s.answerless} {done} candidates without an answer left out"
        f"{unread}"
    )
    return text + (f" ({s.reason})" if s.reason else "") + "."


def _analyses(doc: Document, e: RunEvaluation) -> None:
    d = e.dynamics
    if d is not None:
        doc.add(Heading(4, "Verification-score dynamics (B.4)"))
        if not d.available:
            doc.add(Paragraph(f"Not available: {d.reason}."))
        else:

            def fmt(v: float | None) -> str:
                return "-" if v is None else f"{v:.3f}"

            rows = [
                [f"It{t}", fmt(a), fmt(b)]
                for t, (a, b) in enumerate(zip(d.ever_by_iteration, d.never_by_iteration, strict=True))
            ]
            doc.add(Table(["Iteration", "ever-correct mean score", "never-correct mean score"], rows))
            summary = (
                f"ever-correct: {len(d.ever_correct)} problems, mean {fmt(d.ever_mean)}; never-correct: "
                f"{len(d.never_correct)} problems, mean {fmt(d.never_mean)}; delta(wrong - correct) = {fmt(d.delta)}"
            )
            if d.p_value is not None:
                summary += f"; Mann-Whitney U = {d.u_statistic:.1f}, p = {d.p_value:.4g}"
            elif d.reason:
                summary += f" ({d.reason})"
            doc.add(Paragraph(summary + "."))
    if e.guidelines is not None:
        doc.add(Heading(4, "Unique guidelines per problem (B.3)"))
        gd = e.guidelines
        if gd.available and gd.mean_unique is not None:
            doc.add(Paragraph(f"epsilon = {gd.epsilon}; mean unique guidelines per problem = {gd.mean_unique:.2f}."))
        else:
            doc.add(Paragraph(f"Not available: {gd.reason}."))
    t = e.trace
    if t is None and e.grades is not None and e.metrics.iterations and len(e.metrics.iterations) > 1:
        doc.add(Heading(4, "Experience trace (C)"))
        doc.add(Paragraph("No problem gained correct rollouts from its first to its last iteration: nothing to trace."))
    elif t is not None and not t.available:
        doc.add(Heading(4, "Experience trace (C)"))
        doc.add(Paragraph(f"Not available: {t.reason}."))
    if t is not None and t.available:
        doc.add(Heading(4, f"Experience trace of problem {t.problem_id} (C)"))
        rows = [
            [
                f"It{r.iteration}",
                f"{r.correct}/{r.rollouts}",
                f"{r.exploit_correct}/{r.exploit_rollouts}" if r.exploit_rollouts is not None else "-",
                "; ".join(x[:120] for x in r.new_entries) or "-",
            ]
            for r in t.rows
        ]
        headers = ["Iteration", "Correct rollouts", "Correct exploit rollouts", "Experience entries added"]
        doc.add(Table(headers, rows))
    s = e.stopping
    if s is not None and s.any:
        doc.add(Heading(4, "Adaptive stopping"))
        parts = []
        if s.stopped:
            text = f"{s.stopped} problems stopped early ({s.reasons})"
            if s.mean_stop_iteration is not None:
                text += f"; mean stop iteration {s.mean_stop_iteration:.1f}"
            if s.mean_calls is not None:
                text += f"; mean calls of a stopped problem {s.mean_calls:.1f}"
            parts.append(text)
        if s.stopped_traces:
            parts.append(
                f"{s.stopped_traces} samples stopped while streaming (online_stop), saving about"
                f" {s.stopped_tokens_saved} completion tokens (each against its problem's warm-up samples' mean);"
                " no rollouts, they are left out of Pass@1, MV@all and the frontier's MV@k"
            )
        text = "; ".join(parts)
        if s.tokens_saved is not None and s.compared is not None:
            share = f" ({100 * s.tokens_saved_share:.1f}%)" if s.tokens_saved_share is not None else ""
            saved = f"{s.tokens_saved} prompt + completion tokens saved per problem{share}"
            over = f", over the {s.compared} of {e.problems} problems both finished" if s.compared < e.problems else ""
            text += f"; against the full run{over}: {saved}, Pass@1 lost {_pct(s.pass1_lost)}"
        doc.add(Paragraph(text + "."))


# What each run's section shows after its per-iteration table, in order; a new analysis adds its writer here.
RUN_SECTIONS: tuple[Callable[[Document, RunEvaluation], None], ...] = (
    _frontier_points,
    _selection_rules,
    _score_separation,
    _reply_quality,
    _analyses,
)


def check_report_out(run_dirs: list[Path], out_dir: Path, flag: str | None = None) -> None:
    """:class:`InputError` naming ``out_dir`` (after the ``flag`` that gave it, where one did) where it is a run's
    directory under any spelling (one of ``run_dirs``, or another holding a run store): its report files would lie
    among the run's own. A folder inside a run (``RUN/report``, where ``tmas eval`` writes) is one of its own."""
    out = Path(out_dir).resolve()
    run = next((Path(r) for r in run_dirs if Path(r).resolve() == out), None)
    if run is None and (out / DB_NAME).is_file():
        run = Path(out_dir)
    if run is not None:
        named = f"{flag} {out_dir}" if flag else str(out_dir)
        raise InputError(
            f"{named} is the run directory {run}: a report is not written among a run's files"
            f" (choose another, such as {run / 'report'})"
        )


async def build_report(
    run_dirs: list[Path],
    out_dir: Path,
    config: GradeConfig | None,
    settings: Settings | None,
    *,
    grade: bool = True,
    paper_model: str | None = None,
    on_step: Callable[[str], None] | None = None,
    labels: dict[Path, str] | None = None,
) -> dict[str, Path]:
    """Evaluate ``run_dirs`` and write their report; ``on_step`` hears of each step as it begins. With ``grade`` off
    and ``config`` None, each run's stored grades are read as its last grading read them. ``labels``: each run's
    label by directory, where another report of these runs among others named it (a sweep's study report labels its
    points as the combined report does); the runs it lacks, told apart here, are added to it."""
    say = on_step or (lambda _: None)
    resolved_once(run_dirs)  # a run given twice would be graded twice, and reported as two runs
    check_report_out(run_dirs, out_dir)
    for run_dir in run_dirs:  # each a run, said before any is graded (a judge's calls sent for it)
        check_began(run_dir, "report")
        RunStore(run_dir, read_only=True).close()
    evaluations = []
    for i, run_dir in enumerate(run_dirs, start=1):
        where = f"run {i} of {len(run_dirs)}: {run_dir}"

        def began(grading: bool, never: str, where: str = where) -> None:
            # A run no grading reads (proofs, no reference answers) is read, and the line says why.
            say(f"grading {where}" if grading else f"reading {where}" + (f" ({never})" if never else ""))

        evaluations.append(await evaluate_run(run_dir, config, settings, grade=grade, on_read=began))
    for e in evaluations:
        e.label = (labels or {}).get(e.run_dir, e.label)
    say(f"writing the report (tables, plots) into {out_dir}")
    written = write_report(evaluations, out_dir, paper_model=paper_model)
    if labels is not None:
        labels.update({e.run_dir: e.label for e in evaluations if e.run_dir not in labels})
    return written
