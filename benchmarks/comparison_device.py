"""Every method against majority vote at equal completion tokens, on a CUDA machine without network access, in one
command after the transfers: the held-out problems answered by the embedded model run in process by transformers'
continuous batching (``--hf-model``: nothing to build), then the report written on any machine.

Steps (see docs/results.md, "On a CUDA machine without network access"):

- ``pack`` (on a machine with network access, in the repository root): the wheels a plain CUDA/PyTorch image lacks
  (cp312 manylinux, versions as installed here) into ``.cmp-whl/``; each model's GGUF gzip-compressed in pieces,
  ``.cmp-parts/MODEL/NN/``, sized so one transfer carries what 64 MiB hold beside the repository (piece 00 travels
  with the wheels and the tokenizer); each model's tokenizer, converted from its GGUF once here, into
  ``.cmp-tok/MODEL/`` (the GPU machine then never converts one: that took most of the 82 s a conversion took there).
  The folders are ignored by git.
- ``receive`` (on the GPU machine, once per transfer): installs the wheels once into WORK/site, keeps each checked
  piece, and assembles a model's GGUF once all its pieces are there (its SHA-256 checked).
- ``run`` (on the GPU machine): within ``--minutes`` of work (default 9; converting and loading the model count),
  the problems of ``--problems`` (the 287 held-out ones of data/rl/level1/eval.jsonl) with each method in turn, most
  important first, the model loaded once for all of them:

  1. majority vote, k = 16 (MV@1..16 from one run; MV@1 is CoT's expectation);
  2. TMAS, its ``local`` preset (N = 2, M = 1, T = 2); 3. TMAS, the ``local`` preset at N = 4, M = 2 (about MV@16's
     completion tokens); 4. Verify-Refine; 5. adaptive majority vote (Beta stop, k <= 16); 6. Self-Refine;
     7. PaCoRe; 8. RSE; 9. MATTRL (math).

  Each run may take its share of the time left (:class:`Study` ``weight``); one cut short keeps its finished problems
  and iterations. ``--throughput-s`` seconds are kept from the runs for a closing speed measurement: the loaded
  model's generated tokens a second at ``--throughput`` calls at once (64 and 256), then padded ``generate`` on the
  same prompts (``benchmarks/hf_throughput.py``'s measures), each row into the summary as it comes; the engine's
  calls are stopped where they would run into the last ``--reserve`` seconds. As each run ends, its directory is
  compressed into ``--out``: at most seven archives (the runs past the seventh share the seventh), each at most 16
  MiB, and ``summary.json`` (machine, timings, each run's calls and tokens, the log), so ``--out`` never holds more
  than eight files.
- ``report`` (anywhere with the ``eval`` extra): the returned archives graded by rules into accuracy with its standard
  error, completion tokens per problem, each method paired with majority vote at the nearest completion-token budget,
  and the frontier plot; a section of docs/results.md (``--docs``) and its plot beside it.

Rehearse everything on a CPU with SmolLM2 (the commands are in docs/results.md): ``pack --models smollm2-135m``,
``receive``, then ``run --model smollm2-135m --limit 1`` with small ``--k``, ``--max-tokens``, ``--max-tokens-all``
(presets' calls too), ``--throughput`` and ``--throughput-tokens``, and ``report`` into a copy of the page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rl_device  # noqa: E402  (the pieces, the wheels and their receiving: shared with the RL device script)

WHEEL_DIR = ROOT / ".cmp-whl"
PARTS_DIR = ROOT / ".cmp-parts"
TOKENIZER_DIR = ROOT / ".cmp-tok"
DEFAULT_WORK = Path("/tmp/tmas-cmp")
DEFAULT_PROBLEMS = ROOT / "data" / "rl" / "level1" / "eval.jsonl"
# What tmas and the GGUF reader need beyond an image with CUDA PyTorch, transformers 5.17 (and so its tokenizers,
# safetensors and huggingface-hub), accelerate, numpy, typer, rich, jinja2 and aiohttp; transformers itself too, pinned
# to the 5.17.0 the in-process engine is written against (pure Python, its dependencies the image's own).
WHEELS = (
    "transformers",
    "gguf",
    "llguidance",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "zstandard",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
)
# --out holds at most this many files: the run archives, then summary.json.
OUT_FILES = 8
ARCHIVE_LIMIT = 16 * 1024 * 1024
SUMMARY = "summary.json"
SECTION_START = "<!-- comparison-device:start -->"
SECTION_END = "<!-- comparison-device:end -->"


@dataclass(frozen=True)
class Study:
    """One run of the comparison: its name (its folder), method, parameters, and its share of the time left."""

    name: str
    method: str
    params: dict[str, Any]
    weight: float
    # Calls one problem has in flight at most (sizes how many problems run at once).
    width: int
    # Whether the run's own preset sets its sampling (else the run's --temperature and --max-tokens).
    preset: bool = False


def studies(args: argparse.Namespace) -> list[Study]:
    """The runs in the order of the module's docstring."""
    concise = {"style": "concise"}
    return [
        Study("majority", "majority", {"k": args.k, **concise}, 3, args.k),
        Study("tmas-local", "tmas", {"preset": "local"}, 2, 2, preset=True),
        Study("tmas-n4-m2", "tmas", {"preset": "local", "n": 4, "m": 2}, 2, 8, preset=True),
        Study("verify-refine", "verify_refine", {"n": 2, "m": 1, "iterations": 2, **concise}, 1, 2),
        Study("majority-beta", "majority", {"k": args.k, "stop": "beta", "round_size": 4, **concise}, 1, 4),
        Study("self-refine", "self_refine", {"n": 2, "iterations": 2, **concise}, 1, 2),
        Study("pacore", "pacore", {"responses_per_round": 2, "iterations": 2, **concise}, 1, 2),
        Study("rse", "rse", {"n": 2, "iterations": 2, **concise}, 1, 2),
        Study("mattrl", "mattrl", {"domain": "math", "iterations": 2, "team_size": 2}, 1, 3),
    ]


