"""Markdown as a self-contained HTML page: bench's index.md becomes index.html.

`markdown_page(markdown, base_dir, title)` renders the small subset bench's index.md uses
(headings, bullets, pipe tables, links, images, `code`) inside report/page.py's document; each
local image is inlined as a data URI, so the page opens anywhere without its folder.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from gputrain.report.page import escape as _e, page, with_code

_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def markdown_page(markdown: str, base_dir: str | Path, title: str) -> str:
    """The markdown subset bench's index.md uses as one self-contained HTML page (local images
    inlined as data URIs; links to other files stay links)."""
    base = Path(base_dir)
    out: list[str] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append(lines[i])
                i += 1
            out.append(_md_table(block, base))
            continue
        if line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_md_inline(lines[i][2:], base)}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        m = re.match(r"(#{1,6}) (.*)", line)
        if m:
            n = len(m.group(1))
            out.append(f"<h{n}>{_md_inline(m.group(2), base)}</h{n}>")
        elif line.strip():
            out.append(f"<p>{_md_inline(line, base)}</p>")
        i += 1
    return page(title, "\n".join(out))


def _md_table(block: list[str], base: Path) -> str:
    def cells(row: str) -> list[str]:
        return [c.strip() for c in row.strip().strip("|").split("|")]

    rows = [cells(r) for r in block if not re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*", r.strip())]
    if not rows:
        return ""
    head, body = rows[0], rows[1:]
    out = ["<table><tr>" + "".join(f"<th>{_md_inline(c, base)}</th>" for c in head) + "</tr>"]
    for r in body:
        out.append("<tr>" + "".join(f"<td>{_md_inline(c, base)}</td>" for c in r) + "</tr>")
    return "".join(out) + "</table>"


def _md_inline(text: str, base: Path) -> str:
    pieces, pos = [], 0
    for m in _LINK.finditer(text):
        pieces.append(with_code(text[pos:m.start()]))
        bang, label, target = m.groups()
        if bang:
            pieces.append(_inline_image(base / target, label) if _is_local(target)
                          else f"<span>[image not inlined: {_e(target)}]</span>")
        else:
            pieces.append(f"<a href='{_e(target)}'>{_e(label)}</a>")
        pos = m.end()
    pieces.append(with_code(text[pos:]))
    return "".join(pieces)


def _is_local(target: str) -> bool:
    return not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)


def _inline_image(path: Path, alt: str) -> str:
    mime = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}.get(
        path.suffix.lower())
    try:
        data = path.read_bytes()
    except OSError:
        return f"<p class='note'>missing image: {_e(path.name)}</p>"
    if mime is None:
        return f"<p class='note'>not an image: {_e(path.name)}</p>"
    uri = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
    return f"<figure><img src='{uri}' alt='{_e(alt)}' style='max-width:100%'></figure>"
