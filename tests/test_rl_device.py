"""The pieces of ``benchmarks/rl_device.py`` on a CPU: the standard errors worked by hand, the GGUF's pieces checked
and reassembled, the in-process judge and evaluation on a tiny model built from a config, and the result files a
run writes (the training step itself is ``tmas rl train``, run by test_rl_cli and test_rl_train)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from benchmark_scripts import load_benchmark
from conftest import isolate
from tmas.agents.guideline_judge import StrategyView
from tmas.agents.solution import explore_prompt, generation_prompt
from tmas.rl.hf_eval import paired_difference, proportion_stderr
from tmas.rl.scoring import RolloutInput


# ------------------------------------------------------------------------------------------ arithmetic
def test_proportion_stderr_by_hand() -> None:
    # sqrt(p (1 - p) / n) with p = 3/12 = 0.25: sqrt(0.25 * 0.75 / 12) = sqrt(0.015625) = 0.125.
    assert proportion_stderr(3, 12) == pytest.approx(0.125)
    # All right or all wrong: no spread.
    assert proportion_stderr(5, 5) == 0.0
    assert proportion_stderr(0, 0) == 0.0


def test_paired_difference_by_hand() -> None:
    # d = after - before = [0, -1, 1, 1, 0]: mean 0.2; deviations -0.2, -1.2, 0.8, 0.8, -0.2, squares summing to
    # 2.8; sample variance 2.8 / (5 - 1) = 0.7; standard error sqrt(0.7 / 5) = sqrt(0.14) = 0.3742.
    d = paired_difference([True, True, False, False, False], [True, False, True, True, False])
    assert d.difference == pytest.approx(0.2)
    assert d.stderr == pytest.approx(math.sqrt(0.14))
    assert (d.gained, d.lost, d.problems) == (2, 1, 5)
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([True], [True, False])


# ------------------------------------------------------------------------------------------ GGUF pieces
def test_pieces_are_checked_kept_and_assembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = load_benchmark("rl_device", monkeypatch)
    original = tmp_path / "model.gguf"
    original.write_bytes(random.Random(0).randbytes(700))  # gzip cannot shrink it: about 730 bytes compressed
    parts, work = tmp_path / "parts", tmp_path / "work"
    # The first piece travels with the wheels, so it is the smaller one.
    manifest = device.split_file(original, parts, 300, first_bytes=200)
    sizes = [p["bytes"] for p in manifest["pieces"]]
    assert sizes[:2] == [200, 300] and 0 < sizes[2] <= 300 and len(sizes) == 3
    assert manifest["bytes"] == 700 and sorted(p.name for p in parts.iterdir()) == ["00", "01", "02"]

    # The first call carries pieces 00 and 01 only: kept, nothing assembled yet.
    later = tmp_path / "later"
    later.mkdir()
    (parts / "02").rename(later / "02")
    assert device.receive(work, parts) is None
    assert "pieces [2] still to come" in (work / "run.log").read_text()

    # A damaged piece is refused; the intact one completes the file, whose whole SHA-256 is checked.
    (parts / "02").mkdir()
    (parts / "02" / device.MANIFEST).write_text((later / "02" / device.MANIFEST).read_text())
    (parts / "02" / device.PIECE_FILE).write_bytes(b"x" * sizes[2])
    assert device.receive(work, parts) is None
    assert "piece 02: SHA-256 differs" in (work / "run.log").read_text()
    (parts / "02" / device.PIECE_FILE).write_bytes((later / "02" / device.PIECE_FILE).read_bytes())
    assembled = device.receive(work, parts)
    assert assembled is not None and assembled.read_bytes() == original.read_bytes()
    # Received again (the same pieces still carried): the assembled file is kept as it is.
    assert device.receive(work, parts) == assembled


def test_a_transfer_carries_what_64_mib_hold_beside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = load_benchmark("rl_device", monkeypatch)
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text(".whl/\n")  # 6 bytes, untracked and not ignored: it travels
    (repo / "src" / "a.py").write_bytes(b"a" * 100)
    subprocess.run(["git", "-C", str(repo), "add", "src/a.py"], check=True)
    (repo / "notes.md").write_bytes(b"n" * 50)  # untracked, not ignored: travels
    (repo / ".whl").mkdir()
    (repo / ".whl" / "x.whl").write_bytes(b"w" * 1000)  # ignored: travels only when carried
    assert device.repository_bytes(repo) == 100 + 50 + 6
    # 64 MiB = 67,108,864 bytes, less the repository's 156 and the 1 MiB margin (1,048,576): 66,060,132.
    assert device.carry_bytes(None, repo) == 66_060_132
    assert device.carry_bytes(40, repo) == 40_000_000


def test_the_tokenizer_travels_with_the_first_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = load_benchmark("rl_device", monkeypatch)
    original = tmp_path / "model.gguf"
    original.write_bytes(random.Random(1).randbytes(500))
    packed_from = tmp_path / "src" / device.TOKENIZER_DIR
    packed_from.mkdir(parents=True)
    (packed_from / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    packed = tmp_path / device.TOKENIZER_FILE
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(packed_from, arcname=device.TOKENIZER_DIR)
    parts = tmp_path / "parts"
    manifest = device.split_file(original, parts, 300, first_bytes=200, attachment=packed)
    assert (parts / "00" / device.TOKENIZER_FILE).is_file() and not (parts / "01" / device.TOKENIZER_FILE).exists()
    assert manifest["attachment"]["name"] == device.TOKENIZER_FILE

    # Damaged on the way: not unpacked (the GGUF's own tokenizer is then converted), and said so.
    good = (parts / "00" / device.TOKENIZER_FILE).read_bytes()
    (parts / "00" / device.TOKENIZER_FILE).write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    damaged = tmp_path / "damaged"
    assert device.receive(damaged, parts) is not None
    assert not (damaged / device.TOKENIZER_DIR).exists()
    assert "tokenizer.tgz: missing or its SHA-256 differs" in (damaged / "run.log").read_text()

    (parts / "00" / device.TOKENIZER_FILE).write_bytes(good)
    work = tmp_path / "work"
    assert device.receive(work, parts) is not None
    assert json.loads((work / device.TOKENIZER_DIR / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


@pytest.mark.slow
def test_a_carried_tokenizer_spares_the_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from tmas.llm import hf_checkpoint
    from tmas.llm.weights import resolve_model

    try:
        gguf = resolve_model("smollm2-135m")
    except Exception as exc:  # the embedded weights are a package of their own
        pytest.skip(f"SmolLM2-135M not installed: {exc}")
    device = load_benchmark("rl_device", monkeypatch)
    work = tmp_path / "work"
    packed = device.pack_tokenizer(gguf, tmp_path / device.TOKENIZER_FILE)
    with tarfile.open(packed) as tar:
        tar.extractall(work, filter="data")

    def no_conversion(path: Path) -> Any:
        raise AssertionError("the GGUF's tokenizer was converted although one was carried")

    monkeypatch.setattr(hf_checkpoint, "gguf_tokenizer", no_conversion)
    base = device.ensure_base(work, str(gguf), tmp_path / "unused.parquet", tmp_path / "unused.jsonl", None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    # The carried tokenizer is the converted one: it ends text at the chat model's end of turn, and has its template.
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert tokenizer.encode("What is 17*23?") == AutoTokenizer.from_pretrained(work / "tokenizer").encode(
        "What is 17*23?"
    )


# ------------------------------------------------------------------------------------------ in-process model
def tiny(texts: list[str]) -> tuple[Any, Any]:
    pytest.importorskip("transformers")
    from tmas.rl.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer([*texts, "\\boxed{", "}"])
    return tiny_model(len(tokenizer)), tokenizer


@pytest.mark.slow
def test_in_process_judge_counts_unusable_replies_as_known() -> None:
    from tmas.rl.hf_judge import TransformersNoveltyJudge

    question = "What is 17*23?"
    strategies = [StrategyView(id="G1", description="Multiply directly.")]
    prompt = explore_prompt(question, "numeric", [])
    model, tokenizer = tiny([m.content for m in prompt] + [question, strategies[0].description])
    judge = TransformersNoveltyJudge(model, tokenizer, max_new_tokens=3)
    rollout = RolloutInput(
        task="guideline", group="g", question=question, ground_truth="391", completion="391", strategies=strategies
    )
    outcomes = judge([rollout, rollout])
    # An untrained model writes no JSON verdict: each reply counts as known, with the reason.
    assert [o.novelty for o in outcomes] == [None, None]
    assert all(o.note and "counted as known" in o.note for o in outcomes)
    assert not any(p.requires_grad for p in model.parameters())  # frozen
    assert judge([]) == []


def write_training_data(path: Path, question: str) -> None:
    from tmas.rl.data import write_parquet

    messages = generation_prompt(question, "numeric", "concise")
    write_parquet(
        [
            {
                "prompt": [m.model_dump() for m in messages],
                "data_source": "tmas/normal",
                "reward_model": {"style": "rule", "ground_truth": "391"},
                "extra_info": {"task": "normal", "group": "run/p1/0/normal", "variant": None, "question": question},
                "_source": "normal",
            }
        ],
        path,
    )


@pytest.mark.slow
def test_an_evaluation_holding_a_training_question_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pyarrow")
    device = load_benchmark("rl_device", monkeypatch)
    data = tmp_path / "train.parquet"
    write_training_data(data, "What is 17*23?")
    problems = tmp_path / "eval.jsonl"
    lines = [("e0", "What is 2 plus 2?", "4"), ("e1", "what is  17*23?", "391")]  # e1: the training question
    problems.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in lines))
    work = tmp_path / "work"
    options = ["--model", "tiny", "--no-wheels", "--work", str(work), "--out", str(tmp_path / "out")]
    args = device.parse_args(["run", *options, "--data", str(data), "--eval", str(problems)])
    with pytest.raises(SystemExit, match=r"problem 'e1' \(1 in all\) is a question of --data"):
        device.run(args)
    assert not (work / "base-hf").exists()
    # Held out by --eval-limit 1 (e0 alone): nothing to refuse.
    assert device.trained_questions(problems, 1, data) == []


def test_evaluation_and_result_files_with_a_tiny_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("datasets")
    device = load_benchmark("rl_device", monkeypatch)
    problems = tmp_path / "eval.jsonl"
    lines = [{"problem_id": f"e{i}", "question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(3)]
    problems.write_text("".join(json.dumps(p) + "\n" for p in lines))
    data = tmp_path / "train.parquet"
    write_training_data(data, "What is 17*23?")
    work, out = tmp_path / "work", tmp_path / "out"
    options = ["--model", "tiny", "--work", str(work), "--out", str(out), "--data", str(data), "--eval", str(problems)]
    options += ["--eval-max-tokens", "4", "--eval-temperature", "0.7", "--eval-seed", "3", "--eval-batch-size", "2"]
    args = argparse.Namespace(**vars(device.parse_args(["run", *options])), which="base")
    base = device.ensure_base(work, "tiny", data, problems, None)
    assert (base / "config.json").is_file()
    device.run_eval(args)

    # A LoRA adapter where training leaves its final one (training itself: test_rl_cli, test_rl_train).
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    adapter.save_pretrained(work / "lora" / "final")
    device.run_eval(argparse.Namespace(**{**vars(args), "which": "trained"}))

    summary = device.collect(args)
    assert sorted(summary["evals"]) == ["base-greedy", "base-sampled", "trained-greedy", "trained-sampled"]
    for s in summary["evals"].values():
        assert s["problems"] == 3 and 0 <= s["accuracy"] <= 1
        # Four tokens never reach an end token nor a boxed answer.
        assert s["cut_rate"] == 1.0 and s["no_answer_rate"] == 1.0
    assert summary["evals"]["base-sampled"]["settings"]["seed"] == 3
    assert set(summary["paired"]) == {"greedy", "sampled"}
    assert summary["paired"]["greedy"]["problems"] == 3
    written = {p.name for p in out.iterdir()}
    assert {"adapter.tgz", "eval.png", "eval_summary.json", "report.md", "details.tgz"} <= written
    assert written <= set(device.OUT_FILES)  # at most the eight files a transfer brings back
    with tarfile.open(out / "adapter.tgz") as tar:
        assert "final/adapter_config.json" in tar.getnames()
    with tarfile.open(out / "details.tgz") as tar:
        assert "eval/trained-sampled.jsonl" in tar.getnames()
    assert "| trained | greedy | 3 |" in (out / "report.md").read_text()


def guideline_data(path: Path, question: str) -> None:
    from tmas.memory.guideline_bank import Strategy
    from tmas.rl.data import write_parquet

    strategy = Strategy(id="G1", description="Multiply directly.", first_iteration=0, last_iteration=0)
    messages = explore_prompt(question, "numeric", [strategy], "concise")
    write_parquet(
        [
            {
                "prompt": [m.model_dump() for m in messages],
                "data_source": "tmas/guideline",
                "reward_model": {"style": "rule", "ground_truth": "391"},
                "extra_info": {
                    "task": "guideline",
                    "group": "run/p1/1/guideline",
                    "variant": None,
                    "question": question,
                    "guideline_bank": [{"id": "G1", "description": strategy.description}],
                },
                "_source": "guideline",
            }
        ],
        path,
    )


@pytest.mark.slow
def test_train_judges_guideline_rollouts_with_a_frozen_model_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from typer.testing import CliRunner

    from tmas.cli.main import app

    isolate(monkeypatch, tmp_path)
    question = "What is 17*23?"
    data = tmp_path / "train.parquet"
    guideline_data(data, question)
    device = load_benchmark("rl_device", monkeypatch)
    problems = tmp_path / "eval.jsonl"
    problems.write_text(json.dumps({"problem_id": "e0", "question": question, "answer": "391"}) + "\n")
    base = device.ensure_base(tmp_path / "work", "tiny", data, problems, None)
    out = tmp_path / "lora"
    args = ["rl", "train", str(data), "--model", str(base), "-o", str(out), "--max-steps", "1", "--save-steps", "1"]
    args += ["--num-generations", "2", "--max-completion-length", "4", "--lora-rank", "2", "--no-vllm"]

    # Guideline rows and no judge: refused, naming both ways to give one.
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code != 0
    assert "--judge-model" in str(refused.exception or "") + refused.output

    result = CliRunner().invoke(app, [*args, "--judge-model", str(base)])
    assert result.exit_code == 0, result.output
    rewards = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines()]
    assert [r["task"] for r in rewards] == ["guideline", "guideline"]
    # The frozen tiny model writes no JSON verdict: each rollout counts as known, with the reason.
    assert all(r["novelty"] is None and "counted as known" in r["judge_note"] for r in rewards)
    assert (out / "final" / "adapter_config.json").is_file()


@pytest.mark.slow
@pytest.mark.slow
def test_training_stopped_for_time_goes_on_in_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls of ``run``: the first trains until its time is up and leaves the evaluation to the next
    (``--reserve 0``); the second continues from the step the first stopped at, then evaluates."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    device = load_benchmark("rl_device", monkeypatch)
    monkeypatch.setattr(device, "child_env", lambda work: dict(os.environ, PYTHONPATH=str(device.ROOT / "src")))
    problems = tmp_path / "eval.jsonl"
    problems.write_text(json.dumps({"problem_id": "e1", "question": "What is 2 plus 2?", "answer": "4"}) + "\n")
    data = tmp_path / "train.parquet"
    write_training_data(data, "What is 17*23?")
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--model", "tiny", "--no-wheels", "--work", str(work), "--out", str(out), "--data", str(data)]
    common += ["--eval", str(problems), "--eval-max-tokens", "2", "--steps", "2", "--num-generations", "2"]
    common += ["--groups-per-step", "1", "--max-completion-length", "2", "--save-steps", "5"]

    # Its margin takes all its time: training gets the least (--max-time 0.001) and stops after its first step.
    device.run(device.parse_args(["run", *common, "--reserve", "0", "--stop-after", "600", "--train-margin", "600"]))
    lora = work / "lora"
    assert [json.loads(line)["step"] for line in (lora / "steps.jsonl").read_text().splitlines()] == [1]
    assert (lora / "checkpoint-1").is_dir() and (lora / "final" / "adapter_config.json").is_file()
    assert device.evaluated(work, "base") and not list((work / "eval").glob("trained-*"))
    assert "--reserve 0: the trained model is evaluated by a later call" in (work / "run.log").read_text()

    device.run(device.parse_args(["run", *common, "--reserve", "300", "--stop-after", "900", "--train-margin", "30"]))
    assert [json.loads(line)["step"] for line in (lora / "steps.jsonl").read_text().splitlines()] == [1, 2]
    assert "resuming from" in (work / "train.log").read_text()
    assert device.evaluated(work, "trained")
    summary = json.loads((out / "eval_summary.json").read_text())
    assert summary["training"]["steps_logged"] == 2 and summary["training"]["final_adapter"]


@pytest.mark.slow
def test_phases_over_calls_with_the_pilot_and_the_new_rollouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU machine used a few minutes at a time does, one call per part: prepare (base checkpoint, pilot, the
    base model's greedy evaluation), train (on the pilot's kept rows at its chosen temperature, continuous batching,
    bfloat16, dynamic sampling), then the trained model's evaluation and the report."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from test_rl_train import row
    from tmas.rl.data import write_parquet

    device = load_benchmark("rl_device", monkeypatch)
    monkeypatch.setattr(device, "child_env", lambda work: dict(os.environ, PYTHONPATH=str(device.ROOT / "src")))
    problems = tmp_path / "eval.jsonl"
    problems.write_text(json.dumps({"problem_id": "e1", "question": "What is 2 plus 2?", "answer": "4"}) + "\n")
    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")], data)
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--model", "tiny", "--no-wheels", "--work", str(work), "--out", str(out), "--data", str(data)]
    common += ["--eval", str(problems), "--eval-max-tokens", "2", "--eval-mode", "greedy", "--steps", "1"]
    common += ["--num-generations", "2", "--groups-per-step", "1", "--generate-groups", "2"]
    common += ["--max-completion-length", "2", "--save-steps", "5", "--continuous-batching", "--dtype", "bfloat16"]
    common += ["--pilot-samples", "2", "--pilot-temperature", "1.0", "--pilot-temperature", "0.7"]
    common += ["--min-rate", "0", "--max-rate", "1", "--stop-after", "900"]

    device.run(device.parse_args(["run", *common, "--until", "prepare"]))
    report = json.loads((work / "pilot" / "train.pilot.json").read_text())
    # No group has a spread (an untrained model): the tie goes to the lower temperature; the 0-1 band keeps all.
    assert report["chosen_temperature"] == 0.7 and report["kept_rows"] == 3
    assert device.evaluated(work, "base", ["greedy"]) and not (work / "eval" / "base-sampled.summary.json").exists()
    assert not (work / "lora").exists()
    # The pilot's time: --pilot-time (180 s by default), or less where the call has less left.
    assert (report["max_time_s"], report["measured_groups"], report["groups"]) == (180, 2, 2)
    command = " ".join(device.pilot_command(device.parse_args(["run", *common]), work, 60.4))
    assert "--engine continuous" in command and "--max-time 60" in command

    device.run(device.parse_args(["run", *common, "--until", "train"]))
    log = (work / "run.log").read_text()
    train_line = next(line for line in log.splitlines() if "] train: " in line)
    assert str(work / "pilot" / "train.parquet") in train_line and "--temperature 0.7" in train_line
    assert "--generate-groups 2" in train_line and "--continuous-batching" in train_line
    assert "--dtype bfloat16" in train_line
    steps = [json.loads(line) for line in (work / "lora" / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["dynamic/groups_generated"] == 2
    assert not list((work / "eval").glob("trained-*"))

    device.run(device.parse_args(["run", *common, "--until", "all"]))
    summary = json.loads((out / "eval_summary.json").read_text())
    assert sorted(summary["evals"]) == ["base-greedy", "trained-greedy"] and set(summary["paired"]) == {"greedy"}
    assert summary["curve"]["steps"] == 1 and summary["pilot"]["chosen_temperature"] == 0.7
    assert "Pilot: temperature 0.7 chosen" in (out / "report.md").read_text()
    with tarfile.open(out / "details.tgz") as tar:
        names = tar.getnames()
    assert "pilot/train.pilot.jsonl" in names and "pilot.log" in names and "train.log" in names


def test_reward_curve_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = load_benchmark("rl_device", monkeypatch)
    steps = tmp_path / "steps.jsonl"
    # 24 steps: rewards -1.0 for the first 10, then rising by 0.05 a step to -0.3 at step 24.
    rewards = [-1.0] * 10 + [round(-0.95 + 0.05 * i, 2) for i in range(14)]
    rows = [
        {"step": i + 1, "reward": r, "frac_reward_zero_std": 0.5 if i < 12 else 0.25, "step_s": 6.0 + (i % 3)}
        for i, r in enumerate(rewards)
    ]
    rows[0]["rollout/generated_tokens_per_s"] = 3000.0
    rows[1]["rollout/generated_tokens_per_s"] = 5000.0
    rows[0]["dynamic/groups_trained_without_spread"] = 3.0
    rows[1]["dynamic/groups_trained_without_spread"] = 0.0
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = device.reward_curve(steps)
    # Last 10 rewards: -0.75 .. -0.30 in steps of 0.05, mean -0.525; the first 10: -1.0; a rise of 0.475.
    assert (curve["window"], curve["first_mean"]) == (10, -1.0)
    assert curve["last_mean"] == pytest.approx(-0.525) and curve["rise"] == pytest.approx(0.475)
    # 12 steps at 0.5 and 12 at 0.25; step times 6, 7, 8 repeated (median 7), 8 x (6 + 7 + 8) = 168 s in all.
    assert curve["zero_std_mean"] == pytest.approx(0.375)
    assert (curve["step_s_median"], curve["train_s"]) == (7.0, 168.0)
    assert curve["generated_tokens_per_s_mean"] == 4000.0
    assert curve["trained_without_spread_mean"] == 1.5  # over the steps that logged it
    # A run of 6 steps compares its first 3 with its last 3.
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    assert device.reward_curve(steps)["window"] == 3
    # An even number of steps: the median is the mean of the middle two (6 and 7 of 6, 7, 8, 6), not the upper one.
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    assert device.reward_curve(steps)["step_s_median"] == 6.5
    assert device.reward_curve(tmp_path / "none.jsonl") is None


def test_training_reads_the_pilots_rows_when_they_fill_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = load_benchmark("rl_device", monkeypatch)
    work = tmp_path / "work"
    kept, report = device.pilot_paths(work)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"rows")
    args = device.parse_args(["run", "--work", str(work), "--data", str(tmp_path / "all.parquet")])
    args.generate_groups, args.groups_per_step = 16, 8
    # No pilot ran: all of --data at temperature 1.
    assert device.training_plan(args) == (tmp_path / "all.parquet", 1.0)
    report.write_text(json.dumps({"kept_groups": 15, "chosen_temperature": 0.6}))
    # 15 groups kept, 16 generated a step: --data, still at the pilot's temperature.
    assert device.training_plan(args) == (tmp_path / "all.parquet", 0.6)
    report.write_text(json.dumps({"kept_groups": 16, "chosen_temperature": 0.6}))
    assert device.training_plan(args) == (kept, 0.6)
    args.temperature = 0.8  # given: it wins
    assert device.training_plan(args) == (kept, 0.8)


def test_a_call_stopped_in_the_trained_evaluation_still_brings_back_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's call limit ends the command during the trained model's evaluation: the adapter, its steps and
    the report are in --out already (the GPU machine's --out is new each call, its work lost with it)."""
    from test_rl_train import row
    from tmas.rl.data import write_parquet

    device = load_benchmark("rl_device", monkeypatch)
    work, out = tmp_path / "work", tmp_path / "out"
    # The run first checks that the evaluation holds none of the data's questions: the data must be there.
    write_parquet([row("normal", "p1")], tmp_path / "train.parquet")
    monkeypatch.setattr(device, "ensure_base", lambda work, *rest: work / "base-hf")
    monkeypatch.setattr(device, "has_guideline_rows", lambda data: False)
    summary = {"problems": 1, "accuracy": 0.0, "stderr": 0.0, "no_answer_rate": 1.0, "cut_rate": 1.0}

    def phase(phases: dict[str, Any], name: str, command: list[str], work: Path, deadline: float, what: str) -> bool:
        if name == "eval-base":
            (work / "eval").mkdir(parents=True)
            (work / "eval" / "base-greedy.summary.json").write_text(json.dumps(summary | {"mean_tokens": 8.0}))
        elif name == "train":
            (work / "lora" / "final").mkdir(parents=True)
            (work / "lora" / "final" / "adapter_config.json").write_text("{}")
            (work / "lora" / "steps.jsonl").write_text(json.dumps({"step": 1, "reward": -1.0, "step_s": 5.0}) + "\n")
        else:
            raise KeyboardInterrupt  # the call's limit, as it ends the command
        return True

    monkeypatch.setattr(device, "run_phase", phase)
    args = ["run", "--model", "tiny", "--no-wheels", "--work", str(work), "--out", str(out)]
    args += ["--eval-mode", "greedy", "--steps", "1", "--data", str(tmp_path / "train.parquet")]
    with pytest.raises(KeyboardInterrupt):
        device.run(device.parse_args(args))
    with tarfile.open(out / "adapter.tgz") as tar:
        assert "final/adapter_config.json" in tar.getnames()
    assert json.loads((out / "steps.jsonl").read_text())["step"] == 1
    assert json.loads((out / "eval_summary.json").read_text())["training"]["final_adapter"]
    assert "Reward curve over 1 steps" in (out / "report.md").read_text()


