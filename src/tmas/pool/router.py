"""The adaptive router of paper 003, section 5.2 (Table 5): a small classifier over case features that sends each
case to the single agent or to MATTRL, trained from a single-agent run and a MATTRL run of the same problems.

Features are read from the case alone (its text, and for education its metadata), so routing costs no call. Each
domain declares its own (``Domain.case_features`` in :mod:`tmas.methods.mattrl_domains`): math reads length,
quantities, notation and topics; medicine reads the paper's clinical cues (symptom complexity as the number of
findings, the specialties involved as the organ systems the findings touch, the need for a team as findings in more
than one system, and whether lab or genetic results are given); education reads the question's size, its option
count, negation cues and the stated difficulty. The paper's cross-specialty divergence needs a team run first and is
not a feature.
Label: MATTRL (1) exactly where the team was right and the single agent wrong; elsewhere the single agent (0),
which is as good there and cheaper. The model is a standardised logistic regression (scikit-learn, extra
``router``); it is saved as plain JSON (weights, means, scales), so routing needs neither scikit-learn nor pickle.

Reported (cross-validated when each class has at least two cases): the router's accuracy on its labels, the
accuracy of following its routes against always-single, always-MATTRL and the oracle, and the completion tokens
saved against always-MATTRL.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError, model_validator

from tmas.config import Settings
from tmas.errors import ConfigError, InputError, first_error
from tmas.files import write_atomic
from tmas.grading.diagnosis import DIAGNOSIS
from tmas.grading.registry import GradeMode
from tmas.methods.mattrl_domains import DEFAULT_DOMAIN, DOMAINS, domain_named
from tmas.methods.state import MATTRLState
from tmas.pool.outcomes import graded_results
from tmas.problems import Problem
from tmas.store.records import ProblemResult
from tmas.store.run_store import RunStore, StoreError

SINGLE, TEAM = "single", "mattrl"


def problem_features(
    question: str, domain: str = DEFAULT_DOMAIN, metadata: dict[str, Any] | None = None
) -> dict[str, float]:
    """What the router sees of a case in ``domain``: the domain's declared features (see the module docstring)."""
    return domain_named(domain).case_features(question, metadata or {})


def feature_names(domain: str) -> tuple[str, ...]:
    return tuple(problem_features("", domain))


class RouterModel(BaseModel):
    """The saved router: z = (x - mean) / scale, p(MATTRL) = sigmoid(w . z + b); a constant router has no weights."""

    features: list[str]
    # The domain whose features the router reads (files written before domains were recorded: the default one).
    domain: str = DEFAULT_DOMAIN
    mean: list[float]
    scale: list[float]
    weights: list[float]
    intercept: float
    constant: str | None = None
    report: dict[str, Any] = {}

    @model_validator(mode="after")
    def _consistent(self) -> RouterModel:
        """A file that routes every case it can read: a known domain, and (unless constant) one weight, mean and scale
        per feature, each a feature of that domain."""
        if self.domain not in DOMAINS:
            raise ValueError(f"unknown MATTRL domain {self.domain!r} (known: {', '.join(DOMAINS)})")
        if self.constant is not None:
            if self.constant not in (SINGLE, TEAM):
                raise ValueError(f"constant route {self.constant!r}: {SINGLE!r} or {TEAM!r}")
            return self
        sizes = (len(self.features), len(self.weights), len(self.mean), len(self.scale))
        if len(set(sizes)) != 1:
            raise ValueError("{} features, {} weights, {} means and {} scales: one of each per feature".format(*sizes))
        known = feature_names(self.domain)
        unknown = [name for name in self.features if name not in known]
        if unknown:
            raise ValueError(f"features {', '.join(unknown)} are not the {self.domain} domain's ({', '.join(known)})")
        return self

    def probability(self, question: str, metadata: dict[str, Any] | None = None) -> float:
        if self.constant is not None:
            return 1.0 if self.constant == TEAM else 0.0
        x = problem_features(question, self.domain, metadata)
        z = sum(
            w * (x[name] - m) / (s or 1.0)
            for name, w, m, s in zip(self.features, self.weights, self.mean, self.scale, strict=True)
        )
        return _sigmoid(z + self.intercept)

    def route(self, question: str, metadata: dict[str, Any] | None = None) -> str:
        return TEAM if self.probability(question, metadata) >= 0.5 else SINGLE

    @classmethod
    def load(cls, path: Path) -> RouterModel:
        try:
            return cls.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            raise InputError(f"{path}: no such router file") from None
        except (ValidationError, ValueError) as exc:
            raise InputError(f"{path}: not a router file: {first_error(exc)}") from None


def _sigmoid(logit: float) -> float:
    """1 / (1 + e^-logit), with no overflow however far a case lies from the training cases (a problem with thousands
    of numbers, say): e^x is only taken of x <= 0."""
    if logit >= 0:
        return 1.0 / (1.0 + math.exp(-logit))
    grown = math.exp(logit)
    return grown / (1.0 + grown)


class RouterTraining(BaseModel):
    """Options of ``router train`` that need checking."""

    grade_mode: GradeMode = "combined"


@dataclass
class PairedCase:
    problem: Problem
    single_correct: bool
    team_correct: bool
    single_tokens: int
    team_tokens: int
    # The MATTRL run's domain (from its transcripts), which picks the features.
    domain: str = DEFAULT_DOMAIN

    @property
    def label(self) -> int:
        return int(self.team_correct and not self.single_correct)


