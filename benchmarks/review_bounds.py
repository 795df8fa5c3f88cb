"""MATTRL's math peer reviews under their reply schema with and without its bounds, on the same prompts.

Every review prompt a MATTRL math run stored (the first attempt of each) is sent again to the embedded model twice:
once under the reply schema as it was before its bounds (``maxLength`` and ``maxItems`` taken out), once under the
schema the method sends now, each with the run's own temperature and ``max_tokens`` and the stored seed, both arms of a
prompt side by side so that they meet the same load. Each reply is read as the method reads it
(:func:`tmas.agents.mattrl_review.parse_review`). The table gives, per arm: replies cut at ``max_tokens``, reviews
that could not be read, verdicts, issues per readable review and completion tokens per reply; then the paired
difference in unreadable reviews with its standard error.

Run, in the repository root, after a MATTRL run on the embedded model (the one in docs/results.md, for instance)::

    python benchmarks/review_bounds.py runs/mattrl --out review_bounds     # --limit N: the first N prompts

Resumable: the replies go to ``OUT/replies.jsonl`` as they come, and a second run sends only the missing ones; the
summary goes to ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

import aiohttp

from tmas.agents.mattrl_review import ReviewReply, parse_review
from tmas.agents.output import AgentOutputError
from tmas.config import LocalModel
from tmas.llm.local_command import default_threads
from tmas.llm.local_server import LocalServer
from tmas.llm.schema import json_schema
from tmas.methods.mattrl_deliberation import RETRY_OFFSET, REVIEW_SAMPLE
from tmas.store.run_store import RunStore

ARMS = ("unbounded", "bounded")
_BOUNDS = frozenset({"maxLength", "maxItems"})


def unbounded(node: Any) -> Any:
    """``node`` (a JSON schema) without its length bounds: the review schema as it was before them."""
    if isinstance(node, list):
        return [unbounded(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: unbounded(value) for key, value in node.items() if key not in _BOUNDS}


def schemas() -> dict[str, dict[str, Any]]:
    bounded = json_schema(ReviewReply)
    return {"unbounded": unbounded(bounded), "bounded": bounded}


def prompts(run_dir: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first attempt of each distinct math review prompt of the run, in the order they were made."""
    store = RunStore(run_dir, create=False, read_only=True)
    try:
        found = []
        for call in store.calls():
            # A review asked again (unreadable, or echoing its prompt) has its sample moved by RETRY_OFFSET.
            if call.key.role != "reviewer" or call.error is not None or call.key.sample >= REVIEW_SAMPLE + RETRY_OFFSET:
                continue
            messages = store.call_messages(call.call_id)
            if not messages or '"verdict"' not in messages[-1]["content"]:
                continue  # a medicine review (A.4): no verdict to read
            sampling = store.call_sampling(call.call_id)
            found.append(
                {
                    "index": len(found),
                    "problem_id": call.key.problem_id,
                    "model": call.model,
                    "messages": messages,
                    "temperature": sampling.get("temperature"),
                    "max_tokens": sampling.get("max_tokens"),
                    "seed": sampling.get("seed"),
                }
            )
    finally:
        store.close()
    if not found:
        raise SystemExit(f"{run_dir}: no math peer review stored (is it a MATTRL run of the math domain?)")
    return found[:limit] if limit else found


def read(content: str, finish_reason: str | None) -> dict[str, Any]:
    """What the method makes of a reply: its verdict and issues, or why it could not be read."""
    try:
        review = parse_review(content, "reviewer", "author", truncated=finish_reason == "length")
    except AgentOutputError as exc:
        return {"readable": False, "why": str(exc)}
    return {"readable": True, "verdict": review.verdict, "issues": len(review.issues), "analysis": len(review.analysis)}


async def ask(
    session: aiohttp.ClientSession, base_url: str, prompt: dict[str, Any], arm: str, schema: dict[str, Any]
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": prompt["model"],
        "messages": prompt["messages"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "ReviewReply", "schema": schema}},
    }
    for field in ("temperature", "max_tokens", "seed"):
        if prompt[field] is not None:
            body[field] = prompt[field]
    async with session.post(f"{base_url}/chat/completions", json=body) as resp:
        reply = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"prompt {prompt['index']} ({arm}): HTTP {resp.status}: {json.dumps(reply)[:300]}")
    choice = reply["choices"][0]
    content = choice["message"].get("content") or ""
    return {
        "index": prompt["index"],
        "arm": arm,
        "finish_reason": choice.get("finish_reason"),
        "completion_tokens": reply["usage"]["completion_tokens"],
        "content": content,
        **read(content, choice.get("finish_reason")),
    }


def done(replies: Path) -> set[tuple[int, str]]:
    if not replies.exists():
        return set()
    return {(row["index"], row["arm"]) for row in map(json.loads, replies.read_text().splitlines()) if row}


