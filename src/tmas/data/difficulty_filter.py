"""A difficulty filter (TMAS paper, appendix A.2, how IMO-AnswerBench-50 was built): solve every problem k times with
plain chain of thought (paper: k = 8 runs of Qwen3-4B-Thinking-2507 at temperature 1.0, top_p 0.95 and replies of up
to 128K tokens, section 4.1), keep the problems solved fewer than t times (paper: t = 2), and select n of them
(paper: 50) with a seed.

The paper's sampling fills what no one set: a temperature, top_p or max_tokens of the config file, a ``TMAS_*``
variable or a flag is sent as given, and said beside the paper's (:func:`sampling_notes`). The paper's 128K tokens
are fitted down to the solution role's context window where it is known (configured, or stated by its server:
:func:`default_max_tokens`); a filter run again on its run directory samples at the max_tokens its samples were
drawn with (a run begun when the default was 2048 resumes at 2048). The paper's sampling is how the samples are
drawn: it goes to the sampling method's role alone (``[roles.solution.sampling]``, under what its own table sets),
and the grading judge is asked at the settings' own sampling, as ``tmas eval``'s judge is. A run begun when it was
laid on the top-level ``[sampling]`` (its judge asked at 1.0 and 128K tokens) resumes as it is: its samples are
asked alike and its judge's verdicts are kept (:mod:`tmas.grading.judge` asks again only undecided ones).

Only problems with a reference answer are sampled: one without (or with a blank one) cannot be judged, and is left
out before any call, counted on the card.

The k samples are one ordinary run, of one iteration, of a method that draws independent samples of the plain
generation prompt (the first sample every method shares): a method whose traits name its sample-count parameter
(``Traits.samples``; majority vote's ``k`` among tmas's own), the settings' own where they configure one, else the
first registered (:func:`sampling_method`). So the filter resumes like any run and its samples can be reported,
viewed and graded like any other. The paper does not say how its 50 were picked from the kept pool; here it is a
uniform draw with the given seed, listed in the original file order.

A sample whose call failed (an error, no reply) says nothing of the problem's difficulty: only samples that replied
are counted. A problem with every sample replied is kept when solved fewer than t times in k; one with r < k replies,
when its rate is below the same share (solved * k < t * r); one with fewer than half of k replies is undecided, left
out and named on the card. A replied sample whose judge's calls failed is not counted either (ungraded, not wrong); a
reply with no answer, or one the rules and judge could not decide, counts as not solved. The filter run again on its
run directory asks those failed samples again, and only them (the replied ones replay from the store), and the
judge's failed questions: a problem a failing server left undecided is decided once it answers.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import ValidationError

from tmas.config import Sampling, SamplingSource, Settings, legacy_sampling_sources
from tmas.errors import ConfigError, InputError
from tmas.files import write_atomic
from tmas.grading.grades import SELECTED, GradeConfig, Grades, ItemKey
from tmas.grading.judge import CALL_FAILED, JUDGE_ROLE
from tmas.grading.run_results import load_results
from tmas.grading.runs import grade_run
from tmas.llm.model import ChatModel
from tmas.llm.replica import probe
from tmas.llm.routes import Routes
from tmas.llm.sampling import resolve_role
from tmas.methods import METHODS, method_names
from tmas.methods.tmas_params import PAPER_MAX_TOKENS
from tmas.problems import Problem, dataset_name, load_problems
from tmas.runner import RunSetup, RunState, holds_run, prepare_run, run_problems, served_now
from tmas.store.records import ProblemResult
from tmas.store.run_store import GradeRow, RunStore

# The paper's sampling for every experiment, the filter's included (section 4.1: "we set the maximum output length to
# 128K tokens, with temperature=1.0 and top_p=0.95"), used where the user set none of their own.
PAPER_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "max_tokens": PAPER_MAX_TOKENS}
# How each source of a sampling field is named to the user, with the flag that sets it.
SOURCE_WORDS: dict[str, str] = {"config": "the config file", "env": "TMAS_{NAME}", "flags": "--{flag}"}


@dataclass
class FilterCard:
    """What the filter did: the counts it saw, what it kept and what it selected."""

    source: str
    model: str | None
    k: int
    below: int
    n: int
    seed: int
    grading: str
    sampling: dict[str, Any]
    # Number of problems solved c times (of their replied samples), for c = 0..k, and how many of them were kept.
    solved_counts: dict[int, int] = field(default_factory=dict)
    kept_counts: dict[int, int] = field(default_factory=dict)
    kept: int = 0
    selected: list[str] = field(default_factory=list)
    # Problems without a reference answer (or a blank one) cannot be judged: left out before any sample is drawn.
    unlabeled: list[str] = field(default_factory=list)
    # Samples whose call failed (not counted: only replied samples are), problems that failed as a whole, and
    # problems with replies to fewer than half of their k samples (undecided): both left out.
    failed_samples: int = 0
    # Replied samples whose judge's calls failed (undecided, not wrong): not counted either.
    ungraded_samples: int = 0
    failed_problems: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["solved_counts"] = {str(c): v for c, v in sorted(self.solved_counts.items())}
        data["kept_counts"] = {str(c): v for c, v in sorted(self.kept_counts.items())}
        return data

    def markdown(self) -> str:
        lines = [
            f"# Difficulty filter of {self.source}",
            "",
            f"- model: {self.model or '(default endpoint model)'}; {self.k} chain-of-thought samples per problem,"
            f" sampling {json.dumps(self.sampling, sort_keys=True)}; grading: {self.grading}",
            f"- kept: problems solved fewer than {self.below} times in {self.k} (of fewer replied samples, at a rate"
            f" below {self.below}/{self.k}): {self.kept}",
            f"- selected: {len(self.selected)} (n = {self.n}, seed {self.seed})",
            f"- failed samples (not counted, only replied samples are): {self.failed_samples}",
            f"- undecided (fewer than half of the {self.k} samples replied): {len(self.undecided)}, left out",
            *(f"- {note}" for note in self.notes),
            "",
            "| Solved | Problems | Kept |",
            "| --- | --- | --- |",
            *(f"| {c} | {self.solved_counts.get(c, 0)} | {self.kept_counts.get(c, 0)} |" for c in range(self.k + 1)),
        ]
        if self.unlabeled:
            lines += ["", f"Left out, no reference answer: {len(self.unlabeled)} problems."]
        return "\n".join(lines) + "\n"


def sampling_method(settings: Settings, method: str | None = None) -> str:
    """The method the filter samples with: ``method`` when given, else the settings' method where it draws
    independent samples, else the first registered method that does. A named method that does not (its traits name
    no ``samples`` parameter) is a one-line error."""
    if method is not None:
        cls = METHODS.get(method)
        if cls is None or not cls.traits.samples:
            raise ConfigError(
                f"the difficulty filter samples with a method that draws independent samples of the plain prompt;"
                f" {method!r} is not one (methods: {method_names()})"
            )
        return method
    configured = METHODS.get(settings.method.name)
    if configured is not None and configured.traits.samples:
        return settings.method.name
    found = next((name for name, cls in METHODS.items() if cls.traits.samples), None)
    if found is None:
        raise ConfigError(f"no registered method draws independent samples (methods: {method_names()})")
    return found


# What a filter's run directory records of the filter that made it (its problems' name and k), so that a resume
# samples the same filter's problems and no other run is sampled over.
FILTER_META = "filter"


def user_sampling(settings: Settings) -> dict[str, SamplingSource]:
    """The sampling fields a user set, each with its source (the config file, a ``TMAS_*`` variable, a flag)."""
    known = settings.sampling_sources
    return dict(legacy_sampling_sources(settings.sampling) if known is None else known)


def filter_settings(
    settings: Settings,
    k: int,
    flags: Collection[str] = (),
    method: str | None = None,
    *,
    max_tokens: int | None = None,
) -> Settings:
    """The run settings of the filter: its sampling method (:func:`sampling_method`) drawing k samples in one
    iteration, at the paper's temperature, top_p and max_tokens (``max_tokens`` where given: the paper's fitted to a
    window, :func:`default_max_tokens`) where no one set their own (the config file, a ``TMAS_*`` variable, a flag:
    ``flags`` names more fields set; a field of the method's role's own ``[roles.NAME.sampling]``). A value a user set
    is sent as set, never replaced: :func:`sampling_notes` says it beside the paper's. The paper's sampling is how it
    draws solutions: it is laid on the method's roles alone (``[roles.NAME.sampling]``), so the grading judge is
    asked at the settings' own sampling, as ``tmas eval``'s judge is. The method's other parameters are the settings'
    own where the settings configure that method."""
    name = sampling_method(settings, method)
    count = METHODS[name].traits.samples
    assert count is not None
    own = settings.method.params if settings.method.name == name else {}
    data = settings.model_dump(mode="json")
    data["method"] = {"name": name, "params": {**own, count: k, "iterations": 1}}
    taken = set(user_sampling(settings)) | set(flags)
    defaults = {**PAPER_SAMPLING, **({"max_tokens": max_tokens} if max_tokens is not None else {})}
    roles = data.setdefault("roles", {})
    for role in METHODS[name].traits.roles:
        table = roles.setdefault(role, {})
        given = table.get("sampling") or {}
        paper = {key: value for key, value in defaults.items() if key not in taken and given.get(key) is None}
        table["sampling"] = {**given, **paper}
    return Settings.model_validate(data)


def filter_role(settings: Settings) -> str:
    """The role the filter's samples go out under: its sampling method's first (majority vote's ``solution``)."""
    return METHODS[sampling_method(settings)].traits.roles[0]


def samples_sampling(settings: Settings) -> Sampling:
    """The sampling the filter's samples are drawn with under ``settings``, resolved for its sampling method's role:
    the paper's where no one set a field. Settings a filter stored when the paper's sampling was laid on the
    top-level ``[sampling]`` resolve to it the same."""
    return resolve_role(settings, filter_role(settings)).sampling


def sampling_notes(user: Mapping[str, str], settings: Settings) -> list[str]:
    """Each sampling field a user set (``user``: field -> source, :func:`user_sampling` of the settings as given)
    whose value the filter's samples are drawn with (:func:`samples_sampling` of ``settings``) differs from the
    paper's, said with where it came from and the paper's value."""
    notes = []
    drawn = samples_sampling(settings)
    for name, paper in PAPER_SAMPLING.items():
        value = getattr(drawn, name)
        if name in user and value != paper:
            flag = name.replace("_", "-")
            source = SOURCE_WORDS.get(user[name], user[name]).format(NAME=name.upper(), flag=flag)
            notes.append(f"{name} {value} (from {source}; the paper's filter samples at {paper})")
    return notes


def stored_settings(run_dir: Path) -> Settings | None:
    """The settings a filter's run in ``run_dir`` recorded; None where it holds no filter's run (or recorded
    settings another version cannot read)."""
    if not holds_run(run_dir):
        return None
    with RunStore(run_dir, read_only=True) as earlier:
        if earlier.get_meta(FILTER_META) is None:
            return None
        data = earlier.get_meta("settings")
    try:
        return Settings.model_validate(data) if data is not None else None
    except ValidationError:
        return None


async def served_window(settings: Settings, role: str) -> int | None:
    """``role``'s context window in tokens: its endpoint's ``context_length`` where configured (the embedded
    model's slot), else the smallest its servers state (vLLM's and SGLang's ``max_model_len``, llama-server's
    ``n_ctx``: :func:`tmas.llm.replica.probe`, as the client learns it); None where none is known."""
    if settings.uses_in_process_model:
        return settings.endpoint.context_length
    if settings.uses_local_model:
        return settings.endpoint.context_length or settings.local.ctx_per_slot
    route = Routes(settings).route(role)
    if route.endpoint.context_length:
        return route.endpoint.context_length
    async with aiohttp.ClientSession() as session:
        for replica in route.replicas:
            await probe(session, replica, route.api_key)
    known = [r.reported_context for r in route.replicas if r.reported_context]
    return min(known) if known else None


async def default_max_tokens(settings: Settings, run_dir: Path, role: str = "solution") -> tuple[int | None, str]:
    """The max_tokens the filter samples with where no one set one (None: a user did), and why, in words: the one
    the samples in ``run_dir`` were drawn with where it holds a filter's run (a run begun when the default was 2048
    resumes at 2048); else the paper's 128K tokens, fitted down to ``role``'s context window where one is known
    (:func:`served_window`): a reply never has more room than the window (the client lowers each call's max_tokens to
    what its prompt leaves, :meth:`tmas.llm.refusals.Refusals.fit_context`), and the estimate counts what it can
    be."""
    own = settings.roles.get(role)
    if "max_tokens" in user_sampling(settings) or (own is not None and own.sampling.max_tokens is not None):
        return None, ""
    stored = stored_settings(run_dir)
    drawn = samples_sampling(stored).max_tokens if stored is not None else None
    if drawn is not None:
        return drawn, f"as the samples in {run_dir} were drawn"
    window = await served_window(settings, role)
    if window is not None and window < PAPER_MAX_TOKENS:
        return window, f"the paper's {PAPER_MAX_TOKENS} fitted to the context window of {window} tokens"
    return PAPER_MAX_TOKENS, "the paper's 128K tokens"


def tallies(
    problems: list[Problem], results: list[ProblemResult], grades: Grades, ungraded: Collection[ItemKey] = ()
) -> dict[str, tuple[int, int]]:
    """Correct and replied samples per labeled problem: a sample is correct when most judge runs call it so; one
    whose call failed (an error, no reply), or one ``ungraded`` (its judge's calls failed), is not counted at all."""
    counts: dict[str, tuple[int, int]] = {}
    finished = {r.problem_id: r for r in results if r.status in ("done", "failed")}
    missing = [p.problem_id for p in problems if p.labeled and p.problem_id not in finished]
    if missing:
        # An unfinished problem would look hard (no sample solved it): never count it, finish it first.
        raise InputError(
            f"{len(missing)} problems have unfinished samples (first: {missing[0]!r}): run the same command again to "
            "resume them"
        )
    for problem in problems:
        if not problem.labeled or finished[problem.problem_id].status == "failed":
            continue  # a failed problem (no usable sample) says nothing about its difficulty: left out
        result = finished[problem.problem_id]
        first = next((rec for rec in result.iterations if rec.iteration == 0), None)
        replied = [
            c
            for c in (first.candidates if first else [])
            if not c.error and (problem.problem_id, 0, c.index) not in ungraded
        ]
        solved = sum(grades.majority_correct((problem.problem_id, 0, c.index)) for c in replied)
        counts[problem.problem_id] = (solved, len(replied))
    return counts


def judge_failed(grades: Grades, rows: list[GradeRow]) -> set[ItemKey]:
    """The samples the judge left undecided by failed calls alone (every run of theirs undecided, one failed): not
    wrong, ungraded; grading again (the filter run again) asks them again. One the judge answered unreadably, or the
    rules could not decide with no judge asked, stays counted as not solved."""
    failed = {
        (r.problem_id, r.iteration, r.candidate)
        for r in rows
        if r.candidate != SELECTED and r.detail.startswith(CALL_FAILED)
    }
    return {key for key in failed if all(v is None for v in grades.verdicts.get(key) or [None])}


def decided(replied: int, k: int) -> bool:
    """Whether enough samples replied to judge a problem's difficulty: at least half of k."""
    return 2 * replied >= k


def is_kept(solved: int, replied: int, k: int, below: int) -> bool:
    """Solved fewer than ``below`` times in ``k``; of fewer replied samples, at a rate below ``below / k``."""
    # Appendix A.2: "we perform 8 independent inference runs for each problem in the original IMO-AnswerBench and
    # retain the problems that are solved correctly fewer than 2 times out of 8" (k = 8, below = 2). With every
    # sample replied (replied = k) this is solved < below; with fewer, the same share: solved / replied < below / k.
    return solved * k < below * replied


def select(
    problems: list[Problem], counts: dict[str, tuple[int, int]], k: int, below: int, n: int, seed: int
) -> tuple[list[str], int]:
    """The ids kept (decided, and solved fewer than ``below`` times in ``k``, :func:`is_kept`) and, of those, ``n``
    drawn with ``seed`` (all of them when fewer are kept), in the file's order."""
    kept = [
        p.problem_id
        for p in problems
        if p.problem_id in counts and decided(counts[p.problem_id][1], k) and is_kept(*counts[p.problem_id], k, below)
    ]
    chosen = set(random.Random(seed).sample(kept, n)) if len(kept) > n else set(kept)
    return [pid for pid in kept if pid in chosen], len(kept)


def build_card(
    source: str,
    settings: Settings,
    problems: list[Problem],
    results: list[ProblemResult],
    grades: Grades,
    *,
    k: int,
    below: int,
    n: int,
    seed: int,
    ungraded: Collection[ItemKey] = (),
    unlabeled: Collection[str] = (),
    notes: Collection[str] = (),
) -> FilterCard:
    """The card of the filter over ``problems`` (those with a reference answer; ``unlabeled``: the ids of those
    without, left out before any sample; ``notes``: more to say, such as a sampling field set otherwise than the
    paper's)."""
    counts = tallies(problems, results, grades, ungraded)
    selected, kept = select(problems, counts, k, below, n, seed)
    judged = {pid: tally for pid, tally in counts.items() if decided(tally[1], k)}
    card = FilterCard(
        source=source,
        model=settings.endpoint.model,
        k=k,
        below=below,
        n=n,
        seed=seed,
        grading=grades.described(),
        sampling=samples_sampling(settings).model_dump(exclude_none=True, exclude_defaults=True),
        solved_counts=dict(Counter(solved for solved, _ in judged.values())),
        kept_counts=dict(Counter(solved for solved, replied in judged.values() if is_kept(solved, replied, k, below))),
        kept=kept,
        selected=selected,
        unlabeled=[*unlabeled, *(p.problem_id for p in problems if not p.labeled)],
        failed_samples=sum(bool(c.error) for r in results for rec in r.iterations for c in rec.candidates),
        ungraded_samples=len(ungraded),
        failed_problems=[r.problem_id for r in results if r.status == "failed"],
        undecided=[p.problem_id for p in problems if p.problem_id in counts and p.problem_id not in judged],
        notes=[*notes, *grades.notes],
    )
    if card.undecided:
        card.notes.append(
            f"{len(card.undecided)} problems had replies to fewer than half of their {k} samples (undecided): left out"
            " of the filter"
        )
    if card.ungraded_samples:
        card.notes.append(
            f"{card.ungraded_samples} samples were not counted: their judge's calls failed; run the same command again"
            " to grade them"
        )
    if card.failed_problems:
        card.notes.append(f"{len(card.failed_problems)} problems failed (no usable sample): left out of the filter")
    if kept < n:
        card.notes.append(f"only {kept} problems were kept, fewer than n = {n}: all of them are selected")
    return card


def write_subset(problems: list[Problem], selected: list[str], out: Path) -> int:
    """The selected problems as tmas JSONL (problem_id, question, answer, then their other fields), put in place
    whole (:func:`tmas.files.write_atomic`): a write stopped part way leaves the subset an earlier run wrote."""
    wanted = set(selected)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {"problem_id": p.problem_id, "question": p.question, "answer": p.answer, **p.metadata}, ensure_ascii=False
        )
        + "\n"
        for p in problems
        if p.problem_id in wanted
    ]
    write_atomic(out, "".join(lines))
    return len(lines)


