"""Structured outputs on the wire: every role whose reply is JSON sends its reply model's JSON
schema as ``response_format``; ``structured_output = "auto"`` falls back to plain text once a server refuses it and
records that once per endpoint, ``"json_schema"`` fails the call with a clear error, ``"off"`` sends none. All
asserted on the bodies the simulated server received and on the records the run store kept."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from conftest import scripted_settings, settings_for
from mattrl_runs import hand_worked_transcript, write_run
from tmas.agents.baselines import distillation_reply_model, parse_distillation
from tmas.agents.experience import ExperienceReply, experience_reply_model, parse_experience_update
from tmas.agents.guideline import GuidelineReply, parse_guideline_update
from tmas.agents.guideline_judge import NoveltyReply, StrategyView, parse_novelty
from tmas.agents.mattrl_review import DifferentialReviewReply, ReviewReply, parse_differential_review, parse_review
from tmas.agents.mattrl_team import team_reply_model
from tmas.agents.pool_summarizer import (
    SummarizerReply,
    TeachingSummarizerReply,
    parse_summarizer,
    parse_teaching_summarizer,
)
from tmas.agents.utterance_judge import JudgeScoreReply, RubricReply, parse_judge_score, parse_rubric_score
from tmas.agents.verification import VerificationReply, parse_verification, verification_reply_model
from tmas.api import asolve
from tmas.config import Sampling, load_settings
from tmas.grading.judge import JudgeReplyFormat, judge_once, parse_judge_reply
from tmas.llm.client import LLMClient
from tmas.llm.factory import open_model
from tmas.llm.model import ClientStats
from tmas.llm.schema import grammar_fit, json_schema, response_format
from tmas.llm.types import user
from tmas.methods import METHODS
from tmas.methods.mattrl_domains import domain_named
from tmas.pool.build import BuildConfig, build_pool
from tmas.problems import Problem
from tmas.rl.novelty import LLMNoveltyJudge
from tmas.rl.scoring import RolloutInput
from tmas.runner import prepare_run, run_problems
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript, SimServer
from tmas.testing.script import PersonaName

Q = "What is 17*23?"
SUMMARY_JSON = [user("Reply with JSON.")]


def schema_names(sim: SimServer) -> dict[str, set[str | None]]:
    """Per role, the reply-model names its requests carried as response_format (None: a request without one)."""
    out: dict[str, set[str | None]] = {}
    for entry in sim.requests:
        if entry.endpoint != "chat":
            continue
        fmt = entry.body.get("response_format")
        if fmt is not None:
            # Each schema sent is exactly its reply model's (flattened) schema; the experience agent's, the
            # verifier's and the distiller's are bounded by the max_tokens of the same request.
            name = fmt["json_schema"]["name"]
            if name == "TeamReply":
                model = team_model_of(fmt["json_schema"]["schema"])
            elif name in BY_MAX_TOKENS:
                model = BY_MAX_TOKENS[name](entry.body.get("max_tokens"))
            else:
                model = MODELS[name]
            assert fmt["type"] == "json_schema"
            assert fmt["json_schema"]["schema"] == json_schema(model), name
        out.setdefault(entry.role, set()).add(None if fmt is None else fmt["json_schema"]["name"])
    return out


def team_model_of(schema: dict[str, Any]) -> type[BaseModel]:
    """The recruiting reply model of the team size, catalog and roles a sent schema names (each domain's own)."""
    members = schema["properties"]["members"]
    member = members["items"]["properties"]
    catalog, roles = (tuple(member[field].get("enum", ())) for field in ("specialty", "role"))
    return team_reply_model(members["maxItems"], catalog, roles)


BY_MAX_TOKENS: dict[str, Callable[[int | None], type[BaseModel]]] = {
    "ExperienceReply": experience_reply_model,
    "VerificationReply": verification_reply_model,
    # RSE's default of 4 items of each kind a distillation.
    "DistillationReply": lambda max_tokens: distillation_reply_model(max_tokens, 4),
}
MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (
        VerificationReply,
        ExperienceReply,
        GuidelineReply,
        team_reply_model(3),
        ReviewReply,
        JudgeReplyFormat,
        NoveltyReply,
        JudgeScoreReply,
        SummarizerReply,
        DifferentialReviewReply,
        RubricReply,
        TeachingSummarizerReply,
    )
}

