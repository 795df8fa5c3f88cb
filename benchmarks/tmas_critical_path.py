"""How close a TMAS iteration's wall time comes to its dependency chain (Algorithm 1's parallelism).

The simulated server answers every call after a fixed latency, with no binding concurrency cap on either side. One
iteration can then be no faster than its chain: solution + verification + summary + max(experience, guideline).
The figure is (sum over iterations of that chain) / (measured wall time of the problem); 1.0 is perfect overlap.

    .venv/bin/python benchmarks/tmas_critical_path.py [--latency 0.2] [--n 8] [--m 8] [--iterations 5]

Two chains are reported: the nominal one (4 x latency per iteration) and the one measured from the calls' own
latencies in the run store (the slowest candidate's solution + verification + summary, plus the slower memory
agent), which also charges the client's per-call overhead to the chain rather than to scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from tmas.config import Settings
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import SimScript, SimServer


@contextlib.contextmanager
def sim_server(latency: float, in_process: bool, script: SimScript | None = None) -> Iterator[str]:
    """The simulated server's root URL: in a thread of this process, or (default) a process of its own, as a real
    server would be, so its request handling does not compete with the client for this interpreter's lock."""
    # Without a script of its own the request log is off: nothing reads it and it would only grow.
    script = script.model_copy(update={"latency_s": latency}) if script else SimScript(latency_s=latency, log_limit=0)
    if in_process:
        with SimServer(script) as sim:
            yield sim.url
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        handle.write(script.model_dump_json())
    command = [sys.executable, "-m", "tmas.testing.sim_server", "--port", str(port), "--script", handle.name]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the simulated server did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        os.unlink(handle.name)


def server_stats(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/_sim/stats", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def measured_chain(store: RunStore, n: int, m: int, problem_id: str | None = None) -> float:
    """Sum over iterations of max_i(solution_i + max_j verification_ij + summary_i) + max(experience, guideline)."""
    lat: dict[int, dict[tuple[str, int], float]] = defaultdict(dict)
    for call in store.calls(problem_id):
        assert call.key.iteration is not None
        lat[call.key.iteration][(call.key.role, call.key.sample)] = call.latency_s
    total = 0.0
    for calls in lat.values():
        paths = [
            calls[("solution", i)] + max(calls[("verifier", i * m + j)] for j in range(m)) + calls[("summary", i)]
            for i in range(n)
        ]
        total += max(paths) + max(calls.get(("experience", 0), 0.0), calls.get(("guideline", 0), 0.0))
    return total


async def measure(latency: float, n: int, m: int, iterations: int, in_process: bool) -> tuple[float, float, float]:
    with sim_server(latency, in_process) as url, tempfile.TemporaryDirectory() as scratch:
        settings = Settings.model_validate(
            {
                "endpoint": {"base_url": [f"{url}/v1"], "model": "sim-model"},
                "concurrency": 4096,
                "sampling": {"temperature": 0.7, "max_tokens": 256},
                # Algorithm 1 as written: every iteration's chain ends with its summaries and memory update.
                "method": {
                    "name": "tmas",
                    "params": {"n": n, "m": m, "iterations": iterations, "epsilon": 0.2, "skip_final_memory": False},
                },
            }
        )
        problem = Problem(problem_id="bench", question="What is 17*23?")
        store, settings, problems = prepare_run(Path(scratch) / "run", settings, [problem], resume=False)
        with store:
            summary = await run_problems(settings, problems, store, keep_results=True)
            result = summary.results[0]
            assert result.status == "done" and len(result.iterations) == iterations, result.error
            wall = summary.wall_s
            chain = measured_chain(store, n, m)
        max_in_flight = server_stats(url)["max_in_flight"]
        assert isinstance(max_in_flight, int) and max_in_flight >= n * m  # nothing capped the fan-out
    return iterations * 4 * latency, chain, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--in-process", action="store_true", help="run the simulated server in a thread here")
    args = parser.parse_args()
    started = time.monotonic()
    nominal, chain, wall = asyncio.run(measure(args.latency, args.n, args.m, args.iterations, args.in_process))
    calls = args.iterations * (args.n + args.n * args.m + args.n + 2)
    print(f"TMAS N={args.n} M={args.m} T={args.iterations}, {calls} calls, latency {args.latency}s per call")
    where = "a thread of the benchmark" if args.in_process else "its own process"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; server in {where}"
    )
    print(f"wall time of the problem:            {wall:.3f} s")
    print(f"nominal chain (4 x latency x T):     {nominal:.3f} s   ratio {nominal / wall:.3f}")
    print(f"measured chain (calls' own latency): {chain:.3f} s   ratio {chain / wall:.3f}")
    print(f"(benchmark total {time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