def write_card(card: FilterCard, out: Path) -> tuple[Path, Path]:
    """``<subset>.card.json`` and ``<subset>.card.md`` beside the subset, each put in place whole."""
    json_path = out.with_name(out.stem + ".card.json")
    md_path = out.with_name(out.stem + ".card.md")
    write_atomic(json_path, json.dumps(card.to_dict(), indent=2, ensure_ascii=False) + "\n")
    write_atomic(md_path, card.markdown())
    return json_path, md_path


def holds_filter_run(
    run_dir: Path,
    source: Path,
    k: int,
    settings: Settings,
    *,
    own_model: bool = False,
    served: Mapping[str, list[str]] | None = None,
) -> bool:
    """Whether ``run_dir`` holds the samples of this filter (of ``source`` with ``k``) to resume under ``settings``;
    False where it holds no run yet. Another run, another filter's samples, or samples drawn otherwise than
    ``settings`` draw them (:func:`sampled_otherwise`; ``served``: what the servers serve now, where asked) are
    refused in one line: no filter's result holds the samples of two models or samplings."""
    if not holds_run(run_dir):
        return False
    made = {"source": dataset_name(source), "k": k}
    setup = RunSetup.check(settings, own_model=own_model, resuming=run_dir)
    with RunStore(run_dir, read_only=True) as earlier:
        found = earlier.get_meta(FILTER_META)
        changed = sampled_otherwise(earlier, setup, served) if found == made else []
    if found != made:
        what = f"the samples of a filter of {found['source']} with k={found['k']}" if found else "no filter's samples"
        raise InputError(f"--run-dir {run_dir} holds {what}, not of {made['source']} with k={k}: give another")
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        flags = resume_flags(run_dir, settings)
        again = f" (with {' '.join(flags)})" if flags else ""
        raise InputError(
            f"--run-dir {run_dir} holds samples drawn with {'; '.join(changed[:3])}{more}: sampling on would mix them;"
            f" run it again without the change{again}, or give another --run-dir"
        )
    return True


