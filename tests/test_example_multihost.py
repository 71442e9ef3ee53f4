"""``examples/multihost.py --smoke`` as two real processes (4 CPU devices each), launched as its docstring says."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import multihost_worker
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multihost.py"
NUM_PROCESSES = 2


def test_multihost_example_smoke_runs_on_two_processes(tmp_path):
    def command(pid: int, coordinator: str) -> list[str]:
        return [
            sys.executable,
            EXAMPLE,
            f"--coordinator={coordinator}",
            f"--num-processes={NUM_PROCESSES}",
            f"--process-id={pid}",
            "--cpu-devices=4",
            "--smoke",
        ]

    try:
        outputs = multihost_worker.run_processes(command, NUM_PROCESSES, tmp_path, timeout=150)
    except RuntimeError as err:
        pytest.fail(str(err))
    assert "2 process(es), 8 devices (4 local): S = 8" in outputs[0]
    done = re.search(r"done: (\d+) iterations at S = 8 for tau = ([\d.]+) base steps", outputs[0])
    assert done, outputs[0]
    assert float(done.group(2)) >= 40 and int(done.group(1)) < 40  # fewer iterations than base steps
    assert "done:" not in outputs[1]  # only process 0 prints
