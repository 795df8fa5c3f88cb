"""`tmas view`: bank diffs worked by hand, read-only stores beside a live writer, and the pages in headless Chromium."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SCRIPTED_URL, clean_env, scripted_settings
from scripted_runs import scripted_run
from tmas.config import Sampling
from tmas.data.generators import generate
from tmas.grading.grades import GradeConfig
from tmas.grading.runs import grade_run
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.memory.transcript import TeamMember, Transcript, Utterance
from tmas.methods.base import Candidate, CandidateMeta, IterationRecord, ProblemResult
from tmas.methods.confidence import Confidence
from tmas.problems import Problem
from tmas.store.records import Selection
from tmas.store.run_store import SCHEMA_VERSION, RunStore, StoreError
from tmas.store.summaries import summarize_result
from tmas.sweep import Study, SweepSpec, run_sweep
from tmas.testing import Rule, ScriptedModel, ScriptedUsage, SimScript, SimServer
from tmas.view.app import view_app
from tmas.view.bank_diff import bank_diffs, diff_entries
from tmas.view.cache import RunCache
from tmas.view.runs import RunReader, discover
from web_helpers import AppThread, HeldRequests, get, run_ref_for, wait_until

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PROBLEMS = [
    Problem(problem_id="mult", question="What is 17*23?", answer="391"),
    Problem(problem_id="square", question="What is 12*12?", answer="144"),
]


def test_bank_diff_worked_by_hand() -> None:
    before = [
        {"id": "E1", "kind": "insight", "content": "check parity"},
        {"id": "E2", "kind": "anchor", "content": "T_2 = 3"},
        {"id": "E3", "kind": "insight", "subtype": None, "content": "try small cases"},
    ]
    after = [
        {"id": "E1", "kind": "insight", "content": "check parity"},
        {"id": "E2", "kind": "anchor", "content": "T_2 = 3 and T_3 = 0"},
        {"id": "E4", "kind": "insight", "content": "use the recurrence"},
    ]
    changes = diff_entries(before, after, "content")
    assert [(c.id, c.change) for c in changes] == [
        ("E1", "kept"),
        ("E2", "refined"),
        ("E4", "added"),
        ("E3", "deleted"),
    ]
    assert changes[1].before == "T_2 = 3" and changes[1].text == "T_2 = 3 and T_3 = 0"
    assert changes[2].details == changes[3].details == {"kind": "insight"}
    # A guideline strategy followed again keeps its text and changes its counts: updated, not refined.
    strategy = {"id": "S1", "description": "induction", "first_iteration": 0, "last_iteration": 0}
    prev = {"guideline_bank": {"strategies": [{**strategy, "attempts": 1}]}}
    state = {"guideline_bank": {"strategies": [{**strategy, "last_iteration": 1, "attempts": 2}]}}
    diffs = bank_diffs(prev, state)
    assert list(diffs) == ["guideline_bank"] and diffs["guideline_bank"][0].change == "updated"
    # The first iteration is compared with empty banks; a state without banks has no diff at all.
    assert [c.change for c in bank_diffs(None, state)["guideline_bank"]] == ["added"]
    assert bank_diffs(prev, {"modes": []}) == {}


def test_a_read_only_store_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a run directory"):
        RunStore(tmp_path / "none", read_only=True)
    assert not (tmp_path / "none").exists()
    with RunStore(tmp_path / "run") as writer:
        writer.add_problems(PROBLEMS)
        with RunStore(tmp_path / "run", read_only=True) as reader:
            before = reader.change_marker()
            writer.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=[]))
            assert reader.change_marker() != before
            assert [p.problem_id for p in reader.problems()] == ["mult", "square"]
            with pytest.raises(Exception, match="readonly"):
                reader.set_meta("x", 1)


def test_the_change_marker_follows_results_written_again_by_their_summaries(tmp_path: Path) -> None:
    # A result and its summary are written in one transaction with one time; the marker reads the summaries' times
    # (a column the results keep past each whole record: reading theirs walked every record on every poll). A store
    # of an older schema, read-only, has no summaries: its results' times are read.
    import sqlite3

    result = ProblemResult(problem_id="mult", answer="391", text="It is $\\boxed{391}$.", status="done", method="cot")
    with RunStore(tmp_path / "run") as writer:
        writer.add_problems(PROBLEMS)
        writer.save_result(result)
        times = writer._db.execute(
            "SELECT r.finished_at, s.finished_at FROM results r JOIN result_summaries s USING (problem_id)"
        ).fetchall()
    assert len(times) == 1 and times[0][0] == times[0][1]
    for schema, table in ((SCHEMA_VERSION, "result_summaries"), (2, "results")):
        db = sqlite3.connect(tmp_path / "run" / "run.sqlite")
        if schema == 2:  # the store as schema 2 left it
            db.executescript(
                "DROP TRIGGER result_summaries_follow; DROP TABLE result_summaries;"
                " UPDATE meta SET value = '2' WHERE key = 'schema_version';"
            )
        with RunStore(tmp_path / "run", read_only=True) as reader:
            before = reader.change_marker()
            # The same problem solved again: no new call, iteration nor result, only the time it was written.
            db.execute(f"UPDATE {table} SET finished_at = finished_at + 1")
            db.commit()
            assert reader.change_marker() != before, schema
        db.close()


def test_the_run_page_follows_a_write_that_leaves_the_run_files_looking_unchanged(tmp_path: Path) -> None:
    # Once the WAL has restarted after a checkpoint it keeps its size, and a write within the filesystem's time
    # resolution of the last one (a tick of a few ms; a second or two on some filesystems) leaves the files' sizes
    # and times as they were: simulated by putting their times back. The run page must still show the new result.
    run_dir = tmp_path / "run"
    problems = [Problem(problem_id=f"p{i}", question=f"What is {i}+{i}?", answer=str(2 * i)) for i in range(20)]
    with RunStore(run_dir) as writer:
        writer.add_problems(problems)
        for p in problems[:10]:
            done = ProblemResult(problem_id=p.problem_id, answer=p.answer, text="x" * 3000, status="done", method="cot")
            writer.save_result(done)
        writer._db.execute("PRAGMA wal_checkpoint(RESTART)")
        cache = RunCache()
        [ref] = discover([run_dir])
        with RunReader(ref, cache) as reader:
            assert reader.overview().status_counts == {"done": 10, "pending": 10}
        files = [run_dir / "run.sqlite", run_dir / "run.sqlite-wal"]
        stats = [os.stat(f) for f in files]
        writer.save_result(ProblemResult(problem_id="p10", answer="20", text="20", status="done", method="cot"))
        for f, st in zip(files, stats, strict=True):
            assert os.stat(f).st_size == st.st_size
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        with RunReader(ref, cache) as reader:
            assert reader.overview().status_counts == {"done": 11, "pending": 9}


def _ops(*ops: dict[str, str]) -> str:
    return "```json\n" + json.dumps({"operations": list(ops)}) + "\n```"


# The experience agent's replies on the "mult" problem: iteration 0 adds two entries; iteration 1 refines the first,
# deletes the second and adds a third. (The other problem gets the simulator's default experience agent.)
EXPERIENCE_RULE = Rule(
    role="experience",
    pattern=r"17\*23",
    replies=[
        _ops(
            {
                "op": "ADD",
                "kind": "anchor",
                "subtype": "intermediate_result",
                "content": "Splitting one factor into tens and units was verified.",
            },
            {"op": "ADD", "kind": "heuristic", "content": "Check the last digit of a product first."},
        ),
        _ops(
            {
                "op": "REFINE",
                "id": "E1",
                "content": "Splitting one factor into tens and units, then adding both partial products, was verified.",
            },
            {"op": "DELETE", "id": "E2"},
            {"op": "ADD", "kind": "heuristic", "content": "Estimate the size of the product before computing it."},
        ),
    ],
)


def _tmas_run(run_dir: Path, iterations: int = 2) -> None:
    """A TMAS run of PROBLEMS in process, graded by the rules."""
    import asyncio

    params = {"n": 3, "m": 1, "iterations": iterations, "skip_final_memory": False}
    model = ScriptedModel(
        SimScript(rules=[EXPERIENCE_RULE]), scripted_settings(method__name="tmas", method__params=params)
    )
    asyncio.run(scripted_run(model, run_dir, PROBLEMS))
    with RunStore(run_dir) as store:
        asyncio.run(grade_run(store, GradeConfig(mode="rules")))


@pytest.mark.slow
def test_the_viewer_reads_a_run_another_process_is_writing(sim: SimServer, tmp_path: Path) -> None:
    # The server answers the run's first 6 calls and holds the next until the pages were read: the run is unfinished
    # then, however fast the machine; then it goes on, its pages read while it is written, to its end.
    sim.set_script(SimScript(hold_after=6))
    run_dir = tmp_path / "live"
    problems = tmp_path / "p.jsonl"
    problems.write_text("".join(p.model_dump_json() + "\n" for p in PROBLEMS))
    env = clean_env()
    env["PYTHONPATH"] = str(REPO / "src")
    cmd = [sys.executable, "-m", "tmas", "run", str(problems), "-o", str(run_dir), "--base-url", sim.base_url]
    cmd += ["--model", "sim-model", "-m", "tmas", "-T", "3", "-p", "n=2", "-p", "m=1"]
    writer = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: sim.stats().held > 0 or writer.poll() is not None, what="the run to wait on the server")
        assert writer.poll() is None, writer.stderr.read() if writer.stderr else b""
        with AppThread(view_app([tmp_path])) as viewer:
            ref = wait_until(lambda: run_ref_for([tmp_path], run_dir), what="the run to be listed")
            assert ref is not None
            status, page = get(f"{viewer.url}/run/{ref.key}")
            assert status == 200, page[:300]
            assert b'class="tag running"' in page or b'class="tag pending"' in page
            assert b'class="tag done">done' not in page
            sim.set_script(SimScript())  # the gate opens
            while writer.poll() is None:
                status, page = get(f"{viewer.url}/run/{ref.key}")
                assert status == 200, page[:300]
                time.sleep(0.1)  # pacing only: any number of reads, none, proves the same
            assert writer.wait() == 0, writer.stderr.read() if writer.stderr else b""
            status, page = get(f"{viewer.url}/run/{ref.key}")
            assert status == 200 and page.count(b'class="tag done">done') == 2
    finally:
        writer.kill()
        writer.wait()


def test_a_mattrl_transcript_shows_with_the_credits_of_its_turns(tmp_path: Path) -> None:
    transcript = Transcript(
        problem_id="mult",
        team=[TeamMember(id="S1", specialty="arithmetic"), TeamMember(id="S2", specialty="estimation", leader=True)],
        utterances=[
            Utterance(round=0, agent="S1", kind="opinion", text="17*23 is 391 by long multiplication.", answer="391"),
            Utterance(round=0, agent="S2", kind="opinion", text="About 400, so 391 is plausible.", answer="391"),
            Utterance(round=1, agent="coordinator", kind="decision", text="The team agrees on 391.", answer="391"),
        ],
        final_answer="391",
    )
    run_dir = tmp_path / "mattrl-run"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        record = IterationRecord(problem_id="mult", iteration=0, candidates=[], selected="391")
        record.state = {"transcript": transcript.model_dump(mode="json")}
        store.save_iteration(record)
    build = tmp_path / "pool.build"
    RunStore(build).close()
    rows = [
        {"run": str(run_dir), "problem_id": "mult", "turn": 1, "agent": "S1", "r": 0.875},
        {"run": str(run_dir), "problem_id": "mult", "turn": 1, "agent": "S2", "r": 0.125},
        {"run": str(tmp_path / "other"), "problem_id": "mult", "turn": 1, "agent": "S1", "r": 0.5},
    ]
    (build / "credits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    with AppThread(view_app([run_dir, build])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
        # Bad addresses get a page saying what is wrong, with the status to match.
        for path, code, says in [
            ("/run/nosuchrun", 404, b"no run &#39;nosuchrun&#39;"),
            (f"/run/{ref.key}/iteration?id=mult&t=two", 400, b"t must be an iteration number"),
            (f"/run/{ref.key}/iteration?id=mult&t=5", 404, b"has no iteration 5"),
            (f"/run/{ref.key}/problem?id=other", 404, b"no problem &#39;other&#39;"),
            (f"/run/{ref.key}/call/999", 404, b"no call 999"),
        ]:
            got, body = get(viewer.url + path)
            assert got == code and says in body, (path, got, body[-300:])
    text = page.decode()
    assert status == 200 and 'id="transcript"' in text
    assert "S2 estimation (lead)" in text and "17*23 is 391 by long multiplication." in text
    # Each specialist's turn carries its own credit; the coordinator's decision has none.
    order = ["0.88", "17*23 is 391 by long", "0.12", "About 400", "The team agrees"]
    assert [text.index(part) for part in order] == sorted(text.index(part) for part in order)
    assert "0.50" not in text


def test_confidence_and_why_a_problem_stopped_show(tmp_path: Path) -> None:
    run_dir = tmp_path / "mv-run"
    confident = Confidence(mean=2.5, lowest_group=1.25, tail=3.0, tokens=40, window=16)
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        store.set_meta("method", {"name": "majority", "params": {"confidence_measure": "lowest_group"}})
        record = IterationRecord(
            problem_id="mult",
            iteration=0,
            candidates=[
                Candidate(index=0, text="391", answer="391", confidence=confident),
                Candidate(index=1, text="390", answer="390"),
                Candidate(
                    index=2,
                    text="\\boxed{9} first",
                    finish_reason="confidence_stop",
                    error="stopped early: group confidence 1.75 fell below the threshold 2.00",
                    meta={"stopped_early": "group confidence 1.75 fell below the threshold 2.00"},
                ),
            ],
            selected="391",
            state={
                "stop": {"drawn": 4, "k": 16, "reason": "after 4 of 16 samples: decided"},
                "online_stop": {
                    "threshold": 2.0,
                    "window": 4,
                    "warmup": 2,
                    "watched": 1,
                    "stopped": 1,
                    "tokens_saved": 92,
                },
            },
        )
        store.save_iteration(record)
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        _, problem = get(f"{viewer.url}/run/{ref.key}/problem?id=mult")
        _, iteration = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
    # The problem page's column reads the run's measure (the lowest group here); "-" where there is none.
    table = problem.decode().split("<table>")[1].split("</table>")[0]
    assert 'title="DeepConf lowest_group confidence">confidence</th>' in table
    # Three scores and candidates 1's and 2's confidence are missing.
    assert '<td class="num">1.25</td>' in table and table.count('<td class="num">-</td>') == 5
    page = iteration.decode()
    assert "confidence (DeepConf): lowest group 1.25 · tail 3.00 · mean 2.50 over 40 tokens (window 16)" in page
    assert "4 of 16 samples drawn: after 4 of 16 samples: decided" in page
    assert "online stop (DeepConf): 2 warm-up, 1 watched, 1 stopped (about 92 completion tokens saved)" in page
    assert "threshold 2.00 over windows of 4 tokens" in page and "stopped early: no answer" in page


def test_a_carried_solution_is_named_on_the_iteration_page(tmp_path: Path) -> None:
    run_dir = tmp_path / "sr-run"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        store.set_meta("method", {"name": "self_refine", "params": {"n": 2, "iterations": 2}})
        first = [Candidate(index=i, text="\\boxed{391}", answer="391") for i in range(2)]
        store.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=first, selected="391"))
        kept = CandidateMeta(kept_previous=True, carried_from=0)
        second = [Candidate(index=0, text="\\boxed{391}", answer="391"), Candidate(index=1, text="ok", meta=kept)]
        store.save_iteration(IterationRecord(problem_id="mult", iteration=1, candidates=second, selected="391"))
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        _, page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=1")
    text = page.decode()
    assert text.count('class="carried"') == 1
    assert f'holds its <a href="/run/{ref.key}/iteration?id=mult&amp;t=0">solution of iteration 0</a>' in text


def test_the_trajectories_a_budget_stop_refused_are_named_on_the_cut_iterations_page(tmp_path: Path) -> None:
    run_dir = tmp_path / "sr-run"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        store.set_meta("method", {"name": "self_refine", "params": {"n": 3, "iterations": 2}})
        first = [Candidate(index=i, text=f"\\boxed{{{a}}}", answer=a) for i, a in enumerate("577")]
        store.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=first, selected="7"))
        cut = IterationRecord(
            problem_id="mult",
            iteration=1,
            candidates=[Candidate(index=0, text="\\boxed{5}", answer="5")],
            selected="7",
            selection=Selection(iteration=0, candidate=1),
            held_over=[1, 2],
        )
        store.save_iteration(cut)
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        _, page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=1")
    text = page.decode()
    assert "the budget refused the calls of trajectories 1, 2: each holds its" in text
    assert f'<a href="/run/{ref.key}/iteration?id=mult&amp;t=0">solution of iteration 0</a>' in text
    assert "(candidate 1 of iteration 0)" in text


# ------------------------------------------------------------------------------------------------ browser
def _chrome(profile: Path) -> Any:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("headless Chromium is missing: apt-get install chromium chromium-driver (make test does it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    driver = _chrome(tmp_path / "chrome-profile")
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver: Any, tmp_path: Path, name: str, top: Any = None) -> None:
    """Screenshots go to the test's folder; with TMAS_DOCS_SCREENSHOTS=1 to docs/img/ (the ones in the README)."""
    folder = REPO / "docs" / "img" if os.environ.get("TMAS_DOCS_SCREENSHOTS") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1280, min(max(600, int(height) + 40), 1800))
    if top is not None:  # the part of the page to show starts at this element
        driver.execute_script("arguments[0].scrollIntoView()", top)
    path = folder / f"viewer_{name}.png"
    assert driver.save_screenshot(str(path))
    if folder != tmp_path:
        from PIL import Image  # matplotlib's dependency: a palette PNG is a third of the size in the repository

        Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)


