"""Keep the problems of a JSONL file whose question is new: not earlier in the file and not in any --exclude file
(questions compared as `tmas rl build-data --exclude` compares them: case and whitespace do not matter).

    python data/rl/distinct.py IN.jsonl OUT.jsonl [--exclude OTHER.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tmas.rl.data import question_hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--exclude", type=Path, action="append", default=[])
    args = parser.parse_args()
    seen = {
        question_hash(json.loads(line)["question"])
        for path in args.exclude
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip()
    }
    kept = []
    for line in args.source.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        key = question_hash(json.loads(line)["question"])
        if key not in seen:
            seen.add(key)
            kept.append(line)
    args.target.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    print(f"kept {len(kept)} problems of {args.source} in {args.target}")


if __name__ == "__main__":
    main()
