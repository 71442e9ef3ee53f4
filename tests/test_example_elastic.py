"""``examples/elastic.py --smoke``: scale 2 -> 4 -> 8 through checkpoints, table printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic.py"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def test_elastic_example_smoke_prints_the_phase_table():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--smoke"],
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["phase", "S"])
    rows = [ROW.match(line) for line in lines[header + 1 : header + 4]]
    assert all(rows), result.stdout
    phases = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])) for m in rows]
    assert [p[:2] for p in phases] == [(1, 2), (2, 4), (3, 8)]
    T = 64  # the smoke budget
    for (_, scale, iterations, tau, gain), end in zip(phases, (T / 4, T / 2, T), strict=True):
        assert iterations > 0
        assert tau >= end  # each phase ran until τ reached its boundary
        assert 1.0 <= gain <= scale
    assert phases[0][3] < T / 2 and phases[1][3] < T  # ... and stopped there (one update overshoots at most)
    assert "total:" in lines[-1]
