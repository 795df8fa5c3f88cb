"""Majority vote fixed, adaptive and confidence-filtered, on one set of samples.

One run draws k samples a problem with token log-probabilities (majority vote, ``select = "filtered_vote"``); every
rule is then read on those same samples, in their index order:

- **fixed**: the plurality of all k samples (and of the first k/2, the fixed rule at about adaptive's cost);
- **adaptive** (Adaptive-Consistency, Aggarwal et al. 2023; methods/stopping.py): rounds of r samples until the Beta
  criterion says the leader cannot be overtaken with probability 0.95, never past k. A run with ``stop = "beta"``
  sends the same requests with the same sample indices (so the same seeds) in the same order, so the samples it
  draws are drawn like the first ones of the fixed run (alike in distribution; a server's batched arithmetic can
  still make a reply differ by a token), and its completion tokens are theirs;
- **confidence** (DeepConf offline, Fu et al. 2025; methods/selection.py): votes weighted by each sample's confidence,
  and votes over the most confident share of the samples only;
- **online** (DeepConf online; methods/online_stop.py): the first ``warmup`` samples set the threshold, and each later
  sample's stored token log-probabilities are fed to the same watch a streamed reply meets; a sample the watch stops
  counts the tokens up to the stop and does not vote. A live stop also spends the tokens already in flight when the
  connection closes, so this is the least a live run spends.

Accuracy is of the returned answer, graded by the rules (Math-Verify) against the reference, with its standard error
sqrt(p(1 - p) / n) over problems. Only problems whose run finished are counted.

    python benchmarks/adaptive_majority.py --out OUT                 # generate, run (resumable), read
    python benchmarks/adaptive_majority.py --out OUT --read-only     # read what the run has finished so far
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from embedded_cpu import TMAS_CLI, _run

from tmas.answer_classes import answer_classes
from tmas.answer_rules import RuleEquivalence, check_pair, math_verify_installed
from tmas.data.generators import FAMILIES, generate
from tmas.grading.run_results import load_results
from tmas.jsonl import write_jsonl
from tmas.methods.base import Candidate
from tmas.methods.confidence import trace_confidence
from tmas.methods.online_stop import ConfidenceWatch, stopping_threshold
from tmas.methods.selection import ConfidenceVote, select
from tmas.methods.stopping import BETA_THRESHOLD, beta_vote_stop
from tmas.store.database import DB_NAME
from tmas.store.run_store import RunStore


def run_dir_of(out: Path, k: int) -> Path:
    return out / f"fixed{k}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created, or continued)")
    parser.add_argument("--k", type=int, default=8, help="samples a problem")
    parser.add_argument("--per-family", type=int, default=22, help="generated problems per family (7 families)")
    parser.add_argument("--level", type=int, default=1)
    parser.add_argument("--problem-seed", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=4, help="online: samples that set the threshold")
    parser.add_argument(
        "--window",
        type=int,
        default=64,
        help="confidence group size in tokens for the confidence rules, read again from the stored log-probabilities"
        " (the run's own confidence_window, 2048 as DeepConf's long traces, spans a whole short reply)",
    )
    parser.add_argument("--parallel", type=int, default=8, help="the embedded server's slots (k in flight at once)")
    parser.add_argument("--read-only", action="store_true", help="read the run as it stands; start nothing")
    return parser.parse_args(argv)


def run_command(out: Path, args: argparse.Namespace) -> list[str]:
    problems = out / "problems.jsonl"
    if not problems.exists():
        write_jsonl(
            [p for f in FAMILIES for p in generate(f, args.per_family, level=args.level, seed=args.problem_seed)],
            problems,
        )
    config = out / "tmas.toml"
    if not config.exists():
        config.write_text(f"[local]\nparallel = {args.parallel}\n")
    run_dir = run_dir_of(out, args.k)
    if run_dir.exists():  # an interrupted run continues from its store, with its own settings
        return [*TMAS_CLI, "run", "--resume", str(run_dir), "-c", str(config), "-y"]
    return [
        *TMAS_CLI, "run", str(problems), "-o", str(run_dir), "-c", str(config),
        "--method", "majority", "-p", f"k={args.k}", *SAMPLING,
    ]  # fmt: skip


# Majority vote's sampling in docs/results.md's earlier runs; filtered_vote asks for the log-probabilities.
SAMPLING = ["-p", "select=filtered_vote", "--seed", "1", "--temperature", "0.3", "--max-tokens", "640", "-y"]


@dataclass
class Problem:
    problem_id: str
    gold: str
    samples: list[Candidate]  # in index order
    classes: dict[str, str]
    token_positions: list[list[Any]]  # each sample's token log-probabilities (empty without them)


@dataclass
class Outcome:
    answer: str | None
    tokens: int
    drawn: int


Rule = Callable[[Problem], Outcome]


def _tokens(samples: Sequence[Candidate]) -> int:
    return sum(c.usage.completion_tokens for c in samples)


def vote_of(
    samples: Sequence[Candidate], p: Problem, rule: str = "vote", how: ConfidenceVote | None = None
) -> str | None:
    chosen = select(list(samples), "numeric", rule, p.classes, how)  # type: ignore[arg-type]
    return chosen.answer if chosen else None


def fixed(count: int) -> Rule:
    def rule(p: Problem) -> Outcome:
        drawn = p.samples[:count]
        return Outcome(vote_of(drawn, p), _tokens(drawn), len(drawn))

    return rule


def confidence(rule_name: str, share: float) -> Rule:
    how = ConfidenceVote(measure="tail", share=share)

    def rule(p: Problem) -> Outcome:
        return Outcome(vote_of(p.samples, p, rule_name, how), _tokens(p.samples), len(p.samples))

    return rule


def adaptive(round_size: int, threshold: float = BETA_THRESHOLD) -> Rule:
    """methods/majority.py's rounds, read on the stored samples: draw a round, stop once the vote is decided."""

    def rule(p: Problem) -> Outcome:
        drawn: list[Candidate] = []
        for start in range(0, len(p.samples), round_size):
            drawn += p.samples[start : start + round_size]
            keys = [p.classes[c.answer] for c in drawn if c.answer and c.error is None]
            if beta_vote_stop(keys, threshold).stop:
                break
        return Outcome(vote_of(drawn, p), _tokens(drawn), len(drawn))

    return rule


