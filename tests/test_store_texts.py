"""The run store keeps call texts once each, compressed (tmas.store.texts): every reader sees the texts written, a
candidate quoted in many prompts is stored once, and a store written in the schema 1 layout (plain text columns)
opens, reads and replays as before."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest

from tmas.config import Sampling
from tmas.llm.types import CallKey, ChatRequest, Completion, Message, TokenLogprob, TopLogprob, Usage
from tmas.store.run_store import SCHEMA_VERSION, RunStore, StoreError
from tmas.store.texts import INLINE_BELOW, pieces

ALPHABET = ["a", "Z", " ", "\n", "\n\n", "<", ">", "/", "é", "∑", "😀", "\t", "\\", '"', "{", "\x00", "\r\n"]
LINES = ["<solution>", "</solution>", '<rollout number="2" mean_verifier_score="0.5">', "  <problem>  ", "</a b>", ""]


def random_text(rng: random.Random) -> str:
    """Text with what a prompt or reply may hold: tag lines, blank lines, unicode, control characters, nothing."""
    shape = rng.randrange(4)
    if shape == 0:
        return ""
    if shape == 1:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 40)))
    lines = [
        rng.choice(LINES) if rng.random() < 0.3 else "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(90)))
        for _ in range(rng.randrange(1, 30))
    ]
    return "\n".join(lines)


def call(i: int, rng: random.Random) -> tuple[Completion, ChatRequest]:
    messages = [Message(role=rng.choice(["system", "user", "assistant"]), content=random_text(rng)) for _ in range(3)]
    request = ChatRequest(model="m", messages=messages, sampling=Sampling(temperature=0.5, seed=i))
    key = CallKey(problem_id=f"p{i % 3}", role="solution", sample=i, iteration=i % 2)
    logprobs = (
        None
        if i % 3 == 0
        else [
            TokenLogprob(
                token=random_text(rng)[:5], logprob=-0.25 * j, top_logprobs=[TopLogprob(token="é", logprob=-1)]
            )
            for j in range(i % 4)
        ]
    )
    completion = Completion(
        key=key,
        request_hash=request.request_hash(key),
        endpoint="http://e/v1",
        model="m",
        content=random_text(rng),
        reasoning=random_text(rng),
        usage=Usage(prompt_tokens=i, completion_tokens=2 * i, reasoning_tokens=i % 5),
        finish_reason="stop",
        latency_s=0.5,
        error="boom" if i % 7 == 6 else None,
        error_cause="http_503" if i % 7 == 6 else None,
        logprobs=logprobs,
    )
    return completion, request


def test_pieces_join_back_to_the_text_and_cut_at_tag_lines() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        text = random_text(rng)
        assert "\n".join(pieces(text)) == text, repr(text)
    quoted = "<problem>\nQ\n</problem>\n\n<solution>\nline 1\n\nline 2\n</solution>\n<rollout n='1'>\n</rollout>"
    frames = "</solution>\n<rollout n='1'>\n</rollout>"
    assert pieces(quoted) == ["<problem>", "Q", "</problem>", "", "<solution>", "line 1\n\nline 2", frames]


@pytest.mark.parametrize("read_only", [False, True])
def test_every_reader_sees_the_texts_written(tmp_path: Path, read_only: bool) -> None:
    rng = random.Random(2)
    written = [call(i, rng) for i in range(60)]
    # A long text, and long texts that compress to nothing (kept compressed) or do not (kept as they are).
    written[1][0].reasoning = "step 1: 17*23 = 391\n" * 20_000
    written[2][0].content = "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(5000))
    with RunStore(tmp_path) as store:
        ids = [store.record_call(c, r) for c, r in written]
    with RunStore(tmp_path, read_only=read_only) as store:
        expected = [c.model_copy(update={"call_id": i}) for (c, _), i in zip(written, ids, strict=True)]
        assert list(store.calls()) == expected
        assert list(store.calls("p1")) == [c for c in expected if c.key.problem_id == "p1"]
        # One iteration of a problem (the viewer's iteration page), in the order stored.
        assert list(store.calls("p1", 1)) == [c for c in expected if c.key.problem_id == "p1" and c.key.iteration == 1]
        # One iteration of every problem.
        assert list(store.calls(iteration=1)) == [c for c in expected if c.key.iteration == 1]
        for (c, r), call_id, stored in zip(written, ids, expected, strict=True):
            assert store.call(call_id) == stored
            assert store.call_messages(call_id) == [m.model_dump() for m in r.messages]
            assert store.call_sampling(call_id) == r.sampling.model_dump(mode="json")
            replayed = store.lookup_call(c.request_hash, c.key.sample, c.key.iteration)
            assert replayed == (stored if c.error is None else None)


def test_a_candidate_quoted_in_many_prompts_is_stored_once(tmp_path: Path) -> None:
    rng = random.Random(3)
    candidate = "\n".join(" ".join(rng.choice(["x", "=", "17", "23", "so"]) for _ in range(30)) for _ in range(200))
    problem = "Find every integer n such that n^2 + 1 divides n^3 + 5; justify each step of the argument in full."
    with RunStore(tmp_path) as store:
        solution = Completion(key=CallKey(role="solution"), request_hash="s", content=candidate)
        store.record_call(
            solution, ChatRequest(model="m", messages=[Message(role="user", content=problem)], sampling=Sampling())
        )
        blobs = store._db.execute("SELECT COUNT(*), SUM(LENGTH(data)) FROM blobs").fetchone()
        for sample in range(8):
            own = f"Check it: sample {sample}."
            prompt = f"<problem>\n{problem}\n</problem>\n\n<solution>\n{candidate}\n</solution>\n\n{own}"
            verifier = Completion(key=CallKey(role="verifier", sample=sample), request_hash="v", content="Score: 1")
            store.record_call(
                verifier, ChatRequest(model="m", messages=[Message(role="user", content=prompt)], sampling=Sampling())
            )
            assert store.call_messages(sample + 2) == [{"role": "user", "content": prompt}]
        # Eight prompts quoting the problem and the candidate added no blob: their own lines are short, kept inline.
        assert store._db.execute("SELECT COUNT(*), SUM(LENGTH(data)) FROM blobs").fetchone() == blobs
        assert blobs[0] == 2 and len(own) < INLINE_BELOW


# The calls table as schema 1 made it (before sampling_sources), and a row as its record_call wrote it.
OLD_CALLS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
CREATE TABLE calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, request_hash TEXT NOT NULL, sample INTEGER NOT NULL,
    problem_id TEXT NOT NULL, iteration INTEGER, role TEXT NOT NULL, endpoint TEXT NOT NULL, model TEXT NOT NULL,
    messages TEXT NOT NULL, sampling TEXT NOT NULL, content TEXT NOT NULL, reasoning TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL, reasoning_tokens INTEGER NOT NULL,
    usage_estimated INTEGER NOT NULL, finish_reason TEXT, max_tokens_sent INTEGER, latency_s REAL NOT NULL,
    attempts INTEGER NOT NULL, error TEXT, created_at REAL NOT NULL, error_cause TEXT,
    retry_causes TEXT NOT NULL DEFAULT '[]', logprobs TEXT, cached_prompt_tokens INTEGER
);
"""
OLD_INSERT = (
    "INSERT INTO calls (request_hash, sample, problem_id, iteration, role, endpoint, model, messages, sampling,"
    " content, reasoning, prompt_tokens, completion_tokens, reasoning_tokens, usage_estimated, finish_reason,"
    " max_tokens_sent, latency_s, attempts, error, created_at, error_cause, retry_causes, logprobs,"
    " cached_prompt_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?)"
)


