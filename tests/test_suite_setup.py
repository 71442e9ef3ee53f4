"""The suite's own setup (tests/conftest.py, pyproject's pytest options): what keeps it alive on a loaded machine.

Eight fake CPU devices on two busy cores: XLA:CPU gives a collective 40 s by default before it aborts the process,
and pytest-xdist 3.8 under ``--dist loadgroup`` waits forever after replacing a crashed worker (CONTRIBUTING.md).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness import xla


def _seconds(flag: str) -> int:
    found = re.findall(rf"--{flag}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    assert found, f"--{flag} is not in XLA_FLAGS: {os.environ.get('XLA_FLAGS')!r}"
    return int(found[-1])


def test_this_jax_gives_a_collective_minutes_before_it_aborts():
    # conftest adds the flags only where this XLA accepts them: a release that drops one fails here, not on a
    # loaded CI machine. XLA's defaults are 20 s (the warning) and 40 s (the abort).
    assert _seconds("xla_cpu_collective_call_warn_stuck_timeout_seconds") >= 60
    assert _seconds("xla_cpu_collective_call_terminate_timeout_seconds") >= 300


@pytest.mark.slow  # starts pytest with two workers
def test_a_crashed_worker_ends_the_run_naming_its_test(tmp_path):
    """A worker that dies mid-test (XLA aborting the process) ends the run red, naming the test, under the project's
    own pytest options (pyproject.toml: ``-n auto --dist loadgroup --max-worker-restart=0``); pytest-xdist 3.8 would
    otherwise replace it and wait forever (its issues #1323 and #1327). The run gets 120 s; it takes a few."""
    pytest.importorskip("xdist")
    (tmp_path / "test_crash.py").write_text(
        "import os\n\ndef test_dies():\n    os.abort()\n\ndef test_lives():\n    assert True\n"
    )
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-c", str(root / "pyproject.toml"), "--rootdir", str(tmp_path)]
    command += [str(tmp_path / "test_crash.py"), "-n", "2", "-p", "no:cacheprovider", "--durations=0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert re.search(r"worker 'gw\d' crashed while running '.*test_crash.py::test_dies'", out), out


@pytest.mark.slow  # starts two interpreters
def test_add_flags_keeps_the_options_this_xla_knows_and_drops_the_others(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    known, unknown = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=61", "--xla_no_such_option_anywhere=1"
    got = xla.add_flags(unknown, known, "--xla_backend_optimization_level=2")
    assert got == f"--xla_backend_optimization_level=0 {known}"  # an option already named is left as given
    assert os.environ["XLA_FLAGS"] == got
