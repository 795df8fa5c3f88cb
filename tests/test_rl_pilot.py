"""Pilot rollouts before GRPO (``tmas rl pilot``): each prompt group's right rate per temperature, the temperature
that keeps the most groups right 10-90 % of the time, and the kept rows, worked by hand on scripted completions;
then the command end to end with a tiny model built from a config."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from test_rl_train import row
from tmas.errors import ConfigError
from tmas.rl.hf_generate import Completion, GenerationSettings
from tmas.rl.pilot import (
    GroupRate,
    TemperatureSummary,
    choose_temperature,
    kept_groups,
    measure,
    summarize,
)


def with_answer(base: dict[str, Any], pid: str, gold: str) -> dict[str, Any]:
    """A build-data row of problem ``pid`` whose reference answer is ``gold`` (the question names it, so the
    scripted model below can tell the rows apart)."""
    out = json.loads(json.dumps(base))
    out["reward_model"]["ground_truth"] = gold
    out["extra_info"]["question"] = f"problem {pid}"
    for message in out["prompt"]:
        message["content"] = f"[{pid}] " + message["content"]
    return out


class ScriptedRollouts:
    """A generator answering each problem from a script: per (problem, temperature), the answers of its rollouts in
    order. The Base half of an experience group is asked first, then the Bank half, as training samples them."""

    def __init__(self, script: dict[tuple[str, float], list[str]]) -> None:
        self.script = script
        self.calls: list[tuple[int, float]] = []

    def __call__(self, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings) -> list[Any]:
        self.calls.append((len(conversations), settings.temperature))
        asked: dict[str, int] = defaultdict(int)
        out = []
        for conversation in conversations:
            pid = conversation[-1]["content"].split("]")[0].lstrip("[")
            answer = self.script[(pid, settings.temperature)][asked[pid]]
            asked[pid] += 1
            out.append(Completion(text=f"so \\boxed{{{answer}}}", tokens=5, cut=False))
        return out


def test_rates_per_temperature_and_the_temperature_that_keeps_most_groups() -> None:
    rows = [
        with_answer(row("normal", "A"), "A", "4"),
        with_answer(row("experience", "B", "base"), "B", "6"),
        with_answer(row("experience", "B", "bank"), "B", "6"),
        with_answer(row("normal", "C"), "C", "9"),
    ]
    script = {
        # 4 of 4, 2 of 4 (the Bank half right, the Base half wrong), 0 of 4.
        ("A", 0.5): ["4", "4", "4", "4"],
        ("B", 0.5): ["5", "5", "6", "6"],
        ("C", 0.5): ["1", "1", "1", "1"],
        # 3 of 4, 1 of 4, 1 of 4.
        ("A", 1.0): ["4", "4", "3", "4"],
        ("B", 1.0): ["6", "5", "5", "5"],
        ("C", 1.0): ["9", "2", "2", "2"],
    }
    generate = ScriptedRollouts(script)
    rates = measure(generate, rows, [0.5, 1.0], 4, GenerationSettings(max_new_tokens=16))
    # One call per temperature, every group's 4 rollouts in it.
    assert generate.calls == [(12, 0.5), (12, 1.0)]
    got = {(r.group.split("/")[1], r.temperature): (r.right, r.samples, r.task) for r in rates}
    assert got[("A", 0.5)] == (4, 4, "normal") and got[("B", 0.5)] == (2, 4, "experience")
    assert got[("C", 0.5)] == (0, 4, "normal") and got[("A", 1.0)] == (3, 4, "normal")
    assert got[("B", 1.0)] == (1, 4, "experience") and got[("C", 1.0)] == (1, 4, "normal")

    cold, hot = summarize(rates, 0.1, 0.9)
    # T 0.5: right 4 + 2 + 0 = 6 of 12; only B (0.5) is within 10-90 %.
    assert (cold.temperature, cold.right_rate, cold.groups_in_band, cold.groups_with_spread) == (0.5, 0.5, 1, 1)
    # T 1.0: right 3 + 1 + 1 = 5 of 12; A (0.75), B (0.25) and C (0.25) are all within it.
    assert (hot.right_rate, hot.groups_in_band, hot.groups_with_spread) == (pytest.approx(5 / 12), 3, 3)
    temperature, reason = choose_temperature([cold, hot])
    assert temperature == 1.0 and "3 of 3 groups in the band" in reason
    assert {g.split("/")[1] for g in kept_groups(rates, 1.0, 0.1, 0.9)} == {"A", "B", "C"}
    assert {g.split("/")[1] for g in kept_groups(rates, 0.5, 0.1, 0.9)} == {"B"}
    # The band's ends are included: 1 of 4 is kept by a 0.25 floor, 4 of 4 by a ceiling of 1.
    assert {g.split("/")[1] for g in kept_groups(rates, 1.0, 0.25, 0.5)} == {"B", "C"}
    assert {g.split("/")[1] for g in kept_groups(rates, 0.5, 0.5, 1.0)} == {"A", "B"}
    with pytest.raises(ValueError, match="at least two"):
        measure(generate, rows, [0.5], 1, GenerationSettings())


class TickingRollouts(ScriptedRollouts):
    """Scripted rollouts on a clock that each generate call moves on by ``seconds``."""

    def __init__(self, script: dict[tuple[str, float], list[str]], seconds: float) -> None:
        super().__init__(script)
        self.now = 0.0
        self.seconds = seconds

    def __call__(self, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings) -> list[Any]:
        self.now += self.seconds
        return super().__call__(conversations, settings)


def six_problems() -> tuple[list[dict[str, Any]], dict[tuple[str, float], list[str]]]:
    # Problem P right in 1 of its 2 rollouts at 0.5 and in both at 1.0; every problem alike.
    pids = "ABCDEF"
    rows = [with_answer(row("normal", pid), pid, "7") for pid in pids]
    script = {(pid, t): ["7", "0"] if t == 0.5 else ["7", "7"] for pid in pids for t in (0.5, 1.0)}
    return rows, script


# The pilot's options on six_problems' data: batch_size 4 / 2 samples make chunks of 2 groups (4 rollouts), each
# chunk one call per temperature. At 0.5 every group is right 1 of 2 (in the 10-90 % band), at 1.0 2 of 2 (not).
PILOT_OPTIONS: dict[str, Any] = dict(
    temperatures=[0.5, 1.0],
    samples=2,
    settings=GenerationSettings(max_new_tokens=16, batch_size=4, seed=3),
    min_rate=0.1,
    max_rate=0.9,
)


def six_problems_file(tmp_path: Path) -> tuple[Path, dict[tuple[str, float], list[str]]]:
    """six_problems' rows written as a build-data file under ``tmp_path``, and their script."""
    pytest.importorskip("datasets")
    from tmas.rl.data import write_parquet

    rows, script = six_problems()
    data = tmp_path / "train.parquet"
    write_parquet(rows, data)
    return data, script


