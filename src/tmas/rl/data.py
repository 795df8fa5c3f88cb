"""Training data for the hybrid rewards (paper section 4.2) from TMAS runs, in the release's parquet schema.

Each TMAS run (any teacher endpoint) gives, per labeled problem:

- ``normal``: the iteration-0 generation prompt (standard correctness reward);
- ``experience``: for each iteration t >= 1 whose R_{t-1} and E_{t-1} are non-empty, two rows sharing one
  ``extra_info.group``: the exploit prompt with R_{t-1} alone (variant ``base``) and with E_{t-1} too (``bank``),
  written next to each other, Base first (eq. 7-8 need both halves in one group);
- ``guideline``: for each iteration t >= 1 whose G_{t-1} is non-empty, the explore prompt listing G_{t-1} (eq. 9).

t runs up to T, the iteration after the run's last, where that last iteration's memory update ran (section 4.2
distils every round's experiences and guidelines); under ``skip_final_memory`` or after an early stop it did not
(no summaries, the banks of the iteration before), and t runs up to T-1.

Prompts are built by the run's method itself (:class:`tmas.methods.training_prompts.BankPrompts`: TMAS's own prompt
builders), from the method made with the run's stored parameters, in the run's output style, with R_{t-1} fitted to
the same prompt budget as the run fitted it (its stored settings) and with the run's own prompt templates (its
``prompts_dir``, checked against the overrides the run recorded), so training matches inference. Columns:
``prompt`` (chat messages), ``data_source``, ``reward_model`` ({style, ground_truth}), ``extra_info`` (task, group,
variant, copy, question, banks, provenance) and ``_source``. Evaluation problems never
get in: problems whose id or question hash appears in an ``exclude`` JSONL file are dropped, and the optional
validation split is a function of the question hash, so one question is always on the same side.

The mix (section 4.2: 2.2K normal, 1.6K experience, 0.6K guideline examples) is drawn per split by prompt group:
as many groups of each task as the ratio allows given the scarcest task, taken one problem at a time (a seeded
round over the problems), so one problem with many iterations does not fill a task. The chosen groups are written
in a seeded random order, the rows of a group next to each other. The ``verl`` layout writes every group as two
rows (a one-row group twice, ``extra_info.copy`` 1 on the second), so verl's per-row rollouts make one group of
2 x ``rollout.n`` and an even batch size never cuts a group.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from tmas.agents.overrides import check_overrides
from tmas.agents.templates import prompts_from
from tmas.config import Settings
from tmas.errors import ConfigError, InputError, first_error
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.guideline_bank import GuidelineBank
from tmas.methods import METHODS, stored_params
from tmas.methods.training_prompts import BankPrompts, Rendering
from tmas.problems import Problem, load_problems, question_hash
from tmas.rl.scoring import TASKS, Task
from tmas.store.records import IterationRecord
from tmas.store.run_store import RunStore, StoreError, resolved_once

COLUMNS = ("prompt", "data_source", "reward_model", "extra_info", "_source")
Layout = Literal["trl", "verl"]
# Section 4.2: 2.2K normal, 1.6K experience and 0.6K guideline training examples.
PAPER_MIX: tuple[float, float, float] = (2.2, 1.6, 0.6)


# What a store a run left before its setup holds: an empty file, or its problems alone.
NO_RUN = "holds no run: it was stopped before its first call"


def parse_mix(text: str) -> tuple[float, float, float] | None:
    """``normal:experience:guideline`` weights (e.g. the paper's ``2.2:1.6:0.6``), or ``all`` (None: keep every
    example)."""
    if text.strip().lower() == "all":
        return None
    parts = text.split(":")
    try:
        weights = tuple(float(p) for p in parts)
    except ValueError:
        weights = ()
    if len(weights) != 3 or any(w < 0 or not math.isfinite(w) for w in weights) or not any(weights):
        raise InputError(f"--mix {text!r}: expected normal:experience:guideline weights >= 0, e.g. 2.2:1.6:0.6, or all")
    return weights[0], weights[1], weights[2]


@dataclass
class ExcludeList:
    """Problems that must never reach training data (evaluation sets), by id and by question hash."""

    ids: set[str] = field(default_factory=set)
    hashes: set[str] = field(default_factory=set)

    @classmethod
    def from_files(cls, paths: Iterable[Path]) -> ExcludeList:
        out = cls()
        for path in paths:
            for problem in load_problems(path):
                out.ids.add(problem.problem_id)
                out.hashes.add(question_hash(problem.question))
        return out

    def excludes(self, problem: Problem) -> bool:
        return problem.problem_id in self.ids or question_hash(problem.question) in self.hashes


@dataclass
class BuildReport:
    rows: Counter[str] = field(default_factory=Counter)
    groups: Counter[str] = field(default_factory=Counter)
    val_rows: Counter[str] = field(default_factory=Counter)
    # Prompt groups per task the runs gave (train split), before the mix drew from them.
    available: Counter[str] = field(default_factory=Counter)
    mix: tuple[float, float, float] | None = None
    seed: int = 0
    layout: Layout = "trl"
    problems: int = 0
    excluded: int = 0
    unlabeled: int = 0
    duplicates: int = 0
    runs: list[str] = field(default_factory=list)
    # Per run: the output style and prompt budget its training prompts were rendered with.
    rendering: list[str] = field(default_factory=list)


@dataclass
class Dataset:
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    report: BuildReport


def _messages(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def _row(
    task: Task,
    messages: list[Message],
    problem: Problem,
    *,
    run: str,
    iteration: int,
    variant: str | None = None,
    experience: ExperienceBank | None = None,
    guideline: GuidelineBank | None = None,
) -> dict[str, Any]:
    assert problem.answer is not None
    group = f"{run}/{problem.problem_id}/{iteration}/{task}"
    return {
        "prompt": _messages(messages),
        "data_source": f"tmas/{task}",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        # Every row has every key, so the parquet column has one struct type.
        "extra_info": {
            "task": task,
            "group": group,
            "variant": variant,
            # 1 on the second row of a one-row group written twice (the verl layout).
            "copy": 0,
            "problem_id": problem.problem_id,
            "question": problem.question,
            "question_hash": question_hash(problem.question),
            "run": run,
            "iteration": iteration,
            "experience_bank": [
                {"id": e.id, "kind": e.kind, "subtype": e.subtype, "content": e.content}
                for e in (experience.entries if experience else [])
            ],
            "guideline_bank": [
                {"id": s.id, "description": s.description} for s in (guideline.strategies if guideline else [])
            ],
        },
        "_source": task,
    }


def problem_rows(
    problem: Problem,
    records: list[IterationRecord],
    method: BankPrompts,
    run: str,
    rendering: Rendering | None = None,
) -> list[dict[str, Any]]:
    """The rows one problem of one run gives (see the module docstring), its prompts built by ``method`` (made with
    the run's parameters) as ``rendering`` says."""
    render = rendering or Rendering()
    rows = [_row("normal", method.first_prompt(problem.question, render), problem, run=run, iteration=0)]
    # Every iteration's state, the last one's too where its memory update ran: the state an iteration T would start
    # from is one TMAS reaches at test time when it runs longer, and the richest memory the run distilled.
    states = records if records and method.leaves_next_state(records[-1]) else records[:-1]
    for prev in states:
        t = prev.iteration + 1
        prompts = method.prompts_after(problem.question, prev, render)
        # Both banks of t-1 go with every row of iteration t: the state its prompt came from.
        row = partial(
            _row,
            problem=problem,
            run=run,
            iteration=t,
            experience=prompts.experience_bank,
            guideline=prompts.guideline_bank,
        )
        if prompts.exploit is not None:
            # Base and Bank share the problem and the trajectories (section 3.3).
            for variant, messages in zip(("base", "bank"), prompts.exploit, strict=True):
                rows.append(row("experience", messages, variant=variant))
        if prompts.explore is not None:
            rows.append(row("guideline", prompts.explore))
    return rows


def in_validation(question: str, fraction: float) -> bool:
    return fraction > 0 and int(question_hash(question), 16) % 10_000 < fraction * 10_000


@dataclass
class _Group:
    """The rows of one prompt group (one row, or an experience group's Base and Bank rows)."""

    task: Task
    problem: str
    rows: list[dict[str, Any]]


def _groups(rows: Iterable[dict[str, Any]]) -> list[_Group]:
    out: dict[str, _Group] = {}
    for row in rows:
        info = row["extra_info"]
        key = str(info["group"])
        if key not in out:
            out[key] = _Group(row["_source"], str(info["question_hash"]), [])
        out[key].rows.append(row)
    return list(out.values())


def mix_targets(available: Counter[str], mix: tuple[float, float, float]) -> dict[str, int]:
    """Groups to take per task: the largest scale at which every weighted task still has enough groups, times each
    weight, rounded (never more than there are). E.g. 40 / 120 / 120 available at 2.2 : 1.6 : 0.6 -> scale
    min(40/2.2, 120/1.6, 120/0.6) = 18.18 -> 40, 29, 11. A task the runs gave no group of (T = 1 under
    ``skip_final_memory``, an ablation) does not hold the others down; the card shows it at 0."""
    weights = dict(zip(TASKS, mix, strict=True))
    scales = [available[t] / w for t, w in weights.items() if w > 0 and available[t] > 0]
    scale = min(scales, default=0.0)
    return {t: min(available[t], int(scale * w + 0.5)) for t, w in weights.items()}


def draw_by_problem(groups: list[_Group], count: int, rng: random.Random) -> list[_Group]:
    """``count`` of ``groups``, one problem at a time: problems in a random order, each giving one of its groups (at
    random) per round, so the examples spread over as many problems as they can."""
    by_problem: dict[str, list[_Group]] = {}
    for g in groups:
        by_problem.setdefault(g.problem, []).append(g)
    queues = list(by_problem.values())
    rng.shuffle(queues)
    for queue in queues:
        rng.shuffle(queue)
    chosen: list[_Group] = []
    while len(chosen) < count:
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return chosen


def mixed(
    rows: list[dict[str, Any]], mix: tuple[float, float, float] | None, rng: random.Random, layout: Layout
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The rows of the groups the mix draws (all of them without a mix) in a random group order, each group's rows
    together, and the groups available per task."""
    groups = _groups(rows)
    available: Counter[str] = Counter(g.task for g in groups)
    chosen: list[_Group] = []
    if mix is None or not groups:
        chosen = groups
    else:
        targets = mix_targets(available, mix)
        for task in TASKS:
            chosen += draw_by_problem([g for g in groups if g.task == task], targets[task], rng)
    rng.shuffle(chosen)
    out: list[dict[str, Any]] = []
    for g in chosen:
        out += g.rows
        if layout == "verl" and len(g.rows) == 1:
            out.append({**g.rows[0], "extra_info": {**g.rows[0]["extra_info"], "copy": 1}})
    return out, available


def run_names(run_dirs: Sequence[Path]) -> dict[Path, str]:
    """Each run's name in its rows' groups: its directory's name, or its whole path where two runs' names are one (a
    group is one run's; rows of two runs under one name made groups of four rows, or two prompts in one group). A
    run given twice is refused."""
    resolved = resolved_once(run_dirs)
    shared = {name for name in (p.name for p in resolved) if [q.name for q in resolved].count(name) > 1}
    return {given: str(p) if p.name in shared else p.name for given, p in zip(run_dirs, resolved, strict=True)}


def build_dataset(
    run_dirs: Sequence[Path],
    exclude: ExcludeList | None = None,
    val_fraction: float = 0.0,
    *,
    mix: tuple[float, float, float] | None = PAPER_MIX,
    seed: int = 0,
    layout: Layout = "trl",
    context_length: int | None = None,
) -> Dataset:
    exclude = exclude or ExcludeList()
    report = BuildReport(mix=mix, seed=seed, layout=layout)
    train: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    seen_normal: set[str] = set()
    names = run_names(run_dirs)
    for run_dir in run_dirs:
        if not (run_dir / "run.sqlite").is_file():
            raise InputError(f"{run_dir}: not a run directory (no run.sqlite)")
        if (run_dir / "run.sqlite").stat().st_size == 0:  # said without writing a schema into it
            raise InputError(f"{run_dir}: {NO_RUN}")
        try:
            store = RunStore(run_dir, read_only=True)
        except StoreError as exc:
            raise InputError(f"{run_dir}: {exc}") from None
        with store:
            method, settings = _bank_method(store, run_dir)
            rendering = method.rendering(settings, context_length)
            run = names[run_dir]
            report.runs.append(str(run_dir))
            report.rendering.append(f"`{run_dir}`: {rendering.describe()}")
            for problem in store.problems():
                if not problem.labeled:
                    # No reward without a reference answer (a blank one included: 'tmas rl train' refuses its rows).
                    report.unlabeled += 1
                    continue
                if exclude.excludes(problem):
                    report.excluded += 1
                    continue
                try:
                    records = store.iterations(problem.problem_id)
                    if not records:
                        continue
                    report.problems += 1
                    target = val if in_validation(problem.question, val_fraction) else train
                    with prompts_from(settings.prompts_dir if settings is not None else None):
                        rows = problem_rows(problem, records, method, run, rendering)
                except (ValidationError, KeyError, TypeError, ValueError) as exc:
                    first = str(exc).splitlines()[0]
                    raise InputError(
                        f"{run_dir}: problem {problem.problem_id!r}: unreadable iteration record: {first}"
                    ) from None
                for row in rows:
                    if row["_source"] == "normal":
                        # The same question in several runs gives one plain example.
                        key = row["extra_info"]["question_hash"]
                        if key in seen_normal:
                            report.duplicates += 1
                            continue
                        seen_normal.add(key)
                    target.append(row)
    rng = random.Random(seed)
    train, report.available = mixed(train, mix, rng, layout)
    val, _ = mixed(val, mix, rng, layout)
    for split, counts in ((train, report.rows), (val, report.val_rows)):
        for row in split:
            counts[row["_source"]] += 1
    for row in train:
        info = row["extra_info"]
        if info["variant"] != "bank" and not info["copy"]:
            report.groups[row["_source"]] += 1
    return Dataset(train, val, report)


def _bank_method(store: RunStore, run_dir: Path) -> tuple[BankPrompts, Settings | None]:
    """The run's method, made with its stored parameters, and its stored settings: a method that builds the prompts
    RL trains on (one that keeps TMAS's banks), with numeric answers, its prompt overrides as the run had them."""
    stored = store.get_meta("method") or {}
    if not stored:
        # What a run leaves before its setup (an empty store file, its problems alone): no run, not one of method None.
        raise InputError(f"{run_dir}: {NO_RUN}")
    name = str(stored.get("name"))
    cls = METHODS.get(name)
    if cls is None or not issubclass(cls, BankPrompts):
        raise InputError(
            f"{run_dir}: method {stored.get('name')!r} keeps no experience or guideline banks;"
            " build-data reads runs of a method that does (tmas)"
        )
    mode = stored_params(name, stored.get("params"))["mode"]
    if mode != "numeric":
        raise InputError(f"{run_dir}: mode {mode!r}: rewards need numeric answers")
    try:
        method = cls(cls.Params.as_stored(stored.get("params") or {}))
        raw = store.get_meta("settings")
        settings = Settings.model_validate(raw) if raw else None
    except ValidationError as exc:
        raise InputError(f"{run_dir}: stored {name} parameters or settings unreadable: {first_error(exc)}") from None
    _check_overrides(run_dir, settings, store.get_meta("prompt_overrides"))
    assert isinstance(method, BankPrompts)
    return method, settings


def _check_overrides(run_dir: Path, settings: Settings | None, recorded: dict[str, str] | None) -> None:
    """The run's prompt templates are still the ones it ran with: its ``prompts_dir`` reads, and holds exactly the
    overrides the run recorded, each with the same SHA-256 (runs stored before overrides were recorded: not
    compared). Else the rows would not be the prompts the run was given."""
    folder = settings.prompts_dir if settings is not None else None
    if folder is None:
        return
    try:
        found = {o.name: o.sha256 for o in check_overrides(folder)}
    except ConfigError as exc:
        raise InputError(f"{run_dir}: the run's prompt overrides cannot be read: {exc}") from None
    changed = sorted(n for n in {*(recorded or {}), *found} if recorded is not None and recorded.get(n) != found.get(n))
    if changed:
        raise InputError(
            f"{run_dir}: prompt template {changed[0]} in {folder} is not the one the run used:"
            " restore the run's overrides to build its training prompts"
        )


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("writing parquet needs pyarrow: pip install 'tmas[rl]'") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def dataset_card(data: Dataset, train_path: Path, val_path: Path | None) -> str:
    r = data.report
    mix = (
        "all examples (no mix)"
        if r.mix is None
        else ":".join(f"{w:g}" for w in r.mix) + " (normal:experience:guideline)"
    )
    lines = [
        f"# {train_path.name}",
        "",
        "Hybrid-reward RL data for TMAS (paper section 3.3 and 4.2), built by `tmas rl build-data` from:",
        "",
        *(f"- `{run}`" for run in r.runs),
        "",
        f"Mix: {mix}, drawn by prompt group one problem at a time, seed {r.seed} (the paper: 2.2K normal, 1.6K"
        f" experience, 0.6K guideline examples). Layout: {r.layout}.",
        "",
        "| `_source` | reward | groups available | prompt groups | train rows | validation rows |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    rewards = {
        "normal": "correctness (+1/-1)",
        "experience": "experience utilization (eq. 7-8)",
        "guideline": "novel strategy exploration (eq. 9)",
    }
    for task in TASKS:
        lines.append(
            f"| {task} | {rewards[task]} | {r.available[task]} | {r.groups[task]} | {r.rows[task]} |"
            f" {r.val_rows[task]} |"
        )
    lines += [
        f"| total | | {sum(r.available.values())} | {sum(r.groups.values())} | {sum(r.rows.values())} |"
        f" {sum(r.val_rows.values())} |",
        "",
        f"Problems used: {r.problems}. Left out: {r.excluded} evaluation problems (by id or question hash),"
        f" {r.unlabeled} without a reference answer; {r.duplicates} repeated plain prompts dropped.",
        "",
        "Prompts rendered as each run rendered them:",
        "",
        *(f"- {line}" for line in r.rendering),
        "",
        "An experience group is two rows next to each other (Base: previous rollouts only; Bank: with the experience"
        " bank) sharing `extra_info.group`; trainers give each half of the group's rollouts to one of them.",
    ]
    if r.layout == "verl":
        lines.append(
            "verl layout: every group is two rows (a one-row group written twice, `extra_info.copy` 1 on the"
            " second); train with `rollout.n` = half the rollouts per prompt and an even `train_batch_size`."
        )
    if val_path is not None:
        lines.append(f"Validation split (by question hash): `{val_path.name}`.")
    return "\n".join(lines) + "\n"


def write_dataset(data: Dataset, output: Path) -> list[Path]:
    """``output`` (train), ``<stem>.val.parquet`` when there is a validation split, and the card ``<stem>.md``."""
    written = [output]
    write_parquet(data.train, output)
    val_path = None
    stale = output.with_name(f"{output.stem}.val.parquet")
    if data.val:
        val_path = stale
        write_parquet(data.val, val_path)
        written.append(val_path)
    elif stale.exists():
        # An earlier build's split: its questions may be in this training file now.
        stale.unlink()
    card = output.with_name(f"{output.stem}.md")
    card.write_text(dataset_card(data, output, val_path), encoding="utf-8")
    written.append(card)
    return written
