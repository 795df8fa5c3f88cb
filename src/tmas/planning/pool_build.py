"""What ``tmas pool build`` will send, before it sends anything: the judge's and the summarizer's chat calls, counted
from the runs' transcripts as the build makes them (tmas.pool.build), as a :class:`tmas.planning.estimate.Estimate`
that the commands' cost gate (tmas.cli.estimate) shows and asks about.

The judge scores every specialist turn (Eq. 9), and under the difference or Shapley scheme asks the value of each
coalition of each turn (Eq. 17-18; the empty one costs nothing); the summarizer distils each kept turn (Eq. 14).
How many turns are kept is known only once they are judged: the top quantile keeps ceil(quantile x turns) of each
group, more where rewards tie at the cut, and a threshold (``tau``) anywhere from none to all: the most calls count
every turn as kept. An unusable reply is asked again up to ``retries`` times: the most calls count every such retry.
The runs' grading (a judge where the grader asks one) and the embedding of new entries are not chat calls of the
build's store and are named beside the figures instead.
"""

from __future__ import annotations

import math
from pathlib import Path

from tmas.config import Settings
from tmas.llm.sampling import resolve_role
from tmas.methods.call_count import CallCount
from tmas.planning.estimate import Estimate, PointEstimate, fewest_tokens
from tmas.pool.build import (
    CONFIG_META,
    REQUESTS_META,
    RUNS_META,
    SUMMARIZER_ROLE,
    BuildConfig,
    build_dir_for,
    build_requests,
    build_runs,
    check_cases,
    check_pool_target,
    turn_coalitions,
)
from tmas.pool.outcomes import LabelledTranscript, ungraded_transcripts
from tmas.pool.scoring import JUDGE_ROLE
from tmas.store.database import DB_NAME
from tmas.store.run_store import RunStore

# Graders that ask a judge model (tmas.grading.registry).
_JUDGE_GRADERS = ("combined", "judge", "diagnosis")


def estimate_build(run_dirs: list[Path], pool_path: Path, settings: Settings, config: BuildConfig) -> Estimate:
    """The calls (and, where both roles set max_tokens, the completion-token ceiling) of building the pool at
    ``pool_path`` from ``run_dirs`` under ``config``; on a resume, less the answered calls its store replays."""
    check_pool_target(pool_path, config, run_dirs)
    cases = ungraded_transcripts(run_dirs)
    check_cases(run_dirs, cases)
    tries = config.retries + 1
    judge, turns = 0, 0
    groups: dict[tuple[str, str] | None, int] = {}
    # The most calls each problem id may send (the build store keys its calls by problem, not by run).
    most: dict[str, int] = {}
    for case in cases:
        case_turns = case.turns()
        asked = len(case_turns) + _coalition_calls(case, config)
        turns += len(case_turns)
        judge += asked
        pid = case.problem.problem_id
        most[pid] = most.get(pid, 0) + (asked + len(case_turns)) * tries
        within = config.tau is None and case.domain.quantile_within == "case"
        key = (case.run, case.problem.problem_id) if within else None
        groups[key] = groups.get(key, 0) + len(case_turns)
    retried = f"; each unusable reply asked again up to {config.retries} times" if config.retries else ""
    judged = f"{len(cases)} {'case' if len(cases) == 1 else 'cases'}, {turns} {'turn' if turns == 1 else 'turns'}"
    # Every reply asked again (an unusable score, a summary that echoes its instructions) is one of the ``retries``:
    # none comes beside the upper counts.
    judge_count = CallCount(
        {JUDGE_ROLE: judge}, {JUDGE_ROLE: judge * tries}, exact=not config.retries, again={JUDGE_ROLE: 0}
    )
    judge_count.note = retried.removeprefix("; ")
    if config.tau is not None:
        kept, how = turns, f"those with reward >= {config.tau}: from none to all"
    else:
        kept = sum(math.ceil(config.quantile * n) for n in groups.values() if n)
        how = f"the top {config.quantile:g} share: {kept}, more where rewards tie at the cut"
    distil = CallCount(
        {SUMMARIZER_ROLE: kept},
        {SUMMARIZER_ROLE: turns * tries},
        exact=False,
        note=f"one call per kept turn ({how}){retried}",
        again={SUMMARIZER_ROLE: 0},
    )
    points = [
        _point(f"judge ({judged})", judge_count, settings, JUDGE_ROLE),
        _point("summarizer", distil, settings, SUMMARIZER_ROLE),
    ]
    estimate = Estimate(points, left_out=_left_out(cases, config), measurable=False)
    stored, answered = _stored(pool_path, settings, config, run_dirs)
    estimate.stored_calls = sum(min(n, most.get(pid, 0)) for pid, n in stored.items())
    if estimate.stored_calls and estimate.completion_tokens is not None:
        # The judge's and the summarizer's max_tokens may differ: a build stopped after its judge calls has only
        # summaries left, each at the summarizer's.
        ceilings = {
            role: float(resolve_role(settings, role).sampling.max_tokens or 0) for role in (JUDGE_ROLE, SUMMARIZER_ROLE)
        }
        estimate.stored_tokens = fewest_tokens(estimate.stored_calls, answered, ceilings)
    return estimate


