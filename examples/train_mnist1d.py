"""AdaScale SGD on MNIST-1D: one learning-rate schedule, written for batch 32, trained at S = 1, 8 and 32.

A Flax Linen 1-D CNN learns MNIST-1D (Greydanus 2020; generated locally, no download).
The learning-rate schedule is the user's: an exponential decay written once for the
base batch of 32 examples and a budget of ``T`` base-batch steps. It is never retuned.
We train three times, each until AdaScale's scale-invariant clock ``τ`` reaches ``T``:

* ``S = 1``: one device, batch 32, ``axis_name=None``. AdaScale is then exactly SGD
  with momentum on ``lr(t)``, and takes ``T`` iterations.
* ``S = 8``: 8 data-parallel replicas of batch 32 (256 per iteration).
* ``S = 32``: 8 replicas × 4 micro-batches of 32 (1024 per iteration). Each replica
  computes its gradient over 4 micro-batches with
  ``optax_adascale.value_and_grad`` and passes the statistics on with
  ``state.apply_gradients(grads=grads, microbatch_stats=stats)``.

Each update multiplies the step by the gain ``r_t ∈ [1, S]`` and advances ``τ`` by
``r_t``, so the schedule runs on base-batch progress: the test-accuracy curves of all
``S`` plotted against ``τ`` lie on top of each other (the paper's Figure 1). The
effective learning rate ``r_t · lr(⌊τ_t⌋)`` is AdaScale's choice, not a rule: it stays
well below linear scaling's ``S · lr`` while the gradient is mostly signal, and the
gain climbs towards ``S`` late in training, as the gradient shrinks below its noise.

The replicas are 8 devices when there are 8 accelerators, else 8 virtual CPU devices on
a CPU-only host; on a machine with 1 to 7 GPUs (or TPU cores) they run as a ``jax.vmap``
axis on the first accelerator (``--mesh vmap``, chosen automatically and printed). The
training step is the same per-replica function under every mesh: ``--mesh shard_map``
(default), ``--mesh pmap``, ``--mesh gspmd`` (``jax.jit`` of a ``jax.vmap`` with
``axis_name``, the replica axis sharded over an Auto-axes mesh) or ``--mesh vmap`` (all
replicas on one device). All draw the same batches and give the same results up to float
rounding. (On virtual CPU
devices ``gspmd`` is several times slower: XLA's SPMD partitioner all-gathers the
activations for the vmapped weight-gradient convolutions. Prefer ``shard_map``.)

Run::

    python examples/train_mnist1d.py                 # full run, about 2 minutes on 2 CPU cores
    python examples/train_mnist1d.py --smoke         # tiny data and budget, < 60 s
    python examples/train_mnist1d.py --mesh pmap --out /tmp/adascale

The plot goes to ``runs/adascale_mnist1d.png`` (``--out`` to change).

Reference: Johnson, Agrawal, Gu, Guestrin, "AdaScale SGD: A User-Friendly Algorithm for
Distributed Training", ICML 2020, https://arxiv.org/abs/2007.05105.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

BASE_BATCH = 32  # examples per micro-batch: the batch the schedule was written for
REPLICAS = 8  # data-parallel replicas (devices)
AXIS = "data"
MESHES = ("shard_map", "pmap", "gspmd", "vmap")


@dataclasses.dataclass(frozen=True)
class Config:
    num_samples: int  # MNIST-1D examples generated (80 % train, 20 % test)
    budget: int  # T: base-batch steps; train until τ ≥ T
    lr: float  # lr(0) of the user's schedule, for batch 32
    width: int  # CNN channels
    evals: int  # test-accuracy evaluations per run, evenly spaced in τ


FULL = Config(num_samples=20_000, budget=4_000, lr=0.05, width=32, evals=20)
SMOKE = Config(num_samples=2_000, budget=150, lr=0.05, width=8, evals=5)


# --------------------------------------------------------------------------- data, model, schedule


class CNN(nn.Module):
    """Three strided convolutions (40 → 20 → 10 → 5 positions) and a linear classifier."""

    width: int

    @nn.compact
    def __call__(self, x):
        x = x[..., None]  # (batch, 40, 1 channel)
        for kernel in (5, 3, 3):
            x = nn.relu(nn.Conv(self.width, (kernel,), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


@functools.partial(jax.jit, static_argnums=0)
def evaluate(model: nn.Module, params, x, y):
    """Mean cross-entropy and accuracy of ``model`` on ``(x, y)``."""
    logits = model.apply({"params": params}, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean(jnp.argmax(logits, axis=-1) == y)


def make_schedule(cfg: Config) -> optax.Schedule:
    """The user's schedule for batch 32: ``lr`` decaying exponentially to ``lr / 100`` at ``T``."""
    return optax.exponential_decay(cfg.lr, transition_steps=cfg.budget, decay_rate=0.01)


