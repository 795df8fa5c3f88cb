"""The adaptive router (paper 003, Table 5) on a tiny synthetic pair of runs: long, notation-heavy problems only the
team solves; short ones the single agent solves too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mattrl_runs import write_run
from tmas.pool.router import SINGLE, TEAM, RouterModel, paired_cases, problem_features, save_router, train_router
from tmas.problems import Problem

pytest.importorskip("sklearn")


def problems() -> list[tuple[Problem, bool, bool]]:
    """(problem, single right, team right)."""
    out = []
    for i in range(4):
        hard = (
            f"Let $x_{i}$ satisfy \\frac{{x^2 + {i}x + 7}}{{x - 3}} = \\sqrt{{2x + {i}}} and \\sum_{{k=1}}^{{n}} k^2 "
            f"= x + {i * 11}. Prove that the number of integer solutions with 0 < x < 1000 is prime, and find it."
        )
        out.append((Problem(problem_id=f"hard{i}", question=hard, answer="1"), False, True))
    for i in range(4):
        out.append((Problem(problem_id=f"easy{i}", question=f"What is {i} plus {i + 2}?", answer="1"), True, i != 0))
    return out


@pytest.mark.slow
def test_router_trains_reports_and_routes(tmp_path: Path) -> None:
    import asyncio

    data = problems()
    single = write_run(tmp_path / "single", [(p, None, "1" if s else "2") for p, s, _ in data], "cot", tokens=100)
    team = write_run(tmp_path / "team", [(p, None, "1" if t else "2") for p, _, t in data], tokens=1000)
    cases = asyncio.run(paired_cases(single, team, None, "rules"))
    assert len(cases) == 8 and [c.label for c in cases] == [1, 1, 1, 1, 0, 0, 0, 0]
    model = train_router(cases)
    report = model.report
    assert report["evaluated_by"] == "4-fold cross-validation"
    # By hand: single right on the 4 easy = 4/8; team right on 4 hard + 3 easy = 7/8; oracle 8/8.
    assert report["accuracy"]["single"] == pytest.approx(0.5)
    assert report["accuracy"]["mattrl"] == pytest.approx(0.875)
    assert report["accuracy"]["oracle"] == pytest.approx(1.0)
    # The features separate the two kinds: every held-out case routed right, so routing reaches the oracle
    # while sending only the 4 hard cases to the team.
    assert report["router_accuracy"] == pytest.approx(1.0)
    assert report["accuracy"]["routed"] == pytest.approx(1.0) and report["routed_to_mattrl"] == 4
    # Tokens: single 8 x 100, team 8 x 1000, routed 4 x 1000 + 4 x 100 = 4400: 1 - 4400/8000 = 0.45 saved.
    assert report["tokens"] == {"single": 800, "mattrl": 8000, "routed": 4400}
    assert report["savings_vs_mattrl"] == pytest.approx(0.45)

    path = tmp_path / "router.json"
    save_router(model, path)
    loaded = RouterModel.load(path)
    assert loaded.route(data[0][0].question) == TEAM and loaded.route("What is 5 plus 9?") == SINGLE


@pytest.mark.slow
def test_one_class_gives_a_constant_router(tmp_path: Path) -> None:
    import asyncio

    data = [(Problem(problem_id=f"e{i}", question=f"What is {i}+1?", answer="1"), True, True) for i in range(3)]
    single = write_run(tmp_path / "single", [(p, None, "1") for p, _, _ in data], "cot", tokens=100)
    team = write_run(tmp_path / "team", [(p, None, "1") for p, _, _ in data], tokens=1000)
    model = train_router(asyncio.run(paired_cases(single, team, None, "rules")))
    assert model.constant == SINGLE and model.route("anything") == SINGLE
    # Always single: 300 tokens instead of 3000.
    assert model.report["savings_vs_mattrl"] == pytest.approx(0.9)


def test_features_and_bad_router_file(tmp_path: Path) -> None:
    f = problem_features("Prove that 3 + 4 = 7 and find the probability.")
    assert f["numbers"] == 3 and f["operators"] == 2
    assert f["topic_proof"] == 1.0 and f["topic_probability"] == 1.0 and f["topic_geometry"] == 0.0
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    from tmas.errors import InputError

    with pytest.raises(InputError, match=r"not a router file: Invalid JSON: key must be a string at line 1 column 2$"):
        RouterModel.load(bad)


@pytest.mark.slow
def test_medicine_and_education_routers_read_their_own_features(tmp_path: Path) -> None:
    import asyncio

    from mattrl_runs import hand_worked_transcript

    record = "Observed phenotypes: Seizure; Hypotonia; Cardiomyopathy; Elevated serum lactate"
    f = problem_features(record, "medicine")
    # 4 findings; seizure and hypotonia are neurological, cardiomyopathy cardiac: 2 systems, so a team case;
    # "elevated" and "serum" are lab cues.
    assert (f["findings"], f["systems"], f["multisystem"], f["labs_or_genetics"]) == (4.0, 2.0, 1.0, 2.0)
    assert f["system_neuro"] == 1.0 and f["system_cardio"] == 1.0 and f["system_renal"] == 0.0
    e = problem_features("Which is not a vector?\nA) speed\nB) force\nC) velocity", "education", {"difficulty": "hard"})
    assert e == {
        "log_chars": pytest.approx(math.log1p(52)),
        "options": 3.0,
        "numbers": 0.0,
        "negation": 1.0,
        "difficulty": 2.0,
    }
    # A router trained on medicine runs records the domain and routes by the clinical features; a router file
    # written before domains were recorded reads as math.
    data = [Problem(problem_id=f"m{i}", question=record, answer="Fabry disease") for i in range(2)]
    medical = hand_worked_transcript().model_copy(update={"domain": "medicine"})
    single = write_run(tmp_path / "single", [(p, None, "Fabry disease") for p in data], "cot", tokens=100)
    team = write_run(tmp_path / "team", [(p, medical, "Fabry disease") for p in data], tokens=1000)
    model = train_router(asyncio.run(paired_cases(single, team, None, "rules")))
    assert model.domain == "medicine" and model.features[:3] == ["log_chars", "findings", "systems"]
    old = RouterModel.model_validate({k: v for k, v in model.model_dump().items() if k != "domain"})
    assert old.domain == "math"


def test_a_medicine_router_grades_diagnoses_as_the_domain_does(tmp_path: Path) -> None:
    import asyncio

    from mattrl_runs import hand_worked_transcript
    from tmas.store.run_store import RunStore

    # The gold names a synonym too; the team's differential holds it. Graded as a diagnosis (the domain's own
    # grader, by default), the team was right; graded as a maths answer, never.
    data = [Problem(problem_id=f"m{i}", question="Angiokeratomas, acroparesthesia.", answer=GOLD) for i in range(2)]
    medical = hand_worked_transcript().model_copy(update={"domain": "medicine"})
    decision = {"decision": {"top10": ["Anderson-Fabry disease", "Pompe disease"]}}
    single = write_run(tmp_path / "single", [(p, None, "Pompe disease") for p in data], "cot", tokens=100)
    team = write_run(tmp_path / "team", [(p, medical, "Anderson-Fabry disease") for p in data], last_state=decision)
    with RunStore(team) as store:
        store.set_meta("method", {"name": "mattrl", "params": {"domain": "medicine"}})
    cases = asyncio.run(paired_cases(single, team, None))
    assert [(c.single_correct, c.team_correct) for c in cases] == [(False, True), (False, True)]


GOLD = "Fabry disease | Anderson-Fabry disease"


def test_a_case_far_outside_the_training_cases_is_routed_not_overflowed() -> None:
    # Trained on problems of about 5 numbers (scale 3): one with 3,000 has z = -(3000 - 5) / 3, about -998, and
    # e^998 is beyond a float. The sigmoid is then 0 (single) or, with the weight's sign turned, 1 (MATTRL).
    question = "Sum the table: " + " + ".join(str(i) for i in range(3000)) + "."
    assert problem_features(question)["numbers"] == 3000
    away = RouterModel(features=["numbers"], mean=[5.0], scale=[3.0], weights=[-1.0], intercept=0.0)
    assert away.probability(question) == 0.0 and away.route(question) == SINGLE
    toward = away.model_copy(update={"weights": [1.0]})
    assert toward.probability(question) == 1.0 and toward.route(question) == TEAM


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"weights": [1.0]}, "2 features, 1 weights, 2 means and 2 scales: one of each per feature"),
        ({"features": ["numbers", "colour"]}, "features colour are not the math domain's (log_chars, "),
        ({"domain": "chemistry"}, "unknown MATTRL domain 'chemistry' (known: math, medicine, education)"),
        ({"constant": "team"}, "constant route 'team': 'single' or 'mattrl'"),
    ],
)
def test_a_router_file_that_cannot_route_is_refused_when_loaded(
    tmp_path: Path, fields: dict[str, object], said: str
) -> None:
    from tmas.errors import InputError

    good = {"features": ["numbers", "operators"], "mean": [5.0, 2.0], "scale": [3.0, 1.0], "weights": [1.0, -1.0]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({**good, "intercept": 0.0, **fields}))
    with pytest.raises(InputError) as caught:
        RouterModel.load(path)
    assert str(caught.value).startswith(f"{path}: not a router file: {said}")
