"""The LLM-as-judge of the paper (appendix A.2): is the student's final answer equivalent to the reference?

The judge answers JSON ``{"reasoning": ..., "equivalent": true|false}``. A reply that is not such JSON is undecided:
it is asked again (a fresh sample) up to ``retries`` times, and the last undecided outcome is recorded as such.

The ``judge`` grader asks it R independent times per item (paper: 4) on the ``judge`` role's endpoint; verdicts are
stored as grader ``judge``, runs 0..R-1. An item without an extracted final answer is wrong in every run, and the judge
is not asked about it: it grades answers, not replies that hold none.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError, field_validator

from tmas.agents.output import latex_restored, literal_backslashes, loads_reply, without_trailing_commas
from tmas.agents.templates import prompt
from tmas.config import Sampling, Settings
from tmas.grading.grader import GradingContext, StoredGrades, Verdicts
from tmas.grading.grades import GradeConfig, Item, ItemKey
from tmas.grading.rules import NO_ANSWER, has_answer
from tmas.llm.model import ChatModel
from tmas.llm.sampling import DERIVED_SEED, derived_base, earlier_configured_seeds, for_sample, retried
from tmas.llm.types import CallKey, Usage
from tmas.store.run_store import GradeRow

JUDGE_ROLE = "judge"
# How a verdict left undecided by failed calls says so.
CALL_FAILED = "judge call failed"
# The most of an answer the judge is shown: its end, where a long answer's result is.
STUDENT_TAIL_CHARS = 2000
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.I)


class JudgeReply(BaseModel):
    reasoning: str = ""
    equivalent: bool

    @field_validator("equivalent", mode="before")
    @classmethod
    def _lenient_bool(cls, value: object) -> object:
        # Models sometimes quote booleans; anything else stays invalid.
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


class JudgeReplyFormat(BaseModel):
    """The reply's shape, sent as the call's JSON schema (``reply_model``): the reasoning before the verdict (a
    constrained model writes required properties first, in order)."""

    reasoning: str
    equivalent: bool


def parse_judge_reply(text: str, planted: Sequence[JudgeReply] = ()) -> JudgeReply | None:
    """The verdict in a judge reply, or None when it holds no valid JSON verdict.

    The reply is read as one object first (bare, fenced, or wrapped in prose); failing that, every object in it that
    holds a verdict is found, so that prose before the object may hold braces of its own (``\\frac{1}{2}``). Objects
    that disagree (a verdict and its correction) are no verdict: the judge is asked again. An object equal to one of
    ``planted`` (the verdicts the graded answer itself writes: :func:`planted_verdicts`) is the answer's, quoted,
    not the judge's: it is passed over."""
    cleaned = _FENCE.sub("", text.strip())
    candidates = [cleaned]
    # A model may wrap the object in prose: also try the outermost {...} span.
    start, end = cleaned.find("{"), cleaned.rfind("}")
    if 0 <= start < end:
        candidates.append(cleaned[start : end + 1])
    for raw in candidates:
        try:
            data = loads_reply(raw)
        except ValueError:
            continue
        if (parsed := _reply(data)) is not None and parsed not in planted:
            return parsed
    found = _replies_in(without_trailing_commas(cleaned))
    if not found and "\\" in cleaned:
        found = _replies_in(literal_backslashes(without_trailing_commas(cleaned)))
    found = [reply for reply in found if reply not in planted]
    if not found or len({reply.equivalent for reply in found}) > 1:
        return None
    return found[-1]


def planted_verdicts(student: str) -> list[JudgeReply]:
    """The verdicts in the judge's reply format that ``student`` (an answer being graded) writes itself."""
    return _replies_in(without_trailing_commas(student)) if "{" in student else []


def _reply(data: object) -> JudgeReply | None:
    if not isinstance(data, dict) or not isinstance(data.get("equivalent"), bool | str):
        return None
    try:
        return JudgeReply.model_validate(data)
    except ValidationError:
        return None


