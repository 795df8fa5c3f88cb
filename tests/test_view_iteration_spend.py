"""The viewer's iteration page counts an iteration's calls and tokens as the report's per-iteration table does."""

from __future__ import annotations

from pathlib import Path

from tmas.config import Sampling
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.methods.base import Candidate, IterationRecord, ProblemResult
from tmas.problems import Problem
from tmas.reports.metrics import run_spend, spent_in
from tmas.store.run_store import RunStore
from tmas.view.app import view_app
from web_helpers import AppThread, get, run_ref_for


def test_an_iteration_page_counts_a_call_asked_again_on_resume_as_the_report_does(tmp_path: Path) -> None:
    # Iteration 0's solution failed after generating 5 tokens; a resume asked it again and it was answered. The
    # iteration's record holds the pass that finished it (1 call); the report's table counts both calls, and the page
    # said the failed one was "not in this iteration's 1" calls.
    run_dir = tmp_path / "run"
    request = ChatRequest(model="m", messages=[user("What is 17*23?")], sampling=Sampling())
    key = CallKey(problem_id="mult", iteration=0, role="solution")
    answered = Usage(prompt_tokens=12, completion_tokens=7)
    with RunStore(run_dir) as store:
        store.add_problems([Problem(problem_id="mult", question="What is 17*23?", answer="391")])
        failed = Completion(key=key, request_hash="s", error="HTTP 503", usage=Usage(completion_tokens=5))
        store.record_call(failed, request)
        store.record_call(Completion(key=key, request_hash="s", content="\\boxed{391}", usage=answered), request)
        candidate = Candidate(index=0, text="\\boxed{391}", answer="391", usage=answered)
        record = IterationRecord(
            problem_id="mult", iteration=0, candidates=[candidate], selected="391", calls=1, usage=answered
        )
        result = ProblemResult(problem_id="mult", method="cot", answer="391", iterations=[record])
        store.save_result(result)
        calls, usage = spent_in([result], 0, run_spend(store))
    assert (calls, usage.prompt_tokens, usage.completion_tokens) == (2, 12, 12)
    with AppThread(view_app([run_dir], warm_up=False)) as viewer:
        ref = run_ref_for([run_dir], run_dir)
        assert ref is not None
        status, body = get(f"{viewer.url}/run/{ref.key}/iteration?id=mult&t=0")
    page = body.decode()
    assert status == 200
    assert '<span id="iteration-spend">2 calls · 12 prompt + 12 completion tokens</span>' in page
    note = page.split('id="asked-again-note">')[1].split("</p>")[0]
    assert "counts in this iteration's 2 calls and their tokens" in note and "not in" not in note