def test_the_pilot_is_stopped_at_its_time_not_at_the_calls_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pilot's first chunk of groups may outlast --pilot-time (nothing foretells its time): the pilot's process
    is stopped once its time and margin have passed (it then reports on the chunks it finished), not at the call's
    end, which left the base model's evaluation no time in the same call."""
    pytest.importorskip("pyarrow")
    from test_rl_train import row
    from tmas.rl.data import write_parquet

    device = load_benchmark("rl_device", monkeypatch)
    now = 1000.0
    monkeypatch.setattr(device.time, "monotonic", lambda: now)
    monkeypatch.setattr(device, "ensure_base", lambda work, *rest: work / "base-hf")
    data, problems = tmp_path / "train.parquet", tmp_path / "eval.jsonl"
    write_parquet([row("normal", "p1")], data)
    problems.write_text(json.dumps({"problem_id": "e1", "question": "What is 2 plus 2?", "answer": "4"}) + "\n")
    deadlines: dict[str, float] = {}

    def phase(phases: dict[str, Any], name: str, command: list[str], work: Path, deadline: float, what: str) -> bool:
        deadlines[name] = deadline
        if name == "pilot":
            deadlines["pilot --max-time"] = float(command[command.index("--max-time") + 1])
        return False

    monkeypatch.setattr(device, "run_phase", phase)
    args = ["run", "--model", "tiny", "--no-wheels", "--work", str(tmp_path / "work"), "--data", str(data)]
    args += ["--eval", str(problems), "--pilot-samples", "2", "--pilot-time", "60", "--stop-after", "600"]
    device.run(device.parse_args([*args, "--until", "prepare"]))
    assert deadlines == {"pilot --max-time": 60, "pilot": now + 60 + device.PILOT_MARGIN, "eval-base": now + 600}
    # With less of the call left than --pilot-time and its margin, the pilot has what the margin leaves.
    deadlines.clear()
    device.run(device.parse_args([*args, "--until", "prepare", "--stop-after", "70"]))
    assert deadlines == {"pilot --max-time": 40, "pilot": now + 70, "eval-base": now + 70}


