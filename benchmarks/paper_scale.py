"""The paper's scale rehearsed. Table 1's HLE-Math-100 TMAS cell (``preset = "paper"``: N = 8, M = 8,
T = 20, 100 problems, 164,000 calls) run as a user runs it, against 8 simulated vLLM replicas with thinking-length
replies, faults, a kill -9 half way and ``--resume``.

    PYTHONPATH=src .venv/bin/python benchmarks/paper_scale.py --out /tmp/paper-scale              # the paper's cell
    PYTHONPATH=src .venv/bin/python benchmarks/paper_scale.py --out /tmp/ps --problems 10 --iterations 4
    PYTHONPATH=src .venv/bin/python benchmarks/paper_scale.py --calibrate RUN_DIR [RUN_DIR ...]

Each replica is a simulator process of its own (``python -m tmas.testing.sim_server``, vLLM persona, its own prefix
cache of ``--cache-tokens``), answering every call with reasoning of 2K-60K tokens (log-normal, median 6K) and an
answer of 300-2K tokens (tmas.testing.long_replies), streamed in deltas of 2,000 tokens at ``--tokens-per-s``: a
reply above ``--timeout-s`` x the rate streams for longer in all than the client's ``timeout_s``, which bounds each
gap between chunks, not the reply. 2 % of calls stall (the simulator goes silent past the timeout), 2 % are cut
mid-stream, 1 % answer 503 (``--faults``). The problems are generated arithmetic (a stand-in for HLE-Math: the
simulator checks and answers them; 60 % of solutions right).

``tmas run`` runs in a subprocess; once half the calls are in its store it is killed with SIGKILL, then ``tmas run
--resume`` finishes the run (from a copy of the run as the kill left it, ``OUT/run-at-kill``, so that deleting
``OUT/figures/second_half.json`` measures the resume again). Then ``tmas report`` (rules grading) is timed, and the
viewer's first view of the run page and of a comparison of the run with a copy of itself (no second run of 164,000
calls: the copy is the same run under another directory), each in a fresh viewer without its background warm-up, as
benchmarks/view_pages.py times pages. Last, two runs of ``--routing-problems`` problems, least-loaded and cache-aware
routing, give the prompt share served from the replicas' caches and the spread of load (benchmarks/replica_routing.py's
figures, on these replies).

Every part writes its figures to ``OUT/figures/PART.json`` and is skipped when they are there, so an interrupted
benchmark continues where it stopped (a part cut short is run again). ``OUT/paper_scale.json`` gathers them; a
Markdown table against the goals is printed at the end. ``--calibrate`` prints zstd's ratio on real model
replies read from run stores (read only) beside the simulated reasoning's, at three lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replica_routing import spread
from tmas_critical_path import server_stats, sim_server
from view_pages import _fetch

from tmas.store.run_store import DB_NAME, RunStore
from tmas.testing import FaultRates, LongReplies, SimScript
from tmas.testing.long_replies import compression_ratio, prompt_digest
from tmas.testing.web_servers import AppThread
from tmas.view.app import view_app
from tmas.view.runs import discover

GIB = 2**30
# The goals the rehearsal is checked against.
GOALS = {
    "peak_rss_mib": 1024,
    "store_gb": 2.5,
    "store_of_plain": 1 / 8,
    "first_new_call_s": 30,
    "report_s": 60,
    "view_s": 1.0,
}


def calls_per_problem(n: int, m: int, iterations: int) -> int:
    """Algorithm 1 with the last iteration's memory update: N solutions, N x M verifications, N summaries, 2 memory."""
    return iterations * (n + n * m + n + 2)


def write_problems(path: Path, count: int) -> None:
    rng = random.Random(27)
    with path.open("w") as handle:
        for i in range(count):
            a, b, c = rng.randrange(11, 99), rng.randrange(11, 99), rng.randrange(1, 50)
            question = f"What is {a}*{b} - {c}?"
            handle.write(
                json.dumps({"problem_id": f"hle-math-{i:03d}", "question": question, "answer": str(a * b - c)})
            )
            handle.write("\n")


