"""Separate a reasoning model's thinking from its final answer, and tell from a reply where its server puts it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tmas.llm.types import Reasoning, TokenLogprob

# The tag that opens a think block in a reply (or, in some chat templates, at the end of the prompt).
THINK_OPEN = "<think>"
_THINK = re.compile(r"<think>(.*?)</think>", re.S)
# How much of an answer's opening text finds where its tokens begin.
_ANSWER_HEAD_CHARS = 64


def split_reasoning(content: str, reasoning_field: str | None = None, *, cut_inline: bool = False) -> tuple[str, str]:
    """Return ``(final_content, reasoning)``.

    Servers with a reasoning parser (vLLM, SGLang) put thinking in ``reasoning_content`` (or ``reasoning``);
    without one it stays in the content as ``<think>...</think>``. Some chat templates open the think block in
    the prompt (DeepSeek-R1 distills, Qwen3.5), so the content may hold only the closing tag: everything before it is
    thinking then, and a reply cut before that tag holds no tag at all. Where the thinking came in its field, a lone
    tag in the content is the answer's own text. ``cut_inline``: the reply was cut before its end by a model known to
    think inside its content (:func:`reply_place`); such a reply without a think tag is all thinking, cut before its
    answer, as a reasoning parser reads it.
    """
    if cut_inline and not reasoning_field and "<think>" not in content and "</think>" not in content:
        return "", content.strip()
    parts: list[str] = [reasoning_field.strip()] if reasoning_field else []
    thoughts = _THINK.findall(content)
    if thoughts:
        parts.extend(t.strip() for t in thoughts)
        content = _THINK.sub("", content)
    # Where the server's reasoning parser took the thinking out, a lone tag left in the content is text the answer
    # writes (a verifier quoting a solution's tags), never a think block the template opened or one cut short.
    if not reasoning_field and "</think>" in content:
        head, _, content = content.rpartition("</think>")
        parts.append(head.strip())
    elif not reasoning_field and "<think>" in content:
        # An unclosed think block: the model ran out of tokens while thinking; there is no final answer.
        head, _, tail = content.partition("<think>")
        parts.append(tail.strip())
        content = head
    return content.strip(), "\n\n".join(p for p in parts if p)


def thinking_off(extra_body: Mapping[str, Any]) -> bool:
    """Whether a request turns its model's thinking off in the chat template (``chat_template_kwargs``:
    ``enable_thinking`` false, Qwen3's switch; ``thinking`` false, DeepSeek-V3.1's and Kimi's). The template then
    closes the think block in the prompt, so a reply cut at max_tokens is its answer, cut, whatever the model's other
    replies show: never thinking that lost its tags (``cut_inline`` of :func:`split_reasoning`). Nor does a reply
    without thinking show where the model's thinking goes when it thinks (:func:`reply_place`'s ``none``)."""
    kwargs = extra_body.get("chat_template_kwargs")
    return isinstance(kwargs, Mapping) and (kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False)


# The finish reasons of a reply that ran to its end (not cut by max_tokens, aborted, or stopped by its reader).
FINISHED = frozenset({"stop", "tool_calls"})


def reply_place(content: str, reasoning_field: str | None, finish_reason: str | None) -> Reasoning | None:
    """Where a reply shows its server puts reasoning: ``separate`` (a field of its own, in any reply), ``inline`` (a
    think tag in the content of a reply that finished), ``none`` (a reply that finished without either). A reply cut
    before its end shows nothing (None): it may be cut inside thinking whose closing tag has not come yet, or whose
    opening tag the chat template put in the prompt, so that its content holds no tag at all."""
    if reasoning_field:
        return "separate"
    if finish_reason not in FINISHED:
        return None
    return "inline" if "</think>" in content or "<think>" in content else "none"


def answer_logprobs(tokens: list[TokenLogprob], content: str) -> list[TokenLogprob] | None:
    """The log-probabilities of a thinking reply's answer: its last tokens, from the one where the ``content`` (the
    answer, its thinking split off) begins. vLLM, SGLang and llama-server give one for every generated token, the
    thinking's first, even where their reasoning parser puts the thinking in a field of its own, and a think block in
    the content is part of it too. None where the tokens' text does not show where the answer begins (tokens shown
    as bytes), so that nothing is read from the thinking."""
    head = content.strip()[:_ANSWER_HEAD_CHARS]
    at = "".join(t.token for t in tokens).rfind(head) if head else -1
    if at < 0:
        return None
    end = 0
    for i, token in enumerate(tokens):
        end += len(token.token)
        if end > at:
            return tokens[i:]
    return None
