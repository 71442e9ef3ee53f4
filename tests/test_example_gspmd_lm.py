"""``examples/gspmd_lm.py --smoke``: one jit step over the global batch, FSDP × TP, AdaScale at S = 1 and S = 8.

The example trains an NNX byte LM until ``τ ≥ T`` with ``optax_adascale.value_and_grad(...,
data_axes="data", num_microbatches=2)`` on a (data 4, model 2) mesh, and once at S = 1 on
(data 1, model 2). Inside the program it asserts that every optimizer-state leaf has the
sharding given by ``state_partition_specs`` and that some are split. Here we check the table,
and that ``docs/gspmd.md``'s diff from a plain optax step is the example's step.
"""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 30  # the smoke budget T
ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<mesh>\d+x\d+)\s+(?P<k>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+"
    r"(?P<gain>[\d.]+)\s+(?P<train>[\d.]+|nan|inf)\s+(?P<val>[\d.]+|nan|inf)\s+(?P<seconds>[\d.]+)\s*$"
)


def run_smoke(*args: str) -> str:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gspmd_lm.py"), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


def parse_table(stdout: str) -> tuple[float, dict[int, dict[str, str]]]:
    initial = float(re.search(r"Initial validation loss: ([\d.]+)", stdout)[1])
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["S", "mesh", "k", "batch"])
    rows = {}
    for line in lines[header + 2 :]:
        match = ROW.match(line)
        if match is None:
            break
        rows[int(match["S"])] = match.groupdict()
    return initial, rows


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gspmd_lm_smoke(optimizer):
    stdout = run_smoke("--optimizer", optimizer)
    initial, rows = parse_table(stdout)
    assert sorted(rows) == [1, 8], stdout
    assert "P('data', 'model')" in stdout and "P('model', 'data')" in stdout  # FSDP × TP placement printed
    assert (rows[8]["mesh"], rows[8]["k"], int(rows[8]["batch"])) == ("4x2", "2", 8 * int(rows[1]["batch"]))
    for scale, row in rows.items():
        tau, gain, val = float(row["tau"]), float(row["gain"]), float(row["val"])
        assert tau >= BUDGET, (scale, row)  # trained until τ reached T
        assert 1.0 <= gain <= scale, (scale, row)
        assert math.isfinite(val) and val < initial - 0.5, (scale, row, initial)  # it learned
        assert math.isfinite(float(row["train"])), (scale, row)
    assert int(rows[1]["iterations"]) == BUDGET and float(rows[1]["gain"]) == 1.0  # S = 1: the plain optimizer
    assert int(rows[8]["iterations"]) < int(rows[1]["iterations"])  # the same τ in fewer steps
    assert float(rows[8]["val"]) < float(rows[1]["val"]) + 0.1  # and no worse for it


# ---------------------------------------------------------------- the diff in docs/gspmd.md


def docs_diff() -> list[str]:
    text = (ROOT / "docs" / "gspmd.md").read_text()
    section = text[text.index("## The diff from a plain optax step") :]
    return section[section.index("```diff\n") + len("```diff\n") :].split("\n```", 1)[0].splitlines()


def example_region() -> str:
    source = (ROOT / "examples" / "gspmd_lm.py").read_text()
    start = source.index("\n", source.index("# [diff]")) + 1
    return source[start : source.index("# [end diff]")]


def test_docs_diff_is_the_example_step_and_small():
    diff = docs_diff()
    body = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    assert all(line[:1] in (" ", "+", "-") or line == "" for line in body), body
    changed = [line for line in body if line[:1] in "+-"]
    assert 0 < len(changed) <= 10, changed
    new = "\n".join(line[1:] for line in body if line[:1] in (" ", "+") or line == "")
    old = "\n".join(line[1:] for line in body if line[:1] in (" ", "-") or line == "")
    assert new.strip() == example_region().strip()  # the AdaScale side is the example, verbatim
    ast.parse(textwrap.dedent(old))  # the plain side is Python
    assert "optax_adascale" not in old and "microbatch_stats" not in old
