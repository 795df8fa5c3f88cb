"""Cached prompt tokens: read per call from the server's usage (OpenAI's and vLLM's
``prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``), kept in the call records, summed in the
run summary and its report (a run in process), in ``tmas solve --json``; stores written before the column existed
still open."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import scripted_settings, settings_for
from tmas.api import arun
from tmas.cli.main import app
from tmas.grading.grades import GradeConfig
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.reports.report import build_report
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript, SimServer

# Two problems, each answered once by cot, with usage scripted so the totals can be worked by hand:
# p3: 200 prompt tokens, 150 of them cached (OpenAI's usage field); p4: 100 prompt tokens, 50 cached (llama-server's
# timings). Together 300 prompt tokens, 200 cached: a share of 2/3.
RULES = [
    Rule(
        role="solution",
        pattern=r"What is 3\*7\?",
        replies=["3*7 = 21, so \\boxed{21}"],
        usage=ScriptedUsage(prompt_tokens=200, completion_tokens=20, cached_tokens=150),
    ),
    Rule(
        role="solution",
        pattern=r"What is 4\*7\?",
        replies=["4*7 = 28, so \\boxed{28}"],
        usage=ScriptedUsage(prompt_tokens=100, completion_tokens=10, cached_tokens=50, cached_in="timings"),
    ),
]


async def test_cached_tokens_are_read_from_usage_and_from_timings(tmp_path: Path) -> None:
    with SimServer(SimScript(rules=RULES)) as sim, RunStore(tmp_path) as store:
        stats = ClientStats()
        async with open_model(settings_for(sim), store, stats=stats) as llm:
            a = await llm.chat("solution", [user("What is 3*7?")])
            b = await llm.chat("solution", [user("What is 4*7?")])
            c = await llm.chat("verifier", [user("Grade it.")])  # the server says nothing of its cache: 0
            assert stats.usage.cached_prompt_tokens == 200
        # The wire carried both shapes.
        replies = [r for r in sim.requests]
        assert len(replies) == 3
        assert (a.usage.cached_prompt_tokens, b.usage.cached_prompt_tokens, c.usage.cached_prompt_tokens) == (
            150,
            50,
            0,
        )
        assert [call.usage.cached_prompt_tokens for call in store.calls()] == [150, 50, 0]
        counts = store.call_counts()
        assert counts["cached_prompt_tokens"] == 200
        assert store.role_costs()["solution"]["cached_prompt_tokens"] == 200
        assert a.usage.cached_prompt_share == pytest.approx(0.75)
        assert (a.usage + b.usage).cached_prompt_share == pytest.approx(2 / 3)
        # A replayed call brings its cached count along.
        async with open_model(settings_for(sim), store) as llm:
            again = await llm.chat("solution", [user("What is 3*7?")])
        assert again.replayed and again.usage.cached_prompt_tokens == 150


@pytest.mark.slow
async def test_run_summary_and_report_show_the_cached_share(tmp_path: Path, isolated: None) -> None:
    pytest.importorskip("math_verify")
    pytest.importorskip("matplotlib")
    problems = tmp_path / "p.jsonl"
    rows = [{"problem_id": f"p{i}", "question": f"What is {i}*7?", "answer": str(i * 7)} for i in (3, 4)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The run `tmas run p.jsonl -m cot` makes, in process; its summary is what the command prints.
    model = ScriptedModel(SimScript(rules=RULES), scripted_settings(method={"name": "cot"}))
    summary = (await arun(problems, tmp_path / "run", model=model)).to_dict()
    assert (summary["prompt_tokens"], summary["cached_prompt_tokens"]) == (300, 200)
    assert summary["cached_prompt_share"] == pytest.approx(2 / 3)
    assert summary["downgrades"] == {}

    paths = await build_report([tmp_path / "run"], tmp_path / "report", GradeConfig(mode="rules"), None)
    markdown = paths["markdown"].read_text()
    assert "| Cached prompt |" in markdown
    # 200 of 300 prompt tokens: 66.7 %.
    assert "| 300 | 66.7% (200) |" in markdown
    assert "prompt tokens served from the servers' prompt caches: 66.7% (200) of 300" in markdown
    assert "66.7% (200)" in (tmp_path / "report" / "report.html").read_text()


@pytest.mark.slow
def test_solve_json_shows_the_cached_share(isolated: None) -> None:
    with SimServer(SimScript(rules=RULES)) as sim:
        args = ["solve", "What is 3*7?", "-m", "cot", "--json", "--base-url", sim.base_url]
        solved = CliRunner().invoke(app, args)
    assert solved.exit_code == 0, solved.output
    usage = json.loads(solved.stdout)["usage"]
    assert (usage["prompt_tokens"], usage["cached_prompt_tokens"], usage["cached_prompt_share"]) == (200, 150, 0.75)


def _completion(cached: int) -> tuple[Completion, ChatRequest]:
    from tmas.config import Sampling

    request = ChatRequest(model="m", messages=[user("q")], sampling=Sampling())
    key = CallKey(role="solution", sample=cached)
    usage = Usage(prompt_tokens=10, completion_tokens=1, cached_prompt_tokens=cached)
    return Completion(key=key, request_hash=request.request_hash(key), usage=usage), request


def test_a_store_from_before_the_column_opens_and_resumes(tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        store.record_call(*_completion(4))
    # What a store written by an earlier version looks like: no cached_prompt_tokens column.
    with sqlite3.connect(tmp_path / "run.sqlite") as db:
        db.execute("ALTER TABLE calls DROP COLUMN cached_prompt_tokens")
    # A reader (viewer, report) cannot alter it, and reads the old calls as uncached.
    reader = RunStore(tmp_path, read_only=True)
    assert [c.usage.cached_prompt_tokens for c in reader.calls()] == [0]
    assert reader.call_counts()["cached_prompt_tokens"] == 0
    assert reader.role_costs()["solution"]["cached_prompt_tokens"] == 0
    reader.close()
    # A resumed run adds the column and records new calls with their counts.
    with RunStore(tmp_path) as store:
        store.record_call(*_completion(7))
        assert [c.usage.cached_prompt_tokens for c in store.calls()] == [0, 7]
        assert store.call_counts()["cached_prompt_tokens"] == 7
