"""The docs site's reference tables cannot drift from the code (issue 30): every ``DEID_*`` setting and every exit
code is in the tables docs/gen_reference.py generates, and every ``DEID_*`` name the code reads is documented."""
from __future__ import annotations

import html
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(table: str) -> list[list[str]]:
    """The body rows of a generated Markdown table, split into cells (escaped pipes kept inside their cell)."""
    lines = table.strip().splitlines()[2:]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]


def test_every_setting_has_a_documented_row(gen):
    from deid.settings import Settings

    rows = {r[0].strip("`"): r for r in _rows(gen.settings_markdown())}
    expected = {f"DEID_{name.upper()}" for name in Settings.model_fields}
    assert set(rows) == expected
    for name, (_, default, valid, text) in rows.items():
        assert default and valid, name
        assert len(text) >= 10, f"{name} has no description in deid/settings.py (Field(description=...))"
    # The bounds come from the Field metadata: k's declared range is in its row.
    assert html.unescape(rows["DEID_K"][2]) == "int, >= 2 and <= 1000" and rows["DEID_K"][1] == "`5`"


def test_every_exit_code_is_in_the_table(gen):
    import deid.cli as cli

    codes = {int(r[0]): r for r in _rows(gen.exit_codes_markdown())}
    constants = {v for k, v in vars(cli).items() if k.startswith("EXIT_") and isinstance(v, int)}
    declared = constants | {c for _, c in cli.EXIT_BY_TYPE} | {c for _, c in cli.VERIFY_EXIT}
    assert set(codes) == declared | set(cli.EXIT_MEANINGS)
    for code, (_, _, run, verify, _) in codes.items():
        assert run != "—" or verify != "—", f"exit code {code} has no meaning for any command (deid.cli.EXIT_MEANINGS)"
    for kind, code in cli.VERIFY_EXIT:
        assert kind.__name__ in codes[code][3]
    assert "`StateError`" in codes[cli.EXIT_STATE][4] and "`OSError`" in codes[cli.EXIT_ENVIRONMENT][4]


def test_every_deid_variable_the_code_reads_is_documented(gen):
    """A ``DEID_*`` name anywhere in the package's source is in the generated settings table or on a docs page."""
    documented = gen.settings_markdown() + "".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    used = set()
    for path in (ROOT / "deid").rglob("*.py"):
        used |= set(re.findall(r"(?<![A-Z0-9_])DEID_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    assert used, "no DEID_ name found in deid/: the scan is broken"
    missing = sorted(name for name in used if not re.search(rf"\b{name}\b", documented))
    assert not missing, f"DEID_ names the code reads but no docs page documents: {missing}"


def test_the_pages_carry_the_markers_and_the_site_runs_the_hook(gen):
    assert gen.SETTINGS_MARKER in (DOCS / "settings.md").read_text(encoding="utf-8")
    assert gen.EXIT_CODES_MARKER in (DOCS / "exit-codes.md").read_text(encoding="utf-8")
    assert "docs/gen_reference.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    page = gen.on_page_markdown("a\n" + gen.SETTINGS_MARKER + "\nb\n" + gen.EXIT_CODES_MARKER + "\n")
    assert "`DEID_K`" in page and "| 130 |" in page and "generated:" not in page
