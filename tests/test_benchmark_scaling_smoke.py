"""The scaling study's smoke mode (``python -m benchmarks.scaling --smoke``) runs end to end and writes its
report and plots."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("scaling_curves.png", "scaling_lr.png", "scaling_gain.png", "scaling_elastic.png", "scaling_tracking.png")


def test_scaling_benchmark_smoke_writes_report_and_plots(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scaling", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    report = (tmp_path / "README.md").read_text()
    for method in ("AS", "LSW+", "LSW"):
        assert f"| {method} val. accuracy (%) |" in report
    for heading in (
        "MNIST-1D MLP",
        "digits MLP",
        "noisy linear regression",
        "Elastic AdaScale",
        "Gain estimates",
        "A gain that keeps up",
        "Iterations at equal quality",
    ):
        assert heading in report
    assert "| `AS-H(T/100)+unfloored` |" in report  # an estimator variant (the benchmark's prototype)
    for name in PLOTS:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 0, name
        assert f"plots/{name}" in report
    assert "Command: `python -m benchmarks.scaling --smoke --out " in report
    assert not (tmp_path / ".cache").exists()  # smoke mode caches nothing
