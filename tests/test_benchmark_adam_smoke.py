"""The Adam study's smoke mode (``python -m benchmarks.adam --smoke``) runs end to end and writes its report
section and plots."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("adam_curves.png", "adam_gain.png", "adam_lr.png")
METHODS = ("AS-a", "AS-b", "AS-c", "AS-c'", "sqrt", "LSW")


def test_adam_benchmark_smoke_writes_report_and_plots(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    results = tmp_path / "README.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.adam", "--smoke", "--cache", str(tmp_path / "cache"),
         "--results", str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    text = results.read_text()
    assert "<!-- adam:start -->" in text and "<!-- adam:end -->" in text
    assert "<!-- adam-reading:start -->" in text
    section = text[text.index("<!-- adam:start -->") : text.index("<!-- adam:end -->")]
    for heading in ("byte-level transformer LM", "MNIST-1D CNN", "Learning-rate sweep"):
        assert heading in section
    tables = section.split("### ")[2:4]  # the two task tables, in order
    for table in tables:
        rows = [line for line in table.splitlines() if line.startswith("| ")]
        assert any(row.startswith("| 1 | adamw | ") and "—" not in row for row in rows), table
        for method in METHODS:
            assert any(row.startswith(f"| 4 | {method} | ") and "—" not in row for row in rows), (method, table)
    for name in PLOTS:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 0, name
        assert f"plots/{name}" in section
    assert any((tmp_path / "cache").glob("lm_AS-cp_S4_seed0_*.json"))  # cells cached where --cache says
