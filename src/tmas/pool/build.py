"""``tmas pool build``: labelled MATTRL runs to pool entries (paper 003, section 3.2, Eq. 9-15, section 5.1).

Per case: the judge scores every specialist turn (Eq. 9); the chosen scheme gives the contributions (naive: Eq. 11;
difference: Eq. 17; Shapley: Eq. 18; both normalised by Eq. 16); Eq. 10 and 12 give each turn's reward r. Over all
cases, the turns with r >= tau (Eq. 13) or in the top quantile (education: within each case, C.1) are kept, and the
summarizer distils each into ACTION / EXPERIENCE entries (Eq. 14) added to the pool (Eq. 15).

Every LLM call goes through a build store (``POOL.build/``, a run store) so an interrupted build, run again,
replays what it finished; entries already in the pool are not added twice, and entries a prune removed from it
(:attr:`tmas.memory.pool.PoolMeta.removed`) are not added again. The credit of every turn, kept or not,
is written to ``POOL.build/credits.jsonl`` for reports.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tmas.agents.echo import EchoGuard
from tmas.agents.output import AgentOutputError
from tmas.agents.overrides import check_overrides
from tmas.agents.pool_summarizer import (
    DistilledEntry,
    SummarizerReply,
    TeachingEntry,
    TeachingSummarizerReply,
    parse_summarizer,
    parse_teaching_summarizer,
    summarizer_prompt,
    teaching_summarizer_prompt,
)
from tmas.agents.templates import prompts_from
from tmas.agents.utterance_judge import TeachingView, TurnView
from tmas.config import Settings
from tmas.errors import ConfigError, InputError
from tmas.files import replacing
from tmas.grading.registry import GradeMode
from tmas.llm.factory import open_model
from tmas.llm.model import ChatModel
from tmas.llm.sampling import resolve_role, retried
from tmas.llm.types import CallKey, Message
from tmas.memory.embedders import UNNAMED, Embedder, embedder_for
from tmas.memory.pool import META, Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.pool.credit import (
    DEFAULT_BETA,
    Coalition,
    CreditScheme,
    TurnCredit,
    assign_credit,
    coalitions_needed,
    difference_credits,
    kept_by_quantile,
    kept_by_threshold,
    sample_permutations,
    shapley_credits,
)
from tmas.pool.outcomes import AgentTurn, DiagnosisMatch, LabelledTranscript, load_transcripts
from tmas.pool.scoring import JUDGE_ROLE, Judged, TurnJudge, history_before
from tmas.pool.writing import build_dir_for as build_dir_for  # where it was, for its readers
from tmas.pool.writing import writing
from tmas.problems import question_hash
from tmas.store.database import DB_NAME
from tmas.store.run_store import RunStore

SUMMARIZER_ROLE = "summarizer"

# (stage, done, total): how far the build is, for a progress bar.
ProgressFn = Callable[[str, int, int], None]

# (run, problem id) -> the labelled case and its specialist turns.
CaseTurns = dict[tuple[str, str], tuple[LabelledTranscript, list[AgentTurn]]]

# The store meta a build records its configuration and its calls' requests under (what a resume's estimate compares).
CONFIG_META = "experience_build"
REQUESTS_META = "experience_requests"
RUNS_META = "experience_runs"

# The turn credits of a build, one JSON line per credited turn, beside the pool (the viewer reads this file).
CREDITS_FILE = "credits.jsonl"


class BuildConfig(BaseModel):
    """The knobs of a build. Defaults: the naive scheme of section 3.2; lambda 0.4 and gamma 0.85, the only values
    the paper states (appendix C.1: weights 0.4 individual / 0.6 decayed global); the top 25 % (section 4.1)."""

    model_config = ConfigDict(extra="forbid")

    scheme: CreditScheme = "naive"
    lam: float = Field(default=0.4, ge=0.0, le=1.0)
    gamma: float = Field(default=0.85, gt=0.0, le=1.0)
    # Eq. 10's direction: "later" (Eq. 10: the last turn weighs 1), "earlier" (appendix C.1's education setting:
    # the first turn weighs 1), or "auto": each case's domain's (``Domain.credit_decay``: earlier for education).
    decay: Literal["auto", "later", "earlier"] = "auto"
    # Eq. 16's softmax sharpness for the difference and Shapley schemes (see credit.DEFAULT_BETA).
    beta: float = Field(default=DEFAULT_BETA, gt=0.0)
    # Eq. 13's threshold (rewards lie in [0, 1]); when None the top ``quantile`` share of all turns is kept.
    tau: float | None = Field(default=None, ge=0.0, le=1.0)
    quantile: float = Field(default=0.25, gt=0.0, le=1.0)
    # Monte Carlo orders per turn for Eq. 18 (every order when this covers n!, i.e. exact Shapley values).
    permutations: int = Field(default=8, ge=1)
    retries: int = Field(default=2, ge=0)
    grade_mode: GradeMode = "combined"
    # Medicine's G: gold names matched by spelling, then by the diagnosis judge (A.5 rules) for the rest.
    match: DiagnosisMatch = "judge"
    embedder: Literal["endpoint", "local"] = "endpoint"
    seed: int = 0


@dataclass
class TurnRecord:
    """What credits.jsonl holds per specialist turn."""

    run: str
    problem_id: str
    turn: int
    agent: str
    outcome: float
    scheme: str
    credit: TurnCredit
    judge: Judged
    kept: bool = False
    entries: list[str] = field(default_factory=list)
    # The transcript round of the turn (education's turn 1 is its round 1; elsewhere round = turn - 1).
    round: int = 0

    def to_json(self) -> dict[str, object]:
        c = self.credit
        return {
            "run": self.run,
            "problem_id": self.problem_id,
            "turn": self.turn,
            "round": self.round,
            "agent": self.agent,
            "G": self.outcome,
            "scheme": self.scheme,
            "s": c.s,
            "q": c.q,
            "c": c.c,
            "w": c.w,
            "r": c.r,
            "kept": self.kept,
            "entries": self.entries,
            "judge_analysis": self.judge.analysis,
            "judge_defaulted": self.judge.defaulted,
        }


@dataclass
class BuildSummary:
    pool: Path
    cases: int = 0
    turns: int = 0
    kept: int = 0
    added: int = 0
    already_in_pool: int = 0
    # Entries of the runs read before that a prune has since removed from the pool: not added again.
    removed_before: int = 0
    # Calls sent to the endpoint, and calls answered from the build store (a resumed or repeated build's), apart.
    judge_calls: int = 0
    judge_replayed_calls: int = 0
    summarizer_calls: int = 0
    summarizer_replayed_calls: int = 0
    # Summarizer entries that echoed the prompt's instructions (never added; the reply is asked again once).
    summarizer_echoes: int = 0
    defaulted_scores: int = 0
    version: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


def build_requests(settings: Settings) -> dict[str, object]:
    """What the build's calls ask beyond their prompts: each role's model and resolved sampling, the seed, the
    prompt templates' folder and the SHA-256 of each template there (an edited one asks other calls). A stored call
    answers a resume only under the same."""
    asked: dict[str, object] = {"seed": settings.seed, "prompts_dir": settings.prompts_dir}
    if settings.prompts_dir:
        asked.update({f"prompt template {o.name}": o.sha256[:12] for o in check_overrides(settings.prompts_dir)})
    for role in (JUDGE_ROLE, SUMMARIZER_ROLE):
        override = settings.roles.get(role)
        asked[f"{role} model"] = (override.model if override else None) or settings.endpoint.model
        asked[f"{role} sampling"] = resolve_role(settings, role).sampling.model_dump(mode="json", exclude_defaults=True)
    return asked


def build_runs(run_dirs: list[Path]) -> list[str]:
    """The runs a build reads, as its store records them: resolved, sorted."""
    return sorted(str(Path(run).resolve()) for run in run_dirs)


def entry_id(case: LabelledTranscript, turn: AgentTurn, k: int) -> str:
    """Stable across rebuilds: the same source turn gives the same ids, so a rebuild adds nothing twice."""
    source = f"{Path(case.run).resolve()}|{case.problem.problem_id}|{turn.turn}|{turn.agent}"
    return f"{hashlib.sha256(source.encode()).hexdigest()[:12]}-{k}"


def turn_coalitions(
    case: LabelledTranscript, turn: int, team: list[str], config: BuildConfig
) -> tuple[list[tuple[str, ...]], list[Coalition]]:
    """The difference or Shapley scheme's orders (Shapley's; none for difference) and the coalitions whose value F_t
    turn ``turn`` of ``case`` asks the judge for (the empty one included; it costs no call)."""
    full: Coalition = frozenset(team)
    perms: list[tuple[str, ...]] = []
    if config.scheme == "difference":
        needed = {full, *(full - {a} for a in team)}
    else:
        rng = random.Random(f"{config.seed}|{case.problem.problem_id}|{turn}")
        perms = sample_permutations(team, config.permutations, rng)
        needed = coalitions_needed(perms)
    return perms, sorted(needed, key=sorted)


async def _case_credits(
    judge: TurnJudge, case: LabelledTranscript, turns: list[AgentTurn], config: BuildConfig
) -> tuple[dict[tuple[int, str], Judged], dict[int, dict[str, TurnCredit]]]:
    judged_list = await asyncio.gather(*(judge.score_turn(case, turns, t) for t in turns))
    judged = {(t.turn, t.agent): j for t, j in zip(turns, judged_list, strict=True)}
    scores: dict[int, dict[str, float]] = {}
    for t in turns:
        scores.setdefault(t.turn, {})[t.agent] = judged[(t.turn, t.agent)].value
    credits: dict[int, dict[str, float]] | None = None
    if config.scheme != "naive":
        credits = {}
        for turn, team_scores in scores.items():
            team = sorted(team_scores)
            full: Coalition = frozenset(team)
            perms, ordered = turn_coalitions(case, turn, team, config)
            values_list = await asyncio.gather(*(judge.turn_value(case, turns, turn, s) for s in ordered))
            values = {s: v.value for s, v in zip(ordered, values_list, strict=True)}
            if config.scheme == "difference":
                credits[turn] = difference_credits(values[full], {a: values[full - {a}] for a in team})
            else:
                credits[turn] = shapley_credits(perms, values)
    earlier = config.decay == "earlier" or (config.decay == "auto" and case.domain.credit_decay == "earlier")
    result = assign_credit(
        scores,
        case.rounds,
        case.outcome,
        lam=config.lam,
        gamma=config.gamma,
        beta=config.beta,
        credits=credits,
        earlier=earlier,
    )
    return judged, result


async def _distil(
    llm: ChatModel,
    case: LabelledTranscript,
    turns: list[AgentTurn],
    record: TurnRecord,
    retries: int,
    summary: BuildSummary,
) -> list[PoolEntry]:
    """Eq. 14: the kept turn as pool entries (none, with a note, when no summarizer reply is usable)."""
    target = next(t for t in turns if t.turn == record.turn and t.agent == record.agent)
    teaching = case.teaching_view(target) if case.domain.teaching else None
    messages = _summarizer_prompt(case, turns, target, record, teaching)
    where = f"{case.run}: problem {case.problem.problem_id}: turn {target.turn} of {target.agent}"
    reason = ""
    guard = EchoGuard.of(messages)
    shape: type[BaseModel] = SummarizerReply if teaching is None else TeachingSummarizerReply
    echo_retried = False
    # The entries of a reply that echoed, less those that echo: what the turn gives if no later attempt is usable.
    echoed_reply: list[DistilledEntry] | None = None
    configured = llm.resolve_sampling(SUMMARIZER_ROLE)
    for attempt in range(retries + 1):
        key = CallKey(problem_id=case.problem.problem_id, role=SUMMARIZER_ROLE, sample=attempt, iteration=target.turn)
        sampling = retried(configured, attempt)
        completion = await llm.chat(SUMMARIZER_ROLE, messages, key=key, sampling=sampling, reply_model=shape)
        if completion.replayed:
            summary.summarizer_replayed_calls += 1
        else:
            summary.summarizer_calls += 1
        if not completion.ok:
            reason = f"call failed: {completion.error}"
            continue
        found: Sequence[DistilledEntry]
        try:
            if teaching is not None:
                found, malformed = parse_teaching_summarizer(completion.content, truncated=completion.truncated)
            else:
                found, malformed = parse_summarizer(completion.content, truncated=completion.truncated)
        except AgentOutputError as exc:
            reason = str(exc)
            continue
        summary.notes.extend(f"{where}: summarizer {m}, dropped" for m in malformed)
        echoed = [e for e in found if guard.first_echo((("action", e.action), ("experience", e.experience)))]
        if echoed:
            summary.summarizer_echoes += len(echoed)
            summary.notes.append(f"{where}: summarizer: {len(echoed)} entries echo the prompt's instructions")
            found = [e for e in found if e not in echoed]
            if not echo_retried and attempt < retries:
                echo_retried, reason, echoed_reply = True, "entries echoing the instructions", found
                continue
        return _entries(case, target, record, found, teaching)
    if echoed_reply:
        summary.notes.append(
            f"{where}: no usable summary after the echo ({reason}); the echoing reply's other entries are kept"
        )
        return _entries(case, target, record, echoed_reply, teaching)
    summary.notes.append(f"{where}: no usable summary after {retries + 1} attempts ({reason}); no entry")
    return []


def _entries(
    case: LabelledTranscript,
    target: AgentTurn,
    record: TurnRecord,
    found: Sequence[DistilledEntry],
    teaching: TeachingView | None,
) -> list[PoolEntry]:
    """The pool entries the summarizer found in ``target``'s turn."""
    return [
        PoolEntry(
            id=entry_id(case, target, k),
            action=e.action,
            experience=e.experience,
            scope=e.scope,
            domain=case.transcript.domain,
            specialty=target.specialty,
            source_run=case.run,
            source_problem=case.problem.problem_id,
            source_question=question_hash(case.problem.question),
            source_round=target.turn,
            source_agent=target.agent,
            reward=record.credit.r,
            tags=[record.scheme],
            **_teaching_keys(e, teaching),
        )
        for k, e in enumerate(found)
    ]


