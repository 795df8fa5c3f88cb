"""A run survives faults of every kind, bad input, 1,000 queued problems and keeps the API key secret."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import run_tmas, scripted_settings, settings_for
from tmas.api import arun
from tmas.config import load_settings
from tmas.data.case_import import read_supergpqa
from tmas.data.importers import read_rows
from tmas.errors import InputError
from tmas.llm.types import CallKey, Completion, Message
from tmas.problems import Problem, load_problems
from tmas.runner import RunState, Unreachable, prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import FaultRates, Rule, ScriptedModel, SimScript, SimServer
from tmas.testing.sim_faults import RUNNING_TIMEOUT

TMAS_SMALL = ["--method", "tmas", "-T", "2", "-p", "n=2", "-p", "m=2", "--seed", "5"]


def tmas(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return run_tmas(*args, env=extra_env, timeout=300)


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def arithmetic(n: int) -> list[dict[str, object]]:
    return [{"problem_id": f"p{i}", "question": f"What is {i + 2}*7?", "answer": str((i + 2) * 7)} for i in range(n)]


# ------------------------------------------------------------------------------------------------ 1. faults
# The client-side cause each injected fault must be recorded under (drop = the server closes the connection unanswered).
FAULT_CAUSES = {
    "http_500": "http_500",
    "http_503": "http_503",
    "http_429": "http_429",
    "drop": "disconnected",
    "malformed": "malformed",
}


@pytest.mark.slow
def test_twenty_percent_faults_of_every_kind_are_survived_stored_and_counted(tmp_path: Path) -> None:
    rates = FaultRates(**{kind: 0.025 for kind in (*FAULT_CAUSES, "timeout", "truncate", "garbage")})
    assert abs(rates.total() - 0.2) < 1e-9
    config = tmp_path / "tmas.toml"
    # Two attempts only, so some calls fail for good and the failure path is exercised too. A "timeout" fault holds a
    # streamed request silent past timeout_s while the server answers /health: a queue, waited out, never retried.
    config.write_text(
        "[endpoint]\ntimeout_s = 1.5\n[retry]\nmax_attempts = 2\nbackoff_base_s = 0.01\nbackoff_max_s = 0.02\n"
    )
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(20))
    run_dir = tmp_path / "run"
    # Which calls the random faults fail for good depends on the order requests arrive in; one problem's experience
    # update (its only call of that role: the last iteration has none) is refused at both its attempts, so at least
    # one call fails for good whatever the order. (A verifier rule would not do: a candidate's verifications go
    # together, and its two refusals would fall on two calls, each answered when sent again.)
    refused = Rule(role="experience", pattern=r"What is 2\*7\?", fault="http_500", times=2)
    with SimServer(SimScript(rules=[refused], faults=rates, hang_s=4.0, seed=11)) as sim:
        out = tmas("run", str(problems), "-o", str(run_dir), "-c", str(config), "--base-url", sim.base_url, *TMAS_SMALL)
        injected = sim.stats().faults
    assert out.returncode == 0, out.stderr.decode()
    assert b"Traceback" not in out.stderr
    summary = json.loads(out.stdout)
    assert summary["done"] == 20 and summary["failed"] == 0
    assert all(injected.get(kind, 0) > 0 for kind in (*FAULT_CAUSES, "timeout", "truncate", "garbage")), injected

    db = sqlite3.connect(run_dir / "run.sqlite")
    failed = Counter(dict(db.execute("SELECT error_cause, COUNT(*) FROM calls WHERE error IS NOT NULL GROUP BY 1")))
    retried: Counter[str] = Counter()
    for (raw,) in db.execute("SELECT retry_causes FROM calls"):
        retried.update(json.loads(raw))
    truncated = db.execute("SELECT COUNT(*) FROM calls WHERE finish_reason = 'length'").fetchone()[0]
    missing_error = db.execute("SELECT COUNT(*) FROM calls WHERE error IS NOT NULL AND error_cause IS NULL")
    assert missing_error.fetchone()[0] == 0
    db.close()

    # Every injected fault is in the store under its cause: as a retried attempt or as the call's final failure.
    seen = failed + retried
    for kind, cause in FAULT_CAUSES.items():
        assert seen[cause] == injected[kind], (kind, seen, injected)
    assert truncated == injected["truncate"]
    assert set(seen) <= set(FAULT_CAUSES.values())
    # The run summary counts them, by cause.
    assert summary["failed_calls"] == sum(failed.values()) > 0
    assert summary["failed_calls_by_cause"] == dict(sorted(failed.items()))
    assert summary["retries_by_cause"] == dict(sorted(retried.items()))
    assert summary["truncated_calls"] == truncated
    # Garbage agent text and failed calls become handled anomalies of the iterations, never a crash.
    assert sum(summary["anomalies"].values()) >= injected["garbage"] // 2


# ------------------------------------------------------------------------------------------------ 3. bad input
@pytest.mark.slow
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"problem_id": "a", "question": "What is 1+1?"}\n{"problem_id": "b", "quest', "p.jsonl:2: not valid JSON"),
        (b'{"problem_id": "a", "question": "   "}\n', "p.jsonl:1: 'question' is empty"),
        (b'{"problem_id": "a", "question": ""}\n', "p.jsonl:1: 'question' is empty"),
        (b'{"problem_id": "a", "question": "caf\xe9?"}\n', "p.jsonl:1: not valid UTF-8"),
        (b'["a", "b"]\n', "p.jsonl:1: expected a JSON object"),
        (b'{"problem_id": "", "question": "x"}\n', "p.jsonl:1: field 'problem_id' must be a non-empty"),
        (b'{"problem_id": "a", "question": "x", "answer": [1]}\n', "p.jsonl:1: field 'answer' must be"),
        (b'{"problem_id": "a", "question": "x", "answer": true}\n', "p.jsonl:1: field 'answer' must be"),
        (b'{"problem_id": "a", "question": "x", "answer": NaN}\n', "p.jsonl:1: field 'answer' must be"),
        (b'{"problem_id": "a", "question": "x", "answer": 1e400}\n', "p.jsonl:1: field 'answer' must be"),
    ],
)
def test_more_bad_problem_files_fail_cleanly_before_any_call(
    sim: SimServer, tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "p.jsonl"
    # The bad line comes after many good ones: the file is streamed, and still nothing is run or left behind.
    good = b"".join(b'{"problem_id": "g%d", "question": "What is 2+2?"}\n' % i for i in range(300))
    path.write_bytes(good + content.replace(b'"a"', b'"zz"'))
    out = tmas("run", str(path), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, "--method", "cot")
    err = out.stderr.decode().strip()
    assert out.returncode == 2, err
    expected = message.replace("p.jsonl:1", "p.jsonl:301").replace("p.jsonl:2", "p.jsonl:302")
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert sim.stats().total_requests == 0


def test_files_that_start_with_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    # Some Windows editors and spreadsheet exports start UTF-8 files with the mark EF BB BF; elsewhere it is an error.
    bom = b"\xef\xbb\xbf"
    problems = tmp_path / "p.jsonl"
    problems.write_bytes(bom + b'{"problem_id": "a", "question": "What is 1+1?", "answer": "2"}\n')
    assert load_problems(problems) == [Problem(problem_id="a", question="What is 1+1?", answer="2")]
    cases = tmp_path / "edu.jsonl"
    cases.write_bytes(bom + b'{"uuid": "q", "question": "Which?", "options": ["x", "y"], "answer_letter": "B"}\n')
    assert [(c.problem_id, c.answer) for c in read_supergpqa(cases)] == [("q", "B")]
    rows = tmp_path / "rows.json"
    rows.write_bytes(bom + b'[{"question": "q"}]')
    assert list(read_rows(rows)) == [{"question": "q"}]
    config = tmp_path / "tmas.toml"
    config.write_bytes(bom + b'[endpoint]\nmodel = "m"\n')
    assert load_settings(config, environ={}).endpoint.model == "m"
    # Only at the very start: a mark starting a later line (files joined together) is said as such.
    problems.write_bytes(b'{"problem_id": "a", "question": "x"}\n' + bom + b'{"problem_id": "b", "question": "y"}\n')
    with pytest.raises(InputError, match=r"p\.jsonl:2: a byte-order mark \(U\+FEFF\) begins the line"):
        load_problems(problems)


@pytest.mark.parametrize("flags", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_an_empty_problem_file_is_a_clear_error(sim: SimServer, tmp_path: Path, flags: list[str]) -> None:
    # Before, the error named the run directory, and a dry run estimated 0 calls and exited 0.
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\n  \n")
    out = tmas("run", str(path), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, *flags)
    assert out.returncode == 2
    assert out.stderr.decode().splitlines() == [f"tmas: error: {path}: no problems in the file (it is empty or blank)"]
    assert not (tmp_path / "run").exists()
    assert sim.stats().total_requests == 0


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[endpoint]\ntimeout_s = 'soon'\n", "endpoint.timeout_s"),
        ("[retry]\nmax_attempts = 1.5\n", "retry.max_attempts"),
        ("[method]\nname = 7\n", "method.name"),
        ("[sampling]\ntemperature = [0.7]\n", "sampling.temperature"),
    ],
)
def test_config_with_wrong_types_is_one_line_naming_the_key(
    sim: SimServer, tmp_path: Path, toml: str, message: str
) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text(toml)
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(1))
    out = tmas("run", str(problems), "-o", str(tmp_path / "run"), "-c", str(config), "--base-url", sim.base_url)
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and message in err and len(err.splitlines()) == 1, err
    assert sim.stats().total_requests == 0


TEMPLATE_QUESTIONS = [
    "What is {{ 6 * 7 }}? Leave {{ x }} as it is.",
    "Fill in {question} and {answer} then compute 2+3.",
    "{% for i in range(3) %}loop{% endfor %} What is 4*4?",
    "{# comment #} {{ question }} {%- raw %} 5+5?",
]


async def test_template_syntax_in_questions_reaches_the_model_verbatim(tmp_path: Path) -> None:
    records: list[dict[str, object]] = [
        {"problem_id": f"t{i}", "question": q} for i, q in enumerate(TEMPLATE_QUESTIONS)
    ]
    problems = write_jsonl(tmp_path / "p.jsonl", records)
    # The run `tmas run ... TMAS_SMALL` makes, in process.
    params = {"n": 2, "m": 2, "iterations": 2}
    model = ScriptedModel(SimScript(), scripted_settings(seed=5, method={"name": "tmas", "params": params}))
    summary = await arun(problems, tmp_path / "run", model=model)
    assert summary.done == len(TEMPLATE_QUESTIONS)
    for i, question in enumerate(TEMPLATE_QUESTIONS):
        mine = [call for call in model.calls if call.key.problem_id == f"t{i}"]
        # The agents shown the problem (solution, verifier, ...) got it character for character, unrendered.
        for role in ("solution", "verifier"):
            prompts = ["\n".join(m.content for m in call.messages) for call in mine if call.role == role]
            assert prompts and all(question in p for p in prompts), (role, question)


async def test_a_reply_escaping_half_a_surrogate_pair_is_stored(tmp_path: Path) -> None:
    # Valid JSON from the server ("\ud800" in a string), which no UTF-8 store can hold as it is.
    rules = [Rule(role="solution", replies=["Half a pair \ud800 then \\boxed{5}"])]
    problems = write_jsonl(tmp_path / "p.jsonl", [{"problem_id": "a", "question": "What is 2+3?", "answer": "5"}])
    async with SimServer(SimScript(rules=rules)) as sim:
        summary = await arun(problems, tmp_path / "run", settings_for(sim, method={"name": "cot"}))
        assert (summary.done, summary.failed) == (1, 0)
        with RunStore(tmp_path / "run", create=False) as store:
            [call] = list(store.calls())
            assert call.content == "Half a pair \ufffd then \\boxed{5}" and store.results()[0].answer == "5"


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("plain text \\boxed{5}", "plain text \\boxed{5}"),
        ("\u2211 \u4e2d\u6587 \U0001f600 caf\u00e9", "\u2211 \u4e2d\u6587 \U0001f600 caf\u00e9"),
        ("\U0001f600 half \ud83d then \u00e9 \udc00", "\U0001f600 half \ufffd then \u00e9 \ufffd"),
    ],
)
def test_a_completion_keeps_whole_characters_and_marks_half_pairs(given: str, kept: str) -> None:
    # Plain ASCII, other characters of every width (kept as they are) and half pairs among them (each one U+FFFD).
    completion = Completion(key=CallKey(role="solution"), content=given, reasoning=given, error=given)
    assert (completion.content, completion.reasoning, completion.error) == (kept, kept, kept)


def test_a_question_longer_than_the_context_fails_its_problem_only(tmp_path: Path) -> None:
    records: list[dict[str, object]] = [
        {"problem_id": "short", "question": "What is 3*7?", "answer": "21"},
        {"problem_id": "huge", "question": "Compute the sum of " + "one plus two, " * 3000 + "please."},
        {"problem_id": "after", "question": "What is 4*7?", "answer": "28"},
    ]
    problems = write_jsonl(tmp_path / "p.jsonl", records)
    with SimServer(SimScript(context_length=2048)) as sim:
        out = tmas("run", str(problems), "-o", str(tmp_path / "run"), "--base-url", sim.base_url, *TMAS_SMALL)
        sent_for_huge = sum(r.problem_id == "huge" for r in sim.requests)
    # Some problems failed: exit code 3, and the last line says which reason.
    assert out.returncode == 3, out.stderr.decode()
    assert out.stderr.decode().strip().splitlines()[-1].startswith("tmas: 1 of 3 problems failed: 1 x ")
    summary = json.loads(out.stdout)
    assert (summary["done"], summary["failed"]) == (2, 1)
    assert summary["failed_calls_by_cause"].get("context", 0) > 0
    # The context window was read from /v1/models: the oversize prompt was refused locally, never sent.
    assert sent_for_huge == 0
    db = sqlite3.connect(tmp_path / "run" / "run.sqlite")
    rows = dict(db.execute("SELECT problem_id, status FROM results"))
    db.close()
    assert rows["short"] == "done" and rows["after"] == "done" and "huge" in rows


# ------------------------------------------------------------------------------------------------ 4. limits
@dataclass
class Counted(ScriptedModel):
    """A scripted model that counts the calls it answers at once (each takes a few turns of the event loop)."""

    in_flight: int = 0
    most_in_flight: int = 0

    async def chat(self, role: str, messages: Sequence[Message], **kwargs: Any) -> Completion:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            return await super().chat(role, messages, **kwargs)
        finally:
            self.in_flight -= 1


@pytest.mark.slow
def test_a_thousand_queued_problems_never_exceed_the_cap_and_are_streamed(tmp_path: Path) -> None:
    cap = 8
    n = 1000
    pulled = 0
    finished = 0
    most_ahead = 0
    most_tasks = 0

    def source() -> Iterator[Problem]:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            yield Problem(problem_id=f"q{i}", question=f"What is {i}+1?", answer=str(i + 1))

    def on_result(_: object) -> None:
        nonlocal finished, most_ahead, most_tasks
        finished += 1
        most_tasks = max(most_tasks, len(asyncio.all_tasks()))

    model = Counted(SimScript(), scripted_settings(concurrency=cap, method={"name": "cot"}))
    store, settings, todo = prepare_run(tmp_path / "run", model.settings, source(), resume=False, own_model=True)

    class Watched:
        """The stored problems, noting how far the runner has read ahead of the finished ones."""

        def __iter__(self) -> Iterator[Problem]:
            nonlocal most_ahead
            for read, problem in enumerate(todo, start=1):
                most_ahead = max(most_ahead, read - finished)
                yield problem

    with store:
        run = run_problems(settings, Watched(), store, state=RunState(), on_result=on_result, model=model)
        summary = asyncio.run(run)
    assert summary.done == n and summary.results == []
    assert len(model.calls) == n
    assert 1 < model.most_in_flight <= cap
    # Only the workers' problems are ever held: at most one per worker ahead of the finished ones, and the
    # event loop holds a handful of tasks, not one per problem (a worker per call in flight).
    assert most_ahead <= cap
    assert most_tasks <= 2 * cap + 8


# ------------------------------------------------------------------------------------------------ 5. secrets
SECRET = "sk-test-TOPSECRET-1234567890abcdef"


@pytest.mark.slow
def test_the_api_key_is_sent_but_never_written_anywhere(tmp_path: Path) -> None:
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(2))
    run_dir = tmp_path / "run"
    env = {"MY_PROVIDER_KEY": SECRET}
    rates = FaultRates(http_500=0.1, http_429=0.1)
    fast = tmp_path / "tmas.toml"
    fast.write_text("[retry]\nbackoff_base_s = 0.01\nbackoff_max_s = 0.02\n")
    with SimServer(SimScript(faults=rates)) as sim:
        out = tmas(
            "run",
            str(problems),
            "-o",
            str(run_dir),
            "--base-url",
            sim.base_url,
            "--api-key-env",
            "MY_PROVIDER_KEY",
            *TMAS_SMALL,
            extra_env=env,
        )
        assert out.returncode == 0, out.stderr.decode()
        auth = {r.authorization for r in sim.requests}
        outputs = [out.stdout, out.stderr]
        for args in (
            ["export", str(run_dir)],
            ["export", str(run_dir), "--calls"],
            ["report", str(run_dir), "-o", str(tmp_path / "report"), "--grade", "rules"],
        ):
            shown = tmas(*args, extra_env=env)
            assert shown.returncode == 0, shown.stderr.decode()
            outputs += [shown.stdout, shown.stderr]
        solved = tmas(
            "solve",
            "What is 6*7?",
            "--base-url",
            sim.base_url,
            "--api-key-env",
            "MY_PROVIDER_KEY",
            "--json",
            "-c",
            str(fast),
            "-o",
            str(tmp_path / "solve"),
            extra_env=env,
        )
        assert solved.returncode == 0, solved.stderr.decode()
        outputs += [solved.stdout, solved.stderr]
    assert auth == {f"Bearer {SECRET}"}  # the key really was sent, with every request
    artefacts = [p for d in (run_dir, tmp_path / "solve", tmp_path / "report") for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "run.sqlite" for p in artefacts) and any(p.suffix == ".html" for p in artefacts)
    needle = SECRET.encode()
    for path in artefacts:
        assert needle not in path.read_bytes(), path
    for text in outputs:
        assert needle not in text
    # Also not in any part: the store keeps the name of the variable, not its value.
    assert b"TOPSECRET" not in b"".join(p.read_bytes() for p in artefacts)


# ------------------------------------------------------------------------------------------------ 5. the account
# OpenAI's 429 bodies: a spent quota, and a rate limit (https://platform.openai.com/docs/guides/error-codes).
QUOTA_SPENT = {
    "error": {
        "message": "You exceeded your current quota, please check your plan and billing details.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
}
RATE_LIMITED = {
    "error": {
        "message": "Rate limit reached for requests per min (RPM): Limit 3, Used 3, Requested 1.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}


def _one_at_a_time(sim: SimServer) -> Any:
    return settings_for(sim, method__name="cot", problems_in_flight=1)


async def test_a_spent_quota_ends_the_run_after_one_request_keeping_finished_work(tmp_path: Path) -> None:
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(3))  # 2*7, 3*7, 4*7, solved in turn
    spent = Rule(pattern=r"3\*7", error_status=429, error_body=QUOTA_SPENT)
    async with SimServer(SimScript(persona="openai", rules=[spent])) as sim:
        with pytest.raises(Unreachable, match="quota is spent") as raised:
            await arun(problems, tmp_path / "run", _one_at_a_time(sim))
        asked = [r.problem_id for r in sim.requests if r.endpoint == "chat"]
    assert asked == ["p0", "p1"]  # the refused call was not sent again, and no later problem was started
    assert f"tmas.api.aresume('{tmp_path / 'run'}')" in str(raised.value)
    with RunStore(tmp_path / "run") as store:
        assert {r.problem_id: r.status for r in store.results()} == {"p0": "done"}


async def test_a_rate_limit_is_waited_out_and_the_run_goes_on(tmp_path: Path) -> None:
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(3))
    limited = Rule(pattern=r"3\*7", error_status=429, error_body=RATE_LIMITED, times=2)
    async with SimServer(SimScript(persona="openai", rules=[limited])) as sim:
        summary = await arun(problems, tmp_path / "run", _one_at_a_time(sim))
        asked = [r.problem_id for r in sim.requests if r.endpoint == "chat"]
    assert asked == ["p0", "p1", "p1", "p1", "p2"]
    assert (summary.done, summary.failed, summary.retries_by_cause) == (3, 0, {"http_429": 2})


@pytest.mark.parametrize("stream", ["on", "off"])
async def test_sglangs_running_time_limit_is_its_own_cause_and_is_sent_again_once(tmp_path: Path, stream: str) -> None:
    problems = write_jsonl(tmp_path / "p.jsonl", arithmetic(3))
    # SGLang aborts the reply part way, every time it is asked (scheduler.py _abort_on_running_timeout).
    limited = Rule(pattern=r"3\*7", fault="stream_error", error_status=503, error_message=RUNNING_TIMEOUT)
    async with SimServer(SimScript(persona="sglang", rules=[limited])) as sim:
        settings = _one_at_a_time(sim)
        settings.endpoint.stream = stream  # type: ignore[assignment]
        summary = await arun(problems, tmp_path / "run", settings)
        asked = [r.problem_id for r in sim.requests if r.endpoint == "chat"]
    assert asked == ["p0", "p1", "p1", "p2"]  # sent again once, not up to max_attempts
    assert (summary.done, summary.failed, summary.retries_by_cause) == (2, 1, {"running_timeout": 1})
    with RunStore(tmp_path / "run") as store:
        [failed] = [c for c in store.calls() if not c.ok]
    assert failed.error_cause == "running_timeout" and "SGLANG_REQ_RUNNING_TIMEOUT" in (failed.error or "")
