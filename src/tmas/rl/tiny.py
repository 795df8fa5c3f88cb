"""A tiny causal LM and tokenizer built locally from a config: for CPU smoke runs and tests, no download.

The tokenizer is word-level over the given texts (plus the chat markers); the model is a two-layer Qwen2 with a
few thousand parameters per layer. It learns nothing useful; it exercises the whole training path in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(texts: Iterable[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words: dict[str, int] = {token: i for i, token in enumerate(SPECIAL)}
    splitter = pre_tokenizers.Whitespace()
    for text in texts:
        for word, _ in splitter.pre_tokenize_str(text):
            words.setdefault(word, len(words))
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("<|im_start|>", "isolated"), pre_tokenizers.Split("<|im_end|>", "isolated"), splitter]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(vocab_size: int, seed: int = 0) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
