"""Every relative link of the README and the pages under docs/ (and the examples' and benchmarks' READMEs) names a
file that exists and, where it names a section, a heading of that file, spelled as GitHub spells its anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    str(p.relative_to(ROOT))
    for p in [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "examples").rglob("*.md"),
        *(ROOT / "benchmarks").rglob("*.md"),
    ]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (those in code blocks are none), a repeated one numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M):
        slug = anchor(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_anchors_are_spelled_as_github_spells_them() -> None:
    assert anchor("Streaming, `timeout_s`, `queue_timeout_s` and `deadline_s`") == (
        "streaming-timeout_s-queue_timeout_s-and-deadline_s"
    )
    assert anchor("The seam: `ChatModel`") == "the-seam-chatmodel"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page: str) -> None:
    source = ROOT / page
    broken = []
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, section = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif section and linked.suffix == ".md" and section not in anchors(linked):
            broken.append(f"{target} (no such section)")
    assert not broken, f"{page}: {broken}"
