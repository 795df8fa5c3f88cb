"""Sampling resolved once, with one documented priority, keeping which source set each field.

Priority, lowest first (a later source wins every field it sets; ``extra_body`` merges key by key):

====  ============  ==================================================================================
 1    ``built-in``  ``DEFAULT_SAMPLING`` (temperature 0.7, max_tokens 2048)
 2    ``preset``    a method's preset for the role (TMAS ``paper`` / ``local``): fills only what no one set
 3    ``config``    ``[sampling]`` in the TOML file
 4    ``env``       ``TMAS_TEMPERATURE``, ``TMAS_TOP_P``, ``TMAS_MAX_TOKENS``
 5    ``flags``     ``--temperature``, ``--top-p``, ``--max-tokens``
 6    ``role``      ``[roles.<role>.sampling]``
 7    ``method``    the method's own per-role parameters (TMAS ``sampling = {<role> = {...}}``)
 8    ``call``      what a method's code asks of one call (e.g. a score-first verifier's max_tokens, logprobs)
====  ============  ==================================================================================

``role`` sits above ``env`` and ``flags``: it is the more specific setting (``--temperature 0.6`` with
``[roles.refiner.sampling] temperature = 0.05`` sends 0.05 to the refiner), as it always has. The seed is the one
field no source need set: where none did, :class:`tmas.methods.base.ProblemSession` derives one per prompt and step
(``derived seed``) from the run seed (:func:`derived_base`); either way sample ``j`` of a prompt goes with that seed +
``j`` (:func:`for_sample`), so parallel samples of one prompt differ reproducibly, batched or not.

Which of ``config`` / ``env`` / ``flags`` set a field of ``[sampling]`` is recorded in
``Settings.sampling_sources`` by :func:`tmas.config.load_settings`, and travels with the stored settings (resume,
sweep points). Code that sets sampling of its own before a call (a sweep's grid file, the difficulty filter's paper
sampling, a served request's) lays it on with :func:`with_sampling`, which records its source the same way.
A field no record names (settings built in Python, stored by a version before sources were kept, or changed in
Python after loading) counts as ``config`` where its value is set and differs from the built-in default,
and as the built-in default otherwise: what the preset check read before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

from pydantic import BaseModel, Field

from tmas.config import DEFAULT_SAMPLING, Sampling, SamplingSource, Settings, legacy_sampling_sources

BUILT_IN, PRESET, CONFIG, ENV, FLAGS, ROLE, METHOD, CALL = (
    "built-in",
    "preset",
    "config",
    "env",
    "flags",
    "role",
    "method",
    "call",
)
SOURCES = (BUILT_IN, PRESET, CONFIG, ENV, FLAGS, ROLE, METHOD, CALL)
DERIVED_SEED = "derived seed"
# The source of the seed of a call asked again after an unreadable reply (:func:`retried`).
RETRY_SEED = "retry seed"
# How far apart the sample indices of one prompt's samples in a step may lie (a method's offsets for its own retries
# included): a retry's seed is never this close to its sample's seed, so it is never another sample's.
SAMPLE_SEEDS = 1 << 21
# Derived base seeds lie below this, so that base + j of every sample of the prompt stays a 31-bit seed.
DERIVED_BASES = (1 << 31) - SAMPLE_SEEDS

Layer = tuple[str, Sampling | None]


class ResolvedSampling(BaseModel):
    """The sampling a call sends and, for each field it sets (``extra_body.KEY`` per key), the source that set it."""

    sampling: Sampling = Field(default_factory=Sampling)
    sources: dict[str, str] = Field(default_factory=dict)
    # The seeds earlier versions sent this call with, where they differ from this version's: a derived seed of the
    # versions before seeds were derived per prompt and step (:func:`earlier_derived_seed`), a configured seed of
    # those before sample j went with seed + j (:func:`earlier_configured_seeds`). A stored run made by one still
    # replays its calls (:class:`tmas.llm.replay.StoreReplay`). Never sent.
    earlier_seeds: tuple[int, ...] = ()

    def over(self, source: str, sampling: Sampling | None) -> ResolvedSampling:
        """This resolution with ``sampling`` laid on top as ``source`` (fields it leaves unset or None are kept)."""
        if sampling is None:
            return self
        sources = dict(self.sources)
        for name in sampling.model_fields_set:
            value = getattr(sampling, name)
            if name == "extra_body":
                sources.update({f"extra_body.{key}": source for key in value})
            elif value is not None:
                sources[name] = source
        return ResolvedSampling(sampling=self.sampling.merged(sampling), sources=sources)


def derived_base(*parts: object) -> int:
    """The seed derived from ``parts`` (the run seed, the problem, the iteration, the role: everything that tells one
    prompt's step from another but the sample index) for sample 0 of the prompt, below :data:`DERIVED_BASES`; sample
    ``j`` goes with it + ``j`` (:func:`for_sample`), as a configured seed does."""
    raw = repr(parts).encode()
    return (int.from_bytes(hashlib.sha256(raw).digest()[:4], "big") >> 1) % DERIVED_BASES


def earlier_derived_seed(*parts: object) -> int:
    """The seed versions before :func:`derived_base` derived for a call from ``parts`` (the run seed, the problem, the
    iteration, ``"call"``, the role and the sample index), each call its own."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


def earlier_configured_seeds(seed: int, draw: int, attempt: int) -> tuple[int, ...]:
    """The seeds earlier versions sent with ``seed`` configured for draw ``draw`` of a prompt, asked ``attempt`` times
    before, where this version sends :func:`for_sample` and :func:`retried`'s: the versions before sample ``j`` went
    with seed + ``j`` sent ``seed`` on a first attempt and a seed drawn from ``seed`` and the attempt on a retry
    (:func:`earlier_retried`), and those before a retry changed the seed sent ``seed`` on a retry too.

    ``seed`` itself is named only for a draw other than 0: this version sends it with draw 0's first attempt alone, so
    a stored call found under it for another draw is an earlier version's. (Draw 0 asked again under the same key, a
    prompt whose reply was unusable, sent ``seed`` again in the versions before a retry changed the seed: found under
    it, it would be the unusable first reply, so it is asked.)"""
    earlier = (earlier_retried(seed, attempt),) if attempt else ()
    return (*earlier, seed) if draw else earlier


def earlier_retried(seed: int, attempt: int) -> int:
    """The seed versions before sample ``j`` went with seed + ``j`` sent on attempt ``attempt`` of a call whose seed
    was configured as ``seed`` (:func:`retried`'s draw, not kept away from the other samples' seeds)."""
    return int.from_bytes(hashlib.sha256(repr((seed, attempt)).encode()).digest()[:4], "big") >> 1


def for_sample(resolved: ResolvedSampling, sample: int) -> ResolvedSampling:
    """``resolved`` for sample ``sample`` of its prompt in one step (0 for a call of one sample): its seed, set by a
    source or derived for the prompt's step (:func:`derived_base`), goes plus ``sample``, so sample ``j`` is drawn
    with seed + ``j``, as vLLM draws choice ``j`` of one request with ``n``: a prompt's samples differ whether they go
    alone or together, and sample 0 keeps the seed. A retry's seed (already its own) or none is ``resolved`` as it
    is."""
    seed = resolved.sampling.seed
    if seed is None or not sample or resolved.sources.get("seed") == RETRY_SEED:
        return resolved
    return resolved.model_copy(update={"sampling": resolved.sampling.model_copy(update={"seed": seed + sample})})


def retried(resolved: ResolvedSampling, attempt: int) -> ResolvedSampling:
    """``resolved`` for attempt ``attempt`` of a call asked again because its reply could not be read: a seed set or
    derived (the sample's, :func:`for_sample`) goes out as it is on the first attempt and is changed on each retry
    (source ``retry seed``), since a server that honours it would give the retry the same unreadable reply; without a
    seed it is ``resolved``. The retry's seed is drawn from the sample's seed and the attempt, never within
    :data:`SAMPLE_SEEDS` of the sample's seed, so it is no other sample's of the same prompt (seed + ``j``)."""
    seed = resolved.sampling.seed
    if attempt == 0 or seed is None:
        return resolved
    raw = repr((seed, attempt)).encode()
    drawn = int.from_bytes(hashlib.sha256(raw).digest()[:4], "big") >> 1
    while abs(drawn - seed) < SAMPLE_SEEDS:
        raw = repr((seed, attempt, drawn)).encode()
        drawn = int.from_bytes(hashlib.sha256(raw).digest()[:4], "big") >> 1
    return resolved.over(RETRY_SEED, Sampling(seed=drawn))


def resolve_sampling(layers: Sequence[Layer]) -> ResolvedSampling:
    """``layers`` (source, sampling), lowest priority first, merged field by field into one resolution."""
    out = ResolvedSampling()
    for source, sampling in layers:
        out = out.over(source, sampling)
    return out


def settings_layers(settings: Settings, role: str) -> list[Layer]:
    """The built-in, config, env, flags and role layers of ``role`` in ``settings``."""
    sampling = settings.sampling
    # What was recorded wins; a value no record explains (none kept, or set in Python after loading) is read as
    # before sources were kept: away from its built-in default, it is the user's.
    sources: dict[str, str] = {**legacy_sampling_sources(sampling), **(settings.sampling_sources or {})}
    by_source: dict[str, dict[str, Any]] = {CONFIG: {}, ENV: {}, FLAGS: {}}
    builtin: dict[str, Any] = {}
    for name in Sampling.model_fields:
        value = getattr(sampling, name)
        if name == "extra_body":
            for key, item in value.items():
                by_source[sources.get(f"extra_body.{key}", CONFIG)].setdefault("extra_body", {})[key] = item
            continue
        source = sources.get(name)
        if source in by_source:
            by_source[source][name] = value
        elif name in DEFAULT_SAMPLING and value is not None:
            # Unset by any source but holding a value: the built-in default (an explicit None never is).
            builtin[name] = value
    override = settings.roles.get(role)
    return [
        (BUILT_IN, Sampling(**builtin)),
        *((source, Sampling(**fields)) for source, fields in by_source.items()),
        (ROLE, override.sampling if override is not None else None),
    ]


def resolve_role(
    settings: Settings,
    role: str,
    *,
    preset: Sampling | None = None,
    method: Sampling | None = None,
    call: Sampling | None = None,
) -> ResolvedSampling:
    """The one resolution of a call of ``role``: every layer in the documented order."""
    layers = settings_layers(settings, role)
    return resolve_sampling([layers[0], (PRESET, preset), *layers[1:], (METHOD, method), (CALL, call)])


def with_sampling(settings: Settings, source: SamplingSource, sampling: Sampling) -> Settings:
    """``settings`` with ``sampling`` laid over their ``[sampling]`` as ``source``, recorded in
    ``sampling_sources`` for each field it sets (fields it leaves unset or None keep their values and sources)."""
    if not sampling.model_fields_set:
        return settings
    # Settings that recorded no sources are read as they were before sources were kept, as the resolution reads them.
    known = settings.sampling_sources
    recorded = legacy_sampling_sources(settings.sampling) if known is None else known
    laid = ResolvedSampling(sampling=settings.sampling, sources=dict(recorded)).over(source, sampling)
    # Every source in it is a settings source: the recorded ones and ``source``.
    sources = cast(dict[str, SamplingSource], laid.sources)
    return settings.model_copy(update={"sampling": laid.sampling, "sampling_sources": sources})
