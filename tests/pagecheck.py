"""Reading deid's HTML pages back in tests: tables as cell text, headings, and the validation page's promises."""
from __future__ import annotations

from html.parser import HTMLParser

from deid.reporting.html_page import fmt
from deid.evaluation.validation import SuiteResult


class Page(HTMLParser):
    """Headings (with their ids) and every table as rows of cell text; ``<br>`` becomes a newline."""

    def __init__(self, doc: str) -> None:
        super().__init__()
        self.headings: list[tuple[str, str | None, str]] = []  # (tag, id, text)
        self.tables: list[list[list[str]]] = []
        self.images: list[dict[str, str]] = []
        self.svgs: list[dict[str, str]] = []  # attributes of each <svg> element (the charts)
        self._cell: list[str] | None = None
        self._heading: tuple[str, str | None, list[str]] | None = None
        self.feed(doc)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")
        elif tag in ("h1", "h2", "h3"):
            self._heading = (tag, a.get("id"), [])
        elif tag == "img":
            self.images.append(a)
        elif tag == "svg":
            self.svgs.append(a)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag in ("h1", "h2", "h3") and self._heading is not None:
            self.headings.append((self._heading[0], self._heading[1], "".join(self._heading[2]).strip()))
            self._heading = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._heading is not None:
            self._heading[2].append(data)

    def table_after(self, heading: str) -> list[list[str]]:
        """The first table whose header row starts with ``heading``."""
        return next(t for t in self.tables if t and t[0] and t[0][0].startswith(heading))


def assert_validation_page_names_every_expectation(doc: str, suites: list[SuiteResult]) -> None:
    """The validation page shows each suite by name, with its counts, and every expectation's name,
    arguments, observed value and result, in order (nothing blank, no ``suite-0``)."""
    page = Page(doc)
    assert [h[1] for h in page.headings if h[0] == "h2"] == [s.suite for s in suites]
    summary = page.tables[0]
    assert summary[0][:6] == ["suite", "table", "result", "evaluated", "passed", "failed"]
    for row, s in zip(summary[1:], suites, strict=True):
        assert row[0] == s.suite and row[2] == ("pass" if s.success else "FAIL")
        assert row[3:] == [str(s.evaluated), str(s.passed), str(s.failed)]
    for s, t in zip(suites, page.tables[1:], strict=True):
        assert t[0] == ["result", "expectation", "arguments", "observed"]
        assert len(t) - 1 == s.evaluated > 0
        for e, (result, expectation, arguments, observed) in zip(s.expectations, t[1:], strict=True):
            assert result == ("pass" if e.success else "FAIL"), (s.suite, e.type)
            assert expectation.startswith(e.type) and e.type.startswith("expect_"), expectation
            assert e.kwargs, (s.suite, e.type)  # every stored expectation has arguments
            for k, v in e.kwargs.items():
                assert f"{k} = {fmt(v)}" in arguments, (s.suite, e.type, k, arguments)
            assert observed == e.observed_text() and observed not in ("", "\u2014"), (s.suite, e.type, observed)