# A registered method, params, and per role (each one the method declares) the reply models its calls send (None:
# calls whose reply is free text or tags).
SCHEMA_CASES: list[tuple[str, dict[str, Any], dict[str, set[str | None]]]] = [
    (
        "tmas",
        {"n": 1, "m": 1, "iterations": 1, "skip_final_memory": False},
        {
            "solution": {None},
            "verifier": {"VerificationReply"},
            "summary": {None},
            "experience": {"ExperienceReply"},
            "guideline": {"GuidelineReply"},
        },
    ),
    # Scores read from log-probabilities stay unconstrained (see LLMClient._response_format).
    (
        "tmas",
        {"n": 1, "m": 1, "iterations": 1, "verifier_score": "logprob", "skip_final_memory": False},
        {
            "solution": {None},
            "verifier": {None},
            "summary": {None},
            "experience": {"ExperienceReply"},
            "guideline": {"GuidelineReply"},
        },
    ),
    (
        "verify_refine",
        {"n": 1, "m": 1, "iterations": 2},
        {"solution": {None}, "verifier": {"VerificationReply"}, "corrector": {None}},
    ),
    ("rse", {"n": 1, "iterations": 2}, {"solution": {None}, "distiller": {"DistillationReply"}}),
    (
        "mattrl",
        {"team_size": 2, "iterations": 1},
        # The coordinator recruits (JSON) and decides (tags); specialists write solutions.
        {"coordinator": {"TeamReply", None}, "specialist": {None}, "reviewer": {"ReviewReply"}},
    ),
    (
        "mattrl",
        {"team_size": 2, "iterations": 2, "domain": "medicine"},
        # A.4: the peer review of a differential has its own shape (round 1; the last round asks for none).
        {"coordinator": {"TeamReply", None}, "specialist": {None}, "reviewer": {"DifferentialReviewReply"}},
    ),
]


@pytest.mark.parametrize(
    ("method", "params", "wanted"), SCHEMA_CASES, ids=[f"{m[0]}-{i}" for i, m in enumerate(SCHEMA_CASES)]
)
async def test_each_structured_role_sends_its_reply_schema(
    sim: SimServer, method: str, params: dict[str, Any], wanted: dict[str, set[str | None]]
) -> None:
    assert set(wanted) <= set(METHODS[method].traits.roles), f"{method} declares roles {METHODS[method].traits.roles}"
    # "json_schema": every call sends its schema ("auto" holds it until a reply shows the model does not think
    # inline: tested below).
    settings = settings_for(sim, method={"name": method, "params": params}, endpoint__structured_output="json_schema")
    result = await asolve(Q, settings)
    assert result.status == "done", result.error
    assert schema_names(sim) == wanted


async def test_judges_send_their_reply_schemas(sim: SimServer, tmp_path: Path) -> None:
    async with LLMClient(settings_for(sim, endpoint__structured_output="json_schema")) as llm:
        await judge_once(llm, problem_id="p", problem=Q, reference="391", student="\\boxed{391}", run=0)
    rollout = RolloutInput(
        task="guideline",
        group="g",
        question=Q,
        ground_truth="391",
        completion="\\boxed{391}",
        strategies=[StrategyView(id="G1", description="Multiply directly.")],
    )
    await LLMNoveltyJudge(settings_for(sim, endpoint__structured_output="json_schema")).judge([rollout])
    assert schema_names(sim) == {"judge": {"JudgeReplyFormat", "NoveltyReply"}}


async def test_experience_construction_sends_judge_and_summarizer_schemas(tmp_path: Path) -> None:
    problem = Problem(problem_id="p1", question="What is 6*7?", answer="42")
    run = write_run(tmp_path / "run", [(problem, hand_worked_transcript(), "42")])
    judge = json.dumps({"analysis": "scripted", "score": 5})
    entry = {
        "action": "Factor first.",
        "experience": "Factoring before adding kept the sums small.",
        "scope": "general",
    }
    rules = [
        Rule(role="judge", replies=[judge]),
        Rule(role="summarizer", replies=[json.dumps({"entries": [entry]})]),
    ]
    with SimServer(SimScript(rules=rules)) as sim:
        config = BuildConfig(scheme="difference", lam=0.5, gamma=0.5, beta=1.0, grade_mode="rules")
        await build_pool([run], tmp_path / "pool", settings_for(sim, endpoint__structured_output="json_schema"), config)
        assert schema_names(sim) == {"judge": {"JudgeScoreReply"}, "summarizer": {"SummarizerReply"}}


# C.4.6's rubric and a C.4.7 entry, as a constraining server returns them (every required field, in schema order).
RUBRIC = {
    "correctness_score": 4,
    "information_gain_score": 3,
    "relevance_score": 5,
    "clarity_score": 4,
    "analysis": "It points at the misread term.",
}
TEACHING_ENTRY = {
    "class": "GUIDANCE",
    "action": "Diagnostician error analysis, Physics, easy: name the misread term",
    "experience": "Good practice: ask which definition the student used.",
    "scope": "subject",
}


async def test_an_education_build_sends_the_rubric_and_teaching_summarizer_schemas(
    sim: SimServer, tmp_path: Path
) -> None:
    settings = settings_for(
        sim,
        method={"name": "mattrl", "params": {"domain": "education", "iterations": 1}},
        endpoint__structured_output="json_schema",
    )
    question = "Which quantity stays the same in free fall?\nA) speed\nB) acceleration\nC) height"
    problem = Problem(
        problem_id="q1", question=question, answer="B", metadata={"field": "Physics", "difficulty": "easy"}
    )
    store, settings, todo = prepare_run(tmp_path / "run", settings, [problem], resume=False)
    with store:
        await run_problems(settings, todo, store)
    assert "judge" not in schema_names(sim) and "summarizer" not in schema_names(sim)
    sim.set_script(
        SimScript(
            rules=[
                Rule(role="judge", replies=[json.dumps(RUBRIC)]),
                Rule(role="summarizer", replies=[json.dumps({"entries": [TEACHING_ENTRY]})]),
            ]
        )
    )
    config = BuildConfig(lam=0.5, gamma=0.5, grade_mode="rules")
    summary = await build_pool([tmp_path / "run"], tmp_path / "pool", settings, config)
    assert summary.kept > 0
    built = {role: names for role, names in schema_names(sim).items() if role in ("judge", "summarizer")}
    assert built == {"judge": {"RubricReply"}, "summarizer": {"TeachingSummarizerReply"}}