# --------------------------------------------------------------------------- the training step


def make_replica_step(apply_fn: Callable, microbatches: int, axis_name: str | None, mark_varying: bool):
    """One replica's step: its local gradient goes to ``state.apply_gradients``, which averages over the axis."""

    def loss_fn(params, x, y):
        logits = apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    micro_grad = optax_adascale.value_and_grad(loss_fn, num_microbatches=microbatches, unroll=True)

    def replica_step(state, x, y):
        # Under shard_map, differentiate w.r.t. params marked varying over the axis, else
        # jax.grad returns gradients already summed over it (AdaScale raises if you forget).
        params = jax.lax.pcast(state.params, axis_name, to="varying") if mark_varying else state.params
        if microbatches == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            state = state.apply_gradients(grads=grads)
        else:
            loss, grads, stats = micro_grad(params, x, y)
            state = state.apply_gradients(grads=grads, microbatch_stats=stats)
        if axis_name is not None:
            loss = jax.lax.pmean(loss, axis_name)
        return state, loss

    return replica_step


def build_step(state, data, *, scale: int, mesh_kind: str, devices: list, seed: int):
    """Place state and data for ``scale`` and ``mesh_kind``; return ``(step, state, data)``.

    ``step(state, x_train, y_train) -> (state, loss, metrics)``. Every mode draws the
    same batches: at iteration ``t`` replica ``i`` trains on rows
    ``randint(fold_in(key, t), (replicas, rows))[i]`` of the training set.
    """
    replicas = 1 if scale == 1 else REPLICAS
    if scale % replicas:
        raise ValueError(f"S must be 1 or a multiple of {REPLICAS}, got S={scale}")
    microbatches = scale // replicas
    rows = microbatches * BASE_BATCH
    key = jax.random.key(seed)
    x_train, y_train = data["x"], data["y"]
    num_train = x_train.shape[0]

    def batch_indices(step):
        return jax.random.randint(jax.random.fold_in(key, step), (replicas, rows), 0, num_train)

    def finish(state, loss):
        return state, loss, optax_adascale.metrics(state.opt_state)

    if scale == 1:  # one device, no axis: AdaScale is exactly the inner SGD on lr(t)
        replica_step = make_replica_step(state.apply_fn, 1, None, mark_varying=False)

        def step(state, xt, yt):
            idx = batch_indices(state.step)[0]
            return finish(*replica_step(state, xt[idx], yt[idx]))

        placed = jax.device_put((state, x_train, y_train), devices[0])
        return jax.jit(step, donate_argnums=0), *placed

    if mesh_kind == "pmap":
        from flax import jax_utils

        replica_step = make_replica_step(state.apply_fn, microbatches, AXIS, mark_varying=False)

        def step(state, xt, yt):
            idx = batch_indices(state.step)[jax.lax.axis_index(AXIS)]
            return finish(*replica_step(state, xt[idx], yt[idx]))

        placed = jax_utils.replicate((state, x_train, y_train), devices)
        return jax.pmap(step, axis_name=AXIS, devices=devices, donate_argnums=0), *placed

    if mesh_kind == "shard_map":
        mesh = jax.make_mesh((REPLICAS,), (AXIS,), devices=devices)  # Explicit axes
        replica_step = make_replica_step(state.apply_fn, microbatches, AXIS, mark_varying=True)

        def body(state, xt, yt):
            idx = batch_indices(state.step)[jax.lax.axis_index(AXIS)]
            return finish(*replica_step(state, xt[idx], yt[idx]))

        step = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
        placed = jax.device_put((state, x_train, y_train), NamedSharding(mesh, P()))
        return jax.jit(step, donate_argnums=0), *placed

    if mesh_kind == "vmap":
        # All replicas on one device (one GPU): a vmap axis with axis_name, no mesh.
        replica_step = make_replica_step(state.apply_fn, microbatches, AXIS, mark_varying=False)
        vmapped = jax.vmap(replica_step, in_axes=(None, 0, 0), out_axes=(None, None), axis_name=AXIS)

        def step(state, xt, yt):
            idx = batch_indices(state.step)
            return finish(*vmapped(state, xt[idx], yt[idx]))

        placed = jax.device_put((state, x_train, y_train), devices[0])
        return jax.jit(step, donate_argnums=0), *placed

    if mesh_kind == "gspmd":
        # jit + vmap with axis_name, the vmapped axis sharded over the mesh: no shard_map, no pmap.
        # JAX 0.10 needs Auto axes here (jax.sharding.Mesh), not jax.make_mesh's Explicit ones.
        mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
        replica_step = make_replica_step(state.apply_fn, microbatches, AXIS, mark_varying=False)
        vmapped = jax.vmap(replica_step, in_axes=(None, 0, 0), out_axes=(None, None), axis_name=AXIS)
        per_replica = NamedSharding(mesh, P(AXIS))

        def step(state, xt, yt):
            idx = batch_indices(state.step)
            x = jax.lax.with_sharding_constraint(xt[idx], per_replica)
            y = jax.lax.with_sharding_constraint(yt[idx], per_replica)
            return finish(*vmapped(state, x, y))

        placed = jax.device_put((state, x_train, y_train), NamedSharding(mesh, P()))
        return jax.jit(step, donate_argnums=0), *placed

    raise ValueError(f"--mesh must be one of {MESHES}, got {mesh_kind!r}")


