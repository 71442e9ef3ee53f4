"""``examples/nnx_quickstart.py --smoke``: NNX with micro-batches and with shard_map replicas train alike."""

from __future__ import annotations

import re

from helpers import run_example

BUDGET = 100  # the smoke budget T
ROW = re.compile(
    r"^(?P<run>\S.*?)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+(?P<acc>[\d.]+)%\s+[\d.]+$"
)


def test_nnx_example_smoke():
    stdout = run_example("nnx_quickstart.py", "--smoke")
    rows = {m["run"]: m.groupdict() for m in map(ROW.match, stdout.splitlines()) if m}
    assert list(rows) == ["S=1", "S=8, 8 micro-batches", "S=8, 8 shard_map replicas"], stdout
    base, micro, replicas = rows.values()
    assert int(base["iterations"]) == BUDGET and float(base["gain"]) == 1.0
    assert float(micro["tau"]) >= BUDGET
    assert 1.0 <= float(micro["gain"]) <= 8.0
    assert int(micro["iterations"]) < BUDGET
    # The same 256 examples per step, as 8 micro-batches on one device or as 8 replicas.
    for key in ("iterations", "tau", "gain", "acc"):
        assert micro[key] == replicas[key], key
