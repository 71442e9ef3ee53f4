"""AdaScale with Flax NNX: ``nnx.Optimizer`` forwards ``microbatch_stats``; replicas via ``nnx.split``.

An NNX MLP learns MNIST-1D (generated locally, no download) with the user's schedule
for batch 32, trained until the scale-invariant clock ``τ`` reaches the budget ``T``:

* ``S = 1``: batch 32, no axis; AdaScale is plain SGD with momentum on ``lr(t)``.
* ``S = 8`` on one device: 8 micro-batches of 32 per step. No axis and no extra
  state: ``optax_adascale.value_and_grad`` returns the gradient and the
  micro-batch statistics, and ``optimizer.update(model, grads, microbatch_stats=stats)``
  passes them to AdaScale (``nnx.Optimizer.update`` forwards keywords to ``tx.update``).
* ``S = 8`` as 8 ``jax.shard_map`` replicas of 32 (8 virtual CPU devices): the pure
  state of ``(model, optimizer)`` from ``nnx.split`` goes through ``shard_map``; each
  replica differentiates a copy of the parameters marked varying with ``jax.lax.pcast``
  and calls ``optimizer.update`` with its local gradient. No extra collective: AdaScale's
  one ``pmean`` does the averaging.

Both ``S = 8`` runs see the same 256 examples per step (micro-batch ``j`` is replica
``j``'s batch), so they train identically up to float rounding.

Run::

    python examples/nnx_quickstart.py           # one to two minutes on 2 CPU cores
    python examples/nnx_quickstart.py --smoke   # < 60 s
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

BASE_BATCH = 32
REPLICAS = 8
AXIS = "data"


def make_model(seed: int):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden1 = nnx.Linear(40, 128, rngs=rngs)
            self.hidden2 = nnx.Linear(128, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden2(nnx.relu(self.hidden1(x)))))

    return MLP(nnx.Rngs(seed))


def cross_entropy(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train(data, mode: str, budget: int, lr: float, seed: int) -> dict:
    """Train until ``τ ≥ budget``; ``mode`` is ``"S=1"``, ``"microbatch"`` or ``"shard_map"``."""
    from flax import nnx

    replicas = 1 if mode == "S=1" else REPLICAS
    schedule = optax.exponential_decay(lr, transition_steps=budget, decay_rate=0.01)  # written for batch 32
    axis_name = AXIS if mode == "shard_map" else None
    model = make_model(seed)
    optimizer = nnx.Optimizer(
        model, optax_adascale.adascale_sgd(schedule, momentum=0.9, axis_name=axis_name), wrt=nnx.Param
    )
    x_train, y_train = jnp.asarray(data["x"]), jnp.asarray(data["y"])
    key = jax.random.key(seed + 1)

    def batch_indices(it):  # (replicas, 32) rows of the training set; the same in every mode
        return jax.random.randint(jax.random.fold_in(key, it), (replicas, BASE_BATCH), 0, x_train.shape[0])

    if mode != "shard_map":

        @nnx.jit
        def step(model, optimizer, it):
            idx = batch_indices(it).reshape(-1)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            loss_fn = lambda params, x, y: cross_entropy(nnx.merge(graphdef, params, rest), x, y)  # noqa: E731
            grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=replicas)
            _, grads, stats = grad_fn(params, x_train[idx], y_train[idx])
            optimizer.update(model, grads, microbatch_stats=stats)  # forwarded to tx.update
            return optax_adascale.metrics(optimizer.opt_state)

        def run_step(it):
            return step(model, optimizer, it)

    else:
        devices = jax.devices() if len(jax.devices()) >= REPLICAS else jax.devices("cpu")
        mesh = jax.sharding.Mesh(np.array(devices[:REPLICAS]), (AXIS,))
        graphdef, state = nnx.split((model, optimizer))

        def replica_step(state, it):
            model, optimizer = nnx.merge(graphdef, state)
            idx = batch_indices(it)[jax.lax.axis_index(AXIS)]
            # Differentiate a varying copy of the params (else shard_map's autodiff sums the
            # gradients over AXIS); the model keeps the replicated ones, and so do the updates.
            gdef, params, rest = nnx.split(model, nnx.Param, ...)
            params = jax.lax.pcast(params, AXIS, to="varying")
            grads = nnx.grad(cross_entropy)(nnx.merge(gdef, params, rest), x_train[idx], y_train[idx])
            optimizer.update(model, grads)  # local gradients: AdaScale does the pmean
            return nnx.state((model, optimizer)), optax_adascale.metrics(optimizer.opt_state)

        sharded_step = jax.jit(jax.shard_map(replica_step, mesh=mesh, in_specs=(P(), P()), out_specs=P()))

        def run_step(it):
            nonlocal state
            state, m = sharded_step(state, it)
            return m

    tau, iterations, start = 0.0, 0, time.perf_counter()
    while tau < budget:
        m = run_step(jnp.asarray(iterations, jnp.int32))
        tau = float(m["scale_invariant_steps"])
        iterations += 1
    seconds = time.perf_counter() - start
    if mode == "shard_map":
        nnx.update((model, optimizer), state)

    logits = model(jnp.asarray(data["x_test"]))
    return {
        "mode": mode,
        "S": replicas,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,
        "test_acc": float(jnp.mean(jnp.argmax(logits, -1) == data["y_test"])),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="T in base-batch steps (default 3000, smoke 100)")
    parser.add_argument("--lr", type=float, default=0.05, help="lr(0) of the schedule, for batch 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny data and budget (< 60 s)")
    args = parser.parse_args(argv)
    budget = args.budget or (100 if args.smoke else 3000)

    jax.config.update("jax_num_cpu_devices", REPLICAS)  # CPU backend only; before JAX first runs
    data = datasets.mnist1d(2_000 if args.smoke else 10_000)
    print(f"MNIST-1D: {len(data['x'])} train / {len(data['x_test'])} test; NNX MLP 40-128-128-10; T = {budget}")

    rows = [train(data, mode, budget, args.lr, args.seed) for mode in ("S=1", "microbatch", "shard_map")]
    print(f"{'run':<24} {'iterations':>10} {'tau':>7} {'mean gain':>9} {'test acc':>8} {'wall (s)':>8}")
    for r in rows:
        name = {"S=1": "S=1", "microbatch": "S=8, 8 micro-batches", "shard_map": "S=8, 8 shard_map replicas"}
        print(
            f"{name[r['mode']]:<24} {r['iterations']:>10} {r['tau']:>7.1f} {r['mean_gain']:>9.2f} "
            f"{100 * r['test_acc']:>7.1f}% {r['seconds']:>8.1f}"
        )
    return rows


if __name__ == "__main__":
    main()
