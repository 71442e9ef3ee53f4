"""Elastic AdaScale: more replicas mid-training, through a checkpoint (the paper's Figure 4 scenario).

An MLP on MNIST-1D (generated offline by ``mnist1d``) trains with AdaScale SGD
on a base-batch learning-rate schedule of ``T`` base steps. The job starts on 2
replicas, is checkpointed and restarted on 4 replicas at ``τ = T/4``, and again
on 8 replicas at ``τ = T/2``. Nothing is retuned: the schedule runs on the
scale-invariant clock ``τ``, the gain ``r ∈ [1, S]`` adapts to each scale, and
the moving averages ``σ̄²``, ``μ̄²`` (base-batch units) carry over the restarts.

Each restart is what an elastic job does after losing or gaining workers: the
in-memory state is dropped, a new mesh is built over the new devices, and the
Orbax checkpoint is restored *in the layout that wrote it* (its replica count
and ``accumulation_steps`` are read from the checkpoint's metadata) straight
onto the new devices; ``optax_adascale.transfer_state`` then moves the
statistics and momentum into the new layout's fresh state. (With
``--accumulation-steps 1`` the two layouts have the same structure, and
restoring into the new state directly would do too.)

Run (on the CPU it simulates 8 devices)::

    python examples/elastic.py             # T = 3000 base steps
    python examples/elastic.py --smoke     # a few seconds
    python examples/elastic.py --accumulation-steps 2   # S = 2·replicas, per-replica buffers

It prints one row per phase: its scale ``S``, the iterations it ran, ``τ`` at
its end, the gain of its last update and the test accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
from types import SimpleNamespace

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects the CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optax_adascale  # noqa: E402

import datasets  # noqa: E402

AXIS = "data"
PHASES = ((0.25, 2), (0.5, 4), (1.0, 8))  # (τ at the end of the phase, as a fraction of T; replicas)
SIZES = (40, 128, 128, 10)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="AdaScale on MNIST-1D, scaled 2 -> 4 -> 8 replicas via checkpoints.")
    parser.add_argument("--base-steps", type=int, default=3000, help="T: the schedule's length in base-batch steps")
    parser.add_argument("--batch-size", type=int, default=32, help="base batch size (per replica and call)")
    parser.add_argument("--accumulation-steps", type=int, default=1, help="calls per update")
    parser.add_argument("--lr", type=float, default=0.05, help="base-batch learning rate")
    parser.add_argument("--checkpoint-dir", help="default: a temporary directory")
    parser.add_argument("--smoke", action="store_true", help="tiny run for CI")
    return parser.parse_args()


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in), "b": jnp.zeros(fan_out)}
        for k, fan_in, fan_out in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()


def make_tx(schedule, accumulation_steps: int):
    return optax_adascale.adascale_sgd(
        schedule, momentum=0.9, weight_decay=1e-4, axis_name=AXIS, accumulation_steps=accumulation_steps
    )


def layout(replicas: int, accumulation_steps: int, schedule) -> SimpleNamespace:
    """Mesh, transformation, state layout and jitted step for ``replicas`` data-parallel devices."""
    devices = jax.devices() if len(jax.devices()) >= replicas else jax.devices("cpu")
    mesh = jax.sharding.Mesh(np.array(devices[:replicas]), (AXIS,))
    tx = make_tx(schedule, accumulation_steps)
    fresh = lambda p: optax_adascale.replicate_buffers(tx.init(p), replicas)  # noqa: E731
    specs = optax_adascale.state_partition_specs(jax.eval_shape(fresh, init_params(jax.random.key(0))), AXIS)
    state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

    def local_step(params, opt_state, x, y):
        # Mark the replicated params varying: jax.grad then returns this replica's own gradient.
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    return SimpleNamespace(
        replicas=replicas,
        replicated=NamedSharding(mesh, P()),
        rows=NamedSharding(mesh, P(AXIS)),
        init_state=jax.jit(fresh, out_shardings=state_shardings),
        step=step,
    )


def save(manager: ocp.CheckpointManager, call: int, params, opt_state, meta: dict) -> None:
    manager.save(
        call,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), meta=ocp.args.JsonSave(meta)
        ),
    )
    manager.wait_until_finished()


def resume(manager: ocp.CheckpointManager, new, schedule):
    """Restore the latest checkpoint onto ``new``'s devices and move it into ``new``'s layout."""
    call = manager.latest_step()
    meta = manager.restore(call, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    # The layout that wrote the checkpoint (its buffers are per replica of the *old* mesh) ...
    old_tx = make_tx(schedule, meta["accumulation_steps"])
    abstract = jax.eval_shape(
        lambda key: (p := init_params(key), optax_adascale.replicate_buffers(old_tx.init(p), meta["replicas"])),
        jax.random.key(0),
    )
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=new.replicated), abstract)
    restored = manager.restore(
        call,
        args=ocp.args.Composite(state=ocp.args.StandardRestore({"params": target[0], "opt_state": target[1]})),
    )["state"]
    # ... restored straight onto the new devices; its statistics move into the new layout (at an update boundary).
    opt_state = optax_adascale.transfer_state(restored["opt_state"], new.init_state(restored["params"]))
    return restored["params"], opt_state, call


def accuracy(params, x, y) -> float:
    host = jax.tree.map(np.asarray, params)
    return float(np.mean(np.argmax(apply(host, x), axis=-1) == y))


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.base_steps, num_samples = min(args.base_steps, 64), 1000
    else:
        num_samples = 5000
    T, k, B = args.base_steps, args.accumulation_steps, args.batch_size
    data = datasets.mnist1d(num_samples)
    schedule = optax.piecewise_constant_schedule(args.lr, {T // 2: 0.1, 3 * T // 4: 0.1})
    print(f"AdaScale, elastic: MNIST-1D MLP, T = {T} base steps of {B} examples, {k} call(s) per update")

    rows = []
    with tempfile.TemporaryDirectory() as tmp, ocp.CheckpointManager(args.checkpoint_dir or tmp) as manager:
        call = 0
        for phase, (end_fraction, replicas) in enumerate(PHASES, start=1):
            new = layout(replicas, k, schedule)
            if phase == 1:
                params = jax.device_put(init_params(jax.random.key(0)), new.replicated)
                opt_state = new.init_state(params)
            else:  # a restart: nothing survives but the checkpoint
                params, opt_state, call = resume(manager, new, schedule)
            tau, start, end = float(optax_adascale.scale_invariant_steps(opt_state)), call, end_fraction * T
            # Stop at an update boundary once τ reaches the end of the phase.
            while tau < end or optax_adascale.get_adascale_state(opt_state).micro_step != 0:
                idx = np.random.default_rng([0, call]).integers(0, len(data["x"]), replicas * B)
                x = jax.device_put(data["x"][idx], new.rows)
                y = jax.device_put(data["y"][idx], new.rows)
                params, opt_state = new.step(params, opt_state, x, y)
                tau = float(optax_adascale.scale_invariant_steps(opt_state))
                call += 1
            m = optax_adascale.metrics(opt_state)
            acc = accuracy(params, data["x_test"], data["y_test"])
            rows.append((phase, int(m["scale"]), (call - start) // k, tau, float(m["gain"]), acc))
            save(manager, call, params, opt_state, {"replicas": replicas, "accumulation_steps": k})
            del params, opt_state

    print(f"{'phase':>5}  {'S':>3}  {'iterations':>10}  {'tau at end':>10}  {'gain':>6}  {'test acc':>8}")
    for phase, scale, iterations, tau, gain, acc in rows:
        print(f"{phase:>5}  {scale:>3}  {iterations:>10}  {tau:>10.1f}  {gain:>6.2f}  {acc:>8.3f}")
    total = sum(r[2] for r in rows)
    print(f"total: {total} iterations for tau = {rows[-1][3]:.1f} base steps ({rows[-1][3] / total:.2f}x fewer)")


if __name__ == "__main__":
    main()
