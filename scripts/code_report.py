#!/usr/bin/env python
"""How big the code is: physical lines and files of Python per part (``shmbuf/``, ``workers/``,
``scripts/``, with ``tests/`` apart) and of C, then the largest modules and classes. The shims
that keep moved modules' old paths for a release (a module docstring opening "Deprecated:") are
counted in their part and also shown apart.

A report, not a rule: nothing fails on a size. Run it on any tree, e.g. an old commit's:

    python scripts/code_report.py [ROOT] [--top N]
    git archive df9ff63 | tar -x -C /tmp/x && python scripts/code_report.py /tmp/x
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

PARTS = ("shmbuf", "workers", "scripts")  # the code; tests are counted apart
TESTS = "tests"
C_SUFFIXES = (".c", ".h")


@dataclass(frozen=True)
class Tally:
    """Files and physical lines (every line, blank and comment ones included)."""

    files: int = 0
    lines: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.files + other.files, self.lines + other.lines)


def physical_lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


def files_of(root: Path, part: str, suffixes: tuple[str, ...]) -> list[Path]:
    """The files under ``root/part`` whose names end in ``suffixes`` (build outputs and caches
    left out)."""
    base = root / part
    if not base.is_dir():
        return []
    return sorted(p for p in base.rglob("*") if p.suffix in suffixes and p.is_file()
                  and "__pycache__" not in p.parts and "build" not in p.relative_to(root).parts)


def tally(paths: list[Path]) -> Tally:
    return Tally(len(paths), sum(physical_lines(p) for p in paths))


def is_shim(path: Path) -> bool:
    """A deprecated module kept for its old import path (its docstring says so first)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    except SyntaxError:
        return False
    return bool(doc and doc.startswith("Deprecated:"))


def classes_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(lines, ``module.Class``) of every class in ``path``, nested ones included."""
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    try:
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError:
        return []
    return [(node.end_lineno - node.lineno + 1, f"{module}.{node.name}")
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None]


def report(root: Path, top: int) -> str:
    out = [f"code report of {root}", "",
           f"{'part':<12}{'Python files':>14}{'lines':>9}{'C files':>10}{'lines':>9}"]
    python_total = c_total = Tally()
    for part in (*PARTS, TESTS):
        py, c = tally(files_of(root, part, (".py",))), tally(files_of(root, part, C_SUFFIXES))
        if part != TESTS:
            python_total, c_total = python_total + py, c_total + c
        out.append(f"{part + '/':<12}{py.files:>14}{py.lines:>9}{c.files:>10}{c.lines:>9}")
    out.append(f"{'code':<12}{python_total.files:>14}{python_total.lines:>9}"
               f"{c_total.files:>10}{c_total.lines:>9}   (shmbuf/ + workers/ + scripts/)")
    code = [p for part in PARTS for p in files_of(root, part, (".py",))]
    shims = tally([p for p in code if is_shim(p)])
    out.append(f"{'of which':<12}{shims.files:>14}{shims.lines:>9}   shims of moved modules")
    modules = sorted(((physical_lines(p), str(p.relative_to(root))) for p in code), reverse=True)
    classes = sorted((c for p in code for c in classes_of(p, root)), reverse=True)
    out += ["", f"largest modules (of {len(modules)}):"]
    out += [f"  {n:>6}  {name}" for n, name in modules[:top]]
    out += ["", f"largest classes (of {len(classes)}):"]
    out += [f"  {n:>6}  {name}" for n, name in classes[:top]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the tree to measure (default: this checkout)")
    p.add_argument("--top", type=int, default=10, help="largest modules and classes shown")
    args = p.parse_args(argv)
    print(report(args.root.resolve(), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
