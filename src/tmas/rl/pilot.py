"""Pilot rollouts: how often the model about to be trained gets each training prompt group right, before training.

A GRPO group whose rollouts are all right or all wrong has no advantage (eq. 6) and trains nothing. The pilot
samples every prompt group of the training data ``samples`` times, as training will (an experience group's Base
and Bank rows half the samples each, :mod:`tmas.rl.sampler`), at each temperature asked, grades each rollout as the
rewards do (:func:`tmas.rl.scoring.is_correct`), and keeps the groups right in ``min_rate`` .. ``max_rate`` of their
rollouts (both included) at the temperature that keeps the most of them: a sweep of the rollout temperature and a
difficulty filter in one measurement. It grades correctness only: a guideline rollout's novelty (eq. 9), which the
judge decides during training, is not asked here.

The groups are sampled in chunks of about a batch of rollouts, every temperature on each chunk: what is generated
and graded at once stays that size however many groups the data holds. A pilot with a time limit (``max_time_s``: a
GPU held for minutes) takes the groups in an order shuffled by the seed and starts no chunk that the last one's
time says would end past the limit: it reports on the groups it reached, each measured at every temperature. The
limit cannot cut a chunk short by itself (a first chunk always starts, and one chunk's time is not known before it
ends), so a process stopped with SIGTERM while it samples (``tmas rl pilot --max-time`` on a machine held for a few
minutes, stopped at its time by the caller) drops the chunk being sampled and reports on the chunks finished.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tmas.rl.hf_generate import Completion, GenerationSettings
from tmas.rl.sampler import PromptGroupSampler, prompt_groups
from tmas.rl.scoring import is_correct
from tmas.rl.train_options import bf16_autocast, rollout_precision

Conversation = Sequence[dict[str, str]]
Generate = Callable[[Sequence[Conversation], GenerationSettings], list[Completion]]


class PilotStopped(BaseException):
    """The pilot's process was told to stop (SIGTERM) while it sampled: the chunk under way is dropped. Raised out of
    :func:`measure` with the rates of the chunks that finished before it, and how many chunks there were. A stop, not
    an error (as KeyboardInterrupt): transformers' continuous batching (``generate_batch``) catches every Exception of
    its loop and returns the completions that finished, which would leave the chunk short instead of stopped."""

    def __init__(self, rates: Sequence[GroupRate] = (), finished: int = 0, chunks: int = 0) -> None:
        super().__init__("stopped (SIGTERM) while sampling")
        self.rates = list(rates)
        self.finished = finished
        self.chunks = chunks


@contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`PilotStopped` where the main thread is (in the main thread only: a signal
    handler can be set nowhere else); the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise PilotStopped

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class GroupRate(BaseModel):
    """One prompt group's pilot rollouts at one temperature."""

    group: str
    task: str
    problem_id: str | None
    temperature: float
    samples: int
    right: int
    cut: int

    @property
    def rate(self) -> float:
        return self.right / self.samples


class TemperatureSummary(BaseModel):
    temperature: float
    groups: int
    rollouts: int
    # Share of all rollouts right, and cut at the token limit.
    right_rate: float
    cut_rate: float
    # Groups with right and wrong rollouts both (they carry a gradient at this group size).
    groups_with_spread: int
    # Groups right in min_rate .. max_rate of their rollouts (kept at this temperature).
    groups_in_band: int


class PilotReport(BaseModel):
    model: str
    data: str
    samples: int
    max_new_tokens: int
    top_p: float
    min_rate: float
    max_rate: float
    temperatures: list[TemperatureSummary]
    # None when no group was measured (stopped before a chunk finished): nothing chosen, nothing kept.
    chosen_temperature: float | None
    reason: str
    kept_groups: int
    kept_rows: int
    rows: int
    # Prompt groups in the data, and the ones sampled before the time limit (all of them without one).
    groups: int = 0
    measured_groups: int = 0
    max_time_s: float | None = None
    # --limit-groups: only the data's first so many prompt groups were read (``groups`` counts those); None: all.
    limit_groups: int | None = None
    # Why sampling ended early by a signal (SIGTERM while a chunk sampled: that chunk dropped); None otherwise.
    stopped: str | None = None
    # The rollouts' weights and autocast (:func:`tmas.rl.train_options.rollout_precision`); None: rollouts of a
    # generator given by the caller, or a report written before it was recorded.
    precision: str | None = None


def expanded_rows(extra_info: Sequence[dict[str, Any]], samples: int) -> tuple[list[list[int]], list[int]]:
    """The prompt groups (row indices) and, per pilot rollout, the row it samples: each group ``samples`` times as
    the training sampler expands it."""
    groups = prompt_groups(extra_info)
    sampler = PromptGroupSampler(groups, num_generations=samples, shuffle=False)
    return groups, [row for group in groups for row in sampler.expand(group)]


