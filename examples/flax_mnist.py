"""Flax's own NNX MNIST example, ported to AdaScale through the drop-in, on scikit-learn's 8×8 digits.

Flax's ``examples/mnist/train.py`` (main): an NNX CNN with BatchNorm and Dropout whose loss takes the dropout
``rngs`` at call time, ``nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)`` and one ``nnx.jit`` step. The
port changes the lines marked ``# AdaScale`` and nothing else in the model, the loss or the step:

* ``nnx.value_and_grad(loss_fn, has_aux=True)`` -> ``optax_adascale.value_and_grad(loss_fn, data_axes="data",
  has_aux=True)``, which takes the module and the ``nnx.Rngs`` as ``nnx.value_and_grad`` does and also returns the
  statistics; ``optimizer.update(model, grads, microbatch_stats=stats)`` passes them on;
* ``optax.sgd(lr, momentum)`` -> ``optax_adascale.adascale_sgd(schedule, momentum=0.9)``, the schedule written for
  the base batch of 32 (a cosine from 0.1 to 0 over ``T`` base-batch steps);
* a mesh of 8 devices (8 virtual CPU devices here) and the batch put on it split over ``"data"``;
* the loop stops at ``optax_adascale.done(optimizer.opt_state, T)`` (``τ ≥ T`` base-batch steps), not after a
  number of epochs: a larger batch covers an epoch in fewer, larger steps;
* BatchNorm's running statistics decay per base-batch step (``optax_adascale.base_step_average`` after the update):
  an update worth ``r`` base steps decays them by ``0.99^r``. Left per update, at S = 8 they see about 5× fewer
  updates over the same ``T`` and remember ``r/(1 − 0.99)`` base steps: T = 500, seeds 0-2, held-out accuracy
  97.8 % at S = 8 against 99.0 % at S = 1 (the weights as good as S = 1's: 98.9 % with the held-out batch's own
  statistics); with it, 99.1 % at S = 8 and 99.3 % at S = 32.

Runs, each until ``τ = T``:

* ``S = 1``: Flax's example unchanged (``nnx.value_and_grad``, ``optax.sgd``), batch 32: the reference;
* ``S = 8``: 8 data shards of 32 (batch 256);
* ``S = 32``: 8 data shards × ``num_microbatches=4`` of 32 (batch 1024).

BatchNorm inside the drop-in normalises over what the loss is given, as in your own ``jax.jit`` step: the global
batch (256 rows at S = 8), or each global micro-batch with ``num_microbatches`` (256 rows at S = 32, four calls
whose running statistics are threaded). ``docs/gspmd.md`` ("Flax NNX") says how to keep per-shard statistics.

Run::

    python examples/flax_mnist.py                   # S = 1, 8, 32, seeds 0 and 1, T = 3000 (the table in docs)
    python examples/flax_mnist.py --scales 8 --seeds 0 --budget 500
    python examples/flax_mnist.py --smoke           # CI: T = 20, S = 1 and 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

import datasets

BASE_BATCH = 32
DEVICES = 8


def make_cnn(rngs):
    from flax import nnx

    class CNN(nnx.Module):
        """Flax's MNIST CNN; the first dense layer takes 2 × 2 × 64 = 256 features (8×8 digits, not 28×28)."""

        def __init__(self, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=0.025)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
            self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(256, 256, rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=0.025)
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x, rngs: nnx.Rngs):
            x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
            x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
            x = x.reshape(x.shape[0], -1)  # flatten
            x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
            return self.linear2(x)

    return CNN(rngs)