def resume_flags(run_dir: Path, settings: Settings) -> list[str]:
    """The flags that sample as the samples in ``run_dir`` were drawn, for each of the paper's sampling fields
    ``settings`` set otherwise: ``--max-tokens 2048`` for a filter begun when that was the default."""
    before = stored_settings(run_dir)
    if before is None:
        return []
    old, new = samples_sampling(before), samples_sampling(settings)
    return [
        f"--{name.replace('_', '-')} {getattr(old, name)}"
        for name in PAPER_SAMPLING
        if getattr(old, name) is not None and getattr(old, name) != getattr(new, name)
    ]


def sampled_otherwise(store: RunStore, setup: RunSetup, served: Mapping[str, list[str]] | None = None) -> list[str]:
    """What ``setup`` draws samples with otherwise than ``store``'s replied samples were drawn, each as ``NAME OLD
    (now NEW)``; none where no sample replied yet (nothing would be mixed). As a resumed run compares them
    (:meth:`RunSetup.changed_requests`, :meth:`RunSetup.changed_handling`: the model, sampling, seed, prompt
    templates; :meth:`RunSetup.changed_servers`: where no model is named, the endpoint's URLs and the model its server
    serves now (``served``), since a stored sample replays whatever server is asked now and only the failed ones would
    be sent to the new one)."""
    roles = setup.method.traits.roles
    if not any(n for role, (n, _) in store.replies_by_role().items() if role in roles):
        return []
    servers = [change.shown for change in setup.changed_servers(store, served)]
    return sorted(setup.changed_requests(store) + setup.changed_handling(store) + servers)