# --------------------------------------------------------------------------- one training run


def train(data, cfg: Config, *, scale: int, mesh_kind: str, devices: list, seed: int) -> dict[str, Any]:
    """Train at ``scale`` until ``τ ≥ cfg.budget``; return curves and a summary."""
    from tqdm import tqdm

    from optax_adascale.flax import TrainState

    model = CNN(cfg.width)
    params = model.init(jax.random.key(seed), data["x"][:1])["params"]
    axis_name = None if scale == 1 else AXIS
    tx = optax_adascale.adascale_sgd(make_schedule(cfg), momentum=0.9, axis_name=axis_name)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step, state, x_train, y_train = build_step(
        state, data, scale=scale, mesh_kind=mesh_kind, devices=devices, seed=seed + 1
    )

    on_one_device = (lambda a: a[0]) if (mesh_kind == "pmap" and scale > 1) else (lambda a: a)

    def host_params(state):  # evaluation runs on the default device, from a host copy of the params
        return jax.tree.map(lambda a: on_one_device(np.asarray(a)), state.params)

    def test_accuracy(state):
        return float(evaluate(model, host_params(state), data["x_test"], data["y_test"])[1])

    start = time.perf_counter()
    step = step.lower(state, x_train, y_train).compile()
    compile_seconds = time.perf_counter() - start

    tau, iterations, next_eval = 0.0, 0, 0.0
    curve = {"tau": [0.0], "test_acc": [test_accuracy(state)]}
    trace = {"learning_rate": [], "gain": []}
    start = time.perf_counter()
    with tqdm(
        total=cfg.budget, desc=f"S={scale:<2} τ", unit="base step", leave=False, mininterval=0.5, disable=None
    ) as bar:
        while not optax_adascale.done(state.opt_state, cfg.budget):  # τ ≥ T (raises if every step is skipped)
            state, loss, m = step(state, x_train, y_train)
            iterations += 1
            loss, m = jax.tree.map(lambda a: float(on_one_device(np.asarray(a))), jax.device_get((loss, m)))
            trace["learning_rate"].append(m["learning_rate"])
            trace["gain"].append(m["gain"])
            bar.update(min(m["scale_invariant_steps"], cfg.budget) - min(tau, cfg.budget))
            tau = m["scale_invariant_steps"]
            if iterations % 25 == 0:
                bar.set_postfix(gain=f"{m['gain']:.2f}", loss=f"{loss:.3f}")
            if tau >= next_eval + cfg.budget / cfg.evals or tau >= cfg.budget:
                next_eval = tau
                curve["tau"].append(tau)
                curve["test_acc"].append(test_accuracy(state))
    seconds = time.perf_counter() - start

    train_loss, _ = evaluate(model, host_params(state), data["x"], data["y"])
    return {
        "S": scale,
        "iterations": iterations,
        "tau": tau,
        "test_acc": curve["test_acc"][-1],
        "train_loss": float(train_loss),
        "mean_gain": tau / iterations,  # τ is the sum of the gains
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "curve": curve,
        "trace": trace,
    }


# --------------------------------------------------------------------------- report


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'S':>3} {'batch':>6} {'iterations':>10} {'tau':>7} {'mean gain':>9} "
        f"{'test acc':>8} {'train loss':>10} {'wall (s)':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['S']:>3} {r['S'] * BASE_BATCH:>6} {r['iterations']:>10} {r['tau']:>7.1f} {r['mean_gain']:>9.2f} "
            f"{100 * r['test_acc']:>7.1f}% {r['train_loss']:>10.4f} {r['seconds']:>8.1f}"
        )


