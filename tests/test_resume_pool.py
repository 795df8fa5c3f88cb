"""A MATTRL run records the content of the experience pool it retrieves from; a resume after the pool was rebuilt,
added to or pruned is refused in one line while a finished problem would keep what it retrieved from the old pool
(the run would otherwise hold results of two pools). The same pool, or one whose lifecycle counters alone changed,
resumes as before, and a run stored before the record resumes with a notice."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.errors import InputError
from tmas.memory.embedders import LOCAL_NAME, EndpointEmbedder
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.problems import Problem
from tmas.runner import RunSetup
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript

PROBLEMS = [
    Problem(problem_id="p0", question="What is 17*23?", answer="391"),
    Problem(problem_id="p1", question="What is 12*12?", answer="144"),
]
ENTRIES = [
    ("Split a factor", "Write 17*23 as 17*20 + 17*3."),
    ("Square by parts", "12*12 is 10*12 + 2*12."),
    ("Check the units digit", "The product's last digit is that of the last digits' product."),
]


async def make_pool(path: Path) -> None:
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(path, embed.name)
    await pool.add([PoolEntry(id=f"e{i}", action=a, experience=e) for i, (a, e) in enumerate(ENTRIES)], embed)
    pool.save()


def model_for(pool: Path) -> ScriptedModel:
    params = {"iterations": 1, "team_size": 2, "pool": str(pool), "top_k": 2}
    return ScriptedModel(SimScript(), scripted_settings(method={"name": "mattrl", "params": params}))


def stopped_before_p1(run_dir: Path) -> None:
    """The run as a stop leaves it when p0 had finished and p1 had not begun."""
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results WHERE problem_id = 'p1'")
        db.execute("DELETE FROM calls WHERE problem_id = 'p1'")


def asked_about(model: ScriptedModel, question: str) -> int:
    return sum(any(question in m.content for m in call.messages) for call in model.calls)


def _pool_changed(run_dir: Path, pool_path: Path) -> str:
    """The one line refusing a resume of ``run_dir`` whose pool changed since its start."""
    return (
        f"{run_dir}: 1 finished problem was solved with pool={pool_path} as it was at the run's start; it has changed"
        " since (rebuilt, added to or pruned): resumed so, what finished would stay of the old pool and the rest get"
        " the new one's; start a new run on it, or resume with the pool as it was"
    )


def _assert_nothing_sent(model: ScriptedModel, run_dir: Path) -> None:
    """No call or embedding went out, and the run keeps what it had finished (p0)."""
    assert model.calls == [] and model.embedded == []
    with RunStore(run_dir, read_only=True) as store:
        assert [r.problem_id for r in store.results()] == ["p0"]


@pytest.fixture
async def stopped_run(tmp_path: Path) -> tuple[Path, Path]:
    pool = tmp_path / "pool"
    await make_pool(pool)
    run_dir = tmp_path / "run"
    await scripted_run(model_for(pool), run_dir, PROBLEMS)
    stopped_before_p1(run_dir)
    return run_dir, pool


@pytest.mark.parametrize("change", ["prune", "add"])
async def test_a_resume_after_the_pool_changed_is_refused_in_one_line(
    stopped_run: tuple[Path, Path], change: str
) -> None:
    run_dir, pool_path = stopped_run
    pool = Pool.open(pool_path)
    if change == "prune":
        pool.remove(["e2"])
    else:
        embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
        await pool.add([PoolEntry(id="e9", action="Halve and double", experience="17*24 is 34*12.")], embed)
    pool.save()
    model = model_for(pool_path)
    with pytest.raises(InputError) as refused:
        await scripted_run(model, run_dir)
    assert str(refused.value) == _pool_changed(run_dir, pool_path)
    _assert_nothing_sent(model, run_dir)


async def test_the_same_pool_resumes_and_sends_nothing_twice(stopped_run: tuple[Path, Path]) -> None:
    run_dir, pool_path = stopped_run
    # A prune's lifecycle counters, saved as a new version: nothing a retrieval reads changed.
    pool = Pool.open(pool_path)
    pool.update([e.model_copy(update={"retrieved": 3, "retrieved_wrong": 1}) for e in pool.entries])
    pool.save()
    model = model_for(pool_path)
    summary = await scripted_run(model, run_dir)
    assert (summary.done, summary.skipped, summary.failed) == (2, 1, 0)
    assert asked_about(model, "What is 17*23?") == 0 and asked_about(model, "What is 12*12?") == len(model.calls) > 0
    with RunStore(run_dir, read_only=True) as store:
        assert sorted(r.problem_id for r in store.results()) == ["p0", "p1"]
        assert "inputs_unrecorded" not in (store.get_meta("notices") or {})


async def test_a_run_that_recorded_no_pool_resumes_with_a_notice(stopped_run: tuple[Path, Path]) -> None:
    run_dir, pool_path = stopped_run
    with sqlite3.connect(run_dir / "run.sqlite") as db:  # as an earlier version stored it
        db.execute("DELETE FROM meta WHERE key = 'method_inputs'")
    pool = Pool.open(pool_path)
    pool.remove(["e2"])
    pool.save()
    model = model_for(pool_path)
    await scripted_run(model, run_dir)
    assert asked_about(model, "What is 17*23?") == 0
    with RunStore(run_dir, read_only=True) as store:
        assert sorted(r.problem_id for r in store.results()) == ["p0", "p1"]
        assert store.notices()["inputs_unrecorded"] == (
            f"pool={pool_path}: the run recorded no identity of it at its start (an earlier version of tmas), so this"
            " resume cannot tell whether it changed since: problems finished before keep what they read then"
        )
        # Recorded now: a later resume compares with the pool this one read.
        assert store.get_meta("method_inputs") == {f"pool={pool_path}": Pool.open(pool_path).content_digest()}


async def _rebuild_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> list[str]:
    """A build that saves the pool a run names just after the run's ``step`` (a method of :class:`RunSetup`) and
    before the run's first retrieval: its entries replaced by one new one. The digests it saved."""
    other = tmp_path / "other"
    embed = EndpointEmbedder(ScriptedModel(settings=scripted_settings()))
    pool = Pool.create(other, embed.name)
    await pool.add([PoolEntry(id="e9", action="Halve and double", experience="17*24 is 34*12.")], embed)
    pool.save()
    saved: list[str] = []
    done = getattr(RunSetup, step)

    def then_rebuild(self: RunSetup, *args: Any) -> Any:
        out = done(self, *args)
        if not saved:
            rebuilt = Pool.open(other)
            rebuilt.path = Path(self.settings.method.params["pool"])
            rebuilt.save()
            saved.append(rebuilt.content_digest())
        return out

    monkeypatch.setattr(RunSetup, step, then_rebuild)
    return saved


