"""Turn credits of MATTRL deliberations, as ``tmas pool build`` writes them (``POOL.build/credits.jsonl``).

Only the fields the viewer shows are read (run, problem, turn, agent, reward r); lines it cannot read are skipped,
so a change in that file costs the viewer its credit column, never a page.
"""

from __future__ import annotations

from pathlib import Path

from tmas.jsonl import read_objects
from tmas.pool.build import CREDITS_FILE

# (run directory, problem id, round (0-based, as in the transcript), agent) -> the turn's reward r.
CreditKey = tuple[str, str, int, str]


def load_credits(run_dirs: list[Path]) -> dict[CreditKey, float]:
    credits: dict[CreditKey, float] = {}
    for run_dir in run_dirs:
        path = run_dir / CREDITS_FILE
        if not path.is_file():
            continue
        for _, _, row in read_objects(path, lenient=True):
            try:
                # The transcript round where the build wrote it; older files only have the turn (t = round + 1).
                round_ = int(row["round"]) if "round" in row else int(row["turn"]) - 1
                key = (str(Path(row["run"]).resolve()), str(row["problem_id"]), round_, str(row["agent"]))
                credits[key] = float(row["r"])
            except (ValueError, KeyError, TypeError):
                continue
    return credits
