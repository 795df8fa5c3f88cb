"""Grading: Math-Verify equivalences (in worker processes), the LLM judge over HTTP, combined mode and reuse."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from conftest import scripted_settings
from scripted_runs import scripted_run
from tmas.answer_rules import RuleChecker, asks_for_all, check_pair, exact_value
from tmas.grading.grader import GradingContext
from tmas.grading.grades import SELECTED, GradeConfig, Grades, Item
from tmas.grading.judge import judge_once, parse_judge_reply
from tmas.grading.rules import RulesGrader
from tmas.grading.run_results import load_results
from tmas.grading.runs import grade_run, load_grades
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.testing import Rule, ScriptedModel, SimScript

pytest.importorskip("math_verify")

# The equivalences the paper's judge prompt lists (000_*.txt items [1]-[5]), gold first.
EQUIVALENT = [
    ("0.5", "1/2"),
    ("1000", "1,000"),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("x+1", "1+x"),
    ("10", "\\text{10}"),
    ("10", "10 \\text{ cm}"),
    ("\\frac{2}{7}", "2/7"),
]


async def test_math_verify_equivalences_in_a_process_pool() -> None:
    async with RuleChecker(workers=2) as checker:
        for gold, pred in EQUIVALENT:
            verdict = await checker.check(gold, pred)
            assert verdict.correct is True, (gold, pred, verdict)
        assert (await checker.check("12", "6")).correct is False
        # Unequal non-numeric answers are left to the judge rather than called wrong.
        assert (await checker.check("\\text{all odd } n", "n")).correct is None


def test_unparseable_answers_are_undecided() -> None:
    assert check_pair("5", "").correct is None


def test_a_full_stop_enclosing_dollars_and_thin_spaces_do_not_change_the_value() -> None:
    # A full stop once cut an expression short ("3^{10} \\cdot 7!." read as 7) and made a right answer a "different
    # number"; a reference written "$...$." was not read at all; "12\\,345" was read as 12 * 345.
    assert check_pair("3^{10} \\cdot 7!", "3^{10} \\cdot 7!.").correct is True
    assert check_pair("\\sqrt{\\frac{5}{3}}", "\\sqrt{\\frac{5}{3}}.").correct is True
    assert check_pair("$\\left\\lceil \\log_{3} n\\right\\rceil - 1$.", "\\lceil \\log_3 n \\rceil - 1").correct is True
    assert check_pair("12345", "12\\,345").correct is True
    assert check_pair("1234567", "1\\,234\\,567").correct is True
    assert check_pair("12345", "12\\,346").correct is False
    assert check_pair("40", "40.").correct is True


def test_an_angle_with_a_degree_sign_is_its_number_of_degrees() -> None:
    # Math-Verify reads 40^\\circ and "40 degrees" but not the sign models also write (40°, 40\\degree): such a
    # right answer was left undecided.
    for pred in ("40°", "40 °", "40\\degree", "40\\textdegree", "\\angle ABC = 40°.", "40^\\circ"):
        assert check_pair("40", pred).correct is True, pred
        assert check_pair("40^\\circ", pred).correct is True, pred
    assert check_pair("40", "41°").correct is False
    assert check_pair("90 - \\theta", "90° - \\theta").correct is True


def test_signs_of_plain_text_are_read_as_their_latex() -> None:
    # A right answer with a middle dot was a "different number"; roots and infinity in plain text were undecided.
    assert check_pair("3^{7} \\cdot 5!", "3^{7} \u00b7 5!").correct is True
    assert check_pair("3^{7} \\cdot 5!", "3^{7} \u22c5 5!").correct is True
    assert check_pair("3^{7} \\cdot 5!", "3^{6} \u00b7 5!").correct is False
    assert check_pair("6\\sqrt{7}", "6\u221a7").correct is True
    assert check_pair("6\\sqrt{7}", "6\u221a8").correct is False
    assert check_pair("\\sqrt{k+2}", "\u221a(k+2)").correct is True
    assert check_pair("\\frac{5\\sqrt{3}}{3}", "5/\u221a3").correct is True
    assert check_pair("[2, \\infty)", "[2, \u221e)").correct is True


def test_digit_groups_apart_by_a_space_are_one_number_whatever_the_reference_spelling() -> None:
    # "4 302 117" was right against "4302117" (equal spellings) but a "different number" against "4,302,117":
    # Math-Verify read the spaces as products.
    for gold in ("4302117", "4,302,117", "4{,}302{,}117", "4\\,302\\,117", "4 302 117"):
        for pred in ("4 302 117", "4~302~117", "4\\ 302\\ 117"):
            assert check_pair(gold, pred).correct is True, (gold, pred)
        # "4,302,117" reads also as the list "4, 302, 117", which one other number is not either: wrong.
        assert check_pair(gold, "4 302 118").correct is False
    # LaTeX's thousands separator after a name: "N = 4{,}302{,}117" was read as a list, undecided.
    assert check_pair("4302117", "N = 4{,}302{,}117").correct is True
    assert check_pair("4,302,117", "N = 4{,}302{,}117").correct is True
    # Only groups of three digits: a space elsewhere is still a product.
    assert check_pair("6", "2 3").correct is False


def test_a_reference_in_words_is_left_to_the_judge() -> None:
    # Math-Verify reads one formula of a sentence at most: it took the case "b=2" of this reference for all of it,
    # and one part of a multi-part reference for the whole answer.
    cases = "$b^2 + 2b$ ( $b \\ge 3$)\n1 ($b=2$)"
    assert check_pair(cases, "b = 2").correct is None
    assert check_pair("(i) No; (ii) \\( \\binom{m+1}{2} \\)", "\\binom{m+1}{2}").correct is None
    assert check_pair("$q(x)=x^2+c$ for some constant $c$", "q(x) = x^2 + c").correct is None
    # The same answer in another spelling is still right without the judge.
    assert check_pair(cases, "$b^2 + 2b$ ( $b \\ge 3$) 1 ($b=2$).").correct is True
    assert check_pair("odd $n$", "\\text{odd} $n$").correct is True


def test_digits_with_leading_zeros_are_not_read_as_their_value() -> None:
    # The rows of a grid, a code: Math-Verify read 0110 as 110 and the list as a set, so rows dropped of their zeros
    # or given in another order were right.
    assert check_pair("0110,1001", "110,1001").correct is None
    assert check_pair("0110,1001", "1001, 0110").correct is None
    assert check_pair("007", "7").correct is None
    # The same digits in another spelling are right without the judge; decimals keep their value.
    assert check_pair("0110,1001", "0110, 1001").correct is True
    assert check_pair("0110,1001", "$\\text{0110,1001}$.").correct is True
    assert check_pair("0.25", "\\frac{1}{4}").correct is True
    assert check_pair("1024", "1{,}024").correct is True
    assert check_pair("1,024", "1024").correct is True
    assert check_pair("1{,}024", "1,024").correct is True
    assert check_pair("2\\,048", "2048").correct is True
    assert check_pair("2.5E-05", "0.000025").correct is True


def test_the_rules_say_no_only_between_two_numbers() -> None:
    assert check_pair("12", "6").correct is False
    # A number against an expression, either way round: the rules may miss an equality between them, so they leave
    # it undecided (for the judge in combined mode) rather than call it wrong.
    assert check_pair("x+1", "5").correct is None
    assert check_pair("5", "x+1").correct is None


def test_an_answer_offering_alternatives_is_no_answer_to_one_number() -> None:
    # Math-Verify read "4 (or 3)" and "4 \vee 3" as 3, and "4 \text{ (maybe 3)}" as 3: each hedge was right.
    for hedged in ("4 (or 3)", "4 \\vee 3", "3 \\text{ (maybe 4)}", "x = 3, but possibly 4", "3 or 4", "3, 4"):
        verdict = check_pair("3", hedged)
        assert verdict.correct is False, hedged
        assert verdict.detail == "several different answers where the reference is one number"
    # The same answer twice is one answer; alternatives that make up a listed reference, in its order, are that list
    # (in another order they are left undecided, as a list is: see the test below).
    assert check_pair("3", "3 (or equivalently \\frac{6}{2})").correct is True
    assert check_pair("3, 4", "3 or 4").correct is True
    assert check_pair("3, 4", "x = 3 \\text{ or } x = 4").correct is True
    assert check_pair("$n=2k, n=3k$", "n = 2k or n = 3k").correct is True
    assert check_pair("-\\dfrac{5}{12}, \\dfrac{7}{9}", "-\\frac{5}{12} \\text{ or } \\frac{7}{9}").correct is True
    assert check_pair("3, 4", "4 or 3").correct is None


def test_a_bare_list_in_another_order_is_left_undecided() -> None:
    # A reference written as a bare list may be a set ("all n: 2, 7, 11") or a sequence (an ordered pair, the answers
    # to two questions in turn): Math-Verify reads it as a set, so "11, 7, 2" was right even where order mattered.
    # The rules now accept the reference's own order and leave any other to the judge, which reads the problem.
    reordered = "not the reference's items in its order: the rules cannot tell whether the order matters"
    for other_order in ("11, 7, 2", "7, 2, 11", "\\{11, 7, 2\\}", "(11, 7, 2)", "a = 11, b = 7, c = 2"):
        verdict = check_pair("2, 7, 11", other_order)
        assert verdict.correct is None, other_order
        assert verdict.detail == reordered
    assert check_pair("-\\dfrac{3}{8}, \\dfrac{5}{6}", "\\frac{5}{6}, -\\frac{3}{8}").detail == reordered
    # Each item as often as the reference has it: "2, 2, 5" is not "2, 5".
    assert check_pair("2, 2, 5", "2, 5").correct is None
    # The reference's order, however spelt, is still right.
    for same_order in ("2,7,11", "(2, 7, 11)", "\\{2, 7, 11\\}", "a = 2, b = 7, c = 11", "\\left(2, 7, 11\\right)"):
        assert check_pair("2, 7, 11", same_order).correct is True, same_order
    assert check_pair("-\\dfrac{3}{8}, \\dfrac{5}{6}", "-3/8, 5/6").correct is True
    # A reference in set braces has no order; a tuple's other order is, as before, not shown equal.
    assert check_pair("\\{2, 7, 11\\}", "11, 7, 2").correct is True
    assert check_pair("\\left\\{2, 7\\right\\}", "7, 2").correct is True
    assert check_pair("(2, 7, 11)", "(11, 7, 2)").correct is None
    assert check_pair("2, 7, 11", "2, 7, 12").correct is not True
    # A question asking for all of something makes its bare-list reference a set.
    assert check_pair("2, 7, 11", "11, 7, 2", any_order=True).correct is True
    assert check_pair("2, 7, 11", "11, 7, 12", any_order=True).correct is not True
    assert asks_for_all("Find all primes p such that p + 2 is prime.")
    assert asks_for_all("Determine all possible values of the sum.")
    assert not asks_for_all("Compute the ordered pair (x, y) such that the identity holds for all real t.")
    # Nor has a pair a sign makes: "\\pm 3" is 3 and -3 in any order.
    assert check_pair("\\pm 3", "3, -3").correct is True
    assert check_pair("1 \\pm \\sqrt{5}", "1 - \\sqrt{5}, 1 + \\sqrt{5}").correct is True
    assert check_pair("3", "\\{3\\}").correct is True


def test_huge_numbers_are_compared_by_value() -> None:
    # Math-Verify rounds the difference of two numbers at 15 digits of its largest term: 4^{2024} swamped it.
    gold = "\\dfrac{4^{2024}}{\\binom{4048}{2024}}-2"
    for wrong in ("\\dfrac{4^{2025}}{\\binom{4048}{2024}}-2", "\\dfrac{5^{2024}}{\\binom{4048}{2024}}-2"):
        verdict = check_pair(gold, wrong)
        assert verdict.correct is False, wrong
        assert verdict.detail == "the values differ (math-verify rounded their difference away)"
        assert check_pair(gold, f"{gold} \\text{{ or }} {wrong}").correct is False
    assert check_pair(gold, "\\frac{2^{4048}}{\\binom{4048}{2024}}-2").correct is True
    # A number that is not built exactly (a root) is compared at 30 digits.
    assert check_pair("\\frac{2^{2024}}{3^{1000}}+\\sqrt{2}", "\\frac{2^{2025}}{3^{1000}}+\\sqrt{2}").correct is False
    assert check_pair("2^{25} \\cdot 26!", str(2**25 * 403291461126605635584000000)).correct is True
    # Rounded decimals and percentages keep Math-Verify's reading.
    assert check_pair("\\frac{1}{3}", "0.333333").correct is True
    assert check_pair("60\\%", "60").correct is True


def test_letters_ending_an_expression_are_unknowns_not_units() -> None:
    # Math-Verify drops letters it takes for a unit: it read "2-2m" as 2-2, so 0 "equalled" the reference 2-2m.
    assert check_pair("$2-2m$", "0").correct is not True
    assert check_pair("$2-2m$", "2-2d").correct is not True
    assert check_pair("2 - 2 \\cdot m", "2").correct is not True
    assert check_pair("0", "2-2m").correct is not True
    assert check_pair("$2-2m$", "-2m+2").correct is True
    assert check_pair("$2-2m$", "2(1-m)").correct is True
    assert check_pair("3s", "3").correct is not True
    # After a number alone, against a numeric reference, they are still a unit.
    assert check_pair("12", "12 cm").correct is True
    assert check_pair("3", "3 m").correct is True
    assert check_pair("\\frac{1}{2}", "\\frac{1}{2} m").correct is True


def test_scientific_notation_against_a_number_is_not_eulers_number() -> None:
    # Math-Verify read "1e-3" as e - 3 and "1e5" as 5e, so programs' spelling of a right number was graded wrong.
    assert check_pair("0.001", "1e-3").correct is True
    assert check_pair("100000", "1e5").correct is True
    assert check_pair("0.000025", "2.5e-05").correct is True
    assert check_pair("602000000000000000000000", "6.02e23").correct is True
    assert check_pair("10^{70840}", "1e70840").correct is True
    assert check_pair("\\frac{1}{3}", "3.33333e-1").correct is True  # rounded as its decimal spelling is
    assert check_pair("0.000025", "2.5e-04").correct is False
    assert check_pair("10^{70840}", "1e70841").correct is False
    # Against a reference with letters, e is Euler's number.
    assert check_pair("2e-1", "0.2").correct is not True


def test_a_decimal_times_a_power_of_ten_keeps_all_its_digits() -> None:
    # Math-Verify reads the decimal as a float, whose product with the power missed the integer: "1.23456789 \\times
    # 10^{8}" was a "different number" from 123456789, which it is.
    for pred in (
        "1.23456789 \\times 10^{8}",
        "1.23456789 \\cdot 10^8",
        "1.23456789\\times10^{8}",
        "1.23456789 × 10^{8}",
    ):
        assert check_pair("123456789", pred).correct is True, pred
        assert check_pair(pred, "123456789").correct is True, pred
    assert check_pair("0.000123456789", "1.23456789 \\times 10^{-4}").correct is True
    assert check_pair("123456789 \\cdot 10^{400}", "1.23456789 \\times 10^{408}").correct is True
    assert check_pair("123456789", "1.23456788 \\times 10^{8}").correct is False
    assert check_pair("123456789", "1.23 \\times 10^{8}").correct is False
    assert check_pair("123456789", "1.23456789 \\times 10^{7}").correct is False
    # A division before it binds first: 1/2.5 \\times 10^{2} is (1/2.5) \\times 100.
    assert check_pair("40", "1/2.5 \\times 10^{2}").correct is True


def test_a_comparison_that_runs_out_of_time_is_undecided_not_different() -> None:
    # Math-Verify answers "not equal" for a comparison it stopped at its time limit: that read as "different numbers".
    verdict = check_pair("2", "10^{10^{10}} - 10^{10^{10}} + 2", timeout_s=1)
    assert verdict.correct is None
    assert verdict.detail == "math-verify: timed out comparing (over 1 s)"


def test_exact_values_of_parsed_numbers() -> None:
    from sympy import Integer, Pow, Rational, binomial, factorial, pi, sqrt

    assert exact_value(Pow(Integer(4), Integer(3), evaluate=False) * Rational(1, 2)) == Fraction(32)
    assert exact_value(binomial(Integer(6), Integer(3), evaluate=False)) == Fraction(20)
    assert exact_value(factorial(Integer(5), evaluate=False)) == Fraction(120)
    assert exact_value(Pow(Integer(2), Integer(-2), evaluate=False)) == Fraction(1, 4)
    assert exact_value(sqrt(2)) is None and exact_value(pi) is None
    # Too large to build: left to Math-Verify.
    assert exact_value(Pow(Integer(2), Integer(10**8), evaluate=False)) is None
    assert exact_value(factorial(Integer(10**6), evaluate=False)) is None


async def test_an_item_without_an_answer_is_wrong_whatever_its_text(tmp_path: Path) -> None:
    problem = Problem(problem_id="a", question="What is 6*7?", answer="42")
    silent = Item(("a", 0, 0), problem, None, "")
    # Text without an extracted final answer: no answer to grade (it was undecided, left for a judge to read).
    worded = Item(("a", 0, 1), problem, None, "Six sevens make forty-two.")
    grader = RulesGrader()
    assert grader.grade_one(silent) is False and grader.grade_one(worded) is False
    config = GradeConfig(mode="rules")
    with RunStore(tmp_path / "run") as store:
        context = GradingContext(store, config, None, Grades(runs=1, mode="rules"), {})
        assert await grader.grade([silent, worded], context) == {silent.key: [False], worded.key: [False]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"reasoning": "same", "equivalent": true}', True),
        ('```json\n{"reasoning": "differ", "equivalent": false}\n```', False),
        ('Verdict: {"reasoning": "x", "equivalent": "true"} done', True),
        ("they are equal", None),
        ('{"reasoning": "no verdict"}', None),
        ('{"equivalent": 1}', None),
        # LaTeX with one backslash: "\sqrt" begins no JSON escape; the verdict is read all the same.
        (r'{"reasoning": "\sqrt{4} = 2 and \frac{4}{2} = 2", "equivalent": true}', True),
        # Reasoning over two lines, its line break written as it is.
        ('{"reasoning": "Both are 2.\nThe forms differ only in style.", "equivalent": true}', True),
        ('{"reasoning": "They differ.", "equivalent": false,}', False),
        # Prose before the object, with braces of its own (LaTeX, a set): the object after it is the verdict.
        (
            'The reference \\frac{3}{4} is 0.75, as written.\n{"reasoning": "same value", "equivalent": true}',
            True,
        ),
        ('Is {1, 2} the set {2, 1}? Yes.\n```json\n{"reasoning": "same set", "equivalent": true}\n```', True),
        (r'Student: \sqrt{8}; reference: 2\sqrt{2}. {"reasoning": "\sqrt{8} = 2\sqrt{2}", "equivalent": true}', True),
        # A verdict and its correction: no verdict (asked again), not whichever comes last.
        ('{"reasoning": "a", "equivalent": false}\nOn reflection: {"reasoning": "b", "equivalent": true}', None),
        ('{"reasoning": "a", "equivalent": true} so {"reasoning": "b", "equivalent": true}', True),
        # A reply cut inside its verdict holds none.
        ('{"reasoning": "The two agree", "equivalent": tr', None),
        ('{"equivalent": true, "reasoning": "cut inside the reas', None),
    ],
)
def test_judge_reply_parsing(text: str, expected: bool | None) -> None:
    parsed = parse_judge_reply(text)
    assert (parsed.equivalent if parsed else None) == expected


async def test_judge_retries_invalid_json_then_records_undecided() -> None:
    llm = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=["no json here"], times=1)]), scripted_settings())
    verdict = await judge_once(llm, problem_id="p", problem="Q?", reference="1", student="1", run=0)
    assert verdict.correct is True and verdict.attempts == 2
    llm.script = SimScript(rules=[Rule(role="judge", replies=["still not json"])])
    verdict = await judge_once(llm, problem_id="p", problem="Q?", reference="1", student="2", run=0, retries=2)
    assert verdict.correct is None and verdict.attempts == 3 and "not valid JSON" in verdict.detail
    judged = llm.calls_of("judge")
    assert len(judged) == 2 + 3 and "<reference>" in judged[-1].messages[-1].content


async def test_a_judge_reply_with_latex_before_its_object_is_read_at_once() -> None:
    reply = 'The reference \\frac{1}{2} and the student\'s 0.5 agree. {"reasoning": "same value", "equivalent": true}'
    llm = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=[reply])]), scripted_settings())
    verdict = await judge_once(llm, problem_id="p", problem="Q?", reference="\\frac{1}{2}", student="0.5", run=0)
    assert verdict.correct is True and verdict.attempts == 1 and verdict.detail == "same value"
    assert len(llm.calls_of("judge")) == 1


async def _cot_run(run_dir: Path, problems: list[Problem]) -> RunStore:
    """A chain-of-thought run of ``problems`` in process on the simulator's script; its store, open."""
    await scripted_run(ScriptedModel(SimScript(), scripted_settings()), run_dir, problems)
    return RunStore(run_dir, create=False)


