"""Several samples of one prompt as one request: the grouping of alike calls, the split of one
reply's usage across its samples and the recognition of the servers that serve ``n``, in-process; then on the wire
against the simulated server: the request bodies it received, the rows the run store kept, the fallback recorded."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import eventually, settings_for
from tmas.api import aresume, asolve
from tmas.cli.main import app
from tmas.config import Sampling, Settings, load_settings
from tmas.errors import ConfigError, LLMError
from tmas.llm.batching import (
    MAX_SAMPLES_PER_REQUEST,
    Sample,
    SampleBatcher,
    apportion,
    batch_group,
    handed_out,
    one_per_choice,
    refuses_n,
    serves_samples,
    share_usage,
    split_usage,
)
from tmas.llm.client import LLMClient
from tmas.llm.model import ClientStats
from tmas.llm.sampling import DERIVED_SEED
from tmas.llm.server_kind import server_kind
from tmas.llm.tokens import TokenCounter
from tmas.llm.types import CallKey, ChatRequest, Completion, Usage, user
from tmas.problems import Problem
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedUsage, SimScript, SimServer
from tmas.testing.script import PersonaName

Q = "What is 17*23?"


def request(
    content: str = Q, *, seed: int | None = 1, derived: bool = True, temperature: float = 0.7, model: str = "m"
) -> ChatRequest:
    sources = {"temperature": "config", "seed": DERIVED_SEED if derived else "config"}
    return ChatRequest(
        model=model,
        messages=[user(content)],
        sampling=Sampling(temperature=temperature, seed=seed),
        sampling_sources=sources,
    )


def key(sample: int, role: str = "solution", problem: str = "p1") -> CallKey:
    return CallKey(problem_id=problem, role=role, sample=sample, iteration=0)


class RecordingSend:
    """A send function that answers each sample of a group with a completion naming its place in the group, and
    keeps every group it was given."""

    def __init__(self) -> None:
        self.groups: list[list[Sample]] = []

    async def __call__(self, samples: list[Sample]) -> list[Completion | None]:
        self.groups.append(samples)
        await asyncio.sleep(0)  # as the wire would, the answer comes on a later turn
        return [
            Completion(key=s.key, request_hash=s.request_hash, content=f"choice {i} of {len(samples)}")
            for i, s in enumerate(samples)
        ]


# ------------------------------------------------------------------------------------------------ grouping
def test_samples_alike_but_for_their_seed_are_one_group() -> None:
    group = batch_group(request(seed=11), key(0))
    assert batch_group(request(seed=99), key(7)) == group
    # Derived or set by a source, a seed is each sample's own (seed + j): which runs go together is seed_runs's call.
    assert batch_group(request(seed=5, derived=False), key(0)) == group
    assert batch_group(request(seed=None, derived=False), key(0)) != group
    # Any other difference keeps calls apart: prompt, sampling, model, role, problem, response_format.
    apart = [
        batch_group(request("What is 2+2?"), key(0)),
        batch_group(request(temperature=0.3), key(0)),
        batch_group(request(model="other"), key(0)),
        batch_group(request(), key(0, role="verifier")),
        batch_group(request(), key(0, problem="p2")),
        batch_group(request().model_copy(update={"response_format": {"type": "json_object"}}), key(0)),
    ]
    assert group not in apart and len(set(apart)) == len(apart)


async def test_alike_calls_started_together_go_as_one_group_in_sample_order() -> None:
    send = RecordingSend()
    batcher = SampleBatcher(send)
    order = [4, 2, 0, 3, 1]
    done = await asyncio.gather(
        *(batcher.submit(request(seed=100 + i), key(i), f"h{i}") for i in order),
        batcher.submit(request("What is 2+2?"), key(0), "other"),  # alone: goes back to its caller
    )
    assert [[s.key.sample for s in g] for g in send.groups] == [[0, 1, 2, 3, 4]]
    # The choices go out one per call in sample order; each caller gets its own completion.
    by_sample = {i: c for i, c in zip(order, done, strict=False)}
    assert {i: c.content for i, c in by_sample.items() if c is not None} == {i: f"choice {i} of 5" for i in range(5)}
    assert all(c is not None and c.key.sample == i for i, c in by_sample.items())
    assert done[-1] is None


async def test_samples_of_a_set_seed_go_together_only_where_their_seeds_follow_one_another() -> None:
    # Choice i of a request is drawn with the seed sent + i: a run of consecutive seeds goes as one request whose
    # choice i is the sample with the lead's seed + i; a sample whose seed follows none goes alone.
    send = RecordingSend()
    batcher = SampleBatcher(send)
    seeds = {0: 7, 1: 8, 2: 9, 3: 12, 4: 13, 5: 20}
    done = await asyncio.gather(
        *(batcher.submit(request(seed=seed, derived=False), key(i), f"h{i}") for i, seed in seeds.items())
    )
    sent = [[(s.key.sample, s.request.sampling.seed) for s in g] for g in send.groups]
    assert sent == [[(0, 7), (1, 8), (2, 9)], [(3, 12), (4, 13)]]
    assert [c.content if c is not None else None for c in done] == [
        "choice 0 of 3", "choice 1 of 3", "choice 2 of 3", "choice 0 of 2", "choice 1 of 2", None,
    ]  # fmt: skip


async def test_samples_of_a_derived_seed_go_together_only_where_their_seeds_follow_one_another() -> None:
    # A resumed run's remainder, samples 1 and 3 of a prompt whose derived seed is 40: choice 1 of one request sent
    # with 41 would be drawn with 42, not sample 3's 43, so each goes alone.
    send = RecordingSend()
    batcher = SampleBatcher(send)
    done = await asyncio.gather(*(batcher.submit(request(seed=40 + i), key(i), f"h{i}") for i in (1, 3)))
    # Their seeds following one another, they go as one request.
    together = await asyncio.gather(*(batcher.submit(request(seed=40 + i), key(i), f"h{i}") for i in (1, 2)))
    assert done == [None, None] and [[s.key.sample for s in g] for g in send.groups] == [[1, 2]]
    assert [c.content if c is not None else None for c in together] == ["choice 0 of 2", "choice 1 of 2"]


async def test_calls_of_different_turns_are_not_joined() -> None:
    send = RecordingSend()
    batcher = SampleBatcher(send)

    async def later(sample: int) -> Completion | None:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return await batcher.submit(request(seed=1 + sample), key(sample), "h")

    first, second = await asyncio.gather(batcher.submit(request(seed=1), key(0), "h"), later(1))
    assert first is None and second is None and send.groups == []


@pytest.mark.parametrize(("count", "sizes"), [(64, [64]), (65, [33, 32]), (130, [44, 43, 43])])
async def test_a_big_group_goes_as_near_equal_requests(count: int, sizes: list[int]) -> None:
    assert MAX_SAMPLES_PER_REQUEST == 64
    send = RecordingSend()
    batcher = SampleBatcher(send)
    done = await asyncio.gather(*(batcher.submit(request(seed=i), key(i), f"h{i}") for i in range(count)))
    assert [len(g) for g in send.groups] == sizes
    assert [s.key.sample for g in send.groups for s in g] == list(range(count))
    assert all(c is not None and c.key.sample == i for i, c in enumerate(done))


async def test_what_the_group_send_raises_every_caller_raises() -> None:
    async def unreachable(samples: list[Sample]) -> list[Completion | None]:
        raise LLMError("endpoint unreachable")

    batcher = SampleBatcher(unreachable)
    outcomes = await asyncio.gather(
        *(batcher.submit(request(seed=1 + i), key(i), "h") for i in range(3)), return_exceptions=True
    )
    assert [str(o) for o in outcomes] == ["endpoint unreachable"] * 3


async def test_a_request_whose_callers_all_left_is_cancelled() -> None:
    sent = asyncio.Event()
    cancelled = asyncio.Event()

    async def hangs(samples: list[Sample]) -> list[Completion | None]:
        sent.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return []

    batcher = SampleBatcher(hangs)
    callers = [asyncio.ensure_future(batcher.submit(request(seed=1 + i), key(i), "h")) for i in range(3)]
    await sent.wait()
    callers[0].cancel()
    await asyncio.sleep(0)
    assert not cancelled.is_set()  # two callers still wait for the reply
    for caller in callers[1:]:
        caller.cancel()
    await asyncio.wait_for(cancelled.wait(), 1)
    assert all(c.cancelled() for c in callers)


# ------------------------------------------------------------------------------------------------ replies and usage
def test_a_reply_of_n_choices_reads_as_one_reply_per_choice_in_index_order() -> None:
    data: dict[str, Any] = {
        "model": "m",
        "choices": [{"index": 2, "message": {"content": "c"}}, {"index": 0, "message": {"content": "a"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3},
    }
    data["choices"].append({"index": 1, "message": {"content": "b"}})
    replies = one_per_choice(data, 3)
    assert [r["choices"][0]["message"]["content"] for r in replies] == ["a", "b", "c"]
    assert all(r["usage"] == data["usage"] and r["model"] == "m" for r in replies)
    assert one_per_choice(data, 1) == [data]


def test_apportion_splits_a_total_exactly_by_largest_remainder() -> None:
    # 101 by 10:30:0 -> 25.25, 75.75, 0 -> 25, 75 and the one left to the largest remainder (0.75).
    assert apportion(101, [10, 30, 0]) == [25, 76, 0]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]  # ties go to the earlier part
    assert apportion(7, [0, 0]) == [4, 3]
    assert apportion(0, [5, 5]) == [0, 0]


def test_a_replys_usage_is_split_so_the_samples_add_up_to_it() -> None:
    # Worked by hand: the server reported 120 prompt tokens (64 of them cached) and 101 completion tokens (30 of them
    # reasoning) for 3 choices. The token counter (4 characters a token) counts the choices' texts as 10, 30 and 0
    # tokens, their reasoning as 0, 12 and 0.
    counter = TokenCounter()
    texts = [("x" * 40, ""), ("y" * 72, "z" * 48), ("", "")]
    reported = Usage(prompt_tokens=120, completion_tokens=101, reasoning_tokens=30, cached_prompt_tokens=64)
    completions = [
        Completion(key=key(i), request_hash="h", content=c, reasoning=r, usage=reported)
        for i, (c, r) in enumerate(texts)
    ]
    details = {"reasoning_tokens": 30}
    data = {"usage": {"prompt_tokens": 120, "completion_tokens": 101, "completion_tokens_details": details}}
    shares = [c.usage for c in share_usage(completions, data, counter)]
    assert [(u.prompt_tokens, u.cached_prompt_tokens) for u in shares] == [(120, 64), (0, 0), (0, 0)]
    # 101 by 10:30:0 -> 25, 76, 0; reasoning 30 by 0:12:0 -> 0, 30, 0.
    assert [u.completion_tokens for u in shares] == [25, 76, 0]
    assert [u.reasoning_tokens for u in shares] == [0, 30, 0]
    total = sum(shares, Usage())
    assert (total.prompt_tokens, total.completion_tokens, total.reasoning_tokens, total.cached_prompt_tokens) == (
        120,
        101,
        30,
        64,
    )


def test_reasoning_the_server_did_not_count_stays_each_choice_s_own() -> None:
    # Worked by hand: vLLM before 2026-08 reports no reasoning tokens. Each choice's were counted from its own reasoning
    # text as it was read (none: 0; 48 characters, 4 a token: 12), and stay its own rather than the first choice's
    # count shared out; the completion tokens are shared as before: 101 by 10:30 -> 25, 76.
    counter = TokenCounter()
    texts = [("x" * 40, ""), ("y" * 72, "z" * 48)]
    read = [
        Usage(prompt_tokens=120, completion_tokens=101),
        Usage(prompt_tokens=120, completion_tokens=101, reasoning_tokens=12, estimated=True),
    ]
    completions = [
        Completion(key=key(i), request_hash="h", content=c, reasoning=r, usage=u)
        for i, ((c, r), u) in enumerate(zip(texts, read, strict=True))
    ]
    data = {"usage": {"prompt_tokens": 120, "completion_tokens": 101}}
    shares = [c.usage for c in share_usage(completions, data, counter)]
    assert [u.completion_tokens for u in shares] == [25, 76]
    assert [u.reasoning_tokens for u in shares] == [0, 12]
    assert shares[1].estimated


def test_without_reported_usage_each_choice_keeps_its_own_count_and_the_prompt_counts_once() -> None:
    counted = [Usage(prompt_tokens=50, completion_tokens=n, estimated=True) for n in (7, 3)]
    completions = [Completion(key=key(i), request_hash="h", usage=u) for i, u in enumerate(counted)]
    shares = [c.usage for c in share_usage(completions, {"choices": []}, TokenCounter())]
    assert [(u.prompt_tokens, u.completion_tokens, u.estimated) for u in shares] == [(50, 7, True), (0, 3, True)]
    assert split_usage(Usage(prompt_tokens=5, completion_tokens=4), [1], [0]) == [
        Usage(prompt_tokens=5, completion_tokens=4)
    ]


def test_a_first_choice_usage_stays_with_the_first_sample_and_the_others_are_counted() -> None:
    # llama-server reports the first choice's usage alone: 120 prompt and 9 completion tokens here.
    first = Usage(prompt_tokens=120, completion_tokens=9, cached_prompt_tokens=100)
    texts = ["a" * 36, "b" * 52, "c" * 68]  # 9, 13 and 17 tokens at 4 characters a token
    completions = [Completion(key=key(i), request_hash="h", content=t, usage=first) for i, t in enumerate(texts)]
    data = {"usage": {"prompt_tokens": 120, "completion_tokens": 9}}
    shares = [c.usage for c in share_usage(completions, data, TokenCounter(), "llama-server")]
    assert shares == [
        first,
        Usage(completion_tokens=13, estimated=True),
        Usage(completion_tokens=17, estimated=True),
    ]


def test_a_failed_request_fails_every_sample_and_missing_choices_go_back() -> None:
    samples = [Sample(request(), key(i), f"h{i}", asyncio.Future(loop=asyncio.new_event_loop())) for i in range(3)]
    failed = Completion(key=key(0), request_hash="h0", error="HTTP 503: busy", error_cause="http_503")
    out = handed_out([failed], samples)
    assert [(c.key.sample, c.request_hash, c.error) for c in out if c is not None] == [
        (0, "h0", "HTTP 503: busy"),
        (1, "h1", "HTTP 503: busy"),
        (2, "h2", "HTTP 503: busy"),
    ]
    one = Completion(key=key(0), request_hash="h0", content="only one")
    assert [None if c is None else c.content for c in handed_out([one], samples)] == ["only one", None, None]


def test_what_a_failed_request_cost_is_charged_to_its_first_sample_alone() -> None:
    # Its attempts streamed text before they failed (tmas.llm.client): the server generated it once, for the request.
    samples = [Sample(request(), key(i), f"h{i}", asyncio.Future(loop=asyncio.new_event_loop())) for i in range(3)]
    spent = Usage(completion_tokens=250, reasoning_tokens=250, estimated=True)
    failed = Completion(key=key(0), request_hash="h0", error="stream cut", error_cause="cut", usage=spent)
    out = handed_out([failed], samples)
    assert [(c.key.sample, c.error, c.usage) for c in out if c is not None] == [
        (0, "stream cut", spent),
        (1, "stream cut", Usage()),
        (2, "stream cut", Usage()),
    ]


# ------------------------------------------------------------------------------------------------ servers
def test_the_servers_kind_comes_from_owned_by() -> None:
    def models(owner: Any) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]}

    assert server_kind(models("vllm")) == "vllm"
    assert server_kind(models("sglang")) == "sglang"
    assert server_kind(models("llamacpp")) == "llama-server"
    # OpenAI names an organisation, and look-alikes copy it: not recognised, so "auto" sends no n there.
    assert [server_kind(models(o)) for o in ("openai", "system", "tmas-sim", 3)] == [None] * 4
    assert server_kind(None) is None and server_kind({"data": "x"}) is None
    assert serves_samples(["vllm", "vllm"]) and serves_samples(["sglang", None])
    assert not serves_samples(["llama-server"]) and not serves_samples([None]) and not serves_samples([])


@pytest.mark.parametrize(
    ("cause", "error", "refused"),
    [
        ("http_400", "HTTP 400: Only one completion choice is allowed", True),  # llama-server
        ("http_500", "gave up after 4 attempts: HTTP 500: Only one completion choice is allowed", True),  # older
        ("http_400", "HTTP 400: n_cmpl cannot be greater than the number of slots, please increase -np", True),
        ("http_400", "HTTP 400: The simulator supports only n=1.", True),
        ("http_422", "HTTP 422: Invalid value for 'n': must be at most 1", True),
        ("http_400", "HTTP 400: messages must not be empty", False),
        ("http_503", "gave up after 4 attempts: HTTP 503: n is too large, try later", False),
        ("timeout", "no reply within 5s", False),
    ],
)
def test_a_refusal_of_n_is_told_from_other_failures(cause: str, error: str, refused: bool) -> None:
    assert refuses_n(Completion(key=key(0), request_hash="h", error=error, error_cause=cause)) is refused


# ------------------------------------------------------------------------------------------------ on the wire
def majority(sim: SimServer, k: int, **overrides: Any) -> Any:
    return settings_for(sim, method={"name": "majority", "params": {"k": k}}, **overrides)


def boxed(k: int, step: int = 0) -> list[str]:
    """k replies with distinct answers (100, 101, ...), reply i being 36 + ``step`` * i characters long."""
    out = []
    for i in range(k):
        tail = f"\n\n\\boxed{{{100 + i}}}"
        out.append(f"Attempt {i}: ".ljust(36 + step * i - len(tail), "x") + tail)
    return out


def stored(run_dir: Path) -> list[tuple[Completion, dict[str, Any]]]:
    """Every stored call in sample order, with the sampling stored with it."""
    with RunStore(run_dir, create=False) as store:
        rows = sorted(store.calls(), key=lambda c: (c.key.iteration or 0, c.key.role, c.key.sample))
        return [(c, store.call_sampling(c.call_id or 0)) for c in rows]


@pytest.mark.parametrize(
    ("persona", "setting", "sent"),
    [
        ("vllm", "auto", [5]),
        ("sglang", "auto", [5]),
        ("vllm", "off", [None] * 5),
        # Not recognised as serving n: the simulator's own ("tmas-sim"), llama-server ("llamacpp"), OpenAI ("system").
        ("sim", "auto", [None] * 5),
        ("llama-server", "auto", [None] * 5),
        ("openai", "auto", [None] * 5),
    ],
)
async def test_auto_sends_n_to_vllm_and_sglang_only(
    sim: SimServer, tmp_path: Path, persona: PersonaName, setting: str, sent: list[int | None]
) -> None:
    sim.set_script(SimScript(persona=persona))
    result = await asolve(Q, majority(sim, 5, endpoint__batch_samples=setting), run_dir=tmp_path / "run")
    bodies = sim.chat_bodies("solution")
    assert [b.get("n") for b in bodies] == sent
    assert result.calls == 5 and sorted(c.key.sample for c, _ in stored(tmp_path / "run")) == list(range(5))


async def test_a_server_that_refuses_n_falls_back_to_one_request_per_sample_recorded_once(
    sim: SimServer, tmp_path: Path
) -> None:
    # llama-server serves at most as many choices as it has slots, and says so in a 400 naming n_cmpl.
    sim.set_script(SimScript(persona="llama-server", slots=2))
    settings = majority(sim, 5, endpoint__batch_samples="on")
    settings.method.params["iterations"] = 2
    store, settings, todo = prepare_run(tmp_path / "run", settings, [Problem(problem_id="p", question=Q)], resume=False)
    with store:
        summary = await run_problems(settings, todo, store)
        fallbacks = store.downgrades("batch_samples")
        rows = list(store.calls())
    bodies = sim.chat_bodies("solution")
    assert [b.get("n") for b in bodies] == [5] + [None] * 10  # refused once, then never asked again
    where = [f"{sim.base_url} (model sim-model)"]
    assert list(fallbacks) == [sim.base_url] and list(summary.downgrades.get("batch_samples", {})) == where
    [first] = fallbacks[sim.base_url].values()
    assert first["role"] == "solution" and first["model"] == "sim-model" and "n_cmpl" in first["message"]
    assert sorted((c.key.iteration, c.key.sample) for c in rows) == [(t, i) for t in range(2) for i in range(5)]
    assert all(c.ok for c in rows) and summary.calls == 10


async def test_pinned_slots_never_batch(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(persona="llama-server"))  # its 4 slots would serve n = 3
    settings = majority(sim, 3, endpoint__batch_samples="on", endpoint__pin_slots=True, endpoint__max_in_flight=1)
    await asolve(Q, settings, run_dir=tmp_path / "run")
    assert [b.get("n") for b in sim.chat_bodies("solution")] == [None] * 3
    with RunStore(tmp_path / "run", create=False) as store:
        assert store.downgrades("batch_samples") == {}


def test_batch_samples_is_set_per_endpoint_role_and_environment() -> None:
    settings = load_settings(
        environ={"TMAS_BASE_URL": "http://127.0.0.1:1/v1", "TMAS_BATCH_SAMPLES": "on"},
        overrides={"roles.verifier.batch_samples": "off"},
    )
    assert Settings().endpoint.batch_samples == "auto"
    assert settings.endpoint.batch_samples == "on" and settings.roles["verifier"].batch_samples == "off"
    with pytest.raises(ConfigError, match=r"bad value for 'endpoint\.batch_samples'"):
        load_settings(environ={"TMAS_BATCH_SAMPLES": "sometimes"})


# ------------------------------------------------------------------------------------------------ what is stored
async def test_majority_vote_on_vllm_sends_its_samples_as_one_request(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(persona="vllm", rules=[Rule(role="solution", replies=boxed(5))]))
    result = await asolve(Q, majority(sim, 5), run_dir=tmp_path / "run")
    [body] = sim.chat_bodies("solution")
    assert body["n"] == 5
    rows = stored(tmp_path / "run")
    # One row per sample, choice i for sample i; each row keeps its own derived seed, the request carried sample 0's.
    assert [c.key.sample for c, _ in rows] == list(range(5))
    assert [c.content for c, _ in rows] == boxed(5) and len({c.content for c, _ in rows}) == 5
    assert len({s["seed"] for _, s in rows}) == 5 and body["seed"] == rows[0][1]["seed"]
    assert result.calls == 5 and sorted(c.answer for c in result.iterations[0].candidates) == [
        str(100 + i) for i in range(5)
    ]


async def test_a_resumed_run_asks_in_one_request_only_for_the_samples_it_lacks(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(SimScript(persona="sglang"))
    await asolve(Q, majority(sim, 3), run_dir=tmp_path / "run")
    assert [b["n"] for b in sim.chat_bodies("solution")] == [3]
    sim.reset()
    await aresume(tmp_path / "run", params={"k": 5})
    [body] = sim.chat_bodies("solution")
    rows = stored(tmp_path / "run")
    assert body["n"] == 2 and body["seed"] == rows[3][1]["seed"]  # samples 3 and 4; 0-2 replayed
    assert [c.key.sample for c, _ in rows] == list(range(5))


async def test_tmas_first_solutions_and_each_candidates_verifications_go_as_one_request(
    sim: SimServer, tmp_path: Path
) -> None:
    # Distinct solutions, so that each candidate's verifier prompt is its own (identical ones would go together too).
    sim.set_script(SimScript(persona="vllm", rules=[Rule(role="solution", replies=boxed(4))]))
    params = {"n": 4, "m": 3, "iterations": 1}
    result = await asolve(Q, settings_for(sim, method={"name": "tmas", "params": params}), run_dir=tmp_path / "run")
    assert [b["n"] for b in sim.chat_bodies("solution")] == [4]
    verifier = sim.chat_bodies("verifier")
    assert sorted(b["n"] for b in verifier) == [3] * 4  # one request per candidate, its 3 verifications
    rows = stored(tmp_path / "run")
    assert sum(c.key.role == "solution" for c, _ in rows) == 4 and sum(c.key.role == "verifier" for c, _ in rows) == 12
    assert len(result.iterations[0].candidates) == 4


async def test_a_batched_replys_usage_is_split_across_its_samples_as_worked_by_hand(
    sim: SimServer, tmp_path: Path
) -> None:
    # The server reports 120 prompt tokens (64 cached) once and 30 completion tokens per choice: 90 for 3 choices.
    # The replies are 36, 52 and 68 characters: 9, 13 and 17 tokens at 4 characters a token, so the 90 split as
    # 90 * 9/39 = 20.77, 90 * 13/39 = 30, 90 * 17/39 = 39.23 -> 21 (largest remainder), 30, 39.
    usage = ScriptedUsage(prompt_tokens=120, completion_tokens=30, cached_tokens=64)
    replies = boxed(3, step=16)
    assert [len(r) for r in replies] == [36, 52, 68]
    rule = Rule(role="solution", replies=replies, usage=usage)
    sim.set_script(SimScript(persona="vllm", cache_report=True, rules=[rule]))
    result = await asolve(Q, majority(sim, 3), run_dir=tmp_path / "run")
    shares = [c.usage for c, _ in stored(tmp_path / "run")]
    assert [(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens) for u in shares] == [
        (120, 64, 21),
        (0, 0, 30),
        (0, 0, 39),
    ]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.cached_prompt_tokens) == (
        120,
        90,
        64,
    )


async def test_on_llama_server_the_first_sample_keeps_the_usage_reported_and_the_others_are_counted(
    sim: SimServer, tmp_path: Path
) -> None:
    # llama-server serves n up to its slots; its usage is the first choice's alone: 120 prompt, 30 completion tokens.
    usage = ScriptedUsage(prompt_tokens=120, completion_tokens=30)
    rule = Rule(role="solution", replies=boxed(3, step=16), usage=usage)
    sim.set_script(SimScript(persona="llama-server", rules=[rule]))
    await asolve(Q, majority(sim, 3, endpoint__batch_samples="on"), run_dir=tmp_path / "run")
    assert [b["n"] for b in sim.chat_bodies("solution")] == [3]
    shares = [c.usage for c, _ in stored(tmp_path / "run")]
    # The others' replies are 52 and 68 characters: 13 and 17 tokens counted at 4 characters a token.
    assert [(u.prompt_tokens, u.completion_tokens, u.estimated) for u in shares] == [
        (120, 30, False),
        (0, 13, True),
        (0, 17, True),
    ]


async def test_a_batched_request_that_fails_for_another_reason_keeps_batching_on(
    sim: SimServer, tmp_path: Path
) -> None:
    # A request for n choices answered with an error that is no refusal of n (a bad request, a model the server does
    # not know) fails its samples; it says nothing of n, so the next samples still go as one request, and no
    # fallback is recorded.
    sim.set_script(SimScript(persona="vllm", rules=[Rule(role="solution", fault="http_400", times=1)]))
    settings = majority(sim, 3)
    settings.method.params["iterations"] = 2
    store, settings, todo = prepare_run(tmp_path / "run", settings, [Problem(problem_id="p", question=Q)], resume=False)
    with store:
        summary = await run_problems(settings, todo, store)
        fallbacks = store.downgrades("batch_samples")
    assert [b.get("n") for b in sim.chat_bodies("solution")] == [3, 3]
    assert fallbacks == {} and summary.downgrades == {}


async def test_a_cancelled_first_sample_leaves_the_prompt_its_request_cost_to_the_others(sim: SimServer) -> None:
    # One request serves samples 0 to 2; sample 0's caller leaves while the server holds it (the others settled the
    # vote, a budget stop). The request goes on for the others, and the prompt the server prefilled once, carried on
    # the first choice's usage, is still counted: on the first sample whose caller waits.
    sim.set_script(SimScript(persona="vllm", hold_after=0))
    stats = ClientStats()
    async with LLMClient(settings_for(sim, endpoint__batch_samples="on"), stats=stats) as llm:
        callers = [asyncio.ensure_future(llm.chat("solution", [user(Q)], key=key(i))) for i in range(3)]
        await eventually(lambda: sim.stats().held == 1)
        callers[0].cancel()
        sim.set_script(SimScript(persona="vllm"))  # the held request goes on
        answered = [await caller for caller in callers[1:]]
    served = sim.stats()
    assert [b.get("n") for b in sim.chat_bodies("solution")] == [3] and callers[0].cancelled()
    assert served.prompt_tokens > 0 and all(c.ok for c in answered)
    assert sum(c.usage.prompt_tokens for c in answered) == stats.usage.prompt_tokens == served.prompt_tokens
    assert stats.usage.completion_tokens == served.completion_tokens  # sample 0's choice was generated too
    assert answered[0].usage.prompt_tokens == served.prompt_tokens and answered[1].usage.prompt_tokens == 0


# ------------------------------------------------------------------------------------------------ a configured seed
async def test_a_configured_seed_moves_on_by_each_requests_lowest_sample(sim: SimServer, tmp_path: Path) -> None:
    # vLLM draws choice i with the seed sent + i. Majority vote's Beta stop asks 4 samples a round: under the same
    # seed the second round's request drew the first round's choices again, 8 samples being 4 twice over.
    sim.set_script(SimScript(persona="vllm", rules=[Rule(role="solution", replies=["\\boxed{1}", "\\boxed{2}"])]))
    params = {"k": 8, "stop": "beta", "round_size": 4}
    settings = settings_for(sim, method={"name": "majority", "params": params}, sampling__seed=7)
    await asolve(Q, settings, run_dir=tmp_path / "run")
    assert [(b["n"], b["seed"]) for b in sim.chat_bodies("solution")] == [(4, 7), (4, 11)]
    # Each sample is stored under its own request, with its own seed: sample j's is seed + j, as it went alone.
    assert [s["seed"] for _, s in stored(tmp_path / "run")] == list(range(7, 15))


@pytest.mark.parametrize("persona", ["vllm", "llama-server"])
async def test_under_a_configured_seed_batched_samples_are_the_replies_each_would_get_alone(
    sim: SimServer, tmp_path: Path, persona: PersonaName
) -> None:
    # vLLM and llama-server draw choice i with the seed sent + i, and so do their personas: each sample is then the
    # reply its own request gets alone, so batching changes no sample. (A question the simulator cannot work out:
    # its guess follows the seed.)
    sim.set_script(SimScript(persona=persona))
    replies = []
    for batch in ("on", "off"):
        settings = majority(sim, 4, sampling__seed=7, endpoint__batch_samples=batch)
        await asolve("Which number is hidden?", settings, run_dir=tmp_path / batch)
        replies.append([(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / batch)])
    assert replies[0] == replies[1] and [seed for _, seed, _ in replies[0]] == [7, 8, 9, 10]
    assert len({content for _, _, content in replies[0]}) > 1


# ------------------------------------------------------------------------------------------------ a derived seed
async def test_without_a_set_seed_batched_samples_are_the_replies_each_would_get_alone(
    sim: SimServer, tmp_path: Path
) -> None:
    # With no seed configured each sample got a seed hashed from its own index, and a request with n carried the
    # lowest sample's: choice i was drawn with that seed + i, not its own, so the same run drew other samples batched
    # than unbatched, and the store recorded seeds they were not drawn with. Now the seed is derived per prompt and
    # step, and sample j goes with it + j whichever way it is sent.
    sim.set_script(SimScript(persona="vllm"))
    runs = []
    for batch in ("on", "off"):
        sim.reset()
        await asolve(
            "Which number is hidden?", majority(sim, 4, endpoint__batch_samples=batch), run_dir=tmp_path / batch
        )
        rows = [(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / batch)]
        # The store keeps each sample's seed as the one it was drawn with.
        assert drawn_seeds(sim) == [seed for _, seed, _ in rows]
        runs.append(rows)
    assert runs[0] == runs[1]
    base = runs[0][0][1]
    assert [seed for _, seed, _ in runs[0]] == [base + j for j in range(4)]
    assert len({content for _, _, content in runs[0]}) > 1


async def test_a_resumed_batched_run_without_a_set_seed_draws_what_the_uninterrupted_one_drew(
    sim: SimServer, tmp_path: Path
) -> None:
    # Interrupted with samples 1 and 3 of majority@4 missing, the resumed run sent one request with sample 1's seed
    # and n = 2: sample 3 was drawn with sample 1's seed + 1, not the one the uninterrupted run drew it with.
    sim.set_script(SimScript(persona="vllm"))
    question = "Which number is hidden?"
    await asolve(question, majority(sim, 4), run_dir=tmp_path / "whole")
    await asolve(question, majority(sim, 4), run_dir=tmp_path / "cut")
    with sqlite3.connect(tmp_path / "cut" / "run.sqlite") as db:
        db.execute("DELETE FROM results")
        db.execute("DELETE FROM calls WHERE sample IN (1, 3)")
    sim.reset()
    await aresume(tmp_path / "cut")
    whole = [(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / "whole")]
    assert [(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / "cut")] == whole
    # Samples 1 and 3 asked again, each with the seed it was drawn with before (their seeds do not follow one another).
    assert sorted((b.get("n", 1), b["seed"]) for b in sim.chat_bodies("solution")) == [
        (1, whole[1][1]),
        (1, whole[3][1]),
    ]


def drawn_seeds(sim: SimServer, role: str = "solution") -> list[int]:
    """The seed each sample was drawn with, as vLLM draws them: a request's seed + i for its choice i."""
    return sorted(b["seed"] + i for b in sim.chat_bodies(role) for i in range(b.get("n", 1)))