def sim_script(args: argparse.Namespace, replica: int) -> SimScript:
    return SimScript(
        persona="vllm",
        # Room for the paper preset's 128K-token output cap beside the longest prompts.
        context_length=262_144,
        long_replies=LongReplies(),
        latency_per_token_s=1.0 / args.tokens_per_s,
        faults=FaultRates(stall=args.faults[0], cut=args.faults[1], http_503=args.faults[2]),
        hang_s=3 * args.timeout_s,
        cache_report=True,
        prefix_cache_tokens=args.cache_tokens,
        accuracy=0.6,
        log_digests=True,
        log_limit=10_000_000,
        seed=replica,
    )


@contextlib.contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    """The replicas, a simulator process each; their root URLs."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(sim_server(0.0, False, sim_script(args, i))) for i in range(args.replicas)]


def write_config(path: Path, urls: list[str], args: argparse.Namespace, routing: str) -> None:
    """The run's tmas.toml: 8 replicas, the paper preset at the asked size, quick retries (faults are frequent here,
    and a real server answers again at once)."""
    path.write_text(
        f"""concurrency = {args.concurrency}
problems_in_flight = {args.problems_in_flight}

[endpoint]
base_url = {json.dumps([f"{url}/v1" for url in urls])}
model = "sim-model"
timeout_s = {args.timeout_s}
routing = "{routing}"

[retry]
backoff_base_s = 0.1
backoff_max_s = 2.0

[method]
name = "tmas"

[method.params]
preset = "paper"
n = {args.n}
m = {args.m}
iterations = {args.iterations}
"""
    )


def tmas_command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "tmas", *map(str, args)]


def stored_calls(run_dir: Path) -> int:
    """Calls in the run's store now (0 before it exists); read only, beside the writer."""
    try:
        with RunStore(run_dir, read_only=True) as store:
            return store.call_counts()["calls"]
    except Exception:  # not created yet, or its schema not yet written
        return 0


