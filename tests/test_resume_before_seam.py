"""A run directory made before the ChatModel seam (and with it sampling resolved once with its sources, and prompt
overrides) resumes: every finished call replays from the store (the request hashes did not change) and new calls
send the sampling the old code sent.

``data/pre_seam_tmas_run.sql`` is the SQL dump of a run made by tmas at commit 6484367 on the simulated server:
TMAS with the ``local`` preset (N = 2, M = 1, T = 1), ``[sampling] temperature = 0.7`` (equal to the built-in
default, so the old code sent the preset's temperatures), ``top_p = 0.9``, ``[roles.verifier.sampling] max_tokens =
111`` and ``--max-tokens 500``. Its store has no ``sampling_sources`` column and its settings no sources.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tmas.cli.main import app
from tmas.store.run_store import RunStore
from tmas.testing import SimServer

DUMP = Path(__file__).parent / "data" / "pre_seam_tmas_run.sql"
# What the old code sent per role: (temperature, top_p, max_tokens).
OLD_SAMPLING = {
    "solution": (0.3, 0.9, 500),
    "verifier": (0.3, 0.9, 111),
    "summary": (0.2, 0.9, 500),
    "experience": (0.2, 0.9, 500),
    "guideline": (0.2, 0.9, 500),
}


def old_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.executescript(DUMP.read_text(encoding="utf-8"))
    # Unfinish the problem: a resume must then solve it again, from the stored calls alone.
    db.execute("DELETE FROM results")
    db.commit()
    db.close()
    return run_dir


@pytest.mark.usefixtures("isolated")
def test_a_run_made_before_the_change_replays_every_call_and_extends_with_the_old_sampling(
    sim: SimServer, tmp_path: Path
) -> None:
    run_dir = old_run(tmp_path)
    with RunStore(run_dir, create=False) as store:
        before = [(c.key.role, c.request_hash, c.content) for c in store.calls()]
    assert len(before) == 8
    cli = CliRunner()
    out = cli.invoke(app, ["run", "--resume", str(run_dir), "--base-url", sim.base_url])
    assert out.exit_code == 0, out.output
    assert [r for r in sim.requests if r.endpoint == "chat"] == []  # all 8 calls replayed
    with RunStore(run_dir, create=False) as store:
        assert [(c.key.role, c.request_hash, c.content) for c in store.calls()] == before
        [result] = store.results()
        assert result.answer == "391" and result.status == "done"
    # One more iteration: new calls, with what the old code sent each role (its summaries and memory updates too).
    # The local preset now stops a settled problem after iteration 0, as this one is: extend it without the stop.
    more = ["-T", "2", "-p", "skip_final_memory=false", "-p", "early_stop=false"]
    out = cli.invoke(app, ["run", "--resume", str(run_dir), "--base-url", sim.base_url, *more])
    assert out.exit_code == 0, out.output
    chats = [r for r in sim.requests if r.endpoint == "chat"]
    assert {r.role for r in chats} == set(OLD_SAMPLING)
    for r in chats:
        assert (r.body["temperature"], r.body["top_p"], r.body["max_tokens"]) == OLD_SAMPLING[r.role], r.role
    with RunStore(run_dir, create=False) as store:
        new = [c for c in store.calls() if c.key.iteration == 1]
        assert len(new) == 8
        assert all(c.call_id is not None and store.call_sampling_sources(c.call_id) for c in new)
        assert store.call_sampling_sources(1) is None  # the old rows keep no sources
