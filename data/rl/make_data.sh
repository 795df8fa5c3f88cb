#!/usr/bin/env bash
# The TMAS runs behind data/rl/: the embedded Qwen2.5-Coder-0.5B (llama-server) on generated problems, one batch
# after another, each a run directory under RUNS that `tmas run --resume` continues. Run it again after a stop: a
# finished batch resumes with nothing to do, an unfinished one goes on. See data/rl/README.md.
#
#   PY=.venv/bin/python RUNS=runs/rl data/rl/make_data.sh [batch ...]
#
# DATA=DIR reads the problem files from there (default data/rl; data/rl/level1 for the level-1 set).
#
# Batches (problem file data/rl/train-NAME.jsonl, iterations): "aN" run two iterations, "bN" one. A two-iteration
# problem gives a normal, an experience and a guideline prompt group; a one-iteration problem a normal group only,
# which is what the paper's mix (2.2:1.6:0.6) runs short of when every problem has one experience group.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
# llama-server is an OpenMP build: on cores shared with other work its threads' spin-waits at every barrier cost
# far more than the work (generation measured at 0.5-2 tokens/s per slot here); passive waiting avoids that.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
RUNS=${RUNS:-runs/rl-data}
DATA=${DATA:-data/rl}
mkdir -p "$RUNS"
batches=("$@")
[ ${#batches[@]} -gt 0 ] || batches=(a1 b1 a2 a3 a4 b2)

iterations_of() {
  case "$1" in
    a*) echo 2 ;;
    b*) echo 1 ;;
    *) echo "unknown batch $1" >&2; exit 2 ;;
  esac
}

for name in "${batches[@]}"; do
  t=$(iterations_of "$name")
  dir="$RUNS/$name"
  echo "== $(date -u +%FT%TZ) batch $name: iterations $t, $dir"
  if [ -f "$dir/run.sqlite" ]; then
    "$PY" -m tmas run --resume "$dir"
  else
    # early_stop off: a settled iteration 0 would otherwise skip the memory update the experience and guideline
    # prompts of iteration 1 are built from. The guideline agent gets 600 tokens (the preset: 300): cut at 300, its
    # update was lost on 2 of the first 4 problems, and guideline prompts are what the paper's mix ran short of.
    "$PY" -m tmas run "$DATA/train-$name.jsonl" -m tmas -p preset=local -p iterations="$t" -p early_stop=false \
      -p 'sampling={"guideline": {"max_tokens": 600}}' --local-model qwen2.5-coder-0.5b -o "$dir"
  fi
done
echo "== $(date -u +%FT%TZ) all batches done"
