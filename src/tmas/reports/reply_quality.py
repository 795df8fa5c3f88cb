"""Per-role reply quality of a run: of each role's successful replies, the share with no extractable answer or
score (or an invalid update), the share cut at max_tokens, and the share whose answer came from a final-answer
statement instead of a box.

Read from the iteration records (``IterationRecord.replies``), so a run whose problems are mid-way is counted up to
its last finished iteration. Records written before these counts existed contribute nothing.
"""

from __future__ import annotations

from tmas.methods.base import ReplyTally, truncation_warnings
from tmas.reports.document import Document, Heading, Paragraph, Table
from tmas.store.run_store import RunStore


def role_replies(store: RunStore) -> dict[str, ReplyTally]:
    """The run's reply counts per role, summed over every stored iteration of every problem."""
    totals: dict[str, ReplyTally] = {}
    for problem in store.iter_problems():
        for record in store.iterations(problem.problem_id):
            for role, tally in record.replies.items():
                totals[role] = totals.get(role, ReplyTally()) + tally
    return dict(sorted(totals.items()))


def share(part: int, whole: int) -> str:
    """``part`` as a share of ``whole`` with its count, as the report prints it ("-" when ``whole`` is 0)."""
    return f"{100 * part / whole:.1f}% ({part})" if whole else "-"


def reply_quality_section(doc: Document, replies: dict[str, ReplyTally]) -> None:
    """The per-role table of a run's section in the report (nothing when the run recorded no counts)."""
    if not replies:
        return
    doc.add(Heading(4, "Replies per role"))
    doc.add(
        Paragraph(
            "Of each role's successful replies: no usable answer, score or update; cut at max_tokens; answer read "
            "from a final-answer statement because no \\boxed{} was given; echoes of the prompt's own instructions "
            "(rejected and asked again once)."
        )
    )
    rows = [
        [
            role,
            str(t.replies),
            share(t.unusable, t.replies),
            share(t.truncated, t.replies),
            share(t.stated, t.replies),
            share(t.echo, t.replies),
        ]
        for role, t in replies.items()
    ]
    doc.add(Table(["Role", "Replies", "No answer/score", "Truncated", "Answer stated, no box", "Echo"], rows))
    warnings = truncation_warnings({role: (t.replies, t.truncated) for role, t in replies.items()})
    if warnings:
        doc.add(Paragraph(" ".join(f"{w}." for w in warnings), lead="Warning: many replies cut at max_tokens."))