async def collect(prompts_: list[dict[str, Any]], model: str, out: Path, parallel: int) -> None:
    """Sends every missing (prompt, arm) to the embedded model, ``parallel`` at a time, appending each reply."""
    replies = out / "replies.jsonl"
    have = done(replies)
    todo = [(p, arm) for p in prompts_ for arm in ARMS if (p["index"], arm) not in have]
    print(f"{len(todo)} replies to ask for ({len(have)} kept)", file=sys.stderr, flush=True)
    if not todo:
        return
    shapes = schemas()
    gate = asyncio.Semaphore(parallel)
    cfg = LocalModel(model=model, parallel=parallel, startup_timeout_s=600)
    async with LocalServer(cfg) as srv, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(prompt: dict[str, Any], arm: str) -> None:
            async with gate:
                row = await ask(session, srv.base_url, prompt, arm, shapes[arm])
            with replies.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"prompt {row['index']} {arm}: {row['finish_reason']}, {row['completion_tokens']} tokens, "
                f"{row.get('verdict') or 'unreadable'}",
                file=sys.stderr,
                flush=True,
            )

        await asyncio.gather(*(one(p, arm) for p, arm in todo))


def share(hits: int, n: int) -> dict[str, float]:
    """A proportion and its standard error sqrt(p (1 - p) / n)."""
    p = hits / n if n else 0.0
    return {"share": p, "stderr": math.sqrt(p * (1 - p) / n) if n else 0.0}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: cut, unreadable, verdicts, issues and tokens; and the paired difference (unbounded minus bounded)
    in unreadable reviews over the prompts both arms answered."""
    by_arm: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in ARMS}
    for row in rows:
        by_arm[row["arm"]][row["index"]] = row
    arms: dict[str, Any] = {}
    for arm, got in by_arm.items():
        n = len(got)
        readable = [r for r in got.values() if r["readable"]]
        verdicts = {v: sum(r["verdict"] == v for r in readable) for v in ("accept", "revise", "reject")}
        arms[arm] = {
            "replies": n,
            "cut": share(sum(r["finish_reason"] == "length" for r in got.values()), n),
            "unreadable": share(n - len(readable), n),
            "verdicts": verdicts,
            "issues_per_readable": sum(r["issues"] for r in readable) / len(readable) if readable else 0.0,
            "completion_tokens_per_reply": sum(r["completion_tokens"] for r in got.values()) / n if n else 0.0,
        }
    both = sorted(set(by_arm["unbounded"]) & set(by_arm["bounded"]))
    diffs = [int(not by_arm["unbounded"][i]["readable"]) - int(not by_arm["bounded"][i]["readable"]) for i in both]
    mean = sum(diffs) / len(diffs) if diffs else 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) if len(diffs) > 1 else 0.0
    paired = {"prompts": len(both), "difference": mean, "stderr": math.sqrt(var / len(diffs)) if diffs else 0.0}
    return {"arms": arms, "unreadable_paired": paired}


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| Schema | Replies | Cut at max_tokens | Unreadable reviews (± SE) | accept / revise / reject | "
        "Issues a readable review | Completion tokens a reply |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for arm, s in summary["arms"].items():
        v = s["verdicts"]
        lines.append(
            f"| {arm} | {s['replies']} | {s['cut']['share']:.1%} | {s['unreadable']['share']:.1%} "
            f"(± {s['unreadable']['stderr']:.1%}) | {v['accept']} / {v['revise']} / {v['reject']} | "
            f"{s['issues_per_readable']:.2f} | {s['completion_tokens_per_reply']:.0f} |"
        )
    p = summary["unreadable_paired"]
    lines.append(
        f"\nUnreadable, unbounded minus bounded, paired over {p['prompts']} prompts: "
        f"{p['difference']:+.1%} (± {p['stderr']:.1%})"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a MATTRL run (math) on the embedded model")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="only the first N review prompts")
    parser.add_argument("--model", default=None, help="the embedded model (default: the one the run used)")
    parser.add_argument("--parallel", type=int, default=4, help="llama-server slots, and calls in flight")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found = prompts(args.run_dir, args.limit)
    model = args.model or found[0]["model"]
    started = dt.datetime.now(dt.UTC)
    asyncio.run(collect(found, model, args.out, args.parallel))
    wanted = {p["index"] for p in found}
    rows = [r for r in map(json.loads, (args.out / "replies.jsonl").read_text().splitlines()) if r["index"] in wanted]
    summary = {
        "run": str(args.run_dir),
        "model": model,
        "prompts": len(found),
        "machine": f"{platform.machine()}, {default_threads()} threads",
        "started": started.isoformat(timespec="seconds"),
        **summarize(rows),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