def old_store(run_dir: Path, written: list[tuple[Completion, ChatRequest]]) -> None:
    run_dir.mkdir()
    db = sqlite3.connect(run_dir / "run.sqlite")
    db.executescript(OLD_CALLS)
    for c, r in written:
        u, k = c.usage, c.key
        logprobs = None if c.logprobs is None else json.dumps([t.model_dump() for t in c.logprobs])
        db.execute(
            OLD_INSERT,
            (c.request_hash, k.sample, k.problem_id, k.iteration, k.role, c.endpoint, c.model,
             json.dumps([m.model_dump() for m in r.messages], ensure_ascii=False), r.sampling.model_dump_json(),
             c.content, c.reasoning, u.prompt_tokens, u.completion_tokens, u.reasoning_tokens, int(u.estimated),
             c.finish_reason, c.max_tokens_sent, c.latency_s, c.attempts, c.error, c.error_cause,
             json.dumps(c.retry_causes), logprobs, u.cached_prompt_tokens),
        )  # fmt: skip
    db.commit()
    db.close()


def test_a_store_in_the_old_layout_reads_as_before_and_is_extended_in_the_new(tmp_path: Path) -> None:
    rng = random.Random(4)
    written = [call(i, rng) for i in range(12)]
    old_store(tmp_path / "run", written[:8])
    expected = [c.model_copy(update={"call_id": i + 1}) for i, (c, _) in enumerate(written)]
    # A reader beside a live run (the viewer) neither migrates it nor needs to.
    with RunStore(tmp_path / "run", read_only=True) as reader:
        assert list(reader.calls()) == expected[:8]
        assert reader.call_messages(3) == [m.model_dump() for m in written[2][1].messages]
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.get_meta("schema_version") == SCHEMA_VERSION
        # What a resume replays: each finished call, by its request hash and sample.
        for (c, _), stored in zip(written[:8], expected, strict=False):
            assert store.lookup_call(c.request_hash, c.key.sample, c.key.iteration) == (
                stored if c.error is None else None
            )
        for c, r in written[8:]:
            store.record_call(c, r)
        assert list(store.calls()) == expected
        assert [store.call_messages(i + 1) for i in range(12)] == [
            [m.model_dump() for m in r.messages] for _, r in written
        ]
        rows = store._db.execute("SELECT text_parts IS NULL, content FROM calls ORDER BY id").fetchall()
    assert [old for old, _ in rows] == [True] * 8 + [False] * 4
    assert all(content == "" for _, content in rows[8:])  # the new rows' texts are in the blobs only


def test_a_store_of_a_later_schema_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    with RunStore(tmp_path) as store:
        store.set_meta("schema_version", SCHEMA_VERSION + 1)
    # As a later tmas may make it: a table of this one's gone, a column of its own added.
    db = sqlite3.connect(tmp_path / "run.sqlite")
    db.executescript(
        "DROP TRIGGER result_summaries_follow; DROP TABLE result_summaries;"
        " ALTER TABLE calls DROP COLUMN first_token_s;"
    )
    db.close()
    schema = schema_of(tmp_path)
    for read_only in (False, True):
        with pytest.raises(StoreError, match=f"store schema {SCHEMA_VERSION + 1} is not one this tmas reads"):
            RunStore(tmp_path, read_only=read_only)
    # Nothing of this tmas's schema was written into it before it was refused.
    assert schema_of(tmp_path) == schema


def schema_of(run_dir: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(run_dir / "run.sqlite")
    try:
        return db.execute("SELECT name, sql FROM sqlite_master").fetchall()
    finally:
        db.close()
