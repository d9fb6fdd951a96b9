"""Rules of how production code reads (STYLE.md), checked on the source: no layout pragma or
function-level import without a comment saying why, and a docstring on every package.

Production code: every first-party package (pyproject.toml's import-linter `root_packages`),
migrations left out. Each rule runs per package, and a failure lists each offender as
path:line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]
)
# A comment that only silences a tool says nothing about why.
PRAGMA_ONLY = re.compile(r"#\s*(noqa(:\s*[A-Z0-9, ]+)?|type:\s*ignore(\[[^\]]*\])?|fmt:\s*\w+)\s*")


def _sources(package: str) -> Iterator[Path]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "migrations" not in path.relative_to(ROOT).parts:
            yield path


def _comments(source: str) -> dict[int, list[str]]:
    """Each line's comments (real comments: a `#` inside a string is not one)."""
    out: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.setdefault(tok.start[0], []).append(tok.string)
    return out


def _segments(comment: str) -> list[str]:
    """`# fmt: skip  # why` -> ["# fmt: skip", "# why"] (ruff reads pragmas the same way)."""
    return ["#" + part for part in comment.split("#")[1:]]


def _is_reason(comment: str) -> bool:
    return any(not PRAGMA_ONLY.fullmatch(seg.strip()) for seg in _segments(comment))


def _is_skip(comment: str) -> bool:
    return any(re.fullmatch(r"#\s*fmt:\s*(skip|off)", seg.strip()) for seg in _segments(comment))


def _comment_line(lines: list[str], lineno: int) -> bool:
    """Line `lineno` (1-based) is a comment of its own that says something."""
    text = lines[lineno - 1].strip() if lineno >= 1 else ""
    return text.startswith("#") and _is_reason(text)


def _innermost_statement(tree: ast.AST, lineno: int) -> ast.stmt:
    covering = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt) and node.lineno <= lineno <= (node.end_lineno or 0)
    ]
    return max(covering, key=lambda node: node.lineno)


def unexplained_fmt_skips(path: Path) -> list[str]:
    """`# fmt: skip` (or `# fmt: off`) needs its reason: a further comment on the same line
    (`# fmt: skip  # a table read across`) or a comment line right above the statement it
    applies to."""
    source = path.read_text()
    comments = _comments(source)
    if not any(_is_skip(c) for cs in comments.values() for c in cs):
        return []
    tree, lines = ast.parse(source), source.splitlines()
    out = []
    for lineno, found in sorted(comments.items()):
        for comment in found:
            if not _is_skip(comment):
                continue
            if _is_reason(comment):  # `# fmt: skip  # why`: the reason on the same line
                continue
            if lines[lineno - 1].strip().startswith("#"):  # `# fmt: off` on a line of its own
                first = lineno
            else:
                first = _innermost_statement(tree, lineno).lineno
            if not _comment_line(lines, first - 1):
                out.append(f"{path.relative_to(ROOT)}:{lineno}")
    return out


def _function_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    def visit(node: ast.AST, in_function: bool) -> Iterator[ast.Import | ast.ImportFrom]:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            yield from visit(child, inner)

    yield from visit(tree, False)


def _first_party(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
    return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)


def unexplained_function_imports(path: Path) -> list[str]:
    """A first-party import inside a function needs a comment saying why (start-up cost:
    STYLE.md, Boundaries): on one of its own lines, or on the line above it. Imports one
    after another (blank lines between them allowed) share the comment above the first."""
    source = path.read_text()
    tree = ast.parse(source)
    imports = list(_function_imports(tree))
    if not any(_first_party(node) for node in imports):
        return []
    comments, lines = _comments(source), source.splitlines()
    ends = {node.end_lineno: node for node in imports}

    def explained(node: ast.Import | ast.ImportFrom) -> bool:
        own = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if any(_is_reason(c) for line in own for c in comments.get(line, [])):
            return True
        above = node.lineno - 1
        while above >= 1 and not lines[above - 1].strip():
            above -= 1
        if _comment_line(lines, above):
            return True
        return above in ends and explained(ends[above])

    return [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for node in imports
        if _first_party(node) and not explained(node)
    ]


def _packages(package: str) -> Iterator[Path]:
    for init in sorted((ROOT / package).rglob("__init__.py")):
        parts = init.relative_to(ROOT).parts
        # Django's command folders are named by the framework, their modules by the commands.
        if "migrations" not in parts and "management" not in parts:
            yield init


def undocumented_packages(package: str) -> list[str]:
    """Every package's `__init__` has a docstring (what lives there); a top-level package's
    also says what it may import (the import-linter layers, pyproject.toml)."""
    out = []
    for init in _packages(package):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        where = init.relative_to(ROOT)
        if not doc.strip():
            out.append(f"{where}: no docstring")
        elif init.parent == ROOT / package and "import" not in doc:
            out.append(f"{where}: the docstring does not say what the package may import")
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_fmt_skip_says_why(package):
    offenders = [o for path in _sources(package) for o in unexplained_fmt_skips(path)]
    assert not offenders, "a `# fmt: skip` without a comment saying why:\n" + "\n".join(offenders)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_first_party_import_in_a_function_says_why(package):
    offenders = [o for path in _sources(package) for o in unexplained_function_imports(path)]
    assert not offenders, (
        "a first-party import inside a function without a comment saying why (start-up cost "
        "only; a cycle is fixed by moving code):\n" + "\n".join(offenders)
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_what_lives_there(package):
    offenders = undocumented_packages(package)
    assert not offenders, "\n".join(offenders)