def _coalition_calls(case: LabelledTranscript, config: BuildConfig) -> int:
    """The judge's F_t calls of ``case`` under the difference or Shapley scheme: its coalitions less the empty one."""
    if config.scheme == "naive":
        return 0
    teams: dict[int, list[str]] = {}
    for t in case.turns():
        teams.setdefault(t.turn, []).append(t.agent)
    return sum(
        sum(1 for s in turn_coalitions(case, turn, sorted(team), config)[1] if s) for turn, team in teams.items()
    )


def _point(name: str, count: CallCount, settings: Settings, role: str) -> PointEstimate:
    """The point's calls, and their completion tokens at the role's max_tokens (a ceiling) where it sets one."""
    point = PointEstimate(name, "pool build", 1, count)
    ceiling = resolve_role(settings, role).sampling.max_tokens
    if ceiling is not None:
        point.basis = "max_tokens"
        point.completion_tokens = float(count.upper_total * ceiling)
    return point


def _left_out(cases: list[LabelledTranscript], config: BuildConfig) -> list[str]:
    """The calls beside the build's own: the runs' grading judge, medicine's diagnosis judge, the embedder."""
    out = []
    if config.grade_mode in _JUDGE_GRADERS:
        out.append(
            "the runs' grading judge (--grade rules sends none), one call per answer the rules cannot decide, stored in"
            " each run and reused"
        )
    if config.match == "judge" and any(c.domain.outcome == "reciprocal_rank" for c in cases):
        out.append("the diagnosis judge for differentials not matched by spelling (--match spelling sends none)")
    if config.embedder == "endpoint":
        out.append("the embedding requests of the new entries")
    return out


def _stored(
    pool_path: Path, settings: Settings, config: BuildConfig, run_dirs: list[Path]
) -> tuple[dict[str, int], dict[str, int]]:
    """The answered calls by problem the build's store replays, and its answered calls by role: none unless it was
    last built from the same runs under the same configuration and requests (other runs, another scheme, model or
    sampling ask other calls)."""
    build_dir = build_dir_for(pool_path)
    if not (build_dir / DB_NAME).exists():
        return {}, {}
    with RunStore(build_dir, create=False) as store:
        same = (
            store.get_meta(CONFIG_META) == config.model_dump(mode="json")
            and store.get_meta(REQUESTS_META) == build_requests(settings)
            and store.get_meta(RUNS_META) == build_runs(run_dirs)
        )
        if not same:
            return {}, {}
        return store.sure_replays(), {role: n for role, (n, _) in store.replies_by_role().items()}
