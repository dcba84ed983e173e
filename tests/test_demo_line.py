"""The demos' live line: drawn every 2 s in a log (0.5 s on a terminal, in place), rates over
the interval since the last line, and the summary's opening."""

from __future__ import annotations

import pytest

from workers.demo import line as demo_line
from workers.demo.line import LiveLine


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock the test moves by hand."""
    now = [100.0]
    monkeypatch.setattr(demo_line.time, "monotonic", lambda: now[0])
    return now


def test_log_line_every_two_seconds_with_rates_since_the_last(clock, capsys):
    line = LiveLine(batch_bytes=1_000_000, tty=False)
    clock[0] += 1.9
    assert line.due() is None and line.elapsed() == pytest.approx(1.9)
    clock[0] += 0.1
    assert line.due() == pytest.approx(2.0)
    line.show(batches=400, inserts=10_000, columns="buffer 7")
    clock[0] += 4.0
    assert line.due() == pytest.approx(4.0)
    line.show(batches=600, inserts=30_000, columns="x")
    line.close()  # nothing to end in a log
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "inserts/s     5,000 | batches/s     200 |  0.20 GB/s | buffer 7",
        "inserts/s     5,000 | batches/s      50 |  0.05 GB/s | x",
    ]


def test_terminal_line_every_half_second_drawn_in_place(clock, capsys):
    line = LiveLine(batch_bytes=10, tty=True)
    clock[0] += 0.5
    assert line.due() == pytest.approx(0.5)
    line.show(batches=1, inserts=1, columns="c")
    line.close()
    assert capsys.readouterr().out == ("\rinserts/s         2 | batches/s       2 |  0.00 GB/s | c"
                                       "\n")


def test_summary_opening():
    line = LiveLine(batch_bytes=2_000_000, tty=False)
    assert line.summary(1_000, 2.0) == ("summary: 1,000 batches in 2.0 s (500/s, 1.00 GB/s to "
                                        "the learner")