def _summarizer_prompt(
    case: LabelledTranscript,
    turns: list[AgentTurn],
    target: AgentTurn,
    record: TurnRecord,
    teaching: TeachingView | None,
) -> list[Message]:
    """The summarizer's call for ``target``: a teaching domain's (C.4.7, against the session's ``teaching`` view) or
    the deliberation's (the turns before it)."""
    view = TurnView(agent=target.agent, specialty=target.specialty, text=target.text)
    if teaching is not None:
        return teaching_summarizer_prompt(
            question=case.problem.question,
            gold=case.gold,
            outcome=case.outcome,
            view=teaching,
            target=view,
            round_number=target.turn,
            reward=record.credit.r,
            judge_analysis=record.judge.analysis,
        )
    return summarizer_prompt(
        question=case.problem.question,
        gold=case.gold,
        outcome=case.outcome,
        history=history_before(turns, target.turn),
        target=view,
        round_number=target.turn,
        reward=record.credit.r,
        judge_analysis=record.judge.analysis,
        domain=case.transcript.domain,
    )


def _teaching_keys(entry: DistilledEntry, teaching: TeachingView | None) -> dict[str, str]:
    """Education entries are keyed by role, subject and difficulty (C.1.1) and carry their C.4.7 class."""
    if teaching is None:
        return {}
    return {
        "role": teaching.role,
        "subject": teaching.subject,
        "difficulty": teaching.difficulty,
        "category": entry.category if isinstance(entry, TeachingEntry) else "",
    }


