"""The house as the docs describe it: the dependency rule's greps in
``docs/ARCHITECTURE.md`` find nothing, and every repository path and ``file: name`` that
``README.md`` and ``docs/*.md`` cite exists (the docs cannot drift from the code unseen)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _rule_greps() -> list[str]:
    text = ARCHITECTURE.read_text()
    section = text[text.index("## The dependency rule") :]
    start = section.index("```bash") + len("```bash")
    block = section[start : section.index("```", start)]
    return [line for line in block.strip().splitlines() if line.startswith("grep ")]


def test_the_dependency_rule_has_greps() -> None:
    assert len(_rule_greps()) >= 8


@pytest.mark.parametrize("command", _rule_greps())
def test_a_grep_of_the_dependency_rule_finds_nothing(command: str) -> None:
    found = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert found.returncode == 1 and not found.stdout, found.stdout or found.stderr


_PATH = re.compile(
    r"`((?:store|transfer|bindings|tools|tests|benches|docs|kvbridge)/[A-Za-z0-9_./-]*)"
    r"(?::\s*([A-Za-z_][A-Za-z0-9_.]*))?`"
)
"""A repository path in backquotes, optionally followed by ``: Name`` or ``: Class.method``
inside the same backquotes (what the docs' ``file: function`` references look like)."""


def _cited() -> list[tuple[str, str, str | None]]:
    found = []
    for doc in DOCS:
        for match in _PATH.finditer(doc.read_text()):
            path, name = match.group(1), match.group(2)
            if "*" in path or "_x." in path:  # a pattern or a placeholder, not a path
                continue
            found.append((doc.name, path.split("::")[0], name))
    return found


_FILE = re.compile(r"`([A-Za-z0-9_.-]+\.(?:md|py|sh|toml|json|txt))`")
"""A bare file name in backquotes (``ENGINE_FACTS.md``, ``_metrics.py``)."""


def _bare_names() -> list[tuple[str, str]]:
    return [(doc.name, match.group(1)) for doc in DOCS for match in _FILE.finditer(doc.read_text())]


def _repository_files() -> set[str]:
    """The names of the repository's files (its folders, not virtual environments or
    build output)."""
    names: set[str] = set()
    for folder in ("store", "transfer", "bindings", "tools", "tests", "benches", "docs", ".ci"):
        names.update(path.name for path in (ROOT / folder).rglob("*") if path.is_file())
    for top in (ROOT, ROOT / "kvbridge"):  # kvbridge/: the package's own files beside links
        names.update(path.name for path in top.iterdir() if path.is_file())
    return names


def _bad_path(doc: str, path: str, name: str | None) -> str | None:
    """What is wrong with ``doc`` citing ``path`` (and ``name`` in it), or None."""
    target = ROOT / path.rstrip("/")
    if not target.exists():
        return f"{doc} cites {path}, which is not in the repository"
    if name is not None and target.suffix == ".py" and not _defines(target, name):
        return f"{doc} cites {path}: {name}, which it does not define"
    return None


def test_every_path_and_file_name_the_docs_cite_exists() -> None:
    """Every cited path exists and defines the name cited with it, and every bare file name
    is a file of the repository; each bad citation is listed."""
    cited = _cited()
    assert len(cited) > 50
    wrong = [why for why in (_bad_path(*citation) for citation in cited) if why is not None]
    files = _repository_files()
    wrong += [
        f"{doc} cites {name}, which is not in the repository"
        for doc, name in _bare_names()
        if name not in files
    ]
    assert not wrong, f"{len(wrong)} bad citations:\n" + "\n".join(wrong)


def _defines(path: Path, dotted: str) -> bool:
    """Whether the module defines ``dotted``: a top-level name, or ``Class.member``."""
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        node = next((n for n in scope if _named(n, part)), None)
        if node is None:
            return False
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _named(node: ast.stmt, name: str) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False