def loss_fn(model, batch, rngs):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def make_steps(scale: int):
    """Flax's ``train_step`` and ``eval_step``; at ``scale > 1`` with AdaScale's drop-in."""
    from flax import nnx

    if scale == 1:  # Flax's example as written

        @nnx.jit
        def train_step(model, optimizer, metrics, batch, rngs):
            grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
            (loss, logits), grads = grad_fn(model, batch, rngs)
            metrics.update(loss=loss, logits=logits, labels=batch["label"])
            optimizer.update(model, grads)

    else:
        k = scale // DEVICES  # micro-batches per data shard: S = 8 shards × k

        @nnx.jit
        def train_step(model, optimizer, metrics, batch, rngs):
            grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", has_aux=True, num_microbatches=k)
            # AdaScale: a copy of BatchNorm's running statistics before the forward pass (nnx.state returns the
            # model's own Variables, which the forward pass updates in place: copy their values)
            before = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat))
            (loss, logits), grads, stats = grad_fn(model, batch, rngs)  # AdaScale
            if k == 1:
                metrics.update(loss=loss, logits=logits, labels=batch["label"])
            else:  # a floating aux is the mean over the k micro-batches: the logits do not come back per row
                metrics.update(loss=loss)
            optimizer.update(model, grads, microbatch_stats=stats)  # AdaScale
            # AdaScale: BatchNorm's statistics advanced k times (once per micro-batch); an update worth r base steps
            # decays them by momentum^r, as r small-batch steps would (its momentum: nnx.BatchNorm's 0.99)
            after = nnx.state(model, nnx.BatchStat)
            nnx.update(model, optax_adascale.base_step_average(before, after, 0.99, optimizer.opt_state, updates=k))

    @nnx.jit
    def eval_step(model, metrics, batch):
        loss, logits = loss_fn(model, batch, None)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])

    return train_step, eval_step


