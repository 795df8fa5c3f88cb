"""The viewer's text rendering (LaTeX to whitelisted MathML), its live exact-rule grades and its model names."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from fractions import Fraction

import pytest

from tmas.answer_classes import value_key
from tmas.view.live_grades import exact_number, exact_verdict
from tmas.view.mathtext import answer, latex_to_mathml, render_math_text, rich
from tmas.view.runs import describe_model, params_line

MATHML = "{http://www.w3.org/1998/Math/MathML}"


def _math(html: str) -> list[ET.Element]:
    """The <math> elements of rendered HTML (the rest is escaped text, so the whole parses once wrapped)."""
    root = ET.fromstring(f"<div>{html}</div>")
    return [e for e in root.iter() if e.tag == MATHML + "math"]


def test_every_kind_of_math_span_becomes_mathml_and_the_text_around_stays_text() -> None:
    text = (
        "## Step 1\nSo $2\\times 5$ and \\(\\frac{1}{2}\\), then\n\\[x^2\\]\n$$\\sqrt{2}$$\n"
        "**Hence** \\boxed{\\frac{3}{4}} costs $5 and $10."
    )
    html = render_math_text(text)
    maths = _math(html)
    assert [m.get("display") for m in maths] == ["inline", "inline", "block", "block", "inline"]
    assert [len(list(m.iter(MATHML + "mfrac"))) for m in maths] == [0, 1, 0, 0, 1]
    assert maths[4].find(f".//{MATHML}menclose").get("notation") == "box"  # type: ignore[union-attr]
    # Markdown structure kept: the heading and the bold word; the dollars of prices are not math.
    assert '<span class="md-h">Step 1</span>' in html and "<strong>Hence</strong>" in html
    assert html.endswith("costs $5 and $10.")
    assert "\\frac" not in html and "\\boxed" not in html


def test_model_output_cannot_inject_markup() -> None:
    hostile = (
        "$\\text{<script>alert(1)</script>}$ <img src=x onerror=alert(2)> "
        '$\\href{javascript:alert(3)}{x}$ $\\color{red" onload="alert(4)}{y}$ $a & b$'
    )
    html = render_math_text(hostile)
    root = ET.fromstring(f"<div>{html}</div>")
    tags = {e.tag.split("}")[-1] for e in root.iter()}
    assert tags <= {"div", "math", "mrow", "mtext", "mi", "mo", "mstyle"}, tags
    attributes = {name for e in root.iter() for name in e.attrib}
    assert attributes <= {"display", "xmlns"}, attributes
    # The script's text is shown as text, inside the formula it was written in.
    assert "<script>alert(1)</script>" in "".join(root.itertext())
    assert "&lt;img src=x onerror=alert(2)&gt;" in html


def test_entities_a_model_wrote_in_a_formula_show_as_it_wrote_them() -> None:
    # The converter copies \text{} as it is: "&lt;" a model wrote (an HTML-escaped reply, a formula about HTML) was
    # read back as '<', "R&amp;D" as "R&D". A matrix's column separators are still read as columns.
    text = (
        "$\\text{a &lt; b}$, $\\text{R&amp;D}$, $\\mbox{&#60;p&#62;}$"
        " and $\\begin{matrix} a & b \\\\ c & d \\end{matrix}$"
    )
    maths = _math(render_math_text(text))
    assert ["".join(m.itertext()) for m in maths[:3]] == ["a\u00a0&lt;\u00a0b", "R&amp;D", "&#60;p&#62;"]
    assert len(list(maths[3].iter(MATHML + "mtd"))) == 4
    shown = ET.fromstring(str(answer("\\text{&gt; 5}")).replace('<code class="raw">', "<code>"))
    assert "".join(next(e for e in shown.iter() if e.tag == MATHML + "math").itertext()) == "&gt;\u00a05"


def test_openers_left_open_stay_text_and_spans_after_them_still_render() -> None:
    # A model looping until max_tokens: openers without closers stay text (each looked for once).
    looped = "\\boxed{" * 3000 + "\\( a " * 3000 + "**b " * 3000 + "\\[c " * 3000
    assert render_math_text(looped) == looped  # nothing rendered, nothing lost
    # A span after a \boxed{} whose inside opens a "$$" is a span of its own (the "$$" inside does not reach past
    # the box to pair with the span's).
    html = render_math_text("\\boxed{$$a} then $$b$$ and \\[x^2\\] and **bold**")
    assert [m.get("display") for m in _math(html)] == ["inline", "block", "block"] and "<strong>bold</strong>" in html
    # Bold as the one-line rule reads it: an opener before a non-space, the first closer after a non-space.
    assert render_math_text("** a** **b *c** d**") == "** a** <strong>b *c</strong> d**"


def test_aligned_equations_keep_their_rows() -> None:
    mathml = latex_to_mathml("\\begin{aligned} a &= b + c \\\\ &= d \\end{aligned}", block=True)
    assert mathml is not None
    rows = ET.fromstring(mathml).findall(f".//{MATHML}mtr")
    assert len(rows) == 2 and "&" not in "".join(ET.fromstring(mathml).itertext())


def test_latex_the_converter_cannot_read_stays_raw_for_that_span_only() -> None:
    assert latex_to_mathml("\\frac{1}{") is None
    html = render_math_text("bad $\\frac{1}{$ then good $x^2$")
    assert '<code class="tex-failed" title="not rendered">$\\frac{1}{$</code>' in html
    assert len(_math(html)) == 1
    # An unclosed \boxed{ is left as text.
    assert render_math_text("\\boxed{3") == "\\boxed{3"


def test_a_box_holding_a_literal_brace_renders_to_its_own_closing_brace() -> None:
    # A case split opens a literal brace it never closes: it groups nothing, so the box still ends where it does.
    html = render_math_text("So \\boxed{f(x) = \\left\\{ 1 \\right.} then {y} and \\boxed{5}.")
    maths = _math(html)
    assert len(maths) == 2 and [len(list(m.iter(MATHML + "menclose"))) for m in maths] == [1, 1]
    assert "\\boxed" not in html and html.startswith("So <math") and " then {y} and <math" in html


def test_blocks_and_answers_keep_their_raw_text_one_click_away() -> None:
    block = str(rich("$\\frac{1}{2}$ & <b>"))
    assert '<pre class="raw">$\\frac{1}{2}$ &amp; &lt;b&gt;</pre>' in block and "<mfrac>" in block
    assert str(answer("\\frac{1}{2}")).endswith('<code class="raw">\\frac{1}{2}</code></span>')
    # Numbers and words are not LaTeX: plain text, escaped.
    assert str(answer("391")) == '<span class="ans">391</span>'
    assert str(answer("<i>")) == '<span class="ans">&lt;i&gt;</span>'
    assert str(answer(None)) == '<span class="muted">-</span>' and str(rich(None)) == ""


@pytest.mark.parametrize(
    ("reference", "given", "verdict"),
    [
        ("391", "391", True),
        ("391", "$391$", True),
        ("391", "\\boxed{391}", True),
        ("391", "n = 391", True),
        ("1000", "1{,}000", True),
        ("1000", "1,000", True),
        ("1/2", "\\frac{1}{2}", True),
        ("1/2", "\\dfrac12", True),
        ("0.5", "\\tfrac{1}{2}", True),
        ("-3/4", "-\\frac{3}{4}", True),
        ("391", "390", False),
        ("1/2", "0.49", False),
        ("391", None, False),
        ("391", "  ", False),
        ("391", "x + 1", None),
        ("2\\sqrt{2}", "\\sqrt{8}", None),
        ("\\sqrt{2}", "\\sqrt{2}", True),
        ("1/0", "5", None),
        # Scientific notation as programs print it is the number it writes, as votes key it.
        ("32500000", "3.25e7", True),
        ("0.00042", "4.2E-4", True),
        ("32500000", "3.25e6", False),
        # A list is no number written with a thousands separator.
        ("3, 125", "3125", None),
        ("3125", "3, 125", None),
        # Digits with leading zeros: only the same digits are checked, as the grading rules do.
        ("017", "17", None),
        ("017", "$017$", True),
    ],
)
def test_live_exact_rules_worked_by_hand(reference: str, given: str | None, verdict: bool | None) -> None:
    assert exact_verdict(reference, given) is verdict


def test_the_live_check_calls_two_plain_numbers_equal_exactly_where_votes_key_them_as_one() -> None:
    spellings = [
        "4250000",
        "4.25e6",
        "4.25E+06",
        "4250000.0",
        "17/4",
        "\\frac{17}{4}",
        "\\frac74",
        "1.75",
        "4.25",
        "-4.25",
        "1{,}250",
        "1250",
        "1.25e3",
        "2.5e-3",
        "0.0025",
        "1/400",
    ]
    for first in spellings:
        for second in spellings:
            same = value_key(first) == value_key(second)
            assert exact_verdict(first, second) is same, (first, second)


def test_votes_key_two_numbers_as_one_exactly_where_the_live_check_calls_each_the_other_right() -> None:
    # Digits with leading zeros are the answer, not their value: against "017" only "017" is right. Votes keyed "017"
    # and "17" as one answer (the number 17) that the live check (and the grading rules) kept apart.
    spellings = ["017", "17", "17.0", "0017", "$017$", "-017", "-17", "05.5", "5.5", "11/2", "1/02", "1/2", "0.5"]
    for first in spellings:
        for second in spellings:
            same = value_key(first) == value_key(second)
            both = exact_verdict(first, second) is True and exact_verdict(second, first) is True
            assert both is same, (first, second)


def test_exact_numbers() -> None:
    assert exact_number("\\frac{6}{8}") == Fraction(3, 4)
    assert exact_number("12.50") == Fraction(25, 2)
    assert exact_number("1,00") is None  # not a thousands separator: not read as a number
    assert exact_number("\\pi") is None


def test_the_run_names_its_model() -> None:
    embedded = {"endpoint": {"base_url": [], "model": None}, "local": {"model": "qwen2.5-coder-0.5b"}}
    name, detail = describe_model(embedded, "qwen2.5-coder-0.5b")
    assert name == "qwen2.5-coder-0.5b" and detail is not None
    assert detail.startswith("embedded: Qwen2.5-Coder-0.5B-Instruct, Q4 GGUF")
    assert detail.endswith("; file qwen2.5-coder-0.5b.gguf")
    tiny = {"endpoint": {"base_url": []}, "local": {"model": "smollm2-135m"}}
    assert str(describe_model(tiny, None)[1]).endswith("; file SmolLM2-135M-Instruct.Q4_1.gguf")
    gguf = {"endpoint": {"base_url": []}, "local": {"model": "/models/phi-3-mini.Q4_K_M.gguf"}}
    assert describe_model(gguf, None) == ("phi-3-mini.Q4_K_M", "embedded: /models/phi-3-mini.Q4_K_M.gguf")
    remote = {"endpoint": {"base_url": ["http://gpu:8000/v1"], "model": "Qwen3-8B"}}
    assert describe_model(remote, "other") == ("Qwen3-8B", "http://gpu:8000/v1")
    # An endpoint without a configured model name: the name the server answered with.
    assert describe_model({"endpoint": {"base_url": ["http://gpu:8000/v1"]}}, "served-name")[0] == "served-name"
    assert describe_model({}, "from-calls") == ("from-calls", None)


def test_the_title_names_the_parameters_set_away_from_the_defaults() -> None:
    # The embedded model's majority vote: k=4 and the concise style (defaults: k=64, style=paper).
    params = {"iterations": 1, "mode": "numeric", "style": "concise", "k": 4, "sampling": {}}
    assert params_line("majority", params) == "style=concise, k=4"
    assert params_line("cot", {"iterations": 1, "mode": "numeric", "style": "paper"}) == ""
    assert params_line("not-a-method", {"a": 1, "b": [1]}) == "a=1"


def test_a_long_text_with_an_address_leaves_its_raw_text_to_be_fetched() -> None:
    long = "x < y " * 400
    block = str(rich(long, raw_url="/run/k/iteration/text?id=a&t=0&c=1"))
    assert '<pre class="raw" data-src="/run/k/iteration/text?id=a&amp;t=0&amp;c=1"></pre>' in block
    assert block.count("x &lt; y") == 400  # the rendered text alone
    # A short one keeps its raw text inline.
    assert '<pre class="raw">$x$</pre>' in str(rich("$x$", raw_url="/r"))
