"""Text as inert Markdown, for everything deid shows in a Markdown renderer (the Prefect UI's artifacts).

The Prefect UI renders markdown artifacts *and the cells of table artifacts* as Markdown: a threshold
``>= 5`` at the start of a cell became a blockquote reading "= 5", losing the direction exactly
where bigger is safer. Every text deid puts there goes through :func:`md` (or :func:`md_cell`).
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["md", "md_cell", "truncate"]

# CommonMark lets a backslash escape any ASCII punctuation; these are the ones that start or end
# Markdown or HTML constructs inside a line (emphasis, code, links, images, HTML, tables, strikethrough,
# entities, headings).
_INLINE = re.compile(r"([\\`*_\[\]<>|~&#!])")
# At the start of a line, before a space: a list marker or setext underline, an ordered-list number's
# "." or ")".
_LINE_START = re.compile(r"^(\s*)(?:([-+=])|(\d{1,9})([.)]))(?=\s|$)", re.MULTILINE)


def md(text: Any) -> str:
    """``text`` (any value; None as an em dash) escaped so a Markdown renderer shows it literally."""
    if text is None:
        return "\u2014"
    out = _INLINE.sub(r"\\\1", str(text))
    return _LINE_START.sub(lambda m: m.group(1) + ("\\" + m.group(2) if m.group(2) else m.group(3) + "\\" + m.group(4)),
                           out)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis when cut."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[:limit - 1].rsplit(" ", 1)[0] if " " in text[:limit - 1] else text[:limit - 1]
    return cut.rstrip(" ,;:") + "\u2026"


def md_cell(value: Any, *, limit: int | None = None) -> str | int | float | bool:
    """A table-artifact cell: numbers and booleans as they are, text on one line, escaped (and cut to ``limit``)."""
    if isinstance(value, bool | int | float):
        return value
    text = " ".join(("\u2014" if value is None else str(value)).split())
    if limit is not None:
        text = truncate(text, limit)
    return md(text)
