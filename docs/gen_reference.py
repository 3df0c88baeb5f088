"""The generated reference tables of the docs site: every ``DEID_*`` setting and every exit code, read from the code.

An mkdocs hook (``hooks:`` in mkdocs.yml): :func:`on_page_markdown` replaces the markers
``<!-- generated: settings -->`` and ``<!-- generated: exit-codes -->`` of a page with
:func:`settings_markdown` (from :class:`deid.settings.Settings`: name, default, valid values, description) and
:func:`exit_codes_markdown` (from :data:`deid.cli.EXIT_MEANINGS`, :data:`deid.cli.EXIT_BY_TYPE` and
:data:`deid.cli.VERIFY_EXIT`, with each exception type's docstring). So the tables cannot drift from the code;
``tests/integration/test_docs_reference.py`` checks that every setting and code is in them and that every ``DEID_*`` name the
code reads is documented.
"""
from __future__ import annotations

import inspect
import types
import typing
from typing import Any

SETTINGS_MARKER = "<!-- generated: settings -->"
EXIT_CODES_MARKER = "<!-- generated: exit-codes -->"

# pydantic's constraint metadata (annotated_types) -> how the table writes it.
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _cell(text: object) -> str:
    """One Markdown table cell: one line, pipes escaped, and ``<...>`` outside code spans shown, not read as HTML."""
    parts = str(text).replace("\n", " ").split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    """A short, readable form of a field's annotation (``int``, ``Path | None``, ``bool | 'auto'``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(repr(a) if not isinstance(a, bool) else str(a).lower() for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        factory = field.default_factory
        return f"`{getattr(factory, '__qualname__', repr(factory))}()`"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _valid(field: Any) -> str:
    """The valid values: the field's bounds (pydantic Field metadata), else its type (Literal choices included)."""
    bounds = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    kind = _type_name(field.annotation)
    return f"{kind}, {' and '.join(bounds)}" if bounds else kind


def settings_rows() -> list[tuple[str, str, str, str]]:
    """(environment variable, default, valid values, description) of every field of :class:`deid.settings.Settings`."""
    from deid.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", ""))
    return [((prefix + name).upper(), _default(field), _valid(field), field.description or "")
            for name, field in Settings.model_fields.items()]


def settings_markdown() -> str:
    """The settings table (Markdown), one row per ``DEID_*`` variable, in the order of :class:`deid.settings.Settings`."""
    lines = ["| variable | default | valid values | what it sets |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {_cell(default)} | {_cell(valid)} | {_cell(text)} |"
              for name, default, valid, text in settings_rows()]
    return "\n".join(lines) + "\n"


def _first_line(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.split("\n\n")[0].replace("\n", " ").strip()


def exit_code_rows() -> list[tuple[int, str, str, str, str]]:
    """(code, constant names, ``deid run`` meaning, ``deid verify`` meaning, exception types) of every exit code."""
    import deid.cli as cli

    names: dict[int, list[str]] = {}
    for name, value in vars(cli).items():
        if name.startswith("EXIT_") and isinstance(value, int) and not isinstance(value, bool):
            names.setdefault(value, []).append(name)
    raised: dict[int, list[str]] = {}
    for kind, code in cli.EXIT_BY_TYPE:
        raised.setdefault(code, []).append(f"`{kind.__name__}`")
    verify: dict[int, str] = {}
    for kind, code in cli.VERIFY_EXIT:
        raised.setdefault(code, []).append(f"`{kind.__name__}`")
        verify[code] = f"`{kind.__name__}`: {_first_line(kind)}"
    codes = sorted({*cli.EXIT_MEANINGS, *names, *raised, *verify})
    rows = []
    for code in codes:
        run, ver = cli.EXIT_MEANINGS.get(code, ("", ""))
        rows.append((code, ", ".join(f"`{n}`" for n in sorted(names.get(code, []))), run or "—",
                     ver or verify.get(code) or "—", ", ".join(raised.get(code, [])) or "—"))
    return rows


def exit_codes_markdown() -> str:
    """The exit-code table (Markdown): every code ``deid`` exits with, what it means per command, what raises it."""
    lines = ["| code | constant | `deid run` | `deid verify` | raised as (exception type) |", "|---|---|---|---|---|"]
    lines += [f"| {code} | {_cell(names) or '—'} | {_cell(run)} | {_cell(ver)} | {_cell(types)} |"
              for code, names, run, ver, types in exit_code_rows()]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: the generated tables in place of their markers."""
    if SETTINGS_MARKER in markdown:
        markdown = markdown.replace(SETTINGS_MARKER, settings_markdown())
    if EXIT_CODES_MARKER in markdown:
        markdown = markdown.replace(EXIT_CODES_MARKER, exit_codes_markdown())
    return markdown