def _select(records: list[TurnRecord], config: BuildConfig, case_turns: CaseTurns) -> list[TurnRecord]:
    """Eq. 13 (``tau``) or the top quantile: over every turn of every case (section 4.1), except for the cases of a
    domain that takes it within each case (``Domain.quantile_within``; education, C.1), whose turns compete only
    with their own case's."""
    groups: dict[tuple[str, str] | None, list[int]] = {}
    for i, record in enumerate(records):
        case = case_turns[(record.run, record.problem_id)][0]
        within = config.tau is None and case.domain.quantile_within == "case"
        groups.setdefault((record.run, record.problem_id) if within else None, []).append(i)
    kept: list[int] = []
    for members in groups.values():
        rewards = [records[i].credit.r for i in members]
        if config.tau is not None:
            chosen = kept_by_threshold(rewards, config.tau)
        else:
            chosen = kept_by_quantile(rewards, config.quantile)
        kept.extend(members[j] for j in chosen)
    kept.sort()
    for i in kept:
        records[i].kept = True
    return [records[i] for i in kept]


async def build_pool(
    run_dirs: list[Path],
    pool_path: Path,
    settings: Settings,
    config: BuildConfig,
    *,
    progress: ProgressFn | None = None,
    model: ChatModel | None = None,
) -> BuildSummary:
    """Build (or extend) the pool at ``pool_path`` from the labelled MATTRL runs in ``run_dirs``. Every judge (the
    runs' grading, the turn credits, the summaries) asks the endpoint of ``settings``, or ``model``, a
    :class:`tmas.llm.model.ChatModel` of the caller's own, its calls kept in the build's store either way. The turn
    judge's and the summarizer's prompts are rendered with the templates of ``settings.prompts_dir`` where it
    overrides them; the runs' grading uses the packaged judge templates, as every grading of a run does (its
    verdicts are stored in the run and read by its reports)."""
    summary = BuildSummary(pool=pool_path)
    step: ProgressFn = progress or (lambda stage, done, total: None)
    # Before any call: a bad target or template found after them lost their work's place.
    check_pool_target(pool_path, config, run_dirs)
    requests = build_requests(settings)  # checks the prompts folder's templates
    cases = await load_transcripts(
        run_dirs, settings, grade_mode=config.grade_mode, notes=summary.notes, match=config.match, model=model
    )
    check_cases(run_dirs, cases)
    case_turns: CaseTurns = {(c.run, c.problem.problem_id): (c, c.turns()) for c in cases}
    summary.cases = len(cases)
    # One writer of a pool at a time (a build or a prune): two would each save the pool as they read it, the later
    # losing the earlier's entries; two builds would also write each other's credits and store metadata over.
    with (
        writing(pool_path, "tmas pool build") as build_dir,
        RunStore(build_dir) as store,
        prompts_from(settings.prompts_dir),
    ):
        store.set_meta(CONFIG_META, config.model_dump(mode="json"))
        store.set_meta(REQUESTS_META, requests)
        store.set_meta(RUNS_META, build_runs(run_dirs))
        async with open_model(settings, store, log_dir=build_dir, model=model) as llm:
            embed = embedder_for(config.embedder, llm)
            # A pool another embedding model made is said before the judge's first call, not after the last summary:
            # a role that names its model is checked by name; one that names none asks one embedding, whose reply
            # names the model that serves it.
            if (pool_path / META).exists():
                pool = Pool.open(pool_path, embed.name)
                if embed.name == UNNAMED:
                    await pool.check_served(embed)
            judge = TurnJudge(llm, retries=config.retries, concurrency=settings.concurrency)
            records = await _credit_turns(judge, case_turns, config, summary, step)
            kept = _select(records, config, case_turns)
            summary.kept = len(kept)
            entries = await _distil_kept(llm, case_turns, kept, config, summary, step)
            _write_credits(build_dir / CREDITS_FILE, records)
            await _add_to_pool(pool_path, entries, embed, summary)
    return summary


