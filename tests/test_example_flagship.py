"""``examples/train_mnist1d.py --smoke``: table printed, PNG written, every mesh trains the same.

The example draws the same batches under ``--mesh shard_map``, ``pmap``, ``gspmd`` and ``vmap``
(all replicas on one device, as on a single GPU), so four parallel mechanisms must print the same iterations, τ, gains,
accuracies and losses (to the printed precision).
"""

from __future__ import annotations

import re
from pathlib import Path

import helpers
import pytest

BUDGET = 150  # the smoke budget T
ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+"
    r"(?P<acc>[\d.]+)%\s+(?P<loss>[\d.]+)\s+(?P<seconds>[\d.]+)\s*$"
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(out: Path, *args: str) -> tuple[dict[int, dict[str, str]], Path]:
    """Run the smoke example; return its table rows by S and the PNG path."""
    stdout = helpers.run_example("train_mnist1d.py", "--smoke", "--out", str(out), *args)
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"])
    rows = {}
    for line in lines[header + 2 :]:
        match = ROW.match(line)
        if match is None:
            break
        rows[int(match["S"])] = match.groupdict()
    png = out / "adascale_mnist1d.png"
    assert f"wrote {png}" in stdout
    return rows, png


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default run (``--mesh shard_map``, S = 1, 8, 32), shared by the tests below."""
    return run_example(tmp_path_factory.mktemp("shard_map"))


def test_flagship_smoke_prints_the_table_and_writes_the_png(default_run):
    rows, png = default_run
    assert sorted(rows) == [1, 8, 32]
    assert png.read_bytes()[:8] == PNG_MAGIC
    for scale, row in rows.items():
        assert int(row["batch"]) == 32 * scale
        tau, gain, iterations = float(row["tau"]), float(row["gain"]), int(row["iterations"])
        assert tau >= BUDGET  # trained until τ reached the budget...
        assert 1.0 <= gain <= scale  # ...with gains in [1, S]
        assert tau == pytest.approx(gain * iterations, abs=0.01 * iterations)  # τ is the sum of the gains
        assert 0.0 <= float(row["acc"]) <= 100.0


def test_flagship_smoke_s1_is_plain_sgd(default_run):
    rows, _ = default_run
    assert int(rows[1]["iterations"]) == BUDGET
    assert float(rows[1]["tau"]) == BUDGET
    assert float(rows[1]["gain"]) == 1.0


def test_flagship_smoke_larger_scale_takes_fewer_iterations(default_run):
    rows, _ = default_run
    assert int(rows[32]["iterations"]) < int(rows[8]["iterations"]) < int(rows[1]["iterations"])


@pytest.mark.parametrize("mesh", ["pmap", "gspmd", "vmap"])
def test_flagship_smoke_mesh_matches_shard_map(mesh, default_run, tmp_path):
    rows, png = run_example(tmp_path, "--mesh", mesh, "--scales", "8", "32")
    assert png.read_bytes()[:8] == PNG_MAGIC
    reference, _ = default_run
    for scale in (8, 32):
        for key in ("iterations", "tau", "gain", "acc", "loss"):
            assert rows[scale][key] == reference[scale][key], (mesh, scale, key)
