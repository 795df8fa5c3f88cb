"""lm-evaluation-harness through `tmas serve` against `tmas eval`, problem by problem: the same problems, methods,
sampling and seeds, on the embedded model (or the simulated upstream with ``--upstream sim``).

For each method, lm-eval (``local-chat-completions``, its own command line) scores the task `tmas data lm-eval-task`
writes, through the proxy; then the same problems are run in-process as `tmas eval` runs them and graded by its
rules grader (Math-Verify). A served question is its own run, whose problem id the proxy derives from the request,
and a method's calls draw their seeds from the run seed and the problem id: so the in-process run gives each problem
the id of its served problem and the served run's seed, and the two ask the upstream the very same calls. Where the
upstream answers the same call the same way (a seeded sampler), the two transcripts are the same, and a difference in
the scores is a difference in grading alone (lm-eval's last-\\boxed{} regex and exact match, against tmas's extraction
and Math-Verify).

    PYTHONPATH=src .venv/bin/python benchmarks/lm_eval_vs_tmas_eval.py --limit 20 --methods cot tmas
    PYTHONPATH=src .venv/bin/python benchmarks/lm_eval_vs_tmas_eval.py --upstream sim --limit 6
    PYTHONPATH=src .venv/bin/python benchmarks/lm_eval_vs_tmas_eval.py --base-url http://localhost:8000/v1 --model M
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmas.api import arun
from tmas.config import Sampling, Settings
from tmas.data.generators import FAMILIES, generate
from tmas.data.lm_eval_task import write_task
from tmas.grading.grades import Item
from tmas.grading.rules import RulesGrader
from tmas.llm.provision import provisioned
from tmas.llm.sampling import with_sampling
from tmas.methods import METHODS
from tmas.problems import Problem, load_problems
from tmas.serve.jobs import REQUEST_META
from tmas.serve.launch import ServeOptions
from tmas.store.records import ProblemResult
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer
from tmas.testing.web_servers import ProxyThread

TASK = "tmas_compare"
# Small settings of each method, so that a comparison on the embedded model takes minutes, not hours.
SMALL_PARAMS: dict[str, dict[str, Any]] = {"tmas": {"n": 2, "m": 1, "iterations": 1}, "majority": {"k": 3}}


@dataclass
class Row:
    """One problem of one method, scored both ways."""

    question: str
    gold: str
    served_id: str
    lm_eval_answer: str
    lm_eval_correct: bool
    tmas_answer: str | None
    tmas_correct: bool | None
    same_text: bool


@contextlib.asynccontextmanager
async def upstream(kind: str, base_url: str | None, model: str | None) -> AsyncIterator[Settings]:
    """Settings whose endpoint answers: your server, the simulator, or the embedded model started once for both."""
    if base_url is not None:
        yield Settings.model_validate({"endpoint": {"base_url": [base_url], "model": model}})
        return
    if kind == "sim":
        with SimServer(SimScript()) as sim:
            yield Settings.model_validate({"endpoint": {"base_url": [sim.base_url], "model": "sim-model"}})
        return
    async with provisioned(Settings(), log_dir=Path(tempfile.mkdtemp(prefix="tmas-compare-"))) as live:
        yield live


def embedded(args: argparse.Namespace) -> bool:
    """The upstream is the embedded model: methods get their small local presets, as `tmas eval` gives them."""
    return args.upstream == "embedded" and getattr(args, "base_url", None) is None


def run_lm_eval(
    model: str, proxy: ProxyThread, task_dir: Path, out: Path, params: dict[str, Any], workers: int
) -> Path:
    """``lm_eval run`` through the proxy; the samples file it logs."""
    args = [
        "--model", "local-chat-completions",
        "--model_args", f"model={model},base_url={proxy.url}/v1/chat/completions,num_concurrent={workers},"
        "max_retries=1,timeout=3600",
        "--tasks", TASK, "--include_path", str(task_dir), "--apply_chat_template",
        "--output_path", str(out), "--log_samples",
    ]  # fmt: skip
    if params:
        args += ["--gen_kwargs", json.dumps({"tmas": params})]
    env = {**os.environ, "HF_HOME": str(out / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "lm_eval", "run", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed ({done.returncode}):\n{done.stderr[-3000:]}")
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    return samples


def served_runs(serve_dir: Path, method: str) -> dict[str, tuple[str, int, ProblemResult]]:
    """Question -> (served problem id, its run's seed, its result) of ``method``'s requests."""
    out = {}
    for run_dir in sorted(p for p in serve_dir.iterdir() if (p / "run.sqlite").is_file()):
        with RunStore(run_dir, read_only=True) as store:
            request = store.get_meta(REQUEST_META)
            [problem] = store.problems()
            result = store.result(problem.problem_id)
        if request["method"] == method and result is not None:
            out[problem.question] = (problem.problem_id, int(request["seed"]), result)
    return out


async def compare_method(
    method: str, live: Settings, proxy: ProxyThread, problems: list[Problem], work: Path, args: argparse.Namespace
) -> list[Row]:
    params = {
        **(METHODS[method].embedded_defaults if embedded(args) else {}),
        **SMALL_PARAMS.get(method, {}),
    }
    model = f"{method}/{live.endpoint.model}"
    samples = await asyncio.to_thread(
        run_lm_eval, model, proxy, work / "task", work / f"lm-eval-{method}", params, args.concurrency
    )
    scored = {s["doc"]["question"]: s for s in map(json.loads, samples.read_text().splitlines())}
    served = served_runs(work / "served", method)
    # The same problems under their served ids, with the served seed: the in-process run asks the same calls.
    [seed] = {seed for _, seed, _ in served.values()}
    renamed = [Problem(problem_id=served[p.question][0], question=p.question, answer=p.answer) for p in problems]
    problem_file = work / f"eval-{method}.jsonl"
    problem_file.write_text(
        "".join(json.dumps(p.model_dump(include={"problem_id", "question", "answer"})) + "\n" for p in renamed)
    )
    data = live.model_dump(mode="json")
    data["method"] = {"name": method, "params": params}
    data["seed"] = seed
    sampling = Sampling(temperature=args.temperature, max_tokens=args.max_tokens)
    settings = with_sampling(Settings.model_validate(data), "flags", sampling)
    settings = settings.model_copy(update={"concurrency": args.concurrency})
    await arun(problem_file, work / f"eval-{method}", settings)
    grader = RulesGrader()
    rows = []
    with RunStore(work / f"eval-{method}", read_only=True) as store:
        for problem in renamed:
            result = store.result(problem.problem_id)
            answer = result.answer if result is not None else None
            text = result.text if result is not None else ""
            item = Item(key=(problem.problem_id, 0, 0), problem=problem, answer=answer, text=text)
            sample = scored[problem.question]
            rows.append(
                Row(
                    question=problem.question,
                    gold=problem.answer or "",
                    served_id=problem.problem_id,
                    lm_eval_answer=str(sample["filtered_resps"][0]),
                    lm_eval_correct=bool(sample["exact_match"]),
                    tmas_answer=answer,
                    tmas_correct=grader.grade_one(item),
                    same_text=result is not None and result.text == served[problem.question][2].text,
                )
            )
    return rows


def report(method: str, rows: list[Row], seconds: float) -> str:
    n = len(rows)
    lm = sum(r.lm_eval_correct for r in rows)
    tm = sum(r.tmas_correct is True for r in rows)
    agree = sum(r.lm_eval_correct == (r.tmas_correct is True) for r in rows)
    same = sum(r.same_text for r in rows)
    lines = [f"| {method} | {n} | {lm}/{n} | {tm}/{n} | {agree}/{n} | {same}/{n} | {seconds:.0f} |"]
    for r in rows:
        if r.lm_eval_correct != (r.tmas_correct is True):
            lines.append(
                f"|   {r.served_id} | gold {r.gold!r} | lm-eval {r.lm_eval_answer!r} ({int(r.lm_eval_correct)}) |"
                f" tmas {r.tmas_answer!r} ({r.tmas_correct}) | | same text: {r.same_text} | |"
            )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    work = Path(args.work or tempfile.mkdtemp(prefix="tmas-lm-eval-"))
    if args.problems:
        problems = load_problems(args.problems)[: args.limit]
    else:
        # Every family at level 1, one problem of each in turn (families differ in difficulty).
        per_family = -(-args.limit // len(FAMILIES))
        by_family = list(generate("all", per_family, seed=args.seed, level=1))
        ordered = [by_family[f * per_family + i] for i in range(per_family) for f in range(len(FAMILIES))]
        problems = [Problem.model_validate(r) for r in ordered[: args.limit]]
    write_task(problems, work / "task", TASK, max_gen_toks=args.max_tokens, temperature=args.temperature)
    print(f"# {len(problems)} problems, temperature {args.temperature}, max_tokens {args.max_tokens}; work in {work}")
    print("| method | problems | lm-eval | tmas eval | verdicts agree | same transcript | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    async with upstream(args.upstream, args.base_url, args.model) as live:
        options = ServeOptions(serve_dir=work / "served", max_problems=args.concurrency)
        with ProxyThread(live, options) as proxy:
            for method in args.methods:
                start = time.monotonic()
                rows = await compare_method(method, live, proxy, problems, work, args)
                print(report(method, rows, time.monotonic() - start), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", choices=["embedded", "sim"], default="embedded")
    parser.add_argument("--base-url", help="An OpenAI-compatible server of yours instead (with --model).")
    parser.add_argument("--model", help="Its model.")
    parser.add_argument("--problems", type=Path, help="Problems JSONL (default: generated arithmetic problems).")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--methods", nargs="+", default=["cot", "tmas"], choices=sorted(METHODS))
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent and the proxy's slots.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the generated problems.")
    parser.add_argument("--work", type=Path, help="Working folder (default: a new temporary one).")
    args = parser.parse_args()
    if (args.base_url is None) != (args.model is None):
        parser.error("--base-url and --model go together")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
