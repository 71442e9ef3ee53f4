"""Worker for ``test_multihost.py``: AdaScale on a data-parallel mesh that may span processes.

One process of a multi-process run (what the test launches twice)::

    python tests/multihost_worker.py --out p0.npz --coordinator 127.0.0.1:PORT \
        --num-processes 2 --process-id 0 --local-devices 4

Without ``--coordinator`` it trains in a single process. The test imports :func:`train`
to compute the single-process reference in its own (8-device) process, and
:func:`run_processes` to launch them (``test_multihost.py`` launches the example with it too).

Every process builds the same global batches from a fixed seed and hands each device
its rows with ``jax.make_array_from_callback``, so device ``i`` of the mesh sees the
same data in every layout; only the all-reduce order can differ between layouts.

A batch ramp on the same mesh (:func:`train_ramp`, keys ``ramp_…``): every call feeds the micro-batch the state's
``batch_plan(...)["microbatches_seen"]`` names, each process making its own devices' rows.

Besides the data-parallel runs on a 1-D mesh (keys ``k<steps>_…``), on 8 devices every
process also trains with tensor parallelism (``TP_RUNS``, keys ``<layout>_k<steps>_…``):
a ``(data=4, model=2)`` mesh over the 8 global devices with the MLP's weights split over
``model`` (``TP_SPECS``), one ``psum`` over ``model`` in the forward pass. In layout ``tp``
each ``model`` pair lies in one process and the ``data`` axis crosses processes (TP
within a host); in ``tp_cross`` both axes cross processes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

AXIS = "data"
MODEL = "model"
IN_DIM, HIDDEN = 8, 16
PER_DEVICE_BATCH = 4
NUM_CALLS = 10
ACCUMULATION_STEPS = (1, 2)
TP_SHAPE = (4, 2)  # (data, model)
TP_SPECS = {"w1": P(None, MODEL), "b1": P(MODEL), "w2": P(MODEL, None), "b2": P()}
# Mesh position (d, m) -> index into jax.devices() (process 0 holds 0-3, process 1 holds 4-7).
TP_LAYOUTS = {
    "tp": np.arange(8).reshape(TP_SHAPE),  # model pairs within a process, data across processes
    "tp_cross": np.array([[0, 4], [5, 1], [2, 6], [7, 3]]),  # both axes across processes
}
TP_RUNS = (("tp", 1), ("tp_cross", 2))  # (layout, accumulation steps): one compile each, to keep the test short
TP_NUM_CALLS = 6


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = h @ params["w2"] + params["b2"]
    return 0.5 * jnp.mean((pred[:, 0] - y) ** 2)


def tp_loss_fn(params, x, y):
    """:func:`loss_fn` on one ``model`` shard: column-parallel ``w1``, row-parallel ``w2``, one psum."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    pred = jax.lax.psum(h @ params["w2"], MODEL) + params["b2"]
    return 0.5 * jnp.mean((pred[:, 0] - y) ** 2)


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(IN_DIM, HIDDEN)) / np.sqrt(IN_DIM)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def global_batch(call: int, num_replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of call ``call``: rows ``i·B … (i+1)·B − 1`` belong to replica ``i``."""
    rng = np.random.default_rng(1000 + call)
    x = rng.normal(size=(num_replicas * PER_DEVICE_BATCH, IN_DIM)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.3 * rng.normal(size=x.shape[0])).astype(np.float32)
    return x, y


def _global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a value every process knows in full; each device takes its slice."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _fetch(x: jax.Array) -> np.ndarray:
    """A global array as numpy (a local copy: works when it spans processes); gathers a split one first."""
    if not x.sharding.is_fully_replicated:
        x = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, P()))(x)
    return np.asarray(x.addressable_data(0))


def tp_mesh(layout: str) -> jax.sharding.Mesh:
    """The ``(data, model)`` mesh of ``layout`` over the 8 global devices."""
    devices = np.array(jax.devices(), dtype=object)
    return jax.sharding.Mesh(devices[TP_LAYOUTS[layout]], (AXIS, MODEL))


def train(
    mesh: jax.sharding.Mesh, accumulation_steps: int, num_calls: int = NUM_CALLS, tensor_parallel: bool = False
) -> dict[str, np.ndarray]:
    """``num_calls`` AdaScale calls under ``jax.shard_map`` over ``mesh``'s ``"data"`` axis.

    With ``tensor_parallel``, ``mesh`` also has a ``"model"`` axis over which the
    parameters are split as ``TP_SPECS`` says (and momentum and the accumulation
    buffers with them).

    Returns numpy arrays: per-call ``gain``, ``tau`` and ``loss``, and the final
    (whole) parameters as ``param_<name>``.
    """
    n = mesh.shape[AXIS]
    schedule = optax.exponential_decay(0.05, transition_steps=5, decay_rate=0.8, staircase=True)
    tx = optax_adascale.adascale_sgd(schedule, momentum=0.9, axis_name=AXIS, accumulation_steps=accumulation_steps)
    param_specs = TP_SPECS if tensor_parallel else {k: P() for k in TP_SPECS}
    rows = NamedSharding(mesh, P(AXIS))
    params = {k: _global_array(v, NamedSharding(mesh, param_specs[k])) for k, v in init_params().items()}

    model_shards = mesh.shape[MODEL] if tensor_parallel else 1
    init = lambda p: optax_adascale.replicate_buffers(tx.init(p), n, model_shards=model_shards)  # noqa: E731
    if tensor_parallel:
        specs = optax_adascale.state_partition_specs(jax.eval_shape(init, params), AXIS, TP_SPECS, tx=tx)
    else:
        specs = optax_adascale.state_partition_specs(jax.eval_shape(init, params), AXIS)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    opt_state = jax.jit(init, out_shardings=shardings)(params)
    loss_of = tp_loss_fn if tensor_parallel else loss_fn

    def local_step(params, opt_state, x, y):
        # Mark the replicated params varying so that jax.grad returns this replica's gradient.
        local = jax.lax.pcast(params, AXIS, to="varying")
        loss, grads = jax.value_and_grad(loss_of)(local, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        m = optax_adascale.metrics(opt_state)
        stats = {"gain": m["gain"], "tau": m["scale_invariant_steps"], "loss": jax.lax.pmean(loss, AXIS)}
        return optax.apply_updates(params, updates), opt_state, stats

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(param_specs, specs, P(AXIS), P(AXIS)),
            out_specs=(param_specs, specs, P()),
        ),
        donate_argnums=(0, 1),
    )

    history: dict[str, list[np.ndarray]] = {"gain": [], "tau": [], "loss": []}
    for call in range(num_calls):
        x, y = global_batch(call, n)
        params, opt_state, stats = step(params, opt_state, _global_array(x, rows), _global_array(y, rows))
        for key, value in stats.items():
            history[key].append(_fetch(value))
    out = {key: np.stack(values) for key, values in history.items()}
    out.update({f"param_{k}": _fetch(v) for k, v in params.items()})
    return out


def train_all(mesh: jax.sharding.Mesh) -> dict[str, np.ndarray]:
    """:func:`train` for every accumulation setting, keys prefixed ``k<steps>_``."""
    out = {}
    for k in ACCUMULATION_STEPS:
        out.update({f"k{k}_{key}": value for key, value in train(mesh, k).items()})
    return out


def train_all_tp() -> dict[str, np.ndarray]:
    """Tensor-parallel :func:`train` for each of ``TP_RUNS``, keys prefixed ``<layout>_k<steps>_``."""
    out = {}
    for layout, k in TP_RUNS:
        results = train(tp_mesh(layout), k, num_calls=TP_NUM_CALLS, tensor_parallel=True)
        out.update({f"{layout}_k{k}_{key}": value for key, value in results.items()})
    return out


# --------------------------------------------------------------------------- a batch ramp across processes

# The ramp's rungs come from a fixed policy (the k asked for after each update: up, down, up again), so the path is
# known in advance: k = 1 for the first update, then RAMP_KS after updates 1, 2, ...
RAMP_K_OF_UPDATE = (1, 2, 4, 2, 4)
RAMP_KS = (2, 4, 2, 4, 4)
RAMP_CALLS = 13  # 1 + 2 + 4 + 2 + 4: five updates


def _ramp_policy(inputs):
    table = jnp.asarray(RAMP_K_OF_UPDATE, jnp.float32)
    return table[jnp.minimum(inputs.updates, len(RAMP_K_OF_UPDATE) - 1)]


def replica_microbatch(position: int, replica: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica ``replica``'s rows of micro-batch ``position`` of the stream: a function of both alone, so a process
    makes only its own replicas' rows."""
    rng = np.random.default_rng([2000 + position, replica])
    x = rng.normal(size=(PER_DEVICE_BATCH, IN_DIM)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] + 0.3 * rng.normal(size=PER_DEVICE_BATCH)).astype(np.float32)
    return x, y