def test_a_pilot_with_a_deadline_stops_between_chunks_and_reports_the_groups_reached() -> None:
    rows, script = six_problems()
    # batch_size 4 / 2 samples: chunks of 2 groups (4 rollouts), each chunk one call per temperature, 10 s a call.
    settings = GenerationSettings(max_new_tokens=16, batch_size=4, seed=3)
    generate = TickingRollouts(script, 10.0)
    # Chunk 1 starts at 0 and ends at 20; chunk 2 starts at 20 and, taking as long, would end at 40 <= 45: it runs;
    # chunk 3 would start at 40 and end at 60 > 45: not started. 4 of the 6 groups, each at both temperatures.
    rates = measure(generate, rows, [0.5, 1.0], 2, settings, deadline=45.0, clock=lambda: generate.now)
    assert generate.calls == [(4, 0.5), (4, 1.0), (4, 0.5), (4, 1.0)]
    reached = {r.group for r in rates}
    assert len(reached) == 4 and len(rates) == 8
    assert all((r.right, r.samples) == ((1, 2) if r.temperature == 0.5 else (2, 2)) for r in rates)
    # The groups reached are a seeded draw, not the file's first four; the same seed draws the same ones.
    again = TickingRollouts(script, 10.0)
    assert {
        r.group for r in measure(again, rows, [0.5, 1.0], 2, settings, deadline=45.0, clock=lambda: again.now)
    } == reached
    # Without a deadline: every chunk, in the file's order.
    whole = TickingRollouts(script, 10.0)
    rates = measure(whole, rows, [0.5, 1.0], 2, settings)
    assert len(rates) == 12 and whole.calls == [(4, 0.5), (4, 1.0)] * 3
    assert [r.group.split("/")[1] for r in rates if r.temperature == 0.5] == list("ABCDEF")
    # The first chunk always runs, even past the deadline.
    late = TickingRollouts(script, 10.0)
    assert len(measure(late, rows, [0.5], 2, settings, deadline=-1.0, clock=lambda: late.now)) == 2