def test_a_pilot_that_measured_nothing_runs_again_and_its_report_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pilot stopped before any chunk of groups finished leaves a report saying so (tmas.rl.pilot): a later call
    runs the pilot again (unless training has begun), the run's report quotes why nothing was measured; a pilot that
    measured groups is done."""
    pytest.importorskip("pyarrow")
    from test_rl_train import row
    from tmas.rl.data import write_parquet

    device = load_benchmark("rl_device", monkeypatch)
    monkeypatch.setattr(device, "ensure_base", lambda work, *rest: work / "base-hf")
    data, problems = tmp_path / "train.parquet", tmp_path / "eval.jsonl"
    write_parquet([row("normal", "p1")], data)
    problems.write_text(json.dumps({"problem_id": "e1", "question": "What is 2 plus 2?", "answer": "4"}) + "\n")
    ran: list[str] = []
    monkeypatch.setattr(device, "run_phase", lambda phases, name, *rest: ran.append(name) or False)
    work = tmp_path / "work"
    args = ["run", "--model", "tiny", "--no-wheels", "--work", str(work), "--data", str(data), "--eval", str(problems)]
    args += ["--pilot-samples", "2", "--until", "prepare"]
    report = device.pilot_paths(work)[1]
    report.parent.mkdir(parents=True)
    stopped = "Stopped (SIGTERM) while sampling chunk 1 of 3 of prompt groups: no chunk had finished"
    nothing = {"measured_groups": 0, "kept_groups": 0, "kept_rows": 0, "rows": 6, "chosen_temperature": None}
    nothing |= {"reason": "no chunk of prompt groups finished", "stopped": stopped}
    report.write_text(json.dumps(nothing))
    device.run(device.parse_args(args))
    assert ran == ["pilot", "eval-base"]
    assert f"Pilot: {stopped}; no chunk of prompt groups finished." in (work / "report.md").read_text()
    # Training has a checkpoint (on --data, the pilot having kept nothing): the pilot is not run again, which could
    # change the rows under it.
    checkpoint = work / "lora" / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    ran.clear()
    device.run(device.parse_args(args))
    assert ran == ["eval-base"]
    assert "training goes on with the rows it began on" in (work / "run.log").read_text()
    (checkpoint / "trainer_state.json").unlink()
    report.write_text(json.dumps(nothing | {"measured_groups": 2, "chosen_temperature": 1.0, "stopped": None}))
    ran.clear()
    device.run(device.parse_args(args))
    assert ran == ["eval-base"]


def test_the_report_names_the_model_the_carried_pieces_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run without --model trains the GGUF its pieces carry, whichever model packed them: the report names that
    GGUF (from the pieces' manifest), not --model's default."""
    device = load_benchmark("rl_device", monkeypatch)
    work = tmp_path / "work"
    (work / "parts").mkdir(parents=True)
    manifest = {"name": "SmolLM2-135M-Instruct-Q8_0.gguf", "bytes": 1, "sha256": "0", "pieces": []}
    (work / "parts" / device.MANIFEST).write_text(json.dumps(manifest))
    summary = device.collect(device.parse_args(["run", "--work", str(work)]))
    assert summary["model"] == "SmolLM2-135M-Instruct-Q8_0.gguf"
    assert "Model: `SmolLM2-135M-Instruct-Q8_0.gguf`" in (work / "report.md").read_text()
    # A GGUF given by its path, or the tiny model, is named as given.
    gguf = tmp_path / "given.gguf"
    gguf.write_bytes(b"GGUF")
    assert device.collect(device.parse_args(["run", "--work", str(work), "--model", str(gguf)]))["model"] == str(gguf)
    assert device.collect(device.parse_args(["run", "--work", str(work), "--model", "tiny"]))["model"] == "tiny"


def test_a_steps_line_cut_by_a_kill_is_left_out_of_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Training stopped at a call's end can leave steps.jsonl's last line half written: the report reads the steps
    before it (as --resume does) rather than failing."""
    device = load_benchmark("rl_device", monkeypatch)
    steps = tmp_path / "lora" / "steps.jsonl"
    steps.parent.mkdir()
    rows = [{"step": 1, "reward": -1.0, "step_s": 6.0}, {"step": 2, "reward": 0.0, "step_s": 8.0}]
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    curve = device.reward_curve(steps)
    assert (curve["steps"], curve["first_mean"], curve["last_mean"]) == (2, -1.0, 0.0)
    assert device.training_state(tmp_path)["steps_logged"] == 2
