"""Prompt tokens that hit the cache: with ``pin_slots``, each problem of a run keeps to one server
slot (llama-server's ``id_slot``), one call at a time, so that slot's prompt cache holds the problem's prefixes; the
exploit prompt starts with the memory agents' rollouts block; and the last iteration computes no summary or bank that
nothing reads."""

from __future__ import annotations

import asyncio
import copy
from collections import defaultdict
from pathlib import Path
from typing import Any

from conftest import dead_url, scripted_settings, settings_for
from scripted_runs import scripted_run, solve_in_process
from tmas.config import Settings
from tmas.llm.client import LLMClient
from tmas.llm.lanes import Lane, SlotQueue, pinned_slot
from tmas.llm.routes import Routes
from tmas.llm.types import CallKey, ChainKey, user
from tmas.methods import create_method
from tmas.planning.estimate import calls_per_problem
from tmas.problems import Problem
from tmas.runner import RunSummary, prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import ScriptedModel, SimScript, SimServer

TMAS = {"name": "tmas", "params": {"n": 2, "m": 1, "iterations": 2, "epsilon": 0.0}}


def test_lanes_fill_slot_zero_of_every_replica_first_and_never_leave_a_slot_idle() -> None:
    # Fewer lanes than slots: nothing pinned (one problem's parallel calls then use every slot).
    assert pinned_slot(Lane(0, 1), replicas=1, slots_per_replica=4) is None
    assert pinned_slot(Lane(2, 3), replicas=2, slots_per_replica=2) is None
    assert pinned_slot(None, replicas=1, slots_per_replica=4) is None
    # No known slot count (max_in_flight = 0): nothing to pin to.
    assert pinned_slot(Lane(0, 4), replicas=1, slots_per_replica=0) is None
    assert [pinned_slot(Lane(w, 4), 2, 2) for w in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # More lanes than slots: lanes share slots, evenly.
    assert [pinned_slot(Lane(w, 6), 2, 2) for w in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 0), (1, 0)]


async def test_the_lane_is_data_in_every_call_key_of_a_runs_worker(tmp_path: Path) -> None:
    """The runner gives each worker's sessions their lane; every call of a problem carries it in its key, and the
    client pins by the key (no state of the task that sends it)."""
    settings = scripted_settings(method={"name": "cot", "params": {}}, problems_in_flight=2)
    model = ScriptedModel(SimScript(), settings)
    await scripted_run(model, tmp_path / "run", _problems(4))
    lanes: dict[str, set[Lane | None]] = defaultdict(set)
    for call in model.calls:
        lanes[call.key.problem_id].add(call.key.lane)
    assert len(lanes) == 4 and all(len(per) == 1 for per in lanes.values())
    assert set().union(*lanes.values()) == {Lane(0, 2), Lane(1, 2)}
    # Outside a run's workers (one problem solved in process) a call has no lane.
    alone = ScriptedModel(SimScript(), settings)
    await solve_in_process(alone, "What is 2+2?")
    assert {call.key.lane for call in alone.calls} == {None}
    # The routes read the lane from the key: lane 1 of 2 on one replica of two slots is slot 1.
    route = Routes(settings_for_pins()).route("solution")
    assert Routes.pinned(route, CallKey(role="solution", lane=Lane(1, 2))) == (0, 1)
    assert Routes.pinned(route, CallKey(role="solution")) is None


def settings_for_pins() -> Settings:
    return scripted_settings(endpoint={"base_url": ["http://127.0.0.1:9/v1"], "max_in_flight": 2, "pin_slots": True})


def _problems(n: int) -> list[Problem]:
    return [Problem(problem_id=f"q{i}", question=f"What is {i}+{i}?", answer=str(2 * i)) for i in range(n)]


def _run(tmp_path: Path, name: str, *servers: SimServer, problems: int = 6, **overrides: Any) -> RunSummary:
    settings = settings_for(*servers, method=copy.deepcopy(TMAS), seed=3, **overrides)
    store, settings, todo = prepare_run(tmp_path / name, settings, _problems(problems), resume=False)
    with store:
        return asyncio.run(run_problems(settings, todo, store, keep_results=True))