@pytest.mark.slow
def test_in_chromium_open_a_run_a_problem_an_iteration_its_bank_diff_and_a_call(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "runs" / "tmas-demo"
    _tmas_run(run_dir)
    with RunStore(run_dir, read_only=True) as store:
        records = store.iterations("mult")
        expected = bank_diffs(records[0].state, records[1].state)
        first_call = store.call(records[1].candidates[0].call_id or 0)
        assert first_call is not None
    with AppThread(view_app([tmp_path / "runs"])) as viewer:
        browser.get(viewer.url)
        _shot(browser, tmp_path, "runs")
        browser.find_element(By.LINK_TEXT, "tmas-demo").click()
        problems = browser.find_element(By.ID, "problems").text
        assert "mult" in problems and "391" in problems and "correct" in problems
        assert "solution" in browser.find_element(By.ID, "costs").text
        # Graded with the rules: the accuracy table and both charts (PNG from tmas.reports' plots) are there.
        assert "100.0%" in browser.find_element(By.ID, "metrics").text
        charts = browser.find_elements(By.CSS_SELECTOR, ".charts img")
        assert len(charts) == 2 and all(browser.execute_script("return arguments[0].naturalWidth", c) for c in charts)
        _shot(browser, tmp_path, "run")

        browser.find_element(By.LINK_TEXT, "mult").click()
        cards = browser.find_elements(By.CSS_SELECTOR, ".timeline .iteration")
        assert len(cards) == 2 and any(mode in cards[1].text for mode in ("exploit", "explore"))
        _shot(browser, tmp_path, "problem")

        browser.find_element(By.LINK_TEXT, "iteration 1").click()
        diff = browser.find_element(By.ID, "diff-experience_bank")
        rows = diff.find_elements(By.CSS_SELECTOR, "tr")[1:]
        assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == [
            c.change for c in expected["experience_bank"]
        ]
        assert [(c.id, c.change) for c in expected["experience_bank"]] == [
            ("E1", "refined"),
            ("E3", "added"),
            ("E2", "deleted"),
        ]
        assert "Splitting one factor into tens and units was verified." in diff.find_element(By.TAG_NAME, "del").text
        assert browser.find_element(By.ID, "diff-guideline_bank")
        assert len(browser.find_elements(By.CSS_SELECTOR, ".candidate")) == 3
        # Every call of the iteration, all roles, is listed (and linked).
        call_rows = browser.find_element(By.ID, "calls").find_elements(By.CSS_SELECTOR, "tr")[1:]
        assert len(call_rows) == records[1].calls == 11
        assert {r.find_elements(By.TAG_NAME, "td")[1].text for r in call_rows} == {
            "solution",
            "verifier",
            "summary",
            "experience",
            "guideline",
        }
        _shot(browser, tmp_path, "iteration")

        browser.find_elements(By.CSS_SELECTOR, "a.call-link")[0].click()
        request = browser.find_element(By.ID, "request").text
        assert "What is 17*23?" in request
        assert first_call.content.splitlines()[0] in browser.find_element(By.ID, "reply").text
        _shot(browser, tmp_path, "call")


@pytest.mark.slow
def test_in_chromium_a_problem_page_follows_a_run_as_it_goes(tmp_path: Path, browser: Any) -> None:
    """The run moves on between the page's render and its first question whether the run changed (held here until
    the write is done): the page still reloads, as it compares with the run it was rendered from."""
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "growing"
    with RunStore(run_dir) as writer:
        writer.add_problems(PROBLEMS[:1])
        record = IterationRecord(problem_id="mult", iteration=0, candidates=[], selected="390")
        writer.save_iteration(record)
        gate = HeldRequests(view_app([run_dir]), "/marker")
        with AppThread(gate) as viewer, gate:
            ref = run_ref_for([run_dir], run_dir)
            assert ref is not None
            browser.get(f"{viewer.url}/run/{ref.key}/problem?id=mult")
            assert "in progress" in browser.page_source and "iteration 1" not in browser.page_source
            wait_until(gate.arrived.is_set, timeout=60, what="the page to ask whether its run changed")
            writer.save_iteration(record.model_copy(update={"iteration": 1, "selected": "391"}))
            gate.release()
            wait_until(lambda: "iteration 1" in browser.page_source, timeout=60, what="the page to update itself")
            assert browser.find_elements(By.LINK_TEXT, "iteration 1")


def test_each_live_page_carries_the_change_marker_of_the_run_it_was_rendered_from(tmp_path: Path) -> None:
    """A live page compares the markers it polls with its own: the one its run had when it was rendered."""
    import re

    runs = {}
    for name in ("a", "b"):
        with RunStore(tmp_path / name) as store:
            store.add_problems(PROBLEMS[:1])
            store.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=[], selected="391"))
            runs[name] = store.change_marker()
    with AppThread(view_app([tmp_path / "a", tmp_path / "b"], warm_up=False)) as viewer:
        refs = {name: run_ref_for([tmp_path / name], tmp_path / name) for name in runs}
        a, b = refs["a"], refs["b"]
        assert a is not None and b is not None
        pages = {
            f"/run/{a.key}": runs["a"],
            f"/run/{a.key}/problem?id=mult": runs["a"],
            f"/run/{a.key}/iteration?id=mult&t=0": runs["a"],
            f"/run/{a.key}/where-lost": runs["a"],
            f"/compare?run={a.key}&run={b.key}": f"{runs['a']}/{runs['b']}",
        }
        for address, marker in pages.items():
            status, page = get(viewer.url + address)
            assert status == 200, (address, page[:300])
            assert re.findall(rb'<body[^>]* data-marker="([^"]*)"', page) == [marker.encode()], address
        # What the pages poll answers the same while the runs stay as they are.
        assert get(f"{viewer.url}/run/{a.key}/marker") == (200, runs["a"].encode())
        assert get(f"{viewer.url}/compare/marker?run={a.key}&run={b.key}") == (200, f"{runs['a']}/{runs['b']}".encode())


