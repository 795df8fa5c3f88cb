"""A training pool: the rows of a ``tmas rl build-data`` parquet, and beside them one ``normal`` row per problem of a
JSONL file (the iteration-0 generation prompt every TMAS run starts with, built by the TMAS method of the runs'
``local`` preset, in its ``concise`` style), for problems no TMAS run has solved yet. The pilot (``tmas rl pilot``)
then keeps what the model to train gets right sometimes.

    python data/rl/cot_pool.py PROBLEMS.jsonl TRAIN.parquet POOL.parquet
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow.parquet as pq

from tmas.methods.tmas import TMAS
from tmas.methods.training_prompts import Rendering
from tmas.problems import load_problems
from tmas.rl.data import problem_rows, write_parquet

RUN = "cot"
# The method of make_data.sh's runs (-m tmas -p preset=local): its first prompt is what those runs sent first.
METHOD = TMAS(TMAS.Params(preset="local"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("problems", type=Path)
    parser.add_argument("train", type=Path)
    parser.add_argument("pool", type=Path)
    args = parser.parse_args()
    rows = pq.read_table(args.train).to_pylist()
    known = {r["extra_info"]["question_hash"] for r in rows}
    added = 0
    for problem in load_problems(args.problems):
        row = problem_rows(problem, [], METHOD, RUN, Rendering(style="concise"))[0]
        if row["extra_info"]["question_hash"] not in known:
            rows.append(row)
            added += 1
    write_parquet(rows, args.pool)
    print(f"{args.pool}: {len(rows) - added} rows of {args.train} and {added} normal rows of {args.problems}")


if __name__ == "__main__":
    main()