# ------------------------------------------------------------------------------------------ the parsers read bare JSON
def test_every_parser_reads_the_bare_json_its_schema_forces() -> None:
    """A constraining server returns bare JSON (no code fence, every required field): each parser takes it."""
    verification = parse_verification(json.dumps({"analysis": "Step 2 divides by zero.", "score": 0.5}))
    assert (verification.score, verification.feedback) == (0.5, "Step 2 divides by zero.")
    fenced = parse_verification('```json\n{"analysis": "All steps check out.", "score": 1}\n```')
    assert (fenced.score, fenced.feedback) == (1.0, "All steps check out.")
    ops = {
        "operations": [{"op": "ADD", "kind": "heuristic", "content": "Check the units."}, {"op": "KEEP", "id": "E1"}]
    }
    assert [o.op for o in parse_experience_update(json.dumps(ops)).operations] == ["ADD", "KEEP"]
    items = {"rollouts": [{"rollout": 1, "strategy": "direct product", "novelty": 1, "same_as": None}]}
    assert parse_guideline_update(json.dumps(items)).items[0].strategy == "direct product"
    verdict = parse_novelty(json.dumps({"identified_strategy": "casework", "novelty": 0, "same_as": "G1"}))
    assert (verdict.novelty, verdict.same_as) == (0, "G1")
    assert parse_judge_score(json.dumps({"analysis": "helped", "score": 4})).score == 4
    entries, _ = parse_summarizer(json.dumps({"entries": [{"action": "a", "experience": "e", "scope": "case"}]}))
    assert entries[0].scope == "case"
    members = [{"specialty": "Algebra", "role": "leader", "description": "d"}, {"specialty": "Geometry"}]
    team, _ = domain_named("math").parse_team(json.dumps({"members": members}), 3)
    assert [m.specialty for m in team] == ["Algebra", "Geometry"] and team[0].leader
    review = {
        "analysis": "Sound.",
        "verdict": "accept",
        "validated": ["step 1"],
        "issues": [],
        "tests": {"random_checks": 2, "counterexample": {"found": False}},
    }
    parsed = parse_review(json.dumps(review), "S1", "S2")
    assert (parsed.verdict, parsed.tests["random_checks"]) == ("accept", 2)
    distilled = parse_distillation(json.dumps({"propositions": ["p"], "pitfalls": []}), max_items=3)
    assert distilled.propositions == ["p"]
    judged = parse_judge_reply(json.dumps({"reasoning": "same value", "equivalent": True}))
    assert judged is not None and judged.equivalent
    critique = {"analysis": "Fits.", "agreements": ["Fabry disease first."], "disagreements": None, "changes": []}
    DifferentialReviewReply.model_validate(critique)
    assert parse_differential_review(json.dumps(critique), "S2", "S1").concurs
    RubricReply.model_validate(RUBRIC)
    # C.4.6: 0.30 * 4 + 0.25 * 3 + 0.25 * 5 + 0.20 * 4 = 4.0.
    assert parse_rubric_score(json.dumps(RUBRIC)).score == 4
    TeachingSummarizerReply.model_validate({"entries": [TEACHING_ENTRY]})
    [entry], _ = parse_teaching_summarizer(json.dumps({"entries": [TEACHING_ENTRY]}))
    assert (entry.category, entry.scope) == ("GUIDANCE", "case")


