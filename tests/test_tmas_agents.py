"""TMAS agents: prompt contents and the parsers' rules."""

from __future__ import annotations

import pytest

from tmas.agents.experience import experience_prompt, parse_experience_update
from tmas.agents.guideline import parse_guideline_update
from tmas.agents.output import AgentOutputError, extract_json_object
from tmas.agents.rollouts import Rollout, fit_rollouts
from tmas.agents.solution import explore_prompt, generation_prompt, parse_solution, refine_prompt
from tmas.agents.summary import parse_summary
from tmas.agents.verification import parse_verification
from tmas.memory import ExperienceBank, ExperienceEntry, Strategy


@pytest.mark.parametrize(
    ("text", "score", "snapped"),
    [
        ("## Analysis\nfine\n\n## Score\nScore: 1", 1.0, False),
        ("**Score:** 0.5", 0.5, False),
        ("Final score = 1/2", 0.5, False),
        ("score: 0\nlater text\nScore: 1.0", 1.0, False),  # the last score line wins
        # With a "## Score" section, the verdict is read from it: a score line above it is in the analysis.
        ("## Analysis\nScore: 1 would need step 2 to hold; it does not.\n\n## Score\n\\boxed{0}", 0.0, False),
        ("## Analysis\nScore: 1 would need step 2 to hold.\n\n## Score\nThe solution has a fatal error.", None, False),
        ("## Analysis\nScore: 1 would need step 2.\n\n## Score\nScore: 0", 0.0, False),
        ("### Score: 0.5", 0.5, False),
        ("## Score\n\\boxed{0.5}", 0.5, False),
        # The section holds its grade alone below the heading, without the "Score:" label.
        ("## Analysis\nStep 2 has a gap.\n\n## Score\n0.5", 0.5, False),
        ("## Analysis\nAll steps hold.\n## Score\n**1**\n", 1.0, False),
        ("## Score (0 to 1)\n$1/2$", 0.5, False),
        ("## Score\n1 if every step holds", None, False),  # prose, not a grade
        ("## Score\nThe solution is fully correct.\n1", None, False),
        ("Score: \\boxed{0}", 0.0, False),
        ("Score: 0.5/1", 0.5, False),  # a decimal grade out of 1
        ("**Score:** 0.5 / 1", 0.5, False),
        ("Score: 1.0/1.0", 1.0, False),
        ("Score: 1/0", None, False),
        ("Score: 0.8", 1.0, True),
        ("Score: 0.25", 0.0, True),  # ties go down
        ("Score: 7", None, False),
        # A decimal comma: not 0 followed by prose.
        ("Score: 0,5", 0.5, False),
        ("**Score:** 0,5 / 1", 0.5, False),
        ("Score: 10,5", None, False),
        ("Score: 1 means fully correct.\nStep 2 has a gap.\nScore: 0,5", 0.5, False),
        ("Score: 1, as every step holds", 1.0, False),
        ("The solution looks right.", None, False),
        ("", None, False),
    ],
)
def test_verification_scores(text: str, score: float | None, snapped: bool) -> None:
    parsed = parse_verification(text)
    assert parsed.score == score and parsed.snapped == snapped
    assert parsed.effective_score == (score or 0.0)


@pytest.mark.parametrize(
    ("text", "score"),
    [
        # Cut mid-analysis after restating the scale: that line is no verdict.
        ("Step 1 holds.\nScore: 1 means fully correct, so check step 2.\nStep 2 divides by", None),
        ("## Score\n\\boxed{1} if every step holds; \\boxed{0} if one fails.\nStep 2 divides by", None),
        # The last line restates the scale where the cut went through it.
        ("Step 2 divides by zero.\nThe rubric gives\nScore: 1 when", None),
        # A score line the cut went through: "Score: 1/2" and "Score: 0.5" cut after their first character.
        ("Step 2 divides by zero.\nScore: 1", None),
        ("Step 2 divides by zero.\nScore: 0", None),
        ("## Analysis\nAll steps hold.\n## Score\n\\boxed{1}", None),
        # A JSON object that parsed whole, the cut in the blank lines a constrained server let follow it.
        ('{"analysis": "Score: 0 would fit a wrong step; none is.", "score": 1}\n\n\n', 1.0),
    ],
)
def test_a_cut_verification_is_scored_only_from_a_whole_json_object(text: str, score: float | None) -> None:
    # A reply cut at max_tokens had not stopped: its last line is unfinished (or more was to follow it).
    assert parse_verification(text, truncated=True).score == score


def test_solution_parsing_by_mode() -> None:
    text = "Thinking.\n\n## Solution\nWe get $x = 2$, so the answer is \\boxed{\\frac{1}{2}}."
    numeric = parse_solution(text, "numeric")
    assert numeric.answer == "\\frac{1}{2}" and numeric.has_section and numeric.text == text.strip()
    proof = parse_solution(text, "proof")
    assert proof.answer is None and proof.text.startswith("We get")
    stated = parse_solution("The answer is 4.", "numeric")  # no box: the explicit statement
    assert (stated.answer, stated.extraction) == ("4", "stated")
    assert parse_solution("It is roughly four hundred", "numeric").answer is None