async def paired_cases(
    single_run: Path, team_run: Path, settings: Settings | None, mode: GradeMode = "combined"
) -> list[PairedCase]:
    """The labelled problems both runs finished, graded by the evaluation harness; the default ``combined`` grades
    a domain with a grader of its own (medicine's diagnosis) by that one, as the pool build and ``tmas cases grade``
    do."""
    notes: list[str] = []
    if mode == "combined":
        mode = _domain_grader(team_run) or mode
    single = {g.problem.problem_id: g for g in await graded_results(single_run, settings, mode, notes)}
    team = {g.problem.problem_id: g for g in await graded_results(team_run, settings, mode, notes)}
    shared = [pid for pid in single if pid in team]
    if not shared:
        raise InputError(f"{single_run} and {team_run} share no finished, labelled problem")
    return [
        PairedCase(
            single[pid].problem,
            single[pid].correct,
            team[pid].correct,
            _completion_tokens(single[pid].result),
            _completion_tokens(team[pid].result),
            _domain(team[pid].result),
        )
        for pid in shared
    ]


def _domain(result: ProblemResult) -> str:
    last = result.last
    state = MATTRLState.model_validate(last.state if last is not None else {})
    return state.transcript.domain if state.transcript is not None else DEFAULT_DOMAIN


def _completion_tokens(result: ProblemResult) -> int:
    # Completion tokens, the cost the project's budgets and equal-budget comparisons count.
    return result.usage.completion_tokens


def _sklearn() -> Any:
    try:
        import sklearn.linear_model
        import sklearn.model_selection
        import sklearn.preprocessing
    except ImportError:
        raise ConfigError("training the router needs scikit-learn: pip install 'tmas[router]'") from None
    return sklearn


def routed_report(cases: list[PairedCase], routes: list[str], how: str) -> dict[str, Any]:
    """Accuracy and tokens of following ``routes`` against the two fixed choices and the oracle."""
    n = len(cases)
    chose_team = [r == TEAM for r in routes]
    routed_correct = sum(c.team_correct if t else c.single_correct for c, t in zip(cases, chose_team, strict=True))
    team_tokens = sum(c.team_tokens for c in cases)
    routed_tokens = sum(c.team_tokens if t else c.single_tokens for c, t in zip(cases, chose_team, strict=True))
    return {
        "cases": n,
        "evaluated_by": how,
        "router_accuracy": sum(int(t) == c.label for c, t in zip(cases, chose_team, strict=True)) / n,
        "routed_to_mattrl": sum(chose_team),
        "accuracy": {
            "single": sum(c.single_correct for c in cases) / n,
            "mattrl": sum(c.team_correct for c in cases) / n,
            "routed": routed_correct / n,
            "oracle": sum(c.single_correct or c.team_correct for c in cases) / n,
        },
        "tokens": {
            "single": sum(c.single_tokens for c in cases),
            "mattrl": team_tokens,
            "routed": routed_tokens,
        },
        "savings_vs_mattrl": (1.0 - routed_tokens / team_tokens) if team_tokens else 0.0,
    }


def _domain_grader(run_dir: Path) -> GradeMode | None:
    """The grader of the MATTRL run's domain where it has its own (medicine: ``diagnosis``), else None."""
    try:
        with RunStore(run_dir, create=False) as store:
            method = store.get_meta("method") or {}
    except StoreError:
        return None  # said by the grading that follows
    domain = DOMAINS.get(str((method.get("params") or {}).get("domain")))
    return domain.grader if domain is not None and domain.grader == DIAGNOSIS else None


def train_router(cases: list[PairedCase], *, seed: int = 0) -> RouterModel:
    """Fit the router on ``cases`` and attach its report."""
    labels = [c.label for c in cases]
    domains = sorted({c.domain for c in cases})
    if len(domains) > 1:
        raise InputError(f"the runs mix domains ({', '.join(domains)}): train one router per domain")
    domain = domains[0] if domains else DEFAULT_DOMAIN
    names = feature_names(domain)
    if len(set(labels)) < 2:
        only = TEAM if labels and labels[0] else SINGLE
        model = RouterModel(
            features=list(names), domain=domain, mean=[], scale=[], weights=[], intercept=0.0, constant=only
        )
        model.report = routed_report(cases, [only] * len(cases), "training set (one class only: a constant router)")
        return model
    sk = _sklearn()
    rows = [[problem_features(c.problem.question, domain, c.problem.metadata)[f] for f in names] for c in cases]
    scaler = sk.preprocessing.StandardScaler().fit(rows)
    z = scaler.transform(rows)

    def classifier() -> Any:
        return sk.linear_model.LogisticRegression(class_weight="balanced", max_iter=1000, random_state=seed)

    minority = min(labels.count(0), labels.count(1))
    if minority >= 2:
        folds = min(5, minority)
        splitter = sk.model_selection.StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
        predicted = sk.model_selection.cross_val_predict(classifier(), z, labels, cv=splitter)
        how = f"{folds}-fold cross-validation"
    else:
        predicted = classifier().fit(z, labels).predict(z)
        how = "training set (a class has one case: no cross-validation)"
    fitted = classifier().fit(z, labels)
    model = RouterModel(
        features=list(names),
        domain=domain,
        mean=[float(v) for v in scaler.mean_],
        scale=[float(v) for v in scaler.scale_],
        weights=[float(v) for v in fitted.coef_[0]],
        intercept=float(fitted.intercept_[0]),
    )
    model.report = routed_report(cases, [TEAM if p else SINGLE for p in predicted], how)
    return model


def save_router(model: RouterModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(model.model_dump(mode="json"), indent=2) + "\n")
