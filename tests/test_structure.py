"""Guard rails for the package structure, read from the source with ``ast`` (nothing is imported).

The rules, over every import in ``shmbuf`` and ``workers`` (module level and inside functions):

(a) no import cycle inside ``shmbuf`` or inside ``workers``. An edge runs from a module to each
    module of the same package that it imports (``from . import layout`` names the submodule,
    ``from shmbuf import Spec`` the package face); importing a submodule is not counted as an
    import of its parent package. Imports under ``if TYPE_CHECKING:`` count: they do not run,
    but a module that names another's types in its signatures sits above it all the same. An
    edge is a violation when its two ends can reach each other.
(b) the storage package never imports the processes: no ``shmbuf`` module imports ``workers``
    (at all, TYPE_CHECKING included). There is one stated exception, and only one: the
    integrations, ``shmbuf/integrations/`` (drop-ins for SB3 and TorchRL), use both packages
    and may import ``workers``, inside functions only (lazy imports: today ``sb3.py``'s, of
    ``SamplerPool`` and ``Workers`` for its optional prefetching). They sit above both packages
    although their import path is ``shmbuf.integrations``, so no other ``shmbuf`` module may
    import them, which this rule checks as well (entered as ``(module,
    "shmbuf.integrations...")``). A module-level import of ``workers`` there is a breach.
(c) ``workers`` never touches a private name of ``shmbuf``. Without types, "a shmbuf object" is
    judged by name: ``recv._x`` (or ``getattr(recv, "_x")``) is a violation when ``recv`` is
    not the bare ``self``/``cls`` and ``_x`` is a private member some ``shmbuf`` class defines
    (a ``def _x`` or ``_x = ...`` in its body, or a ``self._x = ...``). So ``buf._limiter`` and
    ``self._buf._seg`` are caught, while ``self._held`` and a workers object's own privates
    (``w._close_in_child``) are not; a name both packages define counts as shmbuf's (rename it).
    ``from shmbuf._util import _timeout``, ``L._X`` on an imported shmbuf module, and any import
    path with a private part are violations as well, entered as the dotted name.

Sizes are not a rule here: a cap on lines bends the code to fit it (mixins split off to keep a
class short). ``scripts/code_report.py`` reports them (lines of Python and C, files, the largest
modules and classes) for a reader to judge.

``KNOWN_DEBTS`` lists each breach a tree is allowed, and may only shrink (today it is empty).
The test fails on a breach that is not listed and on a listed one that is gone (delete its
entry); the failure prints the allowlist that matches the tree, ready to paste.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shmbuf", "workers")

DEBT_KINDS = {  # kind -> what one entry is (the comment above its list)
    "cycle": "(importer, imported): an import edge that lies on a cycle",
    "shmbuf_imports_workers": "(shmbuf module, workers module)",
    "private_access": "(workers module, private name of shmbuf it touches)",
}

# Written from the tree of the structure work (issue 10); entries go as the debts are paid.
KNOWN_DEBTS: dict[str, Any] = {
    # (importer, imported): an import edge that lies on a cycle
    "cycle": set(),
    # (shmbuf module, workers module)
    "shmbuf_imports_workers": set(),
    # (workers module, private name of shmbuf it touches)
    "private_access": set(),
}


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    """Our modules by dotted name: each ``.py`` file, and each compiled extension by its
    ``.pyi`` stub (``shmbuf._stream_c``: importing it is not importing ``shmbuf``)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted([*(ROOT / pkg).rglob("*.py"), *(ROOT / pkg).rglob("*.pyi")]):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if path.suffix == ".pyi" and name in out:
                continue  # a stub beside its module
            out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


def _imports(name: str, path: Path, tree: ast.Module, modules: dict) -> list[str]:
    """The dotted names a module imports: the submodule where one is named, else the module
    imported from, with a private name kept (``shmbuf._util._timeout``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append(full if full in modules or a.name.startswith("_") else base)
    return out


def _owner(dotted: str, modules: dict) -> str | None:
    """The module of ours that ``dotted`` names or lies in, if any."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _cycle_edges(edges: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges whose two ends can reach each other."""
    reach: dict[str, set[str]] = {}
    for a, b in edges:
        reach.setdefault(a, set()).add(b)
    changed = True
    while changed:
        changed = False
        for targets in reach.values():
            more = set().union(*(reach.get(b, set()) for b in targets)) - targets
            changed |= bool(more)
            targets |= more
    return {(a, b) for a, b in edges if a in reach.get(b, set())}