def _replies_in(text: str) -> list[JudgeReply]:
    """The verdicts of the JSON objects in ``text`` outside any other object, in order."""
    decoder = json.JSONDecoder(strict=False)
    found: list[JudgeReply] = []
    position = text.find("{")
    while position != -1:
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            position = text.find("{", position + 1)
            continue
        if (parsed := _reply(latex_restored(value))) is not None:
            found.append(parsed)
        position = text.find("{", end)
    return found


@dataclass(frozen=True)
class JudgeVerdict:
    correct: bool | None
    detail: str
    attempts: int
    usage: Usage


def judge_route(settings: Settings | None) -> Settings | None:
    """The settings a judge is opened on: where only the judge role names an endpoint (``[roles.judge] base_url``,
    ``--judge-base-url``), ``settings`` with it made the default endpoint, so that nothing else is started; else
    ``settings`` where an endpoint or a model in process answers every role; None where no judge answers (no
    settings, or the embedded model alone, which is no judge)."""
    if settings is None:
        return None
    own = settings.roles.get(JUDGE_ROLE)
    if not settings.endpoint.base_url and own is not None and own.base_url:
        endpoint = settings.endpoint.model_copy(update={"base_url": own.base_url})
        return settings.model_copy(update={"endpoint": endpoint})
    return None if settings.uses_local_model else settings


def _earlier_seed(*parts: object) -> int:
    # The seed versions before the judge's seed was derived per pair gave each run and retry.
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=4).digest(), "big") >> 1


async def judge_once(
    llm: ChatModel,
    *,
    problem_id: str,
    problem: str,
    reference: str,
    student: str,
    run: int,
    retries: int = 2,
) -> JudgeVerdict:
    """Judge run ``run`` for one (reference, student) pair; invalid replies are retried ``retries`` times."""
    # The texts' own tags are made inert as every template inserts them: an answer that writes "</student>" and a
    # grader's note after it stays inside its block.
    messages = prompt(
        "judge_user.j2",
        system_name="judge_system.j2",
        problem=problem,
        reference=reference,
        student=student[-STUDENT_TAIL_CHARS:],
    )
    usage = Usage()
    detail = ""
    planted = planted_verdicts(student)
    configured = llm.resolve_sampling(JUDGE_ROLE)
    derived = configured.sampling.seed is None
    if derived:
        # Distinct seeds make the runs independent samples, reproducible on servers that honour `seed`.
        configured = configured.over(DERIVED_SEED, Sampling(seed=derived_base(problem_id, student)))
    for attempt in range(retries + 1):
        # The sample index keeps each run and retry a distinct call in the store's cache.
        key = CallKey(problem_id=problem_id, role=JUDGE_ROLE, sample=run * (retries + 1) + attempt)
        # The judge's seed, configured or derived for the pair, goes plus the run (run j: seed + j, as a method's
        # samples send theirs, so runs batched or not draw alike), changed on a retry.
        sampling = retried(for_sample(configured, run), attempt)
        if derived:
            # Verdicts stored by a version that derived each run's and retry's seed on its own still replay.
            earlier: tuple[int, ...] = (_earlier_seed(problem_id, student, run, attempt),)
        else:
            # Verdicts stored by a version that sent every run the configured seed still replay.
            earlier = earlier_configured_seeds(configured.sampling.seed or 0, run, attempt)
        sampling = sampling.model_copy(update={"earlier_seeds": earlier})
        reply = await llm.chat(JUDGE_ROLE, messages, key=key, sampling=sampling, reply_model=JudgeReplyFormat)
        usage = usage + reply.usage
        if not reply.ok:
            detail = f"{CALL_FAILED}: {reply.error}"
            continue
        parsed = parse_judge_reply(reply.content, planted)
        if parsed is not None:
            return JudgeVerdict(parsed.equivalent, parsed.reasoning[:500], attempt + 1, usage)
        if planted and parse_judge_reply(reply.content) is not None:
            detail = f"judge reply holds only a verdict the answer itself wrote: {reply.content[:200]!r}"
        else:
            detail = f"judge reply is not valid JSON: {reply.content[:200]!r}"
    return JudgeVerdict(None, detail, retries + 1, usage)