def measure(
    generate: Generate,
    rows: Sequence[dict[str, Any]],
    temperatures: Sequence[float],
    samples: int,
    settings: GenerationSettings,
    *,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[GroupRate]:
    """Every group sampled ``samples`` times at each temperature (``settings`` gives the rest of the sampling), in
    chunks of about ``settings.batch_size`` rollouts: one ``generate`` call per chunk and temperature, seeded past
    the batches of the chunks before it (every chunk draws its own random streams). With a ``deadline`` (a ``clock``
    time), the groups are shuffled by ``settings.seed`` first, and after the first chunk none starts that the one
    before says would end past it.
    :class:`PilotStopped` raised while a chunk is sampled drops that chunk and ends the measurement: it is raised
    again with the chunks finished before it (their rates, how many of how many)."""
    if samples < 2:
        raise ValueError("a group needs at least two pilot rollouts to show a spread")
    groups, order = expanded_rows([r["extra_info"] for r in rows], samples)
    # Each group with the rows its rollouts sample.
    sampled = [(group, order[g * samples : (g + 1) * samples]) for g, group in enumerate(groups)]
    if deadline is not None:
        random.Random(settings.seed).shuffle(sampled)
    # Whatever the data's size, a chunk is about a batch of rollouts: what one generate call holds at once.
    size = max(1, settings.batch_size // samples)
    # Padded generate seeds its b-th batch of a call with seed + b: a chunk starts after the batches of those before.
    batches = -(-size * samples // settings.batch_size)
    out: list[GroupRate] = []
    last = 0.0
    starts = range(0, len(sampled), size)
    finished = 0
    try:
        for chunk, start in enumerate(starts):
            began = clock()
            if deadline is not None and out and began + last > deadline:
                break
            seeded = settings.model_copy(update={"seed": settings.seed + chunk * batches})
            # A chunk's rates join the others whole: every group of it measured at every temperature.
            out += measure_chunk(generate, rows, sampled[start : start + size], temperatures, seeded)
            finished += 1
            last = clock() - began
    except PilotStopped:
        raise PilotStopped(out, finished, len(starts)) from None
    return out


def measure_chunk(
    generate: Generate,
    rows: Sequence[dict[str, Any]],
    sampled: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperatures: Sequence[float],
    settings: GenerationSettings,
) -> list[GroupRate]:
    """Groups (each with the rows its rollouts sample) at each temperature, one ``generate`` call a temperature.
    ``rows`` may read a row on each access (a dataset on disk): each row of the chunk is read once."""
    mine = {i: rows[i] for group, rollouts in sampled for i in (*group, *rollouts)}
    conversations = [mine[i]["prompt"] for _, rollouts in sampled for i in rollouts]
    out: list[GroupRate] = []
    for temperature in temperatures:
        completions = iter(generate(conversations, settings.model_copy(update={"temperature": temperature})))
        for group, rollouts in sampled:
            first = mine[group[0]]
            right = cut = 0
            for i in rollouts:
                completion = next(completions)
                row = mine[i]
                right += is_correct(
                    completion.text,
                    str(row["reward_model"]["ground_truth"]),
                    question=str(row["extra_info"].get("question") or ""),
                )
                cut += completion.cut
            out.append(
                GroupRate(
                    group=str(first["extra_info"]["group"]),
                    task=str(first["extra_info"]["task"]),
                    problem_id=first["extra_info"].get("problem_id"),
                    temperature=temperature,
                    samples=len(rollouts),
                    right=right,
                    cut=cut,
                )
            )
    return out


def in_band(rate: GroupRate, min_rate: float, max_rate: float) -> bool:
    return min_rate <= rate.rate <= max_rate


def summarize(rates: Sequence[GroupRate], min_rate: float, max_rate: float) -> list[TemperatureSummary]:
    out = []
    for temperature in sorted({r.temperature for r in rates}):
        mine = [r for r in rates if r.temperature == temperature]
        rollouts = sum(r.samples for r in mine)
        out.append(
            TemperatureSummary(
                temperature=temperature,
                groups=len(mine),
                rollouts=rollouts,
                right_rate=sum(r.right for r in mine) / rollouts,
                cut_rate=sum(r.cut for r in mine) / rollouts,
                groups_with_spread=sum(0 < r.right < r.samples for r in mine),
                groups_in_band=sum(in_band(r, min_rate, max_rate) for r in mine),
            )
        )
    return out


def choose_temperature(summaries: Sequence[TemperatureSummary]) -> tuple[float, str]:
    """The temperature keeping the most groups in the band; a tie goes to more groups with a spread, then to the
    lower temperature (fewer incoherent rollouts)."""
    if not summaries:
        raise ValueError("no temperature measured")
    best = max(summaries, key=lambda s: (s.groups_in_band, s.groups_with_spread, -s.temperature))
    reason = (
        f"{best.groups_in_band} of {best.groups} groups in the band and {best.groups_with_spread} with a spread of"
        f" outcomes at temperature {best.temperature:g} (right {best.right_rate:.1%} of {best.rollouts} rollouts),"
        " the most of the temperatures tried"
    )
    return best.temperature, reason


def kept_groups(rates: Sequence[GroupRate], temperature: float, min_rate: float, max_rate: float) -> set[str]:
    return {r.group for r in rates if r.temperature == temperature and in_band(r, min_rate, max_rate)}


def card(report: PilotReport) -> str:
    lines = [
        "# Pilot rollouts",
        "",
        f"Model `{report.model}` on `{report.data}`: every prompt group sampled {report.samples} times per"
        f" temperature (top_p {report.top_p:g}, at most {report.max_new_tokens} tokens), each rollout graded as the"
        " rewards grade it (correctness only)."
        + ("" if report.precision is None else f" Generated in {report.precision}."),
        "",
        "| temperature | groups | rollouts right | cut | groups with a spread | groups in band |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report.temperatures:
        lines.append(
            f"| {s.temperature:g} | {s.groups} | {s.right_rate:.1%} | {s.cut_rate:.1%} | {s.groups_with_spread} |"
            f" {s.groups_in_band} |"
        )
    lines += [
        "",
        f"Band: right in {report.min_rate:.0%} to {report.max_rate:.0%} of a group's rollouts (both included).",
        (
            "Chosen temperature: none"
            if report.chosen_temperature is None
            else f"Chosen temperature: {report.chosen_temperature:g}"
        )
        + f": {report.reason}.",
        f"Kept: {report.kept_groups} groups, {report.kept_rows} of {report.rows} rows.",
    ]
    if report.limit_groups is not None:
        lines.append(
            f"Limited to the first {report.limit_groups} prompt groups of the data: {report.groups} groups read, the"
            " others neither sampled nor kept."
        )
    if report.stopped is not None:
        lines.append(f"{report.stopped}.")
    elif report.measured_groups < report.groups:
        lines.append(
            f"Stopped for time ({report.max_time_s:g} s): {report.measured_groups} of {report.groups} groups sampled,"
            " in an order shuffled by the seed; the others were not measured and are not kept."
        )
    return "\n".join(lines) + "\n"


def stop_note(stop: PilotStopped) -> str:
    """Where a SIGTERM stopped the pilot, and what that left measured."""
    if not stop.chunks:
        return "Stopped (SIGTERM) before any chunk of prompt groups began (while the model loaded)"
    note = f"Stopped (SIGTERM) while sampling chunk {stop.finished + 1} of {stop.chunks} of prompt groups"
    if not stop.rates:
        return note + ": no chunk had finished, so no group was measured"
    groups = len({r.group for r in stop.rates})
    return note + (
        f": that chunk was dropped; {groups} groups of the {stop.finished} chunks finished were measured, the others"
        " are not kept"
    )


def pilot_paths(out: Path) -> dict[str, Path]:
    """Beside the kept rows' parquet: the per-group rates, the report and its card."""
    stem = out.with_suffix("")
    return {
        "rates": stem.with_name(stem.name + ".pilot.jsonl"),
        "report": stem.with_name(stem.name + ".pilot.json"),
        "card": stem.with_name(stem.name + ".pilot.md"),
    }


def read_report(out: Path) -> PilotReport | None:
    """The report of the pilot whose kept rows are ``out``, or None when none is beside it."""
    from pydantic import ValidationError

    from tmas.errors import InputError

    path = pilot_paths(out)["report"]
    if not path.is_file():
        return None
    try:
        return PilotReport.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as exc:
        raise InputError(f"{path}: not a report of 'tmas rl pilot' ({exc.error_count()} errors)") from None


def sampling_differences(
    report: PilotReport, temperature: float, top_p: float, max_new_tokens: int, precision: str | None = None
) -> list[str]:
    """Where rollouts sampled at these settings (and generated in ``precision``, where known) differ from those the
    pilot chose its groups at, each as ``'<setting> <pilot's> (here <these>)'``: its right rates describe rollouts
    sampled at the pilot's."""
    pairs = [
        ("temperature", report.chosen_temperature, temperature),
        ("top_p", report.top_p, top_p),
        ("max tokens", report.max_new_tokens, max_new_tokens),
    ]
    out = [f"{name} {pilot:g} (here {mine:g})" for name, pilot, mine in pairs if pilot is not None and pilot != mine]
    if report.precision is not None and precision is not None and report.precision != precision:
        out.append(f"precision {report.precision} (here {precision})")
    return out


def run_pilot(
    data: Path,
    out: Path,
    model_spec: str,
    *,
    temperatures: Sequence[float],
    samples: int,
    settings: GenerationSettings,
    min_rate: float,
    max_rate: float,
    dtype: str = "float32",
    limit_groups: int | None = None,
    max_time_s: float | None = None,
    generate: Generate | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PilotReport:
    """Measure, write the rates, the report and its card beside ``out``, then the kept rows to ``out`` (a parquet
    in the training data's schema). ``generate`` defaults to ``model_spec`` loaded in-process with transformers
    (on the GPU when there is one). ``max_time_s``: seconds from here (the model's loading included) after which no
    chunk of groups starts (:func:`measure`); SIGTERM while it samples ends the measurement with the chunks
    finished."""
    from tmas.errors import ConfigError, InputError
    from tmas.rl.data import write_parquet
    from tmas.rl.trl_train import load_dataset

    deadline = None if max_time_s is None else clock() + max_time_s
    dataset = load_dataset(data)
    if limit_groups is not None:
        # Only these groups' rows are read from here on, and give ``tiny`` its vocabulary.
        chosen = prompt_groups(dataset["extra_info"])[:limit_groups]
        dataset = dataset.select([i for group in chosen for i in group])
    # Rows are read from the (memory-mapped) dataset as a chunk needs them, not all copied into memory at once.
    rows = dataset
    if not len(rows):
        raise InputError(f"pilot on {data}: no training rows to sample")
    stopped = None
    measured: list[GroupRate] | None = None
    precision = None if generate is not None else rollout_precision(dtype, settings.engine == "continuous", cuda())
    with stopped_by_sigterm():
        try:
            # The model's loading counts in the pilot's time: a stop then is reported too.
            generate = generate or in_process_generator(model_spec, dtype, dataset)
            measured = measure(generate, rows, temperatures, samples, settings, deadline=deadline, clock=clock)
        except PilotStopped as exc:
            if measured is None:  # (a stop once every group is measured changes nothing)
                measured, stopped = exc.rates, stop_note(exc)
    rates = measured or []
    paths = pilot_paths(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths["rates"].write_text("".join(r.model_dump_json() + "\n" for r in rates), encoding="utf-8")
    summaries = summarize(rates, min_rate, max_rate)
    temperature: float | None = None
    reason = "no chunk of prompt groups finished, so no rate was measured and no group is kept"
    if summaries:
        temperature, reason = choose_temperature(summaries)
    keep = set() if temperature is None else kept_groups(rates, temperature, min_rate, max_rate)
    infos = rows["extra_info"]
    kept = [rows[i] for i, info in enumerate(infos) if str(info["group"]) in keep]
    report = PilotReport(
        model=model_spec,
        data=str(data),
        samples=samples,
        max_new_tokens=settings.max_new_tokens,
        top_p=settings.top_p,
        min_rate=min_rate,
        max_rate=max_rate,
        temperatures=summaries,
        chosen_temperature=temperature,
        reason=reason,
        kept_groups=len(keep),
        kept_rows=len(kept),
        rows=len(rows),
        groups=len(prompt_groups(infos)),
        measured_groups=len({r.group for r in rates}),
        max_time_s=max_time_s,
        limit_groups=limit_groups,
        stopped=stopped,
        precision=precision,
    )
    paths["report"].write_text(report.model_dump_json(indent=1) + "\n", encoding="utf-8")
    paths["card"].write_text(card(report), encoding="utf-8")
    if not kept:
        # An earlier pilot's rows would pass for this one's beside its report.
        out.unlink(missing_ok=True)
        if not rates:
            raise ConfigError(
                f"pilot on {data}: stopped before any chunk of prompt groups finished: nothing measured, nothing"
                f" kept (report {paths['card']})"
            )
        raise ConfigError(
            f"no prompt group was right in {min_rate:.0%}-{max_rate:.0%} of its rollouts at any temperature tried:"
            f" nothing to train on (rates in {paths['rates']})"
        )
    write_parquet(kept, out)
    return report


def cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def in_process_generator(model_spec: str, dtype: str, dataset: Any = None) -> Generate:
    """``model_spec`` as training loads it (``dataset`` gives ``tiny`` its vocabulary), generating in the precision
    training generates in with the same dtype and engine (:func:`tmas.rl.train_options.bf16_autocast`)."""
    import torch

    from tmas.rl.hf_generate import generate
    from tmas.rl.trl_train import load_policy

    on_gpu = cuda()
    model, tokenizer = load_policy(model_spec, dataset, dtype)
    model = model.to("cuda" if on_gpu else "cpu").eval()

    def run(conversations: Sequence[Conversation], settings: GenerationSettings) -> list[Completion]:
        if bf16_autocast(dtype, settings.engine == "continuous", on_gpu):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return generate(model, tokenizer, conversations, settings)
        return generate(model, tokenizer, conversations, settings)

    return run
