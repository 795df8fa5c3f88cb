"""Batched chat completions in-process with transformers, where no inference server runs (a CUDA machine without
llama.cpp or vLLM, a CPU rehearsal): the before/after evaluation and the in-process guideline judge use it.

Prompts are rendered with the tokenizer's chat template and padded on the left, so every row of a batch continues
its own prompt. A completion is ``cut`` when it reached ``max_new_tokens`` without an end token: the same notion as
a server's ``finish_reason == "length"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field


class GenerationSettings(BaseModel):
    # 0 decodes greedily; above 0 samples with top_p.
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=640, ge=1)
    # Batch b is sampled after torch.manual_seed(seed + b): two models given the same prompts, settings and seed
    # draw from the same random streams.
    seed: int = 0
    batch_size: int = Field(default=64, ge=1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Completion(BaseModel):
    text: str
    tokens: int
    cut: bool


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends a turn: the tokenizer's end token and those the model's generation config names (for
    Qwen2.5 instruct from a GGUF file, ``<|im_end|>`` and ``<|endoftext|>``)."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, configured):
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    return ids


def render(tokenizer: Any, conversation: Sequence[dict[str, str]]) -> str:
    return str(tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=False))


def generate(
    model: Any, tokenizer: Any, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings
) -> list[Completion]:
    """One completion per conversation, in order."""
    import torch

    stops = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    texts = [render(tokenizer, c) for c in conversations]
    device = next(model.parameters()).device
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[Completion] = []
    try:
        for b, start in enumerate(range(0, len(texts), settings.batch_size)):
            batch = tokenizer(
                texts[start : start + settings.batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            torch.manual_seed(settings.seed + b)
            sampling: dict[str, Any] = (
                {"do_sample": False}
                if settings.greedy
                else {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
            )
            with torch.inference_mode():
                generated = model.generate(
                    **batch,
                    max_new_tokens=settings.max_new_tokens,
                    eos_token_id=stops,
                    pad_token_id=pad,
                    **sampling,
                )
            width = batch["input_ids"].shape[1]
            for row in generated[:, width:].tolist():
                end = next((i for i, token in enumerate(row) if token in stops), None)
                body = row if end is None else row[:end]
                out.append(
                    Completion(
                        text=tokenizer.decode(body, skip_special_tokens=True),
                        tokens=len(body) + (end is not None),
                        cut=end is None and len(row) >= settings.max_new_tokens,
                    )
                )
    finally:
        tokenizer.padding_side = previous_side
    return out
