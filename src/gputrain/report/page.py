"""The shell of gputrain's self-contained HTML pages: the document, its inline style, escaping.

`page(title, body)` is the complete document around a body of HTML; the run report (report/html.py)
and bench's index page (report/markdown.py) both use it, so they look alike and need nothing from
the network.
"""

from __future__ import annotations

import html
import re
from typing import Any

_CODE = re.compile(r"`([^`]+)`")


def escape(x: Any) -> str:
    """`str(x)` safe inside HTML text and attribute values."""
    return html.escape(str(x), quote=True)


def with_code(text: str) -> str:
    """`text` escaped, with its `backquoted` spans as <code> (the verdict's advice, markdown text)."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", escape(text))


def page(title: str, body: str) -> str:
    """A complete HTML document with the report's inline style around `body`."""
    return ("<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
            f"<title>{escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
            f"{body}\n</main>\n</body>\n</html>\n")


_CSS = """
body{margin:0;background:#f6f7f9;color:#1d232b;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,
'Helvetica Neue',Arial,sans-serif}
main{max-width:1100px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:24px;margin:8px 0 2px}h2{font-size:18px;margin:0 0 10px}h3{font-size:15px;margin:14px 0 6px}
.sub{color:#5b6573;margin:0 0 14px}.note{background:#fff6db;border-left:4px solid #e0a800;padding:6px 10px}
section{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:14px 18px;margin:14px 0}
table{border-collapse:collapse;width:100%;font-size:14px}
td,th{border-bottom:1px solid #eceef1;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600}td.k{font-weight:600;width:28%;white-space:nowrap}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:6px 0 4px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:8px 14px;min-width:130px}
.cards.three{display:grid;grid-template-columns:repeat(auto-fit,minmax(250px,1fr))}
.card .v{font-size:20px;font-weight:600}.card .l{color:#5b6573;font-size:12px;text-transform:uppercase}
.plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(460px,1fr));gap:10px}
.plots figure,figure.wide{margin:0}figure.wide img{max-width:820px;width:100%}.plots img{width:100%;height:auto;border:1px solid #eceef1;border-radius:4px}
figcaption{font-size:12px;color:#5b6573}
.bar{background:#e9edf2;border-radius:4px;height:18px;position:relative;overflow:hidden;margin:6px 0}
.bar span{display:block;height:100%;background:#3b7dd8}.bar.hot span{background:#d9822b}
.bar.full span{background:#c0392b}
.ok{color:#1e7d32}.warn{color:#a15c00}.bad{color:#b3261e}
ul.w li{margin:3px 0}code{background:#f3f4f6;padding:0 3px;border-radius:3px}
.verdict{font-size:18px;font-weight:600}
details summary{cursor:pointer;color:#3b5b8a}
footer{color:#7a8390;font-size:12px;margin-top:18px}
"""