def test_each_problem_keeps_to_one_slot_of_one_replica(tmp_path: Path, sim: SimServer, sim2: SimServer) -> None:
    summary = _run(
        tmp_path, "pinned", sim, sim2, endpoint__max_in_flight=2, endpoint__pin_slots=True, problems_in_flight=4
    )
    assert summary.done == 6
    where: dict[str, set[tuple[int, Any]]] = defaultdict(set)
    for server_index, server in enumerate((sim, sim2)):
        for request in server.requests:
            where[str(request.problem_id)].add((server_index, request.body.get("id_slot")))
        # Never two calls at once on one slot: the client queues a lane's calls instead of the server.
        assert server.stats().max_in_flight_per_slot == 1
    assert sorted(where) == [f"q{i}" for i in range(6)]
    assert all(len(places) == 1 for places in where.values()), where
    # Four lanes over 2 replicas x 2 slots: every slot served a problem, and only the slots the server has.
    used = set().union(*where.values())
    assert used == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_nothing_is_pinned_without_pin_slots_or_with_fewer_problems_than_slots(tmp_path: Path, sim: SimServer) -> None:
    _run(tmp_path, "off", sim, endpoint__max_in_flight=2, problems_in_flight=2)
    assert sim.requests and all("id_slot" not in r.body for r in sim.requests)
    sim.reset()
    # One problem on a 2-slot endpoint: its N = 2 candidates still go out together, unpinned.
    sim.set_script(SimScript(latency_s=0.05))
    _run(tmp_path, "one", sim, problems=1, endpoint__max_in_flight=2, endpoint__pin_slots=True)
    assert sim.requests and all("id_slot" not in r.body for r in sim.requests)
    assert sim.stats().max_in_flight == 2


def test_each_candidate_s_calls_run_back_to_back_on_its_slot(tmp_path: Path, sim: SimServer) -> None:
    # A latency, so that both candidates' calls are queued at once and the order is the queue's choice.
    sim.set_script(SimScript(latency_s=0.02))
    _run(tmp_path, "chains", sim, problems=2, endpoint__max_in_flight=2, endpoint__pin_slots=True)
    with RunStore(tmp_path / "chains", read_only=True) as store:
        solutions = {
            store.call_sampling(c.call_id)["seed"]: c.content
            for c in store.calls()
            if c.key.role == "solution" and c.call_id is not None
        }
    by_problem: dict[str, list[Any]] = defaultdict(list)
    for request in sim.requests:
        by_problem[str(request.problem_id)].append(request)
    for requests in by_problem.values():
        assert len({r.body["id_slot"] for r in requests}) == 1
        roles = [r.role for r in requests]
        # Iteration 1: candidate 0's solution, verification and summary, then candidate 1's, then the memory
        # agents; iteration 2 (no summaries: skip_final_memory): each candidate's solution and verification.
        # First come, first served would interleave them: solution, solution, verifier, verifier, ...
        chain_roles = ["solution", "verifier", "summary"]
        assert roles[:6] == chain_roles * 2, roles
        assert sorted(roles[6:8]) == ["experience", "guideline"]
        assert roles[8:] == ["solution", "verifier"] * 2, roles
        # Each verification checks the solution written just before it on the slot (found by the call's seed).
        for at in (0, 3, 8, 10):
            written = solutions[requests[at].body["seed"]]
            assert written and written in requests[at + 1].body["messages"][-1]["content"]


def test_a_chain_keeps_its_slot_between_calls_until_it_ends() -> None:
    order: list[str] = []

    async def call(queue: SlotQueue, name: str, chain: ChainKey | None = None) -> None:
        async with queue.turn(chain):
            order.append(name)
            await asyncio.sleep(0)

    async def chained(queue: SlotQueue, name: str, started: asyncio.Event) -> None:
        # The chain is named by the calls' keys: equal keys, built apart, are one chain.
        index = ord(name) - ord("a")
        try:
            await call(queue, f"{name}1", ChainKey(problem_id="q0", iteration=0, chain=index))
            started.set()
            # Work between the chain's calls: another caller is queued meanwhile, and waits.
            for _ in range(5):
                await asyncio.sleep(0)
            await asyncio.gather(
                call(queue, f"{name}2a", ChainKey(problem_id="q0", iteration=0, chain=index)),
                call(queue, f"{name}2b", ChainKey(problem_id="q0", iteration=0, chain=index)),
            )
        finally:
            queue.chain_ended(ChainKey(problem_id="q0", iteration=0, chain=index))

    async def main() -> None:
        queue = SlotQueue()
        started = asyncio.Event()
        holder = asyncio.ensure_future(chained(queue, "a", started))
        await started.wait()
        other = asyncio.ensure_future(call(queue, "x"))
        second = asyncio.ensure_future(chained(queue, "b", asyncio.Event()))
        await asyncio.gather(holder, other, second)
        # A cancelled waiter leaves the queue, and the turn goes on.
        async with queue.turn():
            waiting = asyncio.ensure_future(call(queue, "cancelled"))
            await asyncio.sleep(0)
            waiting.cancel()
        await call(queue, "last")

    asyncio.run(main())
    assert order == ["a1", "a2a", "a2b", "x", "b1", "b2a", "b2b", "last"]