def opens_unanimous(p: Problem) -> bool:
    """The first four samples all answered, alike: the only way the Beta criterion at 0.95 stops at four."""
    first = p.samples[:4]
    return (
        len(first) == 4
        and all(c.answer and c.error is None for c in first)
        and len({p.classes[c.answer] for c in first}) == 1
    )


def online(warmup: int, keep: float, window: int) -> Rule:
    """DeepConf's online mode on the stored token log-probabilities (see the module docstring)."""

    def rule(p: Problem) -> Outcome:
        warm = p.samples[:warmup]
        lowest = [c.confidence.lowest_group for c in warm if c.confidence is not None]
        if not lowest:
            return fixed(len(p.samples))(p)
        threshold = stopping_threshold(lowest, keep)
        voters, tokens = list(warm), _tokens(warm)
        for c, positions in zip(p.samples[warmup:], p.token_positions[warmup:], strict=True):
            watch = ConfidenceWatch(threshold, window)
            watch.begin()
            stopped_at = None
            for i, position in enumerate(positions):
                if watch.observe([position]) is not None:
                    stopped_at = i + 1
                    break
            if stopped_at is None:
                voters.append(c)
                tokens += c.usage.completion_tokens
            else:
                tokens += min(stopped_at, c.usage.completion_tokens)
        return Outcome(vote_of(voters, p), tokens, len(p.samples))

    return rule


async def load(run_dir: Path, window: int) -> list[Problem]:
    equivalence = RuleEquivalence() if math_verify_installed() else None
    problems: list[Problem] = []
    try:
        with RunStore(run_dir, create=False) as store:
            gold = {q.problem_id: q.answer for q in store.problems()}
            for result in load_results(store):
                if result.status != "done":  # still running, or failed: no answer to read
                    continue
                samples = sorted((c for it in result.iterations for c in it.candidates), key=lambda c: c.index)
                positions = []
                for c in samples:
                    call = store.call(c.call_id) if c.call_id is not None else None
                    positions.append(list(call.logprobs or []) if call is not None else [])
                    if positions[-1]:  # the measures again, with groups of ``window`` tokens
                        c.confidence = trace_confidence(positions[-1], window)
                classes = await answer_classes((c.answer for c in samples if c.error is None), equivalence)
                problems.append(Problem(result.problem_id, str(gold[result.problem_id]), samples, classes, positions))
    finally:
        if equivalence is not None:
            await equivalence.aclose()
    return problems


