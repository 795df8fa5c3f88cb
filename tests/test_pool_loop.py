"""The whole loop against the simulated server: MATTRL runs on labelled problems, ``build_pool`` turns their real
transcripts into a pool, a second MATTRL run retrieves from it, and ``prune_pool`` reads that run's retrievals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import settings_for
from tmas.memory.pool import Pool
from tmas.memory.transcript import Transcript
from tmas.pool.build import BuildConfig, build_pool
from tmas.pool.lifecycle import PruneConfig, prune_pool
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimScript, SimServer

PROBLEMS = [
    Problem(problem_id="a", question="What is 17*23?", answer="391"),
    Problem(problem_id="b", question="What is 12*12?", answer="144"),
]
ENTRY = {"action": "Split a factor", "experience": "Good practice: write 17*23 as 17*20 + 17*3.", "scope": "general"}


async def mattrl_run(sim: SimServer, run_dir: Path, **params: Any) -> None:
    settings = settings_for(sim, method={"name": "mattrl", "params": {"iterations": 2, "team_size": 2, **params}})
    store, settings, _ = prepare_run(run_dir, settings, PROBLEMS, resume=False)
    with store:
        await run_problems(settings, PROBLEMS, store)


@pytest.mark.slow
async def test_build_from_real_mattrl_runs_then_retrieve_and_prune(tmp_path: Path) -> None:
    rules = [
        Rule(role="judge", replies=[json.dumps({"analysis": "sound step", "score": 3})]),
        Rule(role="summarizer", replies=[json.dumps({"entries": [ENTRY]})]),
    ]
    with SimServer(SimScript(rules=rules)) as sim:
        await mattrl_run(sim, tmp_path / "train")
        pool_path = tmp_path / "pool"
        config = BuildConfig(grade_mode="rules", quantile=0.5)
        summary = await build_pool([tmp_path / "train"], pool_path, settings_for(sim), config)
        assert summary.cases == 2 and summary.turns >= 4 and summary.added == summary.kept >= 2
        assert summary.defaulted_scores == 0
        # Every judged turn is a specialist's (opinion + reviews), never the coordinator's.
        judged = [r.body["messages"][-1]["content"] for r in sim.requests if r.role == "judge"]
        assert len(judged) == summary.turns and all('agent="coordinator"' not in j for j in judged)
        pool = Pool.open(pool_path)
        assert {e.source_problem for e in pool.entries} <= {"a", "b"}
        assert all(e.source_agent.startswith("S") and e.reward > 0 for e in pool.entries)

        await mattrl_run(sim, tmp_path / "test", pool=str(pool_path), top_k=2)
        with prepare_run(tmp_path / "test", settings_for(sim), None, resume=True)[0] as store:
            records = [r["iterations"][-1] for r in store.results()]
        per_problem = [
            {i for u in Transcript.model_validate(record["state"]["transcript"]).utterances for i in u.experience_ids}
            for record in records
        ]
        assert all(per_problem) and set().union(*per_problem) <= {e.id for e in pool.entries}

        pruned = await prune_pool(pool_path, [tmp_path / "test"], settings_for(sim), PruneConfig(grade_mode="rules"))
        # The summarizer wrote the same entry for every kept turn: they merge into one, which takes the others'
        # retrieval counts (each entry counts once per problem that retrieved it).
        assert pruned.after == 1 and pruned.wrong == [] and pruned.base_wrong_rate == 0.0
        [kept] = Pool.open(pool_path).entries
        assert kept.retrieved == sum(len(ids) for ids in per_problem) and kept.retrieved_wrong == 0