def test_grading_a_run_moves_the_marker_its_open_pages_poll(tmp_path: Path) -> None:
    """`tmas report` grading a run (its judge writes grades as they come) changes what the run's pages show: the
    marker they poll moves with the grades written, and again when they are deleted for a new grading."""
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        record = IterationRecord(
            problem_id="mult",
            iteration=0,
            candidates=[Candidate(index=0, text="So 391.", answer="391")],
            selected="391",
        )
        store.save_iteration(record)
        store.save_result(ProblemResult(problem_id="mult", method="cot", answer="391", iterations=[record]))
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        marker = f"{viewer.url}/run/{ref.key}/marker"
        before = get(marker)
        with RunStore(run_dir) as store:
            asyncio.run(grade_run(store, GradeConfig(mode="rules")))
            assert store.grades()
            graded = get(marker)
            store.delete_grades()
            deleted = get(marker)
    assert before[0] == graded[0] == deleted[0] == 200
    assert graded[1] != before[1] and deleted[1] != graded[1], (before, graded, deleted)


def test_the_cli_takes_options_after_the_run_directories(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "tmas", "view", str(tmp_path / "missing"), "--port", "1"]
    done = subprocess.run(cmd, capture_output=True, env=env, timeout=60, text=True)
    assert done.returncode == 2 and done.stderr.strip() == f"tmas: error: not a directory: {tmp_path / 'missing'}"


# ------------------------------------------------------------------------------------------------ comparison
def _solution(answer: str) -> str:
    return f"We have $17 \\times 23 = \\frac{{782}}{{2}}$ and \\(\\sqrt{{4}} = 2\\).\n\n**So** \\boxed{{{answer}}}"


def _scripted(answers: dict[str, list[str]], completion_tokens: int) -> SimScript:
    """Solution replies per problem (by its question), each reporting ``completion_tokens`` completion tokens."""
    usage = ScriptedUsage(prompt_tokens=50, completion_tokens=completion_tokens)
    patterns = {"mult": r"17\*23", "square": r"12\*12"}
    return SimScript(
        rules=[
            Rule(role="solution", pattern=patterns[pid], replies=[_solution(a) for a in replies], usage=usage)
            for pid, replies in answers.items()
        ]
    )


def _scripted_run(run_dir: Path, script: SimScript, method: str, params: dict[str, Any]) -> None:
    """A run of ``method`` on PROBLEMS in process, answered by ``script``."""
    import asyncio

    model = ScriptedModel(script, scripted_settings(method__name=method, method__params=params))
    asyncio.run(scripted_run(model, run_dir, PROBLEMS))


@pytest.mark.slow
def test_in_chromium_two_runs_compared_with_math_rendered_and_graded_live(tmp_path: Path, browser: Any) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    runs = tmp_path / "runs"
    # Majority vote, k=4 samples of 100 completion tokens: mult gets 391 three times (reference 391), square 144
    # twice (reference 144); chain of thought, one sample of 300 tokens: right on mult, wrong on square.
    _scripted_run(
        runs / "a-majority",
        _scripted({"mult": ["391", "391", "390", "391"], "square": ["144", "144", "140", "141"]}, 100),
        "majority",
        {"k": 4},
    )
    _scripted_run(runs / "b-cot", _scripted({"mult": ["391"], "square": ["145"]}, 300), "cot", {})
    with AppThread(view_app([runs])) as viewer:
        browser.get(viewer.url)
        for box in browser.find_elements(By.CSS_SELECTOR, "#compare-form input[name=run]"):
            box.click()
        browser.find_element(By.ID, "compare").click()
        wait_until(lambda: browser.find_elements(By.ID, "frontier"), timeout=30, what="the comparison page")
        points = [
            [td.text for td in row.find_elements(By.TAG_NAME, "td")]
            for row in browser.find_elements(By.CSS_SELECTOR, "#frontier tr.frontier-point")
        ]
        # MV@k (the exact expectation over k of the 4 samples), worked by hand:
        # MV@1 = mean(3/4, 2/4) = 0.625, s.e. = stdev(0.75, 0.5)/sqrt(2) = 0.125.
        # MV@2: mult: of the C(4,2) = 6 pairs, 3 are 391+391 (right), 3 are 391+390 (a tie, right half the time):
        #   4.5/6 = 0.75; square: 144+144 right, 144+140 (2) and 144+141 (2) ties, 140+141 wrong: 3/6 = 0.5.
        # MV@4: 391 and 144 win their votes: 1.0. Tokens: k x 100. CoT: one point, 1 of 2 right at 300 tokens.
        assert points == [
            ["a-majority", "MV@1", "100", "62.5%", "12.5", "2"],
            ["a-majority", "MV@2", "200", "62.5%", "12.5", "2"],
            ["a-majority", "MV@4", "400", "100.0%", "0.0", "2"],
            ["b-cot", "It0", "300", "50.0%", "50.0", "2"],
        ]
        chart = browser.find_element(By.CSS_SELECTOR, ".charts img")
        assert browser.execute_script("return arguments[0].naturalWidth", chart)
        _shot(browser, tmp_path, "compare")

        # Equal budgets read from each frontier: the best point at or under each budget.
        field = browser.find_element(By.NAME, "budgets")
        field.clear()
        field.send_keys("150,350,500")
        field.submit()

        def budgets_shown() -> bool:
            try:
                return "≤ 150" in browser.find_element(By.ID, "equal-budget").text
            except StaleElementReferenceException:  # the submitted form's page is replacing this one
                return False

        wait_until(budgets_shown, what="the new budgets")
        table = [
            [td.text for td in row.find_elements(By.TAG_NAME, "td")]
            for row in browser.find_elements(By.CSS_SELECTOR, "#equal-budget tr")[1:]
        ]
        assert table == [
            ["a-majority", "62.5% MV@1", "62.5% MV@1", "100.0% MV@4"],
            ["b-cot", "-", "50.0% It0", "50.0% It0"],
        ]

        # Problem by problem: who got it right, with what answer, at what cost (4 x 100 or 1 x 300 tokens).
        grid = {
            row.get_attribute("data-problem"): [
                " ".join(td.text.split()) for td in row.find_elements(By.CSS_SELECTOR, "td.grid-cell")
            ]
            for row in browser.find_elements(By.CSS_SELECTOR, "#grid tr.grid-row")
        }
        assert grid == {
            "mult": [
                "correct rules 391 400 completion tokens · 4 calls",
                "correct rules 391 300 completion tokens · 1 call",
            ],
            "square": [
                "correct rules 144 400 completion tokens · 4 calls",
                "wrong rules 145 300 completion tokens · 1 call",
            ],
        }
        _shot(browser, tmp_path, "compare_grid", top=browser.find_element(By.ID, "equal-budget"))

        # Into the CoT run's problem page from the grid: its solution's math is rendered, not shown as LaTeX.
        cells = browser.find_elements(By.CSS_SELECTOR, "#grid tr.grid-row[data-problem=square] td.grid-cell a")
        cells[1].click()
        wait_until(lambda: browser.find_elements(By.ID, "solution"), what="the problem page")
        assert "b-cot" in browser.find_element(By.TAG_NAME, "header").text
        solution = browser.find_element(By.ID, "solution")
        assert len(solution.find_elements(By.CSS_SELECTOR, "math")) == 3  # the fraction, the root, the box
        assert solution.find_elements(By.CSS_SELECTOR, "mfrac") and solution.find_elements(By.CSS_SELECTOR, "msqrt")
        visible = browser.find_element(By.TAG_NAME, "body").text
        assert "\\frac" not in visible and "\\boxed" not in visible and "So" in solution.text
        assert "wrong" in browser.find_element(By.TAG_NAME, "main").text.split("Iterations")[0]
        _shot(browser, tmp_path, "math")
        # The raw text, one click away.
        browser.find_element(By.ID, "raw-text").click()
        assert "\\frac{782}{2}" in solution.text and "\\boxed{145}" in solution.text
        browser.find_element(By.ID, "raw-text").click()
        assert "\\frac" not in solution.text

        # The run page: the model and the method's parameters in the title, each problem graded live by the rules.
        browser.find_element(By.LINK_TEXT, "b-cot").click()
        title = browser.find_element(By.ID, "run-title").text
        assert title == "cot on sim-model", title  # every parameter at its default: none named
        assert browser.find_element(By.ID, "model-detail").text == SCRIPTED_URL
        rows = {
            r.find_elements(By.TAG_NAME, "td")[0].text.split()[0]: r.find_elements(By.TAG_NAME, "td")[4].text
            for r in browser.find_elements(By.CSS_SELECTOR, "#problems tr")[1:]
        }
        assert rows == {"mult": "correct rules", "square": "wrong rules"}
        assert "50.0%" in browser.find_element(By.ID, "metrics").text
        _shot(browser, tmp_path, "run_graded_live")


def test_stored_grades_take_precedence_over_the_live_rules(tmp_path: Path) -> None:
    import asyncio

    run_dir = tmp_path / "cot"
    _scripted_run(run_dir, _scripted({"mult": ["391"], "square": ["145"]}, 300), "cot", {})
    with RunStore(run_dir) as store:
        asyncio.run(grade_run(store, GradeConfig(mode="rules")))
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, page = get(f"{viewer.url}/run/{ref.key}")
    text = page.decode()
    assert status == 200 and text.count('class="tag correct"') == 1 and text.count('class="tag wrong"') == 1
    # Graded by tmas report (Math-Verify): marked with the stored grades' mode, not as the viewer's live check.
    problems = text.split('id="problems"')[1]
    assert (
        problems.count(' <span class="grader" title="graded by tmas report">rules</span>') == 2
        and "graded live" not in problems
    )


