"""The comparison's device script (benchmarks/comparison_device.py): its runs in their order, at most eight files
brought back, and its section put into a docs page in place of the last one."""

from __future__ import annotations

import argparse
import asyncio
import json
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("comparison_device", monkeypatch)


def test_the_runs_go_most_important_first(device: ModuleType) -> None:
    names = [s.name for s in device.studies(argparse.Namespace(k=16))]
    assert names == [
        "majority",
        "tmas-local",
        "tmas-n4-m2",
        "verify-refine",
        "majority-beta",
        "self-refine",
        "pacore",
        "rse",
        "mattrl",
    ]
    first = device.studies(argparse.Namespace(k=16))[0]
    assert (first.method, first.params["k"], first.width) == ("majority", 16, 16)


def test_nine_runs_come_back_in_seven_archives_beside_the_summary(device: ModuleType, tmp_path: Path) -> None:
    args = argparse.Namespace(work=tmp_path / "work", out=tmp_path / "out")
    names = [f"run{i}" for i in range(1, 10)]
    for i, name in enumerate(names):
        folder = tmp_path / "work" / "runs" / name
        folder.mkdir(parents=True)
        (folder / "run.sqlite").write_text(name)
        record: dict[str, object] = {}
        device.archive(args, folder, i, record)
        assert record["archive"] == f"runs-{min(i + 1, 7)}.tar.xz"
    device.write_summary(args, {"runs": []})
    files = sorted(p.name for p in args.out.iterdir())
    assert files == [*(f"runs-{i}.tar.xz" for i in range(1, 8)), "summary.json"]
    with tarfile.open(args.out / "runs-7.tar.xz", "r:xz") as tar:
        assert {m.name for m in tar.getmembers() if m.isfile()} == {f"{n}/run.sqlite" for n in ("run7", "run8", "run9")}