def check_pool_target(pool_path: Path, config: BuildConfig, run_dirs: Sequence[Path]) -> None:
    """What :func:`_add_to_pool` would find wrong at the end, found now: a path that is no directory, or that is one
    of the runs read or another run's directory (the pool's files would be mixed into the run's), a pool that cannot
    be read or that another embedder made."""
    if pool_path.exists() and not pool_path.is_dir():
        raise InputError(f"-o {pool_path}: a file, not a pool directory")
    own = "give the pool a directory of its own"
    if pool_path.resolve() in {Path(run).resolve() for run in run_dirs}:
        raise InputError(f"-o {pool_path}: one of the runs the build reads; {own}")
    if (pool_path / DB_NAME).exists():
        raise InputError(f"-o {pool_path}: a run directory (it holds {DB_NAME}); {own}")
    if (pool_path / META).exists():
        pool = Pool.open(pool_path)
        made_by = pool.meta.embedder.split(":", 1)[0]
        if made_by != config.embedder:
            raise ConfigError(f"{pool_path}: built with the {pool.meta.embedder} embedder, not {config.embedder!r}")


def check_cases(run_dirs: Sequence[Path], cases: Sequence[LabelledTranscript]) -> None:
    """Refuse runs that hold no case to build from (a run of another method, or on unlabelled problems): the build
    would save an empty pool, which a MATTRL run retrieves no hint from."""
    if not cases:
        runs = ", ".join(str(run) for run in run_dirs)
        raise InputError(
            f"{runs}: no finished MATTRL problem with a gold answer; a pool is built from MATTRL runs on labelled"
            " problems"
        )


