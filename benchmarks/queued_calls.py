"""Calls queued behind a busy server: are they waited for, and sent once?

A simulated vLLM replica generates at most 4 sequences at once (``max_running``), each for 3 s; 64 calls are sent at
once with ``timeout_s`` 1, so 60 of them wait in the server's queue, silent (vLLM sends its stream's headers, then
nothing until the first token), for up to 45 s. A client that took the silence for a stall would close them and send
them again to the back of the queue. The figures: calls answered, requests the server received, requests it saw
abandoned, retries, and the wall time against the 16 x 3 s the queue needs at the least.

    PYTHONPATH=src python benchmarks/queued_calls.py [--calls 64] [--running 4] [--seconds 3] [--timeout 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

from tmas.config import Settings
from tmas.llm.client import LLMClient
from tmas.llm.model import ClientStats
from tmas.llm.types import user
from tmas.testing import Rule, SimScript, SimServer


async def measure(calls: int, running: int, seconds: float, timeout_s: float) -> dict[str, object]:
    script = SimScript(persona="vllm", max_running=running, rules=[Rule(latency_s=seconds)])
    with SimServer(script) as sim:
        settings = Settings.model_validate(
            {
                "endpoint": {"base_url": sim.base_url, "model": "sim-model", "timeout_s": timeout_s},
                "concurrency": calls,
                "sampling": {"max_tokens": 64},
            }
        )
        stats = ClientStats()
        started = time.monotonic()
        async with LLMClient(settings, stats=stats) as llm:
            done = await asyncio.gather(*(llm.chat("solution", [user(f"What is {i}*7?")]) for i in range(calls)))
        wall = time.monotonic() - started
        served = sim.stats()
    least = -(-calls // running) * seconds
    return {
        "calls": calls,
        "answered": sum(c.ok for c in done),
        "requests_received": served.total_requests,
        "requests_abandoned": served.aborted,
        "retries": stats.retries,
        "most_waiting_at_once": served.max_waiting,
        "longest_first_token_s": round(max(c.first_token_s or 0.0 for c in done), 2),
        "wall_s": round(wall, 2),
        "least_possible_s": least,
        "over_least": round(wall / least - 1, 4),
        "machine": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.calls, args.running, args.seconds, args.timeout)), indent=2))


if __name__ == "__main__":
    main()
