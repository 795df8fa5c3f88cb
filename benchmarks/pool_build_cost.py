"""What building the experience pool costs per credit scheme, against the SIMULATED server (no model): MATTRL runs on
small arithmetic problems (the simulator's coordinator recruits three specialists), then ``build_pool`` with each
scheme. The judge's replies are scripted (scores cycling 1..5), so the figures count calls and turns, not quality.

    .venv/bin/python benchmarks/pool_build_cost.py --out /tmp/bench-pool

Prints a markdown table (scheme, cases, specialist turns, judge calls and per turn, summarizer calls, entries).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from tmas.config import Settings
from tmas.pool.build import BuildConfig, build_pool
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimScript, SimServer


def settings(sim: SimServer, **method: object) -> Settings:
    return Settings.model_validate(
        {
            "endpoint": {"base_url": [sim.base_url], "model": "sim-model"},
            "sampling": {"temperature": 0.7, "max_tokens": 512},
            "method": {"name": "mattrl", "params": method},
        }
    )


async def main(out: Path, problems: int, permutations: int) -> None:
    judge = [json.dumps({"analysis": "scripted", "score": s}) for s in (1, 2, 3, 4, 5)]
    entry = {"entries": [{"action": "Check the product", "experience": "Good practice: verify by division."}]}
    rules = [Rule(role="judge", replies=judge), Rule(role="summarizer", replies=[json.dumps(entry)])]
    cases = [
        Problem(problem_id=f"p{i}", question=f"What is {i + 12}*{i + 7}?", answer=str((i + 12) * (i + 7)))
        for i in range(problems)
    ]
    rows = []
    with SimServer(SimScript(rules=rules, accuracy=0.7, seed=1)) as sim:
        run_dir = out / "run"
        run_settings = settings(sim, iterations=3, team_size=3)
        store, run_settings, _ = prepare_run(run_dir, run_settings, cases, resume=False)
        with store:
            await run_problems(run_settings, cases, store)
        for scheme in ("naive", "difference", "shapley"):
            config = BuildConfig(scheme=scheme, permutations=permutations, grade_mode="rules")
            summary = await build_pool([run_dir], out / f"pool-{scheme}", settings(sim), config)
            # What the scheme asks, sent or replayed (an output folder used before replays its calls).
            judged = summary.judge_calls + summary.judge_replayed_calls
            distilled = summary.summarizer_calls + summary.summarizer_replayed_calls
            per_turn = judged / summary.turns if summary.turns else 0.0
            rows.append(
                f"| {scheme} | {summary.cases} | {summary.turns} | {judged} ({per_turn:.1f}) "
                f"| {distilled} | {summary.added} |"
            )
    print("| scheme | cases | specialist turns | judge calls (per turn) | summarizer calls | entries |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=6)
    parser.add_argument("--permutations", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.out, args.problems, args.permutations))