class SeededRollouts(ScriptedRollouts):
    """Scripted rollouts noting each call's seed."""

    def __init__(self, script: dict[tuple[str, float], list[str]]) -> None:
        super().__init__(script)
        self.seeds: list[int] = []

    def __call__(self, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings) -> list[Any]:
        self.seeds.append(settings.seed)
        return super().__call__(conversations, settings)


def test_a_pilot_generates_at_most_a_batch_of_rollouts_at_once_however_large_the_data() -> None:
    """200 groups x 4 samples: 800 rollouts a temperature, never asked of the model at once. Chunks of 10 // 4 = 2
    groups (8 rollouts), each its own seed past the batches before it, every group measured once a temperature."""
    pids = [f"Q{i}" for i in range(200)]
    rows = [with_answer(row("normal", pid), pid, "7") for pid in pids]
    script = {(pid, t): ["7", "0", "0", "0"] for pid in pids for t in (0.5, 1.0)}
    generate = SeededRollouts(script)
    rates = measure(generate, rows, [0.5, 1.0], 4, GenerationSettings(max_new_tokens=16, batch_size=10, seed=5))
    assert generate.calls == [(8, 0.5), (8, 1.0)] * 100
    # Both temperatures of chunk k at seed 5 + k (one padded batch a chunk): no two chunks draw the same streams.
    assert generate.seeds == [5 + k for k in range(100) for _ in (0.5, 1.0)]
    assert sorted((r.group.split("/")[1], r.temperature) for r in rates) == sorted(
        (pid, t) for pid in pids for t in (0.5, 1.0)
    )
    assert all((r.right, r.samples) == (1, 4) for r in rates)
    # A batch smaller than a group: one group a chunk, sampled by padded generate in two batches (seeds 0 and 1),
    # so the next chunk starts at seed 2.
    small = SeededRollouts(script)
    measure(small, rows[:3], [0.5], 4, GenerationSettings(max_new_tokens=16, batch_size=3))
    assert small.calls == [(4, 0.5)] * 3 and small.seeds == [0, 2, 4]


def test_a_pilot_stopped_for_time_says_so_and_keeps_only_groups_it_measured(tmp_path: Path) -> None:
    from tmas.rl.pilot import run_pilot

    data, script = six_problems_file(tmp_path)
    generate = TickingRollouts(script, 10.0)
    # The limit counts from the start (0): 45 s as above, 4 of 6 groups; 0.5 keeps the 4 measured groups.
    report = run_pilot(
        data,
        tmp_path / "kept.parquet",
        "scripted",
        max_time_s=45,
        generate=generate,
        clock=lambda: generate.now,
        **PILOT_OPTIONS,
    )
    assert (report.groups, report.measured_groups, report.max_time_s) == (6, 4, 45)
    assert (report.chosen_temperature, report.kept_groups, report.kept_rows, report.rows) == (0.5, 4, 4, 6)
    assert "Stopped for time (45 s): 4 of 6 groups sampled" in (tmp_path / "kept.pilot.md").read_text()


