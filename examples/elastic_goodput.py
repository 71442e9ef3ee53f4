"""Elastic AdaScale driven by goodput: re-choose the batch scale ``S`` every ``K`` iterations.

An MLP learns MNIST-1D (generated locally by ``mnist1d``, no download) with AdaScale SGD
on one base-batch learning-rate schedule (batch 32, ``T`` base-batch steps, step decays
at ``T/2`` and ``3T/4``). The ``S`` data-parallel replicas are a ``jax.vmap`` axis with
``axis_name`` on one device. Every ``K`` iterations the loop reads AdaScale's gradient
statistics (``σ̄²``, ``μ̄²`` in ``optax_adascale.metrics``) and asks
``optax_adascale.goodput.choose_scale`` for the candidate ``S`` with the most
progress per second, ``gain(S)/t(S)`` (Pollux's goodput), where ``t(S)`` is the time of
one iteration at scale ``S``. As training goes on, the gradient noise scale
``B = σ̄²/μ̄²`` grows and so does the best ``S``.

The scale changes *without touching the optimizer state*: the moving averages are in
base-batch units, ``τ`` is base-batch progress, and with replicas on a vmap axis (no
accumulation buffers) the state has the same structure at every ``S``; the next
iteration simply runs with another number of replicas. (With ``accumulation_steps``
the buffers change shape: move the state with ``optax_adascale.transfer_state``.)

The first ``K`` iterations run at the smallest candidate: before the first update there
are no statistics to choose from. Candidates start at ``S = 2``: at ``S = 1`` AdaScale
sees one gradient sample per update, estimates no noise, and the choice could never grow.

**Whose seconds?** Here all replicas share one device (on this CPU: two cores), so a step's
real time grows about linearly with ``S`` with hardly any fixed cost, and the smallest
``S`` would always win (``--measure`` on a CPU shows it): it says nothing about a
data-parallel job on ``S`` accelerators. By default the choice is driven, and every
run is timed, by a clearly labelled SYNTHETIC step-time model ``t(S) = t0 + t1·S``
(20 ms of fixed cost per iteration, launch, all-reduce and optimizer, plus 1.5 ms per
base batch). All reported times are that model's seconds. ``--measure`` instead times
real iterations at every candidate ``S`` (meant for a real accelerator) and uses
``goodput.StepTimeModel.interpolate`` of the measured times.

For comparison the same training is also run at every fixed candidate ``S`` to the same
``τ ≥ T`` (the same quality target: the final validation accuracy of each is printed),
and the adaptive run's modelled time is compared with the best fixed ``S``'s.

Run::

    python examples/elastic_goodput.py            # T = 10000, S in 2..64: about 1-2 minutes on 2 CPU cores
    python examples/elastic_goodput.py --smoke    # T = 2000, S in {2, 4, 8, 16}: < 40 s
    python examples/elastic_goodput.py --measure  # time real steps instead of the synthetic model

It prints the adaptive run's ``S`` over ``τ`` (a row per change: where it started, the
noise scale and the advisor's goodput at the choice, the mean gain of the phase) and the
time every run took to reach ``τ ≥ T``, with the time saved against the best fixed ``S``.

References: Johnson et al., AdaScale SGD, ICML 2020; McCandlish et al., An Empirical Model
of Large-Batch Training, 2018; Qiao et al., Pollux, OSDI 2021.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_adascale
from optax_adascale import goodput

import datasets

AXIS = "data"
SIZES = (40, 128, 128, 10)  # MLP widths


@dataclasses.dataclass(frozen=True)
class Config:
    num_samples: int  # MNIST-1D examples generated (80 % train, 20 % validation)
    budget: int  # T: base-batch steps; train until τ ≥ T
    every: int  # K: iterations between re-choices of S
    candidates: tuple[int, ...]  # the scales S to choose from (each >= 2)


FULL = Config(num_samples=20_000, budget=10_000, every=25, candidates=(2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
SMOKE = Config(num_samples=5_000, budget=2_000, every=10, candidates=(2, 4, 8, 16))


# --------------------------------------------------------------------------- data, model, schedule


def init_params(key: jax.Array) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in), "b": jnp.zeros(fan_out)}
        for k, fan_in, fan_out in zip(keys, SIZES[:-1], SIZES[1:])
    ]


def apply(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), y).mean()


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(apply(params, x), axis=-1) == y)


def make_tx(lr: float, budget: int) -> optax.GradientTransformation:
    """The user's schedule for batch 32 (``lr``, ÷10 at T/2 and again at 3T/4), run by AdaScale on τ."""
    schedule = optax.piecewise_constant_schedule(lr, {budget // 2: 0.1, 3 * budget // 4: 0.1})
    # The update clock (0.3's): this example's recorded phases (benchmarks/RESULTS.md) were measured on it; on 0.4.0's
    # guarded τ clock the measured noise scale is not monotone here and goodput steps S back down (not re-recorded).
    return optax_adascale.adascale_sgd(schedule, momentum=0.9, weight_decay=1e-4, axis_name=AXIS, clock="update")


# --------------------------------------------------------------------------- K iterations at scale S


@functools.cache
def chunk_fn(tx: optax.GradientTransformation, scale: int, batch: int, every: int):
    """Up to ``every`` iterations at ``scale`` replicas (stopping once ``τ ≥ budget``), in one jitted loop.

    Returns ``(params, opt_state, iterations done, metrics)``. Iteration ``i`` of the run draws
    replica ``j``'s batch from ``randint(fold_in(key, i), (scale, batch))[j]``.
    """

    def replica_step(params, opt_state, x, y):  # one replica's own gradient; update() averages over AXIS
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.vmap(replica_step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name=AXIS)

    def chunk(params, opt_state, start, budget, key, x_train, y_train):
        def cond(carry):
            _, opt_state, i = carry
            return (i < every) & (optax_adascale.scale_invariant_steps(opt_state) < budget)

        def body(carry):
            params, opt_state, i = carry
            idx = jax.random.randint(jax.random.fold_in(key, start + i), (scale, batch), 0, x_train.shape[0])
            params, opt_state = step(params, opt_state, x_train[idx], y_train[idx])
            return params, opt_state, i + 1

        params, opt_state, done = jax.lax.while_loop(cond, body, (params, opt_state, jnp.int32(0)))
        return params, opt_state, done, optax_adascale.metrics(opt_state)

    return jax.jit(chunk)


def compile_all(tx, candidates, batch: int, every: int, data) -> float:
    """Compile the loop at every candidate ``S`` up front (a call that runs no iteration); return the seconds."""
    start = time.perf_counter()
    params = init_params(jax.random.key(0))
    for s in candidates:
        chunk_fn(tx, s, batch, every)(params, tx.init(params), 0, 0.0, jax.random.key(0), data["x"], data["y"])
    return time.perf_counter() - start


def measure_step_times(tx, candidates, batch: int, every: int, data) -> dict[int, float]:
    """Seconds per iteration at each candidate ``S``, timed on this machine (3 calls of ``every`` iterations)."""
    params = init_params(jax.random.key(0))
    times = {}
    for s in candidates:
        fn = chunk_fn(tx, s, batch, every)
        args = (params, tx.init(params), 0, float("inf"), jax.random.key(0), data["x"], data["y"])
        jax.block_until_ready(fn(*args))  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        times[s] = (time.perf_counter() - start) / (3 * every)
    return times


# --------------------------------------------------------------------------- one run


def train(tx, data, cfg: Config, *, batch, model, policy, seed: int, label: str) -> dict[str, Any]:
    """Train until ``τ ≥ T``; ``policy(metrics) -> (S, Choice or None)`` picks S every ``K`` iterations."""
    from tqdm import tqdm

    key = jax.random.key(seed + 1)
    params = init_params(jax.random.key(seed))
    opt_state = tx.init(params)
    m = jax.device_get(optax_adascale.metrics(opt_state))
    tau, iterations, modelled, phases = 0.0, 0, 0.0, []
    start = time.perf_counter()
    with tqdm(
        total=cfg.budget, desc=f"{label:>9} τ", unit="base step", leave=False, mininterval=0.5, disable=None
    ) as bar:
        while tau < cfg.budget:
            scale, choice = policy(m)
            fn = chunk_fn(tx, scale, batch, cfg.every)
            params, opt_state, done, m = fn(params, opt_state, iterations, float(cfg.budget), key, data["x"], data["y"])
            done, m = jax.device_get((done, m))  # the values a training loop fetches anyway (τ, for the loop)
            done = int(done)
            new_tau = float(m["scale_invariant_steps"])
            if not phases or phases[-1]["S"] != scale:
                phases.append(
                    {
                        "tau_start": tau,
                        "S": scale,
                        "iterations": 0,
                        "tau": 0.0,
                        "choice": choice,
                        "noise_scale": choice.noise_scale if choice else float("nan"),
                    }
                )
            phases[-1]["iterations"] += done
            phases[-1]["tau"] += new_tau - tau
            modelled += done * float(model(scale))
            iterations += done
            bar.update(min(new_tau, cfg.budget) - min(tau, cfg.budget))
            bar.set_postfix(S=scale, gain=f"{float(m['gain']):.2f}", B=f"{float(m['noise_scale']):.1f}")
            tau = new_tau
    seconds = time.perf_counter() - start
    return {
        "label": label,
        "iterations": iterations,
        "tau": tau,
        "modelled": modelled,
        "val_acc": float(accuracy(params, data["x_test"], data["y_test"])),
        "seconds": seconds,
        "phases": phases,
    }


# --------------------------------------------------------------------------- report


def print_phases(run: dict[str, Any], best_fixed: int) -> None:
    """One row per change of S: where it started, the choice's numbers at that moment, what the phase achieved."""
    print("Adaptive S over τ (a row per change of S; noise scale, τ/s and the goodput ratio are the advisor's")
    print(f"numbers at the choice, the ratio against the best fixed S = {best_fixed}; mean gain is over the phase):")
    header = (
        f"{'tau start':>9} {'S':>3} {'iterations':>10} {'mean gain':>9} {'noise scale':>11} {'τ/s':>7} "
        f"{'vs S=' + str(best_fixed):>9}"
    )
    print(header)
    print("-" * len(header))
    for p in run["phases"]:
        c = p["choice"]
        i, j = list(c.candidates).index(p["S"]), list(c.candidates).index(best_fixed)
        ratio = f"{c.tau_per_second[i] / c.tau_per_second[j]:.3f}x"
        if c.note.startswith("no gradient statistics"):
            ratio = "n/a"
        gain = p["tau"] / p["iterations"] if p["iterations"] else float("nan")
        noise = p["noise_scale"]
        noise_text = "n/a" if np.isnan(noise) else f"{noise:.2f}"  # NaN: not measured yet (before the first update)
        print(
            f"{p['tau_start']:>9.1f} {p['S']:>3} {p['iterations']:>10} {gain:>9.2f} {noise_text:>11} "
            f"{c.tau_per_second[i]:>7.1f} {ratio:>9}"
        )


def print_times(runs: list[dict[str, Any]], unit: str) -> None:
    """The adaptive run and every fixed S, each until τ ≥ T: modelled time, and the quality reached."""
    adaptive = runs[0]["modelled"]
    header = (
        f"{'run':>9} {'S':>6} {'iterations':>10} {'tau':>8} {'time to T (' + unit + ' s)':>24} "
        f"{'vs adaptive':>11} {'val acc':>8} {'wall here (s)':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in runs:
        scales = [p["S"] for p in r["phases"]]
        s = f"{min(scales)}-{max(scales)}" if r["label"] == "adaptive" else str(scales[0])
        print(
            f"{r['label']:>9} {s:>6} {r['iterations']:>10} {r['tau']:>8.1f} {r['modelled']:>24.3f} "
            f"{r['modelled'] / adaptive:>10.3f}x {100 * r['val_acc']:>7.1f}% {r['seconds']:>13.1f}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=int, default=None, help="T: base-batch steps (default 10000, smoke 2000)")
    parser.add_argument("--num-samples", type=int, default=None, help="MNIST-1D examples (default 20000, smoke 5000)")
    parser.add_argument("--every", type=int, default=None, help="K: iterations between choices (default 25, smoke 10)")
    parser.add_argument(
        "--candidates",
        type=int,
        nargs="+",
        default=None,
        help="candidate scales S, each >= 2 (default 2 3 4 6 8 12 16 24 32 48 64; smoke 2 4 8 16)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="base batch (per replica)")
    parser.add_argument("--lr", type=float, default=0.05, help="base-batch learning rate")
    parser.add_argument("--t0", type=float, default=0.020, help="synthetic model: seconds per iteration, fixed")
    parser.add_argument("--t1", type=float, default=0.0015, help="synthetic model: seconds per base batch")
    parser.add_argument("--measure", action="store_true", help="time real iterations instead of the synthetic model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="small data and budget (< 40 s)")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    cfg = dataclasses.replace(
        cfg,
        budget=args.budget or cfg.budget,
        every=args.every or cfg.every,
        num_samples=args.num_samples or cfg.num_samples,
    )
    candidates = sorted(set(args.candidates or cfg.candidates))
    if candidates[0] < 2:
        parser.error("candidates must be >= 2: at S = 1 AdaScale estimates no gradient noise, so S could never grow")

    data = datasets.mnist1d(cfg.num_samples)
    tx = make_tx(args.lr, cfg.budget)
    device = jax.devices()[0]
    print(
        f"AdaScale + goodput: MNIST-1D MLP ({len(data['x'])} train / {len(data['x_test'])} validation), "
        f"lr {args.lr} for batch {args.batch_size}, T = {cfg.budget} base steps, S in {candidates} "
        f"re-chosen every K = {cfg.every} iterations; replicas on a vmap axis on {device.platform.upper()}."
    )
    data = {k: jax.device_put(v) for k, v in data.items()}
    seconds = compile_all(tx, candidates, args.batch_size, cfg.every, data)
    print(f"compiled the training loop at {len(candidates)} scales in {seconds:.1f} s (not counted below)")
    if args.measure:
        measured = measure_step_times(tx, candidates, args.batch_size, cfg.every, data)
        model = goodput.StepTimeModel.interpolate(measured)
        unit = "measured"
        print(f"MEASURED step-time model on {device.device_kind}: {model.description} per iteration")
    else:
        model = goodput.StepTimeModel.linear(args.t0, args.t1)
        unit = "synthetic"
        print(
            f"SYNTHETIC step-time model: {model.description} per iteration "
            "(not this machine's timing; all times below are this model's seconds; --measure to time real steps)"
        )

    def adaptive(m):
        choice = goodput.choose_scale(m, model, candidates)
        return choice.scale, choice

    runs = [train(tx, data, cfg, batch=args.batch_size, model=model, policy=adaptive, seed=args.seed, label="adaptive")]
    first = runs[0]["phases"][0]["choice"]
    print(f"first choice, before any update: S = {first.scale} ({first.note})")
    for s in candidates:
        runs.append(
            train(
                tx,
                data,
                cfg,
                batch=args.batch_size,
                model=model,
                policy=lambda m, s=s: (s, None),
                seed=args.seed,
                label=f"fixed {s}",
            )
        )
    fixed = runs[1:]
    best = min(fixed, key=lambda r: r["modelled"])
    best_scale = best["phases"][0]["S"]

    print()
    print_phases(runs[0], best_scale)
    print()
    print(f"Time to reach τ ≥ T = {cfg.budget} ({unit} step-time model's seconds):")
    print_times(runs, unit)
    saved = 1 - runs[0]["modelled"] / best["modelled"]
    print()
    print(
        f"adaptive: {runs[0]['modelled']:.3f} s vs best fixed S = {best_scale}: {best['modelled']:.3f} s "
        f"({unit}); time saved against the best fixed S: {100 * saved:.1f}%"
    )
    return {"runs": runs, "best_fixed": best_scale, "saved": saved}


if __name__ == "__main__":
    main()
