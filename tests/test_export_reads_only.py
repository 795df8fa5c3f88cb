"""``tmas export`` reads a run and writes nothing into it."""

from __future__ import annotations

from pathlib import Path

from conftest import run_tmas


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_export_of_an_empty_store_says_it_holds_no_run_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.sqlite").write_bytes(b"")
    before = _files(run_dir)
    out = run_tmas("export", str(run_dir), timeout=120)
    assert out.returncode == 2
    assert out.stdout == b""
    assert out.stderr.decode().strip().splitlines() == [
        f"tmas: error: {run_dir}: holds no run to export: it was stopped before its first call"
    ]
    assert _files(run_dir) == before
