"""Default reply generators of the simulated server, one per agent role.

A responder turns a :class:`SimRequest` into the reply text. Everything here is deterministic: the same
request body (seed included) always gets the same reply, so test runs and benchmarks are reproducible. Send a
different ``seed`` per sample to get diverse samples.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property, lru_cache
from typing import Any

from tmas.testing.script import SimScript

TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """The simulator's token count: words and single punctuation marks."""
    return len(TOKEN_RE.findall(text))


# System prompts and few-shot blocks repeat across thousands of calls: count each distinct text once.
count_tokens_cached = lru_cache(maxsize=8192)(count_tokens)


def cut_tokens(text: str, limit: int) -> str:
    """``text`` cut right after its ``limit``-th token (original spacing kept)."""
    if limit <= 0:
        return ""
    end = 0
    for i, match in enumerate(TOKEN_RE.finditer(text)):
        if i == limit:
            return text[:end]
        end = match.end()
    return text


# The tokens a chat template adds around each message, in the simulator's count.
MESSAGE_OVERHEAD_TOKENS = 4


def chat_prompt_tokens(texts: list[str]) -> int:
    """A chat prompt's tokens as the simulator counts them: each message's text plus its template overhead. The
    context check and the tokenize routes both count with this."""
    return sum(count_tokens_cached(t) for t in texts) + MESSAGE_OVERHEAD_TOKENS * len(texts)


def content_text(content: Any) -> str:
    """The text of a message ``content``: a string, or a list of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


# Request fields that change how a reply is delivered, not what it says.
_DELIVERY_FIELDS = frozenset({"stream", "stream_options"})


def stable_hash(*parts: object) -> int:
    """A 64-bit hash that, unlike ``hash()``, is the same in every process."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class SimRequest:
    """One chat completion request as the responders see it."""

    role: str
    problem_id: str | None
    messages: list[dict[str, Any]]
    body: dict[str, Any]
    seed: int | None = None
    script: SimScript = field(default_factory=SimScript)

    @cached_property
    def sample_key(self) -> int:
        """Hash of the whole body (seed, temperature and all) but how it is delivered (``stream``,
        ``stream_options``): identical requests get identical replies, streamed or not."""
        asked = {k: v for k, v in self.body.items() if k not in _DELIVERY_FIELDS}
        blob = json.dumps(asked, sort_keys=True, separators=(",", ":"), default=str)
        return stable_hash(blob)

    @property
    def thinking(self) -> bool:
        """Whether the chat template lets a thinking model think: not where the request turns it off
        (``chat_template_kwargs.enable_thinking`` false, Qwen3's switch, which vLLM, SGLang and llama-server hand to
        the template). The template then closes an empty think block in the prompt, and the reply is its answer alone:
        no reasoning field (vLLM's Qwen3 parser reads the same switch, reasoning/qwen3_reasoning_parser.py; SGLang's
        serving_chat.py _get_reasoning_from_request) and no think tag in the content."""
        kwargs = self.body.get("chat_template_kwargs")
        return not (isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False)

    @cached_property
    def question(self) -> str:
        """The text of the last user message (the whole prompt if there is no user message)."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                return content_text(message.get("content")).strip()
        return "\n".join(content_text(m.get("content")) for m in self.messages).strip()


Responder = Callable[[SimRequest], str]

RESPONDERS: dict[str, Responder] = {}


def register_responder(*roles: str) -> Callable[[Responder], Responder]:
    """Decorator: make ``fn`` the default reply generator for each of ``roles`` (later registrations win)."""

    def decorate(fn: Responder) -> Responder:
        for role in roles:
            RESPONDERS[role] = fn
        return fn

    return decorate


def get_responder(role: str) -> Responder:
    """The responder for ``role``; unknown roles get the generic ``default`` one."""
    return RESPONDERS.get(role) or RESPONDERS["default"]


# ----------------------------------------------------------------------------------------------------
# Arithmetic: find an expression in the question and evaluate it exactly, without eval().

# Starts with a digit or "(", ends with a digit or ")"; ×, ÷ and ^ are normalised before parsing.
_EXPR_RE = re.compile(r"(?:(?<![\w)])-)?[\d(][\d \t+\-*/()^×÷]*[\d)]")
_MAX_POW_BITS = 4096  # refuse powers whose result would exceed this many bits


class _NotComputable(Exception):
    pass


def _eval_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise _NotComputable("division by zero")
            return left / right
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right.numerator) > 1024:
                raise _NotComputable("exponent")
            base_bits = max(abs(left.numerator).bit_length(), left.denominator.bit_length())
            if base_bits * abs(right.numerator) > _MAX_POW_BITS or (left == 0 and right < 0):
                raise _NotComputable("power too large")
            return left ** int(right)
    raise _NotComputable(type(node).__name__)


def _balance(expr: str) -> str:
    # A match can swallow a "(" that opens prose or stop before a ")" that closes it: trim the excess.
    expr = expr.strip()
    while expr.count("(") > expr.count(")") and expr.startswith("("):
        expr = expr[1:].lstrip()
    while expr.count(")") > expr.count("(") and expr.endswith(")"):
        expr = expr[:-1].rstrip()
    return expr


@lru_cache(maxsize=4096)  # every sample of a problem asks the same question: parse it once
def evaluate_expression(text: str) -> tuple[str, Fraction] | None:
    """The most substantial arithmetic expression in ``text`` and its exact value, or ``None``."""
    best: tuple[int, int, str, Fraction] | None = None
    for match in _EXPR_RE.finditer(text):
        shown = _balance(match.group())
        source = shown.replace("×", "*").replace("÷", "/").replace("^", "**")
        try:
            tree = ast.parse(source, mode="eval")
        except (SyntaxError, ValueError):
            continue
        n_ops = sum(isinstance(n, ast.BinOp) for n in ast.walk(tree))
        if n_ops == 0:
            continue  # a lone number ("step 3", "-2") is not a question to compute
        try:
            value = _eval_node(tree)
        except (_NotComputable, ZeroDivisionError, OverflowError):
            continue
        rank = (n_ops, len(shown))
        if best is None or rank >= best[:2]:
            best = (*rank, shown, value)
    return None if best is None else (best[2], best[3])


def format_number(value: Fraction) -> str:
    """An integer as digits, anything else as a LaTeX fraction."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def fake_reasoning(req: SimRequest) -> str:
    """A short, plausible chain of thought for ``reasoning_content`` or ``<think>`` tags."""
    question = " ".join(req.question.split())
    if len(question) > 120:
        question = question[:117] + "..."
    return (
        f"The question is: {question} "
        "I will work through it step by step, check each intermediate result, "
        "and then state the final answer."
    )


