"""How long `tmas view` takes to render the pages of a big run: 1,000 generated problems, 100,000 calls.

The store is written directly with the run store API (a majority-vote run of k=100 samples per problem, solutions
with LaTeX, about 1,100 characters each; and a chain-of-thought run of the same problems for the comparison page),
then the viewer is started on loopback and each page is fetched over HTTP: the first time (cold: nothing cached)
and then five more times (warm: the median). Nothing is graded: the viewer grades live by its exact rules, which
is part of what is timed.

    PYTHONPATH=src python benchmarks/view_pages.py --out /tmp/view-bench          # builds once, then reuses
    PYTHONPATH=src python benchmarks/view_pages.py --out /tmp/view-bench --problems 200 --samples 20

``--answers symbolic`` writes answers the live rules cannot settle instead of integers (each sample picks one of six
LaTeX spellings of its problem, two of them equal): what a symbolic benchmark's run costs the viewer.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import urllib.request
from pathlib import Path

from tmas.config import Sampling, Settings
from tmas.data.generators import generate
from tmas.llm.types import CallKey, ChatRequest, Completion, Message, Usage
from tmas.methods.base import Candidate, IterationRecord, ProblemResult
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing.web_servers import AppThread
from tmas.view.app import PAGE_SIZE, view_app
from tmas.view.runs import discover

SOLUTION = (
    "## Step 1\nLet $a_n$ be the quantity asked for. From the statement, $a_{{n+1}} = 2a_n + \\frac{{n}}{{2}}$, "
    "and we check $a_1 = {k}$ by hand.\n\n## Step 2\nSumming, $$\\sum_{{i=1}}^{{n}} a_i = \\frac{{n(n+1)}}{{2}} "
    "+ \\binom{{n}}{{2}}.$$ Working modulo $7$: $a_n \\equiv {k} \\pmod{{7}}$, since $\\sqrt{{49}} = 7$.\n\n"
    "**Check.** Small cases $n = 1, 2, 3$ agree with the recurrence; the count is an integer, as it must be, and "
    "no case was counted twice because the blocks are disjoint.\n\nThe answer is $\\boxed{{{answer}}}$."
)


def spellings(index: int) -> list[str]:
    """The symbolic answers of the ``index``-th problem: six spellings, the first two always equal (nine sets in
    turn)."""
    m = index % 9 + 2
    return [
        f"\\frac{{{m}}}{{\\sqrt{{2}}}}",
        f"\\frac{{{m}\\sqrt{{2}}}}{{2}}",
        f"{m}\\sqrt{{2}}",
        f"\\sqrt{{{m}}}",
        f"{m}\\pi",
        f"\\frac{{{m}\\pi}}{{2}}",
    ]


def _problems(n: int, symbolic: bool = False) -> list[Problem]:
    records = list(generate("all", n, seed=0))
    # One family after another: take problems round-robin so every family appears.
    families: dict[str, list[dict[str, object]]] = {}
    for record in records:
        families.setdefault(str(record["family"]), []).append(record)
    mixed = [r for group in zip(*families.values(), strict=False) for r in group][:n]
    return [
        Problem(
            problem_id=str(r["problem_id"]),
            question=str(r["question"]),
            answer=spellings(i)[1] if symbolic else str(r["answer"]),
        )
        for i, r in enumerate(mixed)
    ]


def build_run(
    run_dir: Path, problems: list[Problem], samples: int, method: str, seed: int = 0, symbolic: bool = False
) -> None:
    """A finished run of ``method`` ("majority": ``samples`` per problem; "cot": one) written straight to a store;
    ``symbolic``: each answer one of the problem's :func:`spellings`."""
    rng = random.Random(f"{method}:{seed}")
    settings = Settings()
    with RunStore(run_dir) as store:
        store.set_meta("settings", settings.model_dump(mode="json"))
        params = {"k": samples, "style": "concise"} if method == "majority" else {"style": "concise"}
        store.set_meta("method", {"name": method, "params": params})
        store.add_problems(problems)
        sampling = Sampling(temperature=0.7, max_tokens=2048)
        k = samples if method == "majority" else 1
        for index, problem in enumerate(problems):
            candidates = []
            for i in range(k):
                # About two thirds right; the wrong ones off by one so the exact rules must compare numbers.
                if symbolic:
                    answer = rng.choice(spellings(index))
                else:
                    answer = problem.answer if rng.random() < 0.66 else str(int(problem.answer or 0) + 1)
                text = SOLUTION.format(k=i, answer=answer)
                usage = Usage(prompt_tokens=180, completion_tokens=rng.randint(250, 450))
                key = CallKey(problem_id=problem.problem_id, role="solution", sample=i, iteration=0)
                request = ChatRequest(
                    model="qwen2.5-coder-0.5b",
                    messages=[Message(role="user", content=problem.question)],
                    sampling=sampling,
                )
                completion = Completion(
                    key=key,
                    request_hash=f"{problem.problem_id}-{i}",
                    model="qwen2.5-coder-0.5b",
                    content=text,
                    usage=usage,
                    finish_reason="stop",
                    latency_s=1.0,
                )
                call_id = store.record_call(completion, request)
                candidates.append(Candidate(index=i, text=text, answer=answer, call_id=call_id, usage=usage))
            votes: dict[str, int] = {}
            for c in candidates:
                votes[c.answer or ""] = votes.get(c.answer or "", 0) + 1
            chosen = max(candidates, key=lambda c: votes[c.answer or ""])
            total = Usage(
                prompt_tokens=sum(c.usage.prompt_tokens for c in candidates),
                completion_tokens=sum(c.usage.completion_tokens for c in candidates),
            )
            record = IterationRecord(
                problem_id=problem.problem_id,
                iteration=0,
                candidates=candidates,
                selected=chosen.answer,
                calls=k,
                usage=total,
                state={"samples": k, "votes": votes},
            )
            store.save_iteration(record)
            result = ProblemResult(
                problem_id=problem.problem_id,
                method=method,
                answer=chosen.answer,
                text=chosen.text,
                iterations=[record],
                calls=k,
                usage=total,
            )
            store.save_result(result)


