"""``scripts/code_report.py``, the size report that replaced the structure test's size caps: it
counts every line of each part, tells shims apart, and ranks modules and classes by length."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_counts_each_part_and_ranks_modules_and_classes(tmp_path):
    pkg = tmp_path / "shmbuf"
    pkg.mkdir()
    (pkg / "big.py").write_text('"""A module."""\n\n\nclass Big:\n    x = 1\n\n    y = 2\n')
    (pkg / "old.py").write_text('"""Deprecated: ``shmbuf.old`` is ``shmbuf.big`` now."""\n')
    (pkg / "_c.c").write_text("int x;\nint y;\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test():\n    pass\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "code_report.py"),
                          str(tmp_path), "--top", "3"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    rows = {line.split()[0]: line.split()[1:5] for line in out.splitlines()[3:8]}
    assert rows["shmbuf/"] == ["2", "8", "1", "2"]  # Python files, lines, C files, lines
    assert rows["tests/"] == ["1", "2", "0", "0"]
    assert rows["code"] == ["2", "8", "1", "2"]  # tests apart
    shims = next(line for line in out.splitlines() if line.endswith("shims of moved modules"))
    assert shims.split()[2:4] == ["1", "1"]  # counted in shmbuf/ as well
    assert "     7  shmbuf/big.py" in out and "     4  shmbuf.big.Big" in out
