"""No URL in what deid writes for people to read: report pages, the catalogue, the dataset card.

A base module (no deid import): the reporting pages (:mod:`deid.reporting.html_page`, which
re-exports it) and the release's dataset card (:mod:`deid.release.card`, a layer below) both strip
URLs, with this one pattern.
"""
from __future__ import annotations

import re

__all__ = ["strip_urls"]

# A URL up to whitespace, a quote or bracket; trailing sentence punctuation stays in the text.
_URL = re.compile(r"(?i)\b(?:https?|ftp)://[^\s\"'<>)]*?(?=[.,;:!?]*(?:[\s\"'<>)]|$))")


def strip_urls(text: str) -> str:
    """Replace every ``http(s)://`` or ``ftp://`` URL in ``text`` by ``[link removed]``.

    Report text comes from manifests, settings and gate details the steward does not control;
    a URL in it would otherwise appear in a page promised to reference nothing external.
    """
    return _URL.sub("[link removed]", text)
