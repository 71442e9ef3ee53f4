"""Multi-host: two real JAX processes (4 CPU devices each) train over one 8-device mesh.

Each process runs ``multihost_worker.py`` with ``jax.distributed.initialize`` on
127.0.0.1; the results must agree across processes and with the same computation
on 8 devices in this (single) process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import multihost_worker
import numpy as np
import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 100  # a hang (e.g. a process waiting for a peer that died) fails instead of blocking CI


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(tmp_path: Path) -> list[dict[str, np.ndarray]]:
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"process{pid}.npz" for pid in range(NUM_PROCESSES)]
    procs = []
    with contextlib.ExitStack() as stack:
        for pid, out in enumerate(outs):
            log = stack.enter_context(open(tmp_path / f"process{pid}.log", "w"))
            cmd = [
                sys.executable,
                str(WORKER),
                f"--out={out}",
                f"--coordinator={coordinator}",
                f"--num-processes={NUM_PROCESSES}",
                f"--process-id={pid}",
                f"--local-devices={LOCAL_DEVICES}",
            ]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + TIMEOUT_S
        try:
            # A crashed process leaves its peers waiting for it: stop at the first failure.
            while True:
                codes = [proc.poll() for proc in procs]
                if None not in codes or any(codes):
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"multi-host workers did not finish within {TIMEOUT_S} s:\n{_tails(tmp_path)}")
                time.sleep(0.1)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        pytest.fail(f"multi-host workers exited with {codes}:\n{_tails(tmp_path)}")
    return [dict(np.load(out)) for out in outs]


def _tails(tmp_path: Path) -> str:
    parts = []
    for log in sorted(tmp_path.glob("process*.log")):
        lines = [line for line in log.read_text().splitlines() if not line.startswith("[Gloo]")]
        parts.append(f"--- {log.name}\n" + "\n".join(lines[-30:]))
    return "\n".join(parts)


def _assert_close(actual: np.ndarray, expected: np.ndarray, name: str, rtol: float = 1e-5) -> None:
    """Relative error in norm: ``‖actual − expected‖ ≤ rtol·‖expected‖``."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, name
    err = np.linalg.norm(actual - expected)
    assert err <= rtol * np.linalg.norm(expected), f"{name}: relative error {err / np.linalg.norm(expected):.3g}"


@pytest.fixture(scope="module")
def multihost_results(tmp_path_factory) -> list[dict[str, np.ndarray]]:
    return _run_processes(tmp_path_factory.mktemp("multihost"))


@pytest.fixture(scope="module")
def single_process_results() -> dict[str, np.ndarray]:
    assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES
    mesh = jax.make_mesh((jax.device_count(),), (multihost_worker.AXIS,))
    return multihost_worker.train_all(mesh)


def _result_keys(results: dict[str, np.ndarray]) -> list[str]:
    return sorted(k for k in results if k.startswith("k"))


def test_workers_form_one_global_mesh(multihost_results):
    for pid, results in enumerate(multihost_results):
        assert int(results["process_index"]) == pid
        assert int(results["process_count"]) == NUM_PROCESSES
        assert int(results["device_count"]) == NUM_PROCESSES * LOCAL_DEVICES


def test_processes_agree_exactly(multihost_results):
    first, *others = multihost_results
    for other in others:
        assert _result_keys(other) == _result_keys(first)
        for key in _result_keys(first):
            np.testing.assert_array_equal(other[key], first[key], err_msg=key)


@pytest.mark.parametrize("accumulation_steps", multihost_worker.ACCUMULATION_STEPS)
def test_multihost_matches_single_process(multihost_results, single_process_results, accumulation_steps):
    prefix = f"k{accumulation_steps}_"
    keys = [k for k in _result_keys(single_process_results) if k.startswith(prefix)]
    assert {f"{prefix}gain", f"{prefix}tau", f"{prefix}param_w1"} <= set(keys)
    for key in keys:
        _assert_close(multihost_results[0][key], single_process_results[key], key)


@pytest.mark.parametrize("accumulation_steps", multihost_worker.ACCUMULATION_STEPS)
def test_multihost_run_adapts_the_gain(multihost_results, accumulation_steps):
    results = multihost_results[0]
    gains = results[f"k{accumulation_steps}_gain"]
    taus = results[f"k{accumulation_steps}_tau"]
    applied = gains[accumulation_steps - 1 :: accumulation_steps]
    assert len(applied) == multihost_worker.NUM_CALLS // accumulation_steps
    scale = NUM_PROCESSES * LOCAL_DEVICES * accumulation_steps
    assert np.all(applied > 1.0) and np.all(applied <= scale)
    np.testing.assert_allclose(taus[-1], np.sum(applied), rtol=1e-6)