@pytest.mark.parametrize(("batch", "requests"), [("on", 2), ("off", 8)])
async def test_a_configured_seed_draws_sample_j_with_seed_plus_j_batched_or_not(
    sim: SimServer, tmp_path: Path, batch: str, requests: int
) -> None:
    # Sent alone, every sample went with the configured seed: on vLLM majority@4 was one sample counted four times,
    # and iteration 1 drew iteration 0's again. Now sample j goes with seed + j alone as in a request with n, and an
    # iteration's samples continue the earlier ones' numbering (the same prompt).
    sim.set_script(SimScript(persona="vllm"))
    settings = settings_for(
        sim,
        method={"name": "majority", "params": {"k": 4, "iterations": 2}},
        sampling__seed=7,
        endpoint__batch_samples=batch,
    )
    await asolve(Q, settings, run_dir=tmp_path / "run")
    assert len(sim.chat_bodies("solution")) == requests
    assert drawn_seeds(sim) == list(range(7, 15))
    assert [s["seed"] for _, s in stored(tmp_path / "run")] == list(range(7, 15))
    # Resumed with one more iteration, the stored samples replay and the new ones continue the numbering.
    sim.reset()
    await aresume(tmp_path / "run", params={"iterations": 3})
    assert drawn_seeds(sim) == list(range(15, 19))


