"""The pieces of tmas.llm.hf_grammar that need no model: the bitmask read as allowed tokens, the schema a request
carries, and the tokens a request has drawn. The mask on a real model is in test_hf_model.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tmas.agents.verification import verification_reply_model  # noqa: E402
from tmas.llm.hf_grammar import allowed_of, generated, schema_text  # noqa: E402
from tmas.llm.schema import response_format  # noqa: E402


def test_a_bitmask_allows_the_tokens_of_its_set_bits() -> None:
    # Row 0: word 0 = 0b101 (tokens 0 and 2), word 1 = 1 << 3 (token 35). Row 1: every bit of word 0 (-1 as int32:
    # tokens 0-31), none of word 1. A vocabulary of 40 scores: tokens 36-39 lie in word 1, unset in both rows.
    mask = torch.tensor([[0b101, 1 << 3], [-1, 0]], dtype=torch.int32)
    allowed = allowed_of(mask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 35]
    assert allowed[1].nonzero().flatten().tolist() == list(range(32))
    # The sign bit is token 31 of its word.
    assert allowed_of(torch.tensor([[-(2**31), 0]], dtype=torch.int32), 64)[0].nonzero().flatten().tolist() == [31]
    # Scores past the mask's words (a model's padded output layer) are not allowed.
    assert allowed_of(torch.tensor([[1]], dtype=torch.int32), 40)[0].tolist() == [True] + [False] * 39


def test_a_request_carries_its_schema_with_the_properties_in_reply_order() -> None:
    model = verification_reply_model(48)
    text = schema_text(response_format(model))
    assert text is not None
    schema = json.loads(text)
    assert list(schema["properties"]) == ["analysis", "score"]
    assert schema["properties"]["analysis"]["maxLength"] == 60
    assert schema_text(None) is None
    assert schema_text({"type": "json_object"}) is None


def test_the_tokens_drawn_include_those_from_before_the_engine_moved_the_request_out_and_back() -> None:
    assert generated(SimpleNamespace(initial_tokens=[1, 2], generated_tokens=[7, 8], _true_initial_tokens=0)) == [7, 8]
    # Moved out after drawing 7 and 8, back with them appended to its prompt of 2 tokens, then drew 9.
    back = SimpleNamespace(initial_tokens=[1, 2, 7, 8], generated_tokens=[9], _true_initial_tokens=2)
    assert generated(back) == [7, 8, 9]