_JUNK_WORDS = (
    *("lorem", "flux", "quibble", "zeta", "ombra", "vantle", "krisp", "nodular", "pell", "thrum", "gorse"),
    *("wimble", "ascot", "fennel", "brask", "oolong", "tansy", "murk", "jib", "quoll", "sprocket", "dross"),
)


def garbage_text(rng: random.Random, n_words: int = 24) -> str:
    """Unstructured junk words: no sentences, no boxed answer."""
    return " ".join(rng.choice(_JUNK_WORDS) for _ in range(n_words))


@register_responder("solution", "default")
def solution_responder(req: SimRequest) -> str:
    """A short worked solution ending in ``\\boxed{...}``; right with probability ``script.accuracy``."""
    found = evaluate_expression(req.question)
    if found is None:
        guess = 1 + stable_hash(req.question, req.seed) % 10
        return (
            "Let me consider the conditions of the problem carefully. "
            "Combining them step by step leaves a single consistent value.\n\n"
            f"Therefore, the final answer is \\boxed{{{guess}}}."
        )
    shown, value = found
    # Hashing the body costs a little, so only scripts that want mistakes pay for it.
    rng = random.Random(req.sample_key) if req.script.accuracy < 1.0 else None
    if rng is not None and rng.random() >= req.script.accuracy:
        # A plausible slip: an integer close to the true value, never the value itself.
        value = Fraction(round(value) + rng.choice((-3, -2, -1, 1, 2, 3)))
    answer = format_number(value)
    return (
        f"We need to evaluate {shown}. "
        f"Carrying out the operations in the usual order gives {shown} = {answer}.\n\n"
        f"Therefore, the final answer is \\boxed{{{answer}}}."
    )


@register_responder("judge")
def judge_responder(req: SimRequest) -> str:
    """An answer-equivalence verdict as JSON (script a rule to get ``false``)."""
    return json.dumps({"reasoning": "Both answers denote the same value.", "equivalent": True})


# The other roles' defaults are registered in modules of their own (tmas_responders, baseline_responders,
# mattrl_responders, pool_responders), which tmas.testing imports. pool_responders answers the pool build's own judge
# prompts (turn scores) and the diagnosis matching prompt, and the "summarizer" role, and hands every other judge prompt
# back to judge_responder.
