"""`tmas serve` under load: many concurrent clients (half of them streaming) through the proxy in front of the
simulated upstream answering as vLLM, against the same requests sent straight to the simulator.

The simulator and the proxy run as processes of their own (``python -m tmas.testing.sim_server`` and
``python -m tmas serve``); the clients are aiohttp coroutines in this process. Three phases:

1. direct: every client at once sends its question straight to the simulator;
2. proxy: every client at once sends it through the proxy (CoT: one upstream call each); past ``--max-problems``
   the requests wait in the proxy's queue;
3. one at a time: ``--paired`` requests, each direct then through the proxy, for what the proxy adds to one request
   when nothing waits.

Reported: answers, peak RSS of the proxy process (VmHWM), the proxy's peak queue, latency percentiles of each phase
and the latency the proxy adds (proxy minus direct).

    PYTHONPATH=src .venv/bin/python benchmarks/serve_load.py --clients 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from tmas.testing.web_servers import free_port

SRC = Path(__file__).resolve().parents[1] / "src"


@contextmanager
def process(cmd: list[str], ready_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            asyncio.run(wait_ready(ready_url, proc))
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=30)


async def wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}")  # type: ignore[arg-type]
            try:
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit(f"{url} did not answer in 60 s")


async def ask(session: aiohttp.ClientSession, base: str, model: str, i: int, stream: bool) -> tuple[float, str]:
    """One chat completion; its latency and the answer's text (streamed or not)."""
    body = {"model": model, "messages": [{"role": "user", "content": f"What is {i}*7?"}], "stream": stream}
    start = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"request {i}: HTTP {resp.status}: {(await resp.text())[:200]}")
        if not stream:
            reply = await resp.json()
            return time.perf_counter() - start, reply["choices"][0]["message"]["content"] or ""
        text = []
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {i}: {chunk['error']['message']}")
            text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
        return time.perf_counter() - start, "".join(text)


async def burst(base: str, model: str, clients: int, stats_url: str | None) -> tuple[list[float], int, float]:
    """Every client at once (even ones streaming); latencies, the peak queue seen, wall time."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    peak = 0
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def watch() -> None:
            nonlocal peak
            while stats_url is not None:
                async with session.get(stats_url) as resp:
                    peak = max(peak, (await resp.json())["peak_queued"])
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        results = await asyncio.gather(*(ask(session, base, model, i, i % 2 == 0) for i in range(clients)))
        wall = time.perf_counter() - start
        watcher.cancel()
    for i, (_, text) in enumerate(results):
        if f"\\boxed{{{i * 7}}}" not in text:
            raise RuntimeError(f"client {i} got a wrong answer: {text[:200]!r}")
    return [latency for latency, _ in results], peak, wall


async def paired(sim: str, proxy: str, n: int) -> list[float]:
    """What the proxy adds to one request when nothing waits: proxy minus direct latency, request by request."""
    added = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            direct, _ = await ask(session, sim, "sim-model", i, i % 2 == 0)
            through, _ = await ask(session, proxy, "cot/sim-model", i, i % 2 == 0)
            added.append(through - direct)
    return added


def pct(values: list[float], q: int) -> float:
    return 1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--latency", type=float, default=0.05, help="simulated seconds per upstream call")
    parser.add_argument("--max-problems", type=int, default=4, help="the proxy's problem slots (its default: 4)")
    parser.add_argument("--paired", type=int, default=100, help="one-at-a-time requests for the added latency")
    args = parser.parse_args()
    sim_port, proxy_port = free_port(), free_port()
    sim, proxy = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{proxy_port}"
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        sim_cmd = [sys.executable, "-m", "tmas.testing.sim_server", "--port", str(sim_port), "--persona", "vllm"]
        sim_cmd += ["--latency", str(args.latency)]
        proxy_cmd = [sys.executable, "-m", "tmas", "serve", "--base-url", f"{sim}/v1", "--model", "sim-model"]
        proxy_cmd += ["--port", str(proxy_port), "--dir", str(scratch / "served"), "--no-resume"]
        proxy_cmd += ["--max-problems", str(args.max_problems), "--max-queue", str(max(1024, args.clients))]
        with (
            process(sim_cmd, f"{sim}/v1/models", scratch / "sim.log"),
            process(proxy_cmd, f"{proxy}/health", scratch / "proxy.log") as proxy_proc,
        ):
            direct, _, direct_wall = asyncio.run(burst(sim, "sim-model", args.clients, None))
            through, peak_queue, proxy_wall = asyncio.run(burst(proxy, "cot/sim-model", args.clients, f"{proxy}/stats"))
            added = asyncio.run(paired(sim, proxy, args.paired))
            rss = peak_rss_mib(proxy_proc.pid)
    print(f"clients: {args.clients} (half streaming), all answered; upstream latency {args.latency * 1000:.0f} ms")
    print(f"proxy: --max-problems {args.max_problems}, peak queue {peak_queue}, peak RSS {rss:.0f} MiB")
    print("| phase | wall s | p50 ms | p99 ms |\n| --- | --- | --- | --- |")
    print(f"| direct, {args.clients} at once | {direct_wall:.1f} | {pct(direct, 50):.0f} | {pct(direct, 99):.0f} |")
    print(f"| proxy, {args.clients} at once | {proxy_wall:.1f} | {pct(through, 50):.0f} | {pct(through, 99):.0f} |")
    print(f"added at {args.clients} at once: p50 {pct(through, 50) - pct(direct, 50):.0f} ms, ", end="")
    print(f"p99 {pct(through, 99) - pct(direct, 99):.0f} ms")
    print(f"added one at a time ({args.paired} pairs): p50 {pct(added, 50):.1f} ms, p99 {pct(added, 99):.1f} ms")


if __name__ == "__main__":
    main()
