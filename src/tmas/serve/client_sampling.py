"""What a client's sampling fields mean for a method's own upstream calls (``tmas serve --client-sampling``).

``defaults`` (the default): the request's ``temperature``, ``top_p``, ``max_tokens``, ``presence_penalty`` and vLLM's
and SGLang's top-level ``top_k``, ``min_p`` and ``repetition_penalty``, where it sends them, become the
defaults of every upstream call of its run. They win over the method's presets and the server's own sampling flags
and config; they yield to per-role settings (``[roles.<role>.sampling]``), to a method's own per-role parameters (TMAS
``sampling = {verifier = {...}}``) and to what a method's code asks of one call (a score-first verifier's few tokens):
the order of :mod:`tmas.llm.sampling`, where the request is the ``flags`` layer.

``ignore``: the server's settings decide every call; the request's sampling fields are dropped. For clients that always
send their own defaults whatever the user asked (lm-evaluation-harness sends temperature 0 and max_tokens 256 unless
its task says otherwise).

Either way a request's ``chat_template_kwargs`` go with every upstream call of its run (laid key by key over those
of the server's ``extra_body``), and so do its ``reasoning_effort`` and ``verbosity``; ``seed`` is the run's seed
(each call's seed is derived from it, so a method's samples still differ) and ``stop`` ends the reply's content, never
a method's call.
"""

from __future__ import annotations

from typing import Literal

from tmas.config import Sampling
from tmas.methods import method_traits
from tmas.serve.protocol import PASSED_ON, ChatBody

ClientSampling = Literal["defaults", "ignore"]
CLIENT_SAMPLING: tuple[ClientSampling, ...] = ("defaults", "ignore")


TEMPLATE_KWARGS = "chat_template_kwargs"


def request_sampling(body: ChatBody, policy: ClientSampling, server: Sampling) -> Sampling:
    """The sampling the request lays over the server's settings (``server``, as the ``flags`` layer). Its
    ``chat_template_kwargs``, ``reasoning_effort`` and ``verbosity`` are kept under either policy: a client sends them
    on purpose, never as a default."""
    fields = body.sampling_overrides() if policy == "defaults" else {}
    extra: dict[str, object] = {}
    if body.chat_template_kwargs is not None:
        configured = server.extra_body.get(TEMPLATE_KWARGS)
        extra[TEMPLATE_KWARGS] = {**(configured if isinstance(configured, dict) else {}), **body.chat_template_kwargs}
    for name in PASSED_ON:
        if getattr(body, name) is not None:
            extra[name] = getattr(body, name)
    if extra:
        fields["extra_body"] = extra
    return Sampling(**fields)


def greedy_notice(method: str, body: ChatBody, policy: ClientSampling) -> str | None:
    """A notice for the reply when the request sets temperature 0 for a method that samples several candidates:
    they are then alike (greedy decoding gives one text whatever the seed), and the method has little to choose from.
    The request is served as asked: the notice says what it cost and how to ask otherwise."""
    if policy != "defaults" or body.temperature != 0 or method_traits(method).one_chain:
        return None
    return (
        f"temperature 0 was applied to every upstream call of {method}, so its samples are alike: send a temperature"
        " above 0 (lm-eval: generation_kwargs temperature), or start tmas serve with --client-sampling ignore"
    )