@pytest.fixture
async def rebuilt_after_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The pool rebuilt just after a new run recorded its setup (the pool's digest among it)."""
    return await _rebuild_after(tmp_path, monkeypatch, "record")


@pytest.fixture
async def rebuilt_after_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The pool rebuilt just after a resume checked it against the run's record."""
    return await _rebuild_after(tmp_path, monkeypatch, "check_resume")


async def test_a_pool_saved_after_the_run_started_is_the_one_recorded_and_read(
    tmp_path: Path, rebuilt_after_record: list[str]
) -> None:
    pool = tmp_path / "pool"
    await make_pool(pool)
    old = Pool.open(pool).content_digest()
    run_dir = tmp_path / "run"
    model = model_for(pool)
    await scripted_run(model, run_dir, PROBLEMS)
    [new] = rebuilt_after_record
    assert new != old
    # The run read the rebuilt pool, and its record names that content: the one a resume compares with.
    assert asked_about(model, "Halve and double") > 0 and asked_about(model, "Split a factor") == 0
    with RunStore(run_dir, read_only=True) as store:
        assert store.get_meta("method_inputs") == {f"pool={pool}": new}


async def test_a_resume_refuses_a_pool_saved_after_its_check(
    stopped_run: tuple[Path, Path], rebuilt_after_check: list[str]
) -> None:
    run_dir, pool_path = stopped_run
    recorded = Pool.open(pool_path).content_digest()
    model = model_for(pool_path)
    with pytest.raises(InputError) as refused:
        await scripted_run(model, run_dir)
    assert rebuilt_after_check and str(refused.value) == _pool_changed(run_dir, pool_path)
    _assert_nothing_sent(model, run_dir)
    with RunStore(run_dir, read_only=True) as store:  # still the pool the run read
        assert store.get_meta("method_inputs") == {f"pool={pool_path}": recorded}


async def test_a_run_on_a_pool_of_another_embedding_model_is_refused_before_any_call(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    Pool.create(pool, "endpoint:other-embedder")
    run_dir = tmp_path / "run"
    model = model_for(pool)
    with pytest.raises(InputError) as refused:
        await scripted_run(model, run_dir, PROBLEMS)
    assert str(refused.value) == (
        f"{pool}: pool built with embedding model 'endpoint:other-embedder', "
        "but the embedding role now gets 'endpoint:sim-model'"
    )
    assert model.calls == [] and model.embedded == []
    with RunStore(run_dir, read_only=True) as store:
        assert store.results() == []


async def test_a_run_reads_its_pool_once_at_its_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, a new run read the whole pool (entries and vectors) twice before its first call: for the record of its
    # setup, then for the run; a resume that had finished no problem did so too.
    pool = tmp_path / "pool"
    await make_pool(pool)
    opened: list[Path] = []
    open_pool = Pool.open

    def counted(cls: type[Pool], path: str | Path, embedder_name: str | None = None) -> Pool:
        opened.append(Path(path))
        return open_pool(path, embedder_name)

    monkeypatch.setattr(Pool, "open", classmethod(counted))
    run_dir = tmp_path / "run"
    await scripted_run(model_for(pool), run_dir, PROBLEMS)
    assert opened == [pool]
    with RunStore(run_dir, read_only=True) as store:
        assert store.get_meta("method_inputs") == {f"pool={pool}": Pool.open(pool).content_digest()}
    stopped_before_p1(run_dir)
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        db.execute("DELETE FROM results")
    opened.clear()
    await scripted_run(model_for(pool), run_dir)
    assert opened == [pool]


def test_a_run_on_the_local_embedder_records_it_as_its_embedding_model(tmp_path: Path) -> None:
    params = {"iterations": 1, "team_size": 2, "pool": str(tmp_path / "pool"), "embedder": "local"}
    before = scripted_settings(method={"name": "mattrl", "params": params})
    after = scripted_settings(method={"name": "mattrl", "params": params}, roles={"embedding": {"model": "other"}})
    asked = [RunSetup.check(s).requests(s, {}) for s in (before, after)]
    # The endpoint's embedding model sends nothing on the local embedder: it is neither named nor a change.
    assert asked[0]["embedding model"] == asked[1]["embedding model"] == LOCAL_NAME
