"""``scripts/bench_hot.py``, the side-by-side table of ``make bench``'s hot rows: against another
checkout (``--base``) or against this one with a compiled extension switched off
(``--base-env``). No timing is asserted: the table's ratio is the ratio of the medians it
prints, and a malformed ``--base-env`` is refused before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "bench_hot.py")

pytestmark = pytest.mark.timeout(120)


def test_the_base_env_side_runs_this_checkout_and_the_ratio_is_of_the_printed_medians():
    out = subprocess.run([sys.executable, SCRIPT, "--rounds", "2", "--only", "add mujoco",
                          "--base-env", "SHMBUF_STORE=numpy"], capture_output=True, text=True,
                         timeout=100, check=True).stdout
    assert "base with {'SHMBUF_STORE': 'numpy'}" in out.splitlines()[0]
    row = next(line for line in out.splitlines() if line.startswith("add mujoco"))
    cells = row.split()
    new, base, ratio = float(cells[3]), float(cells[5]), float(cells[7])
    assert new > 0 and base > 0
    rounding = 0.005 + new / base * (0.005 / new + 0.005 / base)  # each printed to 2 places
    assert ratio == pytest.approx(new / base, abs=rounding)


def test_a_base_env_without_a_value_is_refused():
    run = subprocess.run([sys.executable, SCRIPT, "--base-env", "SHMBUF_STORE"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--base-env takes NAME=VALUE, got ['SHMBUF_STORE']" in run.stderr