async def _credit_turns(
    judge: TurnJudge, case_turns: CaseTurns, config: BuildConfig, summary: BuildSummary, step: ProgressFn
) -> list[TurnRecord]:
    """Eq. 9-12 for every case: each specialist turn's judged score, credit and reward, one record per turn."""
    finished = 0

    async def credit_case(case: LabelledTranscript, turns: list[AgentTurn]) -> list[TurnRecord]:
        nonlocal finished
        judged, credits = await _case_credits(judge, case, turns, config)
        finished += 1
        step("credit", finished, len(case_turns))
        rounds = {t.turn: t.round for t in turns}
        return [
            TurnRecord(
                case.run,
                case.problem.problem_id,
                t,
                a,
                case.outcome,
                config.scheme,
                c,
                judged[(t, a)],
                round=rounds[t],
            )
            for t, by_agent in credits.items()
            for a, c in by_agent.items()
        ]

    step("credit", 0, len(case_turns))
    parts = await asyncio.gather(*(credit_case(c, t) for c, t in case_turns.values()))
    records = [record for part in parts for record in part]
    summary.turns = len(records)
    summary.judge_calls, summary.judge_replayed_calls = judge.calls, judge.replayed
    for r in records:
        if r.judge.defaulted:
            summary.defaulted_scores += 1
            summary.notes.append(f"{r.run}: problem {r.problem_id}: turn {r.turn} of {r.agent}: {r.judge.defaulted}")
    return records