# ------------------------------------------------------------------------------------------------------- pack
def pack(args: argparse.Namespace) -> None:
    from tmas.llm.hf_checkpoint import write_tokenizer
    from tmas.llm.weights import resolve_model

    pinned = [] if args.no_wheels else rl_device.download_wheels(WHEEL_DIR, WHEELS)
    wheels = sum(p.stat().st_size for p in WHEEL_DIR.glob("*.whl"))
    carry = rl_device.carry_bytes(args.carry_mb)
    packed = {}
    for model in args.models.split(","):
        tokenizer = TOKENIZER_DIR / model
        shutil.rmtree(tokenizer, ignore_errors=True)
        gguf = resolve_model(model)
        write_tokenizer(gguf, tokenizer)
        first = carry - wheels - sum(p.stat().st_size for p in tokenizer.iterdir())
        if first <= 0:
            raise SystemExit(f"the wheels and {model}'s tokenizer alone exceed a transfer ({carry} bytes)")
        packed[model] = rl_device.split_file(gguf, PARTS_DIR / model, carry, first_bytes=first)
    print(json.dumps({"wheels": pinned, "wheel_bytes": wheels, "carry_bytes": carry, "models": packed}, indent=1))


# ---------------------------------------------------------------------------------------------------- receive
def receive(args: argparse.Namespace) -> dict[str, str | None]:
    """Install the wheels once; keep the pieces and tokenizers carried so far; each model's GGUF once complete."""
    work: Path = args.work
    rl_device.install_wheels(work, None if args.no_wheels else WHEEL_DIR)
    found: dict[str, str | None] = {}
    for parts in sorted(PARTS_DIR.iterdir()) if PARTS_DIR.is_dir() else []:
        found[parts.name] = model_file(work, parts.name)
    for name in found:
        rl_device.log(work, f"{name}: {found[name] or 'pieces still to come'}")
    return found


