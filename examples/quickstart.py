"""AdaScale quickstart: a learning-rate schedule written once for batch 32, reused at 8x the batch.

A small MLP learns MNIST-1D (generated offline). The learning-rate schedule is
written once, for the base batch of 32 examples and a budget of ``T``
base-batch steps, and is never retuned. We train twice with the same code:

* ``S = 1``: one replica, batch 32. AdaScale is then exactly SGD with momentum
  on ``lr(t)``: ``T`` iterations.
* ``S = 8``: eight data-parallel replicas, each with its own batch of 32
  (``jax.vmap`` with a named axis runs them on one device). Each update scales
  the step by the gain ``r_t ∈ [1, 8]`` and advances the scale-invariant clock
  ``τ`` by ``r_t``; training stops at ``τ ≥ T``, after about ``T / mean gain``
  iterations.

On several devices, map the same ``replica_step`` with ``jax.pmap`` or
``jax.shard_map`` over the same axis name instead of ``jax.vmap``; the
optimizer code does not change.

Usage::

    python examples/quickstart.py            # about a minute on 2 CPU cores
    python examples/quickstart.py --smoke    # tiny budget, a few seconds of training
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import optax_adascale

import datasets

BASE_BATCH = 32  # examples per replica per iteration: the batch the schedule is written for
AXIS = "replica"  # the data-parallel axis name
HIDDEN = (256, 256)


def batches(x: np.ndarray, y: np.ndarray, num_replicas: int, rng: np.random.Generator):
    """Endless shuffled epochs, in batches shaped ``(num_replicas, BASE_BATCH, ...)``: one base batch per replica."""
    size = num_replicas * BASE_BATCH
    while True:
        perm = rng.permutation(len(x))
        for start in range(0, len(x) - size + 1, size):
            idx = perm[start : start + size].reshape(num_replicas, BASE_BATCH)
            yield x[idx], y[idx]


def init_mlp(rng: np.random.Generator, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    """He-initialised dense layers ``sizes[0] -> ... -> sizes[-1]``."""
    return [
        {
            "w": jnp.asarray(rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)), jnp.float32),
            "b": jnp.zeros(fan_out, jnp.float32),
        }
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True)
    ]


def mlp(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(mlp(params, x), axis=-1) == y)


def make_schedule(total_steps: int, lr: float) -> optax.Schedule:
    """The user's schedule for batch 32 over ``total_steps`` base steps: ``lr``, /10 at 50 % and again at 75 %."""
    return optax.piecewise_constant_schedule(lr, {total_steps // 2: 0.1, 3 * total_steps // 4: 0.1})


def train(data: dict[str, np.ndarray], num_replicas: int, total_steps: int, lr: float, seed: int) -> dict:
    """Train until ``τ ≥ total_steps`` with ``num_replicas`` replicas of batch 32; return a summary."""
    # The same schedule for every S. One replica needs no axis: AdaScale is then the identity
    # (plain SGD with momentum on lr(t)).
    schedule = make_schedule(total_steps, lr)
    tx = optax_adascale.adascale_sgd(schedule, momentum=0.9, axis_name=AXIS if num_replicas > 1 else None)

    rng = np.random.default_rng(seed)
    params = init_mlp(rng, (data["x"].shape[1], *HIDDEN, 10))
    opt_state = tx.init(params)

    def replica_step(params, opt_state, x, y):
        # One replica, one base batch: tx.update averages the gradients over AXIS itself.
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if num_replicas > 1:
        # The data is split over replicas (axis 0); params and optimizer state are shared (None):
        # tx.update returns the same update on every replica.
        step = jax.vmap(replica_step, in_axes=(None, None, 0, 0), out_axes=(None, None, 0), axis_name=AXIS)
    else:
        step = lambda params, opt_state, x, y: replica_step(params, opt_state, x[0], y[0])  # noqa: E731

    @jax.jit
    def train_step(params, opt_state, x, y):
        params, opt_state, loss = step(params, opt_state, x, y)
        return params, opt_state, jnp.mean(loss), optax_adascale.metrics(opt_state)

    loader = batches(data["x"], data["y"], num_replicas, rng)
    x, y = next(loader)
    train_step = train_step.lower(params, opt_state, x, y).compile()  # compile outside the timed loop

    iterations, tau = 0, 0.0
    start = time.perf_counter()
    with tqdm(total=total_steps, desc=f"S={num_replicas}", unit="base step", leave=False) as bar:
        while tau < total_steps:
            params, opt_state, loss, m = train_step(params, opt_state, x, y)
            x, y = next(loader)  # the host prepares the next batch while the step runs
            iterations += 1
            tau = float(m["scale_invariant_steps"])  # τ advances by the gain r_t ∈ [1, S] each iteration
            bar.update(min(int(tau), total_steps) - bar.n)
            if iterations % 50 == 0:
                bar.set_postfix(loss=f"{float(loss):.3f}", gain=f"{float(m['gain']):.2f}")
    seconds = time.perf_counter() - start

    return {
        "S": num_replicas,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,  # τ is the sum of the gains
        "train_acc": float(accuracy(params, data["x"], data["y"])),
        "test_acc": float(accuracy(params, data["x_test"], data["y_test"])),
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="T, the budget in base-batch steps (default 8000; smoke 300)")
    parser.add_argument("--lr", type=float, default=0.05, help="initial learning rate for batch 32 (default 0.05)")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 8], help="replica counts S (default 1 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the initialisation and the batch order")
    parser.add_argument("--smoke", action="store_true", help="small dataset and budget, for tests")
    args = parser.parse_args(argv)
    total_steps = args.steps or (300 if args.smoke else 8000)

    data = datasets.mnist1d(2_000 if args.smoke else 10_000)
    print(f"MNIST-1D: train {data['x'].shape}, test {data['x_test'].shape}")
    print(f"MLP {'-'.join(map(str, (data['x'].shape[1], *HIDDEN, 10)))}, AdaScale SGD momentum 0.9")
    print(f"Schedule for batch {BASE_BATCH}: lr {args.lr}, /10 at T/2 and 3T/4; budget T = {total_steps} base steps")

    rows = []
    for s in args.scales:
        r = train(data, s, total_steps, args.lr, args.seed)
        print(
            f"S={s}: {r['iterations']} iterations to tau={r['tau']:.1f}, mean gain {r['mean_gain']:.2f}, "
            f"test accuracy {r['test_acc']:.3f} ({r['seconds']:.1f} s)"
        )
        rows.append(r)

    columns = [  # (header, key, format)
        ("S", "S", "d"),
        ("batch", "batch", "d"),
        ("iterations", "iterations", "d"),
        ("tau", "tau", ".1f"),
        ("mean gain", "mean_gain", ".2f"),
        ("train acc", "train_acc", ".3f"),
        ("test acc", "test_acc", ".3f"),
        ("time (s)", "seconds", ".1f"),
    ]
    print()
    print("  ".join(f"{header:>10}" for header, _, _ in columns))
    for r in rows:
        r["batch"] = r["S"] * BASE_BATCH
        print("  ".join(f"{r[key]:>10{fmt}}" for _, key, fmt in columns))
    print(
        "time: under vmap the S replicas share one device, so an iteration does S times the work; "
        "on S devices it costs about as much as at S=1."
    )


if __name__ == "__main__":
    main()
