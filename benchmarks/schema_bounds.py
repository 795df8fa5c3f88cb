"""A role's JSON replies under its reply schema with and without the schema's length bounds, on the same prompts.

The prompts are a run's own: every MATTRL math peer review (``--role reviewer``, the first attempt of each), every
verification of TMAS or Verify-Refine (``--role verifier``) or every RSE distillation (``--role distiller``, the first
attempt of each) the run stored. Each is sent again to the embedded model twice: once under the reply schema as it
was before its bounds (``maxLength`` and ``maxItems`` taken out), once under the schema the method sends now, each
with the run's own temperature and ``max_tokens`` and the stored seed, both arms of a prompt side by side so that they
meet the same load. Each reply is read as the method reads it. The table gives, per arm: replies cut at
``max_tokens``, replies the method cannot use (a review without its verdict, a verification without its score, a
distillation without its lists), what the usable ones said (verdicts and issues; scores; items, and how many of them
run to the schema's length bound, where the server closed them), completion tokens a reply, and the paired difference
in unusable replies with its standard error. For verifications it also
gives the ROC area of the scores the method uses (an unusable one counts 0) between right and wrong candidates (their
answers graded against the reference by rules).

Run, in the repository root, on a run made with the embedded model::

    python benchmarks/schema_bounds.py runs/mattrl --role reviewer --out bounds-review   # --limit N: first N
    python benchmarks/schema_bounds.py runs/tmas --role verifier --out bounds-verifier
    python benchmarks/schema_bounds.py runs/rse --role distiller --out bounds-distiller
    python benchmarks/schema_bounds.py runs/tmas --role distiller --from-solutions --out bounds-distiller

``--from-solutions`` builds the distillation prompts RSE would make of a run's first-iteration solutions (TMAS's and
majority vote's first samples are RSE's), for a run of another method. ``--base-url`` sends to a server already
running instead of starting the embedded one. ``--hf-model MODEL`` sends to the model in process instead, where the
two arms are no schema and the schema sent now (the engine holds replies to it: ``tmas.llm.hf_grammar``)::

    python benchmarks/schema_bounds.py runs/tmas --role verifier --hf-model qwen2.5-coder-0.5b --out schema-in-process

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
import re
import sys
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import BaseModel

from tmas.agents.baselines import distill_prompt, distillation_reply_model, parse_distillation
from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.agents.mattrl_review import ReviewReply, parse_review
from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.solution import parse_section
from tmas.agents.verification import SCALE, parse_verification, verification_reply_model
from tmas.answer_rules import check_pair
from tmas.answers import extract_answer
from tmas.config import LocalModel, Sampling, Settings
from tmas.llm.local_command import default_threads
from tmas.llm.local_server import LocalServer
from tmas.llm.schema import json_schema
from tmas.llm.types import Message
from tmas.methods.mattrl_deliberation import RETRY_OFFSET, REVIEW_SAMPLE
from tmas.methods.rse import KINDS, RSEParams
from tmas.reports.roc import roc_area
from tmas.rl.hf_eval import proportion_stderr
from tmas.store.run_store import RunStore

if TYPE_CHECKING:
    from tmas.llm.hf_model import HFChatModel

# Over HTTP: the schema without its bounds against the schema sent now. In process (--hf-model): no schema against
# the schema sent now, which the engine holds replies to (tmas.llm.hf_grammar).
ARMS = ("unbounded", "bounded")
IN_PROCESS_ARMS = ("none", "bounded")


def arms_of(hf_model: str | None) -> tuple[str, str]:
    return ARMS if hf_model is None else IN_PROCESS_ARMS


_BOUNDS = frozenset({"maxLength", "maxItems"})
_SOLUTION = re.compile(r"<solution>\n(.*)\n</solution>", re.S)


def unbounded(node: Any) -> Any:
    """``node`` (a JSON schema) without its length bounds: the schema as it was before them."""
    if isinstance(node, list):
        return [unbounded(item) for item in node]
    if not isinstance(node, dict):
        return node
    return {key: unbounded(value) for key, value in node.items() if key not in _BOUNDS}


def review_read(content: str, finish_reason: str | None) -> dict[str, Any]:
    """What MATTRL makes of a review: its verdict and issues, or why it could not be read."""
    try:
        review = parse_review(content, "reviewer", "author", truncated=finish_reason == "length")
    except AgentOutputError as exc:
        return {"usable": False, "why": str(exc)}
    return {"usable": True, "verdict": review.verdict, "issues": len(review.issues)}


def verification_read(content: str, finish_reason: str | None) -> dict[str, Any]:
    """What TMAS and Verify-Refine make of a verification: its score, or none."""
    score = parse_verification(content).score
    return {"usable": score is not None, "score": score}


def distillation_read(content: str, finish_reason: str | None) -> dict[str, Any]:
    """Whether RSE can read a distillation, and the length of each item as the reply wrote it (every item, before
    the method's whitespace clean-up and its cap on items: a bound closes an item at its written length)."""
    try:
        parse_distillation(content, max_items=1, truncated=finish_reason == "length")
    except AgentOutputError as exc:
        return {"usable": False, "why": str(exc)}
    data = extract_json_object(content)
    lists = [data.get(kind) for kind in KINDS]
    return {
        "usable": True,
        "item_chars": [len(i) for items in lists if isinstance(items, list) for i in items if isinstance(i, str)],
    }


def distillation_model(max_tokens: int | None, params: Mapping[str, Any]) -> type[BaseModel]:
    return distillation_reply_model(max_tokens, RSEParams.model_validate(params).items_per_trajectory)


Rows = dict[int, dict[str, Any]]


def review_said(usable: list[dict[str, Any]], _got: Rows, _labels: dict[int, bool | None] | None) -> dict[str, Any]:
    return {
        "verdicts": {v: sum(r["verdict"] == v for r in usable) for v in ("accept", "revise", "reject")},
        "issues_per_usable": sum(r["issues"] for r in usable) / len(usable) if usable else 0.0,
    }


def review_cells(s: dict[str, Any]) -> str:
    v = s["verdicts"]
    return f"{v['accept']} / {v['revise']} / {v['reject']} | {s['issues_per_usable']:.2f}"


def verification_said(usable: list[dict[str, Any]], got: Rows, labels: dict[int, bool | None] | None) -> dict[str, Any]:
    labels = labels or {}
    used = {i: r["score"] if r["usable"] else 0.0 for i, r in got.items()}
    return {
        "scores": {str(v): sum(r["score"] == v for r in usable) for v in SCALE},
        "roc_area": roc_area(
            [v for i, v in used.items() if labels.get(i) is True],
            [v for i, v in used.items() if labels.get(i) is False],
        ),
    }


def verification_cells(s: dict[str, Any]) -> str:
    auc = "n/a" if s["roc_area"] is None else f"{s['roc_area']:.2f}"
    return f"{' / '.join(str(c) for c in s['scores'].values())} | {auc}"


def distillation_said(
    usable: list[dict[str, Any]], _got: Rows, _labels: dict[int, bool | None] | None
) -> dict[str, Any]:
    """Items a usable reply, their mean length, and how many reach the bounded schema's length bound (closed there
    by the server in the bounded arm; longer than it allows in the other)."""
    chars = [c for r in usable for c in r["item_chars"]]
    at_bound = sum(c >= r["item_bound"] for r in usable if r["item_bound"] is not None for c in r["item_chars"])
    return {
        "items_per_usable": len(chars) / len(usable) if usable else 0.0,
        "item_chars_mean": sum(chars) / len(chars) if chars else 0.0,
        "items_at_bound": share(at_bound, len(chars)),
    }


def distillation_cells(s: dict[str, Any]) -> str:
    return f"{s['items_per_usable']:.1f} | {s['item_chars_mean']:.0f} | {s['items_at_bound']['share']:.1%}"


@dataclass(frozen=True)
class Role:
    name: str
    # The reply model the method sends now, for a prompt's max_tokens and the run's method parameters.
    reply_model: Callable[[int | None, Mapping[str, Any]], type[BaseModel]]
    read: Callable[[str, str | None], dict[str, Any]]
    # Whether a stored call of the role is a prompt here (its key's sample, its last message).
    wanted: Callable[[int, str], bool]
    # What an arm's replies said (its usable replies, all its replies by prompt, whether each prompt's candidate is
    # right), and that as the table's columns after "Unusable".
    said: Callable[[list[dict[str, Any]], Rows, dict[int, bool | None] | None], dict[str, Any]]
    columns: str
    cells: Callable[[dict[str, Any]], str]
    # Whether each prompt's candidate is graded, for the ROC area of the scores.
    labelled: bool = False


ROLES = {
    "reviewer": Role(
        "reviewer",
        lambda _max_tokens, _params: ReviewReply,
        review_read,
        # A review asked again (unreadable, or echoing its prompt) has its sample moved by RETRY_OFFSET; a medicine
        # review (A.4) has no verdict to read.
        lambda sample, text: sample < REVIEW_SAMPLE + RETRY_OFFSET and '"verdict"' in text,
        review_said,
        "accept / revise / reject | Issues a usable review",
        review_cells,
    ),
    "verifier": Role(
        "verifier",
        lambda max_tokens, _params: verification_reply_model(max_tokens),
        verification_read,
        lambda _sample, text: "<solution>" in text,
        verification_said,
        "0 / 0.5 / 1 | ROC area, right vs wrong",
        verification_cells,
        labelled=True,
    ),
    "distiller": Role(
        "distiller",
        distillation_model,
        distillation_read,
        # A distillation asked again (echoing its prompt) has its sample moved by ECHO_RETRY_SAMPLE.
        lambda sample, _text: sample < ECHO_RETRY_SAMPLE,
        distillation_said,
        "Items a usable reply | Characters an item | Items at the bound",
        distillation_cells,
    ),
}


def schemas(role: Role, prompt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    bounded = json_schema(role.reply_model(prompt["max_tokens"], prompt["params"]))
    return {"unbounded": unbounded(bounded), "bounded": bounded}


def right(solution_prompt: str, gold: str | None) -> bool | None:
    """Whether the candidate a verification prompt holds answers ``gold`` (by rules; None: cannot tell)."""
    found = _SOLUTION.search(solution_prompt)
    answer = extract_answer(found.group(1)).answer if found else None
    if gold is None or answer is None:
        return None if gold is None else False
    return check_pair(gold, answer).correct


def prompts(run_dir: Path, role: Role, limit: int | None, *, from_solutions: bool = False) -> list[dict[str, Any]]:
    """The role's prompts in the run, in the order they were made (verifications with whether their candidate is
    right). ``from_solutions`` (distillations only): the prompts RSE, with its defaults, would make of the run's first
    samples (TMAS's and majority vote's are RSE's), each first-iteration solution read as the baselines read it, with
    that call's sampling and seed."""
    store = RunStore(run_dir, create=False, read_only=True)
    try:
        problems = {p.problem_id: p for p in store.problems()}
        params = (store.get_meta("method") or {}).get("params") or {}
        mode = params.get("mode", "numeric")
        items = RSEParams().items_per_trajectory
        if from_solutions:  # the prompts and schemas of RSE with its defaults
            params = {}
        found = []
        for call in store.calls():
            if call.error is not None:
                continue
            if from_solutions:
                if call.key.role != "solution" or call.key.iteration != 0 or call.key.sample >= ECHO_RETRY_SAMPLE:
                    continue
                attempt = parse_section(call.content, mode).text
                asked = distill_prompt(problems[call.key.problem_id].question, attempt, items)
                messages = [m.model_dump() for m in asked]
            else:
                if call.key.role != role.name:
                    continue
                messages = store.call_messages(call.call_id)
                if not messages or not role.wanted(call.key.sample, messages[-1]["content"]):
                    continue
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
                    "params": params,
                }
            )
            if len(found) == limit:
                break
    finally:
        store.close()
    if not found:
        raise SystemExit(f"{run_dir}: no {role.name} prompt of the kind measured here is stored")
    if role.labelled:
        for p in found:
            p["right"] = right(p["messages"][-1]["content"], problems[p["problem_id"]].answer)
    return found