def test_solution_prompts_carry_the_paper_instructions() -> None:
    gen = generation_prompt("Find T_4.", "numeric")
    assert gen[0].role == "system" and "## Solution" in gen[1].content and "\\boxed{}" in gen[1].content
    assert "<problem>\nFind T_4.\n</problem>" in gen[1].content
    assert "\\boxed" not in generation_prompt("Prove it.", "proof")[1].content
    bank = ExperienceBank(
        entries=[
            ExperienceEntry(id="E1", kind="anchor", subtype="intermediate_result", content="T(2) = 3"),
            ExperienceEntry(id="E2", kind="heuristic", content="do not assume vertical tiles only"),
        ]
    )
    fit = fit_rollouts([Rollout(index=0, solution="sol A", summary="sum A", score=0.5)])
    refine = refine_prompt("Find T_4.", "numeric", fit.views, bank)[1].content
    assert '<rollout number="1" mean_verifier_score="0.5">' in refine and "sum A" in refine
    assert "[E1] (intermediate result) T(2) = 3" in refine and "[E2] do not assume" in refine
    assert "<experience>" not in refine_prompt("Q", "numeric", fit.views, None)[1].content
    explore = explore_prompt(
        "Q", "numeric", [Strategy(id="G1", description="recurrence", first_iteration=0, last_iteration=0)]
    )
    assert "- [G1] recurrence" in explore[1].content and "fundamentally different" in explore[1].content


def test_problem_text_is_data_not_template() -> None:
    assert "{{ mode }}" in generation_prompt("What is {{ mode }}?", "numeric")[1].content


def test_summary_sections() -> None:
    text = "## Validated Steps\n- base case\n- recurrence\n\n## Remaining Flaws\n- none found\n\n## Verdict\nCorrect."
    summary = parse_summary(text)
    assert summary.structured and summary.validated == ["base case", "recurrence"] and summary.flaws == []
    assert summary.verdict == "Correct."
    assert not parse_summary("Looks fine overall.").structured
    with pytest.raises(AgentOutputError):
        parse_summary("  ")


def test_json_extraction() -> None:
    assert extract_json_object('x ```json\n{"a": 1}\n``` y ```json\n{"a": 2}\n```') == {"a": 2}
    assert extract_json_object('prefix {"a": {"b": 1}} suffix') == {"a": {"b": 1}}
    for bad in ("", "no json", '```json\n{"a": \n```', "[1, 2]"):
        with pytest.raises(AgentOutputError):
            extract_json_object(bad)


def test_latex_in_json_strings_is_read_as_latex() -> None:
    # As a model writes it: one backslash a command. "\f", "\b", "\t", "\n" and "\r" are JSON escapes, so these
    # decode into control characters unless written back; "\sum" and "\cdot" are no escapes at all.
    written = r'{"a": "$\frac{1}{2} \times \binom{4}{2} \neq x \rightarrow \theta \to y$", "b": ["\boxed{3}"]}'
    assert extract_json_object(written) == {
        "a": "$\\frac{1}{2} \\times \\binom{4}{2} \\neq x \\rightarrow \\theta \\to y$",
        "b": ["\\boxed{3}"],
    }
    assert extract_json_object(r"```json" + "\n" + r'{"a": "\sum_{k} k \cdot 2 = \frac{n}{2}"}' + "\n```") == {
        "a": "\\sum_{k} k \\cdot 2 = \\frac{n}{2}"
    }
    assert extract_json_object(r'The JSON: {"a": "\sum_k \binom{n}{k}"} done') == {"a": "\\sum_k \\binom{n}{k}"}
    # Escapes meant as escapes stay: newlines and tabs before words that end no command, an escaped backslash,
    # a quote, a code point.
    meant = r'{"a": "Step 1.\nThe sum\tis 3.\nequals\nnot\\times \"q\" \u00e9\nmid-way\tan"}'
    assert extract_json_object(meant) == {"a": 'Step 1.\nThe sum\tis 3.\nequals\nnot\\times "q" é\nmid-way\tan'}
    # The verifier's JSON reply: its analysis is the feedback later prompts show.
    scored = parse_verification(r'{"analysis": "Uses \binom{5}{2} \times 2 correctly.", "score": 1}')
    assert scored.feedback == "Uses \\binom{5}{2} \\times 2 correctly." and scored.score == 1.0


