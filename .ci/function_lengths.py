"""Fail when a function in the package is longer than :data:`LIMIT` lines, counting its decorators and docstring,
or a module of ``deid/`` longer than :data:`MODULE_LIMIT` lines.

A function that reads in one screen is one a reviewer can check (issue 30: "a house the next engineer can live
in"). A longer one is split along its steps into named helpers, each with its numpydoc; background a docstring
carries (proofs, measurements, the paper's discussion) goes to the module docstring, where the whole module's
reader finds it, and the function's numpydoc keeps its Parameters, Returns, Raises and References.

:data:`ALLOWED` lists the functions that were over the limit when this check was introduced and are not yet
split, each with its length then: the list only shrinks. An entry longer than its recorded length fails (it may
not grow), and so does an entry that is now within the limit or gone (take it off the list).

Usage: ``python .ci/function_lengths.py`` from the repository root (``make check`` runs it); exit 1 on a finding.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deid", "flows", "tasks", "schemas")
LIMIT = 80
MODULE_LIMIT = 800  # issue 30: "no module over 800 lines in deid/": a longer one holds more than one room

# "path:qualified name" -> its length in lines when listed. Only ever shrinks.
ALLOWED: dict[str, int] = {}


def lengths(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, lines)`` of every function in ``path``, from its first decorator to its end."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    found.append((name, first, child.end_lineno - first + 1))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def main() -> int:
    problems: list[str] = []
    seen: set[str] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            n_lines = len(path.read_text(encoding="utf-8").splitlines())
            if package == "deid" and n_lines > MODULE_LIMIT:
                problems.append(f"{rel}: {n_lines} lines, over the module limit of {MODULE_LIMIT}: split it along the "
                                "rooms it holds (a module each, named for what it holds)")
            for name, line, n in lengths(path):
                key = f"{rel}:{name}"
                allowed = ALLOWED.get(key)
                if allowed is not None:
                    seen.add(key)
                    if n > allowed:
                        problems.append(f"{rel}:{line}: {name} is {n} lines, more than the {allowed} it had when it "
                                        f"was allowed over {LIMIT}: split it (or at least do not grow it)")
                    elif n <= LIMIT:
                        problems.append(f"{rel}:{line}: {name} is {n} lines, within the limit of {LIMIT}: take "
                                        f"{key!r} off ALLOWED in .ci/function_lengths.py")
                elif n > LIMIT:
                    problems.append(f"{rel}:{line}: {name} is {n} lines counting its decorators and docstring, over "
                                    f"the limit of {LIMIT}: split it along its steps into named helpers (numpydoc "
                                    "each), and move long background from its docstring to the module docstring")
    for key in sorted(set(ALLOWED) - seen):
        problems.append(f"{key}: listed in ALLOWED in .ci/function_lengths.py but not found: take it off the list")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
