"""``examples/elastic.py --smoke``: scale 2 -> 4 -> 8 through checkpoints, table printed."""

from __future__ import annotations

import re

from helpers import run_example

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def test_elastic_example_smoke_prints_the_phase_table():
    stdout = run_example("elastic.py", "--smoke", timeout=150)
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["phase", "S"])
    rows = [ROW.match(line) for line in lines[header + 1 : header + 4]]
    assert all(rows), stdout
    phases = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])) for m in rows]
    assert [p[:2] for p in phases] == [(1, 2), (2, 4), (3, 8)]
    T = 64  # the smoke budget
    for (_, scale, iterations, tau, gain), end in zip(phases, (T / 4, T / 2, T), strict=True):
        assert iterations > 0
        assert tau >= end  # each phase ran until τ reached its boundary
        assert 1.0 <= gain <= scale
    assert phases[0][3] < T / 2 and phases[1][3] < T  # ... and stopped there (one update overshoots at most)
    assert "total:" in lines[-1]