def batches(data, batch_size: int, seed: int):
    """Shuffled batches, epoch after epoch, incomplete batches dropped (Flax's ``drop_remainder=True``)."""
    rng = np.random.default_rng(seed)
    n = len(data["x"])
    while True:
        perm = rng.permutation(n)
        for i in range(n // batch_size):
            idx = perm[i * batch_size : (i + 1) * batch_size]
            yield {"image": data["x"][idx], "label": data["y"][idx]}


def train(data, scale: int, budget: int, lr: float, seed: int, progress: bool = True) -> dict:
    """Train until ``τ ≥ budget`` base-batch steps; return the run's row."""
    from flax import nnx
    from tqdm import tqdm

    schedule = optax.cosine_decay_schedule(lr, budget)  # written for the base batch of 32
    model = make_cnn(nnx.Rngs(seed))
    if scale == 1:
        tx = optax.sgd(schedule, momentum=0.9)
    else:
        tx = optax_adascale.adascale_sgd(schedule, momentum=0.9)  # AdaScale
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    if scale > DEVICES:  # micro-batches: the training metric is the loss alone (see train_step)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(seed + 1000)
    train_step, eval_step = make_steps(scale)

    mesh = jax.make_mesh((DEVICES,), ("data",))  # AdaScale: 8 data shards
    rows = NamedSharding(mesh, P("data"))
    stream = batches(data, BASE_BATCH * scale, seed)
    iterations, tau, gains, taus, start = 0, 0.0, [], [], time.perf_counter()
    bar = tqdm(total=budget, desc=f"S={scale} seed={seed}", unit="τ", file=sys.stderr, disable=not progress)
    # S = 1 is Flax's example as written: no mesh (on a mesh every device would compute the whole batch)
    with jax.set_mesh(mesh) if scale > 1 else contextlib.nullcontext():
        model.train()
        while not (tau >= budget if scale == 1 else optax_adascale.done(optimizer.opt_state, budget)):
            batch = next(stream)
            if scale > 1:
                batch = jax.device_put(batch, rows)  # AdaScale: the batch's rows split over the data shards
            train_step(model, optimizer, metrics, batch, rngs)
            iterations += 1
            if scale == 1:
                new_tau, gain = float(iterations), 1.0
            else:
                m = optax_adascale.metrics(optimizer.opt_state)
                new_tau, gain = float(m["scale_invariant_steps"]), float(m["gain"])
            gains.append(gain)
            taus.append(tau)  # τ before this update
            bar.update(min(new_tau, budget) - min(tau, budget))
            tau = new_tau
            if iterations % 50 == 0:
                bar.set_postfix(gain=f"{gain:.2f}", loss=f"{float(metrics.compute()['loss']):.4f}")
                metrics.reset()
        bar.close()
        seconds = time.perf_counter() - start
        model.eval()
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        eval_step(model, metrics, {"image": data["x_test"], "label": data["y_test"]})
        held_out = {k: float(v) for k, v in metrics.compute().items()}
    # the gain pinned at S (grad_sqr at 0: the training set memorised): the last run of updates at 0.99·S or more
    at_s = [g >= 0.99 * scale for g in gains] if scale > 1 else [False] * len(gains)
    first = len(at_s)
    while first > 0 and at_s[first - 1]:
        first -= 1
    return {
        "S": scale,
        "seed": seed,
        "batch": BASE_BATCH * scale,
        "iterations": iterations,
        "tau": tau,
        "mean_gain": tau / iterations,
        "final_gain": gains[-1],
        "at_S_share": sum(at_s) / len(at_s),
        "pinned_from_tau": taus[first] if first < len(at_s) else float("nan"),
        "test_acc": 100 * held_out["accuracy"],
        "test_loss": held_out["loss"],
        "seconds": seconds,
    }


COLUMNS = (
    "S",
    "seed",
    "batch",
    "iterations",
    "tau",
    "mean gain",
    "at S (%)",
    "pinned@tau",
    "test acc",
    "test loss",
    "wall (s)",
)


def print_table(rows: list[dict]) -> None:
    print(" ".join(f"{c:>10}" for c in COLUMNS))
    for r in rows:
        print(
            f"{r['S']:>10} {r['seed']:>10} {r['batch']:>10} {r['iterations']:>10} {r['tau']:>10.1f} "
            f"{r['mean_gain']:>10.2f} {100 * r['at_S_share']:>10.1f} {r['pinned_from_tau']:>10.0f} "
            f"{r['test_acc']:>9.2f}% {r['test_loss']:>10.4f} "
            f"{r['seconds']:>10.1f}"
        )
    scales = sorted({r["S"] for r in rows})
    if len(scales) > 1:
        print("\nmean over seeds:")
        print(f"{'S':>4} {'test acc':>9} {'test loss':>10} {'iterations':>10}")
        for s in scales:
            sel = [r for r in rows if r["S"] == s]
            acc = np.mean([r["test_acc"] for r in sel])
            loss = np.mean([r["test_loss"] for r in sel])
            its = np.mean([r["iterations"] for r in sel])
            print(f"{s:>4} {acc:>8.2f}% {loss:>10.4f} {its:>10.0f}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="T in base-batch steps (default 3000; smoke 20)")
    parser.add_argument("--lr", type=float, default=0.1, help="lr(0) of the cosine schedule, for batch 32")
    parser.add_argument("--scales", type=int, nargs="+", default=None, help="S values (1 or multiples of 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1; smoke 0)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--smoke", action="store_true", help="CI: T = 20, S = 1 and 8, one seed")
    args = parser.parse_args(argv)
    budget = args.budget or (20 if args.smoke else 3000)
    scales = args.scales or ([1, 8] if args.smoke else [1, 8, 32])
    seeds = args.seeds if args.seeds is not None else ([0] if args.smoke else [0, 1])
    for s in scales:
        if s != 1 and s % DEVICES:
            parser.error(f"--scales: S = {s} is neither 1 nor a multiple of the {DEVICES} devices")

    jax.config.update("jax_num_cpu_devices", DEVICES)  # CPU backend only; before JAX first runs
    data = datasets.digits(num_val=360)
    data = {k: v.reshape(-1, 8, 8, 1) if k.startswith("x") else v for k, v in data.items()}
    print(
        f"digits: {len(data['x'])} train / {len(data['x_test'])} held out; Flax's NNX CNN; cosine lr {args.lr} -> 0 "
        f"over T = {budget} base-batch steps of {BASE_BATCH}; adascale_sgd's defaults, momentum 0.9; "
        f"optax_adascale {optax_adascale.__version__}, jax {jax.__version__}",
        flush=True,
    )
    rows = []
    for seed in seeds:
        for s in scales:
            rows.append(train(data, s, budget, args.lr, seed, progress=not args.no_progress))
            r = rows[-1]
            print(
                f"S={s} seed={seed}: {r['iterations']} iterations, mean gain {r['mean_gain']:.2f}, "
                f"held-out accuracy {r['test_acc']:.2f}%, loss {r['test_loss']:.4f} ({r['seconds']:.0f} s)",
                flush=True,
            )
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
