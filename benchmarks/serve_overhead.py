"""What `tmas serve` adds to a request, against the SIMULATED upstream (no model, no upstream latency): the same
CoT question solved in-process (``tmas.asolve`` with a run directory, as `tmas solve -o` does) and through the proxy
with the official openai client, sequentially and with several clients at once. Every proxied request is a run
directory of its own, so most of the difference is the store's set-up; on a real model it is noise.

    PYTHONPATH=src .venv/bin/python benchmarks/serve_overhead.py --requests 40
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from tmas.api import asolve
from tmas.config import Settings
from tmas.serve.launch import ServeOptions
from tmas.testing import SimScript, SimServer
from tmas.testing.web_servers import ProxyThread


def settings(sim: SimServer) -> Settings:
    return Settings.model_validate(
        {"endpoint": {"base_url": [sim.base_url], "model": "sim-model"}, "method": {"name": "cot"}}
    )


def direct(sim: SimServer, n: int, scratch: Path) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        asyncio.run(asolve(f"What is {i}*7?", settings(sim), run_dir=scratch / f"direct-{i}"))
        times.append(time.perf_counter() - start)
    return times


def proxied(proxy: ProxyThread, n: int, clients: int) -> tuple[list[float], float]:
    api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)

    def one(i: int) -> float:
        start = time.perf_counter()
        api.chat.completions.create(model="cot/sim-model", messages=[{"role": "user", "content": f"What is {i}*9?"}])
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        times = list(pool.map(one, range(n)))
    return times, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    with SimServer(SimScript()) as sim, tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        rows = [("in-process (tmas.asolve, run dir)", direct(sim, args.requests, scratch), None)]
        options = ServeOptions(serve_dir=scratch / "served", max_problems=args.clients)
        with ProxyThread(settings(sim), options) as proxy:
            times, _ = proxied(proxy, args.requests, 1)
            rows.append(("proxy, 1 client", times, None))
            times, wall = proxied(proxy, args.requests, args.clients)
            rows.append((f"proxy, {args.clients} clients", times, args.requests / wall))
    print("| path | median ms | p90 ms | requests/s |\n| --- | --- | --- | --- |")
    for name, times, rate in rows:
        p90 = statistics.quantiles(times, n=10)[-1]
        per_s = rate if rate is not None else 1 / statistics.mean(times)
        print(f"| {name} | {1000 * statistics.median(times):.1f} | {1000 * p90:.1f} | {per_s:.1f} |")


if __name__ == "__main__":
    main()
