"""The `paper` preset's generation budget: every TMAS role asks for the paper's 128K output cap,
the client lowers it to what the context window leaves, a user's own max_tokens wins, and a run whose replies are
often cut at max_tokens says so at its end and in its report; a run from the old preset resumes, in process."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import SCRIPTED_URL
from scripted_runs import scripted_run
from tmas.api import asolve
from tmas.cli.main import app
from tmas.config import Settings, load_settings
from tmas.llm.refusals import CONTEXT_MARGIN_TOKENS
from tmas.methods.base import ReplyTally, truncation_warnings
from tmas.methods.tmas_params import PAPER_MAX_TOKENS
from tmas.problems import Problem
from tmas.reports.document import Document
from tmas.reports.reply_quality import reply_quality_section
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer

Q = "What is 17*23?"
ROLES = {"solution", "verifier", "summary", "experience", "guideline"}


def paper_config(sim: SimServer, tmp_path: Path, body: str = "", params: str = "iterations = 2") -> Path:
    path = tmp_path / "tmas.toml"
    path.write_text(
        f'[endpoint]\nbase_url = "{sim.base_url}"\nmodel = "m"\n\n[method]\nname = "tmas"\n'
        f'params = {{ preset = "paper", n = 2, m = 1, {params} }}\n' + body
    )
    return path


def chat_bodies(sim: SimServer) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for entry in sim.requests:
        if entry.endpoint == "chat":
            out.setdefault(entry.role, []).append(entry.body)
    return out


def fitted(body: dict[str, Any], window: int) -> int:
    """What the client leaves for the reply (llm/client.py, no tokenizer configured): the window less the prompt
    estimate (ceil(chars / 4) + 4 per message, times 1.1 to stay safe) less the 32-token template margin."""
    prompt = sum(math.ceil(len(m["content"]) / 4) + 4 for m in body["messages"])
    return window - int(prompt * 1.1) - CONTEXT_MARGIN_TOKENS


async def test_a_large_window_gets_the_papers_128k(tmp_path: Path) -> None:
    # 262,144 tokens (Qwen3-Thinking-2507's window): every prompt here is far below 131,072 tokens, so the whole
    # cap fits and is sent as it is.
    with SimServer(SimScript(context_length=262_144)) as sim:
        await asolve(Q, load_settings(paper_config(sim, tmp_path), environ={}))
        bodies = chat_bodies(sim)
    assert set(bodies) == ROLES
    assert PAPER_MAX_TOKENS == 131_072
    assert {b["max_tokens"] for items in bodies.values() for b in items} == {131_072}


async def test_a_small_window_gets_what_the_prompt_leaves(tmp_path: Path) -> None:
    # 32,768 tokens: the cap does not fit, so each call asks for the window less its own prompt. For the first
    # solution prompt (system + user) that is 32,768 - int(1.1 * prompt estimate) - 32, far above the old 2,048.
    with SimServer(SimScript(context_length=32_768)) as sim:
        config = paper_config(sim, tmp_path, params="iterations = 2, epsilon = 0.0")
        result = await asolve(Q, load_settings(config, environ={}))
        bodies = chat_bodies(sim)
    assert set(bodies) == ROLES
    for items in bodies.values():
        for body in items:
            assert body["max_tokens"] == fitted(body, 32_768)
            assert 2_048 < body["max_tokens"] < 32_768
    # Iteration 1 exploits (epsilon 0) and its prompt shows both rollouts whole: the 128K reply budget does not eat
    # the prompt's room (half the window stays for the prompt).
    assert [c.meta.prompt for c in result.iterations[1].candidates] == ["refine", "refine"]
    assert not any(note.startswith("exploit prompt:") for note in result.iterations[1].notes)


async def test_the_users_max_tokens_beats_the_preset(tmp_path: Path) -> None:
    with SimServer(SimScript(context_length=262_144)) as sim:
        # A default max_tokens from the command line, and one role's own: both win over the preset's 128K.
        config = paper_config(sim, tmp_path, "\n[roles.verifier.sampling]\nmax_tokens = 1000\n")
        await asolve(Q, load_settings(config, overrides={"sampling.max_tokens": 4096}, environ={}))
        bodies = chat_bodies(sim)
    assert {b["max_tokens"] for b in bodies["solution"]} == {4096}
    assert {b["max_tokens"] for b in bodies["verifier"]} == {1000}
    assert {b["max_tokens"] for b in bodies["summary"]} == {4096}


def test_truncation_warning_threshold() -> None:
    # 3 of 20 cut = 15 % > 10 %: warned; 1 of 10 = exactly 10 %: not; no replies: not.
    lines = truncation_warnings({"solution": (20, 3), "verifier": (10, 1), "summary": (0, 0)})
    assert len(lines) == 1 and lines[0].startswith("solution: 3 of 20 replies (15.0%)")
    doc = Document("run")
    reply_quality_section(doc, {"solution": ReplyTally(replies=20, truncated=3), "verifier": ReplyTally(replies=10)})
    text = doc.markdown()
    assert "many replies cut at max_tokens" in text and "solution: 3 of 20" in text and "verifier:" not in text
    # Bold in both forms: Markdown's asterisks, HTML's element (not the asterisks).
    assert "**Warning: many replies cut at max_tokens.** solution" in text
    assert "<p><strong>Warning: many replies cut at max_tokens.</strong> solution" in doc.html()


def test_a_run_with_cut_solutions_warns_at_its_end(tmp_path: Path) -> None:
    # Every solution reply is cut (finish_reason "length"); the verifier's are not. 2 problems x N=2 x T=1.
    rules = [Rule(role="solution", replies=["Working it out, 17*23 is"], finish_reason="length")]
    with SimServer(SimScript(rules=rules)) as sim:
        problems = tmp_path / "p.jsonl"
        problems.write_text(
            "".join(json.dumps({"problem_id": f"p{i}", "question": Q, "answer": "391"}) + "\n" for i in range(2))
        )
        config = paper_config(sim, tmp_path, params="iterations = 1")
        result = CliRunner().invoke(app, ["run", str(problems), "-o", str(tmp_path / "run"), "-c", str(config)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["truncated_by_role"] == {"solution": 4}
    assert summary["warnings"] == [
        "solution: 4 of 4 replies (100.0%) were cut at max_tokens;"
        " raise max_tokens for this role (or the model's context window)"
    ]
    assert "warning: solution: 4 of 4 replies" in result.stderr


async def test_a_run_from_the_old_paper_preset_resumes_as_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmas.methods import tmas_params

    problems = [Problem(problem_id="p1", question=Q, answer="391")]
    params = {"preset": "paper", "n": 1, "m": 1, "iterations": 1}
    base = {"endpoint": {"base_url": [SCRIPTED_URL], "model": "m"}, "method": {"name": "tmas", "params": params}}

    def max_tokens(model: ScriptedModel) -> list[int]:
        return [call.body["max_tokens"] for call in model.calls]

    # The preset as it was: temperature and top_p only, so every call sent the global 2048.
    old = {role: {"temperature": 1.0, "top_p": 0.95} for role in ROLES}
    monkeypatch.setitem(tmas_params.PRESETS["paper"], "sampling", old)
    model = ScriptedModel(SimScript(), Settings.model_validate(base))
    await scripted_run(model, tmp_path / "run", problems)
    first = len(model.calls)
    assert set(max_tokens(model)) == {2048}
    monkeypatch.undo()
    shutil.copytree(tmp_path / "run", tmp_path / "copy")

    # Resumed with the five roles at 2048: the problem is solved again from the stored calls, none sent.
    roles = {role: {"sampling": {"max_tokens": 2048}} for role in ROLES}
    pinned = ScriptedModel(SimScript(), Settings.model_validate({**base, "roles": roles}))
    summary = await scripted_run(pinned, tmp_path / "run")
    assert summary.done == 1 and summary.replayed_calls == first and pinned.calls == []
    # Resumed as it is (the copy): solved again with the new budget, in new calls.
    again = ScriptedModel(SimScript(), Settings.model_validate(base))
    await scripted_run(again, tmp_path / "copy")
    assert again.calls and all(tokens > 2048 for tokens in max_tokens(again))