def _graded_majority_run(run_dir: Path) -> tuple[Any, Any]:
    """A majority run graded by the rules, and its grades and metrics as ``tmas report`` reads them (full records)."""
    import asyncio

    from tmas.grading.run_results import load_results
    from tmas.grading.runs import load_grades
    from tmas.reports.metrics import compute_metrics

    _scripted_run(run_dir, _scripted({"mult": ["391", "392"], "square": ["144"]}, 300), "majority", {"k": 3})
    with RunStore(run_dir) as store:
        asyncio.run(grade_run(store, GradeConfig(mode="rules")))
        full = load_grades(store, GradeConfig())
        assert full is not None
        metrics = compute_metrics(load_results(store), full)
    assert metrics.iterations
    return full, metrics


def _overview(run_dir: Path) -> Any:
    from tmas.view.cache import RunCache
    from tmas.view.runs import RunReader

    ref = run_ref_for([run_dir], run_dir)
    assert ref is not None
    with RunReader(ref, RunCache()) as reader:
        return reader.overview()


def test_an_overview_reads_the_same_figures_as_the_full_reads(tmp_path: Path) -> None:
    """The run page reads each result's summary, grades from them, and costs per role in one pass: the figures
    equal those of the full reads (tmas report's load_grades, the store's call counts)."""
    import sqlite3

    run_dir = tmp_path / "maj"
    full, metrics = _graded_majority_run(run_dir)
    with RunStore(run_dir) as store:
        counts, roles = store.call_counts(), store.role_costs()
        summaries = {pid: summary for pid, _, summary in store.result_summaries()}
    # Each result's summary was written with it, without the candidates' texts.
    assert set(summaries) == {"mult", "square"}
    candidates = [c for s in summaries.values() for r in s.iterations for c in r.candidates]
    assert len(candidates) == 6 and all(c.text == "" and c.answer for c in candidates)
    # The full records made unreadable: a first view that read them would fail.
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.execute("UPDATE results SET record = '{'")
    db.commit()
    db.close()
    overview = _overview(run_dir)
    assert overview.grades is not None and overview.grades.grades.verdicts == full.verdicts
    assert overview.metrics == metrics
    assert [(p.answer, p.correct) for p in overview.problems] == [("391", True), ("144", True)]
    assert overview.roles == roles and roles["solution"]["calls"] == 6
    assert overview.costs == {k: counts[k] for k in overview.costs} and overview.costs["calls"] == 6


def test_a_store_without_summaries_is_read_in_full_and_summarized_on_its_first_writable_open(tmp_path: Path) -> None:
    import sqlite3

    run_dir = tmp_path / "maj"
    full, metrics = _graded_majority_run(run_dir)
    # The store as schema 2 left it: no summaries.
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.executescript(
        "DROP TRIGGER result_summaries_follow; DROP TABLE result_summaries;"
        " UPDATE meta SET value = '2' WHERE key = 'schema_version';"
    )
    db.close()
    overview = _overview(run_dir)
    assert overview.grades is not None and overview.grades.grades.verdicts == full.verdicts
    assert overview.metrics == metrics
    with RunStore(run_dir, read_only=True) as reader:
        assert reader.get_meta("schema_version") == 2  # a reader neither migrates nor writes
    with RunStore(run_dir, create=False) as store:
        assert store.get_meta("schema_version") == SCHEMA_VERSION
        stored = store._db.execute("SELECT problem_id, summary FROM result_summaries ORDER BY problem_id").fetchall()
        assert [pid for pid, _ in stored] == ["mult", "square"]
        assert [json.loads(s) for _, s in stored] == [summarize_result(r) for r in store.results()]
        # A result deleted takes its summary along.
        store._db.execute("DELETE FROM results WHERE problem_id = 'square'")
        assert [pid for pid, _, _ in store.result_summaries()] == ["mult"]
    overview = _overview(run_dir)
    assert overview.grades is not None and [p.status for p in overview.problems] == ["done", "running"]


def test_a_comparison_needs_two_known_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "one"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS)
    with AppThread(view_app([tmp_path])) as viewer:
        ref = run_ref_for([tmp_path], run_dir)
        assert ref is not None
        for query, code, says in [
            (f"run={ref.key}", 400, b"pick two or more runs"),
            (f"run={ref.key}&run=nosuch", 404, b"no run &#39;nosuch&#39;"),
            (f"run={ref.key}&run={ref.key}", 400, b"pick two or more runs"),
        ]:
            got, body = get(f"{viewer.url}/compare?{query}")
            assert got == code and says in body, (query, got, body[-300:])
        got, body = get(f"{viewer.url}/run/{ref.key}?page=2")
        assert got == 404 and b"the problems fill 1 page(s)" in body
        # A comparison follows its runs live: its marker joins theirs and moves when any of them is written.
        other = tmp_path / "two"
        with RunStore(other) as writer:
            writer.add_problems(PROBLEMS)
            second = run_ref_for([tmp_path], other)
            assert second is not None
            marker = f"{viewer.url}/compare/marker?run={ref.key}&run={second.key}"
            got, before = get(marker)
            assert got == 200 and before.count(b"/") == 1
            writer.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=[]))
            assert get(marker)[1] != before


@pytest.mark.slow
def test_a_thousand_problem_run_from_the_simulated_server_renders(tmp_path: Path) -> None:
    """Index and run pages of 1,000 generated problems (their render time is measured in benchmarks/view_pages.py)."""
    import asyncio

    records = list(generate("all", 143, seed=0))[:1000]
    problems = [Problem(problem_id=r["problem_id"], question=r["question"], answer=r["answer"]) for r in records]
    run_dir = tmp_path / "big"
    model = ScriptedModel(SimScript(), scripted_settings(method__name="cot", concurrency=64))
    asyncio.run(scripted_run(model, run_dir, problems))
    with AppThread(view_app([tmp_path])) as viewer:
        status, index = get(viewer.url)
        assert status == 200 and b"1000 done" in index
        ref = run_ref_for([tmp_path], run_dir)
        assert ref is not None
        status, first = get(f"{viewer.url}/run/{ref.key}")
        assert status == 200 and first.count(b'class="problem-link"') == 100
        assert b"1000 problems, 100 on this page" in first
        status, last = get(f"{viewer.url}/run/{ref.key}?page=10")
        ids = [p.problem_id for p in problems]
        assert status == 200 and ids[-1].encode() in last and f">{ids[0]}<".encode() not in last
        # Every finished problem is graded live (a generated problem's answer is an exact integer).
        graded = last.count(b'class="tag correct"') + last.count(b'class="tag wrong"')
        assert graded == 100


# A solution written the way models write them (Markdown headings and bold, inline and display math, a box).
REAL_SOLUTION = r"""### Step 1: Count the subsets
A subset of $\{1, 2, \dots, 10\}$ with exactly $k$ elements can be chosen in $\binom{10}{k}$ ways, so

$$\sum_{k=0}^{10} \binom{10}{k} = 2^{10} = 1024.$$

### Step 2: Keep the even sums
Pairing each subset $S$ with $S \triangle \{1\}$ changes the parity of the sum, hence exactly
\[ \begin{aligned} \frac{1}{2} \cdot 2^{10} &= 2^{9} \\ &= 512 \end{aligned} \]
subsets have an even sum. **Check:** for $\{1,2\}$ the subsets with an even sum are $\emptyset$ and
$\{2\}$, which is $\frac{2^2}{2} = 2$, as it should be; and $512 \equiv 0 \pmod{2}$, $\sqrt{512} < 23$.

**Final answer:** $\boxed{512}$"""