def _own_rows(position: int, n: int, sharding: NamedSharding, which: int) -> jax.Array:
    """Micro-batch ``position`` as a global array, each process making the rows of its own devices only (the
    callback runs for this process's devices)."""

    def rows(index):
        start = index[0].start or 0
        return replica_microbatch(position, start // PER_DEVICE_BATCH)[which]

    shape = (n * PER_DEVICE_BATCH, IN_DIM) if which == 0 else (n * PER_DEVICE_BATCH,)
    return jax.make_array_from_callback(shape, sharding, rows)


def train_ramp(mesh: jax.sharding.Mesh) -> dict[str, np.ndarray]:
    """A :class:`BatchRamp` under ``jax.shard_map`` over ``mesh``'s data axis: every call feeds micro-batch
    ``batch_plan(opt_state)["microbatches_seen"]`` (read from the state), each process its own rows. Returns the
    ``k`` held after each call (``ramp_k``), ``ramp_gain``, ``ramp_tau``, ``ramp_position`` and the final
    parameters (``ramp_param_<name>``)."""
    n = mesh.shape[AXIS]
    schedule = optax.exponential_decay(0.05, transition_steps=5, decay_rate=0.8, staircase=True)
    ramp = optax_adascale.BatchRamp(1, 4, hysteresis=1.0, patience=1, policy=_ramp_policy)
    tx = optax_adascale.adascale_sgd(schedule, momentum=0.9, axis_name=AXIS, accumulation_steps=ramp)
    param_specs = {k: P() for k in TP_SPECS}
    rows = NamedSharding(mesh, P(AXIS))
    params = {k: _global_array(v, NamedSharding(mesh, P())) for k, v in init_params().items()}
    init = lambda p: optax_adascale.replicate_buffers(tx.init(p), n)  # noqa: E731
    specs = optax_adascale.state_partition_specs(jax.eval_shape(init, params), AXIS)
    opt_state = jax.jit(init, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), specs))(params)

    def local_step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(param_specs, specs, P(AXIS), P(AXIS)),
            out_specs=(param_specs, specs),
        )
    )
    history: dict[str, list[np.ndarray]] = {"k": [], "gain": [], "tau": [], "position": []}
    for _ in range(RAMP_CALLS):
        plan = optax_adascale.batch_plan(opt_state)
        position = int(_fetch(plan["microbatches_seen"]))
        params, opt_state = step(params, opt_state, _own_rows(position, n, rows, 0), _own_rows(position, n, rows, 1))
        m = optax_adascale.metrics(opt_state)
        history["k"].append(_fetch(optax_adascale.batch_plan(opt_state)["microbatches"]))
        history["gain"].append(_fetch(m["gain"]))
        history["tau"].append(_fetch(m["scale_invariant_steps"]))
        history["position"].append(np.asarray(position))
    out = {f"ramp_{key}": np.stack(values) for key, values in history.items()}
    out.update({f"ramp_param_{k}": _fetch(v) for k, v in params.items()})
    out["ramp_updates"] = _fetch(optax_adascale.get_adascale_state(opt_state).count)
    return out


