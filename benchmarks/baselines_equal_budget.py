"""Every method at one equal token budget per problem, against the SIMULATED server (no model): shows the pipeline
(methods, budgets, sweep, grading, combined report) end to end. The accuracies reflect the simulator's scripted
behaviour (each solution right with probability ``--accuracy``; the verifier checks the answer exactly), not any
model's reasoning.

    .venv/bin/python benchmarks/baselines_equal_budget.py --out /tmp/bench-baselines

Writes the sweep under --out, prints the combined report, and copies its accuracy-against-completion-tokens plot
(the frontier) to docs/baselines_equal_budget_sim.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path

from tmas.config import Budget, Settings
from tmas.grading.grades import GradeConfig
from tmas.sweep import Study, SweepSpec, report_sweep, run_sweep
from tmas.testing import SimScript, SimServer

DOCS = Path(__file__).resolve().parent.parent / "docs"
STUDIES = [
    Study(name="equal-budget", method="cot"),
    Study(name="equal-budget", method="majority", params={"k": 2, "iterations": 20}),
    Study(name="equal-budget", methods=["self_refine", "verify_refine", "rse"], params={"n": 2, "iterations": 20}),
    Study(
        name="equal-budget", method="pacore", params={"responses_per_round": 2, "iterations": 20, "synthesis": False}
    ),
    Study(name="equal-budget", method="tmas", params={"n": 2, "m": 1, "iterations": 20}),
]


def write_problems(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(2, 9)
            f.write(
                json.dumps({"problem_id": f"arith-{i}", "question": f"What is {a}*{b}+{c}?", "answer": str(a * b + c)})
                + "\n"
            )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=20)
    parser.add_argument("--budget-tokens", type=int, default=6000)
    parser.add_argument("--accuracy", type=float, default=0.4)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    problems = args.out / "problems.jsonl"
    write_problems(problems, args.problems, seed=0)
    spec = SweepSpec(problems=str(problems), budget=Budget(tokens=args.budget_tokens), study=STUDIES)
    with SimServer(SimScript(accuracy=args.accuracy)) as sim:
        settings = Settings.model_validate(
            {"endpoint": {"base_url": [sim.base_url], "model": "simulated"}, "sampling": {"max_tokens": 512}}
        )
        await run_sweep(spec, settings, args.out / "sweep")
    written = await report_sweep(spec, args.out / "sweep", GradeConfig(mode="rules"), None)
    shutil.copy(frontier_plot(written), DOCS / "baselines_equal_budget_sim.png")
    print(await asyncio.to_thread(Path(written["markdown"]).read_text, encoding="utf-8"))


def frontier_plot(written: Mapping[str, Path]) -> Path:
    """The combined report's frontier plot (``frontier_<benchmark>.png``) among the files it ``written``: the sweep
    has one benchmark, so one plot."""
    plots = [path for name, path in written.items() if name.startswith("frontier_") and name.endswith(".png")]
    if len(plots) != 1:
        raise SystemExit(f"baselines_equal_budget: the report wrote {len(plots)} frontier plots, not one")
    return plots[0]


if __name__ == "__main__":
    asyncio.run(main())