async def test_a_stored_rules_verdict_is_reused_only_for_the_answer_it_graded(tmp_path: Path) -> None:
    store = await _cot_run(tmp_path / "run", [Problem(problem_id="a", question="What is 6*7?", answer="42")])
    config = GradeConfig(mode="rules")
    first = await grade_run(store, config)
    assert first.verdicts[("a", 0, 0)] == first.verdicts[("a", 0, SELECTED)] == [True]
    # The problem is solved again with another answer (a resume with other parameters re-solves a finished problem):
    # the verdicts stored for 42 are not this answer's.
    [result] = load_results(store)
    record = result.iterations[0]
    record.candidates[0] = record.candidates[0].model_copy(update={"answer": "41", "text": "\\boxed{41}"})
    record.selected = "41"
    store.save_result(result.model_copy(update={"answer": "41"}))
    again = await grade_run(store, config)
    assert again.verdicts[("a", 0, 0)] == again.verdicts[("a", 0, SELECTED)] == [False]
    loaded = load_grades(store, config)
    assert loaded is not None and loaded.verdicts == again.verdicts
    store.close()


def _judge(reply: str) -> ScriptedModel:
    """A judge model of the caller's own, answering every judge call with ``reply``."""
    return ScriptedModel(SimScript(rules=[Rule(role="judge", replies=[reply])]), scripted_settings())


