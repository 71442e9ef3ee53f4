"""Multi-host: two real JAX processes (4 CPU devices each) train over one 8-device mesh.

Each process runs ``multihost_worker.py`` with ``jax.distributed.initialize`` on
127.0.0.1; the results must agree across processes and with the same computation
on 8 devices in this (single) process: data parallelism over a 1-D mesh, a batch ramp on it (each process
feeding its own rows), and tensor parallelism over a 2-D ``(data=4, model=2)`` mesh whose axes cross the processes.
``examples/multihost.py --smoke`` runs the same way, launched as its docstring says.

Every test here starts processes that bind a coordinator port: one ``xdist_group``, so that they run one after
the other on one worker.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import jax
import multihost_worker
import numpy as np
import pytest
from helpers import scratch_dir

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multihost")]

WORKER = Path(__file__).with_name("multihost_worker.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "multihost.py"
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 300  # a hang (e.g. a process waiting for a peer that died) fails instead of blocking CI; generous:
# under `pytest -n auto` the other workers share the cores


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


@functools.cache
def _multihost_results() -> list[dict[str, np.ndarray]]:
    return _run_workers(scratch_dir("multihost"))


@pytest.fixture
def multihost_results():
    """_multihost_results, computed once per process (xdist may tear module fixtures down between tests)."""
    return _multihost_results()


@functools.cache
def _single_process_results() -> dict[str, np.ndarray]:
    assert jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES
    mesh = jax.make_mesh((jax.device_count(),), (multihost_worker.AXIS,))
    return multihost_worker.train_all(mesh) | multihost_worker.train_all_tp() | multihost_worker.train_ramp(mesh)


@pytest.fixture
def single_process_results():
    """_single_process_results, computed once per process (xdist may tear module fixtures down between tests)."""
    return _single_process_results()


# Key prefixes and accumulation steps: data parallelism on the 1-D mesh, then the tensor-parallel runs.
RUNS = [("", k) for k in multihost_worker.ACCUMULATION_STEPS]
RUNS += [(f"{layout}_", k) for layout, k in multihost_worker.TP_RUNS]
RUN_IDS = [f"{prefix or 'dp_'}k{k}" for prefix, k in RUNS]


def _result_keys(results: dict[str, np.ndarray]) -> list[str]:
    return sorted(k for k in results if k.startswith(tuple(f"{prefix}k{steps}_" for prefix, steps in RUNS)))


def test_workers_form_one_global_mesh(multihost_results):
    for pid, results in enumerate(multihost_results):
        assert int(results["process_index"]) == pid
        assert int(results["process_count"]) == NUM_PROCESSES
        assert int(results["device_count"]) == NUM_PROCESSES * LOCAL_DEVICES
        tp, cross = results["mesh_tp_processes"], results["mesh_tp_cross_processes"]
        assert tp.shape == cross.shape == multihost_worker.TP_SHAPE
        assert np.all(tp[:, 0] == tp[:, 1]) and len(set(tp[:, 0])) == NUM_PROCESSES  # TP within a process
        assert np.all(cross[:, 0] != cross[:, 1])  # every model pair spans both processes
        assert all(len(set(cross[:, m])) == NUM_PROCESSES for m in range(2))  # and so does every data column


def test_processes_agree_exactly(multihost_results):
    first, *others = multihost_results
    assert {f"{prefix}k{k}_param_w1" for prefix, k in RUNS} <= set(first)
    for other in others:
        assert _result_keys(other) == _result_keys(first)
        for key in _result_keys(first):
            np.testing.assert_array_equal(other[key], first[key], err_msg=key)


@pytest.mark.parametrize(("run", "accumulation_steps"), RUNS, ids=RUN_IDS)
def test_multihost_matches_single_process(multihost_results, single_process_results, run, accumulation_steps):
    prefix = f"{run}k{accumulation_steps}_"
    keys = [k for k in _result_keys(single_process_results) if k.startswith(prefix)]
    assert {f"{prefix}gain", f"{prefix}tau", f"{prefix}param_w1"} <= set(keys)
    for key in keys:
        _assert_close(multihost_results[0][key], single_process_results[key], key)


@pytest.mark.parametrize(("run", "accumulation_steps"), RUNS, ids=RUN_IDS)
def test_multihost_run_adapts_the_gain(multihost_results, run, accumulation_steps):
    results = multihost_results[0]
    gains = results[f"{run}k{accumulation_steps}_gain"]
    taus = results[f"{run}k{accumulation_steps}_tau"]
    applied = gains[accumulation_steps - 1 :: accumulation_steps]
    calls = multihost_worker.TP_NUM_CALLS if run else multihost_worker.NUM_CALLS
    assert len(applied) == calls // accumulation_steps
    replicas = multihost_worker.TP_SHAPE[0] if run else NUM_PROCESSES * LOCAL_DEVICES
    scale = replicas * accumulation_steps
    assert np.all(applied > 1.0) and np.all(applied <= scale)
    np.testing.assert_allclose(taus[-1], np.sum(applied), rtol=1e-6)


def test_a_ramp_across_processes_takes_one_processs_k_path_and_parameters(multihost_results, single_process_results):
    """Issue 40 item 9: two processes, each feeding its own rows of micro-batch ``microbatches_seen`` (read from the
    state), take the rungs the policy asks for and end with the parameters of one process feeding both hosts' rows."""
    expected_k = []  # the k held after each call: the policy's table, applied at each update's last call
    for update, calls_k in enumerate([1, *multihost_worker.RAMP_KS[:-1]]):
        expected_k += [calls_k] * (calls_k - 1) + [multihost_worker.RAMP_KS[update]]
    for results in (*multihost_results, single_process_results):
        np.testing.assert_array_equal(results["ramp_k"], expected_k)
        np.testing.assert_array_equal(results["ramp_position"], np.arange(multihost_worker.RAMP_CALLS))
        assert int(results["ramp_updates"]) == len(multihost_worker.RAMP_KS)
    for key in [k for k in single_process_results if k.startswith("ramp_")]:
        for results in multihost_results:
            _assert_close(results[key], single_process_results[key], key)
    assert np.all(multihost_results[0]["ramp_gain"] >= 1.0) and float(multihost_results[0]["ramp_tau"][-1]) > 5


def test_tensor_parallel_runs_match_data_parallelism_on_the_same_replicas(single_process_results):
    """The truth for the TP runs: no model axis, the same 4 replicas (and data) on a 1-D mesh of 4 devices."""
    mesh = jax.make_mesh((multihost_worker.TP_SHAPE[0],), (multihost_worker.AXIS,), devices=jax.devices()[:4])
    for layout, k in multihost_worker.TP_RUNS:
        for key, value in multihost_worker.train(mesh, k, num_calls=multihost_worker.TP_NUM_CALLS).items():
            _assert_close(single_process_results[f"{layout}_k{k}_{key}"], value, f"{layout}_k{k}_{key}")


# --------------------------------------------------------------------------- examples/multihost.py


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
        outputs = multihost_worker.run_processes(command, NUM_PROCESSES, tmp_path, timeout=TIMEOUT_S)
    except RuntimeError as err:
        pytest.fail(str(err))
    assert "2 process(es), 8 devices (4 local): S = 8" in outputs[0]
    done = re.search(r"done: (\d+) iterations at S = 8 for tau = ([\d.]+) base steps", outputs[0])
    assert done, outputs[0]
    assert float(done.group(2)) >= 40 and int(done.group(1)) < 40  # fewer iterations than base steps
    assert "done:" not in outputs[1]  # only process 0 prints
