"""Every method on generated problems at equal token budgets per problem, end to end, with one command.

Generates seeded problems (the families of ``tmas data generate``), starts the embedded model once (``--replicas``
llama-server processes, on the GPU when llama-server was built with CUDA), runs the grid file's studies as one
``tmas sweep`` (one run directory per point, resumable: run the same command again to continue), grades and
writes the combined report (plots and tables under OUT/sweep/report/) and OUT/comparison.json (machine, model,
settings, command, what ran). See docs/results.md, "How to reproduce".

    python benchmarks/method_comparison.py --out OUT                     # the embedded 0.5B model, 8 replicas
    python benchmarks/method_comparison.py --out OUT --base-url URL      # a running server (vLLM, SGLang, ...)
    python benchmarks/method_comparison.py --out OUT --sim               # the simulated server: the pipeline only

``--stop-after SECONDS`` stops the sweep cleanly (finished problems are kept) and still writes the report, for
machines held for a limited time. With ``--sim`` the figures reflect the simulator's scripted replies, not a model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tmas.config import Budget, Settings
from tmas.data.generators import FAMILIES, generate
from tmas.errors import ConfigError, TmasError
from tmas.grading.grades import GradeConfig
from tmas.jsonl import write_jsonl
from tmas.llm.provision import provisioned
from tmas.problems import load_problems
from tmas.reports.report import build_report
from tmas.sweep import PointOutcome, SweepSpec, expand, load_spec, report_sweep, run_sweep
from tmas.testing import SimScript, SimServer

ROOT = Path(__file__).resolve().parent.parent
GRID = ROOT / "examples" / "method_comparison.toml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (created, or continued)")
    parser.add_argument("--grid", type=Path, default=GRID, help="grid file (default: %(default)s)")
    parser.add_argument("--studies", help="only these studies of the grid, comma-separated")
    parser.add_argument(
        "--skip-unsupported",
        action="store_true",
        help="leave out (and record) studies whose params this tmas does not know, instead of stopping",
    )
    parser.add_argument("--sim", "--dry-run", action="store_true", help="run against the simulated server")
    parser.add_argument("--base-url", help="use this endpoint (comma-separated replicas) instead of the local model")
    parser.add_argument("--endpoint-model", help="the model name to send to --base-url")
    parser.add_argument("--per-family", type=int, default=29, help="problems per family (7 families; default 203)")
    parser.add_argument("--level", type=int, default=2, help="difficulty 1-5 (choose one where CoT scores 10-30%%)")
    parser.add_argument("--seed", type=int, default=0, help="problem seed")
    parser.add_argument("--problems", type=Path, help="a problems JSONL to use instead of generating")
    parser.add_argument("--budget-tokens", type=int, help="tokens per problem for every point (default: the grid's)")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="known model name or GGUF path")
    parser.add_argument("--replicas", type=int, default=8, help="llama-server processes (local.replicas)")
    parser.add_argument("--parallel", type=int, default=4, help="slots per server (local.parallel)")
    parser.add_argument("--gpu-layers", help="local.gpu_layers: a count, auto or all (default: all on a GPU build)")
    parser.add_argument("--ctx-per-slot", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--stop-after", type=float, help="stop the sweep after this many seconds, then report")
    parser.add_argument("--no-report", action="store_true", help="run the points, write no report")
    return parser.parse_args(argv)


def write_problems(path: Path, per_family: int, level: int, seed: int) -> int:
    """``tmas data generate --family all --n PER_FAMILY --level LEVEL --seed SEED --out PATH``."""
    return write_jsonl(generate("all", per_family, seed=seed, level=level), path)


def select_studies(
    spec: SweepSpec, names: list[str] | None, skip_unsupported: bool
) -> tuple[SweepSpec, list[dict[str, str]]]:
    """The grid's studies that will run, and those left out because this tmas rejects their params."""
    known = {study.name for study in spec.study}
    unknown = sorted(set(names or []) - known)
    if unknown:
        raise ConfigError(f"--studies: no study named {', '.join(unknown)} (the grid has: {', '.join(sorted(known))})")
    kept, skipped = [], []
    for study in spec.study:
        if names and study.name not in names:
            continue
        try:
            expand(SweepSpec(study=[study]))
        except ConfigError as exc:
            if not skip_unsupported:
                raise ConfigError(f"study {study.name!r}: {exc} (--skip-unsupported leaves it out)") from None
            skipped.append({"study": study.name, "reason": str(exc)})
            continue
        kept.append(study)
    return spec.model_copy(update={"study": kept}), skipped


def endpoint_settings(args: argparse.Namespace, base_url: str, model: str | None) -> Settings:
    return Settings.model_validate(
        {
            "endpoint": {"base_url": base_url, "model": model},
            "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
        }
    )