async def _distil_kept(
    llm: ChatModel,
    case_turns: CaseTurns,
    kept: list[TurnRecord],
    config: BuildConfig,
    summary: BuildSummary,
    step: ProgressFn,
) -> list[PoolEntry]:
    """Eq. 14 for every kept turn: its entries, each record told the ids of the entries it gave."""
    distilled = 0
    step("distil", 0, len(kept))

    async def distil(record: TurnRecord) -> list[PoolEntry]:
        nonlocal distilled
        case, turns = case_turns[(record.run, record.problem_id)]
        entries = await _distil(llm, case, turns, record, config.retries, summary)
        record.entries = [e.id for e in entries]
        distilled += 1
        step("distil", distilled, len(kept))
        return entries

    return [e for part in await asyncio.gather(*(distil(r) for r in kept)) for e in part]


async def _add_to_pool(pool_path: Path, entries: list[PoolEntry], embed: Embedder, summary: BuildSummary) -> None:
    """Eq. 15: the entries the pool does not hold yet, embedded and saved as its next version."""
    pool = _open_or_create(pool_path, embed.name)
    known = {e.id for e in pool.entries}
    removed = set(pool.meta.removed)
    fresh = [e for e in entries if e.id not in known and e.id not in removed]
    pruned = [e.id for e in entries if e.id in removed]
    summary.already_in_pool = sum(e.id in known for e in entries)
    summary.removed_before = len(pruned)
    if pruned:
        summary.notes.append(
            f"{pool_path}: {len(pruned)} entries a prune removed are not added again: {', '.join(pruned)}"
        )
    summary.added = len(fresh)
    if not fresh:
        # Nothing new (a build run again to resume): no new version, which would age every entry by one.
        summary.version = pool.meta.version
        return
    await pool.add(fresh, embed)
    summary.version = pool.save()


def _open_or_create(path: Path, embedder_name: str) -> Pool:
    """The pool at ``path`` (an error if it was built with another embedder), or a new one."""
    if (path / META).exists():
        return Pool.open(path, embedder_name)
    return Pool.create(path, embedder_name)


def _write_credits(path: Path, records: list[TurnRecord]) -> None:
    with replacing(path) as handle:
        for record in records:
            handle.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
