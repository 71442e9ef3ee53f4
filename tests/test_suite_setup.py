"""The suite's own setup (tests/conftest.py, pyproject's pytest options): what keeps it alive on a loaded machine.

Eight fake CPU devices on two busy cores: XLA:CPU gives a collective 40 s by default before it aborts the process,
and pytest-xdist 3.8 under ``--dist loadgroup`` waits forever after replacing a crashed worker (CONTRIBUTING.md).
"""

import os
import re

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


def test_a_crashed_worker_fails_the_run_instead_of_being_replaced(request):
    if request.config.pluginmanager.get_plugin("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    assert request.config.getoption("maxworkerrestart") in ("0", 0)


@pytest.mark.slow  # starts two interpreters
def test_add_flags_keeps_the_options_this_xla_knows_and_drops_the_others(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    known, unknown = "--xla_cpu_collective_call_warn_stuck_timeout_seconds=61", "--xla_no_such_option_anywhere=1"
    got = xla.add_flags(unknown, known, "--xla_backend_optimization_level=2")
    assert got == f"--xla_backend_optimization_level=0 {known}"  # an option already named is left as given
    assert os.environ["XLA_FLAGS"] == got
