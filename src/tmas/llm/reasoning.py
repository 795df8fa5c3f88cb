"""Separate a reasoning model's thinking from its final answer."""

from __future__ import annotations

import re

_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def split_reasoning(content: str, reasoning_field: str | None = None) -> tuple[str, str]:
    """Return ``(final_content, reasoning)``.

    Servers with a reasoning parser (vLLM, SGLang) put thinking in ``reasoning_content`` (or ``reasoning``);
    without one it stays in the content as ``<think>...</think>``. Some chat templates open the think block in
    the prompt, so the content may hold only the closing tag: everything before it is thinking then.
    """
    parts: list[str] = [reasoning_field.strip()] if reasoning_field else []
    thoughts = _THINK.findall(content)
    if thoughts:
        parts.extend(t.strip() for t in thoughts)
        content = _THINK.sub("", content)
    if "</think>" in content:
        head, _, content = content.rpartition("</think>")
        parts.append(head.strip())
    elif "<think>" in content:
        # An unclosed think block: the model ran out of tokens while thinking; there is no final answer.
        head, _, tail = content.partition("<think>")
        parts.append(tail.strip())
        content = head
    return content.strip(), "\n\n".join(p for p in parts if p)
