"""AdaScale vs. fixed scaling rules: a miniature of the paper's Table 2 and Figures 1-3.

Three small tasks (``tasks.py``), each with one base batch size ``B``,
one base-batch budget ``T`` and one simple schedule tuned once at ``S = 1``.
At each scale ``S ∈ {1, 2, …, 64}`` (``S`` replicas of batch ``B``, a
``jax.vmap`` axis) three methods train from the same initialisation on the same
stream of batches:

* ``AS``: ``optax_adascale.adascale_sgd(lr, momentum)`` until ``τ ≥ T``;
* ``LSW+``: ``optax.sgd(momentum)`` with linear scaling and warm-up stretched to
  AdaScale's iteration count at that scale and seed
  (``scaling_rules.stretched_linear_warmup``);
* ``LSW``: ``optax.sgd(momentum)`` with linear scaling and warm-up over
  ``T/S`` iterations (``scaling_rules.linear_warmup``);
* estimator variants of AdaScale (``ESTIMATORS``, ``--estimators``), e.g.
  ``"AS-fairscale"`` (``estimator="fairscale"``, the 0.1–0.2 default) and
  ``"AS-H(T/100)"``: ``optax_adascale.experimental.adascale(optax.trace(momentum), lr,
  estimator=Estimator(horizon=T/100))``; see :func:`estimator_options`.

Gradients are averaged over the replicas with ``lax.pmean`` (inside AdaScale's
update for AS). A whole run is one jitted program: a ``lax.scan`` over
evaluation checkpoints, each a ``lax.while_loop`` of training steps. Each cell
(task, method, S, seed) is cached as JSON under ``benchmarks/scaling/cells/``
so the grid resumes where it stopped; ``--smoke`` runs a tiny grid uncached.

Usage::

    python -m benchmarks.scaling                         # the full grid, tables, plots
    python -m benchmarks.scaling --tasks digits --scales 1 2 4   # one chunk
    python -m benchmarks.scaling --smoke --out /tmp/scaling      # < 60 s, every code path
    python -m benchmarks.scaling --tune                  # the S = 1 learning-rate sweep
    python -m benchmarks.scaling --tasks regression --scales 4 16 64 --seeds 1 --no-baselines --no-report \
        --estimators "AS-H(T/50)" "AS-H(T/10,T/50)"      # explore estimator variants (tracking table on stdout)

Outputs: the "scaling" section of ``benchmarks/scaling/README.md`` and ``benchmarks/scaling/plots/scaling_*.png``
(or ``README.md`` and ``plots/`` under ``--out``).

Files: ``scaling.py`` (this: optimizers, compiled runs, one cell, the grid), ``tasks.py`` (the three
tasks), ``results.py`` (tables, plots, the README section), ``__main__.py`` (the command line).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import math  # noqa: E402
import operator  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_adascale  # noqa: E402
from benchmarks.harness import stats  # noqa: E402
from optax_adascale import scaling_rules  # noqa: E402

AXIS = "replicas"
METHODS = ("AS", "LSW+", "LSW")
ESTIMATORS = ("AS-fairscale", "AS-H(T/100)", "AS-delayed")  # variants run beside AS (see estimator_options)
SCALES = (1, 2, 4, 8, 16, 32, 64)
NUM_EVALS = 16  # evaluation checkpoints per run (plus the initial one)
OFFLINE_BATCHES = 1000  # fresh base batches per checkpoint for the offline gain (paper Fig. 2)
OFFLINE_TASK = "mnist1d"
ELASTIC_PHASES = ((2, 0.25), (4, 0.5), (8, 1.0))  # (S, until τ = fraction·T)
LOG_POINTS = 400  # per-iteration logs are thinned to about this many points in the cache

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- optimizers


def is_adascale(method):
    """``"AS"`` (the default estimator) or an estimator variant ``"AS-…"`` (see :func:`estimator_options`)."""
    return method == "AS" or method.startswith("AS-")


def _base_steps(text, task):
    """``"T/20"`` → ``T/20`` base steps of ``task``; ``"150"`` → 150."""
    if text.startswith("T/"):
        return task.total_steps / float(text[2:])
    return float(text)


def estimator_options(task, method):
    """The ``optax_adascale.experimental.adascale`` options of an AdaScale variant.

    ``"AS"`` is the package default (``Estimator()``: a memory of 0.05·τ and at
    least 4 updates, μ̂² averaged unfloored). A variant is ``"AS-"`` followed by
    ``+``-joined options:

    * ``fairscale``: ``estimator="fairscale"`` (FairScale's ``θ = 1 − S/1000``, each step's μ̂² floored: the
      0.1–0.2 default);
    * ``H(h)``: ``Estimator(horizon=h)``; ``H(h_var,h_sqr)``: separate memories for σ̄² and μ̄². Each ``h``
      is a number of base steps or ``T/k`` (the task's budget over ``k``), e.g. ``"AS-H(T/20)"``;
    * ``s(θ)``: ``Estimator(smoothing=θ)``;
    * ``floored``: ``unbiased_sqr=False`` (floor each step's ``μ̂²`` before it is averaged, as FairScale);
    * ``paper``: ``averaging="paper"``;
    * ``delayed``: ``delayed_gain=True`` (the gain of the averages through the last update), e.g. ``"AS-delayed"``.
    """
    if method == "AS":
        return {}
    if not method.startswith("AS-"):
        raise ValueError(f"not an AdaScale method: {method!r}")
    options, fields = {}, {}
    for part in method[3:].split("+"):
        if part == "fairscale":
            fields["fairscale"] = True
        elif part == "floored":
            fields["unbiased_sqr"] = False
        elif part == "delayed":
            options["delayed_gain"] = True
        elif part == "paper":
            options["averaging"] = "paper"
        elif part.startswith("H(") and part.endswith(")"):
            hs = tuple(_base_steps(h, task) for h in part[2:-1].split(","))
            fields["horizon"] = hs[0] if len(hs) == 1 else hs
        elif part.startswith("s(") and part.endswith(")"):
            fields["smoothing"] = float(part[2:-1])
        else:
            raise ValueError(f"unknown estimator option {part!r} in {method!r}")
    if fields:
        options["estimator"] = optax_adascale.Estimator(**fields)
    return options


def build_optimizer(task, method, scale, num_iterations, stretched=None):
    """``(tx, lr_fn)`` for ``"AS"``, an ``"AS-…"`` variant or a fixed rule; ``lr_fn`` is ``None`` for AdaScale.

    The two fixed rules share one compiled program: ``"SGD"`` builds both
    schedules and picks LSW+ where the (possibly traced) ``stretched`` flag is
    set. ``num_iterations`` (LSW+'s ``N``) may be traced too.
    """
    base = task.schedule()
    if method == "AS":
        return optax_adascale.adascale_sgd(base, momentum=task.momentum, axis_name=AXIS), None
    if is_adascale(method):
        # adascale_sgd(momentum=μ) is adascale(optax.trace(μ)) (its zero weight decay is skipped); averaging=
        # is only on experimental.adascale().
        inner = optax.trace(decay=task.momentum)
        options = estimator_options(task, method)
        return optax_adascale.experimental.adascale(inner, base, axis_name=AXIS, **options), None
    lsw = scaling_rules.linear_warmup(base, scale, task.total_steps)
    lsw_plus = scaling_rules.stretched_linear_warmup(base, scale, task.total_steps, num_iterations)
    if method == "LSW":
        lr = lsw
    elif method == "LSW+":
        lr = lsw_plus
    elif method == "SGD":
        lr = lambda count: jnp.where(stretched, lsw_plus(count), lsw(count))  # noqa: E731
    else:
        raise ValueError(f"unknown method={method!r}")
    return optax.sgd(lr, momentum=task.momentum), lr


def num_iterations_for(task, method, scale, as_iterations=None):
    """Iterations a fixed rule runs for: ``⌈T/S⌉`` (LSW) or AdaScale's count (LSW+)."""
    if method == "LSW":
        return math.ceil(task.total_steps / scale)
    if method == "LSW+":
        return int(as_iterations)
    return task.total_steps  # AS: an upper bound (gain ≥ 1), the stop is τ ≥ T


@functools.cache
def compiled_phase(task, method, scale, log_size, num_evals):
    """A jitted run from a given state through ``num_evals`` checkpoints.

    ``method`` is ``"AS"`` or ``"SGD"`` (LSW and LSW+, chosen by the traced
    ``stretched`` flag). The returned function takes ``(params, opt_state,
    it0, key, targets, num_iterations, stretched)``. ``targets`` are int32
    progress marks: ``⌊τ⌋`` for AS, iterations for the fixed rules; after
    reaching each it evaluates. Batches are drawn from ``fold_in(key,
    iteration)``, so a run continued in several phases (the elastic run) sees
    the same stream as one run.
    """

    def run(params, opt_state, it0, key, targets, num_iterations, stretched):
        tx, lr_fn = build_optimizer(task, method, scale, num_iterations, stretched)
        # Base-batch steps per iteration, for the τ axis of the fixed rules: S (LSW), T/N (LSW+).
        steps_per_iteration = jnp.where(
            stretched, jnp.float32(task.total_steps) / jnp.asarray(num_iterations, jnp.float32), jnp.float32(scale)
        )

        def replica_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(task.loss)(params, batch)
            if not is_adascale(method):
                grads = lax.pmean(grads, AXIS)  # plain data-parallel SGD; AdaScale reduces inside
            updates, opt_state = tx.update(grads, opt_state, params)
            return lax.pmean(loss, AXIS), updates, opt_state

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def progress(opt_state, it):
            if is_adascale(method):
                return optax_adascale.get_adascale_state(opt_state).tau_whole
            return it

        def body(carry):
            params, opt_state, it, logs = carry
            batch = task.sample(jax.random.fold_in(key, it), scale)
            if task.moments is not None:
                sigma2, mu2 = task.moments(params)
                true_gain = (sigma2 + mu2) / (sigma2 / scale + mu2)
            else:
                true_gain = jnp.float32(jnp.nan)
            loss, updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            if is_adascale(method):
                m = optax_adascale.metrics(opt_state)
                lr, gain = m["learning_rate"], m["gain"]
            else:
                lr, gain = lr_fn(it), jnp.float32(jnp.nan)
            i = it - it0
            new = {"lr": lr, "gain": gain, "true_gain": true_gain, "loss": loss}
            logs = {k: logs[k].at[i].set(jnp.asarray(v, jnp.float32)) for k, v in new.items()}
            return params, opt_state, it + 1, logs

        def segment(carry, target):
            def cond(c):
                return (progress(c[1], c[2]) < target) & (c[2] - it0 < log_size)

            carry = lax.while_loop(cond, body, carry)
            params, opt_state, it, _ = carry
            if is_adascale(method):
                tau = optax_adascale.scale_invariant_steps(opt_state)
            else:
                tau = it.astype(jnp.float32) * steps_per_iteration
            record = {"tau": tau, "it": it, **task.evaluate(params)}
            return carry, (record, params)

        logs = {k: jnp.full((log_size,), jnp.nan, jnp.float32) for k in ("lr", "gain", "true_gain", "loss")}
        carry = (params, opt_state, jnp.asarray(it0, jnp.int32), logs)
        (params, opt_state, it, logs), (evals, snapshots) = lax.scan(segment, carry, targets)
        return params, opt_state, it, evals, snapshots, logs

    return jax.jit(run)


@functools.cache
def compiled_offline_moments(task, num_batches):
    """``(snapshots, key) -> (σ², μ²)`` per snapshot from ``num_batches`` fresh base batches (paper Fig. 2).

    Each ``(σ², μ²)`` comes with the same estimate from either half of the batches (``((σ², μ²), half 1, half 2)``).
    """

    def estimate(flat):
        k = flat.shape[0]
        mean = flat.mean(0)
        sigma2 = jnp.sum((flat - mean) ** 2) / (k - 1)
        return sigma2, jnp.sum(mean**2) - sigma2 / k

    def moments(params, key):
        batches = task.sample(key, num_batches)
        grads = jax.vmap(jax.grad(task.loss), in_axes=(None, 0))(params, batches)
        flat = jnp.concatenate([g.reshape(num_batches, -1) for g in jax.tree.leaves(grads)], axis=1)
        half = num_batches // 2  # two independent half-size estimates: the reference's own noise
        return estimate(flat), estimate(flat[:half]), estimate(flat[half : 2 * half])

    def run(snapshots, key):
        keys = jax.random.split(key, jax.tree.leaves(snapshots)[0].shape[0])
        return lax.map(lambda a: moments(*a), (snapshots, keys))

    return jax.jit(run)


# --------------------------------------------------------------------------- one cell


def _tolist(x):
    return [float(v) for v in np.asarray(x, np.float64)]


def _phases(task, method, scale, as_iterations, num_evals):
    """``[(scale, targets, num_iterations)]`` for a plain run, or the elastic schedule."""
    T = task.total_steps
    if method == "elastic":
        marks = [round(k * T / num_evals) for k in range(1, num_evals + 1)]
        phases, lo = [], 0
        for s, frac in ELASTIC_PHASES:
            hi = round(frac * T)
            phases.append((s, [m for m in marks if lo < m <= hi], T))
            lo = hi
        return phases
    n = num_iterations_for(task, method, scale, as_iterations)
    if is_adascale(method):
        targets = [round(k * T / num_evals) for k in range(1, num_evals + 1)]
    else:
        targets = [math.ceil(k * n / num_evals) for k in range(1, num_evals + 1)]
    return [(scale, targets, n)]


def run_cell(task, method, scale, seed, *, as_iterations=None, num_evals=NUM_EVALS, offline_batches=0):
    """Train one cell; return a JSON-able record.

    ``method`` is ``"AS"``, ``"LSW+"`` (needs ``as_iterations``), ``"LSW"`` or
    ``"elastic"`` (AdaScale with ``S`` changing as in ``ELASTIC_PHASES``: the
    optimizer state carries over unchanged, only the vmap axis grows).
    """
    start = time.perf_counter()
    k_init, k_data, k_offline = jax.random.split(jax.random.key(seed), 3)
    params = task.init(k_init)
    opt_method = "AS" if method == "elastic" else method
    phases = _phases(task, method, scale, as_iterations, num_evals)
    tx, _ = build_optimizer(task, opt_method, phases[0][0], phases[0][2])
    opt_state = tx.init(params)
    it = 0
    first = jax.jit(task.evaluate)(params)
    evals = [{"tau": 0.0, "it": 0, "scale": phases[0][0], **{k: float(v) for k, v in first.items()}}]
    logs = {k: [] for k in ("it", "lr", "gain", "true_gain", "loss")}
    snapshots = []
    program = opt_method if is_adascale(opt_method) else "SGD"
    for s, targets, n in phases:
        fn = compiled_phase(task, program, s, task.total_steps, num_evals)
        padded = np.asarray(targets + [targets[-1]] * (num_evals - len(targets)), np.int32)
        params, opt_state, it_end, ev, snaps, lg = fn(params, opt_state, it, k_data, padded, n, method == "LSW+")
        it_end = int(it_end)
        ev = jax.device_get(ev)
        for j in range(len(targets)):
            evals.append({k: float(ev[k][j]) for k in ev} | {"scale": s})
        snapshots.append(jax.tree.map(operator.itemgetter(slice(0, len(targets))), snaps))
        count = it_end - it
        logs["it"].extend(range(it, it_end))
        for k in ("lr", "gain", "true_gain", "loss"):
            logs[k].extend(np.asarray(lg[k][:count]).tolist())
        it = it_end
    snapshots = jax.tree.map(lambda *xs: jnp.concatenate(xs), *snapshots)
    last = evals[-1]
    keep = stats.thin(len(logs["it"]), LOG_POINTS)
    record = {
        "task": task.name,
        "method": method,
        "scale": scale,
        "seed": seed,
        "config": task.config(),
        "as_iterations": as_iterations,
        "iterations": it,
        "tau": last["tau"],
        "final": {k: last[k] for k in ("metric", "train_loss", "val_loss")},
        "curve": {k: [e[k] for e in evals] for k in evals[0]},
        "logs": {k: [logs[k][i] for i in keep] for k in logs},
    }
    if offline_batches:
        (sig, mu), (sig1, mu1), (sig2, mu2) = compiled_offline_moments(task, offline_batches)(snapshots, k_offline)
        record["offline"] = {
            "tau": record["curve"]["tau"][1:],
            "sigma2": _tolist(sig),
            "mu2": _tolist(mu),
            "batches": offline_batches,
            "halves": {"sigma2": [_tolist(sig1), _tolist(sig2)], "mu2": [_tolist(mu1), _tolist(mu2)]},
        }
    record["wall_s"] = time.perf_counter() - start
    return record


# --------------------------------------------------------------------------- the grid


def _cell_name(task, method, scale, seed):
    """``"AS"``, ``"LSW"``, ``"LSW+"`` → AS, LSW, LSWplus; a variant ``"AS-H(T/5,T/50)"`` → AS-H_T_5_T_50."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", method.replace("+", "plus")).strip("_")
    tag = "elastic" if method == "elastic" else f"{name}_S{scale}"
    return f"{task.name}_{tag}_seed{seed}"


def run_grid(
    tasks,
    scales,
    seeds,
    cache,
    *,
    num_evals,
    offline_batches,
    elastic_tasks=None,
    log=None,
    estimators=(),
    estimator_seeds=None,
    estimator_tasks=None,
    baselines=True,
):
    """All cells (cached ones are loaded); returns ``{(task, method, S, seed): record}``.

    The elastic run is done for the tasks named in ``elastic_tasks`` (all if ``None``). ``estimators``: AdaScale
    variants (``"AS-…"``) run beside ``"AS"`` on the first ``estimator_seeds`` seeds (all if ``None``), for the
    tasks named in ``estimator_tasks`` (all if ``None``). ``baselines=False`` skips LSW+, LSW and the elastic run.
    """
    log = log or functools.partial(print, flush=True)
    results = {}

    def cell(task, method, scale, seed, **kw):
        record = cache.get(task, method, scale, seed)
        if record is None:
            record = run_cell(task, method, scale, seed, num_evals=num_evals, **kw)
            cache.put(record, task)
            log(
                f"  {task.name:10s} {method:14s} S={scale:<3d} seed={seed}  iters={record['iterations']:5d}  "
                f"{task.metric}={record['final']['metric']:.4g}  train loss={record['final']['train_loss']:.4g}"
                f"  ({record['wall_s']:.1f} s)"
            )
        results[(task.name, method, scale, seed)] = record
        return record

    variant_seeds = seeds if estimator_seeds is None else seeds[:estimator_seeds]
    for task in tasks:
        variants = estimators if estimator_tasks is None or task.name in estimator_tasks else ()
        for scale in scales:
            for seed in seeds:
                off = offline_batches if (task.name == OFFLINE_TASK and seed == seeds[0]) else 0
                as_record = cell(task, "AS", scale, seed, offline_batches=off)
                if baselines:
                    cell(task, "LSW+", scale, seed, as_iterations=as_record["iterations"])
                    cell(task, "LSW", scale, seed)
                # At S = 1 AdaScale is the identity whatever its estimator: the variants share AS's cell.
                for method in variants if seed in variant_seeds and scale > 1 else ():
                    cell(task, method, scale, seed, offline_batches=off)
        if baselines and (elastic_tasks is None or task.name in elastic_tasks):
            for seed in seeds:
                cell(task, "elastic", ELASTIC_PHASES[-1][0], seed)
    return results


# --------------------------------------------------------------------------- tuning


def tune(tasks, rates, seeds, log=print):
    """The S = 1 learning-rate sweep (AdaScale at S = 1 is plain momentum SGD on ``lr(t)``)."""
    import dataclasses

    for task in tasks:
        for lr in rates:
            t = dataclasses.replace(task, learning_rate=lr)
            finals = [run_cell(t, "AS", 1, seed)["final"] for seed in seeds]
            m = np.mean([f["metric"] for f in finals])
            loss = np.mean([f["train_loss"] for f in finals])
            log(f"{task.name:10s} lr={lr:<6g} {task.metric}={m:.4g}  train loss={loss:.4g}")


def check_closed_form(task, num_batches=50_000, seed=0):
    """Monte-Carlo check of ``task.moments``: relative errors of σ² and μ² at a random point."""
    k_w, k_b = jax.random.split(jax.random.key(seed))
    w = task.init(k_w) + 0.3 * jax.random.normal(k_w, jax.tree.leaves(task.init(k_w))[0].shape)
    sigma2, mu2 = task.moments(w)
    grads = jax.vmap(jax.grad(task.loss), in_axes=(None, 0))(w, task.sample(k_b, num_batches))
    mean = grads.mean(0)
    emp_sigma2 = jnp.sum((grads - mean) ** 2) / (num_batches - 1)
    emp_mu2 = jnp.sum(mean**2) - emp_sigma2 / num_batches
    return float(emp_sigma2 / sigma2 - 1), float(emp_mu2 / mu2 - 1), num_batches
