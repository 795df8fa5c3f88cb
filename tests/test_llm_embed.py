"""LLMClient.embed against the simulated /v1/embeddings over HTTP: vectors, order, role routing, retries, errors."""

from __future__ import annotations

import math
import struct

import pytest

from conftest import dead_url, settings_for
from tmas.errors import LLMError
from tmas.llm.client import LLMClient
from tmas.llm.model import EndpointUnreachable
from tmas.testing import Rule, SimScript, SimServer


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def test_embed_returns_one_vector_per_text_in_order(sim: SimServer) -> None:
    texts = ["the sum of the digits is 12", "the sum of the digits is 12.", "a prime modulus rules this out"]
    async with LLMClient(settings_for(sim)) as llm:
        vectors = await llm.embed(texts)
        assert await llm.embed([]) == []
    assert [len(v) for v in vectors] == [256] * 3
    assert cosine(vectors[0], vectors[1]) > 0.99 > cosine(vectors[0], vectors[2])
    [request] = sim.requests
    assert request.endpoint == "embeddings" and request.role == "embedding"
    assert request.body["input"] == texts and request.body["model"] == "sim-model"


async def test_embed_uses_the_embedding_role_endpoint(sim: SimServer, sim2: SimServer) -> None:
    settings = settings_for(sim, roles={"embedding": {"base_url": sim2.base_url, "model": "embedder"}})
    async with LLMClient(settings) as llm:
        await llm.embed(["x"])
    assert sim.stats().total_requests == 0
    assert [r.body["model"] for r in sim2.requests] == ["embedder"]


async def test_embed_sends_the_embedding_roles_own_extra_body_only(sim: SimServer) -> None:
    roles = {"embedding": {"sampling": {"extra_body": {"dimensions": 64}}}}
    settings = settings_for(sim, roles=roles, sampling={"extra_body": {"top_k": 20}})
    async with LLMClient(settings) as llm:
        await llm.embed(["x"])
    [request] = sim.requests
    assert request.body == {"dimensions": 64, "model": "sim-model", "input": ["x"]}


async def test_embed_retries_transient_faults(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_503", times=2)]))
    async with LLMClient(settings_for(sim)) as llm:
        [vector] = await llm.embed(["retry me"])
        assert llm.stats.retries == 2 and llm.stats.embedding_calls == 1
    assert len(vector) == 256 and sim.stats().total_requests == 3


async def test_embed_client_error_raises_llm_error(sim: SimServer) -> None:
    sim.set_script(SimScript(rules=[Rule(fault="http_400")]))
    async with LLMClient(settings_for(sim)) as llm:
        with pytest.raises(LLMError, match="HTTP 400"):
            await llm.embed(["x"])
    assert sim.stats().total_requests == 1


async def test_embed_unreachable_endpoint_raises() -> None:
    settings = settings_for()
    with dead_url() as dead:
        settings.endpoint.base_url = [dead]
        async with LLMClient(settings) as llm:
            with pytest.raises(EndpointUnreachable, match="embedding"):
                await llm.embed(["x"])


async def test_embed_reads_base64_vectors_asked_for_in_extra_body(sim: SimServer) -> None:
    texts = ["the sum of the digits is 12", "a prime modulus rules this out"]
    as_floats = {"embedding": {"sampling": {"extra_body": {"dimensions": 64}}}}
    as_base64 = {"embedding": {"sampling": {"extra_body": {"dimensions": 64, "encoding_format": "base64"}}}}
    async with LLMClient(settings_for(sim, roles=as_floats)) as llm:
        floats = await llm.embed(texts)
    async with LLMClient(settings_for(sim, roles=as_base64)) as llm:
        packed = await llm.embed(texts)
        assert llm.stats.retries == 0
    # The server packed each vector as 64 little-endian float32s; tmas reads back the values of the float reply
    # (itself float32 values written as JSON numbers). Before, each reply was "malformed" until the retries ran out.
    assert [len(v) for v in packed] == [64, 64]
    assert packed == [[struct.unpack("<f", struct.pack("<f", x))[0] for x in v] for v in floats]
    assert [r.body.get("encoding_format") for r in sim.requests] == [None, "base64"]