@pytest.mark.slow
def test_in_chromium_a_solution_a_bank_and_a_transcript_read_as_mathematics(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    problem = Problem(
        problem_id="subsets",
        question=r"How many subsets of $\{1, 2, \dots, 10\}$ have an even sum of elements? Give $\frac{N}{1}$.",
        answer="512",
    )
    candidate = Candidate(
        index=0,
        text=REAL_SOLUTION,
        answer="512",
        meta={"summary": r"Used $\binom{10}{k}$ and a parity-switching pairing: $\frac{2^{10}}{2}$."},
    )
    state = {
        "experience_bank": {
            "entries": [
                {"id": "E1", "kind": "heuristic", "content": r"Toggling $1$ pairs subsets: $\frac{1}{2}$ each."}
            ]
        },
        "transcript": Transcript(
            problem_id="subsets",
            team=[TeamMember(id="S1", specialty="combinatorics", leader=True)],
            utterances=[Utterance(round=0, agent="S1", kind="opinion", text=r"By symmetry $\frac{2^{10}}{2}$.")],
            final_answer="512",
        ).model_dump(mode="json"),
    }
    run_dir = tmp_path / "real"
    with RunStore(run_dir) as store:
        store.add_problems([problem])
        record = IterationRecord(problem_id="subsets", iteration=0, candidates=[candidate], selected="512", state=state)
        store.save_iteration(record)
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        browser.get(f"{viewer.url}/run/{ref.key}/iteration?id=subsets&t=0")
        browser.find_element(By.CSS_SELECTOR, ".candidate details summary").click()
        main = browser.find_element(By.TAG_NAME, "main")
        # Solution (11 inline formulas, the box, 2 displayed), summary (2), bank entry (2), transcript (1).
        assert len(main.find_elements(By.CSS_SELECTOR, ".rendered math")) == 14 + 2 + 2 + 1
        assert len(main.find_elements(By.CSS_SELECTOR, 'math[display="block"]')) == 2
        assert len(main.find_elements(By.CSS_SELECTOR, 'math[display="block"] mtr')) == 2  # the aligned rows
        assert main.find_elements(By.CSS_SELECTOR, 'menclose[notation="box"]')
        text = main.text
        for raw in ("\\frac", "\\binom", "\\sum", "\\boxed", "$$", "###", "**"):
            assert raw not in text, raw
        assert "Step 2: Keep the even sums" in text and "Final answer:" in text
        assert main.find_element(By.CSS_SELECTOR, "#transcript .rendered math")
        assert main.find_element(By.CSS_SELECTOR, "#diff-experience_bank .rendered math")
        _shot(browser, tmp_path, "math_solution")
        browser.get(f"{viewer.url}/run/{ref.key}/problem?id=subsets")
        assert browser.find_element(By.ID, "question").find_elements(By.TAG_NAME, "math")
        assert "\\dots" not in browser.find_element(By.ID, "question").text


def test_the_cache_parses_each_result_once_and_follows_the_run(tmp_path: Path) -> None:
    from tmas.view.cache import RunCache
    from tmas.view.runs import RunReader

    def result(answer: str) -> ProblemResult:
        candidate = Candidate(index=0, text="long text \\boxed{" + answer + "}", answer=answer, meta={"mode": "x"})
        record = IterationRecord(problem_id="mult", iteration=0, candidates=[candidate], selected=answer)
        record.state = {"experience_bank": {"entries": []}}
        return ProblemResult(
            problem_id="mult", method="tmas", status="done", answer=answer, text="t", iterations=[record]
        )

    run_dir = tmp_path / "run"
    cache = RunCache()
    with RunStore(run_dir) as writer:
        writer.add_problems(PROBLEMS)
        writer.save_result(result("390"))
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        with RunStore(run_dir, read_only=True) as reader:
            first = cache.results(reader)
            # Kept without the texts, banks and candidate metadata no overview reads.
            assert [r.problem_id for r in first] == ["mult"] and first[0].text == ""
            assert first[0].iterations[0].state == {}
            written = result("390").iterations[0].candidates[0]
            assert first[0].iterations[0].candidates[0] == written.model_copy(
                update={"text": "", "meta": CandidateMeta()}
            )
            assert cache.results(reader)[0] is first[0]  # not parsed again
            with RunReader(ref, cache) as run:
                overview = run.overview()
                assert overview.problems[0].correct is False and run.overview() is overview
            # The problem is solved again (a new finished_at) and another one starts: both are seen.
            time.sleep(0.01)
            writer.save_result(result("391"))
            writer.save_iteration(IterationRecord(problem_id="square", iteration=0, candidates=[]))
            again = cache.results(reader)
            assert again[0] is not first[0] and again[0].answer == "391"
            assert [(r.problem_id, r.status) for r in again] == [("mult", "done"), ("square", "running")]
            with RunReader(ref, cache) as run:
                fresh = run.overview()
                assert fresh is not overview and fresh.problems[0].correct is True
                assert fresh.status_counts == {"done": 1, "running": 1}


@pytest.mark.slow
def test_in_chromium_a_run_page_leads_to_where_the_run_lost_its_answers(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    from test_where_lost import verify_refine_run

    run_dir = tmp_path / "runs" / "vr-demo"
    asyncio.run(verify_refine_run(run_dir))
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        browser.get(f"{viewer.url}/run/{ref.key}")
        browser.find_element(By.ID, "where-lost-link").click()
        # The figures worked out by hand in test_where_lost.py.
        selection = browser.find_element(By.ID, "lost-selection").text
        assert "25.0% (1) 50.0% (2) 25.0% (1) 25.0% (1) 25.0% (1)" in selection
        assert "50.0% (2 of 4) 27.3% (3 of 11) 0.614" in browser.find_element(By.ID, "lost-verifier").text
        assert "solution 8 12.5% (1) 12.5% (1)" in browser.find_element(By.ID, "lost-replies").text
        _shot(browser, tmp_path, "where_lost")
        # From the step that made p2 worse to that iteration's page.
        browser.find_element(By.ID, "changes-worse").find_element(By.LINK_TEXT, "p2 it1").click()
        assert len(browser.find_elements(By.CSS_SELECTOR, ".candidate")) == 2
        assert "141" in browser.page_source


@pytest.mark.slow
def test_the_viewer_answers_its_own_address_only_and_odd_requests_with_a_4xx(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tmas-demo"
    _tmas_run(run_dir, iterations=1)
    broken = tmp_path / "runs" / "broken"
    broken.mkdir()
    (broken / "run.sqlite").write_bytes(b"not a database" * 100)
    with AppThread(view_app([tmp_path / "runs"])) as viewer:
        ref = run_ref_for([tmp_path / "runs"], run_dir)
        bad = run_ref_for([tmp_path / "runs"], broken)
        assert ref is not None and bad is not None
        assert get(viewer.url)[0] == 200
        assert get(viewer.url, {"Host": f"localhost:{viewer.url.rsplit(':', 1)[1]}"})[0] == 200
        # A page of another site whose name resolves here (DNS rebinding) reads nothing.
        status, body = get(f"{viewer.url}/run/{ref.key}", {"Host": "attacker.example"})
        assert status == 421 and b"its own address only" in body
        assert get(f"{viewer.url}/run/{ref.key}/call/{2**64}")[0] == 404
        assert get(f"{viewer.url}/compare/chart.png?run={ref.key}&run={bad.key}")[0] == 404


def test_the_comparison_counts_tokens_over_the_problems_a_run_started(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name in ("whole", "begun"):
        model = ScriptedModel(SimScript(), scripted_settings(method__name="cot"))
        asyncio.run(scripted_run(model, runs / name, PROBLEMS[:1]))
    with RunStore(runs / "begun") as store:
        # Two more problems nobody has started: they spent nothing and count for nothing yet.
        store.add_problems([Problem(problem_id="p2", question="What is 1+1?"), Problem(problem_id="p3", question="x")])
        [spent] = [r.usage.completion_tokens for r in store.results()]
    with AppThread(view_app([runs])) as viewer:
        keys = [ref.key for ref in (run_ref_for([runs], runs / name) for name in ("whole", "begun")) if ref]
        status, page = get(f"{viewer.url}/compare?run={keys[0]}&run={keys[1]}")
    assert status == 200
    rows = page.decode().split('id="compared-runs"')[1].split("</table>")[0].split("<tr>")[2:]
    assert [row.split('<td class="num">')[3].split("<")[0] for row in rows] == [str(spent), str(spent)]


def test_every_token_figure_says_whether_it_counts_completion_tokens_or_prompt_and_completion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each solution call reports 50 prompt and 300 completion tokens: a figure of 300 is labeled completion tokens,
    one of 350 prompt + completion, on every page that shows one, and the run page's chart is titled by its x axis."""
    from tmas.view import charts

    runs = tmp_path / "runs"
    _scripted_run(runs / "cot", _scripted({"mult": ["391"], "square": ["145"]}, 300), "cot", {})
    _scripted_run(runs / "again", _scripted({"mult": ["391"], "square": ["144"]}, 300), "cot", {})
    titles: list[str] = []
    drawn = charts.plot_frontier
    monkeypatch.setattr(
        charts, "plot_frontier", lambda runs, title, path: titles.append(title) or drawn(runs, title, path)
    )
    with AppThread(view_app([runs])) as viewer:
        refs = [run_ref_for([runs], runs / name) for name in ("cot", "again")]
        keys = [ref.key for ref in refs if ref]
        pages = {
            name: get(f"{viewer.url}{path}")
            for name, path in {
                "compare": f"/compare?run={keys[0]}&run={keys[1]}",
                "run": f"/run/{keys[0]}",
                "problem": f"/run/{keys[0]}/problem?id=mult",
                "iteration": f"/run/{keys[0]}/iteration?id=mult&t=0",
                "chart": f"/run/{keys[0]}/chart/tokens.png",
            }.items()
        }
    assert {name: status for name, (status, _) in pages.items()} == dict.fromkeys(pages, 200)
    text = {name: " ".join(body.decode(errors="replace").split()) for name, (_, body) in pages.items()}
    # The comparison's grid: one call of 300 completion tokens per problem.
    assert text["compare"].count("300 completion tokens · 1 call") == 4 and " 300 tokens" not in text["compare"]
    # The run page: its problems' and its iterations' figures are prompt + completion (350 a problem).
    run = text["run"]
    assert '<th class="num">prompt + completion tokens per problem (cumulative)</th>' in run
    problems = run.split('id="problems"')[1]
    assert '<th class="num">prompt + completion tokens</th>' in problems
    assert problems.count('<td class="num">350</td>') == 2
    assert 'alt="accuracy against completion tokens"' in run
    assert titles == ["Accuracy against completion tokens per problem"]
    # The problem page, in all and per iteration; the iteration page's solution.
    assert text["problem"].count("350 prompt + completion tokens") == 2 and "350 tokens" not in text["problem"]
    assert "solution text (300 completion tokens)" in text["iteration"]


def test_a_problems_cost_counts_the_calls_no_finished_iteration_holds(tmp_path: Path) -> None:
    """Every call reports 100 prompt and 30 completion tokens. TMAS (n=2, m=1: 8 calls an iteration) whose verifier
    breaks fails each problem after iteration 0's 2 solutions, which no record holds; under a budget of 10 calls it
    finishes iteration 0 and iteration 1's 2 solutions, cut short: 10 calls. The pages count what each problem spent,
    as tmas report's cost table and frontier do: 2 calls, 60 completion and 260 prompt + completion tokens; 10 calls,
    300 and 1300."""
    thirty = SimScript(rules=[Rule(usage=ScriptedUsage(prompt_tokens=100, completion_tokens=30))])
    runs = tmp_path / "runs"
    tmas = {"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 5}}
    broken = _BrokenVerifier(thirty, scripted_settings(method=tmas))
    asyncio.run(scripted_run(broken, runs / "failed", PROBLEMS))
    model = ScriptedModel(thirty, scripted_settings(method=tmas, budget={"calls": 10}))
    asyncio.run(scripted_run(model, runs / "cut", PROBLEMS))
    with RunStore(runs / "failed") as store:
        assert [(r.status, r.calls, len(r.iterations)) for r in store.results()] == [("failed", 2, 0)] * 2
    with RunStore(runs / "cut") as store:
        assert [(r.status, r.calls, len(r.iterations)) for r in store.results()] == [("done", 10, 2)] * 2
    with AppThread(view_app([runs])) as viewer:
        keys = [ref.key for ref in (run_ref_for([runs], runs / name) for name in ("failed", "cut")) if ref]
        compare = get(f"{viewer.url}/compare?run={keys[0]}&run={keys[1]}")
        run_pages = [get(f"{viewer.url}/run/{key}") for key in keys]
    assert compare[0] == 200 and [status for status, _ in run_pages] == [200, 200]
    page = compare[1].decode()
    rows = page.split('id="compared-runs"')[1].split("</table>")[0].split("<tr>")[2:]
    assert [row.split('<td class="num">')[3].split("<")[0] for row in rows] == ["60", "300"]
    costs = [" ".join(cell.split()) for cell in page.split('<span class="muted cost">')[1:]]
    assert [cost.split("</span>")[0] for cost in costs] == [
        "60 completion tokens · 2 calls",
        "300 completion tokens · 10 calls",
    ] * 2
    for (_, body), (calls, tokens) in zip(run_pages, (("2", "260"), ("10", "1300")), strict=True):
        problems = body.decode().split('id="problems"')[1].split("</table>")[0].split("<tr>")[2:]
        cells = [[cell.split("<")[0] for cell in row.split('<td class="num">')[2:]] for row in problems]
        assert cells == [[calls, tokens]] * 2


def test_a_problem_that_failed_before_answering_counts_as_wrong_on_every_page(tmp_path: Path) -> None:
    """Chain of thought answers mult (17*23) right; square failed before its first iteration finished (as a budget or
    an unreachable endpoint leaves a problem), returning nothing. tmas report counts it wrong (accuracy 1 of 2); so
    do the comparison's runs table, its frontier, its grid and the run page, instead of leaving it out as
    ungraded."""
    runs = tmp_path / "runs"
    for name in ("one", "two"):
        script = _scripted({"mult": ["391"], "square": ["144"]}, 300)
        _scripted_run(runs / name, script, "cot", {})
        with RunStore(runs / name) as store:
            square = store.result("square")
            assert square is not None
            store._db.execute("DELETE FROM iterations WHERE problem_id = 'square'")
            store.save_result(square.model_copy(update={"status": "failed", "iterations": [], "error": "stopped"}))
    with AppThread(view_app([runs])) as viewer:
        keys = [ref.key for ref in (run_ref_for([runs], runs / name) for name in ("one", "two")) if ref]
        status, body = get(f"{viewer.url}/compare?run={keys[0]}&run={keys[1]}")
        run_status, run_body = get(f"{viewer.url}/run/{keys[0]}")
        problem_status, problem_body = get(f"{viewer.url}/run/{keys[0]}/problem?id=square")
    assert status == 200 and run_status == 200 and problem_status == 200
    # The problem's page: failed, its answer none, wrong.
    assert 'class="tag wrong"' in problem_body.decode().split("<h2>Iterations</h2>")[0]
    page = body.decode()
    rows = page.split('id="compared-runs"')[1].split("</table>")[0].split("<tr>")[2:]
    assert [row.split('<td class="num">')[2].split("<")[0] for row in rows] == ["1 of 2 graded"] * 2
    frontier = page.split('id="frontier"')[1].split("</table>")[0]
    assert frontier.count('<td class="num">50.0%</td>') == 2
    square = page.split('data-problem="square"')[1].split("</tr>")[0]
    assert square.count('class="tag wrong"') == 2
    problems = run_body.decode().split('id="problems"')[1].split("</table>")[0]
    assert problems.count('class="tag wrong"') == 1 and problems.count('class="tag correct"') == 1


def test_the_comparison_marks_a_run_short_of_problems_beside_a_finished_one(tmp_path: Path) -> None:
    # mult (17*23) is answered right, square (12*12, answered 145) wrong: over both, 50 %. The run "part" was stopped
    # before square began: it stands on mult alone, 100 %, which is no comparison with the finished run's 50 %.
    rules = [
        Rule(role="solution", pattern=r"17\*23", replies=["It is \\boxed{391}"]),
        Rule(role="solution", pattern=r"12\*12", replies=["It is \\boxed{145}"]),
    ]
    runs = tmp_path / "runs"
    for name in ("full", "part", "again"):
        model = ScriptedModel(SimScript(rules=rules), scripted_settings(method__name="cot"))
        asyncio.run(scripted_run(model, runs / name, PROBLEMS))
    with RunStore(runs / "part") as store:
        for table in ("results", "iterations"):
            store._db.execute(f"DELETE FROM {table} WHERE problem_id = 'square'")

    def compared(*names: str) -> str:
        refs = [run_ref_for([runs], runs / name) for name in names]
        with AppThread(view_app([runs])) as viewer:
            status, page = get(f"{viewer.url}/compare?" + "&".join(f"run={ref.key}" for ref in refs if ref))
        assert status == 200
        return page.decode()

    def cells(page: str, table: str) -> list[list[str]]:
        rows = page.split(f'id="{table}"')[1].split("</table>")[0].split("<tr")[2:]
        return [[cell.split(">", 1)[1].split("<")[0].strip() for cell in row.split("<td")[1:]] for row in rows]

    page = compared("full", "part")
    # The frontier's problems column, and the first budget's cell (the one point, It0, under every budget).
    assert [row[5] for row in cells(page, "frontier")] == ["2", "1 of 2"]
    assert [row[1] for row in cells(page, "equal-budget")] == ["50.0%", "100.0% (1 of 2 problems)"]
    note = page.split('id="short-runs">')[1].split("</p>")[0]
    assert " ".join(note.split()).startswith(
        "Not every run stands on every problem: part holds 2 problems (1 done, 1 pending)."
    )
    # Two finished runs stand on every problem: nothing to say.
    page = compared("full", "again")
    assert [row[5] for row in cells(page, "frontier")] == ["2", "2"]
    assert "short-runs" not in page and "of 2 problems" not in page


def test_a_run_given_twice_is_listed_once_where_it_came_first(tmp_path: Path) -> None:
    for name in ("a", "b"):
        RunStore(tmp_path / "runs" / name).close()
    listed = discover([tmp_path / "runs" / "b", tmp_path / "runs", tmp_path / "runs" / "." / "a"])
    assert [ref.path.name for ref in listed] == ["b", "a"]


def test_a_sweeps_directory_lists_the_runs_of_its_points(tmp_path: Path) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(p.model_dump_json() + "\n" for p in PROBLEMS))
    spec = SweepSpec(problems=str(problems), study=[Study(name="s", methods=["cot", "majority"], params={})])
    settings = scripted_settings()
    asyncio.run(run_sweep(spec, settings, tmp_path / "sweep", model=ScriptedModel(SimScript(), settings)))
    listed = discover([tmp_path / "sweep"])
    assert sorted(ref.path.name for ref in listed) == ["cot", "majority"]
    assert all(ref.path.parent == tmp_path / "sweep" / "runs" for ref in listed)


@pytest.mark.slow
def test_the_iteration_page_marks_the_candidate_the_method_selected(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tmas-demo"
    _tmas_run(run_dir, iterations=1)
    with RunStore(run_dir, read_only=True) as store:
        [record] = store.iterations("mult")
    assert record.selection is not None
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        _, page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
    text = page.decode()
    assert f"(candidate {record.selection.candidate})" in text
    cards = text.split('<div class="card candidate')[1:]
    marked = [i for i, card in enumerate(cards) if "the selected candidate" in card.split("</table>")[0]]
    assert marked == [record.selection.candidate]


def test_a_damaged_run_gets_a_page_saying_what_cannot_be_read(tmp_path: Path) -> None:
    import shutil
    import sqlite3

    runs = tmp_path / "runs"
    _scripted_run(runs / "good", _scripted({"mult": ["391"], "square": ["144"]}, 30), "cot", {})
    damage = {
        "bad-result": "UPDATE results SET record = '{'; UPDATE result_summaries SET summary = '{'",
        "no-calls": "DROP TABLE calls",
        "bad-meta": "UPDATE meta SET value = '{' WHERE key = 'method'",
        # Edited into a value that is no table: the runs page failed as a whole (an AttributeError).
        "meta-no-table": "UPDATE meta SET value = '5' WHERE key = 'settings'",
        # Written by a newer tmas: unreadable here for good, unlike a run whose store is being created.
        "newer": "UPDATE meta SET value = '99' WHERE key = 'schema_version'",
        "being-created": "DROP TABLE meta",
    }
    for name, sql in damage.items():
        shutil.copytree(runs / "good", runs / name)
        db = sqlite3.connect(runs / name / "run.sqlite")
        db.executescript(sql)
        db.close()
    # A file SQLite cannot read: cut short (a disk that filled, a copy stopped half-way), or overwritten. It stays
    # so, unlike a store being created: it was left off the runs page, as if there were no run, and its own pages said
    # its schema was None.
    shutil.copytree(runs / "good", runs / "cut-short")
    store_file = runs / "cut-short" / "run.sqlite"
    # Its first four pages, without its write-ahead log: the tables' root pages lie past them.
    assert store_file.stat().st_size > 8 * 4096
    store_file.write_bytes(store_file.read_bytes()[: 4 * 4096])
    for log in ("run.sqlite-wal", "run.sqlite-shm"):
        (runs / "cut-short" / log).unlink(missing_ok=True)
    shutil.copytree(runs / "good", runs / "overwritten")
    (runs / "overwritten" / "run.sqlite").write_bytes(b"\x00 not SQLite \xff" * 2048)
    with AppThread(view_app([runs])) as viewer:
        # The runs page lists the readable runs and says which cannot be read, instead of failing as a whole.
        status, index = get(viewer.url)
        text = index.decode()
        assert status == 200 and 'class="run-link"' in text
        unreadable = text.split('id="unreadable"')[1].split("</div>")[0]
        assert f"{runs / 'no-calls'} cannot be read: SQLite: no such table: calls" in unreadable
        assert f"{runs / 'bad-meta'} cannot be read: a stored setting is not JSON" in unreadable
        assert (
            f"{runs / 'meta-no-table'} cannot be read: a stored setting is not a table (&#39;settings&#39; holds 5)"
            in (unreadable)
        )
        assert f"{runs / 'newer'} cannot be read: store schema 99 is not one this tmas reads (1, 2, 3)" in unreadable
        assert f"{runs / 'cut-short'} cannot be read: not a readable run store (database disk image is malformed)" in (
            unreadable
        )
        assert f"{runs / 'overwritten'} cannot be read: not a readable run store (file is not a database)" in unreadable
        assert "being-created" not in text
        pages = {
            "bad-result": ("", "the summary of problem &#39;mult&#39;: not JSON"),
            "no-calls": ("/call/1", "SQLite: no such table: calls"),
            "bad-meta": ("", "a stored setting is not JSON"),
            "overwritten": ("/problem?id=mult", "not a readable run store (file is not a database)"),
            "newer": ("/call/1", "store schema 99 is not one this tmas reads (1, 2, 3)"),
        }
        for name, (path, says) in pages.items():
            ref = run_ref_for([runs], runs / name)
            assert ref is not None
            status, body = get(f"{viewer.url}/run/{ref.key}{path}")
            assert status == 500 and f"<p>the run {runs / name} cannot be read: {says}".encode() in body, body[-400:]
        good, bad = run_ref_for([runs], runs / "good"), run_ref_for([runs], runs / "bad-result")
        assert good is not None and bad is not None
        status, body = get(f"{viewer.url}/compare?run={good.key}&run={bad.key}")
        assert status == 500 and b"a run compared cannot be read: " in body and b"not JSON" in body


def test_a_mattrl_round_shows_the_specialist_that_did_not_speak(tmp_path: Path) -> None:
    """Round 1 of a MATTRL run in which S1's revision call fails: S1 did not speak, S2 and S3 had converged and were
    not asked; each candidate names the member that said it."""
    first_pass = "On a first pass, 17*23 = 391.\n\nTherefore, the final answer is \\boxed{391}."
    nitpick = json.dumps(
        {
            "analysis": "Right value, terse derivation.",
            "verdict": "revise",
            "validated": ["result"],
            "issues": [{"type": "logic_gap", "severity": "minor", "note": "Show the partial products.", "fix": "Add."}],
        }
    )
    revision = "<your_previous_attempt>.*You are Arithmetic strategist"
    rules = [
        Rule(role="specialist", pattern=revision, fault="http_400", times=1),
        Rule(role="specialist", pattern="You are Arithmetic strategist", replies=[first_pass], times=1),
        Rule(role="reviewer", pattern="On a first pass", replies=[nitpick], times=2),
    ]
    run_dir = tmp_path / "mattrl"
    _scripted_run(run_dir, SimScript(rules=rules), "mattrl", {"iterations": 3})
    with RunStore(run_dir, read_only=True) as store:
        second = store.iterations("mult")[1]
    assert [m["spoke"] for m in second.state["members"]] == [False, None, None]
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        _, first_page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
        _, page = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=1")
    members = page.decode().split('id="members"')[1].split("</table>")[0].split('<tr class="member">')[1:]
    said = [row.split("<td>")[2].split("</td>")[0] for row in members]
    assert [row.split("<td>")[1].split("</td>")[0] for row in members] == ["S1", "S2", "S3"]
    assert "did not speak" in said[0] and "not asked: converged before this round" in said[1] == said[2]
    assert [row.split("<td>")[5].split("</td>")[0] for row in members] == ["no", "yes", "yes"]
    assert "The team after round 1" in page.decode()
    # S1's failed opinion is in the transcript with no text: marked, not left as an empty cell.
    assert page.decode().count("no usable opinion (see the call)") == 1
    # Round 0: everyone spoke; each candidate names its member.
    text = first_page.decode()
    rows = text.split('id="members"')[1].split("</table>")[0].split('<tr class="member">')[1:]
    assert [row.split("<td>")[2].split("</td>")[0] for row in rows] == ["spoke"] * 3
    assert [
        card.split('<div class="member">')[1].split("</div>")[0] for card in text.split('class="card candidate')[1:]
    ] == [
        "by S1 (Arithmetic strategist)",
        "by S2 (Computation checker)",
        "by S3 (Edge-case auditor)",
    ]


class _BrokenVerifier(ScriptedModel):
    """A scripted model whose verifier calls raise an error no method expects (a bug): the problem fails."""

    async def chat(self, role: str, messages: Any, **kwargs: Any) -> Completion:
        if role == "verifier":
            raise RuntimeError("the verifier broke")
        return await super().chat(role, messages, **kwargs)


def test_a_problem_that_failed_before_an_iteration_finished_shows_the_calls_it_made(tmp_path: Path) -> None:
    """Iteration 0's two solutions come back (35 completion tokens each), then its verifications fail with an error no
    method expects: the problem fails with no iteration recorded, and its two calls are listed on its page, each
    linked."""
    run_dir = tmp_path / "spent"
    params = {"n": 2, "m": 1, "iterations": 3}
    usage = ScriptedUsage(prompt_tokens=50, completion_tokens=35)
    script = SimScript(rules=[Rule(role="solution", replies=[_solution("391")], usage=usage)])
    model = _BrokenVerifier(script, scripted_settings(method__name="tmas", method__params=params))
    asyncio.run(scripted_run(model, run_dir, PROBLEMS[:1]))
    with RunStore(run_dir, read_only=True) as store:
        [result] = store.results()
        calls = [c.call_id for c in store.calls("mult")]
    assert result.status == "failed" and not result.iterations and len(calls) == 2
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, page = get(f"{viewer.url}/run/{ref.key}/problem?id=mult")
        text = page.decode()
        assert status == 200 and "No iteration finished yet." in text
        table = text.split('id="unrecorded-calls"')[1].split("</table>")[0]
        rows = table.split("<tr>")[2:]
        assert [row.split('">#')[1].split("<")[0] for row in rows] == [str(c) for c in calls]
        cells = [[cell.split("<")[0] for cell in row.split('<td class="num">')[1:]] for row in rows]
        assert cells == [["0", "0", "50", "35"], ["0", "1", "50", "35"]]
        assert "RuntimeError: the verifier broke" in text.split("Calls of no recorded iteration")[1]
        assert all(get(f"{viewer.url}/run/{ref.key}/call/{c}")[0] == 200 for c in calls)


def test_listening_on_every_address_still_refuses_a_page_of_another_site(tmp_path: Path) -> None:
    """--host 0.0.0.0 is reached by any of the machine's addresses, loopback included: a page of another site whose
    domain resolves to 127.0.0.1 is still refused, by its name; a request by an IP address is answered."""
    from starlette.testclient import TestClient

    RunStore(tmp_path / "run").close()
    for host in ("0.0.0.0", "::"):
        client = TestClient(view_app([tmp_path], warm_up=False, host=host))
        for name, code in [
            ("attacker.example:8090", 421),
            ("localhost:8090", 200),
            ("192.168.1.5:8090", 200),
            ("[fe80::1]:8090", 200),
            ("[::1]", 200),
            ("", 421),
        ]:
            response = client.get("/", headers={"Host": name})
            assert response.status_code == code, (host, name, response.text[:200])
    # Listening on one name: that name and loopback only, not another address.
    client = TestClient(view_app([tmp_path], warm_up=False, host="10.0.0.7"))
    assert [client.get("/", headers={"Host": n}).status_code for n in ("10.0.0.7", "10.0.0.8", "127.0.0.1")] == [
        200,
        421,
        200,
    ]


def test_a_reply_cut_while_thinking_says_it_has_no_text(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        ids = []
        for sample, (content, reasoning, finish) in enumerate(
            [("", "Let me multiply 17 by 20 first", "length"), ("", "", "length"), ("17*23 = 391", "", "stop")]
        ):
            key = CallKey(problem_id="mult", iteration=0, role="solution", sample=sample)
            request = ChatRequest(model="m", messages=[user("What is 17*23?")], sampling=Sampling())
            usage = Usage(prompt_tokens=10, completion_tokens=64)
            reply = Completion(key=key, content=content, reasoning=reasoning, finish_reason=finish, usage=usage)
            ids.append(store.record_call(reply, request))
        cut = Candidate(index=0, text="", call_id=ids[0], finish_reason="length", usage=Usage(completion_tokens=64))
        store.save_iteration(IterationRecord(problem_id="mult", iteration=0, candidates=[cut], selected=None))
    with AppThread(view_app([run_dir])) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        pages = [get(f"{viewer.url}/run/{ref.key}/call/{i}") for i in ids]
        iteration = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
    assert [status for status, _ in pages] == [200, 200, 200] and iteration[0] == 200
    thinking, empty, answered = (body.decode() for _, body in pages)
    assert "(no reply text: cut while thinking)" in thinking and "Let me multiply 17 by 20 first" in thinking
    assert "(no reply text: cut at the token limit before any)" in empty and "cut while thinking" not in empty
    assert "no reply text" not in answered and "17*23 = 391" in answered
    assert "(no reply text: cut at the token limit before any;" in iteration[1].decode()


def _long_solutions(run_dir: Path, count: int = 16, tokens: int = 30_000) -> IterationRecord:
    """An iteration of ``count`` thinking-model solutions of ``tokens`` tokens each (slices of the simulator's
    reasoning corpus), one of them holding markup that must stay text."""
    from tmas.testing.long_replies import corpus

    text = corpus(count * tokens + 1, 0.78)
    candidates = []
    for i in range(count):
        first = i * tokens
        body = text.text[text.starts[first] : text.ends[first + tokens - 1]]
        hostile = "</pre><script>alert(1)</script> & " if i == 3 else ""
        candidates.append(
            Candidate(index=i, text=f"{hostile}{body}\n\nSo $\\boxed{{{380 + i}}}$.", answer=str(380 + i))
        )
    record = IterationRecord(problem_id="mult", iteration=0, candidates=candidates, selected="391")
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        store.save_iteration(record)
    return record


def _fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_an_iteration_of_long_solutions_carries_each_text_once_and_serves_raw_text_and_json(tmp_path: Path) -> None:
    """16 solutions of 30K tokens: the page holds each text once (rendered); the raw text of each and the whole
    record are at their own addresses, served as plain text and JSON."""
    run_dir = tmp_path / "run"
    record = _long_solutions(run_dir)
    texts = sum(len(c.text.encode()) for c in record.candidates)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        base = f"{viewer.url}/run/{ref.key}/iteration"
        status, page = get(f"{base}?id=mult&t=0")
        raw = [_fetch(f"{base}/text?id=mult&t=0&c={c.index}") for c in record.candidates]
        whole = _fetch(f"{base}/record.json?id=mult&t=0")
        bad = [_fetch(f"{base}/text?id=mult&t=0&c={c}")[0] for c in ("16", "x")]
        bad.append(_fetch(f"{base}/record.json?id=mult&t=1")[0])
    html = page.decode()
    assert status == 200 and len(page) < 1.3 * texts, (len(page), texts)
    for c in record.candidates:
        # The text itself, rendered, and a link to it as written.
        assert c.text[50_000:50_200] in html
        assert f'href="/run/{ref.key}/iteration/text?id=mult&amp;t=0&amp;c={c.index}"' in html
    assert "<script>alert(1)" not in html and "&lt;/pre&gt;&lt;script&gt;alert(1)" in html
    for (code, headers, body), c in zip(raw, record.candidates, strict=True):
        assert code == 200 and body.decode() == c.text
        assert headers["content-type"] == "text/plain; charset=utf-8"
        assert headers["x-content-type-options"] == "nosniff"
    code, headers, body = whole
    assert code == 200 and headers["content-type"].startswith("application/json")
    assert headers["x-content-type-options"] == "nosniff"
    assert json.loads(body) == record.model_dump(mode="json")
    assert f'href="/run/{ref.key}/iteration/record.json?id=mult&amp;t=0"' in html
    assert bad == [404, 400, 404]


@pytest.mark.slow
def test_in_chromium_a_long_solutions_raw_text_and_the_record_are_fetched_when_shown(
    tmp_path: Path, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    record = _long_solutions(run_dir, count=2, tokens=3_000)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        browser.get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
        raw = browser.find_elements(By.CSS_SELECTOR, ".candidate pre.raw")
        assert len(raw) == 2 and all(pre.get_attribute("textContent") == "" for pre in raw)
        browser.find_element(By.ID, "raw-text").click()
        browser.find_element(By.CSS_SELECTOR, ".candidate details summary").click()
        first = record.candidates[0].text
        wait_until(lambda: raw[0].get_attribute("textContent") == first, timeout=15, what="the raw text")
        assert raw[0].is_displayed() and raw[1].get_attribute("textContent") == ""  # still closed: not fetched
        browser.find_element(By.ID, "raw-text").click()
        browser.find_element(By.CSS_SELECTOR, "#record summary").click()
        pre = browser.find_element(By.CSS_SELECTOR, "#record pre")
        wait_until(lambda: pre.get_attribute("textContent").endswith("}"), timeout=15, what="the record")
    assert json.loads(pre.get_attribute("textContent")) == record.model_dump(mode="json")


def _long_call(
    run_dir: Path, tokens: int = 30_000, quoted: int = 0
) -> tuple[int, Completion, list[dict[str, str]], ProblemResult]:
    """One thinking-model call of a ``tokens``-token reply and as much reasoning, with markup that must stay text in
    the reply, the reasoning and the prompt; and the problem's result returning that reply. With ``quoted``, its user
    message quotes that many solutions of ``tokens`` tokens, each ending in its own answer (an aggregation prompt)."""
    from tmas.testing.long_replies import corpus

    text = corpus(2 * tokens + 1, 0.78)
    hostile = "</pre><script>alert(1)</script> & "
    reply = hostile + text.text[text.starts[0] : text.ends[tokens - 1]] + "\n\nSo $\\boxed{391}$."
    reasoning = hostile + text.text[text.starts[tokens] : text.ends[2 * tokens - 1]]
    solutions = "".join(f"\n\nSolution {i}:\n{hostile}{reasoning}\nSo {380 + i}." for i in range(1, quoted + 1))
    messages = [
        {"role": "system", "content": "Solve the problem. " + hostile},
        {"role": "user", "content": "What is 17*23?" + solutions},
    ]
    key = CallKey(problem_id="mult", iteration=0, role="solution", sample=0)
    request = ChatRequest(model="m", messages=messages, sampling=Sampling())
    usage = Usage(prompt_tokens=20, completion_tokens=2 * tokens, reasoning_tokens=tokens)
    completion = Completion(key=key, content=reply, reasoning=reasoning, finish_reason="stop", usage=usage)
    result = ProblemResult(problem_id="mult", method="cot", answer="391", text=reply)
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        call_id = store.record_call(completion, request)
        store.save_result(result)
    return call_id, completion, messages, result


def test_a_call_of_a_long_reply_and_reasoning_carries_each_text_once_and_serves_each_as_plain_text(
    tmp_path: Path,
) -> None:
    """A call of a 30K-token reply and 30K tokens of reasoning: the page holds the reply once (rendered) and leaves
    the reasoning to its fold; the reply, the reasoning, each prompt message and the problem's returned solution are
    served as they are, as plain text."""
    run_dir = tmp_path / "run"
    call_id, call, messages, result = _long_call(run_dir)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        base = f"{viewer.url}/run/{ref.key}"
        status, page = get(f"{base}/call/{call_id}")
        problem_status, problem_page = get(f"{base}/problem?id=mult")
        texts = {
            "content": _fetch(f"{base}/call/{call_id}/content"),
            "reasoning": _fetch(f"{base}/call/{call_id}/reasoning"),
            "message 0": _fetch(f"{base}/call/{call_id}/message/0"),
            "message 1": _fetch(f"{base}/call/{call_id}/message/1"),
            "solution": _fetch(f"{base}/problem/solution?id=mult"),
        }
        bad = [
            _fetch(f"{base}/call/{call_id + 1}/content")[0],
            _fetch(f"{base}/call/{2**64}/reasoning")[0],
            _fetch(f"{base}/call/{call_id}/message/2")[0],
            _fetch(f"{base}/call/x/content")[0],
            _fetch(f"{base}/problem/solution?id=square")[0],
            _fetch(f"{base}/problem/solution?id=nope")[0],
        ]
    html, problem_html = page.decode(), problem_page.decode()
    reply = len(call.content.encode())
    assert status == 200 and len(page) < 1.3 * reply, (len(page), reply, len(call.reasoning.encode()))
    assert problem_status == 200 and len(problem_page) < 1.3 * reply, (len(problem_page), reply)
    assert call.content[50_000:50_200] in html and call.content[50_000:50_200] in problem_html
    assert call.reasoning[50_000:50_200] not in html
    for name in ("content", "reasoning", "message/0", "message/1"):
        assert f'href="/run/{ref.key}/call/{call_id}/{name}"' in html, name
    assert f'href="/run/{ref.key}/problem/solution?id=mult"' in problem_html
    for markup in (html, problem_html):
        assert "<script>alert(1)" not in markup and "&lt;/pre&gt;&lt;script&gt;alert(1)" in markup
    expected = {
        "content": call.content,
        "reasoning": call.reasoning,
        "message 0": messages[0]["content"],
        "message 1": messages[1]["content"],
        "solution": result.text,
    }
    for name, (code, headers, body) in texts.items():
        assert code == 200 and body.decode() == expected[name], name
        assert headers["content-type"] == "text/plain; charset=utf-8", name
        assert headers["x-content-type-options"] == "nosniff", name
    assert bad == [404, 404, 404, 404, 404, 404]


def test_a_call_of_a_long_prompt_carries_the_head_of_the_message_and_serves_it_whole(tmp_path: Path) -> None:
    """An aggregation prompt quoting 16 solutions of 30K tokens (over 2 MB): the call page carries its first
    MESSAGE_HEAD_CHARS characters and the address of the whole, which serves it exactly; short messages stay whole."""
    from markupsafe import escape

    from tmas.view.app import MESSAGE_HEAD_CHARS

    run_dir = tmp_path / "run"
    call_id, call, messages, _ = _long_call(run_dir, quoted=16)
    prompt = messages[1]["content"]
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        base = f"{viewer.url}/run/{ref.key}/call/{call_id}"
        status, page = get(base)
        whole = _fetch(f"{base}/message/1")
    html, size = page.decode(), len(prompt.encode())
    # The page is the reply (rendered once) and the rest of the page; the prompt's 2 MB are not in it.
    assert size > 2_000_000 and status == 200 and len(page) < 1.3 * len(call.content.encode()), (len(page), size)
    assert str(escape(prompt[:MESSAGE_HEAD_CHARS])) in html and "Solution 2:" not in html
    assert f"… {len(prompt) - MESSAGE_HEAD_CHARS:,} more characters" in html
    assert f'<pre data-src="/run/{ref.key}/call/{call_id}/message/1"></pre>' in html
    assert str(escape(messages[0]["content"])) in html  # the short system message, whole
    assert "<script>alert(1)" not in html
    code, headers, body = whole
    assert code == 200 and body.decode() == prompt
    assert headers["content-type"] == "text/plain; charset=utf-8" and headers["x-content-type-options"] == "nosniff"


@pytest.mark.slow
def test_in_chromium_a_calls_long_reasoning_and_raw_reply_are_fetched_when_shown(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    call_id, call, messages, _ = _long_call(run_dir, tokens=3_000, quoted=2)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        browser.get(f"{viewer.url}/run/{ref.key}/call/{call_id}")
        reasoning = browser.find_element(By.CSS_SELECTOR, "#reasoning pre")
        raw = browser.find_element(By.CSS_SELECTOR, "#reply pre.raw")
        assert reasoning.get_attribute("textContent") == raw.get_attribute("textContent") == ""
        browser.execute_script("document.getElementById('reasoning').open = true")
        wait_until(lambda: reasoning.get_attribute("textContent") == call.reasoning, timeout=15, what="the reasoning")
        assert raw.get_attribute("textContent") == ""  # raw text off: not fetched
        browser.find_element(By.ID, "raw-text").click()
        wait_until(lambda: raw.get_attribute("textContent") == call.content, timeout=15, what="the raw reply")
        # The markup in both stayed text: no element made of it.
        assert raw.is_displayed() and call.content.startswith("</pre><script>")
        assert browser.find_elements(By.CSS_SELECTOR, "#request script, #reply script") == []
        # The long prompt message: its head shown, the whole fetched when its fold opens, as text.
        head = browser.find_element(By.CSS_SELECTOR, "#request pre.head")
        assert messages[1]["content"].startswith(head.get_attribute("textContent"))
        whole = browser.find_element(By.CSS_SELECTOR, "#request details.whole pre")
        assert whole.get_attribute("textContent") == ""
        browser.execute_script("document.querySelector('#request details.whole').open = true")
        wait_until(lambda: whole.get_attribute("textContent") == messages[1]["content"], timeout=60, what="the message")
        assert browser.find_elements(By.CSS_SELECTOR, "#request script") == []


def test_a_calls_failed_attempts_and_why_it_failed_or_stopped_show_with_it(tmp_path: Path) -> None:
    # A run on the simulated server: 17*23 is refused with a 503 twice and answered on the third attempt; 12*12 is a
    # 400, not retried, and its problem fails. The store keeps each call's failed attempts' causes and its own; the
    # call page said "3 attempt(s)" and the error text, never why the attempts failed nor the cause it was counted by.
    from conftest import settings_for
    from tmas.runner import prepare_run, run_problems

    run_dir = tmp_path / "run"
    rules = [
        Rule(pattern=r"17\*23", fault="http_503", times=2),
        Rule(pattern=r"17\*23", replies=["So \\boxed{391}"]),
        Rule(pattern=r"12\*12", fault="http_400"),
    ]

    async def run(sim: SimServer) -> None:
        store, settings, todo = prepare_run(run_dir, settings_for(sim, method__name="cot"), PROBLEMS, resume=False)
        with store:
            await run_problems(settings, todo, store)

    with SimServer(SimScript(rules=rules)) as sim:
        asyncio.run(run(sim))
    with RunStore(run_dir, read_only=True) as store:
        calls = {c.key.problem_id: c for c in store.calls()}
    answered, refused = calls["mult"], calls["square"]
    assert (answered.attempts, answered.retry_causes, answered.error) == (3, ["http_503", "http_503"], None)
    assert (refused.attempts, refused.error_cause) == (1, "http_400")
    # A reply the caller's watch stopped, sent with max_tokens lowered to fit the context window after an attempt
    # that timed out, of an iteration not recorded yet.
    with RunStore(run_dir) as store:
        key = CallKey(problem_id="mult", iteration=5, role="solution")
        request = ChatRequest(model="m", messages=[user("What is 17*23?")], sampling=Sampling(max_tokens=4096))
        watched = Completion(
            key=key,
            content="Let me see",
            finish_reason="stop",
            max_tokens_sent=1000,
            stopped_early="confidence fell below the threshold",
            attempts=2,
            retry_causes=["timeout"],
            usage=Usage(prompt_tokens=30, completion_tokens=3, cached_prompt_tokens=16),
        )
        watched_id = store.record_call(watched, request)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        base = f"{viewer.url}/run/{ref.key}"
        pages = [get(f"{base}/call/{c}")[1].decode() for c in (answered.call_id, refused.call_id, watched_id)]
        iteration = get(f"{base}/iteration?id=mult&t=0")[1].decode()
        problem = get(f"{base}/problem?id=mult")[1].decode()
    facts = [page.split('id="call-facts"')[1].split("</table>")[0] for page in pages]
    assert '<span id="retry-causes">2 failed and retried: http_503, http_503</span>' in facts[0]
    assert "error-cause" not in facts[0] and "retry-causes" not in facts[1]
    assert '<span id="error-cause">cause: http_400</span>' in facts[1]
    assert '<span id="stopped-early">stopped early: confidence fell below the threshold</span>' in facts[2]
    assert '<span id="max-tokens-sent">max_tokens sent: 1000 (lowered to fit the context window)</span>' in facts[2]
    assert "30 prompt (16 cached), 3 completion" in facts[2] and "1 failed and retried: timeout" in facts[2]
    assert "stopped-early" not in facts[0] + facts[1] and "max-tokens-sent" not in facts[0] + facts[1]
    # The calls tables say which call was answered only after failed attempts, and after which.
    row = iteration.split('id="calls"')[1].split("</table>")[0]
    assert '<span class="muted retried">(answered after 2 failed attempts: http_503, http_503)</span>' in row
    unrecorded = problem.split('id="unrecorded-calls"')[1].split("</table>")[0]
    assert '<span class="muted retried">(answered after 1 failed attempt: timeout)</span>' in unrecorded


def test_a_problem_being_solved_shows_its_cost_and_which_failed_call_was_asked_again(tmp_path: Path) -> None:
    # Iteration 0's solution failed with a 503; a resume asked it again and it was answered; the verifier then failed
    # and the problem stopped again before iteration 0 was recorded. The problem page listed two failed calls
    # without saying which was asked again (and so is no failure of the run), as the iteration page says it; and
    # while the problem has no result (still being solved), it said nothing of what it had spent.
    run_dir = tmp_path / "run"
    request = ChatRequest(model="m", messages=[user("What is 17*23?")], sampling=Sampling())
    check = ChatRequest(model="m", messages=[user("Check: 17*23 = 391")], sampling=Sampling())
    solution = CallKey(problem_id="mult", iteration=0, role="solution")
    verifier = CallKey(problem_id="mult", iteration=0, role="verifier")
    failed = {"error": "HTTP 503", "error_cause": "http_503"}
    with RunStore(run_dir) as store:
        store.add_problems(PROBLEMS[:1])
        ids = [
            store.record_call(Completion(key=solution, request_hash="s", **failed), request),
            store.record_call(Completion(key=solution, request_hash="s", content="So 391."), request),
            store.record_call(Completion(key=verifier, request_hash="v", **failed), check),
        ]
        assert store.asked_again_calls("mult") == {ids[0]}
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/problem?id=mult")
    page = body.decode()
    spent = '<span id="spent">3 calls (1 failed, 1 failed, then asked again) · 0 prompt + completion tokens</span>'
    assert status == 200 and 'class="tag running">in progress</span>' in page and spent in page
    rows = page.split('id="unrecorded-calls"')[1].split("</table>")[0].split("<tr>")[2:]
    marked = ["(then asked again on resume)" in row for row in rows]
    assert [f"#{i}<" in row for i, row in zip(ids, rows, strict=True)] == [True] * 3 and marked == [True, False, False]
