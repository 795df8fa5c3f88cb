"""Prompt tokens served from cache and the spread of load over 8 replicas, least-loaded against
cache-aware routing, on the paper's call shapes.

    .venv/bin/python benchmarks/replica_routing.py [--problems 32] [--iterations 4] [--bounds 1.1 1.25]

TMAS with N = 8, M = 8 (epsilon 0.2, the last iteration's summaries and memory updates made, as in the paper) runs
over ``--problems`` generated problems, ``--problems-in-flight`` at once under a cap of ``--concurrency`` calls, against
8 simulated replicas (one SimServer each, in this process). The replies are a tenth of the paper's lengths for a
thinking model (content only: the thinking is never sent back): a solution 200 tokens, a verification 100, a summary
40; the prompt templates are the real ones. Calls take what thinking takes, scaled down (``--time-scale``): a
solution 1.6 s, a verification 0.6 s, a summary 0.2 s, a memory agent 0.3 s.

Each replica answers as vLLM (``persona="vllm"``: streamed replies, ``n`` per request, which ``--batch-samples``
governs) with its own prefix cache, whose hits it reports. The share is also worked out afterwards by replaying the
prompts each received, in arrival order, through :class:`tmas.testing.prefix_cache.PrefixCache` (16-token blocks,
least recently used out), the same way the one-replica figures are. Capacity per replica
(``--capacity``, 20,000 tokens): an H100 running Qwen3-4B (bf16, 144 KiB of KV per token) holds about 400,000
tokens of KV; half of it is taken by the sequences being decoded (their thinking), and the simulated replies are a
tenth of the real ones, so 400,000 / 2 / 10. The same calls sent to one replica are the cache-aware run's prompts of
all 8 replicas merged in arrival order, replayed through one cache of that capacity and through one of 8 times it.

Prints one JSON object: per routing, the share of prompt tokens served from cache, and calls and tokens (prompt +
completion) per replica with the busiest replica against the mean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tmas.config import Endpoint, Settings
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.testing import Rule, SimRequest, SimScript, SimServer, register_responder
from tmas.testing.prefix_cache import PrefixCache, prompt_tokens
from tmas.testing.responders import content_text, solution_responder
from tmas.testing.sim_server import LoggedRequest
from tmas.testing.tmas_responders import summary_responder, verifier_responder

REPLICAS = 8
N, M = 8, 8
# Simulated reply lengths in tokens (words), a tenth of a thinking model's final content in the paper's setting.
SOLUTION_TOKENS, VERIFICATION_TOKENS, SUMMARY_TOKENS = 200, 100, 40
# Seconds per call at --time-scale 1: a tenth of the thinking a call takes at about 40 tokens/s, then / 25.
LATENCY_S = {"solution": 1.6, "verifier": 0.6, "summary": 0.2, "experience": 0.3, "guideline": 0.3}
_WORDS = (
    *("consider", "the", "sum", "over", "all", "pairs", "then", "bound", "each", "term", "by", "its", "square"),
    *("hence", "since", "modulo", "prime", "divides", "integer", "case", "parity", "induction", "assume", "so"),
    *("equality", "holds", "when", "substitute", "into", "equation", "root", "polynomial", "degree", "factor"),
)


def _words(req: SimRequest, count: int) -> str:
    """``count`` words fixed by the request (its seed included): every sample differs, a repeated request does not."""
    rng = random.Random(req.sample_key)
    return " ".join(rng.choice(_WORDS) for _ in range(count)) + "."


def register_paper_lengths() -> None:
    """The simulator's solution, verifier and summary replies, lengthened to the simulated paper's shapes."""

    @register_responder("solution")
    def solution(req: SimRequest) -> str:
        return f"{_words(req, SOLUTION_TOKENS)}\n\n{solution_responder(req)}"

    @register_responder("verifier")
    def verifier(req: SimRequest) -> str:
        return f"{_words(req, VERIFICATION_TOKENS)}\n\n{verifier_responder(req)}"

    @register_responder("summary")
    def summary(req: SimRequest) -> str:
        return f"{summary_responder(req)} {_words(req, SUMMARY_TOKENS)}"


def script(time_scale: float, capacity: int) -> SimScript:
    rules = [Rule(role=role, latency_s=seconds * time_scale) for role, seconds in LATENCY_S.items()]
    # Some answers wrong, so scores, summaries and memories vary as they do on hard problems. Each replica answers as
    # vLLM with --enable-prompt-tokens-details, its own prefix cache of the given capacity reporting the hits.
    return SimScript(
        persona="vllm",
        cache_report=True,
        prefix_cache_tokens=capacity,
        rules=rules,
        accuracy=0.6,
        log_limit=1_000_000,
    )


def problems(count: int) -> list[Problem]:
    return [Problem(problem_id=f"p{i}", question=f"What is {i + 13}*{2 * i + 7} - {i}?") for i in range(count)]


@contextlib.contextmanager
def replicas(time_scale: float, capacity: int) -> Iterator[list[SimServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(SimServer(script(time_scale, capacity))) for _ in range(REPLICAS)]


def settings(servers: list[SimServer], args: argparse.Namespace, routing: str, bound: float) -> Settings:
    return Settings.model_validate(
        {
            "endpoint": {
                "base_url": [s.base_url for s in servers],
                "model": "sim-model",
                "routing": routing,
                "routing_load_bound": bound,
                "batch_samples": args.batch_samples,
            },
            "concurrency": args.concurrency,
            "problems_in_flight": args.problems_in_flight,
            "sampling": {"temperature": 1.0, "max_tokens": 4096},
            "method": {
                "name": "tmas",
                "params": {"n": N, "m": M, "iterations": args.iterations, "skip_final_memory": False},
            },
        }
    )


def chat_log(server: SimServer) -> list[LoggedRequest]:
    return [r for r in server.requests if r.endpoint == "chat"]


def tokens_of(request: LoggedRequest) -> list[str]:
    return prompt_tokens([(m["role"], content_text(m.get("content"))) for m in request.body["messages"]])


def replay(requests: list[LoggedRequest], caches: list[PrefixCache]) -> tuple[int, list[int]]:
    """The prompt tokens of ``requests`` and the tokens each cache served from cache, in arrival order."""
    total, hits = 0, [0] * len(caches)
    for request in requests:
        tokens = tokens_of(request)
        total += len(tokens)
        for i, cache in enumerate(caches):
            hits[i] += cache.serve(tokens)
    return total, hits


def spread(values: list[int]) -> dict[str, Any]:
    mean = sum(values) / len(values)
    return {"per_replica": values, "busiest_over_mean": round(max(values) / mean, 3) if mean else None}


def measure(args: argparse.Namespace, routing: str, bound: float) -> tuple[dict[str, Any], list[list[LoggedRequest]]]:
    with replicas(args.time_scale, args.capacity) as servers, tempfile.TemporaryDirectory() as scratch:
        config = settings(servers, args, routing, bound)
        store, config, todo = prepare_run(Path(scratch) / "run", config, problems(args.problems), resume=False)
        with store:
            summary = asyncio.run(run_problems(config, todo, store))
        assert summary.done == args.problems and summary.failed_calls == 0, summary.to_dict()
        logs = [chat_log(s) for s in servers]
        stats = [s.stats() for s in servers]
    served = [replay(log, [PrefixCache(args.capacity)]) for log in logs]
    prompt = sum(total for total, _ in served)
    figures = {
        "routing": routing,
        **({"routing_load_bound": bound} if routing == "cache" else {}),
        "calls": summary.calls,
        "wall_s": round(summary.wall_s, 1),
        "prompt_tokens_per_call": round(prompt / summary.calls),
        "cached_share": round(sum(hits[0] for _, hits in served) / prompt, 4),
        # What the replicas' own caches reported (vLLM's usage.prompt_tokens_details.cached_tokens), as a check of the
        # replay: the server counts 4 tokens of template per message and never serves a prompt's last token.
        "cached_share_reported": round(
            sum(s.cached_prompt_tokens for s in stats) / sum(s.prompt_tokens for s in stats), 4
        ),
        "calls_spread": spread([s.completed for s in stats]),
        "tokens_spread": spread([s.prompt_tokens + s.completion_tokens for s in stats]),
    }
    return figures, logs


def single_replica(logs: list[list[LoggedRequest]], capacity: int) -> dict[str, Any]:
    """The same calls sent to one replica: every replica's prompts, merged in arrival order, through one cache."""
    merged = list(heapq.merge(*logs, key=lambda r: r.received_at))
    total, (same, eight) = replay(merged, [PrefixCache(capacity), PrefixCache(REPLICAS * capacity)])
    return {"cached_share_same_capacity": round(same / total, 4), "cached_share_8x_capacity": round(eight / total, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--problems-in-flight", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=20_000, help="prefix cache per replica, simulated tokens")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies every call's latency")
    parser.add_argument(
        "--batch-samples",
        choices=["auto", "on", "off"],
        default="auto",
        help="alike samples as one request with n (auto: on, the replicas answer as vLLM)",
    )
    parser.add_argument(
        "--bounds", type=float, nargs="+", default=[Endpoint().routing_load_bound], help="cache-aware load bounds"
    )
    args = parser.parse_args()
    register_paper_lengths()
    started = time.monotonic()
    runs = [measure(args, "load", 1.0)[0]]
    logs: list[list[LoggedRequest]] = []
    for bound in args.bounds:
        figures, logs = measure(args, "cache", bound)
        runs.append(figures)
    single = single_replica(logs, args.capacity)
    for run in runs:
        run["of_single_same_capacity"] = round(run["cached_share"] / single["cached_share_same_capacity"], 3)
        run["of_single_8x_capacity"] = round(run["cached_share"] / single["cached_share_8x_capacity"], 3)
        # The goal: 80 % of one replica's hit share (the 8x one: the same KV memory in all), the busiest
        # replica within 10 % of the mean.
        run["goal_met"] = (
            run["of_single_8x_capacity"] >= 0.8
            and run["calls_spread"]["busiest_over_mean"] <= 1.1
            and run["tokens_spread"]["busiest_over_mean"] <= 1.1
        )
    out = {
        "replicas": REPLICAS,
        "problems": args.problems,
        "iterations": args.iterations,
        "problems_in_flight": args.problems_in_flight,
        "concurrency": args.concurrency,
        "capacity_tokens_per_replica": args.capacity,
        "batch_samples": args.batch_samples,
        "runs": runs,
        "single_replica": single,
        "benchmark_s": round(time.monotonic() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