class StoppedRollouts(TickingRollouts):
    """Ticking rollouts whose process is sent SIGTERM by the ``stop_at``-th generate call (counting from 1), as the
    caller does at the pilot's time: the signal arrives while that call samples."""

    def __init__(self, script: dict[tuple[str, float], list[str]], seconds: float, stop_at: int) -> None:
        super().__init__(script, seconds)
        self.stop_at = stop_at

    def __call__(self, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings) -> list[Any]:
        out = super().__call__(conversations, settings)
        if len(self.calls) == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return out


def test_a_pilot_stopped_while_it_samples_reports_the_chunks_it_finished(tmp_path: Path) -> None:
    """A chunk runs past the pilot's time (none before it said how long one takes): the caller stops the process
    with SIGTERM; the chunk under way is dropped, the finished ones are reported and their groups kept."""
    from tmas.rl.pilot import run_pilot

    data, script = six_problems_file(tmp_path)
    # Chunks of 2 groups, two calls each (0.5, then 1.0); the signal comes during chunk 2's second call, with no
    # deadline reached (1000 s): chunk 1's 2 groups are reported, chunk 2's half-measured ones are not.
    generate = StoppedRollouts(script, 10.0, stop_at=4)
    before = signal.getsignal(signal.SIGTERM)
    report = run_pilot(
        data,
        tmp_path / "kept.parquet",
        "scripted",
        max_time_s=1000,
        generate=generate,
        clock=lambda: generate.now,
        **PILOT_OPTIONS,
    )
    assert len(generate.calls) == 4
    assert (report.groups, report.measured_groups, report.kept_groups, report.kept_rows) == (6, 2, 2, 2)
    rates = [json.loads(line) for line in (tmp_path / "kept.pilot.jsonl").read_text().splitlines()]
    assert len(rates) == 4 and len({r["group"] for r in rates}) == 2
    assert signal.getsignal(signal.SIGTERM) is before
    card = (tmp_path / "kept.pilot.md").read_text()
    assert "Stopped (SIGTERM) while sampling chunk 2 of 3 of prompt groups: that chunk was dropped" in card
    assert json.loads((tmp_path / "kept.pilot.json").read_text())["stopped"].startswith("Stopped (SIGTERM)")


def test_a_pilot_stopped_before_any_chunk_finished_reports_that_and_keeps_nothing(tmp_path: Path) -> None:
    """SIGTERM during the first chunk (2 groups of 6, the first generate call): nothing was measured. The pilot says
    so in one line and in its report and card, and an earlier pilot's rows and report beside OUT do not stay to pass
    for this one's."""
    from tmas.rl.pilot import run_pilot

    data, script = six_problems_file(tmp_path)
    out = tmp_path / "kept.parquet"
    # An earlier pilot on the same OUT: every group measured, all 6 kept at 0.5.
    earlier = TickingRollouts(script, 10.0)
    assert (
        run_pilot(data, out, "scripted", generate=earlier, clock=lambda: earlier.now, **PILOT_OPTIONS).kept_groups == 6
    )
    assert out.exists()

    first = StoppedRollouts(script, 10.0, stop_at=1)
    with pytest.raises(ConfigError) as raised:
        run_pilot(data, out, "scripted", max_time_s=1000, generate=first, clock=lambda: first.now, **PILOT_OPTIONS)
    message = str(raised.value)
    assert "\n" not in message and "stopped before any chunk of prompt groups finished" in message
    assert str(tmp_path / "kept.pilot.md") in message
    assert len(first.calls) == 1 and not out.exists()
    report = json.loads((tmp_path / "kept.pilot.json").read_text())
    assert (report["measured_groups"], report["groups"], report["kept_groups"], report["kept_rows"]) == (0, 6, 0, 0)
    assert report["chosen_temperature"] is None and report["temperatures"] == []
    assert report["stopped"] == (
        "Stopped (SIGTERM) while sampling chunk 1 of 3 of prompt groups: no chunk had finished, so no group was"
        " measured"
    )
    assert (tmp_path / "kept.pilot.jsonl").read_text() == ""
    card = (tmp_path / "kept.pilot.md").read_text()
    assert "Chosen temperature: none: no chunk of prompt groups finished" in card
    assert "Kept: 0 groups, 0 of 6 rows." in card and "chunk 1 of 3" in card


