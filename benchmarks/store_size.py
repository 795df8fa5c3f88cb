"""The run store's size at the paper's reply lengths, plain (schema 1) against kept-once and
compressed (schema 2), and what one call's write costs in each.

One TMAS iteration of one problem at N = 8, M = 8 is 82 calls: 8 solutions (iteration 0 from the problem; later ones
refine from all 8 rollouts and the experience bank), 64 verifications (8 samples of one prompt per candidate), 8
summaries (the candidate and its 8 verifications), an experience and a guideline update (the rollouts and a bank).
Every reply carries reasoning of 2K-60K tokens, long-tailed (log-normal, median 6K), and an answer of 300-2K tokens.
The text is generated (Zipf-distributed words, numbers and formulas; no data files): each text is new, so only the
quoting the prompts do repeats, as in a real run.

    .venv/bin/python benchmarks/store_size.py [--calls 3000] [--seed 0]

Prints one JSON object: per layout, bytes on disk, plain text bytes held, their ratio and write time per call;
``new_whole_messages`` is the new layout with messages stored whole (not cut at tag lines), for what the cut gains;
and the floor: the replies (reasoning and answers, which no prompt repeats) compressed one by one.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zstandard

from tmas.config import Sampling
from tmas.llm.types import CallKey, ChatRequest, Completion, Message, Usage
from tmas.store import texts
from tmas.store.run_store import RunStore

N, M = 8, 8
CHARS_PER_TOKEN = 4
VOCABULARY = (
    "the of a to is and we so that this then it by for with in not as be which let since at on are have case "
    "sum term value step check each gives one two its if but thus hence now both first next every must can "
    "prime integer divides modulo root degree bound equal greater less odd even square factor solution answer "
    "polynomial sequence function set number point line angle triangle circle area length coefficient exponent "
    "induction contradiction assume suppose consider note recall observe compute substitute simplify expand "
    "wait actually hmm verify again careful mistake recheck indeed therefore follows implies holds remaining"
)
WORDS = VOCABULARY.split()


class TextGenerator:
    """Prose of reasoning-like text: Zipf-weighted words, numbers and small formulas, sentences and paragraphs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.weights = [1 / (rank + 1) for rank in range(len(WORDS))]

    def words(self, count: int) -> list[str]:
        rng = self.rng
        out = rng.choices(WORDS, self.weights, k=count)
        for i in range(0, count, 7):
            slot = rng.randrange(i, min(i + 7, count))
            kind = rng.random()
            if kind < 0.5:
                out[slot] = str(rng.randrange(1000))
            elif kind < 0.8:
                out[slot] = f"{rng.choice('xyznk')}^{rng.randrange(2, 9)} + {rng.randrange(100)}"
            else:
                out[slot] = f"= {rng.randrange(10**5)}."
        return out

    def text(self, tokens: int) -> str:
        words = self.words(max(1, tokens * CHARS_PER_TOKEN // 6))
        paragraphs, start = [], 0
        while start < len(words):
            end = start + self.rng.randrange(20, 120)
            paragraphs.append(" ".join(words[start:end]) + ".")
            start = end
        return "\n\n".join(paragraphs)

    def reasoning_tokens(self) -> int:
        return int(min(60_000, max(2_000, self.rng.lognormvariate(math.log(6_000), 0.9))))

    def answer_tokens(self) -> int:
        return self.rng.randrange(300, 2_000)


def simulated_calls(count: int, seed: int) -> Iterator[tuple[Completion, ChatRequest]]:
    """``count`` calls of TMAS iterations, problem after problem, each problem's text generated once."""
    gen = TextGenerator(random.Random(seed))
    instructions = {role: gen.text(400) for role in ("solution", "refine", "verifier", "summary", "experience")}
    system = gen.text(60)
    made = 0
    problem_index = 0
    while True:
        problem = gen.text(150)
        rollouts: list[str] = []
        bank = ""
        for iteration in range(20):
            calls: list[tuple[str, list[str], dict[str, Any]]] = []
            head = f"<problem>\n{problem}\n</problem>"
            candidates = []
            for n in range(N):
                if iteration == 0:
                    prompt = f"{head}\n\n{instructions['solution']}"
                else:
                    prompt = (
                        f"{head}\n\n<rollouts>\n{''.join(rollouts)}</rollouts>\n\n<experience>\n{bank}\n</experience>"
                    )
                    prompt += f"\n\n{instructions['refine']}"
                candidate = gen.text(gen.answer_tokens())
                candidates.append(candidate)
                calls.append(("solution", [system, prompt], {"content": candidate, "sample": n}))
            summaries = []
            for n, candidate in enumerate(candidates):
                prompt = f"{head}\n\n<solution>\n{candidate}\n</solution>\n\n{instructions['verifier']}"
                feedback = [gen.text(gen.rng.randrange(300, 1_000)) for _ in range(M)]
                for m in range(M):
                    calls.append(("verifier", [prompt], {"content": feedback[m], "sample": m, "candidate": n}))
                quoted = "".join(
                    f'<verification number="{m + 1}">\n{f}\n</verification>\n' for m, f in enumerate(feedback)
                )
                prompt = f"{head}\n\n<solution>\n{candidate}\n</solution>\n\n{quoted}\n{instructions['summary']}"
                summary = gen.text(300)
                summaries.append(summary)
                calls.append(("summary", [prompt], {"content": summary, "sample": n}))
            rollouts = [
                f'<rollout number="{n + 1}">\n<solution>\n{c}\n</solution>\n<verification_summary>\n{s}\n'
                "</verification_summary>\n</rollout>\n"
                for n, (c, s) in enumerate(zip(candidates, summaries, strict=True))
            ]
            memory = (
                f"{head}\n\n<rollouts>\n{''.join(rollouts)}</rollouts>\n\n<experience_bank>\n{bank}\n</experience_bank>"
            )
            bank = gen.text(1_000)
            calls.append(("experience", [memory, instructions["experience"]], {"content": bank, "sample": 0}))
            calls.append(("guideline", [memory], {"content": gen.text(800), "sample": 0}))
            for role, messages, reply in calls:
                if made == count:
                    return
                made += 1
                yield call(f"p{problem_index}", iteration, role, messages, reply, gen)
        problem_index += 1


def call(
    problem_id: str, iteration: int, role: str, messages: list[str], reply: dict[str, Any], gen: TextGenerator
) -> tuple[Completion, ChatRequest]:
    roles = ["system", "user"] if len(messages) == 2 else ["user"]
    request = ChatRequest(
        model="thinking-model",
        messages=[Message(role=r, content=text) for r, text in zip(roles, messages, strict=True)],
        sampling=Sampling(temperature=0.7, max_tokens=65_536, seed=reply.get("candidate", 0)),
    )
    key = CallKey(problem_id=problem_id, iteration=iteration, role=role, sample=reply["sample"])
    reasoning = gen.text(gen.reasoning_tokens())
    completion = Completion(
        key=key,
        request_hash=request.request_hash(key),
        endpoint="http://127.0.0.1:8000/v1",
        model="thinking-model",
        content=reply["content"],
        reasoning=reasoning,
        usage=Usage(prompt_tokens=len(messages[-1]) // 4, completion_tokens=len(reasoning) // 4),
        finish_reason="stop",
        latency_s=30.0,
    )
    return completion, request


# The calls table of schema 1 and its record_call's insert: texts as plain columns, one autocommitted row per call.
PLAIN_SCHEMA = """
CREATE TABLE calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, request_hash TEXT NOT NULL, sample INTEGER NOT NULL,
    problem_id TEXT NOT NULL, iteration INTEGER, role TEXT NOT NULL, endpoint TEXT NOT NULL, model TEXT NOT NULL,
    messages TEXT NOT NULL, sampling TEXT NOT NULL, content TEXT NOT NULL, reasoning TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL, finish_reason TEXT, max_tokens_sent INTEGER, latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL, error TEXT, created_at REAL NOT NULL, error_cause TEXT,
    retry_causes TEXT NOT NULL DEFAULT '[]', logprobs TEXT, cached_prompt_tokens INTEGER, sampling_sources TEXT
);
CREATE INDEX calls_by_request ON calls (request_hash, sample);
CREATE INDEX calls_by_problem ON calls (problem_id, iteration);
"""
PLAIN_INSERT = (
    "INSERT INTO calls (request_hash, sample, problem_id, iteration, role, endpoint, model, messages, sampling,"
    " content, reasoning, prompt_tokens, completion_tokens, reasoning_tokens, usage_estimated, finish_reason,"
    " max_tokens_sent, latency_s, attempts, error, created_at, error_cause, retry_causes, logprobs,"
    " cached_prompt_tokens, sampling_sources) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
    " ?, ?, ?, ?, ?)"
)


def plain_writer(run_dir: Path) -> tuple[Callable[[Completion, ChatRequest], object], Callable[[], None]]:
    db = sqlite3.connect(run_dir / "run.sqlite", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(PLAIN_SCHEMA)

    def write(c: Completion, r: ChatRequest) -> object:
        u, k = c.usage, c.key
        return db.execute(
            PLAIN_INSERT,
            (c.request_hash, k.sample, k.problem_id, k.iteration, k.role, c.endpoint, c.model,
             json.dumps([m.model_dump() for m in r.messages], ensure_ascii=False), r.sampling.model_dump_json(),
             c.content, c.reasoning, u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, int(u.estimated),
             c.finish_reason, c.max_tokens_sent, c.latency_s, c.attempts, c.error, time.time(), c.error_cause,
             json.dumps(c.retry_causes), None, u.cached_prompt_tokens,
             json.dumps(r.sampling_sources, sort_keys=True)),
        )  # fmt: skip

    return write, db.close


def store_writer(run_dir: Path) -> tuple[Callable[[Completion, ChatRequest], object], Callable[[], None]]:
    store = RunStore(run_dir)
    return store.record_call, store.close


def measure(layout: str, calls: list[tuple[Completion, ChatRequest]], root: Path) -> dict[str, Any]:
    run_dir = root / layout
    run_dir.mkdir()
    write, close = plain_writer(run_dir) if layout == "old" else store_writer(run_dir)
    elapsed = 0.0
    for completion, request in calls:
        start = time.perf_counter()
        write(completion, request)
        elapsed += time.perf_counter() - start
    close()  # the last connection's close checkpoints the WAL into the database file
    disk = sum(p.stat().st_size for p in run_dir.iterdir())
    return {"bytes_on_disk": disk, "write_ms_per_call": round(1000 * elapsed / len(calls), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    calls = list(simulated_calls(args.calls, args.seed))
    plain = sum(
        len(json.dumps([m.model_dump() for m in r.messages], ensure_ascii=False).encode())
        + len(c.content.encode())
        + len(c.reasoning.encode())
        for c, r in calls
    )
    replies = [t.encode() for c, _ in calls for t in (c.reasoning, c.content)]
    # The replies never repeat one another (the prompts quote them): compressed one by one, they are the floor of
    # what a store that keeps every text can take, whatever it does with the prompts.
    replies_packed = sum(len(zstandard.compress(t, texts.ZSTD_LEVEL)) for t in replies)
    sample = "\n\n".join(c.reasoning for c, _ in calls[:20]).encode()
    figures: dict[str, Any] = {
        "machine": platform.platform(),
        "calls": len(calls),
        "plain_text_bytes": plain,
        "replies_share_of_plain": round(sum(map(len, replies)) / plain, 3),
        "replies_compressed_bytes": replies_packed,
        "plain_per_byte_at_that_floor": round(plain / replies_packed, 2),
        # How compressible the generated text itself is (real English prose: about 3x at this level).
        "zstd3_ratio_of_20_reasoning_texts": round(len(sample) / len(zstandard.compress(sample, 3)), 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        figures["old"] = measure("old", calls, root)
        figures["new"] = measure("new", calls, root)
        cut = texts.pieces
        texts.pieces = lambda text: [text]
        figures["new_whole_messages"] = measure("new_whole_messages", calls, root)
        texts.pieces = cut
    for layout in ("old", "new", "new_whole_messages"):
        figures[layout]["share_of_plain"] = round(figures[layout]["bytes_on_disk"] / plain, 4)
        figures[layout]["plain_per_byte_on_disk"] = round(plain / figures[layout]["bytes_on_disk"], 2)
    figures["goal"] = "store at most 1/8 of the plain text it holds (plain_per_byte_on_disk >= 8)"
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