def test_json_strings_broken_over_lines_are_read() -> None:
    # Unconstrained, a model writes a long string of its JSON over several lines, its line breaks and tabs as they
    # are, not escaped: JSON forbids them inside a string, but the object means one thing.
    analysis = "Step 1 holds.\nStep 2 divides by zero:\n\tthe case x = 0 is lost."
    bare = '{"analysis": "' + analysis + '", "score": 0}'
    reply = f"```json\n{bare}\n```"
    assert extract_json_object(reply) == {"analysis": analysis, "score": 0}
    assert extract_json_object(f"The verdict:\n{bare}\nDone.") == {"analysis": analysis, "score": 0}
    verification = parse_verification(reply)
    assert (verification.score, verification.feedback) == (0.0, analysis)
    heuristic = "Do not divide by x\nbefore x = 0 is ruled out."
    update = parse_experience_update(
        '{"operations": [{"op": "ADD", "kind": "heuristic", "content": "' + heuristic + '"}]}'
    )
    assert [op.content for op in update.operations] == [heuristic]


def test_json_with_trailing_commas_is_read_and_not_from_an_object_inside_it() -> None:
    # A comma before a closing bracket or brace is read as JSON without it, in a string or not.
    assert extract_json_object('```json\n{"analysis": "a, b", "score": 4,}\n```') == {"analysis": "a, b", "score": 4}
    assert extract_json_object('Verdict: {"a": [1, 2,], "b": "x,]"}') == {"a": [1, 2], "b": "x,]"}
    # Before, the object holding the trailing comma did not parse and the one inside it was taken as the reply's.
    assert extract_json_object('{"score": 2, "detail": {"score": 5},}') == {"score": 2, "detail": {"score": 5}}
    update = parse_experience_update('{"operations": [{"op": "KEEP", "id": "E1"}, {"op": "DELETE", "id": "E2"},]}')
    assert [(op.op, op.id) for op in update.operations] == [("KEEP", "E1"), ("DELETE", "E2")]
    assert parse_verification('{"analysis": "Step 2 fails.", "score": 0,}').score == 0.0


def test_experience_update_parsing() -> None:
    update = parse_experience_update(
        '```json\n{"operations": [{"op": "keep", "id": "E1"}, {"op": "MERGE"},'
        ' {"op": "ADD", "kind": "anchor", "content": "c"}]}\n```'
    )
    assert [op.op for op in update.operations] == ["KEEP", "ADD"] and len(update.malformed) == 1
    assert parse_experience_update('{"operations": []}').operations == []
    for bad in ('{"ops": [{"op": "NOPE"}]}', '{"entries": []}', "not json"):
        with pytest.raises(AgentOutputError):
            parse_experience_update(bad)
    with pytest.raises(AgentOutputError, match="truncated"):
        parse_experience_update('{"operations": []}', truncated=True)


@pytest.mark.parametrize(
    ("max_entries", "target"),
    [
        (35, "Aim for 20 to 35 entries"),  # the default: appendix D's target
        (None, "Aim for 20 to 35 entries"),  # the paper preset: appendix D's target alone, no limit named
        (25, "Aim for 20 to 25 entries"),
        (10, "Aim for at most 10 entries"),  # a bank capped below the target is never asked for 20
    ],
)
def test_the_experience_prompts_size_target_fits_the_banks_cap(max_entries: int | None, target: str) -> None:
    text = experience_prompt("Q", [], ExperienceBank(), max_entries)[-1].content
    assert target in text
    if max_entries is None:
        assert "Entries you do not mention are kept." in text and "holds at most" not in text
    else:
        assert f"the bank holds at most {max_entries}." in text
    if max_entries is not None and max_entries < 20:
        assert "20 to" not in text


def test_guideline_update_parsing() -> None:
    update = parse_guideline_update('{"rollouts": [{"rollout": 1, "strategy": "s", "novelty": "1"}, {"rollout": 2}]}')
    assert update.items[0].novelty == 1 and len(update.malformed) == 1
    for bad in ('{"rollouts": []}', '{"rollouts": "x"}', ""):
        with pytest.raises(AgentOutputError):
            parse_guideline_update(bad)


def test_fit_rollouts_top_k_and_budget() -> None:
    rollouts = [Rollout(index=i, solution="x" * 2000, summary="s", score=s) for i, s in enumerate((0.0, 1.0, 0.5))]
    assert fit_rollouts(rollouts).shown == [0, 1, 2]
    top = fit_rollouts(rollouts, top_k=2)
    assert top.shown == [1, 2] and top.left_out == [0] and [v.number for v in top.views] == [2, 3]
    # 3 * (1 + 120) fixed characters; (3000 - 363) // 3 = 879 >= 600 each: all kept, each cut to 879 characters.
    cut = fit_rollouts(rollouts, budget_chars=3000)
    assert cut.shown == [0, 1, 2] and cut.cut_chars == {0: 1121, 1: 1121, 2: 1121}
    assert "characters omitted" in cut.views[0].solution
    # Too little room for three: the lowest score goes first.
    tight = fit_rollouts(rollouts, budget_chars=1500)
    assert tight.shown == [1, 2] and tight.left_out == [0]