class SwallowingEngine(TickingRollouts):
    """Rollouts whose process is sent SIGTERM inside the first generate call, by an engine that, as transformers'
    ``generate_batch`` (continuous batching) does, catches every exception of its loop, logs it and returns the
    completions that finished: none here."""

    def __call__(self, conversations: Sequence[Sequence[dict[str, str]]], settings: GenerationSettings) -> list[Any]:
        out = super().__call__(conversations, settings)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Exception:
            return []
        return out


def test_a_pilot_stopped_inside_an_engine_that_catches_every_exception_still_reports_that(tmp_path: Path) -> None:
    """The stop is not an error of the engine's: it goes through an engine's catch-all as through padded generate,
    and the pilot reports it instead of failing on the completions the engine did not return."""
    from tmas.rl.pilot import run_pilot

    data, script = six_problems_file(tmp_path)
    generate = SwallowingEngine(script, 10.0)
    with pytest.raises(ConfigError, match="stopped before any chunk of prompt groups finished"):
        run_pilot(
            data, tmp_path / "kept.parquet", "scripted", generate=generate, clock=lambda: generate.now, **PILOT_OPTIONS
        )
    assert len(generate.calls) == 1
    report = json.loads((tmp_path / "kept.pilot.json").read_text())
    assert report["measured_groups"] == 0 and report["stopped"].startswith("Stopped (SIGTERM) while sampling chunk 1")


