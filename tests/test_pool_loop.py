"""The whole loop in process on a scripted model: MATTRL runs on labelled problems, ``build_pool`` turns their real
transcripts into a pool, a second MATTRL run retrieves from it, and ``prune_pool`` reads that run's retrievals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import last_user_prompts, scripted_run
from tmas.memory.pool import Pool
from tmas.memory.transcript import Transcript
from tmas.pool.build import BuildConfig, build_pool
from tmas.pool.lifecycle import PruneConfig, prune_pool
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

PROBLEMS = [
    Problem(problem_id="a", question="What is 17*23?", answer="391"),
    Problem(problem_id="b", question="What is 12*12?", answer="144"),
]
ENTRY = {"action": "Split a factor", "experience": "Good practice: write 17*23 as 17*20 + 17*3.", "scope": "general"}


async def mattrl_run(script: SimScript, run_dir: Path, **params: Any) -> None:
    """A MATTRL run of :data:`PROBLEMS` into ``run_dir``, in process on a model answering with ``script``."""
    settings = scripted_settings(method={"name": "mattrl", "params": {"iterations": 2, "team_size": 2, **params}})
    await scripted_run(ScriptedModel(script, settings), run_dir, PROBLEMS)


@pytest.mark.slow
async def test_build_from_real_mattrl_runs_then_retrieve_and_prune(tmp_path: Path) -> None:
    rules = [
        Rule(role="judge", replies=[json.dumps({"analysis": "sound step", "score": 3})]),
        Rule(role="summarizer", replies=[json.dumps({"entries": [ENTRY]})]),
    ]
    script = SimScript(rules=rules)
    await mattrl_run(script, tmp_path / "train")
    pool_path = tmp_path / "pool"
    config = BuildConfig(grade_mode="rules", quantile=0.5)
    # The pool's embeddings are the runs' model's: the build is on its settings.
    builder = ScriptedModel(script, scripted_settings())
    summary = await build_pool([tmp_path / "train"], pool_path, builder.settings, config, model=builder)
    assert summary.cases == 2 and summary.turns >= 4 and summary.added == summary.kept >= 2
    assert summary.defaulted_scores == 0
    # Every judged turn is a specialist's (opinion + reviews), never the coordinator's.
    judged = last_user_prompts(builder, "judge")
    assert len(judged) == summary.turns and all('agent="coordinator"' not in j for j in judged)
    pool = Pool.open(pool_path)
    assert {e.source_problem for e in pool.entries} <= {"a", "b"}
    assert all(e.source_agent.startswith("S") and e.reward > 0 for e in pool.entries)

    await mattrl_run(script, tmp_path / "test", pool=str(pool_path), top_k=2)
    with RunStore(tmp_path / "test", create=False) as store:
        records = [r.iterations[-1] for r in store.results()]
    transcripts = [Transcript.model_validate(record.state["transcript"]) for record in records]
    per_problem = [{i for u in t.utterances for i in u.experience_ids} for t in transcripts]
    assert all(per_problem) and set().union(*per_problem) <= {e.id for e in pool.entries}
    # The test run solves the problems the pool was built from: no problem is handed the entries its own reference
    # answer was distilled into, only the other problem's.
    source = {e.id: e.source_problem for e in pool.entries}
    assert all(
        {source[i] for i in ids} == {t.problem_id} ^ {"a", "b"} for t, ids in zip(transcripts, per_problem, strict=True)
    )
    # Each transcript names the pool its ids are entries of (ids are unique only within a pool).
    assert {t.pool for t in transcripts} == {str(pool_path.resolve())}

    # The prune reads the runs' grades on a model of one's own whose settings name no endpoint.
    pruner = ScriptedModel(script)
    assert not pruner.settings.endpoint.base_url
    pruned = await prune_pool(pool_path, [tmp_path / "test"], None, PruneConfig(grade_mode="rules"), model=pruner)
    # The summarizer wrote the same entry for every kept turn: they merge into one, which takes the others'
    # retrieval counts (each entry counts once per problem that retrieved it).
    assert pruned.after == 1 and pruned.wrong == [] and pruned.base_wrong_rate == 0.0
    [kept] = Pool.open(pool_path).entries
    assert kept.retrieved == sum(len(ids) for ids in per_problem) and kept.retrieved_wrong == 0