# --------------------------------------------------------------------------- launching processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    command: Callable[[int, str], Sequence[str]], num_processes: int, log_dir: Path, timeout: float
) -> list[str]:
    """Run ``command(process_id, coordinator)`` for every process at once; return their outputs.

    A process that fails leaves its peers waiting for it, so the first failure
    (or the deadline) kills the others.

    Raises:
      RuntimeError: with the tail of every process's output, if a process exits
        with a non-zero status or they do not all finish within ``timeout`` seconds.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    logs = [log_dir / f"process{pid}.log" for pid in range(num_processes)]
    procs: list[subprocess.Popen] = []
    timed_out = False
    with contextlib.ExitStack() as stack:
        for pid, log in enumerate(logs):
            out = stack.enter_context(open(log, "w"))
            cmd = [str(part) for part in command(pid, coordinator)]
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [proc.poll() for proc in procs]
                if None not in codes or any(codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    outputs = [log.read_text() for log in logs]
    codes = [proc.returncode for proc in procs]
    if timed_out or any(codes):
        tails = []
        for pid, text in enumerate(outputs):
            lines = [line for line in text.splitlines() if not line.startswith("[Gloo]")]
            tails.append(f"--- process {pid}\n" + "\n".join(lines[-30:]))
        why = f"did not finish within {timeout} s" if timed_out else f"exited with {codes}"
        raise RuntimeError(f"{num_processes} processes {why}:\n" + "\n".join(tails))
    return outputs


# --------------------------------------------------------------------------- entry point


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write this process's results (.npz)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0; omit for a single process")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=8, help="CPU devices in this process")
    args = parser.parse_args()

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    if args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    results = train_all(mesh)
    results.update(train_ramp(mesh))
    if jax.device_count() == np.prod(TP_SHAPE):
        results.update(train_all_tp())
        for layout in TP_LAYOUTS:  # which process holds each (data, model) position
            results[f"mesh_{layout}_processes"] = np.vectorize(lambda d: d.process_index)(tp_mesh(layout).devices)
    results["process_index"] = np.asarray(jax.process_index())
    results["process_count"] = np.asarray(jax.process_count())
    results["device_count"] = np.asarray(jax.device_count())
    tmp = f"{args.out}.tmp.npz"
    np.savez(tmp, **results)
    os.replace(tmp, args.out)
    if args.coordinator:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