@pytest.mark.slow
async def test_combined_grading_uses_the_judge_only_where_rules_cannot_decide(tmp_path: Path) -> None:
    problems = [
        Problem(problem_id="num", question="What is 6*7?", answer="42"),
        Problem(problem_id="wrong", question="What is 2*3?", answer="7"),
        # The simulated solver answers 5; the reference is text, so the rules cannot decide and the judge is asked.
        Problem(problem_id="text", question="What is 2+3?", answer="\\text{five}"),
        Problem(problem_id="unlabeled", question="What is 1+1?"),
    ]
    store = await _cot_run(tmp_path / "run", problems)
    judge = _judge('{"reasoning": "5 is five", "equivalent": true}')
    config = GradeConfig(mode="combined", judge_runs=3)
    grades = await grade_run(store, config, None, model=judge)
    assert grades.verdicts[("num", 0, 0)] == [True] * 3
    assert grades.verdicts[("wrong", 0, 0)] == [False] * 3
    assert grades.verdicts[("text", 0, 0)] == [True] * 3
    assert grades.verdicts[("num", 0, SELECTED)] == [True] * 3
    assert grades.unlabeled == ["unlabeled"]
    assert not any(key[0] == "unlabeled" for key in grades.verdicts)
    # One judge call per run for the "text" answer (candidate and selected answer share it).
    assert len(judge.calls_of("judge")) == 3
    # The report's line says what the judge was asked: its runs on the one answer the rules left undecided.
    assert grades.described() == "combined, 3 judge runs on 1 distinct answer the rules left undecided"
    # Stored grades are reused: grading again sends nothing.
    again = await grade_run(store, config, None, model=judge)
    assert again.verdicts == grades.verdicts and len(judge.calls_of("judge")) == 3
    loaded = load_grades(store, config)
    assert loaded is not None and loaded.verdicts == grades.verdicts
    assert loaded.described() == "combined, 3 judge runs"  # read back: how many the judge decided is not stored
    store.close()