class Child:
    """``tmas`` in a subprocess, its output to a log; ``finish`` reaps it with its resource usage (wait4)."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log.open("w")
        self.started = time.time()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None

    def finish(self, kill: bool = False) -> dict[str, Any]:
        if kill:
            os.kill(self.proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self.log.close()
        return {
            "exit": self.proc.returncode,
            "wall_s": round(time.time() - self.started, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        }

    def cpu_s(self) -> float:
        """CPU seconds the process has used so far (Linux: /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.returncode is None:
            self.finish(kill=True)


def finished_calls(run_dir: Path) -> list[list[Any]]:
    """(problem, role, prompt digest, seed sent) of every call the store holds."""
    with RunStore(run_dir, read_only=True) as store:
        return [
            [
                c.key.problem_id,
                c.key.role,
                prompt_digest(store.call_messages(c.call_id or 0)),
                store.call_sampling(c.call_id or 0).get("seed"),
            ]
            for c in store.calls()
        ]


def chat_log(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/_sim/requests", timeout=120) as reply:
        return [r for r in json.loads(reply.read()) if r["endpoint"] == "chat"]


def part(out: Path, name: str) -> dict[str, Any] | None:
    path = out / "figures" / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def save(out: Path, name: str, figures: dict[str, Any]) -> dict[str, Any]:
    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "figures" / f"{name}.json").write_text(json.dumps(figures, indent=1))
    print(f"{name}: {json.dumps(figures)}", flush=True)
    return figures


# ---- the run: kill -9 half way, then --resume ----------------------------------------------------------------------


# The run directory as the kill -9 left it.
KILLED = "run-at-kill"


def first_half(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    out, run = args.out, args.out / "run"
    shutil.rmtree(run, ignore_errors=True)
    total = args.problems * calls_per_problem(args.n, args.m, args.iterations)
    write_config(out / "tmas.toml", urls, args, "cache")
    child = Child(
        tmas_command("run", out / "problems.jsonl", "--out", run, "--config", out / "tmas.toml"), out / "run1.log"
    )
    try:
        while child.running() and stored_calls(run) < total // 2:
            time.sleep(0.05)
        killed_at = time.time()
        figures = child.finish(kill=True)
    finally:
        child.stop()
    before = finished_calls(run)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    (out / "figures" / "finished_before_kill.json").write_text(json.dumps(before))
    # The run as the kill left it: the resume can be measured again on it (delete figures/second_half.json).
    shutil.rmtree(out / KILLED, ignore_errors=True)
    shutil.copytree(run, out / KILLED)
    return {**figures, "calls_planned": total, "calls_at_kill": len(before), "killed_at": killed_at}


def second_half(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    out, run = args.out, args.out / "run"
    shutil.rmtree(run)
    shutil.copytree(out / KILLED, run)
    asked_before = sum(int(server_stats(url)["total_requests"]) for url in urls)  # type: ignore[call-overload]
    # The same settings with the replicas' addresses now: a resume measured again runs against new replicas.
    write_config(out / "tmas.toml", urls, args, "cache")
    child = Child(tmas_command("run", "--resume", run, "--config", out / "tmas.toml"), out / "run2.log")
    started = child.started
    try:
        # The CPU the resumed process had used when its first new call reached a replica: what the resume itself
        # costs, apart from the wait for a busy machine's cores.
        cpu_at_first_call = None
        while child.running() and cpu_at_first_call is None:
            if sum(int(server_stats(url)["total_requests"]) for url in urls) > asked_before:  # type: ignore[call-overload]
                cpu_at_first_call = round(child.cpu_s(), 2)
            time.sleep(0.1)
        figures = child.finish()
    finally:
        child.stop()
    if figures["exit"] != 0:
        raise SystemExit(f"tmas run --resume failed (exit {figures['exit']}): see {out / 'run2.log'}")
    logs = [chat_log(url) for url in urls]
    after = [r for log in logs for r in log if r["received_at"] >= started]
    before = json.loads((out / "figures" / "finished_before_kill.json").read_text())
    finished = {tuple(c) for c in before}
    # A new request leads with its lowest missing sample's seed: a finished call's seed on its prompt is a resend.
    same_seed = sum((r["problem_id"], r["role"], r["body"]["prompt"], r["body"]["seed"]) in finished for r in after)
    # Samples asked after the resume (retries of one request counted once) against the calls stored after it.
    asked: dict[tuple[Any, ...], set[tuple[Any, Any]]] = defaultdict(set)
    for r in after:
        asked[(r["problem_id"], r["role"], r["body"]["prompt"])].add((r["body"]["seed"], r["body"]["n"]))
    now = Counter((c[0], c[1], c[2]) for c in finished_calls(run))
    then = Counter((c[0], c[1], c[2]) for c in before)
    beyond = sum(
        max(0, sum(n for _, n in requests) - (now[prompt] - then[prompt])) for prompt, requests in asked.items()
    )
    with RunStore(run, read_only=True) as store:
        done = len(store.finished_problem_ids())
        counts = store.call_counts()
    return {
        **figures,
        "first_new_call_s": round(min(r["received_at"] for r in after) - started, 2) if after else None,
        "cpu_s_at_first_new_call": cpu_at_first_call,
        "requests_after_resume": len(after),
        "requests_with_a_finished_calls_seed": same_seed,
        "samples_asked_beyond_new_calls": beyond,
        "problems_done": done,
        "calls": counts["calls"],
        "failed_calls": counts["failed"],
        "replicas": replica_figures(urls),
    }


def replica_figures(urls: list[str]) -> dict[str, Any]:
    """Prompt share served from the replicas' caches, load spread and faults, from the simulators' counters."""
    stats = [server_stats(url) for url in urls]
    prompt = sum(int(s["prompt_tokens"]) for s in stats)  # type: ignore[call-overload]
    faults: Counter[str] = Counter()
    for s in stats:
        faults.update(s["faults"])  # type: ignore[arg-type]
    return {
        "cached_share": round(sum(int(s["cached_prompt_tokens"]) for s in stats) / prompt, 4) if prompt else None,  # type: ignore[call-overload]
        "calls_spread": spread([int(s["completed"]) for s in stats]),  # type: ignore[call-overload]
        "tokens_spread": spread([int(s["prompt_tokens"]) + int(s["completion_tokens"]) for s in stats]),  # type: ignore[call-overload]
        "requests": sum(int(s["total_requests"]) for s in stats),  # type: ignore[call-overload]
        "reasoning_tokens": sum(int(s["reasoning_tokens"]) for s in stats),  # type: ignore[call-overload]
        "faults": dict(faults),
        "disconnected": sum(int(s["disconnected"]) for s in stats),  # type: ignore[call-overload]
    }


# ---- what the run left: store, report, viewer ------------------------------------------------------------------------


def store_figures(args: argparse.Namespace) -> dict[str, Any]:
    run = args.out / "run"
    on_disk = sum(p.stat().st_size for p in run.iterdir() if p.name.startswith(DB_NAME))
    plain = calls = 0
    with RunStore(run, read_only=True) as store:
        for call in store.calls():
            messages = store.call_messages(call.call_id or 0)
            texts = [m["content"] for m in messages] + [call.content, call.reasoning or ""]
            plain += sum(len(t.encode()) for t in texts)
            calls += 1
    return {
        "calls": calls,
        "store_bytes": on_disk,
        "plain_text_bytes": plain,
        "store_of_plain": round(on_disk / plain, 4),
        "store_kib_per_call": round(on_disk / 1024 / calls, 1),
    }


def report_figures(args: argparse.Namespace) -> dict[str, Any]:
    target = args.out / "report"
    shutil.rmtree(target, ignore_errors=True)
    started = time.monotonic()
    command = tmas_command("report", args.out / "run", "--out", target, "--grade", "rules")
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"tmas report failed: {done.stderr[-2000:]}")
    return {"report_s": round(seconds, 1)}


def view_figures(args: argparse.Namespace) -> dict[str, Any]:
    run, copy = args.out / "run", args.out / "run-copy"
    if not copy.exists():
        copy.mkdir()
        for path in run.iterdir():
            if path.name.startswith(DB_NAME):
                shutil.copy2(path, copy / path.name)
    figures: dict[str, Any] = {"comparison_of": "the run and a copy of it in another directory"}
    # A fresh viewer for each page, without the background warm-up: nothing of either run is cached yet.
    with AppThread(view_app([run], warm_up=False)) as viewer:
        [ref] = discover([run])
        figures["run_page_s"], _ = _fetch(f"{viewer.url}/run/{ref.key}")
    with AppThread(view_app([run, copy], warm_up=False)) as viewer:
        first, second = discover([run, copy])
        figures["comparison_s"], _ = _fetch(f"{viewer.url}/compare?run={first.key}&run={second.key}")
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in figures.items()}


def routing_figures(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    """Least-loaded against cache-aware routing on ``--routing-problems`` problems (fresh replica counters each)."""
    out = args.out / "routing"
    out.mkdir(parents=True, exist_ok=True)
    write_problems(out / "problems.jsonl", args.routing_problems)
    figures: dict[str, Any] = {"problems": args.routing_problems}
    for routing in ("load", "cache"):
        for url in urls:
            urllib.request.urlopen(urllib.request.Request(f"{url}/_sim/reset", method="POST"), timeout=10).close()
        shutil.rmtree(out / routing, ignore_errors=True)
        write_config(out / f"{routing}.toml", urls, args, routing)
        command = tmas_command(
            "run", out / "problems.jsonl", "--out", out / routing, "--config", out / f"{routing}.toml"
        )
        child = Child(command, out / f"{routing}.log")
        try:
            run = child.finish()
        finally:
            child.stop()
        figures[routing] = {"wall_s": run["wall_s"], **replica_figures(urls)}
    return figures


# ---- the Markdown table ------------------------------------------------------------------------------------------


def table(figures: dict[str, Any]) -> str:
    run1, run2 = figures["first_half"], figures["second_half"]
    store, report, view = figures["store"], figures["report"], figures["view"]
    routing = figures.get("routing")
    calls = run2["calls"]
    peak = max(run1["peak_rss_mib"], run2["peak_rss_mib"])
    cpu_ms = 1000 * (run1["cpu_s"] + run2["cpu_s"]) / calls
    resent = run2["requests_with_a_finished_calls_seed"] + run2["samples_asked_beyond_new_calls"]

    def met(ok: bool) -> str:
        return "met" if ok else "**missed**"

    rows = [
        ("peak memory of `tmas run` (both halves)", "<= 1 GiB", f"{peak:.0f} MiB", met(peak <= GOALS["peak_rss_mib"])),
        ("orchestrator CPU per call", "", f"{cpu_ms:.2f} ms ({calls:,} calls)", ""),
        (
            "store on disk",
            "<= 2.5 GB",
            f"{store['store_bytes'] / 1e6:,.1f} MB",
            met(store["store_bytes"] / 1e9 <= GOALS["store_gb"]),
        ),
        (
            "store / plain text held",
            "<= 1/8",
            f"{store['store_of_plain']:.3f} (1/{1 / store['store_of_plain']:.1f}) of "
            f"{store['plain_text_bytes'] / 1e6:,.1f} MB",
            met(store["store_of_plain"] <= GOALS["store_of_plain"]),
        ),
        (
            "first new call after `--resume`",
            "< 30 s",
            f"{run2['first_new_call_s']} s",
            met(run2["first_new_call_s"] is not None and run2["first_new_call_s"] < GOALS["first_new_call_s"]),
        ),
        ("finished calls sent again", "0", str(resent), met(resent == 0)),
        (
            "problems finished",
            "all",
            f"{run2['problems_done']} of {figures['problems']}",
            met(run2["problems_done"] == figures["problems"]),
        ),
        ("`tmas report` (rules grading)", "< 60 s", f"{report['report_s']} s", met(report["report_s"] < 60)),
        ("`tmas view`: run page, first view", "< 1 s", f"{view['run_page_s']} s", met(view["run_page_s"] < 1)),
        (
            "`tmas view`: comparison of two runs, first view",
            "< 1 s",
            f"{view['comparison_s']} s",
            met(view["comparison_s"] < 1),
        ),
    ]
    main = run2["replicas"]
    rows.append(
        (
            "cache-aware routing, this run: prompt share from cache; busiest replica / mean (calls, tokens)",
            "",
            f"{main['cached_share']}; {main['calls_spread']['busiest_over_mean']}, "
            f"{main['tokens_spread']['busiest_over_mean']}",
            "",
        )
    )
    if routing:
        for name in ("load", "cache"):
            r = routing[name]
            rows.append(
                (
                    f"routing = {name} ({routing['problems']} problems): share from cache; busiest / mean",
                    "",
                    f"{r['cached_share']}; {r['calls_spread']['busiest_over_mean']}, "
                    f"{r['tokens_spread']['busiest_over_mean']}",
                    "",
                )
            )
    lines = ["| figure | goal | measured | |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


# ---- calibration -----------------------------------------------------------------------------------------------------

CALIBRATION_CHARS = (4_000, 16_000, 64_000)


def calibrate(run_dirs: list[Path]) -> dict[str, Any]:
    """zstd's ratio on stretches of real replies (read only), beside the simulated reasoning's at the same lengths."""
    import zstandard

    replies: list[str] = []
    for run_dir in run_dirs:
        with RunStore(run_dir, read_only=True) as store:
            replies += [text for c in store.calls() for text in (c.content, c.reasoning) if text]
    if not replies:
        raise SystemExit("no replies in those runs")
    compressor = zstandard.ZstdCompressor(level=3)
    rng = random.Random(0)
    real = {}
    for size in CALIBRATION_CHARS:
        ratios = []
        for _ in range(20):
            rng.shuffle(replies)  # replies of different problems and roles, one after another
            blob = "\n\n".join(replies).encode()[:size]
            ratios.append(len(blob) / len(compressor.compress(blob)))
        real[size] = round(sum(ratios) / len(ratios), 2)
    simulated = {size: round(compression_ratio(size), 2) for size in CALIBRATION_CHARS}
    return {
        "replies": len(replies),
        "reply_chars": sum(map(len, replies)),
        "real": real,
        "simulated": simulated,
        "repeat_share": LongReplies().repeat_share,
    }


# ---- main ------------------------------------------------------------------------------------------------------------


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder of the runs and figures (a second call continues it)")
    parser.add_argument("--problems", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--tokens-per-s", type=float, default=4000.0, help="each reply's streaming rate")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the client's timeout_s (per gap)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--problems-in-flight", type=int, default=100)
    parser.add_argument("--cache-tokens", type=int, default=200_000, help="prefix cache per replica, tokens")
    parser.add_argument("--routing-problems", type=int, default=10, help="problems of each routing run (0: none)")
    parser.add_argument(
        "--faults",
        type=float,
        nargs=3,
        default=[0.02, 0.02, 0.01],
        metavar=("STALL", "CUT", "HTTP_503"),
        help="share of calls that stall, are cut mid-stream, answer 503",
    )
    parser.add_argument("--calibrate", type=Path, nargs="+", metavar="RUN_DIR", help="only calibrate, on these runs")
    parser.add_argument(
        "--view-only",
        type=Path,
        metavar="OUT",
        help="only time the viewer's first views of a finished rehearsal's run (OUT as --out), 3 times: the medians",
    )
    args = parser.parse_args(argv)
    if args.out is None and not args.calibrate and not args.view_only:
        parser.error("--out is required")
    return args


def main() -> None:
    args = arguments()
    if args.calibrate:
        print(json.dumps(calibrate(args.calibrate), indent=2))
    elif args.view_only:
        timings = [view_figures(argparse.Namespace(out=args.view_only)) for _ in range(3)]
        print(json.dumps({key: statistics.median(t[key] for t in timings) for key in ("run_page_s", "comparison_s")}))
    else:
        run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    keys = ("problems", "iterations", "n", "m", "replicas", "tokens_per_s", "timeout_s", "faults")
    shape = {key: getattr(args, key) for key in keys}
    known = out / "shape.json"
    if known.exists() and json.loads(known.read_text()) != shape:
        raise SystemExit(f"{out} holds a rehearsal of another shape ({known}): give another --out")
    known.write_text(json.dumps(shape))
    write_problems(out / "problems.jsonl", args.problems)
    figures: dict[str, Any] = {"problems": args.problems}
    needs_replicas = part(out, "second_half") is None or (args.routing_problems and part(out, "routing") is None)
    with replicas(args) if needs_replicas else contextlib.nullcontext([]) as urls:
        for name, measure in (("first_half", first_half), ("second_half", second_half)):
            figures[name] = part(out, name) or save(out, name, measure(args, urls))
        for name, local in (("store", store_figures), ("report", report_figures), ("view", view_figures)):
            figures[name] = part(out, name) or save(out, name, local(args))
        if args.routing_problems:
            figures["routing"] = part(out, "routing") or save(out, "routing", routing_figures(args, urls))
    figures["shape"] = shape
    figures["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    figures["date"] = datetime.date.today().isoformat()
    (out / "paper_scale.json").write_text(json.dumps(figures, indent=1))
    print(table(figures))
    return figures


if __name__ == "__main__":
    main()