def test_a_pinned_call_whose_replica_is_down_goes_to_another(tmp_path: Path, sim: SimServer) -> None:
    settings = settings_for(
        sim, method=copy.deepcopy(TMAS), seed=3, endpoint__max_in_flight=1, endpoint__pin_slots=True
    )
    with dead_url() as down:
        endpoint = settings.endpoint.model_copy(update={"base_url": [down, sim.base_url]})
        settings = settings.model_copy(update={"endpoint": endpoint, "problems_in_flight": 2})
        store, settings, todo = prepare_run(tmp_path / "down", settings, _problems(2), resume=False)
        with store:
            summary = asyncio.run(run_problems(settings, todo, store))
    assert summary.done == 2 and summary.failed_calls == 0
    by_problem = {str(r.problem_id) for r in sim.requests}
    assert by_problem == {"q0", "q1"}


async def test_pinned_calls_do_not_go_to_a_replica_already_known_down() -> None:
    # A lane pinned to a replica where no server listens: its first call is refused there and answered by the other
    # replica; its later calls go to the other at once (the replica is out of routing), none spending an attempt.
    with SimServer(SimScript(persona="llama-server")) as sim, dead_url() as down:
        settings = settings_for(sim, endpoint__max_in_flight=1, endpoint__pin_slots=True)
        endpoint = settings.endpoint.model_copy(update={"base_url": [down, sim.base_url]})
        async with LLMClient(settings.model_copy(update={"endpoint": endpoint})) as llm:
            done = [
                await llm.chat("solution", [user(f"What is {i}*7?")], key=CallKey(role="solution", lane=Lane(0, 2)))
                for i in range(4)
            ]
    assert all(c.ok for c in done) and {c.endpoint for c in done} == {sim.base_url}
    assert [c.retry_causes for c in done] == [["connect"], [], [], []]


def test_the_last_iteration_computes_no_summary_or_bank_and_answers_the_same(tmp_path: Path, sim: SimServer) -> None:
    skipped = _run(tmp_path, "skip", sim, problems=2)
    roles = sim.stats().by_role
    sim.reset()
    full = _run(tmp_path, "full", sim, problems=2, method__params__skip_final_memory=False)
    full_roles = sim.stats().by_role
    # N = 2, T = 2, two problems: the last iteration's 2 summaries and 2 memory updates are gone, per problem.
    assert (roles["summary"], roles["experience"], roles["guideline"]) == (4, 2, 2)
    assert (full_roles["summary"], full_roles["experience"], full_roles["guideline"]) == (8, 4, 4)
    assert roles["solution"] == full_roles["solution"] == 8 and roles["verifier"] == full_roles["verifier"] == 8
    # (Results come in the order problems finish, which two concurrent problems need not keep.)
    assert {r.problem_id: r.answer for r in skipped.results} == {r.problem_id: r.answer for r in full.results}
    # The cost estimate counts the calls the run makes.
    for params, seen in (({}, roles), ({"skip_final_memory": False}, full_roles)):
        method = create_method("tmas", {**TMAS["params"], **params})
        assert {role: 2 * n for role, n in calls_per_problem(method).expected.items()} == dict(seen)
    last = skipped.results[0].iterations[-1]
    assert last.state["experience_update"] == {"status": "skipped"}
    assert any("skip_final_memory" in note for note in last.notes)


def test_the_exploit_prompt_starts_as_the_memory_agents_prompts_do(tmp_path: Path, sim: SimServer) -> None:
    _run(tmp_path, "prefix", sim, problems=1)
    requests = sim.requests

    def user_text(role: str, iteration_of_prompt: str | None = None) -> str:
        bodies = [r.body for r in requests if r.role == role]
        texts = [b["messages"][-1]["content"] for b in bodies]
        if iteration_of_prompt is not None:
            texts = [t for t in texts if iteration_of_prompt in t]
        assert texts, role
        return str(texts[0])

    exploit = user_text("solution", "<rollouts>")
    for role in ("experience", "guideline"):
        memory = user_text(role)
        shared = memory.split("</rollouts>")[0] + "</rollouts>"
        assert exploit.startswith(shared) and len(shared) > 200
