#!/usr/bin/env bash
# The problem files of data/rl/ (see README.md): generated, level 2 (LEVEL=N for another), all seven families; every
# question once. OUT=DIR writes them there instead (data/rl/level1 holds the level-1 set: LEVEL=1 OUT=data/rl/level1).
# Held-out evaluation first; each training batch then keeps only questions not in the evaluation set nor in an
# earlier batch (tiling and combinatorics have few distinct level-2 questions, so they are scarce in training).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
LEVEL=${LEVEL:-2}
OUT=${OUT:-data/rl}
mkdir -p "$OUT"
tmp=$(mktemp -d)
gen() { PYTHONPATH=src "$PY" -m tmas data generate --family all --level "$LEVEL" --n "$1" --seed "$2" -o "$tmp/$3.jsonl"; }
gen 56 9000 eval
PYTHONPATH=src "$PY" data/rl/distinct.py "$tmp/eval.jsonl" "$OUT/eval.jsonl"
previous=(--exclude "$OUT/eval.jsonl")
# batch: per-family count and seed
for spec in a1:4:100 a2:4:101 b1:3:200 a3:4:102 b2:3:201 a4:4:103; do
  IFS=: read -r name n seed <<<"$spec"
  gen "$n" "$seed" "$name"
  PYTHONPATH=src "$PY" data/rl/distinct.py "$tmp/$name.jsonl" "$OUT/train-$name.jsonl" "${previous[@]}"
  previous+=(--exclude "$OUT/train-$name.jsonl")
done
rm -r "$tmp"
