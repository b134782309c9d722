"""Code of the installed sglang, compiled here without importing its module.

Some of SGLang's modules cannot be imported on a machine without its GPU runtime (their
imports reach CUDA kernels), though the code a storage backend meets in them is plain
Python and torch. ``compiled`` reads such a module's file from the installed wheel and
compiles the named classes, or the named methods of one class, unchanged; ``subclass``
compiles methods of one class into a class of the same name over a given base, for
methods that call ``super()``.
"""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _source(module: str) -> tuple[Path, str]:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    root = Path(spec.submodule_search_locations[0]).parent
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    return path, path.read_text()


def compiled(
    module: str, names: Iterable[str], scope: dict[str, Any], *, within: str | None = None
) -> dict[str, Any]:
    """The top-level definitions ``names`` of ``module`` (or, with ``within``, the methods
    of that class), compiled in ``scope`` (the globals they use), in file order."""
    path, text = _source(module)
    lines = text.splitlines()
    body = ast.parse(text).body
    if within is not None:
        (cls,) = (n for n in body if isinstance(n, ast.ClassDef) and n.name == within)
        body = cls.body
    wanted, found = set(names), {}
    for node in body:
        name = getattr(node, "name", None)
        if name in wanted:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            code = textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))
            exec(compile(code, str(path), "exec"), scope)
            found[name] = scope[name]
    missing = wanted - set(found)
    assert not missing, f"{module} has no {sorted(missing)} (another sglang version?)"
    return found


def subclass(
    module: str, within: str, names: Iterable[str], scope: dict[str, Any], base: type
) -> type:
    """The methods ``names`` of class ``within`` of ``module``, compiled unchanged in a class
    of that name over ``base`` (so that their ``super()`` calls reach ``base``), with
    ``scope`` as their globals."""
    path, text = _source(module)
    lines = text.splitlines()
    (cls,) = (n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == within)
    wanted, parts = set(names), []
    for node in cls.body:
        if getattr(node, "name", None) in wanted:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            parts.append("\n".join(lines[first - 1 : node.end_lineno]))
            wanted.discard(node.name)  # type: ignore[attr-defined]
    assert not wanted, f"{module}.{within} has no {sorted(wanted)} (another sglang version?)"
    code = f"class {within}(__base__):\n" + "\n".join(parts)
    where = {**scope, "__base__": base}
    exec(compile(code, str(path), "exec"), where)
    made: type = where[within]
    return made
