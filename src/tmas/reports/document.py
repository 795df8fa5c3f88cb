"""A tiny document model rendered to both Markdown and HTML, so the two reports always say the same thing."""

from __future__ import annotations

import html
from dataclasses import dataclass, field


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Paragraph:
    text: str
    # A lead in bold before the text (a warning's).
    lead: str = ""


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: str
    alt: str


Block = Heading | Paragraph | Bullets | Table | Image


@dataclass
class Document:
    title: str
    blocks: list[Block] = field(default_factory=list)

    def add(self, block: Block) -> None:
        self.blocks.append(block)

    def markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        for block in self.blocks:
            if isinstance(block, Heading):
                lines += ["#" * block.level + " " + block.text, ""]
            elif isinstance(block, Paragraph):
                lines += [f"**{block.lead}** {block.text}" if block.lead else block.text, ""]
            elif isinstance(block, Bullets):
                lines += [f"- {item}" for item in block.items] + [""]
            elif isinstance(block, Table):
                lines.append("| " + " | ".join(block.headers) + " |")
                lines.append("|" + "|".join("---" for _ in block.headers) + "|")
                lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in block.rows]
                lines.append("")
            else:
                lines += [f"![{block.alt}]({block.path})", ""]
        return "\n".join(lines)

    def html(self) -> str:
        esc = html.escape
        parts = [
            "<!DOCTYPE html>",
            '<html><head><meta charset="utf-8">',
            f"<title>{esc(self.title)}</title>",
            "<style>body{font-family:system-ui,sans-serif;max-width:70rem;margin:2rem auto;padding:0 1rem}"
            "table{border-collapse:collapse;margin:0.5rem 0 1.5rem;font-size:0.9rem}"
            "th,td{border:1px solid #ccc;padding:0.2rem 0.5rem;text-align:right}"
            "th:first-child,td:first-child{text-align:left}img{max-width:100%}</style>",
            "</head><body>",
            f"<h1>{esc(self.title)}</h1>",
        ]
        for block in self.blocks:
            if isinstance(block, Heading):
                parts.append(f"<h{block.level}>{esc(block.text)}</h{block.level}>")
            elif isinstance(block, Paragraph):
                lead = f"<strong>{esc(block.lead)}</strong> " if block.lead else ""
                parts.append(f"<p>{lead}{esc(block.text)}</p>")
            elif isinstance(block, Bullets):
                parts.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in block.items) + "</ul>")
            elif isinstance(block, Table):
                head = "".join(f"<th>{esc(h)}</th>" for h in block.headers)
                body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in block.rows)
                parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            else:
                parts.append(f'<p><img src="{esc(block.path)}" alt="{esc(block.alt)}"></p>')
        parts.append("</body></html>")
        return "\n".join(parts)