def test_a_pilot_stopped_while_its_model_loads_reports_that(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's loading counts in the pilot's time, so the caller's SIGTERM can come before any chunk began:
    the pilot reports that too, rather than ending with no report."""
    from tmas.rl import pilot

    data, _ = six_problems_file(tmp_path)

    def loading(model_spec: str, dtype: str, dataset: Any = None) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # the caller's stop, while the weights load
        raise AssertionError("the stop did not interrupt the loading")

    monkeypatch.setattr(pilot, "in_process_generator", loading)
    settings = GenerationSettings(max_new_tokens=16, batch_size=4, seed=3)
    with pytest.raises(ConfigError, match="stopped before any chunk of prompt groups finished"):
        pilot.run_pilot(
            data,
            tmp_path / "kept.parquet",
            "tiny",
            temperatures=[0.5],
            samples=2,
            settings=settings,
            min_rate=0.1,
            max_rate=0.9,
            max_time_s=60,
        )
    report = json.loads((tmp_path / "kept.pilot.json").read_text())
    assert report["stopped"] == "Stopped (SIGTERM) before any chunk of prompt groups began (while the model loaded)"
    assert (report["measured_groups"], report["groups"], report["chosen_temperature"]) == (0, 6, None)


def test_a_pilot_limited_to_some_groups_reads_and_loads_the_model_on_those_rows_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--limit-groups 2 of six: the model (``tiny`` takes its vocabulary from the rows it is given) and the
    measurement see the first two groups' rows, not the whole file."""
    from tmas.rl import pilot

    data, script = six_problems_file(tmp_path)
    given: list[list[str]] = []

    def loading(model_spec: str, dtype: str, dataset: Any = None) -> Any:
        given.append([r["extra_info"]["problem_id"] for r in dataset])
        return ScriptedRollouts(script)

    monkeypatch.setattr(pilot, "in_process_generator", loading)
    report = pilot.run_pilot(data, tmp_path / "kept.parquet", "tiny", limit_groups=2, **PILOT_OPTIONS)
    assert given == [["A", "B"]]
    assert (report.rows, report.groups, report.measured_groups, report.kept_rows) == (2, 2, 2, 2)
    # The report and its card say the data was not read whole.
    assert json.loads((tmp_path / "kept.pilot.json").read_text())["limit_groups"] == 2
    card = (tmp_path / "kept.pilot.md").read_text()
    assert (
        "Limited to the first 2 prompt groups of the data: 2 groups read, the others neither sampled nor kept." in card
    )
    import pyarrow.parquet as pq

    kept = pq.read_table(tmp_path / "kept.parquet").to_pylist()
    assert [r["extra_info"]["problem_id"] for r in kept] == ["A", "B"]
    assert kept[0]["prompt"] == with_answer(row("normal", "A"), "A", "7")["prompt"]


def test_ties_go_to_more_spread_then_to_the_lower_temperature() -> None:
    def summary(t: float, band: int, spread: int) -> TemperatureSummary:
        return TemperatureSummary(
            temperature=t,
            groups=10,
            rollouts=80,
            right_rate=0.2,
            cut_rate=0.0,
            groups_with_spread=spread,
            groups_in_band=band,
        )

    assert choose_temperature([summary(0.6, 4, 5), summary(1.0, 4, 6)])[0] == 1.0
    assert choose_temperature([summary(1.0, 4, 5), summary(0.6, 4, 5)])[0] == 0.6
    assert GroupRate(group="g", task="normal", problem_id=None, temperature=1, samples=8, right=2, cut=0).rate == 0.25


@pytest.mark.slow
def test_pilot_command_with_a_tiny_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("pyarrow")
    from typer.testing import CliRunner

    from tmas.cli.main import app
    from tmas.errors import ConfigError
    from tmas.rl.data import write_parquet

    data = tmp_path / "train.parquet"
    write_parquet([row("normal", "p1"), row("experience", "p2", "base"), row("experience", "p2", "bank")], data)
    out = tmp_path / "kept.parquet"
    args = ["rl", "pilot", str(data), "-o", str(out), "--model", "tiny", "--samples", "2", "--temperature", "0.7"]
    args += ["--temperature", "1.0", "--max-completion-length", "3", "--dtype", "float32"]

    # An untrained model is never right: no group in the default band, so nothing to train on; the rates stay.
    refused = CliRunner().invoke(app, [*args, "--engine", "padded"])
    assert isinstance(refused.exception, ConfigError)  # exit status 2 from the command line
    assert "nothing to train on" in str(refused.exception)
    rates = [json.loads(line) for line in (tmp_path / "kept.pilot.jsonl").read_text().splitlines()]
    assert len(rates) == 2 * 2 and {r["right"] for r in rates} == {0}
    assert not out.exists()

    # A band of 0-100 % keeps every group; the tie (no spread anywhere) goes to the lower temperature.
    result = CliRunner().invoke(app, [*args, "--engine", "continuous", "--min-rate", "0", "--max-rate", "1"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "kept.pilot.json").read_text())
    assert report["chosen_temperature"] == 0.7 and (report["kept_rows"], report["rows"]) == (3, 3)
    assert [t["rollouts"] for t in report["temperatures"]] == [4, 4]
    assert "| 0.7 | 2 | 0.0% |" in (tmp_path / "kept.pilot.md").read_text()
    import pyarrow.parquet as pq

    assert pq.read_table(out).num_rows == 3

    # A later pilot that keeps nothing takes the earlier one's rows away with it: its report says none were kept.
    again = CliRunner().invoke(app, [*args, "--engine", "padded"])
    assert isinstance(again.exception, ConfigError) and not out.exists()