def model_file(work: Path, model: str) -> str | None:
    """The model's GGUF assembled under WORK/MODEL from the pieces carried so far (this call's and earlier calls'),
    its carried tokenizer kept beside it; None while pieces are missing or none were ever carried."""
    place = work / model
    carried = TOKENIZER_DIR / model
    if carried.is_dir() and not (place / "tokenizer").is_dir():
        shutil.copytree(carried, place / "tokenizer")
    if not (PARTS_DIR / model).is_dir() and not (place / "parts").is_dir():
        return None
    gguf = rl_device.receive(place, PARTS_DIR / model)
    return str(gguf) if gguf is not None else None


# -------------------------------------------------------------------------------------------------------- run
@dataclass
class Clock:
    """The command's time: ``minutes`` of work from its start."""

    minutes: float
    started: float = field(default_factory=time.monotonic)

    @property
    def left(self) -> float:
        return self.minutes * 60 - (time.monotonic() - self.started)


def run(args: argparse.Namespace) -> None:
    clock = Clock(args.minutes)
    work: Path = args.work
    rl_device.ensure_site(work, None if args.no_wheels else WHEEL_DIR)
    os.environ.update(rl_device.child_env(work) | {"TMAS_CACHE_DIR": str(work / "cache")})
    gguf = model_file(work, args.model)
    spec = gguf or args.model
    tokenizer = work / args.model / "tokenizer"
    log = lambda text: rl_device.log(work, text)  # noqa: E731
    log(f"run: model {args.model} ({spec}), {args.minutes} minutes, problems {args.problems}")
    if gguf is None and (work / args.model / "parts").is_dir():
        log("the model's pieces are not all here yet: receive them, then run again")
        return
    summary = asyncio.run(compare(args, clock, spec, tokenizer if tokenizer.is_dir() else None, log))
    write_out(args, summary)


