"""The batch follows the noise: a byte-level LM whose global batch grows as its gradient noise grows.

A small byte-level transformer learns the Python standard library's own source (``examples/datasets.py``'s
``stdlib_source()``, read from disk; the last 5 % held out). The trainer is MaxText-shaped: one ``jax.jit`` step
over the global batch on a ``("data",)`` mesh of 4 devices (Auto axes), gradients from
``optax_adascale.value_and_grad(loss, data_axes="data")``. Each call of the step feeds **one fixed-size global
micro-batch** (4 shards × 2 windows of 64 bytes); the optimizer accumulates across calls and applies an update
when ``k_t`` micro-batches are in::

    ramp = optax_adascale.BatchRamp(min_microbatches=1, max_microbatches=16)
    tx = optax_adascale.adascale_adamw(schedule, weight_decay=0.1, accumulation_steps=ramp)
    while not optax_adascale.done(opt_state, T):
        position = int(optax_adascale.batch_plan(opt_state)["microbatches_seen"])
        params, opt_state = step(params, opt_state, *stream.microbatch(position))

``k_t`` is a traced value in the optimizer state, chosen after each update from the measured noise scale
``B = σ̄²/μ̄²`` (the largest power of two whose step is still worth ≥ 60 % of ``S`` base steps), so the step
compiles once for the whole ramp: ``S_t = 4·k_t`` goes from 4 to 64 base batches while AdaScale's gain keeps the
step right and ``τ`` keeps the schedule's clock. The loader never drops or repeats an example: call ``i`` reads
rows ``[i·M, (i+1)·M)`` of a per-epoch permutation (``M`` the global micro-batch), whatever ``k``, and its
position ``i`` is read from the optimizer state. Halfway (``--checkpoint-at``) the example saves an Orbax
checkpoint, restores it into a fresh state and resumes from it, in the middle of an accumulation window if that
is where it is. A progress bar shows ``S_t``; at the end a table lists every change of rung, and a plot of
``S_t``, the gain, ``B_noise`` and the effective learning rate against ``τ`` goes to ``runs/batch_ramp.png``.

The 4 devices are accelerators when there are that many, else virtual CPU devices. On 2 shared CPU cores
``python examples/batch_ramp.py`` printed (the progress bar, on stderr, left out)::

    Initial validation loss: 5.4416 nats/byte (log 256 = 5.5452)
    checkpoint at τ = 602 (call 249, micro-batch 1 of 2): saved, restored (identical), resuming at call 249

           τ    k    S   B_noise   calls   (a row per change of rung)
           2    1    4      1.17       1
         251    2    8     19.18     104
        1078    4   16     29.16     436

    updates 282, τ 1207.5, validation loss 2.8359, wall 51 s
    examples 3872 windows: 484 calls of 8, each window of an epoch fed once
    compiled programs of the train step for the whole ramp: 1

The noise scale rose from about 1 to 30 base batches and the batch followed it from 4 to 16 base batches.

Run::

    python examples/batch_ramp.py               # T = 1200 base steps, a few minutes on 2 CPU cores
    python examples/batch_ramp.py --smoke       # a tiny model, T = 60, for CI

References: Johnson et al., AdaScale SGD, ICML 2020; McCandlish et al., An Empirical Model of Large-Batch
Training, 2018.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import optax_adascale

import datasets

SHARDS, ROWS = 4, 2  # the global micro-batch: 4 data shards × 2 windows; one shard's rows are the base batch


class MicrobatchStream:
    """Call ``i``'s global micro-batch: rows ``[i·M, (i+1)·M)`` of epoch ``⌊i·M/N⌋``'s permutation of the windows.

    A pure function of the position, so the loop can restart anywhere: from the optimizer state's
    ``batch_plan(opt_state)["microbatches_seen"]`` after a restore. Every window is fed once per epoch, whatever
    the ramp does with the micro-batches (here ``M`` divides nothing in particular: an epoch's tail carries over).
    """

    def __init__(self, windows: np.ndarray, rows: int, seed: int = 0):
        self.windows, self.rows, self.seed = windows, rows, seed

    def indices(self, position: int) -> np.ndarray:
        n = len(self.windows)
        flat = np.arange(position * self.rows, (position + 1) * self.rows)
        epochs = flat // n
        out = np.empty_like(flat)
        for e in np.unique(epochs):
            order = np.random.default_rng([self.seed, int(e)]).permutation(n)
            out[epochs == e] = order[flat[epochs == e] % n]
        return out

    def microbatch(self, position: int) -> np.ndarray:
        return self.windows[self.indices(position)]


def model(d: int, layers: int, heads: int, ctx: int):
    """A pre-LN byte-level decoder (tied embedding): ``(init, loss)``."""

    def init(key):
        k = jax.random.split(key, 5)
        n = lambda key, shape, std: jax.random.normal(key, shape) * std  # noqa: E731
        return {
            "embed": n(k[0], (256, d), 0.02),
            "pos": n(k[1], (ctx, d), 0.02),
            "qkv": n(k[2], (layers, d, 3 * d), 0.02),
            "out": n(k[3], (layers, d, d), 0.02 / math.sqrt(2 * layers)),
            "mlp_in": n(k[4], (layers, d, 4 * d), 0.02),
            "mlp_out": jnp.zeros((layers, 4 * d, d)),
        }

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    causal = jnp.tril(jnp.ones((ctx, ctx), bool))

    def block(h, p):
        b, n, _ = h.shape
        q, k, v = jnp.split((norm(h) @ p["qkv"]).reshape(b, n, 3 * heads, d // heads), 3, axis=2)
        att = jax.nn.softmax(jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads), -1e9))
        h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, n, d) @ p["out"]
        return h + jax.nn.gelu(norm(h) @ p["mlp_in"]) @ p["mlp_out"], None

    def loss(params, windows):
        tokens = windows.astype(jnp.int32)
        h = params["embed"][tokens[:, :-1]] + params["pos"]
        h, _ = lax.scan(block, h, {k: params[k] for k in ("qkv", "out", "mlp_in", "mlp_out")})
        logits = norm(h) @ params["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return init, loss


def select_devices() -> list:
    """4 accelerators if there are that many, else 4 virtual CPU devices."""
    jax.config.update("jax_num_cpu_devices", 8)  # before JAX initialises its CPU backend
    devices = jax.devices()
    return (devices if len(devices) >= SHARDS else jax.devices("cpu"))[:SHARDS]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, T = 60 (CI)")
    parser.add_argument("--steps", type=int, default=None, help="T, base-batch steps (default 1200; smoke 60)")
    parser.add_argument("--max-microbatches", type=int, default=16, help="the ramp's top rung (S_max = 4·k)")
    parser.add_argument("--checkpoint-at", type=float, default=0.5, help="save and restore at this fraction of T")
    parser.add_argument("--out", type=Path, default=Path("runs"), help="where the plot goes")
    args = parser.parse_args(argv)

    d, layers, heads, ctx = (16, 1, 2, 16) if args.smoke else (64, 2, 4, 64)
    T = args.steps or (60 if args.smoke else 1200)
    text, _ = datasets.stdlib_source()
    data = np.frombuffer(text, np.uint8)
    split = int(0.95 * len(data))
    windows = data[: split // (ctx + 1) * (ctx + 1)].reshape(-1, ctx + 1)
    val = datasets.validation_windows(data[split:], 64 if args.smoke else 256, ctx)
    stream = MicrobatchStream(windows, SHARDS * ROWS)

    mesh = jax.make_mesh((SHARDS,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=select_devices())
    init, loss_fn = model(d, layers, heads, ctx)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, T // 20), T, 3e-4)
    ramp = optax_adascale.BatchRamp(min_microbatches=1, max_microbatches=args.max_microbatches)
    tx = optax_adascale.adascale_adamw(schedule, b2=0.99, weight_decay=0.1, accumulation_steps=ramp)
    # An Auto mesh does not record the parameters' layout: say it (replicated, P() for every leaf) with param_specs.
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data", param_specs=P())
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads, stats = grad_fn(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(loss_fn)

    def fresh():
        with jax.set_mesh(mesh):
            params = jax.device_put(init(jax.random.key(0)), replicated)
            return params, jax.jit(tx.init)(params)

    params, opt_state = fresh()
    checkpoint_tau = args.checkpoint_at * T
    checkpointed = False
    changes, log, fed = [], [], 0
    start = time.perf_counter()
    print(f"Initial validation loss: {float(evaluate(params, val)):.4f} nats/byte (log 256 = {math.log(256):.4f})")
    bar = tqdm(total=T, unit="τ", desc="training", file=sys.stderr, mininterval=0.5)
    with jax.set_mesh(mesh):
        while not optax_adascale.done(opt_state, T):
            plan = optax_adascale.batch_plan(opt_state)
            position = int(plan["microbatches_seen"])
            assert position == fed  # the loader's position lives in the optimizer state
            params, opt_state, loss = step(params, opt_state, jax.device_put(stream.microbatch(position), rows))
            fed += 1
            m = optax_adascale.metrics(opt_state)
            if int(optax_adascale.get_adascale_state(opt_state).micro_step) == 0:  # an update was applied
                tau, k = float(m["scale_invariant_steps"]), int(m["microbatches"])
                log.append(
                    (tau, float(m["scale"]), float(m["gain"]), float(m["noise_scale"]), float(m["learning_rate"]))
                )
                if not changes or changes[-1][1] != k:
                    changes.append((tau, k, float(m["noise_scale"]), int(m["microbatches_seen"])))
                bar.update(int(tau) - bar.n)
                bar.set_postfix(S=int(m["next_scale"]), k=k, gain=f"{float(m['gain']):.2f}", loss=f"{float(loss):.3f}")
            s = optax_adascale.get_adascale_state(opt_state)
            mid_window = int(s.micro_step) > 0 or int(s.ramp.microbatches) == 1  # inside a window if there is one
            if not checkpointed and float(m["scale_invariant_steps"]) >= checkpoint_tau and mid_window:
                checkpointed = True
                where = f"call {position + 1}, micro-batch {int(s.micro_step)} of {int(s.ramp.microbatches)}"
                with tempfile.TemporaryDirectory() as directory, ocp.StandardCheckpointer() as ckpt:
                    ckpt.save(f"{directory}/ckpt", {"params": params, "opt_state": opt_state})
                    ckpt.wait_until_finished()
                    target = dict(zip(("params", "opt_state"), fresh(), strict=True))
                    restored = ckpt.restore(f"{directory}/ckpt", target)
                now = {"params": params, "opt_state": opt_state}
                same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), restored, now))
                assert same, "the restored state differs from the saved one"
                params, opt_state = restored["params"], restored["opt_state"]
                tqdm.write(
                    f"checkpoint at τ = {float(m['scale_invariant_steps']):.0f} ({where}): saved, restored "
                    f"(identical), resuming at call {fed}",
                    file=sys.stdout,
                )
    bar.close()
    wall = time.perf_counter() - start
    s = optax_adascale.get_adascale_state(opt_state)
    print()
    print(f"{'τ':>8} {'k':>4} {'S':>4} {'B_noise':>9} {'calls':>7}   (a row per change of rung)")
    for tau, k, noise, seen in changes:
        print(f"{tau:8.0f} {k:4d} {k * SHARDS:4d} {noise:9.2f} {seen:7d}")
    examples = fed * SHARDS * ROWS
    print()
    print(
        f"updates {int(s.count)}, τ {float(optax_adascale.scale_invariant_steps(opt_state)):.1f}, "
        f"validation loss {float(evaluate(params, val)):.4f}, wall {wall:.0f} s"
    )
    print(f"examples {examples} windows: {fed} calls of {SHARDS * ROWS}, each window of an epoch fed once")
    print(f"compiled programs of the train step for the whole ramp: {step._cache_size()}")
    plot(log, args.out / "batch_ramp.png")
    return 0


def plot(log, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tau, scale, gain, noise, lr = (np.asarray(c) for c in zip(*log, strict=True))
    fig, axes = plt.subplots(4, 1, figsize=(6.4, 7.2), sharex=True)
    for ax, values, label, log_y in zip(
        axes,
        (scale, gain, noise, lr),
        ("S_t (base batches)", "gain r_t", "B_noise = σ̄²/μ̄²", "r_t·lr(⌊τ⌋)"),
        (True, False, True, False),
        strict=True,
    ):
        ax.plot(tau, values, drawstyle="steps-post", lw=1.0)
        ax.set_ylabel(label)
        if log_y:
            ax.set_yscale("log")
    rungs = [SHARDS * 2**i for i in range(6)]
    axes[0].set_yticks(rungs, [str(s) for s in rungs])
    axes[0].minorticks_off()
    axes[-1].set_xlabel("τ (base-batch steps)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
