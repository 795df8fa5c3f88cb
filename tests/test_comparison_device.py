"""The comparison's device script (benchmarks/comparison_device.py): its runs in their order, at most eight files
brought back, and its section put into a docs page in place of the last one."""

from __future__ import annotations

import argparse
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
