"""``examples/sharded_lm.py --smoke``: a tensor-parallel NNX transformer trained at S = 1 and S = 4.

The example trains under a partial-manual ``jax.shard_map`` (only "data" manual; the
parameters split over "model" by the partitioner) until ``τ ≥ T``, checks inside the
program that the momentum of every split weight is split like the weight, and prints one
table row per scale.
"""

from __future__ import annotations

import math
import re

import helpers

BUDGET = 40  # the smoke budget T
ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+"
    r"(?P<loss>[\d.]+|nan|inf)\s+(?P<seconds>[\d.]+)\s*$"
)


def test_sharded_lm_smoke():
    stdout = helpers.run_example("sharded_lm.py", "--smoke")
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"])
    rows = {}
    for line in lines[header + 2 :]:
        match = ROW.match(line)
        if match is None:
            break
        rows[int(match["S"])] = match.groupdict()
    assert sorted(rows) == [1, 4], stdout
    assert "split over 'model'" in stdout  # the parameter shardings were printed
    for scale, row in rows.items():
        tau, gain, loss = float(row["tau"]), float(row["gain"]), float(row["loss"])
        assert tau >= BUDGET, (scale, row)  # trained until τ reached T
        assert 1.0 <= gain <= scale, (scale, row)
        assert math.isfinite(loss) and loss < math.log(256), (scale, row)  # learned more than uniform bytes
    assert int(rows[1]["iterations"]) == BUDGET and float(rows[1]["gain"]) == 1.0  # S = 1: plain SGD
    assert int(rows[4]["iterations"]) < int(rows[1]["iterations"])
    assert int(rows[4]["batch"]) == 4 * int(rows[1]["batch"])
