"""Batched chat completions in-process with transformers, where no inference server runs (a CUDA machine without
llama.cpp or vLLM, a CPU rehearsal): the before/after evaluation and the in-process guideline judge use it.

Prompts are rendered with the tokenizer's chat template. Two engines: ``padded`` pads a batch on the left and runs
``generate`` (every row continues its own prompt; a batch runs until its longest row ends), ``continuous`` hands
every prompt to transformers' continuous-batching engine (``generate_batch``: paged cache, a finished row's place
taken by the next prompt). A completion is ``cut`` when it reached ``max_new_tokens`` without an end token: the same
notion as a server's ``finish_reason == "length"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from tmas.llm.reasoning import THINK_OPEN


class GenerationSettings(BaseModel):
    # 0 decodes greedily; above 0 samples with top_p.
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=640, ge=1)
    # Batch b is sampled after torch.manual_seed(seed + b): two models given the same prompts, settings and seed
    # draw from the same random streams (padded engine; the continuous one seeds once, and which row draws which
    # number depends on the scheduling).
    seed: int = 0
    batch_size: int = Field(default=64, ge=1)
    engine: Literal["padded", "continuous"] = "padded"

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


def template_opens_think(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template ends its generation prompt inside an opened think block
    (Qwen3-*-Thinking-2507, DeepSeek-R1 distills): the model's completions then start with its thinking and hold
    only the closing ``</think>``, and one cut before it holds no tag at all. A tokenizer without a chat template
    opens none."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    return opens_think(render(tokenizer, [{"role": "user", "content": "?"}]))


def opens_think(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a think block it opened."""
    return prompt.rstrip().endswith(THINK_OPEN)


def generate(
    model: Any, tokenizer: Any, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings
) -> list[Completion]:
    """One completion per conversation, in order."""
    stops = stop_ids(model, tokenizer)
    texts = [render(tokenizer, c) for c in conversations]
    if settings.engine == "continuous":
        rows = generate_continuous(model, tokenizer, texts, settings, stops)
    else:
        rows = generate_padded(model, tokenizer, texts, settings, stops)
    out = [completion(tokenizer, row, stops, settings.max_new_tokens) for row in rows]
    # A completion that starts inside a think block its prompt opened reads as the model wrote it: with the opening
    # tag, so a completion cut while it thinks is thinking, not an answer (tmas.rl.scoring.completion_answer).
    for text, done in zip(texts, out, strict=True):
        if opens_think(text) and THINK_OPEN not in done.text:
            done.text = THINK_OPEN + done.text
    return out


def completion(tokenizer: Any, row: Sequence[int], stops: Sequence[int], max_new_tokens: int) -> Completion:
    """A completion's text up to its first end token (counted in its tokens, not in its text)."""
    end = next((i for i, token in enumerate(row) if token in stops), None)
    body = list(row if end is None else row[:end])
    return Completion(
        text=tokenizer.decode(body, skip_special_tokens=True),
        tokens=len(body) + (end is not None),
        cut=end is None and len(row) >= max_new_tokens,
    )


def sampling_kwargs(settings: GenerationSettings) -> dict[str, Any]:
    """Exactly the sampling asked for: a model's generation config may name a top-k cut or a repetition penalty of
    its own (Qwen2.5's instruct models: top_k 20, a penalty 1.05-1.1), which transformers applies wherever a value is
    not given. None here (top_k 0, penalty 1), as TRL's rollouts in training have none."""
    if settings.greedy:
        return {"do_sample": False, "repetition_penalty": 1.0}
    return {
        "do_sample": True,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "top_k": 0,
        "repetition_penalty": 1.0,
    }


def generate_padded(
    model: Any, tokenizer: Any, texts: Sequence[str], settings: GenerationSettings, stops: Sequence[int]
) -> list[list[int]]:
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    device = next(model.parameters()).device
    previous_side, previous_pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    # A tokenizer without a pad token (SmolLM2's from its GGUF) pads with the end token, as TRL does.
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    rows: list[list[int]] = []
    try:
        for b, start in enumerate(range(0, len(texts), settings.batch_size)):
            batch = tokenizer(
                list(texts[start : start + settings.batch_size]),
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(device)
            torch.manual_seed(settings.seed + b)
            with torch.inference_mode():
                generated = model.generate(
                    **batch,
                    max_new_tokens=settings.max_new_tokens,
                    eos_token_id=list(stops),
                    pad_token_id=pad,
                    **sampling_kwargs(settings),
                )
            width = batch["input_ids"].shape[1]
            rows.extend(generated[:, width:].tolist())
    finally:
        tokenizer.padding_side = previous_side
        if previous_pad is None:
            tokenizer.pad_token = None
    return rows


# On a CPU the engine sizes its paged cache from the machine's memory (half of it under TRL) and allocates and
# clears it on every call, which took 15-30 s a call for a two-layer model on a 24 GiB machine; a rehearsal's
# prompts fit in a few hundred MB. On a GPU the engine's own sizing is kept.
CPU_CACHE_MEMORY_SHARE = 0.02


def continuous_batching_options(cuda: bool) -> dict[str, Any]:
    """``ContinuousBatchingConfig`` fields for this device (none on a GPU)."""
    return {} if cuda else {"max_memory_percent": CPU_CACHE_MEMORY_SHARE}


def generate_continuous(
    model: Any, tokenizer: Any, texts: Sequence[str], settings: GenerationSettings, stops: Sequence[int]
) -> list[list[int]]:
    """Every prompt through transformers' continuous-batching engine at once (it schedules them itself)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=settings.max_new_tokens, eos_token_id=list(stops), pad_token_id=pad, **sampling_kwargs(settings)
    )
    torch.manual_seed(settings.seed)
    # no_grad, not inference_mode: the engine's thread updates in place tensors this thread made.
    with torch.no_grad():
        outputs = model.generate_batch(
            inputs=ids,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(
                **continuous_batching_options(torch.cuda.is_available())
            ),
            progress_bar=False,
        )
    # The engine logs a failed or missing request and returns the others: a missing completion is an error here.
    results = list(outputs.values())
    failed = [r for r in results if r.error is not None]
    if len(results) != len(ids) or failed:
        first = failed[0].error if failed else "no result"
        done = len(results) - len(failed)
        raise RuntimeError(f"continuous batching returned {done} completions of {len(ids)} (first error: {first})")
    return [list(r.generated_tokens) for r in results]