def local_settings(args: argparse.Namespace) -> Settings:
    local = {
        "model": args.model,
        "replicas": args.replicas,
        "parallel": args.parallel,
        "gpu_layers": args.gpu_layers,  # "20" is read as 20
        "ctx_per_slot": args.ctx_per_slot,
    }
    return Settings.model_validate(
        {
            "local": local,
            "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
            # Enough problems in flight to keep every slot of every replica busy.
            "concurrency": max(64, 2 * args.replicas * args.parallel),
        }
    )


def _command_output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def machine_info(local: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if shutil.which("nvidia-smi"):
        info["gpu"] = _command_output(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        )
    if local:
        from tmas.llm.local_command import llama_server_backend, llama_server_bin_dir

        with contextlib.suppress(TmasError):
            bin_dir = llama_server_bin_dir()
            info["llama_server"] = {"path": str(bin_dir / "llama-server"), "backend": llama_server_backend(bin_dir)}
    info["tmas_commit"] = _command_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    return info


async def write_report(spec: SweepSpec, sweep_dir: Path) -> dict[str, Path]:
    """The sweep's report (answers graded by rules: generated problems have exact answers); after a stop at a
    deadline, the combined report of the points that have begun."""
    grading = GradeConfig(mode="rules")
    points = expand(spec, sweep_dir)
    begun = [sweep_dir / "runs" / p.name for p in points if (sweep_dir / "runs" / p.name / "run.sqlite").exists()]
    if len(begun) == len(points):
        return await report_sweep(spec, sweep_dir, grading, None)
    return await build_report(begun, sweep_dir / "report", grading, None) if begun else {}


async def run_comparison(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run (or continue) the comparison into ``args.out``; returns what comparison.json records."""
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.problems is not None:
        problems = args.problems.resolve()
        problem_info: dict[str, Any] = {"file": str(problems), "count": len(load_problems(problems))}
    else:
        problems = args.out / "problems.jsonl"
        count = write_problems(problems, args.per_family, args.level, args.seed)
        problem_info = {"file": str(problems), "count": count, "families": sorted(FAMILIES)}
        problem_info |= {"per_family": args.per_family, "level": args.level, "seed": args.seed}
    spec = load_spec(args.grid)
    spec.problems = str(problems)
    names = [n.strip() for n in args.studies.split(",") if n.strip()] if args.studies else None
    spec, skipped = select_studies(spec, names, args.skip_unsupported)
    for item in skipped:
        print(f"method_comparison: leaving out study {item['study']!r}: {item['reason']}", file=sys.stderr)
    if args.budget_tokens is not None:
        spec.budget = Budget(tokens=args.budget_tokens)
    sweep_dir = args.out / "sweep"
    outcomes: list[PointOutcome] = []

    def progress(outcome: PointOutcome) -> None:
        outcomes.append(outcome)
        print(f"method_comparison: {outcome.point.name}: {outcome.status}", file=sys.stderr, flush=True)

    stopped_early = False
    async with contextlib.AsyncExitStack() as stack:
        server: Any
        if args.sim:
            sim = stack.enter_context(SimServer(SimScript(model="simulated")))
            settings, server = endpoint_settings(args, sim.base_url, "simulated"), "simulated"
        elif args.base_url:
            settings = endpoint_settings(args, args.base_url, args.endpoint_model)
            server = settings.endpoint.model_dump(mode="json", include={"base_url", "model"})
        else:
            settings = local_settings(args)
            server = settings.local.model_dump(mode="json")
        # The servers start once for the whole sweep; every point's run uses them as its endpoint.
        live = await stack.enter_async_context(provisioned(settings, log_dir=args.out))
        try:
            await asyncio.wait_for(run_sweep(spec, live, sweep_dir, on_point=progress), args.stop_after)
        except TimeoutError:
            stopped_early = True
            print("method_comparison: --stop-after reached; finished problems are kept", file=sys.stderr)
    report = {} if args.no_report else await write_report(spec, sweep_dir)
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(local=settings.uses_local_model),
        "server": server,
        "sampling": settings.sampling.model_dump(mode="json", exclude_defaults=True),
        "grid": str(args.grid),
        "problems": problem_info,
        "budget": spec.budget.identity(),
        "studies": list(dict.fromkeys(study.name for study in spec.study)),
        "skipped_studies": skipped,
        "points": {o.point.name: o.status for o in outcomes},
        "stopped_early": stopped_early,
        "report": {name: str(path) for name, path in report.items()},
        "wall_s": round(time.monotonic() - started, 1),
    }
    (args.out / "comparison.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/method_comparison.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        record = asyncio.run(run_comparison(args, command))
    except TmasError as exc:
        print(f"method_comparison: error: {exc}", file=sys.stderr)
        return 1
    print(record["report"].get("markdown", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