def test_the_section_goes_before_the_cpu_point_then_replaces_itself(device: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nIntro.\n\n## A small CPU data point\n\nText.\n", encoding="utf-8")
    first = f"{device.SECTION_START}\n## On a GPU\n\nOne.\n{device.SECTION_END}\n"
    device.into_docs(page, first)
    assert page.read_text() == f"# Results\n\nIntro.\n\n{first}\n## A small CPU data point\n\nText.\n"
    second = f"{device.SECTION_START}\n## On a GPU\n\nTwo.\n{device.SECTION_END}\n"
    device.into_docs(page, second)
    assert page.read_text() == f"# Results\n\nIntro.\n\n{second}\n## A small CPU data point\n\nText.\n"


def test_the_section_pairs_each_run_with_majority_names_its_downgrades_and_shows_its_speed(device: ModuleType) -> None:
    # Worked by hand: the majority run's MV@1 costs 50 tokens a problem, MV@2 100 (p1 right, p2 wrong); TMAS spends
    # 120 and 80 (mean 100), so it pairs with MV@2: differences 0 and +1, mean +0.5, SE stdev(0, 1) / sqrt(2) = 0.5.
    mv1 = {"p1": (1.0, 50.0), "p2": (0.0, 50.0)}
    mv2 = {"p1": (1.0, 100.0), "p2": (0.0, 100.0)}
    majority = device.Evaluated("majority", "majority", mv2, [], {1: mv1, 2: mv2}, "done")
    tmas = device.Evaluated("tmas-local", "tmas", {"p1": (1.0, 120.0), "p2": (1.0, 80.0)}, [], {}, "cut at its time")
    cut = device.Evaluated("mattrl", "mattrl", {}, [], {}, "not run: out of time")
    # A run that also answered p3, which majority vote did not: paired over p1 alone. It spends 60 there: MV@1 (50)
    # is nearest; difference 1 - 1 = 0, SE 0. Its own figures stand on both: accuracy (1 + 0) / 2 = 50%, SE
    # stdev(1, 0) / sqrt(2) = 50%, tokens (60 + 40) / 2 = 50.
    wider = device.Evaluated("cot", "cot", {"p1": (1.0, 60.0), "p3": (0.0, 40.0)}, [], {}, "done")
    why = "the in-process engine follows no schema: llguidance is not installed; its calls went on as plain text"
    summary = {
        "model": "m",
        "problems": 2,
        "options": {"throughput_tokens": 256},
        "runs": [
            {"name": "majority", "downgrades": {}},
            {"name": "tmas-local", "downgrades": {"structured_output": {"in-process": why}}},
            {"name": "mattrl", "status": "not run: out of time"},
        ],
        "throughput": [
            {"backend": "in-process", "concurrency": 64, "generated_tokens": 16384, "cut": 64, "wall_s": 2.0},
            {"backend": "padded generate", "concurrency": 64, "generated_tokens": 15000, "cut": 50, "wall_s": 7.5},
        ],
    }
    for row in summary["throughput"]:
        row |= {"failed": 0, "tokens_per_s": row["generated_tokens"] / row["wall_s"]}
    lines = device.section([majority, tmas, cut, wider], summary, "plot.png", "cmd").splitlines()
    assert "| majority | done | 2 | 50.0% (± 50.0%) | 100 | - | - |" in lines
    assert "| tmas-local | cut at its time | 2 | 100.0% (± 0.0%) | 100 | MV@2 (100) | +50.0 (± 50.0) |" in lines
    assert "| mattrl | not run: out of time | 0 | - | - | - | - |" in lines
    assert "| cot | done | 2 | 50.0% (± 50.0%) | 50 | MV@1 (50), over 1 of 2 problems | +0.0 (± 0.0) |" in lines
    assert lines[lines.index(f"- tmas-local: {why}") - 2].startswith("Runs whose JSON replies went as plain text")
    assert "| accuracy | 50.0% | 50.0% |" in lines and "| tokens | 50 | 100 |" in lines
    assert any("CoT prompt, up to 256 tokens, all of them at once" in line for line in lines)
    # 16,384 tokens in 2 s and 15,000 in 7.5 s.
    assert "| in-process | 64 | 16,384 | 64 | 2.0 | 8,192 |" in lines
    assert "| padded generate | 64 | 15,000 | 50 | 7.5 | 2,000 |" in lines


def throughput_args(tmp_path: Path, reserve: float) -> argparse.Namespace:
    return argparse.Namespace(
        work=tmp_path / "work",
        out=tmp_path / "out",
        problems=tmp_path / "problems.jsonl",
        temperature=0.3,
        throughput_tokens=8,
        seed=0,
        reserve=reserve,
    )


def test_each_speed_row_is_in_the_summary_before_the_next_is_measured(
    device: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The call ends (its machine's limit) while padded generate loads: the engine's rows are in --out already."""
    speed = load_benchmark("hf_throughput", monkeypatch)
    monkeypatch.setattr(speed, "conversations", lambda problems, count: [[{"role": "user", "content": "q"}]] * count)

    async def timed_calls(model: object, convs: list[object], seed: int, sampling: object) -> dict[str, object]:
        return {"calls": len(convs), "generated_tokens": 8 * len(convs), "wall_s": 1.0}

    def load_for_generate(*args: object) -> None:
        raise KeyboardInterrupt  # the call's limit, as it ends the command

    monkeypatch.setattr(speed, "timed_calls", timed_calls)
    monkeypatch.setattr(speed, "load_for_generate", load_for_generate)
    monkeypatch.setattr("tmas.llm.hf_checkpoint.checkpoint", lambda spec, **options: tmp_path / "checkpoint")
    model = argparse.Namespace(engine=argparse.Namespace(options=argparse.Namespace(device="cpu", dtype="float32")))
    args = throughput_args(tmp_path, reserve=0.0)
    summary: dict[str, object] = {"runs": [], "throughput": []}
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(device.throughput(args, model, "m", None, [4, 8], device.Clock(60), lambda text: None, summary))
    written = json.loads((args.out / device.SUMMARY).read_text())
    assert [(r["backend"], r["calls"]) for r in written["throughput"]] == [("in-process", 4), ("in-process", 8)]


def test_the_engines_speed_stops_at_the_time_the_call_keeps(
    device: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls that would run past --reserve are stopped; the levels after them and padded generate are not started."""
    speed = load_benchmark("hf_throughput", monkeypatch)
    monkeypatch.setattr(speed, "conversations", lambda problems, count: [[{"role": "user", "content": "q"}]] * count)
    started: list[int] = []

    async def timed_calls(model: object, convs: list[object], seed: int, sampling: object) -> dict[str, object]:
        started.append(len(convs))
        await asyncio.Event().wait()  # never answered
        raise AssertionError

    def checkpoint(spec: str, **options: object) -> Path:
        raise AssertionError("padded generate started with no time left")

    monkeypatch.setattr(speed, "timed_calls", timed_calls)
    monkeypatch.setattr("tmas.llm.hf_checkpoint.checkpoint", checkpoint)
    logged: list[str] = []
    # A minute's clock of which --reserve keeps all but a fraction of a second.
    args = throughput_args(tmp_path, reserve=59.5)
    summary: dict[str, object] = {"runs": [], "throughput": []}
    measured = device.throughput(args, object(), "m", None, [4, 8], device.Clock(1), logged.append, summary)
    asyncio.run(asyncio.wait_for(measured, 120))  # without the bound it would wait for ever
    assert started == [4] and summary["throughput"] == []
    assert logged == ["throughput: 4 calls at once stopped, 59.5 s left; the rest not measured"]


def test_the_section_names_the_runs_that_brought_back_no_archive(device: ModuleType, tmp_path: Path) -> None:
    """Runs the call had no time for, or whose archive was over its limit, are rows of the section with their
    status, in the runs' order, not left out."""
    returned = tmp_path / "returned"
    returned.mkdir()
    runs = [
        {"name": "mattrl", "method": "mattrl", "status": "not run: out of time"},
        {"name": "tmas-local", "method": "tmas", "status": "done", "archive": "not kept: 20000000 bytes, over 16 MiB"},
    ]
    summary = {"model": "m", "problems": 2, "machine": {}, "engine": {}, "runs": runs}
    (returned / device.SUMMARY).write_text(json.dumps(summary))
    args = argparse.Namespace(
        returned=returned, work=tmp_path / "work", docs=None, plot=tmp_path / "plot.png", command_line="cmd"
    )
    device.report(args)
    lines = (tmp_path / "work" / "section.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| tmas-local |") or line.startswith("| mattrl |")]
    assert rows == [
        "| tmas-local | done; archive not kept: 20000000 bytes, over 16 MiB | 0 | - | - | - | - |",
        "| mattrl | not run: out of time | 0 | - | - | - | - |",
    ]
