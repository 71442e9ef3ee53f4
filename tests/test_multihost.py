"""Multi-host: two real JAX processes (4 CPU devices each) train over one 8-device mesh.

Each process runs ``multihost_worker.py`` with ``jax.distributed.initialize`` on
127.0.0.1; the results must agree across processes and with the same computation
on 8 devices in this (single) process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import multihost_worker
import numpy as np
import pytest

WORKER = Path(__file__).with_name("multihost_worker.py")
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 100  # a hang (e.g. a process waiting for a peer that died) fails instead of blocking CI


def _run_workers(tmp_path: Path) -> list[dict[str, np.ndarray]]:
    outs = [tmp_path / f"process{pid}.npz" for pid in range(NUM_PROCESSES)]

    def command(pid: int, coordinator: str) -> list[str]:
        return [
            sys.executable,
            WORKER,
            f"--out={outs[pid]}",
            f"--coordinator={coordinator}",
            f"--num-processes={NUM_PROCESSES}",
            f"--process-id={pid}",
            f"--local-devices={LOCAL_DEVICES}",
        ]

    try:
        multihost_worker.run_processes(command, NUM_PROCESSES, tmp_path, timeout=TIMEOUT_S)
    except RuntimeError as err:
        pytest.fail(str(err))
    return [dict(np.load(out)) for out in outs]


def _assert_close(actual: np.ndarray, expected: np.ndarray, name: str, rtol: float = 1e-5) -> None:
    """Relative error in norm: ``‖actual − expected‖ ≤ rtol·‖expected‖``."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, name
    err = np.linalg.norm(actual - expected)
    assert err <= rtol * np.linalg.norm(expected), f"{name}: relative error {err / np.linalg.norm(expected):.3g}"


@pytest.fixture(scope="module")
def multihost_results(tmp_path_factory) -> list[dict[str, np.ndarray]]:
    return _run_workers(tmp_path_factory.mktemp("multihost"))


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