async def served_by_filter_run(run_dir: Path, settings: Settings, *, own_model: bool) -> dict[str, list[str]]:
    """What the servers of the samples ``run_dir`` holds serve now, where the filter names no model
    (:func:`tmas.runner.served_now`); none where it holds no run or samples a model of the caller's own."""
    if own_model or not holds_run(run_dir):
        return {}
    setup = RunSetup.check(settings, resuming=run_dir)
    with RunStore(run_dir, read_only=True) as earlier:
        return await served_now(setup, earlier)


def labeled_problems(source: Path, limit: int | None = None) -> tuple[list[Problem], list[str]]:
    """The problems of ``source`` (its first ``limit``) the filter samples, those with a reference answer, and the
    ids of the others: with no answer, or a blank one, no sample of theirs could be judged, so none is drawn. A file
    with no answer at all is a one-line error."""
    loaded = load_problems(source)
    loaded = loaded[:limit] if limit else loaded
    labeled = [p for p in loaded if p.labeled]
    if not labeled:
        raise InputError(f"{source}: no problem has a reference answer: the filter judges samples by theirs")
    return labeled, [p.problem_id for p in loaded if not p.labeled]


async def run_filter(
    source: Path,
    run_dir: Path,
    out: Path,
    settings: Settings,
    grading: GradeConfig,
    *,
    k: int,
    below: int,
    n: int,
    seed: int,
    limit: int | None = None,
    model: ChatModel | None = None,
    state: RunState | None = None,
    on_result: Callable[[ProblemResult], None] | None = None,
    notes: Collection[str] = (),
) -> FilterCard:
    """Sample (or resume sampling) every problem with a reference answer k times into ``run_dir``, grade the
    samples, and write the selected subset to ``out`` with its card beside it (``notes`` on it too). The samples (and
    a judge's grades) come from the endpoint of ``settings``, or from ``model``, a
    :class:`tmas.llm.model.ChatModel` of the caller's own. ``state`` and ``on_result``: the sampling's progress, as a
    run's (:func:`tmas.runner.run_problems`)."""
    if k < 1 or below < 1 or n < 1:
        raise InputError("the filter needs k >= 1, --below >= 1 and -n >= 1")
    own = model is not None
    made = {"source": dataset_name(source), "k": k}
    asked, unlabeled = labeled_problems(source, limit)
    served = await served_by_filter_run(run_dir, settings, own_model=own)
    if holds_filter_run(run_dir, source, k, settings, own_model=own, served=served):
        store, settings, _ = prepare_run(run_dir, settings, None, resume=True, own_model=own)
    else:
        store, settings, _ = prepare_run(run_dir, settings, asked, resume=False, own_model=own)
        store.set_meta("dataset", dataset_name(source))
        store.set_meta(FILTER_META, made)
    wanted = {p.problem_id for p in asked}
    with store:
        # A resumed filter may ask for other problems than its run holds (another --limit): those not sampled yet
        # join the run, and only the ones asked for are sampled, counted and selected from.
        store.add_problems(asked)
        problems = [p for p in store.problems() if p.problem_id in wanted]
        # A problem with samples whose call failed is solved again (tmas.runner.run_problems): only those samples are
        # asked, the replied ones replay from the store, so a server that failed before can decide it now.
        await run_problems(settings, problems, store, state=state or RunState(), on_result=on_result, model=model)
        grades = await grade_run(store, grading, settings, model=model)
        results = [r for r in load_results(store) if r.problem_id in wanted]
        ungraded = {key for key in judge_failed(grades, store.grades(JUDGE_ROLE)) if key[0] in wanted}
    card = build_card(
        str(source),
        settings,
        problems,
        results,
        grades,
        k=k,
        below=below,
        n=n,
        seed=seed,
        ungraded=ungraded,
        unlabeled=unlabeled,
        notes=notes,
    )
    write_subset(problems, card.selected, out)
    write_card(card, out)
    return card
