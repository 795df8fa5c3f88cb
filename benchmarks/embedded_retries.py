"""Every retry explained: many calls to the embedded model's llama-server, in bursts with idle gaps between them.

Long runs on the embedded server used to send a few calls a second time after a "connection" error the server never
logged. One cause: llama-server (cpp-httplib) closes a keep-alive connection idle for 5 s, and a client pool that
keeps idle connections longer may send the next call on one just as the server closes it. The gaps here (seeded,
uniform in 0-7 s) cross that 5 s again and again. The figures: calls, failed calls, retries by cause, wall time, and
whether any retry cost generation: the tokens the server says it generated (its /metrics) against the completion
tokens of the replies the client used. Equal, every retried attempt failed before the server generated anything.

    PYTHONPATH=src python benchmarks/embedded_retries.py [--rounds 50] [--burst 10] [--slots 8] [--model NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time

import aiohttp

from tmas.config import LocalModel, Sampling, Settings
from tmas.llm.client import LLMClient
from tmas.llm.local_server import LocalServer
from tmas.llm.model import ClientStats
from tmas.llm.types import CallKey, user


async def measure(rounds: int, burst: int, slots: int, model: str, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    # The server runs with --metrics (tmas.llm.local_command): the tokens it generated are read there.
    cfg = LocalModel(model=model, parallel=slots, ctx_per_slot=1024, startup_timeout_s=300)
    async with LocalServer(cfg) as server:
        settings = Settings.model_validate(
            {"endpoint": {"base_url": server.base_url, "model": server.model}, "concurrency": slots}
        )
        stats = ClientStats()
        sampling = Sampling(temperature=0.7, max_tokens=32)
        started = time.monotonic()
        gaps = []
        async with LLMClient(settings, stats=stats) as llm:
            for r in range(rounds):
                calls = [
                    llm.chat(
                        "solution",
                        [user(f"What is {r} plus {i}? Answer with the number only.")],
                        key=CallKey(problem_id=f"r{r}", role="solution", sample=i),
                        sampling=sampling,
                    )
                    for i in range(burst)
                ]
                await asyncio.gather(*calls)
                gap = rng.uniform(0.0, 7.0)
                gaps.append(gap)
                await asyncio.sleep(gap)
        wall = time.monotonic() - started
        generated = await _tokens_predicted(server.base_url.removesuffix("/v1"))
    return {
        "calls": stats.calls,
        "failed": stats.failed,
        "retries": stats.retries,
        "retries_by_cause": stats.retries_by_cause,
        "gaps_between_4_and_6_s": sum(4.0 <= g <= 6.0 for g in gaps),
        "completion_tokens_used": stats.usage.completion_tokens,
        "tokens_the_server_generated": generated,
        "wall_s": round(wall, 1),
        "model": model,
        "slots": slots,
        "machine": platform.platform(),
    }


async def _tokens_predicted(root: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(f"{root}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith("llamacpp:tokens_predicted_total "):
                return float(line.split()[1])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--burst", type=int, default=10)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.rounds, args.burst, args.slots, args.model, args.seed)), indent=2))


if __name__ == "__main__":
    main()