@pytest.mark.slow
async def test_judge_mode_grades_everything_with_the_judge(tmp_path: Path) -> None:
    store = await _cot_run(tmp_path / "run", [Problem(problem_id="a", question="What is 6*7?", answer="41")])
    # The judge is scripted to disagree with the rules' obvious answer: judge mode must follow the judge.
    judge = _judge('{"reasoning": "r", "equivalent": true}')
    grades = await grade_run(store, GradeConfig(mode="judge", judge_runs=2), judge.settings, model=judge)
    assert grades.verdicts[("a", 0, 0)] == [True, True]
    rules = await grade_run(store, GradeConfig(mode="rules"), None)
    assert rules.verdicts[("a", 0, 0)] == [False]
    store.close()


async def test_a_judge_of_ones_own_needs_no_endpoint_in_any_settings(tmp_path: Path) -> None:
    store = await _cot_run(tmp_path / "run", [Problem(problem_id="a", question="What is 6*7?", answer="41")])
    # No settings given and the judge model's own name no endpoint: it alone is asked, its calls kept in the run.
    judge = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": true}'])]))
    assert not judge.settings.endpoint.base_url
    config = GradeConfig(mode="judge", judge_runs=2)
    grades = await grade_run(store, config, None, model=judge)
    assert grades.verdicts[("a", 0, 0)] == [True, True] and len(judge.calls_of("judge")) == 2
    # Graded again (regraded, not read back from the stored grades), the judge's calls replay from the store.
    again = ScriptedModel(SimScript(rules=[Rule(role="judge", replies=['{"reasoning": "r", "equivalent": false}'])]))
    regraded = await grade_run(store, config, None, regrade=True, model=again)
    assert regraded.verdicts == grades.verdicts and again.calls == []
    store.close()