def plot(rows: list[dict[str, Any]], cfg: Config, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_lr, ax_gain) = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in rows:
        label = f"S={r['S']} ({r['iterations']} iterations)"
        ax_acc.plot(r["curve"]["tau"], 100 * np.asarray(r["curve"]["test_acc"]), marker=".", label=label)
        its = np.arange(1, r["iterations"] + 1)
        ax_lr.plot(its, r["trace"]["learning_rate"], label=f"S={r['S']}")
        ax_gain.plot(its, r["trace"]["gain"], label=f"S={r['S']}")
        if r["S"] > 1:
            color = ax_lr.get_lines()[-1].get_color()
            ax_lr.axhline(r["S"] * cfg.lr, color=color, linestyle=":", label=f"S·lr(0) = {r['S'] * cfg.lr:g}")
    ax_acc.set(
        xlabel="scale-invariant steps τ (base-batch steps)",
        ylabel="test accuracy (%)",
        title="Test accuracy vs τ: the curves align",
    )
    ax_acc.set_ylim(bottom=max(0.0, ax_acc.get_ylim()[0]))
    ax_lr.set(
        xlabel="iteration",
        ylabel="r_t · lr(⌊τ_t⌋)",
        xscale="log",
        yscale="log",
        title="Effective learning rate (dotted: linear scaling's S·lr(0))",
    )
    ax_gain.set(xlabel="iteration", ylabel="gain r_t", xscale="log", yscale="log", title="Gain r_t ∈ [1, S]")
    for ax in (ax_acc, ax_lr, ax_gain):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"AdaScale SGD on MNIST-1D, one schedule for batch {BASE_BATCH} (T = {cfg.budget})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def select_devices(mesh: str | None) -> tuple[list, str]:
    """Devices and mesh kind: ``REPLICAS`` accelerators; else one accelerator with a vmap axis; else virtual CPUs."""
    # Only affects the CPU backend; it must be set before JAX first runs a computation.
    jax.config.update("jax_num_cpu_devices", REPLICAS)
    devices = jax.devices()
    if devices[0].platform != "cpu" and len(devices) < REPLICAS:
        return devices[:1], "vmap" if mesh is None else mesh  # one GPU: the replicas as a vmap axis
    if len(devices) < REPLICAS:
        devices = jax.devices("cpu")
    return devices[:REPLICAS], "shard_map" if mesh is None else mesh


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mesh",
        choices=MESHES,
        default=None,
        help="how the 8 replicas run (default shard_map; vmap on a machine with 1-7 accelerators)",
    )
    parser.add_argument(
        "--scales",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        help=f"batch scales S to compare: 1 or multiples of {REPLICAS} (default 1 8 32)",
    )
    parser.add_argument("--budget", type=int, default=None, help="T: base-batch steps (default 4000, smoke 150)")
    parser.add_argument("--out", default="runs", help="directory for the PNG (default: runs/)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny data, model and budget (< 60 s)")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    if args.budget is not None:
        cfg = dataclasses.replace(cfg, budget=args.budget)

    devices, args.mesh = select_devices(args.mesh)
    if args.mesh != "vmap" and len(devices) < REPLICAS:
        parser.error(f"--mesh {args.mesh} needs {REPLICAS} devices; this machine has {len(devices)}: use --mesh vmap")
    data = datasets.mnist1d(cfg.num_samples)
    print(
        f"MNIST-1D (generated locally): {len(data['x'])} train / {len(data['x_test'])} test. "
        f"CNN width {cfg.width}, SGD momentum 0.9, lr {cfg.lr}·0.01^(t/T) written for batch {BASE_BATCH}, "
        f"T = {cfg.budget} base steps. {REPLICAS} replicas on {len(devices)} {devices[0].platform.upper()} "
        f"device{'s' if len(devices) > 1 else ''} via --mesh {args.mesh}."
    )

    rows = []
    for scale in args.scales:
        r = train(data, cfg, scale=scale, mesh_kind=args.mesh, devices=devices, seed=args.seed)
        print(
            f"S={r['S']}: {r['iterations']} iterations to τ={r['tau']:.1f}, mean gain {r['mean_gain']:.2f}, "
            f"test accuracy {100 * r['test_acc']:.1f}% ({r['seconds']:.1f} s + {r['compile_seconds']:.1f} s compile)"
        )
        rows.append(r)

    print()
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "adascale_mnist1d.png")
    plot(rows, cfg, path)
    print(f"\nwrote {path}")
    return rows


if __name__ == "__main__":
    main()