def _fetch(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as reply:
        size = len(reply.read())
    return time.perf_counter() - start, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the two runs are built (reused if there)")
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--answers", choices=["numbers", "symbolic"], default="numbers", help="what the runs answer")
    args = parser.parse_args()
    majority, cot = args.out / "majority", args.out / "cot"
    if not (majority / "run.sqlite").exists():
        symbolic = args.answers == "symbolic"
        problems = _problems(args.problems, symbolic)
        start = time.perf_counter()
        build_run(majority, problems, args.samples, "majority", symbolic=symbolic)
        build_run(cot, problems, 1, "cot", symbolic=symbolic)
        print(
            f"built {len(problems)} problems, {len(problems) * (args.samples + 1)} calls in "
            f"{time.perf_counter() - start:.1f} s"
        )
    refs = {r.path.name: r for r in discover([args.out])}
    first = _problems(1)[0].problem_id
    last_page = max(1, -(-args.problems // PAGE_SIZE))  # page 10 of the full size; a smaller run has fewer
    pages = {
        "runs (index)": "/",
        "run, page 1 of problems": f"/run/{refs['majority'].key}",
        f"run, page {last_page} of problems": f"/run/{refs['majority'].key}?page={last_page}",
        f"problem ({args.samples} samples)": f"/run/{refs['majority'].key}/problem?id={first}",
        f"iteration ({args.samples} candidates)": f"/run/{refs['majority'].key}/iteration?id={first}&t=0",
        "call": f"/run/{refs['majority'].key}/call/1",
        "comparison (2 runs)": f"/compare?run={refs['majority'].key}&run={refs['cot'].key}",
    }
    rows = []
    # Without the start-up warm-up: "cold" is what a page costs when nothing of its run is cached yet.
    with AppThread(view_app([args.out], warm_up=False)) as viewer:
        for name, path in pages.items():
            cold, size = _fetch(viewer.url + path)
            warm = statistics.median(_fetch(viewer.url + path)[0] for _ in range(args.repeat))
            rows.append({"page": name, "cold_s": round(cold, 3), "warm_s": round(warm, 3), "kib": size // 1024})
            print(f"{name:34s} cold {cold:6.3f} s   warm {warm:6.3f} s   {size // 1024:6d} KiB", flush=True)
        # A live run moves on: one more problem finished. Only that result is parsed again; the rest is rebuilt.
        with RunStore(majority) as store:
            result = store.result(first)
            assert result is not None
            store.save_result(result)
        for name, path in [("run, after one more result", pages["run, page 1 of problems"])]:
            seconds, size = _fetch(viewer.url + path)
            rows.append({"page": name, "cold_s": round(seconds, 3), "warm_s": None, "kib": size // 1024})
            print(f"{name:34s} once {seconds:6.3f} s", flush=True)
    # With the warm-up (as `tmas view` runs): how long until every run is ready.
    start = time.perf_counter()
    from tmas.view.app import Viewer

    Viewer([args.out]).warm_up()
    ready = time.perf_counter() - start
    print(f"{'warm-up of both runs':34s} {ready:6.3f} s", flush=True)
    rows.append({"page": "warm-up at start (both runs)", "cold_s": round(ready, 3), "warm_s": None, "kib": 0})
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "python": platform.python_version(),
                "problems": args.problems,
                "samples": args.samples,
                "answers": args.answers,
                "pages": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