async def test_a_configured_seeds_group_split_in_parts_draws_distinct_choices(sim: SimServer) -> None:
    sim.set_script(SimScript(persona="vllm"))
    await asolve(Q, majority(sim, MAX_SAMPLES_PER_REQUEST + 2, sampling__seed=7))
    half = MAX_SAMPLES_PER_REQUEST // 2 + 1
    assert [(b["n"], b["seed"]) for b in sim.chat_bodies("solution")] == [(half, 7), (half, 7 + half)]


async def test_a_resumed_runs_remainder_under_a_configured_seed_draws_the_choices_it_lacks(
    sim: SimServer, tmp_path: Path
) -> None:
    sim.set_script(SimScript(persona="sglang"))
    await asolve(Q, majority(sim, 3, sampling__seed=7), run_dir=tmp_path / "run")
    assert [(b["n"], b["seed"]) for b in sim.chat_bodies("solution")] == [(3, 7)]
    sim.reset()
    await aresume(tmp_path / "run", params={"k": 5})
    # Samples 3 and 4: choices 10 and 11, as one request of 5 would have drawn them; not 7 and 8 again.
    assert [(b["n"], b["seed"]) for b in sim.chat_bodies("solution")] == [(2, 10)]


@pytest.mark.parametrize("batch", ["on", "off"])
async def test_a_run_stored_when_every_sample_went_with_the_configured_seed_replays_on_resume(
    sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: str
) -> None:
    # Versions before sample j went with seed + j sent every sample of a prompt the configured seed as it was, and
    # stored each under its own request with that seed. Resumed, samples 1..k-1 were looked up under seed + j only,
    # found nothing and were asked again: the run lost finished work.
    sim.set_script(SimScript(persona="vllm"))
    settings = majority(sim, 4, sampling__seed=7, endpoint__batch_samples=batch)
    with monkeypatch.context() as old:
        old.setattr("tmas.methods.base.for_sample", lambda resolved, sample: resolved)
        await asolve(Q, settings, run_dir=tmp_path / "run")
    before = [(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / "run")]
    assert [seed for _, seed, _ in before] == [7, 7, 7, 7]
    with sqlite3.connect(tmp_path / "run" / "run.sqlite") as db:
        db.execute("DELETE FROM results")
    sim.reset()
    await aresume(tmp_path / "run")
    assert sim.chat_bodies("solution") == []
    assert [(c.key.sample, s["seed"], c.content) for c, s in stored(tmp_path / "run")] == before