def _shmbuf_privates(modules: dict) -> set[str]:
    """Private member names that some shmbuf class defines."""
    names = set()
    for mod, (_, tree) in modules.items():
        if not mod.startswith("shmbuf"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(item.name)
                    for target in getattr(item, "targets", [getattr(item, "target", None)]):
                        names.add(getattr(target, "id", ""))
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_access(imports: list[str], tree: ast.Module, privates: set[str],
                    modules: dict) -> set[str]:
    """The shmbuf private names a workers module touches (see (c) above)."""
    found = {d for d in imports if d.startswith("shmbuf.") and "._" in f".{d}"}
    module_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                full = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                if full.startswith("shmbuf") and full in modules:
                    module_aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver, attr = node.value, node.attr
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") in
              ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            receiver, attr = node.args[0], node.args[1].value
        else:
            continue
        bare = receiver.id if isinstance(receiver, ast.Name) else None
        if not attr.startswith("_") or attr.startswith("__"):
            continue
        if bare in module_aliases or (attr in privates and bare not in ("self", "cls")):
            found.add(attr)
    return found


INTEGRATIONS = "shmbuf.integrations"


def _only_in_functions(tree: ast.Module, package: str) -> bool:
    """True if every import of ``package`` in ``tree`` sits inside a function body."""
    def imports(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] == package for a in node.names)
        return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package

    in_functions = {id(n) for f in ast.walk(tree)
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f)}
    return all(id(n) in in_functions for n in ast.walk(tree) if imports(n))


def current_debts() -> dict[str, Any]:
    """Every breach of the rules in the tree as it is now, in ``KNOWN_DEBTS``'s form."""
    modules = _modules()
    privates = _shmbuf_privates(modules)
    debts: dict[str, Any] = {k: set() for k in DEBT_KINDS}
    edges = set()
    for mod, (path, tree) in modules.items():
        package = mod.split(".")[0]
        imports = _imports(mod, path, tree, modules)
        for dotted in imports:
            target = _owner(dotted, modules)
            if target is None or target == mod:
                continue
            above = mod.startswith(INTEGRATIONS)  # (b)'s exception: a leaf above both
            if package == "shmbuf" and target.startswith("workers") and not (
                    above and _only_in_functions(tree, "workers")):
                debts["shmbuf_imports_workers"].add((mod, target))
            if package == "shmbuf" and target.startswith(INTEGRATIONS) and not above:
                debts["shmbuf_imports_workers"].add((mod, target))
            if target.split(".")[0] == package:
                edges.add((mod, target))
        if package == "workers":
            debts["private_access"] |= {(mod, name) for name in
                                        _private_access(imports, tree, privates, modules)}
    debts["cycle"] = _cycle_edges(edges)
    return debts


def format_debts(debts: dict[str, Any]) -> str:
    """``debts`` as the Python source of ``KNOWN_DEBTS``, one entry a line."""
    out = ["KNOWN_DEBTS: dict[str, Any] = {"]
    for kind, what in DEBT_KINDS.items():
        entries = debts[kind]
        out.append(f"    # {what}")
        kind = _lit(kind)
        lines = [f"        {_lit(e)}," for e in sorted(entries)]
        out += [f"    {kind}: {{", *lines, "    },"] if lines else [f"    {kind}: set(),"]
    return "\n".join([*out, "}"])


def _lit(value: Any) -> str:
    """``repr`` with double quotes (no name here holds a quote)."""
    return repr(value).replace("'", '"')


def test_structure_debts_only_shrink():
    """No new cycle, layering breach or private access."""
    now = current_debts()
    problems = []
    for kind in DEBT_KINDS:
        known, found = KNOWN_DEBTS.get(kind, set()), now[kind]
        problems += [f"new {kind}: {key!r}" for key in sorted(found) if key not in known]
        problems += [f"paid off, delete it from KNOWN_DEBTS[{kind!r}]: {key!r}"
                     for key in sorted(known) if key not in found]
    if problems:
        advice = ("KNOWN_DEBTS for the tree as it is now (paste it in tests/test_structure.py, "
                  "if each new entry is a debt you mean to take on):")
        pytest.fail("\n".join([*problems, "", advice, "", format_debts(now)]), pytrace=False)


def test_the_rules_catch_what_they_name():
    """Controls: each rule fires on a small example of its breach (and not on the allowed form)."""
    modules = _modules()
    snippet = ast.parse(
        "from shmbuf import layout as L\nfrom shmbuf._util import _timeout\n"
        "def f(self, buf):\n    import shmbuf.segment\n    buf._limiter.wait()\n"
        "    self._buf._seg\n    getattr(buf, '_q')\n    L._private\n    self._held\n"
        "    w._close_in_child()\n")
    imports = _imports("workers.x", ROOT / "workers/x.py", snippet, modules)
    assert "shmbuf.segment" in imports and "shmbuf.layout" in imports
    found = _private_access(imports, snippet, {"_limiter", "_seg", "_q"}, modules)
    assert found == {"shmbuf._util._timeout", "_limiter", "_seg", "_q", "_private"}
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}
    assert _cycle_edges(edges) == {("a", "b"), ("b", "c"), ("c", "a")}
    assert len(_shmbuf_privates(modules)) > 20  # the names (c) relies on were found


def test_the_integrations_exception_is_narrow():
    """(b)'s exception holds only for imports of ``workers`` inside functions of
    ``shmbuf.integrations``: a module-level one is still a breach."""
    lazy = ast.parse("import numpy\ndef f():\n    from workers import SamplerPool\n")
    eager = ast.parse("from workers import SamplerPool\ndef f():\n    pass\n")
    assert _only_in_functions(lazy, "workers") and not _only_in_functions(eager, "workers")
    assert "shmbuf.integrations.sb3" in _modules()  # the rule sees the package it exempts
