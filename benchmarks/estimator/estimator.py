"""Decide the default estimator with data: which moving average of σ̂², μ̂² tracks the true gain.

Every candidate is ``optax_adascale.adascale(inner, lr, axis_name=..., estimator=Estimator(**options))`` with
the options its name spells (:func:`candidate_options`), run on the five setups of ``tasks.py`` at
``S ∈ {4, 8, 16, 32, 64}`` (``S`` vmap replicas of the base batch) until ``τ ≥ T``, beside the ``S = 1`` run of
the same seed (AdaScale with one replica is the inner optimizer on ``lr(t)``). A run is one jitted program:
a ``lax.scan`` over ``NUM_EVALS`` checkpoints at ``τ = kT/NUM_EVALS``, each a ``lax.while_loop`` of steps.
At every checkpoint the reference gain is computed at the run's own parameters: in closed form
(regression) or offline from ``OFFLINE_BATCHES`` fresh base batches (two halves give its own noise).

Each cell (setup, candidate, S, seed) is cached as JSON under ``benchmarks/estimator/cells/``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.harness import stats  # noqa: E402
from optax_adascale import Estimator, adascale, get_adascale_state, metrics  # noqa: E402

AXIS = "replicas"
SCALES = (4, 8, 16, 32, 64)
NUM_EVALS = 20  # checkpoints at τ = kT/20; tracking is read at those after the first 5 % of τ
OFFLINE_BATCHES = 256
LOG_POINTS = 300
BASELINE = "S1"  # the S = 1 run of a seed (every candidate is the identity there)
FAIRSCALE = "fairscale"  # what the S = 1 baseline runs under (every candidate is the identity at S = 1)
PACKAGE_DEFAULT = "frac(0.05)+floor(4)+unb"  # optax_adascale.Estimator(), chosen by this study
# The candidates of the full grid (the pilot's pruning is in the README).
CANDIDATES = (
    "fairscale",
    PACKAGE_DEFAULT,
    "H(T/100)+unb",
    "frac(0.05)+unb",
    "frac(0.05)+floor(3)+unb",
    "frac(0.05)+floor(2)+unb",
)


def candidate_options(setup, name: str, scale: int) -> dict:
    """The estimator options a candidate's name spells, ``+``-joined.

    * ``fairscale``: the 0.1 default, spelled out: ``smoothing = max(1 − n/1000, 0)`` per update, each step's
      μ̂² floored at 0;
    * ``unb``: ``unbiased_sqr=True`` (average μ̂² unfloored, floor the average);
    * ``H(T/k)`` or ``H(h)``: ``horizon`` of ``T/k`` or ``h`` base steps (needs the run length);
    * ``frac(c)``: ``memory_fraction=c``: a memory of ``c·τ_t`` base steps (no run length);
    * ``M(m)``: ``smoothing = max(1 − n/m, 0)``: FairScale's form remembering ``m`` samples instead of 1000;
    * ``s(θ)``: ``smoothing=θ``;
    * ``floor(m)``: with ``frac(c)``, ``min_updates=m``: a memory of at least ``m`` updates.

    The keys are :class:`optax_adascale.Estimator`'s fields (``fairscale`` spelled as its θ and floored μ̂²,
    which is the same arithmetic, so that its θ can be traced like the others').
    """
    options: dict = {}
    for part in name.split("+"):
        if part == "fairscale":
            options["smoothing"] = max(1.0 - scale / 1000.0, 0.0)
        elif part == "unb":
            options["unbiased_sqr"] = True
        elif m := re.fullmatch(r"H\(T/([\d.]+)\)", part):
            options["horizon"] = setup.total_steps / float(m[1])
        elif m := re.fullmatch(r"H\(([\d.]+)\)", part):
            options["horizon"] = float(m[1])
        elif m := re.fullmatch(r"frac\(([\d.]+)\)", part):
            options["memory_fraction"] = float(m[1])
        elif m := re.fullmatch(r"M\(([\d.]+)\)", part):
            options["smoothing"] = max(1.0 - scale / float(m[1]), 0.0)
        elif m := re.fullmatch(r"s\(([\d.]+)\)", part):
            options["smoothing"] = float(m[1])
        elif m := re.fullmatch(r"floor\(([\d.]+)\)", part):
            options["min_updates"] = float(m[1])
        else:
            raise ValueError(f"unknown candidate option {part!r} in {name!r}")
    if not {"smoothing", "horizon", "memory_fraction"} & set(options):
        options["smoothing"] = max(1.0 - scale / 1000.0, 0.0)  # the default memory
    return options


def _kind(options: dict) -> tuple[str, bool, float | None]:
    """``(memory option, unbiased_sqr, min_updates)``: candidates of one kind share a compiled program (the
    memory's value is traced)."""
    memory = [k for k in ("smoothing", "horizon", "memory_fraction") if k in options]
    if len(memory) != 1:
        raise ValueError(f"a candidate sets exactly one memory option, got {options}")
    return memory[0], bool(options.get("unbiased_sqr", False)), options.get("min_updates")


@functools.cache
def compiled_run(setup, kind: tuple[str, bool], scale: int, num_evals: int):
    """``(params, key, value, targets) -> (evals, snapshots, logs, iterations)``, vmapped over runs, jitted.

    ``value`` is the traced value of the kind's memory option, so the candidates and seeds of one kind run
    as one batched program.
    """
    max_iters = setup.total_steps + 1  # gain ≥ 1
    option, unbiased, min_updates = kind

    def run(params, key, value, targets):
        estimator = Estimator(**{option: value}, unbiased_sqr=unbiased, min_updates=min_updates)
        tx = adascale(setup.inner(), setup.schedule, axis_name=AXIS, estimator=estimator)
        opt_state = tx.init(params)

        def replica_step(params, opt_state, batch):
            grads = jax.grad(setup.loss)(params, batch)
            return tx.update(grads, opt_state, params)

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def body(carry):
            params, opt_state, it, logs = carry
            batch = setup.sample(jax.random.fold_in(key, it), scale)
            updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            m = metrics(opt_state)
            new = {"gain": m["gain"], "tau": m["scale_invariant_steps"]}
            logs = {k: logs[k].at[it].set(new[k]) for k in logs}
            return params, opt_state, it + 1, logs

        def segment(carry, target):
            def cond(c):
                return (get_adascale_state(c[1]).tau_whole < target) & (c[2] < max_iters)

            carry = lax.while_loop(cond, body, carry)
            params, opt_state, it, _ = carry
            return carry, ({"it": it, "gain": metrics(opt_state)["gain"], **setup.evaluate(params)}, params)

        logs = {k: jnp.full((max_iters,), jnp.nan, jnp.float32) for k in ("gain", "tau")}
        carry = (params, opt_state, jnp.int32(0), logs)
        (params, opt_state, it, logs), (evals, snapshots) = lax.scan(segment, carry, targets)
        evals["tau"] = logs["tau"][jnp.maximum(evals["it"] - 1, 0)]
        return evals, snapshots, logs, it

    return jax.jit(jax.vmap(run, in_axes=(0, 0, 0, None)))


@functools.cache
def compiled_offline(setup, num_batches: int):
    """``(snapshots, key) -> (σ², μ²)`` per snapshot from fresh base batches, and the same from either half."""

    def estimate(flat):
        k = flat.shape[0]
        mean = flat.mean(0)
        sigma2 = jnp.sum((flat - mean) ** 2) / (k - 1)
        return sigma2, jnp.sum(mean**2) - sigma2 / k

    def moments(params, key):
        batches = setup.sample(key, num_batches)
        grads = lax.map(lambda b: jax.grad(setup.loss)(params, b), batches, batch_size=64)
        flat = jnp.concatenate([g.reshape(num_batches, -1) for g in jax.tree.leaves(grads)], axis=1)
        half = num_batches // 2
        return estimate(flat), estimate(flat[:half]), estimate(flat[half:])

    def run(snapshots, key):
        keys = jax.random.split(key, jax.tree.leaves(snapshots)[0].shape[0])
        return lax.map(lambda a: moments(*a), (snapshots, keys))

    return jax.jit(run)


def _floats(x) -> list[float]:
    return [float(v) for v in np.asarray(x, np.float64)]


def run_cells(setup, names, scale: int, seeds, *, num_evals: int = NUM_EVALS, offline_batches: int = 0):
    """Train the cells ``names × seeds`` (candidates of one kind) as one batched run; a JSON-able record each."""
    start = time.perf_counter()
    runs = [(name, seed) for name in names for seed in seeds]
    options = [candidate_options(setup, name, scale) for name, _ in runs]
    kind = _kind(options[0])
    if any(_kind(o) != kind for o in options):
        raise ValueError(f"candidates of different kinds cannot share a run: {names}")
    keys = [jax.random.split(jax.random.key(seed), 3) for _, seed in runs]
    params = jax.vmap(setup.init)(jnp.stack([k[0] for k in keys]))
    values = jnp.asarray([o[kind[0]] for o in options], jnp.float32)
    T = setup.total_steps
    targets = np.asarray([round(k * T / num_evals) for k in range(1, num_evals + 1)], np.int32)
    fn = compiled_run(setup, kind, scale, num_evals)
    evals, snaps, logs, its = jax.device_get(fn(params, jnp.stack([k[1] for k in keys]), values, targets))
    first = jax.device_get(jax.jit(jax.vmap(setup.evaluate))(params))
    wall = (time.perf_counter() - start) / len(runs)
    records = []
    for i, (name, seed) in enumerate(runs):
        t0 = time.perf_counter()
        ev, lg, snap = (jax.tree.map(lambda x, i=i: x[i], tree) for tree in (evals, logs, snaps))
        it = int(its[i])
        record = {
            "task": setup.name,
            "method": name,
            "scale": scale,
            "seed": seed,
            "config": setup.config(),
            "iterations": it,
            "tau": float(ev["tau"][-1]),
            "initial": {k: float(v[i]) for k, v in first.items()},
            "final": {k: float(ev[k][-1]) for k in ("metric", "train_loss", "val_loss")},
            "curve": {k: _floats(ev[k]) for k in ev},
        }
        keep = stats.thin(it, LOG_POINTS)
        record["logs"] = {"it": keep.tolist(), **{k: _floats(np.asarray(lg[k])[keep]) for k in ("gain", "tau")}}
        if scale > 1 and setup.moments is not None:
            sig, mu = jax.device_get(jax.jit(jax.vmap(setup.moments))(snap))
            record["reference"] = {"kind": "closed form", "sigma2": _floats(sig), "mu2": _floats(mu)}
        elif scale > 1 and offline_batches:
            (sig, mu), (s1, m1), (s2, m2) = jax.device_get(compiled_offline(setup, offline_batches)(snap, keys[i][2]))
            record["reference"] = {
                "kind": f"offline, {offline_batches} batches",
                "sigma2": _floats(sig),
                "mu2": _floats(mu),
                "halves": [[_floats(s1), _floats(m1)], [_floats(s2), _floats(m2)]],
            }
        record["wall_s"] = wall + time.perf_counter() - t0
        records.append(record)
    return records


def cell_name(setup, method: str, scale: int, seed: int) -> str:
    tag = re.sub(r"[^A-Za-z0-9.-]+", "_", method.replace("+", "plus")).strip("_")
    return f"{setup.name}_{tag}_S{scale}_seed{seed}"


def run_grid(
    setups,
    candidates,
    scales,
    seeds,
    cache,
    *,
    num_evals=NUM_EVALS,
    offline_batches=OFFLINE_BATCHES,
    log=print,
    cached_only=False,
):
    """Every cell (cached ones loaded); ``{(task, method, S, seed): record}``, ``method = "S1"`` at S = 1.

    The missing cells of one (setup, S) whose candidates are of one kind run together as one batched program;
    ``cached_only`` runs none (the report of what is cached).
    """
    results = {}
    for setup in setups:
        for scale in [1, *scales]:
            todo: dict = {}
            for name in [BASELINE] if scale == 1 else candidates:
                run_name = FAIRSCALE if name == BASELINE else name
                for seed in seeds:
                    record = cache.get(setup, name, scale, seed)
                    if record is not None:
                        results[(setup.name, name, scale, seed)] = record
                    elif not cached_only:
                        kind = _kind(candidate_options(setup, run_name, scale))
                        todo.setdefault(kind, {}).setdefault(run_name, []).append(seed)
            for group in todo.values():
                by_seeds: dict = {}
                for run_name, s in group.items():
                    by_seeds.setdefault(tuple(s), []).append(run_name)
                for s, names in by_seeds.items():
                    records = run_cells(
                        setup, names, scale, list(s), num_evals=num_evals, offline_batches=offline_batches
                    )
                    for record in records:
                        if scale == 1:
                            record["method"] = BASELINE
                        cache.put(record, setup)
                        results[(setup.name, record["method"], scale, record["seed"])] = record
                        _log_cell(record, log)
    return results


def _log_cell(record, log):
    ref = tracking(record)
    dev = ""
    if ref is not None:
        iv, pt = ref["window"], ref["point"]
        dev = f"  window {100 * iv.mean():+.0f}% |{100 * np.abs(iv).mean():.0f}%|"
        dev += f", point |{100 * np.abs(pt).mean():.0f}%|"
    log(
        f"  {record['task']:10s} {record['method']:16s} S={record['scale']:<3d} seed={record['seed']}  "
        f"iters={record['iterations']:5d}  metric={record['final']['metric']:.4g}{dev}  ({record['wall_s']:.1f} s)",
        flush=True,
    )


# --------------------------------------------------------------------------- tracking


def gain(sigma2, mu2, scale):
    """``(σ² + μ²)/(σ²/S + μ²)`` with μ² floored at 0, clipped to ``[1, S]`` (as the optimizer does)."""
    sigma2, mu2 = np.asarray(sigma2), np.maximum(np.asarray(mu2), 0.0)
    return np.clip((sigma2 + mu2) / (sigma2 / scale + mu2), 1.0, scale)


def tracking(record, skip_fraction: float = 0.05, window: int = 4):
    """The online gain against the reference at the run's checkpoints, after the first ``skip_fraction`` of τ.

    Relative deviations (negative: the online gain is low) of the gain *applied*, ``Δτ/Δiterations`` (what
    sets the iteration count), against the reference over the same stretch of τ. Iterations per unit of τ
    are ``1/r``, so the reference over a stretch is the harmonic mean of its values at the checkpoints
    (trapezoid rule in τ). At large S the reference at single checkpoints jumps by factors of several
    between neighbours (μ² of the current parameters oscillates under momentum; the two halves of the
    offline estimate agree), so the tracking error is read over windows of ``window`` intervals:

    * ``"window"``: per window of ``window × T/20`` of τ (``T/5``; the last may be shorter);
    * ``"interval"``: per interval of ``T/20``;
    * ``"point"``: the last update's gain at each checkpoint against the reference there (per-update noise).

    Returns ``None`` without a reference, else those arrays and ``"noise"``, the offline reference's own RMS
    relative noise (its two halves; 0 for the closed form).
    """
    ref = record.get("reference")
    if ref is None:
        return None
    S = record["scale"]
    tau, its = np.asarray(record["curve"]["tau"]), np.asarray(record["curve"]["it"], np.float64)
    truth = gain(ref["sigma2"], ref["mu2"], S)
    start = int(np.argmax(tau >= skip_fraction * record["config"]["total_steps"] - 1))
    tau, its, truth = tau[start:], its[start:], truth[start:]
    inv_ref = 0.5 * (1 / truth[1:] + 1 / truth[:-1])  # per interval: mean of 1/r over it (trapezoid)
    d_tau, d_it = np.diff(tau), np.diff(its)
    interval = (d_tau / np.maximum(d_it, 1.0)) * inv_ref - 1.0
    windows = [slice(i, i + window) for i in range(0, len(d_tau), window)]
    windowed = np.asarray(
        [d_tau[w].sum() / max(d_it[w].sum(), 1.0) * np.average(inv_ref[w], weights=d_tau[w]) - 1.0 for w in windows]
    )
    point = np.asarray(record["curve"]["gain"])[start:] / truth - 1.0
    noise = 0.0
    if "halves" in ref:
        (s1, m1), (s2, m2) = ref["halves"]
        h1, h2 = gain(s1, m1, S)[start:], gain(s2, m2, S)[start:]
        noise = float(np.sqrt(np.mean(((h1 - h2) / (2 * truth)) ** 2)))  # std of the full estimate
    return {"window": windowed, "interval": interval, "point": point, "noise": noise}


# --------------------------------------------------------------------------- tuning


def tune(make, rates, seed=0, log=print):
    """The ``S = 1`` peak-learning-rate sweep of a setup factory (``make(learning_rate=...)``)."""
    for lr in rates:
        setup = make(learning_rate=lr)
        (r,) = run_cells(setup, ["fairscale"], 1, [seed], num_evals=4)
        final = r["final"]["metric"]
        log(f"{setup.name:10s} lr={lr:<8g} {setup.metric}={final:.4g}  ({r['wall_s']:.0f} s)", flush=True)