def keywords(node: Any) -> set[str]:
    """The schema keywords used anywhere in ``node`` (property names are fields, not keywords)."""
    if isinstance(node, list):
        return set().union(*map(keywords, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = set(node)
    for key, value in node.items():
        found |= set().union(*map(keywords, value.values())) if key == "properties" and value else keywords(value)
    return found


RUBRIC_CRITERIA = ("correctness", "information_gain", "relevance", "clarity")


def test_schemas_are_flat_and_put_reasoning_first() -> None:
    for name, model in MODELS.items():
        # llama-server's converter takes no recursion; titles, defaults and docstrings never reach a model.
        assert not keywords(json_schema(model)) & {"$ref", "$defs", "title", "default", "description"}, name
    # A field named like a dropped keyword stays a field.
    assert "description" in json_schema(team_reply_model(3))["properties"]["members"]["items"]["properties"]
    # A constrained model writes required properties first, in order: the reasoning before the verdict.
    assert json_schema(VerificationReply)["required"] == ["analysis", "score"]
    assert json_schema(JudgeReplyFormat)["required"] == ["reasoning", "equivalent"]
    assert json_schema(JudgeScoreReply)["required"] == ["analysis", "score"]
    assert json_schema(NoveltyReply)["required"][:2] == ["identified_strategy", "novelty"]
    assert json_schema(ReviewReply)["required"][:2] == ["analysis", "verdict"]
    # The new MATTRL roles keep the order their templates describe (A.4, C.4.6, C.4.7).
    assert json_schema(DifferentialReviewReply)["required"] == ["analysis", "agreements", "disagreements", "changes"]
    assert json_schema(RubricReply)["required"] == [*(f"{c}_score" for c in RUBRIC_CRITERIA), "analysis"]
    entry = json_schema(TeachingSummarizerReply)["properties"]["entries"]["items"]
    assert entry["required"] == ["class", "action", "experience", "scope"]
    assert entry["properties"]["scope"]["enum"] == ["general", "subject"]
    # OpenAI's strict mode only where every property is required.
    assert response_format(VerificationReply)["json_schema"]["strict"] is True
    assert response_format(ExperienceReply)["json_schema"]["strict"] is False
    issue = json_schema(ReviewReply)["properties"]["issues"]["items"]
    assert issue["properties"]["severity"]["enum"] == ["fatal", "major", "minor"]
    assert issue["additionalProperties"] is False


# ------------------------------------------------------------------------------------------ thinking and schemas
@pytest.mark.parametrize(
    ("script", "schemas", "recorded"),
    [
        # No reasoning in the replies: from the second call on, the schema goes.
        (SimScript(), [False, True], False),
        # A reasoning parser on the server (reasoning in its own field): the grammar applies after it.
        (SimScript(reasoning=True), [False, True], False),
        # Thinking inline (<think> in the content, no parser): a grammar would forbid it; never sent, recorded.
        (SimScript(think_tags=True), [False, False], True),
    ],
)
async def test_auto_sends_a_schema_only_where_it_cannot_forbid_thinking(
    sim: SimServer, script: SimScript, schemas: list[bool], recorded: bool
) -> None:
    sim.set_script(script)
    stats = ClientStats()
    async with LLMClient(settings_for(sim), stats=stats) as llm:
        for text in ("Grade A.", "Grade B."):
            reply = await llm.chat("verifier", [user(text)], reply_model=VerificationReply)
            assert reply.ok
    assert ["response_format" in r.body for r in sim.requests] == schemas
    message = stats.downgrades.get("structured_output", {}).get(sim.base_url, {}).get("sim-model", "")
    assert ("thinks inside its reply" in message) == recorded


async def test_a_reply_with_thinking_turned_off_shows_nothing_of_where_the_model_thinks(sim: SimServer) -> None:
    # A model that thinks inside its content, its thinking turned off for one role (chat_template_kwargs): that
    # role's replies hold no think tag, which says nothing of where the model puts its thinking when it thinks. The
    # other role's schema is held until a reply shows it, as for any server not yet seen.
    sim.set_script(SimScript(think_tags=True))
    off = Sampling(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    async with LLMClient(settings_for(sim)) as llm:
        plain = await llm.chat("solution", [user("Solve.")], sampling=off)
        for text in ("Grade A.", "Grade B."):
            assert (await llm.chat("verifier", [user(text)], reply_model=VerificationReply)).ok
    assert plain.ok and "<think>" not in plain.content and not plain.reasoning
    assert ["response_format" in r.body for r in sim.requests] == [False, False, False]


@pytest.mark.parametrize(
    ("reasoning", "schemas"), [("none", [True, True]), ("separate", [True, True]), ("inline", [False, False])]
)
async def test_the_endpoint_may_say_where_its_reasoning_goes(
    sim: SimServer, reasoning: str, schemas: list[bool]
) -> None:
    # Said in the settings (endpoint.reasoning), it holds from the first call: no reply needs to show it.
    async with LLMClient(settings_for(sim, endpoint__reasoning=reasoning)) as llm:
        for text in ("Grade A.", "Grade B."):
            assert (await llm.chat("verifier", [user(text)], reply_model=VerificationReply)).ok
    assert ["response_format" in r.body for r in sim.requests] == schemas


async def test_a_roles_own_reasoning_setting_holds_at_a_url_another_role_reached_first(sim: SimServer) -> None:
    # The solution role (reasoning "auto") reaches the URL and model first, before any reply showed where reasoning
    # goes; the verifier's own setting still sends its schema from its first call. Before, the replica the roles
    # share held the first role's setting, and the verifier's went unheeded until a reply showed it.
    async with LLMClient(settings_for(sim, roles={"verifier": {"reasoning": "separate"}})) as llm:
        llm.route("solution")
        assert (await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)).ok
    assert [(r.role, "response_format" in r.body) for r in sim.requests] == [("verifier", True)]


# ------------------------------------------------------------------------------------------ modes and the fallback
REFUSING = SimScript(response_format="reject")


async def _verify_twice(settings_mode: str, sim: SimServer, store: RunStore | None) -> list[Any]:
    settings = settings_for(sim, endpoint__structured_output=settings_mode)
    stats = ClientStats()
    async with open_model(settings, store, stats=stats) as llm:
        # A plain reply first: it shows the server's model does not think inline, so "auto" may send schemas.
        await llm.chat("solution", [user("Solve.")])
        sim.reset()
        first = await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)
        second = await llm.chat("verifier", [user("Grade B.")], reply_model=VerificationReply)
        return [first, second, stats.downgrades.get("structured_output", {})]


async def test_auto_falls_back_once_per_endpoint_and_records_it(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(REFUSING)
    with RunStore(tmp_path) as store:
        first, second, fallbacks = await _verify_twice("auto", sim, store)
        assert first.ok and second.ok
        bodies = [r.body for r in sim.requests]
        # Refused once, the same call again without the schema, and none sent to that server again.
        assert ["response_format" in b for b in bodies] == [True, False, False]
        assert bodies[0]["messages"] == bodies[1]["messages"]
        assert first.retry_causes == ["structured_output"] and first.attempts == 1
        assert second.retry_causes == []
        assert list(fallbacks) == [sim.base_url]
        recorded = store.downgrades("structured_output")
        assert list(recorded) == [sim.base_url]
        assert recorded[sim.base_url]["sim-model"]["role"] == "verifier"
        assert "response_format" in recorded[sim.base_url]["sim-model"]["message"]
        assert [c.error for c in store.calls()] == [None, None, None]


@pytest.mark.parametrize(
    ("persona", "wording"),
    [("vllm", "not supported by xgrammar"), ("sglang", "Invalid grammar request: req.grammar_key=('json', ")],
)
@pytest.mark.parametrize("stream", ["on", "off"])
async def test_a_schema_refused_in_the_stream_falls_back_as_an_http_refusal_does(
    stream: str, persona: PersonaName, wording: str
) -> None:
    """vLLM checks a request's schema as it enters the engine, SGLang's scheduler as it compiles the grammar: a
    streamed request meets the refusal as an error event after its headers, not as an HTTP 400. It is the same
    refusal: the call goes again at once without the schema, and none goes to that server again."""
    stats = ClientStats()
    with SimServer(SimScript(persona=persona, response_format="reject")) as sim:
        settings = settings_for(sim, endpoint__stream=stream, endpoint__reasoning="none")
        async with LLMClient(settings, stats=stats) as llm:
            first = await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)
            second = await llm.chat("verifier", [user("Grade B.")], reply_model=VerificationReply)
        bodies = sim.chat_bodies("verifier")
    assert first.ok and second.ok, (first.error, second.error)
    assert first.retry_causes == ["structured_output"] and second.retry_causes == []
    assert ["response_format" in b for b in bodies] == [True, False, False]
    # The same request, less its schema.
    assert {k: v for k, v in bodies[0].items() if k != "response_format"} == bodies[1]
    assert wording in stats.downgrades["structured_output"][sim.base_url]["sim-model"]


async def test_a_second_client_records_the_endpoint_once(sim: SimServer, tmp_path: Path) -> None:
    """A resumed run finds the refusal again (one extra request) but the record stays one per endpoint and model."""
    sim.set_script(REFUSING)
    with RunStore(tmp_path) as store:
        await _verify_twice("auto", sim, store)
        settings = settings_for(sim)
        async with open_model(settings, store) as llm:
            reply = await llm.chat("verifier", [user("Grade C.")], reply_model=VerificationReply)
        assert reply.ok
        assert [list(models) for models in store.downgrades("structured_output").values()] == [["sim-model"]]


async def test_json_schema_mode_fails_the_call_with_a_clear_error(sim: SimServer, tmp_path: Path) -> None:
    sim.set_script(REFUSING)
    with RunStore(tmp_path) as store:
        first, second, fallbacks = await _verify_twice("json_schema", sim, store)
        assert not first.ok and not second.ok
        assert first.error is not None and first.error.startswith(
            "server refused response_format (structured_output = 'json_schema'): HTTP 400"
        )
        assert first.error_cause == "structured_output"
        # Not retried, not fallen back: each call was sent once, with its schema.
        assert ["response_format" in r.body for r in sim.requests] == [True, True]
        assert fallbacks == {} and store.downgrades("structured_output") == {}


async def test_off_sends_no_schema(sim: SimServer) -> None:
    first, second, fallbacks = await _verify_twice("off", sim, None)
    assert first.ok and second.ok and fallbacks == {}
    assert ["response_format" in r.body for r in sim.requests] == [False, False]


async def test_other_client_errors_are_not_taken_for_a_refusal(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_400")]))
    async with LLMClient(settings_for(sim)) as llm:
        reply = await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)
        assert (
            not reply.ok and reply.error_cause == "http_400" and llm.stats.downgrades.get("structured_output", {}) == {}
        )
    assert len(sim.requests) == 1


def test_structured_output_is_configured_per_endpoint_role_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "tmas.toml"
    path.write_text(
        '[endpoint]\nbase_url = "http://a/v1"\nstructured_output = "off"\n'
        '[roles.judge]\nstructured_output = "json_schema"\n'
    )
    settings = load_settings(path, environ={})
    assert settings.endpoint.structured_output == "off"
    assert settings.roles["judge"].structured_output == "json_schema"
    assert load_settings(path, environ={"TMAS_STRUCTURED_OUTPUT": "auto"}).endpoint.structured_output == "auto"
    path.write_text('[endpoint]\nbase_url = "http://a/v1"\nstructured_output = "grammar"\n')
    with pytest.raises(Exception, match="structured_output"):
        load_settings(path, environ={})


async def test_role_override_reaches_the_wire(sim: SimServer) -> None:
    settings = settings_for(sim, roles={"verifier": {"structured_output": "off"}})
    async with LLMClient(settings) as llm:
        await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)
        await llm.chat("judge", [user("Judge A.")], reply_model=JudgeReplyFormat)
    assert schema_names(sim) == {"verifier": {None}, "judge": {"JudgeReplyFormat"}}


