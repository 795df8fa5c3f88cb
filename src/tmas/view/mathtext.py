"""Model text as HTML with its math rendered: LaTeX spans become MathML (``latex2mathml``, on the server; browsers
draw MathML natively, so pages need no script and no network), everything else is escaped.

Model output is untrusted. ``latex2mathml`` copies ``\\text{...}`` and attribute arguments into its output
unescaped, so its output is never passed through: it is parsed as XML and rebuilt from a whitelist of MathML
elements and attributes, and serialized again (which escapes every text). A span that fails any step (LaTeX the
converter does not know, unbalanced braces, output that is not well-formed) is shown as its raw text instead.

Each rendering keeps the raw text beside it (hidden until the page's *raw text* switch is on), or for a long text
with an address of its own, an empty block the page fills from that address when shown.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from bisect import bisect_left
from collections.abc import Iterator
from functools import lru_cache

from markupsafe import Markup, escape

from tmas.answers import closing_braces

MATHML_NS = "http://www.w3.org/1998/Math/MathML"

# MathML Core elements (and the few latex2mathml writes beyond it); anything else drops the whole span to raw text.
_ELEMENTS = frozenset(
    "math mrow mi mn mo ms mtext mspace mfrac msqrt mroot msub msup msubsup munder mover munderover mmultiscripts "  # noqa: SIM905
    "mprescripts none mtable mtr mtd mstyle mpadded mphantom menclose merror semantics annotation".split()
)
# Presentation attributes only: no href, no event handlers, no style.
_ATTRIBUTES = frozenset(
    "display mathvariant notation stretchy fence form minsize maxsize linethickness width height depth displaystyle "  # noqa: SIM905
    "scriptlevel columnalign columnlines columnspacing rowalign rowlines rowspacing frame accent accentunder "
    "movablelimits separator lspace rspace symmetric largeop linebreak align open close".split()
)

# Math spans, in order of precedence: $$...$$, \[...\], \(...\), $...$, and outside math an answer written as bare
# LaTeX, \boxed{...} (its braces may nest; the literal braces \{ and \} group nothing). An inline $ opens when not
# followed by a space and closes when not preceded by one nor followed by a digit (so "$5 and $10" stays text). Openers
# are found by one expression and their closers looked for by hand (:func:`math_spans`), so that text full of unclosed
# openers (a model looping until max_tokens) renders in time linear in its length.
_OPENER = re.compile(r"\$\$|\\\[|\\\(|\\boxed\s*\{|(?<![\\$])\$")
_DELIMITED = (("$$", "$$", True), ("\\[", "\\]", True), ("\\(", "\\)", False))
_INLINE = re.compile(r"(?<![\\$])\$(?=[^\s$])(?P<id>[^$\n]+?)(?<![\s\\])\$(?!\d)")
_LONE_AMP = re.compile(r"&(?!#x?[0-9a-fA-F]+;|[a-zA-Z]+;)")
# Where "**" starts, overlaps included ("***" holds two).
_STARS = re.compile(r"(?=\*\*)")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+)$", re.M)
# Placeholders for rendered spans while the rest of the text is escaped and formatted (NUL is removed first).
_SLOT = re.compile("\x00(\\d+)\x00")
# How the '<' and '>' put in as commands come out of \text{} (the converter turns the space into a no-break one).
_MARKED = re.compile("\\\\(lt|gt)[ \u00a0]?")
# An '&' that begins what XML reads as a reference ("&lt;", "&#60;"): the converter copies \text{} as it is, so the
# model's "&lt;" would be read back as '<'. It is carried through the converter as a private-use character instead.
_REFERENCE = re.compile(r"&(?=#?[0-9A-Za-z]+;)")
_AMP = "\ue000"


@lru_cache(maxsize=50_000)
def latex_to_mathml(latex: str, block: bool = False) -> str | None:
    """Safe MathML for one LaTeX formula (no delimiters), or None when it cannot be rendered."""
    try:
        from latex2mathml.converter import convert
    except ImportError:  # an install of the serve extra from before it was added: pages show raw LaTeX
        return None
    # '<' and '>' as commands: in \text{} the converter would otherwise copy them as markup.
    source = latex.replace("<", r"\lt ").replace(">", r"\gt ")
    # The converter reads `aligned` (the models' favourite) as one line; `split` is the same layout and it knows it.
    source = source.replace(r"\begin{aligned}", r"\begin{split}").replace(r"\end{aligned}", r"\end{split}")
    amp = _REFERENCE.search(source) is not None
    if amp:
        if _AMP in source:
            return None  # the model's own private-use character could not be told from the stand-in: left raw
        source = _REFERENCE.sub(_AMP, source)
    try:
        raw = convert(source, display="block" if block else "inline")
        tree = ET.fromstring(_LONE_AMP.sub("&amp;", raw))
    except Exception:  # the converter raises many kinds on LaTeX it cannot read: that span stays raw
        return None
    clean = _rebuild(tree, amp)
    if clean is None:
        return None
    clean.set("xmlns", MATHML_NS)
    return ET.tostring(clean, encoding="unicode", short_empty_elements=False)


def _rebuild(node: ET.Element, amp: bool) -> ET.Element | None:
    tag = node.tag.rsplit("}", 1)[-1]
    if tag not in _ELEMENTS:
        return None
    out = ET.Element(tag, {k: v for k, v in node.attrib.items() if k in _ATTRIBUTES})
    out.text = _unmark(node.text, amp)
    out.tail = _unmark(node.tail, amp)
    for child in node:
        clean = _rebuild(child, amp)
        if clean is None:
            return None
        out.append(clean)
    return out


def _unmark(text: str | None, amp: bool) -> str | None:
    """'<' and '>' back in text the converter copied (\\text{a<b}), and with ``amp`` the '&' of a reference
    (\\text{a &lt; b}); serialization escapes them."""
    if text is None:
        return None
    text = _MARKED.sub(lambda m: "<" if m.group(1) == "lt" else ">", text)
    return text.replace(_AMP, "&") if amp else text


def math_spans(text: str) -> Iterator[tuple[int, int, str, bool]]:
    """(start, end, LaTeX, displayed) of each math span of ``text``, left to right, none inside another. A closer
    found missing once is not looked for again (nor is one past the end), and \\boxed's braces are matched in one
    pass: linear in the text."""
    absent: set[str] = set()
    closing: dict[int, int] | None = None
    pos = 0
    while (opened := _OPENER.search(text, pos)) is not None:
        start, opener = opened.start(), opened.group(0)
        span = None
        delimited = next((d for d in _DELIMITED if d[0] == opener), None)
        if delimited is not None:
            head, tail, block = delimited
            close = -1 if tail in absent else text.find(tail, start + len(head) + 1)
            if close < 0:
                absent.add(tail)
            else:
                span = (start, close + len(tail), text[start + len(head) : close], block)
        elif opener == "$":
            inline = _INLINE.match(text, start)
            if inline is not None:
                span = (start, inline.end(), inline.group("id"), False)
        else:
            closing = closing_braces(text) if closing is None else closing
            brace = closing.get(opened.end() - 1)
            if brace is not None:
                span = (start, brace + 1, text[start : brace + 1], False)
        if span is None:
            pos = start + 1
            continue
        yield span
        pos = span[1]


def _format_text(escaped: str) -> str:
    """The Markdown a solution uses for structure: headings and bold (line breaks are kept by the page's CSS)."""
    escaped = _HEADING.sub(lambda m: f'<span class="md-h">{m.group(2)}</span>', escaped)
    return "\n".join(_bold(line) for line in escaped.split("\n"))


def _bold(line: str) -> str:
    """``**text**`` as <strong> on one line: an opener followed by a non-space, closed by the first later "**" after
    a non-space (as ``\\*\\*(?=\\S)(.+?)(?<=\\S)\\*\\*`` reads it, in time linear in the line)."""
    stars = [m.start() for m in _STARS.finditer(line)]
    if len(stars) < 2:
        return line
    closers = [i for i in stars if i > 0 and not line[i - 1].isspace()]
    pieces: list[str] = []
    pos = 0
    for i in stars:
        if i < pos or i + 2 >= len(line) or line[i + 2].isspace():
            continue
        after = bisect_left(closers, i + 3)
        if after == len(closers):
            break  # no closer for this opener, nor for any later one
        j = closers[after]
        pieces += [line[pos:i], f"<strong>{line[i + 2 : j]}</strong>"]
        pos = j + 2
    pieces.append(line[pos:])
    return "".join(pieces)


# Renders kept: a maths-heavy reply's HTML is several times its text, so a long-lived viewer keeps few.
@lru_cache(maxsize=512)
def render_math_text(text: str) -> str:
    """HTML of ``text`` with every math span rendered (the raw text not included)."""
    text = text.replace("\x00", "")
    pieces: list[str] = []
    slots: list[str] = []
    pos = 0
    for start, end, latex, block in math_spans(text):
        whole = text[start:end]
        mathml = latex_to_mathml(latex.strip(), block)
        before = text[pos:start]
        if block and mathml is not None:
            # A displayed formula is a block of its own: the line breaks around it would add empty lines.
            before = before[:-1] if before.endswith("\n") else before
            end += text[end : end + 1] == "\n"
        pieces.append(before)
        if mathml is None:
            slots.append(f'<code class="tex-failed" title="not rendered">{escape(whole)}</code>')
        else:
            slots.append(mathml)
        pieces.append(f"\x00{len(slots) - 1}\x00")
        pos = end
    pieces.append(text[pos:])
    html = _format_text(str(escape("".join(pieces))))
    return _SLOT.sub(lambda m: slots[int(m.group(1))], html)


# A text longer than this whose raw text has an address of its own is sent once: the page fetches its raw text when
# *raw text* is switched on, instead of carrying it twice (a thinking model's 30K-token solution is 120K characters).
INLINE_RAW_CHARS = 2_000


def rich(text: object, raw_url: str | None = None) -> Markup:
    """A block of model text: rendered, with its raw text beside it for the page's *raw text* switch; with
    ``raw_url`` (where the text is served as plain text) and a long text, an empty raw block fetched when shown."""
    if text is None or str(text) == "":
        return Markup("")
    value = str(text)
    if raw_url is not None and len(value) > INLINE_RAW_CHARS:
        raw = f'<pre class="raw" data-src="{escape(raw_url)}"></pre>'
    else:
        raw = f'<pre class="raw">{escape(value)}</pre>'
    return Markup(f'<div class="rich"><div class="rendered">{render_math_text(value)}</div>{raw}</div>')


# An answer is LaTeX when it has a command, a script, a group or a fraction bar; plain words and numbers stay text.
_LATEX_HINT = re.compile(r"[\\^_{}]|\d/\d")


def answer(text: object) -> Markup:
    """One final answer (LaTeX without delimiters, as extracted from \\boxed{}), rendered inline."""
    if text is None or str(text) == "":
        return Markup('<span class="muted">-</span>')
    value = str(text)
    bare = value.strip().strip("$").strip()
    mathml = latex_to_mathml(bare) if _LATEX_HINT.search(bare) else None
    if mathml is None:
        return Markup(f'<span class="ans">{escape(value)}</span>')
    return Markup(
        f'<span class="ans"><span class="rendered">{mathml}</span><code class="raw">{escape(value)}</code></span>'
    )
