"""A token budget is kept over the wire: once it is spent no call is sent, a problem passes it by one call's tokens at
most (majority vote's samples go as the budget allows, not all at once), and the stop is recorded; against the
simulated server, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_tmas
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer


def write_problems(path: Path, n: int) -> None:
    lines = [json.dumps({"problem_id": f"p{i}", "question": f"What is {i + 2}*7?"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_majority_k16_under_a_200_token_budget_spends_at_most_one_call_past_it(tmp_path: Path) -> None:
    # Each reply costs about 33 completion tokens: all 16 samples at once spent 528 a problem before. With the
    # samples held back while those in flight could pass the budget (each counted at max_tokens, 256), they go one
    # at a time and the problem stops at the first call once 200 are spent.
    with SimServer(SimScript(latency_s=0.02)) as sim:
        write_problems(tmp_path / "p.jsonl", 2)
        run_dir = tmp_path / "run"
        args = ["run", str(tmp_path / "p.jsonl"), "-o", str(run_dir), "--base-url", sim.base_url]
        out = run_tmas(*args, "-m", "majority", "-p", "k=16", "--budget-tokens", "200", "--max-tokens", "256")
        assert out.returncode == 0, out.stderr.decode()
        bodies = sim.chat_bodies()
        assert bodies and all(b["max_tokens"] == 256 for b in bodies)
    with RunStore(run_dir, create=False) as store:
        results = {r.problem_id: r for r in store.results()}
        calls = list(store.calls())
    assert len(calls) == len(bodies)  # every request sent was answered and stored
    for pid, result in results.items():
        spent = [c.usage.completion_tokens for c in calls if c.key.problem_id == pid]
        assert result.stopped_reason == "budget", pid
        assert len(spent) < 16
        # Every call but the last went with the spend under the budget; the last reached it.
        assert sum(spent[:-1]) < 200 <= sum(spent) <= 200 + max(spent)
        assert result.usage.completion_tokens == sum(spent)
        assert result.iterations[-1].notes[-1].startswith(f"stopped: budget spent ({sum(spent)} completion")


def test_a_total_count_budget_is_kept_within_one_call(tmp_path: Path) -> None:
    # The docs' sweep: prompt + completion tokens counted, 4,000 a problem. Each call is counted at its max_tokens
    # plus its prompt (estimated from its characters) while in flight.
    with SimServer(SimScript(latency_s=0.01)) as sim:
        write_problems(tmp_path / "p.jsonl", 2)
        out = run_tmas(
            "sweep", "--out", str(tmp_path / "sw"), "--problems", str(tmp_path / "p.jsonl"), "-m", "majority",
            "-p", "k=64", "--budget-tokens", "4000", "--budget-count", "total", "--base-url", sim.base_url,
            "--no-report", "--yes",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr.decode()
    [run_dir] = (tmp_path / "sw" / "runs").iterdir()
    with RunStore(run_dir, create=False) as store:
        results = list(store.results())
        calls = list(store.calls())
    for result in results:
        pid = result.problem_id
        spent = [c.usage.prompt_tokens + c.usage.completion_tokens for c in calls if c.key.problem_id == pid]
        assert result.stopped_reason == "budget"
        assert sum(spent[:-1]) < 4000 <= sum(spent) <= 4000 + max(spent)