def test_the_experience_schema_holds_what_max_tokens_can_hold() -> None:
    """450 tokens (the local preset) hold 450 // 170 = 2 operations of at most 400 characters each; no max_tokens: 40.
    Unbounded, the embedded model repeated one sentence inside "content" until the cut (a cut update is no update)."""
    schema = json_schema(experience_reply_model(450))
    operations = schema["properties"]["operations"]
    assert operations["maxItems"] == 2
    content = operations["items"]["properties"]["content"]["anyOf"]
    assert {"type": "string", "maxLength": 400} in content
    assert json_schema(experience_reply_model(None))["properties"]["operations"]["maxItems"] == 40
    assert json_schema(experience_reply_model(100))["properties"]["operations"]["maxItems"] == 1
    # The name the server sees stays the reply model's.
    assert response_format(experience_reply_model(450))["json_schema"]["name"] == "ExperienceReply"


@pytest.mark.parametrize(
    ("domain", "iterations", "model"), [("math", 1, "ReviewReply"), ("medicine", 2, "DifferentialReviewReply")]
)
async def test_the_review_schemas_sent_bound_their_texts_and_lists(
    sim: SimServer, domain: str, iterations: int, model: str
) -> None:
    """Unbounded, the embedded model repeated one "validated" phrase until max_tokens cut the review (a cut review is
    unreadable): the reviewer's schema on the wire bounds the analysis to 600 characters, each phrase to 160, each
    note and fix to 300, and the lists (6 phrases, 4 issues of the prompt's seven types; 10 points in medicine)."""
    settings = settings_for(
        sim,
        method={"name": "mattrl", "params": {"team_size": 2, "iterations": iterations, "domain": domain}},
        endpoint__structured_output="json_schema",
    )
    assert (await asolve(Q, settings)).status == "done"
    sent = [body["response_format"]["json_schema"] for body in sim.chat_bodies("reviewer")]
    assert sent and {s["name"] for s in sent} == {model}
    fields = sent[0]["schema"]["properties"]
    assert fields["analysis"] == {"type": "string", "maxLength": 600}
    if domain == "medicine":
        assert fields["agreements"] == {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 10}
        assert {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 10} in fields[
            "disagreements"
        ]["anyOf"]
        return
    assert fields["validated"] == {"type": "array", "items": {"type": "string", "maxLength": 160}, "maxItems": 6}
    assert fields["issues"]["maxItems"] == 4
    issue = fields["issues"]["items"]["properties"]
    assert issue["note"] == issue["fix"] == {"type": "string", "maxLength": 300}
    assert issue["type"]["enum"] == [
        "algebra_error",
        "logic_gap",
        "missing_case",
        "theorem_misuse",
        "undefined_symbol",
        "diagram_dependence",
        "computation_error",
        "other",
    ]
    assert {"type": "string", "maxLength": 300} in fields["alt_hint"]["anyOf"]


