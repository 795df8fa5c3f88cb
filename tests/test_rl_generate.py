"""In-process generation engines (``tmas.rl.hf_generate``): transformers' continuous batching gives padded
``generate``'s greedy completions on a real model, and the rollout-speed benchmark runs both engines on the same
prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import load_benchmark
from test_rl_train import row


@pytest.mark.slow
def test_continuous_batching_gives_the_padded_greedy_completions(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("gguf")
    from tmas.llm.weights import resolve_model
    from tmas.rl.hf_generate import GenerationSettings, generate
    from tmas.rl.trl_train import load_policy

    try:
        resolve_model("smollm2-135m")
    except Exception as exc:  # the embedded weights are a package of their own
        pytest.skip(f"SmolLM2-135M not installed: {exc}")
    monkeypatch.setenv("TMAS_CACHE_DIR", str(model_cache))  # converted once for the session, not into ~/.cache
    # SmolLM2-135M-Instruct read from its GGUF, float32; prompts of different lengths, so padded generate pads.
    model, tokenizer = load_policy("smollm2-135m")
    questions = [f"What is {7 * i} plus {13 * i}? Put the answer in \\boxed{{}}." + " Be brief." * i for i in range(6)]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    settings = GenerationSettings(max_new_tokens=24, batch_size=6)
    padded = generate(model, tokenizer, conversations, settings)
    continuous = generate(model, tokenizer, conversations, settings.model_copy(update={"engine": "continuous"}))
    assert [c.text for c in continuous] == [c.text for c in padded]
    assert [(c.tokens, c.cut) for c in continuous] == [(c.tokens, c.cut) for c in padded]
    assert any(not c.cut for c in padded) and any(c.text for c in padded)  # some ended, and said something


@pytest.mark.slow
def test_rollout_speed_benchmark_runs_both_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    from tmas.rl.data import write_parquet

    bench = load_benchmark("rl_rollout_speed", monkeypatch)
    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")], data)
    out = tmp_path / "speed.json"
    args = ["--model", "tiny", "--data", str(data), "--groups", "2", "--num-generations", "2"]
    args += ["--max-new-tokens", "4", "--temperature", "0", "--dtype", "float32"]
    args += ["--lora-rank", "0", "--lora-rank", "2"]
    bench.main([*args, "--out", str(out)])
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["engine"], r["lora_rank"]) for r in rows] == [
        ("padded", 0),
        ("continuous", 0),
        ("padded", 2),
        ("continuous", 2),
    ]
    # Two groups of two rollouts each; greedy, so both engines generate the same tokens.
    assert {r["sequences"] for r in rows} == {4}
    assert rows[0]["generated_tokens"] == rows[1]["generated_tokens"] > 0
    assert all(r["generated_tokens_per_s"] > 0 for r in rows)
    assert report["settings"]["groups"] == 2 and report["device"] == "cpu"
    with pytest.raises(SystemExit, match="fewer than --groups 3"):
        bench.main([*args[:4], "--groups", "3", "--dtype", "float32"])


def test_a_completion_inside_a_think_block_its_prompt_opened_reads_with_the_tag() -> None:
    pytest.importorskip("transformers")
    from tmas.rl.hf_generate import GenerationSettings, generate, template_opens_think
    from tmas.rl.scoring import completion_answer
    from tmas.rl.tiny import CHAT_TEMPLATE, tiny_model, tiny_tokenizer

    # The tiny model knows "\boxed{", "391" and "}" and nothing of "</think>": greedy or sampled, it never closes
    # the think block its prompt opened (Qwen3-4B-Thinking-2507's template ends the prompt with "<think>").
    tokenizer = tiny_tokenizer(["\\boxed{", "391", "}", "What is 17*23?"])
    model = tiny_model(len(tokenizer))
    conversations = [[{"role": "user", "content": "What is 17*23?"}]]
    settings = GenerationSettings(max_new_tokens=8, temperature=1.0, seed=3)
    assert not template_opens_think(tokenizer)
    [plain] = generate(model, tokenizer, conversations, settings)
    assert not plain.text.startswith("<think>")
    tokenizer.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
    assert template_opens_think(tokenizer)
    [opened] = generate(model, tokenizer, conversations, settings)
    # The text the model wrote, read as written after the opened tag: all thinking, so no answer whatever it boxed.
    assert opened.text.startswith("<think>") and "</think>" not in opened.text
    assert completion_answer(opened.text) is None
