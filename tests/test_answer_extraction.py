"""Answer extraction: the last box, else an explicit final-answer statement, recorded as a fallback."""

from __future__ import annotations

import pytest

from tmas.agents.solution import parse_solution
from tmas.answers import extract_answer
from tmas.grading.grades import Item
from tmas.grading.rules import RulesGrader
from tmas.problems import Problem


@pytest.mark.parametrize(
    ("text", "answer", "source"),
    [
        ("2 + 2 = 4, so \\boxed{4}.", "4", "boxed"),
        ("First \\boxed{3}, corrected: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
        # A box is the final answer unless the reply then states another as final: an intermediate value boxed, the
        # answer stated after it.
        ("A boxed step: \\boxed{9}.\nFinal answer: 4", "4", "stated"),
        ("So $a = \\boxed{3}$, and $b = 2a + 1 = 7$.\n\nThe final answer is 7.", "7", "stated"),
        ("We get \\boxed{3} for a.\n\n**Final Answer:** $7$", "7", "stated"),
        ("We get \\boxed{3} for a, so b = 7.\n\nHence the answer is 7.", "7", "stated"),  # as the last line
        ("\\boxed{3}\nFinal Answer: The final answer is $7$. I hope it is correct.", "7", "stated"),
        ("\\boxed{3}\nFinal answer: 7\nIf the pairs were ordered, the answer is 14.\nThey are not.", "7", "stated"),
        # A statement before the box, or one that is no final answer, leaves the box the answer.
        ("Final answer: 4\n\nOn checking, \\boxed{9}", "9", "boxed"),
        ("Final answer: \\boxed{9}. Then we are done.", "9", "boxed"),
        ("\\boxed{9}\nIf the pairs were ordered, the answer is 18.\nThey are not.", "9", "boxed"),
        ("\\boxed{9}\n\nFinal answer: as boxed above.", "9", "boxed"),
        ("\\boxed{9}\n\nNote: the first attempt's final answer: 12 was wrong.", "9", "boxed"),  # another's answer
        ("\\boxed{9}\n\nWe checked that the answer is 12 for n = 2.", "9", "boxed"),
        ("\\boxed{12}\n\nThe answer is 12 because each pair counts once.", "12", "boxed"),  # the box, explained
        ("\\boxed{7}\n\nFinal answer: 7", "7", "boxed"),  # the box restated
        ("\\boxed{9}\n\nThe answer is that we must check the parity of n first.", "9", "boxed"),  # a sentence
        # The box itself: nested braces, text after it, several boxes of which the last counts.
        ("\\boxed{\\frac{1}{\\sqrt{2}}} is what we get, and we stop here.", "\\frac{1}{\\sqrt{2}}", "boxed"),
        # Literal braces group nothing: a case split opened with "\\left\\{" and closed with "\\right.", a set, a brace.
        (
            "So \\boxed{f(x) = \\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & \\text{else} \\end{array} \\right.}",
            "f(x) = \\left\\{ \\begin{array}{ll} x & x > 0 \\\\ 0 & \\text{else} \\end{array} \\right.",
            "boxed",
        ),
        ("\\boxed{\\{1, 2\\}} in all", "\\{1, 2\\}", "boxed"),
        # A box inside a box is the outer box's answer, unboxed: no second answer joined to it.
        ("So \\boxed{\\boxed{4}}.", "4", "boxed"),
        ("\\boxed{x = \\boxed{4}}", "x = 4", "boxed"),
        ("\\boxed{3} and \\boxed{\\boxed{4}}", "3, 4", "boxed"),
        ("\\boxed{\\begin{matrix} 1 \\\\{2} \\end{matrix}} in all", "\\begin{matrix} 1 \\\\{2} \\end{matrix}", "boxed"),
        ("Step: \\boxed{2}. Step: \\boxed{5}.\n\nSo the result is \\boxed{\\{1, 2\\}}", "\\{1, 2\\}", "boxed"),
        ("So 2 + 2 = 4.\nFinal answer: 4", "4", "stated"),
        ("Hence the answer is $\\frac{1}{2}$.", "\\frac{1}{2}", "stated"),
        ("**Final Answer:** 42", "42", "stated"),
        # The emphasis closed before the colon.
        ("**Final Answer**: 42", "42", "stated"),
        ("**Answer**: $\\frac{1}{2}$", "\\frac{1}{2}", "stated"),
        ("\\boxed{3}\n\n**Final Answer**: 7", "7", "stated"),
        ("The final answer is: 12", "12", "stated"),
        ("Answer: 3\nOn reflection, the answer is 5.", "5", "stated"),  # the last statement counts
        ("An empty box \\boxed{} is no answer. The answer is 7", "7", "stated"),
        ("We answer this with care.", None, "none"),  # "answer" in prose is not a statement
        ("I will answer: no idea", None, "none"),
        ("The value is 6 and then we stop.", None, "none"),
        ("The answer is that we must first look at the parity of n.", None, "none"),  # a sentence, not an answer
        ("Final answer: x = 3, y = -1", "x = 3, y = -1", "stated"),
        # LaTeX's math delimiters, like '$', are no part of a stated answer.
        ("Hence the answer is \\(\\frac{1}{2}\\).", "\\frac{1}{2}", "stated"),
        ("The final answer is \\[ 12 \\]", "12", "stated"),
        ("Final answer: \\(x = 3\\), \\(y = -1\\)", "x = 3, y = -1", "stated"),
        # An answer in '$' ending its sentence, with more on the line.
        ("Final Answer: The final answer is $\\frac{5}{8}$. I hope it is correct.", "\\frac{5}{8}", "stated"),
        ("The final answer is $11$. Final answer: $13$. That is all.", "13", "stated"),
        ("The answer is $x$. Then we compute the rest.", None, "none"),  # a step of the work, maybe
        # Boxes joined into one final statement are one answer: alternatives offered, or a list.
        ("So $\\boxed{4}$ or $\\boxed{3}$.", "4 or 3", "boxed"),
        ("\\boxed{4} (or maybe \\boxed{3})", "4 or 3", "boxed"),
        ("\\boxed{3} \\text{ or possibly } \\boxed{4}", "3 or 4", "boxed"),
        ("Hence $\\boxed{1}$, $\\boxed{2}$ and $\\boxed{5}$.", "1, 2, 5", "boxed"),
        ("\\boxed{3}\n\\boxed{4}", "3, 4", "boxed"),
        ("So \\boxed{3}, that is \\boxed{3}", "3", "boxed"),
        # The same in LaTeX's own math delimiters, \( \) and \[ \], as much as in '$'.
        ("So \\(\\boxed{4}\\) or \\(\\boxed{3}\\).", "4 or 3", "boxed"),
        ("Hence \\(\\boxed{1}\\), \\(\\boxed{2}\\) and \\(\\boxed{5}\\).", "1, 2, 5", "boxed"),
        ("\\[\\boxed{3}\\]\n\\[\\boxed{4}\\]", "3, 4", "boxed"),
        # The solutions of one unknown, each named: its values, as a list or as alternatives.
        ("So $x = \\boxed{-\\frac{7}{2}}$ or $x=\\boxed{\\frac{5}{9}}$.", "-\\frac{7}{2} or \\frac{5}{9}", "boxed"),
        ("\\(x_1 = \\boxed{2}\\) and \\(x_2 = \\boxed{6}\\)", "2, 6", "boxed"),
        ("n=\\boxed{3} \\text{ or } n=\\boxed{8}", "3 or 8", "boxed"),
        # Values of different unknowns, or a name inside a word, are not joined: the last box counts.
        ("$a = \\boxed{3}$ and $S = \\boxed{12}$", "12", "boxed"),
        ("$ax = \\boxed{3}$ and $x = \\boxed{12}$", "12", "boxed"),
        ("x = \\boxed{3}\n\nx = \\boxed{4}", "4", "boxed"),
        # Boxes apart (a blank line, words between them, parts of a question) are not joined: the last one counts.
        ("\\boxed{3}\n\nOn reflection: \\boxed{4}", "4", "boxed"),
        ("\\boxed{3}\n\n\\boxed{4}", "4", "boxed"),
        ("\\boxed{3} \\text{ corrected to } \\boxed{4}", "4", "boxed"),
        ("(a) \\boxed{5} (b) \\boxed{7}", "7", "boxed"),
        ("We tried \\(\\boxed{3}\\).\n\nSo \\(\\boxed{4}\\)", "4", "boxed"),
        ("\\[\\boxed{3}\\]\n\n\\[\\boxed{4}\\]", "4", "boxed"),
    ],
)
def test_extraction_falls_back_to_an_explicit_statement(text: str, answer: str | None, source: str) -> None:
    assert extract_answer(text) == (answer, source)


def test_solution_parser_records_the_extraction() -> None:
    boxed = parse_solution("## Solution\n17*23 = 391, so \\boxed{391}", "numeric")
    stated = parse_solution("17*23 = 391.\nThe answer is 391.", "numeric")
    nothing = parse_solution("I would write a program for this.", "numeric")
    proof = parse_solution("## Solution\nBy induction. The answer is 3.", "proof")
    assert (boxed.answer, boxed.extraction) == ("391", "boxed")
    assert (stated.answer, stated.extraction) == ("391", "stated")
    assert (nothing.answer, nothing.extraction) == (None, "none")
    assert (proof.answer, proof.extraction) == (None, "none")  # proofs have no answer to extract


def test_a_reply_boxing_alternatives_is_graded_wrong_against_one_number() -> None:
    pytest.importorskip("math_verify")
    problem = Problem(problem_id="p", question="Find n.", answer="3")
    listed = Problem(problem_id="q", question="Find all n.", answer="3, 4")
    hedged = "So $\\boxed{4}$ or $\\boxed{3}$."
    grader = RulesGrader()
    assert grader.grade_one(Item(("p", 0, 0), problem, extract_answer(hedged).answer, hedged)) is False
    assert grader.grade_one(Item(("q", 0, 0), listed, extract_answer(hedged).answer, hedged)) is True
    both = "The solutions are $\\boxed{4}$ and $\\boxed{3}$."
    assert grader.grade_one(Item(("q", 0, 0), listed, extract_answer(both).answer, both)) is True
    # The roots of an equation, each named: both are the answer, not the last alone (a judge shown only "4" of a
    # reference "3, 4" says it differs).
    roots = "Hence $x = \\boxed{4}$ or $x = \\boxed{3}$."
    assert grader.grade_one(Item(("q", 0, 0), listed, extract_answer(roots).answer, roots)) is True
    assert grader.grade_one(Item(("p", 0, 0), problem, extract_answer(roots).answer, roots)) is False


def test_the_question_says_whether_a_listed_reference_may_come_in_any_order() -> None:
    pytest.importorskip("math_verify")
    swapped = "So $x = \\boxed{9}$, that is the pair $\\boxed{9, -1}$."
    grader = RulesGrader()
    every = Problem(problem_id="a", question="Find all integers n with n^2 - 8n = 9.", answer="-1, 9")
    pair = Problem(problem_id="b", question="Find the ordered pair (x, y) with x + y = 8 and x y = -9.", answer="-1, 9")
    answer = extract_answer(swapped).answer
    assert answer == "9, -1"
    # All solutions: a set, right in any order. An ordered pair: the other order is left to the judge.
    assert grader.grade_one(Item(("a", 0, 0), every, answer, swapped)) is True
    assert grader.grade_one(Item(("b", 0, 0), pair, answer, swapped)) is None