@pytest.mark.parametrize(
    ("toml", "env", "said"),
    [
        (
            '[endpoint]\npin_slots = true\nbatch_samples = "on"\n',
            {},
            'CONFIG: endpoint.pin_slots = true and endpoint.batch_samples = "on" never go together',
        ),
        (
            '[endpoint]\npin_slots = true\n[roles.verification]\nbatch_samples = "on"\n',
            {},
            'CONFIG: endpoint.pin_slots = true and roles.verification.batch_samples = "on" never go together',
        ),
        (
            '[endpoint]\nbatch_samples = "on"\n',
            {"TMAS_PIN_SLOTS": "true"},
            'settings: endpoint.pin_slots = true and endpoint.batch_samples = "on" never go together',
        ),
    ],
)
def test_batch_samples_on_with_pinned_slots_is_refused_naming_both_keys(
    tmp_path: Path, toml: str, env: dict[str, str], said: str
) -> None:
    # A pinned slot takes one call at a time: each sample went as its own request, the "on" asked for ignored
    # without a word.
    config = tmp_path / "tmas.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError) as refused:
        load_settings(config, environ=env)
    assert str(refused.value) == (
        said.replace("CONFIG", str(config))
        + ' (a pinned slot takes one call at a time, each sample its own request): set batch_samples to "auto" or'
        ' "off"'
    )