async def test_the_local_preset_bounds_what_its_summary_and_experience_calls_ask_for() -> None:
    """The local preset caps the summary at 220 tokens and the experience agent at 450: the summary prompt asks for
    at most int(220 * 0.55) // 10 * 10 = 120 words, and the experience schema for at most 450 // 170 = 2 operations.
    In process: the scripted model's bodies are the HTTP client's, the reply schema where the client sends it."""
    # No global max_tokens: a user's value would win over the preset's per-role ones.
    settings = scripted_settings(
        sampling={"temperature": 0.7},
        method__params={"preset": "local", "iterations": 1, "skip_final_memory": False},
    )
    model = ScriptedModel(SimScript(), settings)
    await asolve(Q, model=model)
    summaries = [call.body for call in model.calls_of("summary")]
    assert summaries and all(b["max_tokens"] == 220 for b in summaries)
    assert all("Stay under 120 words." in b["messages"][-1]["content"] for b in summaries)
    experience = [call.body for call in model.calls_of("experience")]
    assert experience and all(b["max_tokens"] == 450 for b in experience)
    schema = experience[0]["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["operations"]["maxItems"] == 2
    # The verifier's 400 tokens hold an analysis of (400 - 24) * 2.5 = 940 characters before its score.
    verifier = [call.body for call in model.calls_of("verifier")]
    assert verifier and all(b["max_tokens"] == 400 for b in verifier)
    analysis = verifier[0]["response_format"]["json_schema"]["schema"]["properties"]["analysis"]
    assert analysis == {"type": "string", "maxLength": 940}


async def test_the_verifier_schema_on_the_wire_bounds_its_analysis_by_max_tokens(sim: SimServer) -> None:
    """Verify-Refine over HTTP: the analysis bound follows the max_tokens of the same body, (max_tokens - 24) * 2.5
    characters; 200 tokens for the verifier give 440, and the built-in default of 2048 gives 5,060."""
    for roles, sent, bound in (({"verifier": {"sampling": {"max_tokens": 200}}}, 200, 440), ({}, 2048, 5060)):
        sim.reset()
        settings = settings_for(
            sim,
            method={"name": "verify_refine", "params": {"n": 1, "m": 1, "iterations": 1}},
            endpoint__structured_output="json_schema",
            sampling={"temperature": 0.7},
            roles=roles,
        )
        assert (await asolve(Q, settings)).status == "done"
        bodies = sim.chat_bodies("verifier")
        assert bodies and all(b["max_tokens"] == sent for b in bodies)
        for body in bodies:
            analysis = body["response_format"]["json_schema"]["schema"]["properties"]["analysis"]
            assert analysis == {"type": "string", "maxLength": bound}
    assert verification_reply_model(None) is VerificationReply


@pytest.mark.parametrize("mode", ["auto", "json_schema"])
async def test_llama_server_gets_bounds_its_grammar_can_hold(mode: str) -> None:
    """llama-server's grammar refuses a repetition of 2000 or more, and writes maxLength N as one of N characters: the
    verifier's analysis bound at the built-in max_tokens of 2048, (2048 - 24) * 2.5 = 5060, failed every verification
    ("failed to parse grammar") and, under "auto", took schemas from every role on that server. It goes at 1999 there,
    and whole to a server without that limit."""
    model = verification_reply_model(2048)
    sent: dict[str, list[Any]] = {}
    for persona in ("llama-server", "vllm"):
        stats = ClientStats()
        with SimServer(SimScript(persona=persona)) as sim:
            settings = settings_for(
                sim,
                endpoint__structured_output=mode,
                endpoint__reasoning="none",
                sampling={"temperature": 0.7, "max_tokens": 2048},
            )
            async with LLMClient(settings, stats=stats) as llm:
                for text in ("Grade A.", "Grade B."):
                    reply = await llm.chat("verifier", [user(text)], reply_model=model)
                    assert reply.ok and reply.retry_causes == [], reply.error
            sent[persona] = [b["response_format"]["json_schema"]["schema"] for b in sim.chat_bodies("verifier")]
        assert stats.downgrades == {}
    analysis = [schema["properties"]["analysis"] for schema in sent["llama-server"]]
    assert analysis == [{"type": "string", "maxLength": 1999}] * 2
    # Only the bound changes; the schema vLLM gets is the reply model's own.
    assert sent["vllm"] == [json_schema(model)] * 2
    assert sent["llama-server"][0]["properties"]["score"] == json_schema(model)["properties"]["score"]


def test_grammar_fit_caps_only_bounds() -> None:
    schema = {
        "type": "object",
        "properties": {
            "maxLength": {"type": "string", "maxLength": 5000},
            "items": {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 4000},
        },
    }
    fitted = grammar_fit({"type": "json_schema", "json_schema": {"name": "X", "schema": schema, "strict": True}})
    assert fitted["json_schema"]["name"] == "X" and fitted["json_schema"]["strict"] is True
    assert fitted["json_schema"]["schema"]["properties"] == {
        "maxLength": {"type": "string", "maxLength": 1999},
        "items": {"type": "array", "items": {"type": "string", "maxLength": 300}, "maxItems": 1999},
    }
    assert schema["properties"]["maxLength"]["maxLength"] == 5000  # the schema given is left as it was
    assert grammar_fit({"type": "json_object"}) == {"type": "json_object"}


async def test_the_distillation_schema_on_the_wire_holds_both_lists_within_max_tokens(sim: SimServer) -> None:
    """RSE over HTTP: each list holds at most items_per_trajectory items (the prompt's "at most N of each kind"), and
    each item an equal share of max_tokens after 16 tokens of keys and 3 of quotes an item, at 2.5 characters a
    token, at most 400. Unbounded, 24 of 209 distillations of the embedded 0.5B model were cut at 640 tokens.
    640 tokens, 4 items: ((640 - 16) / 8 - 3) * 2.5 = 187; 300 tokens, 2 items: ((300 - 16) / 4 - 3) * 2.5 = 170;
    the built-in 2048, 2 items: ((2048 - 16) / 4 - 3) * 2.5 = 1262, so 400."""
    for items, roles, sent, bound in (
        (4, {"distiller": {"sampling": {"max_tokens": 640}}}, 640, 187),
        (2, {"distiller": {"sampling": {"max_tokens": 300}}}, 300, 170),
        (2, {}, 2048, 400),
    ):
        sim.reset()
        settings = settings_for(
            sim,
            method={"name": "rse", "params": {"n": 2, "iterations": 2, "items_per_trajectory": items}},
            endpoint__structured_output="json_schema",
            sampling={"temperature": 0.7},
            roles=roles,
        )
        assert (await asolve(Q, settings)).status == "done"
        bodies = sim.chat_bodies("distiller")
        assert len(bodies) == 2 and all(b["max_tokens"] == sent for b in bodies)
        for body in bodies:
            fields = body["response_format"]["json_schema"]["schema"]["properties"]
            bounded = {"type": "array", "items": {"type": "string", "maxLength": bound}, "maxItems": items}
            assert fields == {"propositions": bounded, "pitfalls": bounded}
    assert distillation_reply_model(None, 4).model_json_schema()["properties"]["pitfalls"]["maxItems"] == 4


async def test_latex_in_a_verifiers_json_reaches_the_corrector_as_latex() -> None:
    """A model writes LaTeX in a JSON string with one backslash: "\\frac" and "\\times" are JSON escapes (a form feed,
    a tab). The corrector's prompt shows the verifier's analysis with its commands, not control characters."""
    wrong = "Multiplying gives 17*23 = 390.\n\nTherefore, the final answer is \\boxed{390}."
    analysis = r'{"analysis": "Wrong: $17 \times 23 = \frac{782}{2}$ is 391.", "score": 0}'
    rules = [Rule(role="solution", replies=[wrong]), Rule(role="verifier", replies=[analysis], times=1)]
    with SimServer(SimScript(rules=rules)) as sim:
        settings = settings_for(
            sim,
            method={"name": "verify_refine", "params": {"n": 1, "m": 1, "iterations": 2}},
            endpoint__structured_output="json_schema",
        )
        assert (await asolve(Q, settings)).status == "done"
        [corrector] = sim.chat_bodies("corrector")
    shown = corrector["messages"][-1]["content"]
    assert "Wrong: $17 \\times 23 = \\frac{782}{2}$ is 391." in shown
    assert "\t" not in shown and "\x0c" not in shown


async def test_a_resumed_run_reads_where_each_model_at_a_url_puts_its_reasoning(tmp_path: Path) -> None:
    # One server (a router, a hosted API) serves a model that thinks inside its content and a chat model that does
    # not think. Each model's place is recorded for that model: a resumed run sends schemas to the chat model from its
    # first call and none to the thinking one, whose thinking a grammar would forbid. Recorded by URL alone, the last
    # model seen stood for both.
    script = SimScript(think_tags=True, model="thinker", also_serves=["chat"])
    roles = {"verifier": {"model": "chat"}}
    with SimServer(script) as sim, RunStore(tmp_path) as store:
        settings = settings_for(sim, endpoint__model="thinker", roles=roles)
        async with open_model(settings, store) as llm:
            assert (await llm.chat("solution", [user("Solve.")])).ok
            for text in ("Grade A.", "Grade B."):
                assert (await llm.chat("verifier", [user(text)], reply_model=VerificationReply)).ok
        sim.reset()
        async with open_model(settings, store) as llm:
            verified = await llm.chat("verifier", [user("Grade C.")], reply_model=VerificationReply)
            solved = await llm.chat("solution", [user("Grade D.")], reply_model=VerificationReply)
        sent = [(r.body["model"], "response_format" in r.body) for r in sim.requests]
    assert verified.ok and solved.ok
    assert "<think>" not in solved.content and solved.reasoning
    assert sent == [("chat", True), ("thinker", False)]


async def test_a_record_of_a_url_alone_is_not_read_for_its_models(sim: SimServer, tmp_path: Path) -> None:
    # A run stored by an earlier version recorded where replies put reasoning per URL, of whichever model it saw
    # last: it may be another model's, so a resumed run learns the place again rather than send a schema on it.
    with RunStore(tmp_path) as store:
        store.set_meta("servers", {sim.base_url: {"url": sim.base_url, "reasoning": "none"}})
        async with open_model(settings_for(sim), store) as llm:
            assert (await llm.chat("verifier", [user("Grade A.")], reply_model=VerificationReply)).ok
        recorded = store.servers()
    assert ["response_format" in r.body for r in sim.requests] == [False]
    assert recorded[sim.base_url]["sim-model"]["reasoning"] == "none"


async def test_each_model_at_one_url_learns_its_own_reasoning_place_in_process_as_over_http() -> None:
    # A thinking model and a chat model at one URL: the chat model's reply (no thinking) lets the schema go to it, the
    # thinking model's (a think block) holds it back from that model alone. The in-process model learns as the HTTP
    # client does; before, it kept one place per URL, and the model seen last stood for both.
    script = SimScript(think_tags=True, model="thinker", also_serves=["chat"])
    roles = {"verifier": {"model": "chat"}}
    order = ["verifier", "solution", "verifier", "solution"]

    async def ask(llm: Any) -> None:
        for i, role in enumerate(order):
            assert (await llm.chat(role, [user(f"Grade {i}.")], reply_model=VerificationReply)).ok

    with SimServer(script) as sim:
        async with LLMClient(settings_for(sim, endpoint__model="thinker", roles=roles)) as llm:
            await ask(llm)
        over_http = [(r.body["model"], "response_format" in r.body) for r in sim.requests]
    scripted = ScriptedModel(script, scripted_settings(endpoint__model="thinker", roles=roles))
    await ask(scripted)
    in_process = [(call.body["model"], "response_format" in call.body) for call in scripted.calls]
    assert over_http == [("chat", False), ("thinker", False), ("chat", True), ("thinker", False)]
    assert in_process == over_http