def grade(problems: list[Problem], rules: dict[str, Rule]) -> list[dict[str, Any]]:
    verdicts: dict[tuple[str, str], bool] = {}

    def right(gold: str, answer: str | None) -> bool:
        if answer is None:
            return False
        if (gold, answer) not in verdicts:
            verdicts[(gold, answer)] = check_pair(gold, answer).correct is True
        return verdicts[(gold, answer)]

    base_tokens = None
    rows = []
    for name, rule in rules.items():
        outcomes = [(p, rule(p)) for p in problems]
        n = len(outcomes)
        correct = sum(right(p.gold, o.answer) for p, o in outcomes)
        accuracy = correct / n if n else 0.0
        tokens = sum(o.tokens for _, o in outcomes) / n if n else 0.0
        base_tokens = tokens if base_tokens is None else base_tokens
        rows.append(
            {
                "rule": name,
                "problems": n,
                "right": correct,
                "accuracy": accuracy,
                "standard_error": math.sqrt(accuracy * (1 - accuracy) / n) if n else None,
                "completion_tokens_per_problem": tokens,
                "samples_per_problem": sum(o.drawn for _, o in outcomes) / n if n else 0.0,
                "tokens_saved_vs_fixed": 1 - tokens / base_tokens if base_tokens else 0.0,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| Rule | Right | Accuracy (± SE) | Samples a problem | Completion tokens a problem | Saved against fixed k |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['right']}/{r['problems']} | {100 * r['accuracy']:.1f} % "
            f"(± {100 * r['standard_error']:.1f}) | {r['samples_per_problem']:.2f} | "
            f"{r['completion_tokens_per_problem']:,.0f} | {100 * r['tokens_saved_vs_fixed']:.1f} % |"
        )
    return "\n".join(lines)


def family_table(by_family: dict[str, list[dict[str, Any]]], opened: dict[str, int]) -> str:
    """Fixed k against adaptive (Beta 0.95) by family, with how many problems opened with four agreeing samples."""
    lines = [
        "| Family | Problems | First 4 samples agree | Right, fixed | Right, adaptive | Tokens, fixed |"
        " Tokens, adaptive | Saved |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for family, (f, a) in by_family.items():
        lines.append(
            f"| {family} | {f['problems']} | {opened[family]} | {f['right']} | {a['right']} |"
            f" {f['completion_tokens_per_problem']:,.0f} | {a['completion_tokens_per_problem']:,.0f} |"
            f" {100 * a['tokens_saved_vs_fixed']:.1f} % |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    walls = out / "wall_s.json"  # one entry a run command: a resumed run adds its own
    if not args.read_only:
        seconds = _run(run_command(out, args), out / "run.log")
        walls.write_text(json.dumps([*(json.loads(walls.read_text()) if walls.exists() else []), round(seconds, 1)]))
    run_dir = run_dir_of(out, args.k)
    if not (run_dir / DB_NAME).is_file():
        sys.exit(f"adaptive_majority: no run in {run_dir} to read (run the command without --read-only first)")
    problems = asyncio.run(load(run_dir, args.window))
    if not problems:
        sys.exit(f"adaptive_majority: no finished problem in {run_dir}")
    k = max(len(p.samples) for p in problems)
    rules: dict[str, Rule] = {f"fixed, k = {k}": fixed(k), f"fixed, k = {k // 2}": fixed(k // 2)}
    for r in (1, 2, 4):
        rules[f"adaptive (Beta 0.95), rounds of {r}, k <= {k}"] = adaptive(r)
    for threshold in (0.9, 0.8):  # looser criteria: 3 and 2 agreeing votes suffice (4 at 0.95)
        rules[f"adaptive (Beta {threshold}), rounds of 1, k <= {k}"] = adaptive(1, threshold)
    rules[f"confidence-weighted vote, k = {k}"] = confidence("confidence_vote", 1.0)
    for share in (0.5, 0.1):
        rules[f"filtered vote, top {share:.0%} by confidence, k = {k}"] = confidence("filtered_vote", share)
    for keep in (0.9, 0.1):
        rules[f"online stop, warm-up {args.warmup}, keep {keep}, k = {k}"] = online(args.warmup, keep, args.window)
    rows = grade(problems, rules)
    # By family (the generated problem ids begin with it): where the samples agree, adaptive stops.
    pair = {name: rules[name] for name in (f"fixed, k = {k}", f"adaptive (Beta 0.95), rounds of 1, k <= {k}")}
    families: dict[str, list[Problem]] = {}
    for p in problems:
        families.setdefault(p.problem_id.split("-")[0], []).append(p)
    by_family = {family: grade(members, pair) for family, members in families.items()}
    opened = {family: sum(map(opens_unanimous, members)) for family, members in families.items()}
    record = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {platform.system()}",
        "problems": len(problems),
        "k": k,
        "confidence_window": args.window,
        "run_wall_s": json.loads(walls.read_text()) if walls.exists() else None,
        "rows": rows,
        "by_family": by_family,
        "first_four_agree": opened,
    }
    (out / "adaptive_majority.json").write_text(json.dumps(record, indent=2))
    print(table(rows))
    print(f"\n{family_table(by_family, opened)}")


if __name__ == "__main__":
    main()
