"""AdaScale across hosts: one process per host, one data-parallel mesh over every device.

An MLP on MNIST-1D (generated offline by ``mnist1d``) trained with AdaScale SGD
under ``jax.shard_map``. Each device computes the gradient of one base batch;
AdaScale averages them with one all-reduce over the global ``"data"`` axis, which
spans processes, and runs the base-batch learning-rate schedule on the
scale-invariant clock ``τ``: training stops when ``τ ≥ T`` (the base-batch step
budget) whatever the number of devices. Every process computes the same
replicated ``τ``, so all of them stop at the same iteration.

Launch
------
On a TPU pod slice or a GPU cluster, run the same command on every host;
``jax.distributed.initialize()`` reads the coordinator, the process count and
this process's id from the environment (TPU metadata, SLURM, Open MPI)::

    python examples/multihost.py

On one machine, two CPU processes with 4 devices each (8 replicas). In two terminals::

    python examples/multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 --cpu-devices 4
    python examples/multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1 --cpu-devices 4

or from one shell::

    for i in 0 1; do
      python examples/multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 --process-id $i \\
        --cpu-devices 4 --smoke &
    done; wait

``--smoke`` runs a tiny budget (seconds); ``--accumulation-steps k`` gives each
device ``k`` base batches per update, accumulated across calls in per-device
buffers (``replicate_buffers`` + ``state_partition_specs``). Only process 0 prints.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

AXIS = "data"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="AdaScale SGD on MNIST-1D over a multi-process mesh.")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (omit on a cluster: auto-detected)")
    parser.add_argument("--num-processes", type=int, help="number of processes (with --coordinator)")
    parser.add_argument("--process-id", type=int, help="this process's id (with --coordinator)")
    parser.add_argument("--cpu-devices", type=int, help="run on the CPU with this many devices per process")
    parser.add_argument("--single-process", action="store_true", help="skip jax.distributed (one process)")
    parser.add_argument("--base-steps", type=int, default=3000, help="T: the budget in base-batch steps")
    parser.add_argument("--batch-size", type=int, default=32, help="base batch size (per device and call)")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05, help="base-batch learning rate")
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI")
    return parser.parse_args()


def initialize(args: argparse.Namespace) -> None:
    if args.cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    if args.single_process:
        return
    if args.coordinator:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    else:
        jax.distributed.initialize()  # TPU pods, SLURM, Open MPI: everything from the environment


def init_params(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in), "b": jnp.zeros(fan_out)}
        for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.base_steps, num_samples = min(args.base_steps, 40), 1000
    else:
        num_samples = 5000
    initialize(args)

    pid, nproc = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    replicas = mesh.shape[AXIS]
    scale = replicas * args.accumulation_steps
    log = print if pid == 0 else (lambda *a, **k: None)
    log(f"{nproc} process(es), {jax.device_count()} devices ({jax.local_device_count()} local): S = {scale}")

    data = datasets.mnist1d(num_samples)
    # Each process samples its batches from its own shard of the training set.
    x_local, y_local = data["x"][pid::nproc], data["y"][pid::nproc]
    rng = np.random.default_rng(1 + pid)

    T = args.base_steps
    schedule = optax.piecewise_constant_schedule(args.lr, {T // 2: 0.1, 3 * T // 4: 0.1})
    tx = optax_adascale.adascale_sgd(
        schedule,
        momentum=0.9,
        weight_decay=1e-4,
        axis_name=AXIS,
        accumulation_steps=args.accumulation_steps,
    )

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    params = jax.jit(init_params, static_argnums=1, out_shardings=replicated)(jax.random.key(0), (40, 128, 128, 10))
    init_state = lambda p: optax_adascale.replicate_buffers(tx.init(p), replicas)  # noqa: E731
    state_specs = optax_adascale.state_partition_specs(jax.eval_shape(init_state, params), AXIS)
    opt_state = jax.jit(init_state, out_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs))(params)

    def local_step(params, opt_state, x, y):
        # Replicated params must be marked varying, or jax.grad returns the gradient summed over devices.
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        m = optax_adascale.metrics(opt_state)
        logs = {"loss": jax.lax.pmean(loss, AXIS), "gain": m["gain"], "tau": m["scale_invariant_steps"]}
        return optax.apply_updates(params, updates), opt_state, logs

    train_step = jax.jit(
        jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), state_specs, P(AXIS), P(AXIS)),
            out_specs=(P(), state_specs, P()),
        ),
        donate_argnums=(0, 1),
    )

    local_rows = jax.local_device_count() * args.batch_size
    calls, tau = 0, 0.0
    while tau < T:
        idx = rng.integers(0, len(x_local), local_rows)
        x = jax.make_array_from_process_local_data(rows, x_local[idx])
        y = jax.make_array_from_process_local_data(rows, y_local[idx])
        params, opt_state, logs = train_step(params, opt_state, x, y)
        calls += 1
        # Replicated scalars: the local copy is the global value, identical on every process.
        tau = float(logs["tau"].addressable_data(0))
        if calls % (10 * args.accumulation_steps) == 0 or tau >= T:
            gain, loss = float(logs["gain"].addressable_data(0)), float(logs["loss"].addressable_data(0))
            iteration = calls // args.accumulation_steps
            log(f"iteration {iteration:5d}  tau {tau:8.1f}/{T}  gain {gain:5.2f}  loss {loss:.3f}")

    local_params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
    accuracy = np.mean(np.argmax(apply(local_params, data["x_test"]), axis=-1) == data["y_test"])
    iterations = calls // args.accumulation_steps
    log(f"done: {iterations} iterations at S = {scale} for tau = {tau:.1f} base steps; test accuracy {accuracy:.3f}")
    if not args.single_process:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