def test_a_role_that_pins_no_slot_may_batch_beside_a_pinned_default(tmp_path: Path) -> None:
    config = tmp_path / "tmas.toml"
    config.write_text('[endpoint]\npin_slots = true\n[roles.verification]\npin_slots = false\nbatch_samples = "on"\n')
    assert load_settings(config, environ={}).roles["verification"].batch_samples == "on"


def test_batch_samples_on_with_the_embedded_llama_server_is_refused(tmp_path: Path) -> None:
    # The embedded llama-server pins every problem's calls to a slot (tmas.llm.provision): the "on" asked for was
    # ignored without a word, each sample its own request.
    config = tmp_path / "tmas.toml"
    config.write_text('[endpoint]\nbatch_samples = "on"\n[roles.verification]\nbase_url = "http://127.0.0.1:9/v1"\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(config, environ={})
    assert str(refused.value) == (
        'settings: endpoint.batch_samples = "on" with the embedded llama-server, which pins each problem\'s calls to a'
        ' slot (one call at a time, each sample its own request): set batch_samples to "auto" or "off"'
    )
    # The file alone is no run's settings: an endpoint the flags give batches as asked.
    given = load_settings(config, {"endpoint.base_url": ["http://127.0.0.1:8000/v1"]}, environ={})
    assert given.endpoint.batch_samples == "on"
    # A role served at its own URL is not the embedded server's.
    config.write_text('[roles.verification]\nbase_url = "http://127.0.0.1:9/v1"\nbatch_samples = "on"\n')
    assert load_settings(config, environ={}).roles["verification"].batch_samples == "on"


def test_a_run_stored_with_batch_samples_on_beside_pinned_slots_is_refused_on_resume(
    sim: SimServer, tmp_path: Path
) -> None:
    # Stored so (as the Python API takes a Settings object unchecked, or a tmas before the check), it would go on
    # with the "on" ignored without a word: resumed, it is refused in the line a new run's settings get.
    run_dir = tmp_path / "run"
    settings = majority(sim, 2, endpoint__batch_samples="on", endpoint__pin_slots=True, endpoint__max_in_flight=1)
    asyncio.run(asolve(Q, settings, run_dir=run_dir))
    sent = len(sim.chat_bodies("solution"))
    line = (
        f'{run_dir} (its stored settings): endpoint.pin_slots = true and endpoint.batch_samples = "on" never go'
        " together (a pinned slot takes one call at a time, each sample its own request): set batch_samples to"
        ' "auto" or "off"'
    )
    # Resumed with a sample more to ask.
    out = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "-p", "k=3", "-y"])
    assert isinstance(out.exception, ConfigError), out.output
    assert str(out.exception) == line
    with pytest.raises(ConfigError) as refused:
        asyncio.run(aresume(run_dir, params={"k": 3}))
    assert str(refused.value) == line
    assert len(sim.chat_bodies("solution")) == sent


async def test_a_resume_onto_the_embedded_llama_server_refuses_a_stored_batch_samples_on(
    sim: SimServer, tmp_path: Path
) -> None:
    # The run batched at its endpoint; a flag given now moves it to the embedded llama-server, which pins every
    # problem's calls to a slot.
    run_dir = tmp_path / "run"
    await asolve(Q, majority(sim, 2, endpoint__batch_samples="on"), run_dir=run_dir)
    with pytest.raises(ConfigError) as refused:
        await aresume(run_dir, overrides={"local.model": "smollm2-135m"}, params={"k": 3})
    assert str(refused.value) == (
        f'{run_dir} (its stored settings): endpoint.batch_samples = "on" with the embedded llama-server, which pins'
        " each problem's calls to a slot (one call at a time, each sample its own request): set batch_samples to"
        ' "auto" or "off"'
    )
