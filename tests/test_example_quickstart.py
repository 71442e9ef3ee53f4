"""The quickstart example runs end to end (``--smoke``) and prints a plausible results table."""

import pathlib
import subprocess
import sys

import pytest

QUICKSTART = pathlib.Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
COLUMNS = ("S", "batch", "iterations", "tau", "mean gain", "train acc", "test acc", "time (s)")


@pytest.fixture(scope="module")
def smoke_table() -> dict[int, dict[str, float]]:
    """Runs ``quickstart.py --smoke`` once; returns its table as ``{S: {column: value}}``."""
    proc = subprocess.run(
        [sys.executable, str(QUICKSTART), "--smoke"], capture_output=True, text=True, cwd=QUICKSTART.parents[1]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"]]
    assert len(header) == 1, proc.stdout
    rows = {}
    for line in lines[header[0] + 1 :]:
        if not line.split() or not line.split()[0].isdigit():
            break  # the end of the table
        values = [float(v) for v in line.split()]
        assert len(values) == len(COLUMNS), line
        rows[int(values[0])] = dict(zip(COLUMNS, values, strict=True))
    return rows


def test_table_has_one_row_per_scale(smoke_table):
    assert sorted(smoke_table) == [1, 8]
    assert smoke_table[1]["batch"] == 32 and smoke_table[8]["batch"] == 256


def test_single_replica_is_plain_sgd(smoke_table):
    row = smoke_table[1]
    assert row["mean gain"] == 1.0
    assert row["iterations"] == row["tau"]


def test_eight_replicas_take_fewer_iterations_with_gain_in_range(smoke_table):
    s1, s8 = smoke_table[1], smoke_table[8]
    assert 1.0 <= s8["mean gain"] <= 8.0
    assert s8["iterations"] < s1["iterations"]
    # Both runs stop at the same scale-invariant budget; S = 8 overshoots by less than one gain.
    assert s1["tau"] <= s8["tau"] < s1["tau"] + 8.0
    assert s8["iterations"] == pytest.approx(s8["tau"] / s8["mean gain"], abs=1.0)


@pytest.mark.parametrize("scale", [1, 8])
def test_model_learns(scale, smoke_table):
    # Ten classes: chance is 0.1; the smoke budget gets well above it.
    assert 0.2 < smoke_table[scale]["test acc"] <= 1.0
    assert 0.2 < smoke_table[scale]["train acc"] <= 1.0
