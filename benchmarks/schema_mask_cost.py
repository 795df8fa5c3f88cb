"""Host time a step of the in-process engine loses to reply schemas (:class:`tmas.llm.hf_grammar.SchemaMask`) with
R requests constrained at once, on a run's own JSON replies.

The engine hands the mask each step's requests before the step's forward pass; the mask fills its rows on a worker
thread beside the forward pass and waits for them where the scores come. Here the engine is left out and
:class:`SchemaMask` is driven as the engine drives it:

- R requests decode at once, each replaying one stored reply of the given runs and roles (TMAS's verifications and
  experience updates, RSE's distillations, MATTRL's peer reviews) one token a step, under the schema that role sends
  at ``--max-tokens``; each reply is rewritten as the engine writes JSON (``", "`` and ``": "`` between items, no
  other whitespace), and only replies the schema takes whole are used. A request whose reply is done leaves and the
  next reply joins in its place (its matcher copied from the compiled schema then), so all R rows are constrained
  every step, as in a full batch of JSON calls.
- A step: :meth:`SchemaMask.prepare_tensor_args` (each matcher takes its last token; the fill is handed to the
  worker), a sleep of ``--forward-ms`` standing for the forward pass, the wait for the fill (on ``--threads`` of
  llguidance's executor threads), then :meth:`SchemaMask.__call__` on an (R, vocabulary) score tensor.
- "Host ms lost" is the step's time outside the sleep before the masking: the time the engine's thread spends on
  schemas that the forward pass does not hide. With ``--forward-ms 0`` it is the whole cost, as if filled in line.
  "Masking" is :meth:`SchemaMask.__call__` on this CPU's tensors (on a GPU it runs there).

Writes OUT/mask_cost.json (machine, settings, each row) and prints a table. ``--engine`` measures the whole engine
instead: ``--calls`` verifications at once through the in-process model under the verification schema, the mask
filled beside the forward pass (as the engine does) against in line, in alternating pairs with the same prompts and
seeds; generated tokens/s each, into OUT/engine_ab.json. A timing means something only on a machine running nothing
else. ::

    python benchmarks/schema_mask_cost.py --reply runs/tmas:verifier --reply runs/tmas:experience \\
        --reply runs/rse:distiller --reply runs/mattrl:reviewer --out mask-cost     # 0.5B tokenizer, R 16/64/256
    python benchmarks/schema_mask_cost.py --engine --model smollm2-135m --calls 64 --max-tokens 64 --out mask-ab
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel

from tmas.agents.baselines import distillation_reply_model
from tmas.agents.experience import experience_reply_model
from tmas.agents.mattrl_review import ReviewReply
from tmas.agents.verification import verification_reply_model
from tmas.methods.rse import RSEParams
from tmas.store.run_store import RunStore

# The reply model each role sends with its method's defaults, for replies of at most the given max_tokens.
REPLY_MODELS: dict[str, Callable[[int], type[BaseModel]]] = {
    "verifier": lambda max_tokens: verification_reply_model(max_tokens),
    "experience": lambda max_tokens: experience_reply_model(max_tokens),
    "distiller": lambda max_tokens: distillation_reply_model(max_tokens, RSEParams().items_per_trajectory),
    "reviewer": lambda _max_tokens: ReviewReply,
}


# Steps run before the timed ones (the schemas compiled, the batch past its first replies' start).
WARM_UP = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reply", action="append", metavar="RUN:ROLE", help="a run's replies of a role")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="instead: --calls constrained calls at once through the in-process model (--model), the mask filled "
        "beside the forward pass against in line, alternating --repeats times",
    )
    parser.add_argument("--calls", type=int, default=64, help="--engine: calls at once")
    parser.add_argument("--repeats", type=int, default=3, help="--engine: pairs of runs")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--model", default="qwen2.5-coder-0.5b", help="checkpoint, GGUF or name: its tokenizer (with --engine: it runs)"
    )
    parser.add_argument("--rows", default="16,64,256", help="comma-separated numbers of constrained requests")
    parser.add_argument("--threads", default="1,2", help="comma-separated numbers of llguidance executor threads")
    parser.add_argument("--steps", type=int, default=200, help=f"steps timed at each setting (after {WARM_UP} untimed)")
    parser.add_argument(
        "--forward-ms",
        default="0,15",
        help="comma-separated lengths of the forward pass the fill runs beside (15: a step of 256 calls at 15,000 "
        "tokens/s)",
    )
    parser.add_argument("--max-tokens", type=int, default=640, help="the calls' max_tokens the schemas are sized for")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() else value


def canonical(content: str) -> str | None:
    """The reply as the engine writes JSON (a whole number without its ".0", as the grammar allows a schema's
    ``1.0``); None where it is not one JSON object."""
    try:
        value = json.loads(content, parse_float=_number)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def stored_replies(spec: str, max_tokens: int) -> tuple[str, list[str]]:
    """(the role's schema text, its replies in the run that are one JSON object each) of ``RUN:ROLE``."""
    from tmas.llm.hf_grammar import schema_text
    from tmas.llm.schema import response_format

    run, _, role = spec.rpartition(":")
    if not run:
        raise SystemExit(f"--reply {spec!r}: expected RUN:ROLE")
    if role not in REPLY_MODELS:
        raise SystemExit(f"--reply {spec!r}: the role is not one of {', '.join(REPLY_MODELS)}")
    text = schema_text(response_format(REPLY_MODELS[role](max_tokens)))
    assert text is not None
    store = RunStore(Path(run), create=False, read_only=True)
    try:
        replies = [r for c in store.calls() if c.key.role == role and c.error is None if (r := canonical(c.content))]
    finally:
        store.close()
    if not replies:
        raise SystemExit(f"--reply {spec!r}: the run holds no JSON reply of role {role!r}")
    return text, replies


@dataclass
class State:
    """What :class:`SchemaMask` reads of a request in the engine."""

    request_id: str
    generated_tokens: list[int] = field(default_factory=list)
    initial_tokens: list[int] = field(default_factory=list)


@dataclass
class Request:
    """What the engine hands its processors for a request drawing a token in the step."""

    state: State


@dataclass
class Row:
    state: State
    tokens: list[int]


class Batch:
    """R requests replaying stored replies one token a step; a finished one replaced by the next reply."""

    def __init__(self, replies: list[tuple[str, list[int]]], rows: int, seed: int) -> None:
        self.replies = replies
        self.order = random.Random(seed)
        self.schemas: dict[str, str] = {}
        self.joined = 0
        self.rows = [self._join() for _ in range(rows)]

    def _join(self) -> Row:
        schema, tokens = self.replies[self.order.randrange(len(self.replies))]
        request_id = f"r{self.joined}"
        self.joined += 1
        self.schemas[request_id] = schema
        return Row(State(request_id), tokens)

    def schema_of(self, request_id: str) -> str | None:
        return self.schemas.get(request_id)

    def step(self) -> list[Any]:
        """Each request draws its reply's next token (one finished leaves, the next joins); the requests as the
        engine hands them to the processor."""
        for i, row in enumerate(self.rows):
            drawn = row.state.generated_tokens
            if len(drawn) == len(row.tokens):
                del self.schemas[row.state.request_id]
                self.rows[i] = self._join()
            else:
                drawn.append(row.tokens[len(drawn)])
        return [Request(row.state) for row in self.rows]


def measure(
    grammars: Any,
    vocab: int,
    replies: list[tuple[str, list[int]]],
    rows: int,
    steps: int,
    forward_s: float,
    seed: int,
) -> dict[str, Any]:
    import torch

    from tmas.llm.hf_grammar import SchemaMask

    batch = Batch(replies, rows, seed)
    mask = SchemaMask(grammars, batch.schema_of)
    scores = torch.randn(rows, vocab)
    lost: list[float] = []
    apply: list[float] = []
    allowed = 0
    for step in range(steps + WARM_UP):
        requests = batch.step()
        start = time.perf_counter()
        arg = mask.prepare_tensor_args(requests)
        prepared = time.perf_counter()
        time.sleep(forward_s)  # the step's forward pass, which the fill runs beside
        waited = time.perf_counter()
        pending = mask._mask  # the fill, awaited here so that the masking itself is timed apart
        if pending is not None:
            pending.result()
        filled = time.perf_counter()
        masked = mask(scores, arg)
        end = time.perf_counter()
        if step >= WARM_UP:
            lost.append((prepared - start) + (filled - waited))
            apply.append(end - filled)
            allowed += int(torch.isfinite(masked).sum())
    mean = statistics.fmean(lost)
    return {
        "rows": rows,
        "forward_ms": forward_s * 1e3,
        "steps": steps,
        "lost_ms": round(mean * 1e3, 3),
        "lost_p90_ms": round(sorted(lost)[int(0.9 * len(lost))] * 1e3, 3),
        "lost_us_per_row": round(mean * 1e6 / rows, 1),
        "apply_ms": round(statistics.fmean(apply) * 1e3, 3),
        "allowed_tokens_per_row": round(allowed / (steps * rows), 1),
        "replies_started": batch.joined,
        "matchers_failed": mask.failed,
    }


async def engine_ab(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Generated tokens/s of ``args.calls`` verifications at once through the in-process model, each under the
    verification schema at temperature 1, the mask filled beside the forward pass (as the engine does) and in line,
    alternating; each pair sends the same prompts and seeds."""
    from tmas.agents.verification import verification_reply_model
    from tmas.config import Sampling, Settings
    from tmas.llm import hf_grammar, hf_sampling
    from tmas.llm.hf_model import open_hf_model
    from tmas.llm.types import CallKey, Message

    class InLine(hf_grammar.SchemaMask):
        """The fill waited for where it is handed over: the mask as if computed in line."""

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> Any:
            unused = super().prepare_tensor_args(requests_with_new_token)
            if self._mask is not None:
                self._mask.result()
            return unused

    settings = Settings.model_validate(
        {"hf": {"model": args.model}, "endpoint": {"structured_output": "json_schema"}, "concurrency": args.calls}
    )
    shape = verification_reply_model(args.max_tokens)
    question = "Is {0} + {0} = {1} right? Reply in JSON with your analysis and a score."
    asks = [[Message(role="user", content=question.format(i, 2 * i))] for i in range(args.calls)]

    async def timed(repeat: int) -> tuple[list[Any], float]:
        async with open_hf_model(settings) as llm:
            warm = Sampling(seed=10**6, max_tokens=4, temperature=1.0)
            await llm.chat("verifier", asks[0], sampling=warm, reply_model=shape)
            start = time.perf_counter()
            done = await asyncio.gather(
                *[
                    llm.chat(
                        "verifier",
                        ask,
                        key=CallKey(role="verifier", sample=i),
                        sampling=Sampling(
                            seed=args.seed + 1000 * repeat + i, max_tokens=args.max_tokens, temperature=1.0
                        ),
                        reply_model=shape,
                    )
                    for i, ask in enumerate(asks)
                ]
            )
            return done, time.perf_counter() - start

    rows = []
    try:
        for repeat in range(args.repeats):
            for mode, mask in (("beside", hf_grammar.SchemaMask), ("in line", InLine)):
                hf_sampling.SchemaMask = mask  # type: ignore[misc]  # the class the engine's processors are built from
                done, seconds = await timed(repeat)
                tokens = sum(c.usage.completion_tokens for c in done)
                row = {"repeat": repeat, "mode": mode, "tokens": tokens, "seconds": round(seconds, 2)}
                row |= {"tokens_per_s": round(tokens / seconds, 1), "failed": sum(not c.ok for c in done)}
                rows.append(row)
                print(f"| {repeat} | {mode} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} |", flush=True)
    finally:
        hf_sampling.SchemaMask = hf_grammar.SchemaMask  # type: ignore[misc]
    return rows


def write_summary(out: Path, name: str, figures: dict[str, Any]) -> None:
    """``figures`` with the date and machine, as OUT/``name``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}",
        **figures,
    }
    (out / name).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine:
        print("| Pair | Mask | Completion tokens | Seconds | Tokens/s |\n|---:|---|---:|---:|---:|")
        rows = asyncio.run(engine_ab(args))
        rate = {m: statistics.fmean(r["tokens_per_s"] for r in rows if r["mode"] == m) for m in ("beside", "in line")}
        print(f"beside / in line: {rate['beside'] / rate['in line']:.3f}")
        figures = {"model": args.model, "calls": args.calls, "max_tokens": args.max_tokens, "rows": rows}
        write_summary(
            args.out, "engine_ab.json", {**figures, "beside_over_in_line": round(rate["beside"] / rate["in line"], 3)}
        )
        return 0
    if not args.reply:
        raise SystemExit("give --reply RUN:ROLE (one or more), or --engine")
    import llguidance
    from transformers import AutoConfig, AutoTokenizer

    from tmas.llm.hf_checkpoint import checkpoint
    from tmas.llm.hf_engine import stop_token_ids
    from tmas.llm.hf_grammar import Grammars

    folder = checkpoint(args.model, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    grammars = Grammars(tokenizer, config.vocab_size, stop_token_ids(SimpleNamespace(config=config), tokenizer))
    replies: list[tuple[str, list[int]]] = []
    sources = {}
    for spec in args.reply:
        schema, texts = stored_replies(spec, args.max_tokens)
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        # Only replies the schema sent now takes whole (one written before its bounds may run past them).
        taken = [(schema, tokens) for tokens in encoded if grammars.matcher(schema).consume_tokens(tokens)]
        print(f"{spec}: {len(taken)} of {len(texts)} stored JSON replies fit the schema", flush=True)
        replies += taken
        sources[spec] = {"stored": len(texts), "fitting": len(taken)}
    if not replies:
        raise SystemExit("no stored reply fits its role's schema")
    rows_out = []
    print("| Threads | Rows | Forward ms | Host ms lost a step (p90) | µs a row | Masking ms | Matchers failed |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        grammars.executor = llguidance.LLExecutor(num_threads=threads)
        for rows in (int(r) for r in args.rows.split(",")):
            for forward in (float(f) for f in args.forward_ms.split(",")):
                measured = measure(grammars, config.vocab_size, replies, rows, args.steps, forward / 1e3, args.seed)
                row = {"threads": threads, **measured}
                rows_out.append(row)
                print(
                    f"| {threads} | {rows} | {forward:g} | {row['lost_ms']:.2f} ({row['lost_p90_ms']:.2f}) |"
                    f" {row['lost_us_per_row']:.0f} | {row['apply_ms']:.2f} | {row['matchers_failed']} |",
                    flush=True,
                )
    figures = {
        "llguidance": version("llguidance"),
        "model": args.model,
        "vocab": config.vocab_size,
        "max_tokens": args.max_tokens,
        "replies": sources,
        "mean_reply_tokens": round(statistics.fmean(len(t) for _, t in replies), 1),
        "rows": rows_out,
    }
    write_summary(args.out, "mask_cost.json", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
