"""Training data for the hybrid rewards (paper section 4.2) from TMAS runs, in the release's parquet schema.

Each TMAS run (any teacher endpoint) gives, per labeled problem:

- ``normal``: the iteration-0 generation prompt (standard correctness reward);
- ``experience``: for each iteration t >= 1 whose R_{t-1} and E_{t-1} are non-empty, two rows sharing one
  ``extra_info.group``: the exploit prompt with R_{t-1} alone (variant ``base``) and with E_{t-1} too (``bank``),
  written next to each other, Base first (eq. 7-8 need both halves in one group);
- ``guideline``: for each iteration t >= 1 whose G_{t-1} is non-empty, the explore prompt listing G_{t-1} (eq. 9).

Prompts are rendered by the same agent functions TMAS uses at inference, so training matches inference. Columns:
``prompt`` (chat messages), ``data_source``, ``reward_model`` ({style, ground_truth}), ``extra_info`` (task, group,
variant, question, banks, provenance) and ``_source``. Evaluation problems never get in: problems whose id or
question hash appears in an ``exclude`` JSONL file are dropped, and the optional validation split is a function of
the question hash, so one question is always on the same side.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tmas.agents.rollouts import Rollout, fit_rollouts
from tmas.agents.solution import explore_prompt, generation_prompt, refine_prompt
from tmas.errors import InputError
from tmas.llm.types import Message
from tmas.memory.experience_bank import ExperienceBank
from tmas.memory.guideline_bank import GuidelineBank
from tmas.problems import Problem, load_problems
from tmas.rl.scoring import TASKS, Task
from tmas.store.run_store import RunStore, StoreError

COLUMNS = ("prompt", "data_source", "reward_model", "extra_info", "_source")


def question_hash(question: str) -> str:
    """The identity of a question across files: case and whitespace do not matter."""
    canonical = re.sub(r"\s+", " ", question).strip().lower()
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


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
    problems: int = 0
    excluded: int = 0
    unlabeled: int = 0
    duplicates: int = 0
    runs: list[str] = field(default_factory=list)


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


def _rollouts(record: dict[str, Any]) -> list[Rollout]:
    """R_t of a stored TMAS iteration record: the candidates whose solution call succeeded (as TMAS keeps them)."""
    out = []
    for cand in record.get("candidates", []):
        if cand.get("error"):
            continue
        meta = cand.get("meta") or {}
        out.append(
            Rollout(
                index=int(cand["index"]),
                solution=cand.get("text") or "",
                summary=str(meta.get("summary") or ""),
                score=float(cand.get("score") or 0.0),
                answer=cand.get("answer"),
            )
        )
    return out


def problem_rows(
    problem: Problem, records: list[dict[str, Any]], params: dict[str, Any], run: str
) -> list[dict[str, Any]]:
    """The rows one problem of one TMAS run gives (see the module docstring)."""
    mode = str(params.get("mode", "numeric"))
    q = problem.question
    rows = [_row("normal", generation_prompt(q, mode), problem, run=run, iteration=0)]
    for prev, record in pairwise(records):
        t = int(record["iteration"])
        state = prev.get("state") or {}
        experience = ExperienceBank.model_validate(state.get("experience_bank") or {})
        guideline = GuidelineBank.model_validate(state.get("guideline_bank") or {})
        rollouts = _rollouts(prev)
        # Both banks of t-1 go with every row of iteration t: the state its prompt came from.
        row = partial(_row, problem=problem, run=run, iteration=t, experience=experience, guideline=guideline)
        if rollouts and len(experience) and not params.get("no_experience"):
            views = fit_rollouts(
                rollouts, top_k=params.get("top_k"), max_solution_chars=params.get("max_solution_chars")
            ).views
            for variant, bank in (("base", None), ("bank", experience)):
                messages = refine_prompt(q, mode, views, bank)
                rows.append(row("experience", messages, variant=variant))
        if len(guideline) and not params.get("no_guideline"):
            messages = explore_prompt(q, mode, guideline.strategies)
            rows.append(row("guideline", messages))
    return rows


def in_validation(question: str, fraction: float) -> bool:
    return fraction > 0 and int(question_hash(question), 16) % 10_000 < fraction * 10_000


def build_dataset(run_dirs: Sequence[Path], exclude: ExcludeList | None = None, val_fraction: float = 0.0) -> Dataset:
    exclude = exclude or ExcludeList()
    report = BuildReport()
    train: list[dict[str, Any]] = []
    val: list[dict[str, Any]] = []
    seen_normal: set[str] = set()
    for run_dir in run_dirs:
        if not (run_dir / "run.sqlite").is_file():
            raise InputError(f"{run_dir}: not a run directory (no run.sqlite)")
        try:
            store = RunStore(run_dir, create=False)
        except StoreError as exc:
            raise InputError(f"{run_dir}: {exc}") from None
        with store:
            method = store.get_meta("method") or {}
            if method.get("name") != "tmas":
                raise InputError(f"{run_dir}: method {method.get('name')!r} is not tmas; build-data reads TMAS runs")
            params = dict(method.get("params") or {})
            if params.get("mode", "numeric") != "numeric":
                raise InputError(f"{run_dir}: mode {params.get('mode')!r}: rewards need numeric answers")
            run = run_dir.resolve().name
            report.runs.append(str(run_dir))
            for problem in store.problems():
                if problem.answer is None:
                    report.unlabeled += 1
                    continue
                if exclude.excludes(problem):
                    report.excluded += 1
                    continue
                records = store.iterations(problem.problem_id)
                if not records:
                    continue
                report.problems += 1
                target = val if in_validation(problem.question, val_fraction) else train
                try:
                    rows = problem_rows(problem, records, params, run)
                except (ValidationError, KeyError, TypeError, ValueError) as exc:
                    first = str(exc).splitlines()[0]
                    raise InputError(
                        f"{run_dir}: problem {problem.problem_id!r}: unreadable iteration record: {first}"
                    ) from None
                for row in rows:
                    task = row["_source"]
                    if task == "normal":
                        # The same question in several runs gives one plain example.
                        key = row["extra_info"]["question_hash"]
                        if key in seen_normal:
                            report.duplicates += 1
                            continue
                        seen_normal.add(key)
                    target.append(row)
                    (report.val_rows if target is val else report.rows)[task] += 1
                    if row["extra_info"]["variant"] != "bank":
                        report.groups[task] += 1
    return Dataset(train, val, report)


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
    lines = [
        f"# {train_path.name}",
        "",
        "Hybrid-reward RL data for TMAS (paper section 3.3 and 4.2), built by `tmas rl build-data` from:",
        "",
        *(f"- `{run}`" for run in r.runs),
        "",
        "| `_source` | reward | train rows | prompt groups | validation rows |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    rewards = {
        "normal": "correctness (+1/-1)",
        "experience": "experience utilization (eq. 7-8)",
        "guideline": "novel strategy exploration (eq. 9)",
    }
    for task in TASKS:
        lines.append(f"| {task} | {rewards[task]} | {r.rows[task]} | {r.groups[task]} | {r.val_rows[task]} |")
    lines += [
        f"| total | | {sum(r.rows.values())} | {sum(r.groups.values())} | {sum(r.val_rows.values())} |",
        "",
        f"Problems used: {r.problems}. Left out: {r.excluded} evaluation problems (by id or question hash),"
        f" {r.unlabeled} without a reference answer; {r.duplicates} repeated plain prompts dropped.",
        "",
        "An experience group is two rows next to each other (Base: previous rollouts only; Bank: with the experience"
        " bank) sharing `extra_info.group`; trainers give each half of the group's rollouts to one of them.",
    ]
    if val_path is not None:
        lines.append(f"Validation split (by question hash): `{val_path.name}`.")
    return "\n".join(lines) + "\n"


def write_dataset(data: Dataset, output: Path) -> list[Path]:
    """``output`` (train), ``<stem>.val.parquet`` when there is a validation split, and the card ``<stem>.md``."""
    written = [output]
    write_parquet(data.train, output)
    val_path = None
    if data.val:
        val_path = output.with_name(f"{output.stem}.val.parquet")
        write_parquet(data.val, val_path)
        written.append(val_path)
    card = output.with_name(f"{output.stem}.md")
    card.write_text(dataset_card(data, output, val_path), encoding="utf-8")
    written.append(card)
    return written
