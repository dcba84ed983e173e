"""No source text is written, rewritten or run at run time anywhere in the packages (issue 28):
``Writer.add`` exists once, as code a reader can find, and every spec runs that same code (the
per-spec signature is a ``__signature__``, the compiled store a C type, not generated source).
The test reads every file of ``shmbuf`` and ``workers`` (Python, C and stubs) for the calls that
would do it, and checks that the reading finds each of them where they are.
"""

from __future__ import annotations

import pathlib
import re

import shmbuf

ROOT = pathlib.Path(shmbuf.__file__).resolve().parents[1]
PACKAGES = ("shmbuf", "workers")
SUFFIXES = (".py", ".pyi", ".c", ".h")

# Each pattern: what it finds. The builtin compile() only: not re.compile(...), buf.compile(...)
# or a method named compile; no attribute access before exec/eval either.
FORBIDDEN = {
    r"(?<![\w.])(?<!def )exec\s*\(": "exec(): runs source text",
    r"(?<![\w.])(?<!def )eval\s*\(": "eval(): runs source text",
    r"(?<![\w.])(?<!def )compile\s*\(": "compile(): turns source text into code",
    r"\bbuiltins\s*\.\s*(exec|eval|compile)\b": "the same, through builtins",
    r"\bgetsource(lines)?\b": "inspect.getsource: reads source text to rewrite it",
    r"\bCodeType\b|__code__\s*\.\s*replace\b": "code objects made or rewritten",
    r"\bPyRun_\w+|\bPy_CompileString\w*|\bPyEval_EvalCode\w*": "C API that runs source text",
}


def offences(text: str) -> list[str]:
    """What ``FORBIDDEN`` finds in ``text``: 'line N: why'."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, why in FORBIDDEN.items():
            if re.search(pattern, line):
                found.append(f"line {n}: {why}: {line.strip()}")
    return found


def package_files() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
                  if p.suffix in SUFFIXES and p.is_file())


def test_no_file_of_the_packages_writes_or_runs_source_at_run_time():
    files = package_files()
    assert any(p.name == "writer.py" for p in files) and any(p.suffix == ".c" for p in files)
    found = [f"{p.relative_to(ROOT)} {o}" for p in files for o in offences(p.read_text())]
    assert not found, "source generated or run at run time:\n" + "\n".join(found)


def test_the_reading_finds_each_way_of_running_source_and_nothing_else():
    """Each form is found (the test above could not pass by missing it), and the package's
    own uses of the same words (a regex, a buffer's compiled plan) are not."""
    caught = """\
exec(code, scope)
x = eval("1 + 1")
code = compile(source, "<add>", "exec")
text = inspect.getsource(Writer.add)
lines, _ = inspect.getsourcelines(f)
f.__code__.replace(co_varnames=names)
types.CodeType(*args)
PyRun_String(src, Py_file_input, g, l);
Py_CompileStringExFlags(src, "<x>", Py_file_input, NULL, -1);
builtins.exec (code)
"""
    assert len(offences(caught)) == len(caught.splitlines())
    allowed = """\
_NAME = re.compile(r"[a-z]+")
plan = buf.compile(sequence_length=16)
def compile(self, plan=None):
    return self._batches.compile(plan, fields)
execute(task)
evaluate(results)
"""
    assert offences(allowed) == []