async def ask(
    session: aiohttp.ClientSession, base_url: str, role: Role, prompt: dict[str, Any], arm: str
) -> dict[str, Any]:
    shapes = schemas(role, prompt)
    schema = shapes[arm]
    name = role.reply_model(prompt["max_tokens"], prompt["params"]).__name__
    body: dict[str, Any] = {
        "model": prompt["model"],
        "messages": prompt["messages"],
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
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
    tokens = reply["usage"]["completion_tokens"]
    return reply_row(role, prompt, arm, content, choice.get("finish_reason"), tokens)


async def ask_in_process(llm: HFChatModel, role: Role, prompt: dict[str, Any], arm: str) -> dict[str, Any]:
    """The prompt to the in-process model: under the reply schema the method sends now (arm "bounded", which the
    model's structured_output makes it follow) or under none (arm "none")."""
    reply_model = role.reply_model(prompt["max_tokens"], prompt["params"]) if arm == "bounded" else None
    sampling = Sampling(**{f: prompt[f] for f in ("temperature", "max_tokens", "seed") if prompt[f] is not None})
    messages = [Message.model_validate(m) for m in prompt["messages"]]
    done = await llm.chat(role.name, messages, sampling=sampling, reply_model=reply_model)
    if done.error is not None:
        raise RuntimeError(f"prompt {prompt['index']} ({arm}): {done.error}")
    return reply_row(role, prompt, arm, done.content, done.finish_reason, done.usage.completion_tokens)


def reply_row(
    role: Role, prompt: dict[str, Any], arm: str, content: str, finish_reason: str | None, tokens: int
) -> dict[str, Any]:
    row = {
        "index": prompt["index"],
        "arm": arm,
        "finish_reason": finish_reason,
        "completion_tokens": tokens,
        "content": content,
        **role.read(content, finish_reason),
    }
    if "item_chars" in row:  # the bounded schema's bound, in every arm: what it closes, or would have
        row["item_bound"] = schemas(role, prompt)["bounded"]["properties"][KINDS[0]]["items"].get("maxLength")
    return row


def kept(replies: Path) -> list[dict[str, Any]]:
    if not replies.exists():
        return []
    return [json.loads(line) for line in replies.read_text().splitlines() if line.strip()]


async def collect(
    role: Role,
    prompts_: list[dict[str, Any]],
    model: str,
    out: Path,
    parallel: int,
    base_url: str | None = None,
    hf_model: str | None = None,
) -> None:
    """Sends every missing (prompt, arm) to the embedded model (or the server at ``base_url``, or ``hf_model`` in
    process), ``parallel`` at a time, appending each reply."""
    replies = out / "replies.jsonl"
    have = {(row["index"], row["arm"]) for row in kept(replies)}
    todo = [(p, arm) for p in prompts_ for arm in arms_of(hf_model) if (p["index"], arm) not in have]
    print(f"{len(todo)} replies to ask for ({len(have)} kept)", file=sys.stderr, flush=True)
    if not todo:
        return
    gate = asyncio.Semaphore(parallel)
    async with AsyncExitStack() as stack:
        if hf_model is not None:
            from tmas.llm.hf_model import open_hf_model  # torch and transformers only for a model in process

            settings = {"hf": {"model": hf_model}, "endpoint": {"structured_output": "json_schema"}}
            llm = await stack.enter_async_context(
                open_hf_model(Settings.model_validate({**settings, "concurrency": parallel}))
            )
        elif base_url is None:
            cfg = LocalModel(model=model, parallel=parallel, startup_timeout_s=600)
            base_url = (await stack.enter_async_context(LocalServer(cfg))).base_url
        timeout = aiohttp.ClientTimeout(total=3600)
        session = await stack.enter_async_context(aiohttp.ClientSession(timeout=timeout))

        async def one(prompt: dict[str, Any], arm: str) -> None:
            async with gate:
                if hf_model is not None:
                    row = await ask_in_process(llm, role, prompt, arm)
                else:
                    assert base_url is not None
                    row = await ask(session, base_url, role, prompt, arm)
            with replies.open("a") as f:
                f.write(json.dumps(row) + "\n")
            said = "usable" if row["usable"] else "unusable"
            print(
                f"prompt {row['index']} {arm}: {row['finish_reason']}, {row['completion_tokens']} tokens, {said}",
                file=sys.stderr,
                flush=True,
            )

        await asyncio.gather(*(one(p, arm) for p, arm in todo))


def share(hits: int, n: int) -> dict[str, float]:
    """A proportion and its standard error sqrt(p (1 - p) / n)."""
    return {"share": hits / n if n else 0.0, "stderr": proportion_stderr(hits, n)}


def paired_mean(diffs: list[int]) -> dict[str, float]:
    """The mean of per-prompt differences and its standard error (sample standard deviation / sqrt(n))."""
    n = len(diffs)
    mean = sum(diffs) / n if n else 0.0
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else 0.0
    return {"prompts": n, "difference": mean, "stderr": math.sqrt(var / n) if n else 0.0}


def summarize(
    rows: list[dict[str, Any]],
    role: Role,
    labels: dict[int, bool | None] | None = None,
    arms_: tuple[str, str] = ARMS,
) -> dict[str, Any]:
    """Per arm: replies cut, unusable, what the usable ones said (with ``labels``, whether each prompt's candidate is
    right), tokens; the paired difference (the first arm minus the second) in unusable replies over the prompts both
    arms answered."""
    by_arm: dict[str, Rows] = {arm: {} for arm in arms_}
    for row in rows:
        by_arm[row["arm"]][row["index"]] = row
    arms: dict[str, Any] = {}
    for arm, got in by_arm.items():
        n = len(got)
        usable = [r for r in got.values() if r["usable"]]
        arms[arm] = {
            "replies": n,
            "cut": share(sum(r["finish_reason"] == "length" for r in got.values()), n),
            "unusable": share(n - len(usable), n),
            "completion_tokens_per_reply": sum(r["completion_tokens"] for r in got.values()) / n if n else 0.0,
            **role.said(usable, got, labels),
        }
    first, second = (by_arm[arm] for arm in arms_)
    both = sorted(set(first) & set(second))
    diffs = [int(not first[i]["usable"]) - int(not second[i]["usable"]) for i in both]
    return {"arms": arms, "unusable_paired": {"arms": list(arms_), **paired_mean(diffs)}}


def table(summary: dict[str, Any], role: Role) -> str:
    columns = role.columns.count("|") + 1
    lines = [
        f"| Schema | Replies | Cut at max_tokens | Unusable (± SE) | {role.columns} | Completion tokens a reply |",
        "|---|---:|---:|---:|" + "---|" * columns + "---:|",
    ]
    for arm, s in summary["arms"].items():
        lines.append(
            f"| {arm} | {s['replies']} | {s['cut']['share']:.1%} | {s['unusable']['share']:.1%} "
            f"(± {s['unusable']['stderr']:.1%}) | {role.cells(s)} | {s['completion_tokens_per_reply']:.0f} |"
        )
    p = summary["unusable_paired"]
    lines.append(
        f"\nUnusable, {p['arms'][0]} minus {p['arms'][1]}, paired over {p['prompts']} prompts: "
        f"{p['difference']:+.1%} (± {p['stderr']:.1%})"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run made with the embedded model")
    parser.add_argument("--role", choices=sorted(ROLES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--model", default=None, help="the embedded model (default: the one the run used)")
    parser.add_argument("--parallel", type=int, default=4, help="llama-server slots, and calls in flight")
    parser.add_argument(
        "--base-url", default=None, help="a server already serving the run's model (.../v1), instead of starting one"
    )
    parser.add_argument(
        "--hf-model",
        default=None,
        help="send to this model in process (a GGUF, checkpoint or embedded name): no schema against the bounded one",
    )
    parser.add_argument(
        "--from-solutions",
        action="store_true",
        help="distiller: the prompts RSE would make of the run's first-iteration solutions (a run of another method)",
    )
    args = parser.parse_args()
    role = ROLES[args.role]
    if args.from_solutions and role.name != "distiller":
        parser.error("--from-solutions makes distillation prompts: it goes with --role distiller")
    args.out.mkdir(parents=True, exist_ok=True)
    found = prompts(args.run_dir, role, args.limit, from_solutions=args.from_solutions)
    model = args.model or found[0]["model"]
    started = dt.datetime.now(dt.UTC)
    asyncio.run(collect(role, found, model, args.out, args.parallel, args.base_url, args.hf_model))
    wanted = {p["index"] for p in found}
    rows = [r for r in kept(args.out / "replies.jsonl") if r["index"] in wanted]
    labels = {p["index"]: p["right"] for p in found} if role.labelled else None
    summary = {
        "run": str(args.run_dir),
        "role": role.name,
        "from_solutions": args.from_solutions,
        "model": model,
        "prompts": len(found),
        "labelled": None if labels is None else {str(k): sum(v is k for v in labels.values()) for k in (True, False)},
        "machine": f"{platform.machine()}, {default_threads()} threads",
        "started": started.isoformat(timespec="seconds"),
        "in_process": args.hf_model,
        **summarize(rows, role, labels, arms_of(args.hf_model)),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary, role))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