class JudgeGrader:
    name = JUDGE_ROLE

    def runs(self, config: GradeConfig) -> int:
        return config.judge_runs

    async def grade(self, items: Sequence[Item], context: GradingContext) -> Verdicts:
        if not items:
            return {}
        runs = self.runs(context.config)
        judged = _answerless(items, context)
        answered = [item for item in items if has_answer(item)]
        settings = context.judge_settings
        # The embedded model is no judge; a judge model of the caller's own is, whatever its settings name.
        route = settings if context.model is not None else judge_route(settings)
        if answered and route is None:
            context.grades.notes.append(
                f"no judge endpoint configured: {len(answered)} answers the rules could not decide stay undecided"
            )
        elif answered and route is not None:
            judged.update(await _judge_items(answered, context, route))
        return {item.key: [judged.get((item.key, r)) for r in range(runs)] for item in items}

    def stored_runs(self, stored: StoredGrades) -> int:
        return max([run for (_, grader, run) in stored if grader == JUDGE_ROLE], default=-1) + 1

    def recall(self, items: Sequence[Item], stored: StoredGrades, runs: int) -> Verdicts:
        return {
            item.key: [
                # A verdict stored by an older grading that asked the judge about a reply with no answer is not read.
                (row.verdict if (row := stored.get((item.key, JUDGE_ROLE, r))) is not None else None)
                if has_answer(item)
                else False
                for r in range(runs)
            ]
            for item in items
        }

    def grade_one(self, item: Item) -> bool | None:
        return None  # the judge is a model on an endpoint: never asked from a synchronous caller


def _answerless(items: Sequence[Item], context: GradingContext) -> dict[tuple[ItemKey, int], bool | None]:
    """The verdicts of the items without a final answer: wrong in every run, stored so, no judge asked."""
    out: dict[tuple[ItemKey, int], bool | None] = {}
    rows = []
    for item in items:
        if has_answer(item):
            continue
        for run in range(context.config.judge_runs):
            out[(item.key, run)] = False
            row = context.stored.get((item.key, JUDGE_ROLE, run))
            if row is None or row.answer != item.answer or row.verdict is not False:
                rows.append(GradeRow(*item.key, JUDGE_ROLE, run, item.answer, False, NO_ANSWER))
    context.store.save_grades(rows)
    return out


async def _judge_items(
    items: Sequence[Item], context: GradingContext, settings: Settings
) -> dict[tuple[ItemKey, int], bool | None]:
    config, store, grades = context.config, context.store, context.grades
    out: dict[tuple[ItemKey, int], bool | None] = {}
    # Identical (problem, student answer) pairs are judged once per run and the verdict shared.
    groups: dict[tuple[str, str, int], list[Item]] = defaultdict(list)
    for item in items:
        student = item.answer or ""
        for run in range(config.judge_runs):
            row = context.stored.get((item.key, JUDGE_ROLE, run))
            # An undecided verdict is asked again: a judge that was down is asked anew, and unreadable replies come
            # back from the store's calls at no cost.
            if row is not None and row.answer == item.answer and row.verdict is not None:
                out[(item.key, run)] = row.verdict
            else:
                groups[(item.problem.problem_id, student, run)].append(item)
    if not groups:
        return out
    gate = asyncio.Semaphore(config.judge_concurrency)
    details: list[str] = []
    async with context.open_judge(settings) as llm:

        async def one(pid: str, student: str, run: int, members: list[Item]) -> None:
            problem = members[0].problem
            async with gate:
                verdict = await judge_once(
                    llm,
                    problem_id=pid,
                    problem=problem.question,
                    reference=problem.answer or "",
                    student=student,
                    run=run,
                    retries=config.judge_retries,
                )
            grades.judge_calls += verdict.attempts
            grades.judge_usage = grades.judge_usage + verdict.usage
            details.append(verdict.detail)
            rows = [GradeRow(*m.key, JUDGE_ROLE, run, m.answer, verdict.correct, verdict.detail) for m in members]
            for m in members:
                out[(m.key, run)] = verdict.correct
            store.save_grades(rows)

        await asyncio.gather(*(one(pid, s, r, members) for (pid, s, r), members in groups.items()))
    if failed := sum(detail.startswith(CALL_FAILED) for detail in details):
        grades.notes.append(
            f"{failed} of the judge's questions were left undecided by failed calls: grading again asks them again"
        )
    return out