async def compare(
    args: argparse.Namespace, clock: Clock, spec: str, tokenizer: Path | None, log: Any
) -> dict[str, Any]:
    from tmas.config import Settings
    from tmas.llm.hf_model import open_hf_model
    from tmas.problems import load_problems

    problems = load_problems(args.problems)[: args.limit] if args.limit else load_problems(args.problems)
    hf = {"model": spec, "tokenizer": str(tokenizer) if tokenizer else None, "device": args.device}
    hf |= {"dtype": args.dtype, "attn_implementation": args.attn, "threads": args.threads}
    # The embedded models do not think: their JSON replies are held to their schemas from the first call, as on the
    # embedded llama-server (tmas.llm.provision).
    endpoint = {"reasoning": "none"}
    base = Settings.model_validate({"hf": hf, "endpoint": endpoint, "concurrency": args.concurrency, "seed": args.seed})
    summary: dict[str, Any] = {"machine": machine(), "model": args.model, "file": spec, "problems": len(problems)}
    summary["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "func"}
    summary["runs"] = []
    t0 = time.monotonic()
    async with open_hf_model(base) as model:
        summary["load_s"] = round(time.monotonic() - t0, 1)
        engine = model.engine
        schemas = "followed" if engine.grammars is not None else engine.no_grammar
        summary["engine"] = {"device": engine.options.device, "dtype": engine.options.dtype, "schemas": schemas}
        log(f"model loaded in {summary['load_s']} s ({summary['engine']})")
        plan = studies(args)
        levels = throughput_levels(args)
        kept = args.throughput_s if levels else 0.0
        for i, study in enumerate(plan):
            left = clock.left - args.reserve - kept
            if left < args.min_run:
                summary["runs"].append({"name": study.name, "status": "not run: out of time"})
                log(f"{study.name}: not run, {left:.0f} s left")
                continue
            share = left * study.weight / sum(s.weight for s in plan[i:])
            record = await one_run(args, base, study, problems, model, share, log)
            summary["runs"].append(record)
            archive(args, work_runs(args) / study.name, len([r for r in summary["runs"] if "archive" in r]), record)
            write_summary(args, summary)
        if levels:
            summary["throughput"] = []
            await throughput(args, model, spec, tokenizer, levels, clock, log, summary)
    return summary


def throughput_levels(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.throughput.split(",") if c.strip()]


async def throughput(
    args: argparse.Namespace,
    model: Any,
    spec: str,
    tokenizer: Path | None,
    levels: list[int],
    clock: Clock,
    log: Any,
    summary: dict[str, Any],
) -> None:
    """Generated tokens a second of the loaded model at each number of calls at once in ``levels``, then of padded
    ``generate`` on a second copy of it with the same prompts and sampling (benchmarks/hf_throughput.py's measures),
    each only while more than --reserve seconds are left, the engine's calls stopped when they are not; each row
    into ``summary["throughput"]``, written to --out as it comes."""
    import hf_throughput

    from tmas.config import Sampling
    from tmas.llm.hf_checkpoint import checkpoint

    sampling = Sampling(temperature=args.temperature, max_tokens=args.throughput_tokens)
    rows: list[dict[str, Any]] = summary["throughput"]

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        log(f"throughput: {json.dumps(row)}")
        write_summary(args, summary)

    for c in levels:
        if clock.left <= args.reserve:
            break
        convs = hf_throughput.conversations(args.problems, c)
        calls = hf_throughput.timed_calls(model, convs, args.seed, sampling)
        try:
            measured = await asyncio.wait_for(calls, clock.left - args.reserve)
        except TimeoutError:
            log(f"throughput: {c} calls at once stopped, {args.reserve:g} s left; the rest not measured")
            return
        keep({"backend": "in-process", "concurrency": c, **measured})
    if clock.left <= args.reserve:
        return
    options = model.engine.options
    folder = await asyncio.to_thread(checkpoint, spec, dtype=options.dtype, tokenizer=tokenizer)
    warm_up = hf_throughput.conversations(args.problems, 1)
    loaded = await asyncio.to_thread(hf_throughput.load_for_generate, folder, options.device, options.dtype, warm_up)
    for c in levels:
        if clock.left <= args.reserve:
            break
        convs = hf_throughput.conversations(args.problems, c)
        row = await asyncio.to_thread(
            hf_throughput.padded_row, *loaded, convs, args.temperature, args.throughput_tokens, args.seed
        )
        keep(row)


def work_runs(args: argparse.Namespace) -> Path:
    return Path(args.work) / "runs"


async def one_run(
    args: argparse.Namespace, base: Any, study: Study, problems: list[Any], model: Any, seconds: float, log: Any
) -> dict[str, Any]:
    from tmas.config import Sampling, with_method_params
    from tmas.llm.sampling import with_sampling
    from tmas.runner import RunState, prepare_run, run_problems

    settings = base.model_copy(deep=True)
    settings.method.name = study.method
    settings = with_method_params(settings, study.params)
    if not study.preset:
        settings = with_sampling(settings, "flags", Sampling(temperature=args.temperature, max_tokens=args.max_tokens))
    if args.max_tokens_all is not None:
        # A rehearsal's tight limit: every call, a preset's own roles included (flags sit above presets).
        settings = with_sampling(settings, "flags", Sampling(max_tokens=args.max_tokens_all))
    settings.problems_in_flight = max(1, min(len(problems), args.concurrency // study.width))
    run_dir = work_runs(args) / study.name
    resume = (run_dir / "run.sqlite").exists()
    store, settings, todo = prepare_run(run_dir, settings, None if resume else problems, resume=resume, own_model=True)
    record: dict[str, Any] = {"name": study.name, "method": study.method, "params": study.params}
    record["time_s"] = round(seconds, 1)
    log(f"{study.name}: {study.method} {json.dumps(study.params)}, up to {seconds:.0f} s")
    started = time.monotonic()
    with store:
        try:
            await asyncio.wait_for(run_problems(settings, todo, store, state=RunState(), model=model), seconds)
            record["status"] = "done"
        except TimeoutError:
            record["status"] = "cut at its time"
        record["wall_s"] = round(time.monotonic() - started, 1)
        record["problems_done"] = sum(r.status == "done" for r in store.results())
        costs = store.role_costs().values()
        for kind in ("calls", "failed", "prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
            record[kind] = sum(c[kind] for c in costs)
        # What the model did not do as asked in this run (a schema it could not follow), as the run recorded it.
        record["downgrades"] = store.downgrade_messages()
    # Generated tokens a second over the run (a resumed run's earlier calls count too).
    record["completion_tokens_per_s"] = round(record["completion_tokens"] / max(record["wall_s"], 1e-9), 1)
    log(f"{study.name}: {record['status']} after {record['wall_s']} s, {record['problems_done']} problems done")
    return record


def archive(args: argparse.Namespace, run_dir: Path, archived: int, record: dict[str, Any]) -> None:
    """The run's directory compressed into --out: the n-th run into runs-n.tar.xz, runs past the seventh into the
    seventh (rewritten with all of them), each archive at most 16 MiB."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    slot = min(archived + 1, OUT_FILES - 1)
    target = out / f"runs-{slot}.tar.xz"
    members = [run_dir]
    if target.exists():
        with tarfile.open(target, "r:xz") as old:
            members += [work_runs(args) / n for n in {m.name.split("/")[0] for m in old.getmembers()}]
    partial = target.with_suffix(".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for member in dict.fromkeys(members):
            tar.add(member, arcname=member.name)
    if partial.stat().st_size > ARCHIVE_LIMIT:
        record["archive"] = f"not kept: {partial.stat().st_size} bytes, over 16 MiB"
        partial.unlink()
        return
    partial.rename(target)
    record["archive"] = target.name


def write_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    log_file = Path(args.work) / "run.log"
    summary["log"] = log_file.read_text(encoding="utf-8").splitlines() if log_file.is_file() else []
    summary["finished_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / SUMMARY).write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")


def write_out(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    write_summary(args, summary)
    for r in summary["runs"]:
        print(f"{r['name']}: {r.get('status')} ({r.get('problems_done', 0)} problems, {r.get('wall_s', 0)} s)")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "platform": platform.platform()}
    info["cpus"] = os.cpu_count()
    try:
        import torch
        import transformers

        info["torch"], info["transformers"] = torch.__version__, transformers.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


# ----------------------------------------------------------------------------------------------------- report
@dataclass
class Evaluated:
    """One returned run, graded: its returned answers per problem, its frontier, and (majority vote) MV@k."""

    name: str
    method: str
    final: dict[str, tuple[float, float]]
    frontier: list[Any]
    majority: dict[int, dict[str, tuple[float, float]]]
    status: str


def unpack(returned: Path, dest: Path) -> dict[str, Any]:
    """The returned archives extracted into ``dest`` (a run per folder); the summary they came with."""
    dest.mkdir(parents=True, exist_ok=True)
    for archive_file in sorted(returned.glob("runs-*.tar.xz")):
        with tarfile.open(archive_file, "r:xz") as tar:
            tar.extractall(dest, filter="data")
    summary_file = returned / SUMMARY
    return json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {"runs": []}


async def evaluate(run_dir: Path, status: str) -> Evaluated:
    from tmas.answer_rules import RuleEquivalence
    from tmas.grading.grades import GradeConfig
    from tmas.grading.run_results import load_results
    from tmas.grading.runs import grade_run
    from tmas.reports.frontier import mv_by_problem, returned_by_problem, run_frontier, votes_frontier
    from tmas.reports.metrics import answer_classes_of, run_spend
    from tmas.store.run_store import RunStore

    config = GradeConfig(mode="rules")
    with RunStore(run_dir, create=False) as store:
        meta = store.get_meta("method") or {}
        method = str(meta.get("name"))
        grades = await grade_run(store, config, None)
        results = load_results(store)
        # Every token a problem's calls spent, a call asked again on resume included, as the run's summary counts.
        spend = run_spend(store)
    equivalence = RuleEquivalence(workers=config.workers, timeout_s=config.rule_timeout_s)
    try:
        classes = await answer_classes_of(results, equivalence)
    finally:
        await equivalence.aclose()
    votes = votes_frontier(method, meta.get("params") or {})
    majority: dict[int, dict[str, tuple[float, float]]] = {}
    if votes:
        largest = max((sum(len(r.candidates) for r in x.iterations) for x in results), default=0)
        majority = {k: at for k in range(1, largest + 1) if (at := mv_by_problem(results, grades, k, classes, spend))}
    frontier = run_frontier(results, grades, majority=votes, classes=classes, spend=spend)
    returned = returned_by_problem(results, grades, spend=spend)
    return Evaluated(run_dir.name, method, returned, frontier, majority, status)


def mean_se(values: list[float]) -> tuple[float, float]:
    import math
    import statistics

    if not values:
        return 0.0, 0.0
    spread = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), spread


def section(runs: list[Evaluated], summary: dict[str, Any], plot: str, command: str) -> str:
    from tmas.reports.paired import nearest_majority

    m = summary.get("machine", {})
    engine = summary.get("engine", {})
    baseline = next((r for r in runs if r.majority and "beta" not in r.name), None)
    lines = [
        SECTION_START,
        f"## Every method against majority vote at equal completion tokens: {summary.get('model')} on "
        f"{m.get('gpu') or engine.get('device')}",
        "",
        f"{summary.get('model')} in process (transformers {m.get('transformers')} continuous batching, "
        f"{engine.get('dtype')} on {m.get('gpu') or engine.get('device')}), {m.get('date', '')[:10]}; "
        f"{summary.get('problems')} held-out problems (`data/rl/level1/eval.jsonl`), graded by rules. "
        f"Model loaded in {summary.get('load_s')} s. JSON replies (verifications, memory updates, distillations, "
        f"reviews) held to their schemas: {engine.get('schemas', 'not recorded')}. "
        "Each run's answer is the one it returned; a run cut at its time "
        "counts the problems and iterations it finished. The difference is the run's accuracy minus majority vote's "
        "MV@k at the k whose completion tokens per problem are nearest the run's, paired over the problems both "
        "answered (standard error of the mean difference; where those are fewer than the run's, the cell says over how "
        "many).",
        "",
        f"Command: `{command}`",
        "",
        "| Run | Status | Problems | Accuracy (± SE) | Completion tokens / problem | Paired with | Difference (± SE) |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in runs:
        if not r.final:
            lines.append(f"| {r.name} | {r.status} | 0 | - | - | - | - |")
            continue
        accuracy, se = mean_se([a for a, _ in r.final.values()])
        tokens, _ = mean_se([t for _, t in r.final.values()])
        pair = nearest_majority(r.final, baseline.majority) if baseline is not None and r is not baseline else None
        paired_with = f"MV@{pair.k} ({pair.majority_tokens:,.0f})" if pair else "-"
        if pair and pair.problems < len(r.final):
            # Paired over the problems both answered: fewer than the run's own figures stand on.
            paired_with += f", over {pair.problems} of {len(r.final)} problems"
        difference = f"{pair.difference * 100:+.1f} (± {pair.stderr * 100:.1f})" if pair else "-"
        lines.append(
            f"| {r.name} | {r.status} | {len(r.final)} | {accuracy:.1%} (± {se:.1%}) | {tokens:,.0f} | "
            f"{paired_with} | {difference} |"
        )
    downgraded = {
        r["name"]: message
        for r in summary.get("runs", [])
        for endpoints in r.get("downgrades", {}).values()
        for message in endpoints.values()
    }
    if downgraded:
        lines += ["", "Runs whose JSON replies went as plain text, and why (as each run recorded it):", ""]
        lines += [f"- {name}: {message}" for name, message in downgraded.items()]
    if baseline is not None:
        lines += ["", "Majority vote, MV@k from its one run of k samples per problem (MV@1 is CoT's expectation):", ""]
        lines += ["| k | " + " | ".join(str(k) for k in baseline.majority) + " |"]
        lines += ["|---|" + "---:|" * len(baseline.majority)]
        cells = [mean_se([a for a, _ in at.values()]) for at in baseline.majority.values()]
        lines += ["| accuracy | " + " | ".join(f"{a:.1%}" for a, _ in cells) + " |"]
        tokens_k = [mean_se([t for _, t in at.values()])[0] for at in baseline.majority.values()]
        lines += ["| tokens | " + " | ".join(f"{t:,.0f}" for t in tokens_k) + " |"]
    speed = summary.get("throughput")
    if speed:
        import hf_throughput

        lines += [
            "",
            "Generated tokens a second of the same model on the same machine after the runs: each call a held-out "
            f"problem's CoT prompt, up to {summary.get('options', {}).get('throughput_tokens')} tokens, all of them "
            "at once through the in-process engine, then in one padded `generate` batch "
            "(`benchmarks/hf_throughput.py`'s measures):",
            "",
            hf_throughput.table(speed),
        ]
    lines += ["", f"![accuracy against completion tokens per problem]({plot})", "", SECTION_END]
    return "\n".join(lines) + "\n"


def into_docs(docs: Path, text: str) -> None:
    """``text`` in place of the section between the markers, or before the CPU data point's section."""
    page = docs.read_text(encoding="utf-8")
    if SECTION_START in page and SECTION_END in page:
        head, _, rest = page.partition(SECTION_START)
        _, _, tail = rest.partition(SECTION_END + "\n")
        page = head + text + tail
    else:
        anchor = "## A small CPU data point"
        page = page.replace(anchor, text + "\n" + anchor, 1) if anchor in page else page + "\n" + text
    docs.write_text(page, encoding="utf-8")


def unreturned_status(record: dict[str, Any]) -> str:
    """A run's status as its call recorded it, and why its archive did not come back where it was not kept."""
    status = str(record.get("status", "?"))
    archive = str(record.get("archive", ""))
    return f"{status}; archive {archive}" if archive.startswith("not kept") else status


def report(args: argparse.Namespace) -> None:
    from tmas.reports.frontier import FrontierPoint
    from tmas.reports.plots import plot_frontier

    dest = Path(args.work) / "returned"
    summary = unpack(args.returned, dest)
    status = {r["name"]: r.get("status", "?") for r in summary.get("runs", [])}
    order = [s.name for s in studies(argparse.Namespace(k=16))]
    found = sorted((p.parent for p in dest.glob("*/run.sqlite")), key=lambda p: [*order, p.name].index(p.name))

    async def evaluate_all() -> list[Evaluated]:
        return [await evaluate(run_dir, status.get(run_dir.name, "?")) for run_dir in found]

    runs = asyncio.run(evaluate_all())
    # The runs the call had no time for (or whose archive was over its limit) have no store; the summary still
    # names them, and so does the section, with their status.
    returned = {r.name for r in runs}
    runs += [
        Evaluated(r["name"], str(r.get("method", "?")), {}, [], {}, unreturned_status(r))
        for r in summary.get("runs", [])
        if r["name"] not in returned
    ]
    runs.sort(key=lambda r: [*order, r.name].index(r.name))
    curves = []
    for r in runs:
        if r.majority:
            points = []
            for k, at in r.majority.items():
                accuracy, se = mean_se([a for a, _ in at.values()])
                points.append(FrontierPoint(f"MV@{k}", mean_se([t for _, t in at.values()])[0], accuracy, se, len(at)))
            curves.append((r.name, points))
        else:
            curves.append((r.name, r.frontier))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    title = f"{summary.get('model')}: {summary.get('problems')} held-out problems"
    plot_frontier(curves, title, args.plot)
    relative = os.path.relpath(args.plot, args.docs.parent) if args.docs else str(args.plot)
    text = section(runs, summary, relative, args.command_line or "python benchmarks/comparison_device.py run")
    (Path(args.work) / "section.md").write_text(text, encoding="utf-8")
    if args.docs:
        into_docs(args.docs, text)
    print(text)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tmas.config import LocalModel

    # The embedded default model, as `tmas run` starts it with no endpoint configured.
    default_model = LocalModel().model
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="wheels, GGUF pieces and tokenizers for the GPU machine (needs network)")
    p.add_argument("--models", default=default_model, help="comma-separated embedded model names or GGUF paths")
    p.add_argument("--carry-mb", type=float, help=rl_device.CARRY_HELP)
    p.add_argument("--no-wheels", action="store_true", help="pack no wheels (a CPU rehearsal)")
    p.set_defaults(func=pack)

    p = sub.add_parser("receive", help="install the wheels; keep the pieces carried; assemble complete GGUFs")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--no-wheels", action="store_true")
    p.set_defaults(func=receive)

    p = sub.add_parser("run", help="every method in turn within --minutes; results into --out")
    p.add_argument("--out", type=Path, required=True, help="folder for the (at most eight) files to bring back")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="working folder (keeps state between calls)")
    p.add_argument("--model", default=default_model, help="a model packed here, a GGUF or a checkpoint folder")
    p.add_argument("--problems", type=Path, default=DEFAULT_PROBLEMS)
    p.add_argument("--limit", type=int, help="only the first N problems")
    p.add_argument("--minutes", type=float, default=9.0, help="minutes of work, loading the model included")
    p.add_argument("--reserve", type=float, default=20.0, help="seconds kept for the last archive and summary")
    p.add_argument("--min-run", type=float, default=20.0, help="no run starts with fewer seconds than this left")
    p.add_argument("--k", type=int, default=16, help="majority vote's samples per problem")
    p.add_argument("--temperature", type=float, default=0.3, help="sampling of runs without a preset of their own")
    p.add_argument("--max-tokens", type=int, default=640, help="max_tokens of runs without a preset of their own")
    p.add_argument("--max-tokens-all", type=int, help="max_tokens of every call, presets' too (a CPU rehearsal)")
    p.add_argument("--concurrency", type=int, default=256, help="calls in flight (the engine's batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--attn", default="sdpa", help="the engine's attention implementation")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--throughput", default="64,256", help="calls at once of the closing speed measurement ('': none)")
    p.add_argument("--throughput-s", type=float, default=45.0, help="seconds kept from the runs for it")
    p.add_argument("--throughput-tokens", type=int, default=256, help="max_tokens of its calls")
    p.add_argument("--no-wheels", action="store_true", help="use the packages installed here, not .cmp-whl/")
    p.set_defaults(func=run)

    p = sub.add_parser("report", help="the returned runs graded, compared and plotted (a docs/results.md section)")
    p.add_argument("returned", type=Path, help="the folder holding the files --out returned")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK)
    p.add_argument("--docs", type=Path, help="the page to put the section in (e.g. docs/results.md)")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "comparison_device.png")
    p.add_argument("--command-line", help="the run command to quote in the section")
    p.set_defaults(func=report)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if getattr(args, "work", None) is not None:
        args.work = args.work.resolve()
    args.func(args)


if __name__ == "__main__":
    main()
