"""An lm-evaluation-harness task over a tmas problem file, to score ``tmas serve`` with ``local-chat-completions``.

The task is a generation task: the question is the one user message (``--apply_chat_template``), the reply's last
``\\boxed{}`` is the answer, and lm-eval's own ``exact_match`` (case, spaces and ``$`` ignored) compares it with the
problem's answer. Its documents are the problems, written beside the YAML as JSONL (lm-eval reads them with the
``datasets`` library's JSON loader: no hub, no network).

The YAML is written by hand, not with a YAML library (the core install has none): every value is a JSON scalar or a
flow list, which YAML reads as written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from tmas.errors import InputError
from tmas.problems import Problem

# The last \boxed{...}, one level of nested braces inside (\frac{1}{2}); what tmas's own extraction reads first.
BOXED_PATTERN = r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}"
# What exact_match removes from both sides before comparing: spaces and math-mode dollars ("$391$" is 391).
IGNORED_IN_ANSWERS = [r"\s", r"\$"]
TASK_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def task_yaml(name: str, data_file: Path, *, max_gen_toks: int, temperature: float) -> str:
    """The task's YAML: ``data_file`` is read by absolute path (lm-eval resolves relative ones from its cwd)."""
    q = json.dumps
    ignored = q(IGNORED_IN_ANSWERS)
    return (
        f"# lm-evaluation-harness task over {data_file.name}, written by `tmas data lm-eval-task`.\n"
        f"# lm_eval run --model local-chat-completions --apply_chat_template --include_path {data_file.parent} \\\n"
        f"#   --tasks {name} --model_args model=tmas/MODEL,base_url=http://127.0.0.1:8080/v1/chat/completions\n"
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {q(str(data_file.resolve()))}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n"
        # lm-eval's default stop sequence is the few-shot delimiter "\n\n", which would end the reply at its first
        # paragraph (tmas serve applies stop to the reply, as any OpenAI server): the task sets none.
        "  until: []\n"
        f"  max_gen_toks: {max_gen_toks}\n"
        # lm-eval sends temperature 0 when the task names none, whatever do_sample says: both are written.
        f"  do_sample: {q(temperature > 0)}\n"
        f"  temperature: {q(temperature)}\n"
        "filter_list:\n"
        "  - name: boxed\n"
        "    filter:\n"
        "      - function: regex\n"
        f"        regex_pattern: {q(BOXED_PATTERN)}\n"
        "        group_select: -1\n"
        '        fallback: "[no boxed answer]"\n'
        "      - function: take_first\n"
        "metric_list:\n"
        "  - metric: exact_match\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
        "    ignore_case: true\n"
        f"    regexes_to_ignore: {ignored}\n"
        "metadata:\n"
        "  version: 1.0\n"
    )


def unscorable(problems: list[Problem], places: Mapping[str, str]) -> str | None:
    """Why the problems cannot all be scored, in one line naming the first with no answer or a blank one (a blank
    answer matches no reply either) by its place (``places``: problem id -> ``file:line``, where known) and counting
    the others; None where every problem has an answer."""
    missing = [p for p in problems if not p.labeled]
    if not missing:
        return None
    first = missing[0]
    if first.problem_id not in places:
        return f"problems without an answer cannot be scored: {', '.join(p.problem_id for p in missing[:5])}"
    what = "no answer" if first.answer is None else "a blank answer"
    more = len(missing) - 1
    others = f" (nor {more} more problem{'s' if more > 1 else ''} after it)" if more else ""
    return f"{places[first.problem_id]}: problem {first.problem_id!r} has {what}: lm-eval cannot score it{others}"


def write_task(
    problems: list[Problem],
    out_dir: Path,
    name: str,
    *,
    max_gen_toks: int = 2048,
    temperature: float = 0.7,
    places: Mapping[str, str] | None = None,
) -> tuple[Path, Path]:
    """Write ``OUT_DIR/NAME.yaml`` and its documents ``OUT_DIR/NAME.jsonl``; returns both paths. A problem without
    an answer is refused, named by its place in ``places`` (problem id -> ``file:line``) where given."""
    if not TASK_NAME.match(name):
        raise InputError(f"task name {name!r}: letters, digits and '_' only, starting with a letter")
    if max_gen_toks < 1:
        raise InputError(f"--max-gen-toks must be at least 1 (got {max_gen_toks})")
    if not 0 <= temperature <= 2:
        raise InputError(f"--temperature must be within 0-2 (got {temperature})")
    if (refusal := unscorable(problems, places or {})) is not None:
        raise InputError(refusal)
    if not problems:
        raise InputError("no problems to write")
    out_dir.mkdir(parents=True, exist_ok=True)
    data_file = out_dir / f"{name}.jsonl"
    rows = [{"problem_id": p.problem_id, "question": p.question, "answer": p.answer} for p in problems]
    data_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    yaml_file = out_dir / f"{name}.yaml"
    yaml_file.write_text(task_yaml(name, data_file, max_gen_toks=max_gen_toks, temperature=temperature))
    return yaml_file, data_file
