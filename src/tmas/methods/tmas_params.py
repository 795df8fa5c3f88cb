"""TMAS's parameters and presets.

Without a preset TMAS runs the paper's configuration (section 4.1: N = 8, M = 8, T = 20, epsilon = 0.2) with the
run's own sampling settings. Presets fill in every parameter the user did not give:

- ``paper``: the same N, M, T and epsilon, plus the paper's sampling (temperature 1.0, top_p 0.95) for all five roles,
  the paper's output cap of 128K tokens as every role's ``max_tokens`` (section 4.1: thinking models reason for tens
  of thousands of tokens; the client lowers it to what the context window leaves, so a reply is never cut at the
  2048-token global default), and the paper's output layout (``style = "paper"``);
- ``local``: N = 2, M = 1, T = 2, a low solver temperature, modest per-role ``max_tokens`` and the ``concise`` output
  style for the solution and verifier agents (a small model otherwise often spends its budget before its answer), so
  one question on the embedded model finishes in about a minute on two CPU cores; and the settled stop
  (``early_stop``, patience 1): a problem whose candidates all give one answer that every verification passes ends
  there, without the memory update and the later iterations. It is chosen automatically when the embedded model is
  used and no preset is given (explicit parameters such as ``iterations`` still win over it).
- ``quick``: N = 4, M = 2, T = 3 and the settled stop (patience 1), with the run's own sampling: at most 48 calls a
  question, 16 when the first iteration settles, against the paper configuration's 1,630. It is what one question
  runs (``tmas solve``, ``tmas.solve``, a ``tmas serve`` request) on a user's endpoint where no parameter is given:
  N = 4 and M = 2 is the smallest setting at which the verifier's scores and the memory had something to choose
  from in the project's measurements, and a question asked interactively should cost about what majority vote over
  a few dozen samples costs, not a benchmark run's worth.

The ``paper`` preset pins what keeps Algorithm 1 as written: no stopping before T, no confidence from log-probabilities.

Per-role ``sampling`` the user gives as a method parameter is sent with every call of that role, over the run's
settings (it is the most specific setting there is). Sampling a *preset* asks for fills only the fields no one set:
not ``[sampling]`` (file, ``TMAS_*`` variables or flags, even at a value equal to the built-in default) and not
``[roles.<role>.sampling]``. The whole order is in :mod:`tmas.llm.sampling`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, ValidationInfo, model_validator

from tmas.config import Sampling, extra_body_refusal
from tmas.memory.experience_bank import DEFAULT_DEDUP_THRESHOLD, DEFAULT_MAX_ENTRIES
from tmas.methods.base import Iterations, read_as_stored
from tmas.methods.confidence_params import ConfidenceParams
from tmas.methods.param_flags import cli_flag
from tmas.methods.selection import ConfidenceRule, SelectFrom, SelectRule, proof_rule_error
from tmas.methods.style_params import StyledParams

TMAS_ROLES = ("solution", "verifier", "summary", "experience", "guideline")
# Section 4.1: "we set the maximum output length to 128K tokens". The LLM client lowers it per call to what the
# context window leaves after the prompt (read from /v1/models or learnt from the server's refusal).
PAPER_MAX_TOKENS = 131_072
# Section 4.1: temperature 1.0, top_p 0.95, 128K output tokens. top_k and min_p are not stated there and stay the
# server's: vLLM and SGLang apply the model's generation_config.json, which for Qwen3-*-Thinking-2507 holds its card's
# top_k 20 and min_p 0 (docs/servers.md says how to send them to other servers). Adding them here would change the
# hash of every call of a paper-preset run, so a resumed run would send its finished calls again.
PAPER_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "max_tokens": PAPER_MAX_TOKENS}

PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "n": 8,
        "m": 8,
        "iterations": 20,
        "epsilon": 0.2,
        "style": "paper",
        # Algorithm 1 exactly, calls and tokens included: the last iteration's summaries and memory updates run, every
        # problem runs all T iterations, and no call asks for log-probabilities.
        "skip_final_memory": False,
        "early_stop": False,
        "confidence": False,
        # Nothing beyond the paper that changes what is asked or shown: no second call for a missing answer,
        # rollouts as (c, s) without their scores, and the experience bank's 20-35 entries a target the prompt
        # states (appendix D), not a limit that refuses a late anchor (nor one the prompt names).
        "answer_reminder": False,
        "show_scores": False,
        "experience_max_entries": None,
        "sampling": {role: PAPER_SAMPLING for role in TMAS_ROLES},
    },
    "local": {
        "n": 2,
        "m": 1,
        "iterations": 2,
        "epsilon": 0.2,
        "style": "concise",
        # Two candidates that agree, each verified as fully correct: the answer is settled (a demo run spent 12 calls
        # on 17*23 where 6 give the same answer).
        "early_stop": True,
        "early_stop_patience": 1,
        "sampling": {
            # A 0.5B coder model is right far more often at a low temperature; the per-call seeds
            # still make its parallel samples differ.
            "solution": {"temperature": 0.3, "max_tokens": 640},
            "verifier": {"temperature": 0.3, "max_tokens": 400},
            "summary": {"temperature": 0.2, "max_tokens": 220},
            "experience": {"temperature": 0.2, "max_tokens": 450},
            "guideline": {"temperature": 0.2, "max_tokens": 300},
        },
    },
    "quick": {
        "n": 4,
        "m": 2,
        "iterations": 3,
        "epsilon": 0.2,
        "early_stop": True,
        "early_stop_patience": 1,
        # The run's own sampling: a user's endpoint knows its model better than a preset does.
        "sampling": {},
    },
}


class TMASParams(StyledParams, ConfidenceParams):
    style_roles: ClassVar[tuple[str, ...]] = ("solution", "verifier")
    renamed: ClassVar[dict[str, str]] = {"pool": "select_from"}
    # Runs from before the answer fallback existed chose from the last candidates alone.
    before_added: ClassVar[dict[str, Any]] = {"answer_fallback": False}

    preset: Literal["paper", "local", "quick"] | None = None
    # Algorithm 1's T, N, M and epsilon.
    iterations: Iterations = 20
    n: int = Field(default=8, ge=1, le=256)
    m: int = Field(default=8, ge=1, le=64)
    epsilon: float = Field(default=0.2, ge=0.0, le=1.0)
    # Ablations (Table 2): leave the experience context out of the exploit prompt / the guideline constraint out of
    # the explore prompt, and skip that memory agent's calls.
    no_experience: bool = Field(
        default=False, json_schema_extra=cli_flag("--no-experience", "TMAS ablation: no experience bank.")
    )
    no_guideline: bool = Field(
        default=False, json_schema_extra=cli_flag("--no-guideline", "TMAS ablation: no guideline bank.")
    )
    # What the exploit prompt (and the memory agents) see of R_{t-1}: all N by default; top-k by score and a cap on
    # each solution's length on request, and automatically when the context window demands (recorded in the notes).
    top_k: int | None = Field(default=None, ge=1)
    max_solution_chars: int | None = Field(default=None, ge=200)
    # Prompt budget in tokens; None = the role's context window (when known) less its max_tokens.
    context_tokens: int | None = Field(default=None, ge=512)
    experience_dedup_threshold: float = Field(default=DEFAULT_DEDUP_THRESHOLD, gt=0.0, le=1.0)
    # Beyond the paper: ADDs that would grow the experience bank past this are refused (None: no limit).
    experience_max_entries: int | None = Field(default=DEFAULT_MAX_ENTRIES, ge=1)
    guideline_dedup_threshold: float = Field(default=DEFAULT_DEDUP_THRESHOLD, gt=0.0, le=1.0)
    # Beyond the paper: stop a problem once its answer is settled, for `early_stop_patience` iterations in a row: at
    # least `early_stop_agreement` of the N candidates give one answer (1.0: all of them; in proof mode, where no two
    # answers are counted equal, that share wrote a proof) and every verification of those candidates scores at least
    # `early_stop_score` (on the 1 / 0.5 / 0 scale: 0.9 passes a 1 only; a failed or unreadable verification never
    # passes). The stopping iteration's memory update is skipped (nothing reads it); its summaries are already
    # written, inside each candidate's chain.
    early_stop: bool = Field(
        default=False,
        description="stop a problem when its answer is settled: the candidates agree and every verification passes"
        " (beyond the TMAS paper; on in the local preset)",
    )
    early_stop_patience: int = Field(default=2, ge=1, description="early_stop: settled iterations in a row")
    early_stop_score: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="early_stop: the score every verification of the agreeing candidates reaches",
    )
    early_stop_agreement: float = Field(
        default=1.0, gt=0.0, le=1.0, description="early_stop: the share of candidates that give the leading answer"
    )
    # Beyond the paper: the last iteration's summaries (line 15) and memory updates (lines 19-20) are not computed,
    # since nothing reads them (line 22 reads the candidates and their scores alone); the answer is the same, with
    # N + 2 fewer calls per problem. The `paper` preset runs them, to match the paper's calls and tokens.
    skip_final_memory: bool = True
    # Beyond the paper: which candidate is returned (methods/selection.py); the defaults are Algorithm 1's line 22.
    # The confidence rules ask the solution calls for log-probabilities (methods/confidence_params.py).
    select: SelectRule | ConfidenceRule = Field(
        default="best_score",
        description="best_score (Algorithm 1), vote, score_weighted_vote, confidence_vote or filtered_vote"
        " (DeepConf, Fu et al. 2025)",
    )
    select_from: SelectFrom = "last"
    # Beyond the paper: an exploit or explore reply with no extractable answer (numeric mode, not cut at
    # max_tokens) is asked once more, with a reminder of the required output; and when R_T holds no answered
    # candidate, the answer falls back to the best answered candidate of earlier iterations, recorded as a fallback.
    # Both off: Algorithm 1 exactly (line 22 reads R_T alone).
    answer_reminder: bool = True
    answer_fallback: bool = True
    # Beyond the paper: each rollout shown to the solver and the memory agents carries its mean verifier score beside
    # its summary (Algorithm 1's r = (c, s) has the summary alone, which the summary agent writes from the scored
    # verifications). Off: the rollouts as the paper shows them.
    show_scores: bool = True
    # Beyond the paper: "logprob" replaces each of the M verifier essays by one short score-first reply whose score is
    # the expected value under its score token's log-probabilities (see tmas.agents.score_first); "text" parses the
    # essay's "Score:" line as the paper does. In logprob mode `style` does not apply to the verifier.
    verifier_score: Literal["text", "logprob"] = "text"
    # Logprob mode: max_tokens of a score-first reply, and the alternatives asked for per token (OpenAI allows 20).
    score_max_tokens: int = Field(default=48, ge=4)
    top_logprobs: int = Field(default=10, ge=1, le=20)
    # Per-role sampling the method asks for (see the module docstring for how it meets the run's settings).
    sampling: dict[str, Sampling] = Field(default_factory=dict)

    # The user's own per-role sampling, apart from the preset's (``sampling`` holds both): set by _apply_preset.
    _own_sampling: dict[str, Sampling] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _apply_preset(cls, data: Any, handler: ModelWrapValidatorHandler[TMASParams]) -> TMASParams:
        own = data.get("sampling") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("preset") in PRESETS:
            preset = PRESETS[data["preset"]]
            merged = {**preset, **data}
            user_sampling = data.get("sampling") or {}
            if isinstance(user_sampling, dict):
                roles = set(preset["sampling"]) | set(user_sampling)
                merged["sampling"] = {
                    role: {**preset["sampling"].get(role, {}), **_as_dict(user_sampling.get(role))} for role in roles
                }
            data = merged
        params = handler(data)
        if isinstance(own, dict):
            # Validated above as part of `sampling`: the user's own fields, kept apart so the preset's can yield.
            params._own_sampling = {role: Sampling(**_as_dict(value)) for role, value in own.items()}
        return params

    def sampling_layers(self, role: str) -> tuple[Sampling | None, Sampling | None]:
        """``role``'s (preset, own) sampling: the preset's fills only what no one set; the user's own per-role
        method sampling goes over every setting (see tmas.llm.sampling)."""
        preset = PRESETS[self.preset]["sampling"].get(role) if self.preset else None
        return (Sampling(**preset) if preset else None), self._own_sampling.get(role)

    @model_validator(mode="after")
    def _known_roles(self) -> TMASParams:
        unknown = set(self.sampling) - set(TMAS_ROLES)
        if unknown:
            raise ValueError(f"sampling for unknown roles {sorted(unknown)} (TMAS roles: {', '.join(TMAS_ROLES)})")
        return self

    @model_validator(mode="after")
    def _extra_body_sends_no_setting(self, info: ValidationInfo) -> TMASParams:
        if read_as_stored(info):
            return self
        for role, sampling in self.sampling.items():
            refusal = extra_body_refusal(sampling, f"sampling.{role}", f"roles.{role}")
            if refusal is not None:
                raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _rule_of_the_mode(self, info: ValidationInfo) -> TMASParams:
        if (why := proof_rule_error(self.select, self.mode)) is not None and not read_as_stored(info):
            raise ValueError(why)
        return self


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, Sampling):
        return {k: getattr(value, k) for k in value.model_fields_set}
    return dict(value) if isinstance(value, dict) else {}