async def test_verdicts_a_judge_outage_left_undecided_are_asked_again(tmp_path: Path) -> None:
    store = await _cot_run(tmp_path / "run", [Problem(problem_id="a", question="What is 6*7?", answer="41")])
    config = GradeConfig(mode="judge", judge_runs=1)
    down = ScriptedModel(SimScript(rules=[Rule(role="judge", fault="http_500")]), scripted_settings())
    grades = await grade_run(store, config, None, model=down)
    assert grades.verdicts[("a", 0, 0)] == [None]
    assert any("left undecided by failed calls" in note for note in grades.notes)
    # Graded again with the judge back: the undecided verdicts are asked, the stored ones not reused.
    back = _judge('{"reasoning": "r", "equivalent": true}')
    again = await grade_run(store, config, None, model=back)
    assert again.verdicts[("a", 0, 0)] == [True] and len(back.calls_of("judge")) == 1
    assert not any("failed calls" in note for note in again.notes)
    # Decided verdicts are kept: a third grading asks nothing.
    third = _judge('{"reasoning": "r", "equivalent": false}')
    assert (await grade_run(store, config, None, model=third)).verdicts == again.verdicts and third.calls == []
    store.close()


def test_letters_differing_only_in_case_are_different_unknowns() -> None:
    # Math-Verify lowercases every letter it reads: the reference "A - 3a" was -2a to it, so "-2a", "-2A" and the
    # swapped "a - 3A" were all right, and "q^3/(2Q^3)" equalled 1/2.
    for wrong in ("-2a", "-2A", "a - 3A", "A - 3A"):
        assert check_pair("A - 3a", wrong).correct is not True, wrong
    assert check_pair("q^3 : (2Q^3)", "1 : 2").correct is not True
    assert check_pair("q^3 : (2Q^3)", "q : (2Q)").correct is not True
    assert check_pair("\\frac{K}{k}", "1").correct is not True
    # The same answer in another form is still right, upper-case letters kept apart from lower-case ones.
    assert check_pair("A - 3a", "-3a + A").correct is True
    assert check_pair("\\frac{A^2 + Aa}{A}", "A + a").correct is True
    assert check_pair("q^3 : (2Q^3)", "\\frac{q^3}{2Q^3}").correct is True
    # Where neither answer writes a letter in both cases, case does not count (as Math-Verify reads it).
    assert check_pair("\\text{Yes}", "\\text{yes}").correct is True
    assert check_pair("\\mathbb{R}", "\\mathbb{R}").correct is True


