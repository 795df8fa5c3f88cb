"""The checkpoints a training run leaves in OUT (``checkpoint-<step>``), and which one ``--resume`` continues from.

Read without importing torch or TRL, so that the CLI refuses a wrong start before the slow imports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tmas.errors import ConfigError

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))["global_step"])


def last_checkpoint(out: Path) -> Path | None:
    """The checkpoint of the highest step whose save finished (its trainer state is written last)."""
    if not out.is_dir():
        return None
    done = [p for p in out.iterdir() if _NAME.fullmatch(p.name) and (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def resume_point(out: Path, resume: bool) -> Path | None:
    """The checkpoint to continue from (``--resume``: the last in OUT, if any). A run that would start over a
    stopped one's checkpoints is refused, so that the two never mix."""
    last = last_checkpoint(out)
    if last is not None and not resume:
        raise ConfigError(f"{out} holds {last.name} of a stopped run: pass --resume, or choose another --out")
    return last
