"""Every script of ``benchmarks/`` starts and prints its usage: a name it imports that the package no longer has
fails here, not on the machine the script was carried to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import BENCHMARKS

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def test_the_benchmarks_folder_holds_scripts() -> None:
    assert "comparison_device.py" in SCRIPTS and "rl_device.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_prints_its_usage(script: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