def test_a_reference_listing_its_items_with_and_is_a_list() -> None:
    # "and" made a reference a sentence, left to the judge, though an answer's "and" joins a list: votes, which
    # check each answer against the other, kept "2 and 7" apart from "2, 7".
    for reference in ("2 \\text{ and } 7", "2 and 7", "2, \\text{and } 7", "-\\frac{5}{12} \\text{ and } \\frac{7}{9}"):
        listed = reference.replace("\\text{ and }", ",").replace("\\text{and }", "").replace(" and ", ", ")
        assert check_pair(reference, listed).correct is True, reference
    assert check_pair("3, 5 \\text{ and } 8", "3, 5, 8").correct is True
    assert check_pair("3, 5 \\text{ and } 8", "3, 5, 9").correct is not True
    assert check_pair("2 \\text{ and } 7", "7, 2").correct is None  # a bare list: its order is for the judge
    assert check_pair("2 \\text{ and } 7", "7, 2", any_order=True).correct is True
    # A reference with other words is still a sentence.
    assert check_pair("1 and odd primes", "1, \\text{odd primes}").correct is None
    assert check_pair("n \\text{ and } n+1 \\text{ coprime}", "n, n+1").correct is None


def test_yes_no_answers_and_choice_letters_are_decided_by_the_rules() -> None:
    # Math-Verify reads a word or a letter as unknowns: "Yes" against "No" and "F" against "H" went to the judge, which
    # only cost its calls.
    for same in ("NO", "no.", "\\text{NO}", "\\textbf{No}"):
        assert check_pair("No", same).correct is True, same
        assert check_pair(same, "No").correct is True, same
    for other in ("Yes", "YES", "\\text{yes}."):
        assert check_pair("No", other).correct is False, other
        assert check_pair(other, "No").correct is False, other
    assert check_pair("(F)", "H").correct is False
    assert check_pair("F", "\\textbf{(H)}").correct is False
    assert check_pair("F", "(F)").correct is True
    # Anything more is still the judge's: a reason after the word, a letter with its option's text, two letters, an
    # unknown in lower case, a word against a letter.
    assert check_pair("No", "No, since 4 is even").correct is None
    assert check_pair("F", "(H) 12").correct is None
    assert check_pair("F", "FH").correct is None
    assert check_pair("n", "k").correct is None
    assert check_pair("No", "N").correct is None
