"""AdaScale with Adam: which gain rule keeps the S = 1 quality of AdamW at S times the batch?

Two tasks where Adam is the natural optimizer, each with one base batch ``B``,
one base-batch budget ``T`` and one warm-up + cosine schedule tuned once at
``S = 1`` (``--tune``):

* ``lm``: a byte-level pre-LayerNorm decoder on the standard library's source, metric: validation
  loss in nats/byte;
* ``mnist1d``: MNIST-1D generated locally, a small 1-D CNN; metric: validation accuracy (and loss);

both in ``tasks.py``, their data from ``examples/datasets.py``.

At each ``S`` (``S`` replicas of batch ``B``, a ``jax.vmap`` axis) the
candidates train from the same initialisation on the same stream of batches:

* ``adamw``: ``optax.adamw(lr)`` at ``S = 1``, the baseline (AdaScale at
  ``S = 1`` is the identity, so every AdaScale candidate equals it there);
* ``AS-a``: ``adascale(chain(scale_by_adam, add_decayed_weights), lr)``: the
  raw-gradient gain ``r`` times ``lr(⌊τ⌋)`` on the Adam direction;
* ``AS-b``: the same with ``gain_exponent=0.5`` (step ``r^½·lr``, τ advances by ``r``);
* ``AS-c``: ``AS-a`` with ``precondition=adam_preconditioner(b2, eps)``: the gain
  from Adam-preconditioned gradients (``v̂`` of the previous update);
* ``AS-c'``: ``AS-c`` with ``gain_exponent=0.5`` (AdaptDL's AdamScale);
* ``sqrt``: ``optax.adamw(scaling_rules.square_root(lr, S))`` for ``⌈T/S⌉`` iterations;
* ``LSW``: ``optax.adamw(scaling_rules.linear_warmup(lr, S, T))`` for ``⌈T/S⌉`` iterations.

AdaScale candidates train until ``τ ≥ T``. A whole run is one jitted program: a
``lax.scan`` over evaluation checkpoints, each a ``lax.while_loop`` of steps;
the data sets are arguments of that program, not constants in it. Each cell
(task, method, S, seed, lr) is cached as JSON under ``benchmarks/adam/.cache/``,
so an interrupted grid resumes where it stopped; ``--smoke`` runs a tiny grid
uncached (with ``--cache DIR`` it caches there).

Usage::

    python -m benchmarks.adam --tune                  # the S = 1 learning-rate sweep (1 seed)
    python -m benchmarks.adam --no-report             # the grid (resumable), no report
    python -m benchmarks.adam --report                # tables and plots from the cache only
    python -m benchmarks.adam                         # the grid, then the report
    python -m benchmarks.adam --smoke --cache /tmp/a --results /tmp/a/README.md   # < 60 s

Outputs: the "adam" section of ``benchmarks/adam/README.md`` (``--results``) and
``benchmarks/adam/plots/adam_*.png`` (``plots/`` next to the results file).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_adascale  # noqa: E402
from benchmarks.adam.tasks import Task, make_tasks  # noqa: E402
from benchmarks.harness import cache as cell_cache  # noqa: E402
from benchmarks.harness import plots, report, stats  # noqa: E402
from optax_adascale import scaling_rules  # noqa: E402

AXIS = "replicas"
BASELINE = "adamw"
ADASCALE = {  # name -> (gain_exponent, preconditioned statistics)
    "AS-a": (1.0, False),
    "AS-b": (0.5, False),
    "AS-c": (1.0, True),
    "AS-c'": (0.5, True),
}
FIXED = ("sqrt", "LSW")
METHODS = (*ADASCALE, *FIXED)
SCALES = (1, 4, 16)
NUM_EVALS = 12  # evaluation checkpoints per run (plus the initial one)
LOG_POINTS = 300  # per-iteration logs are thinned to about this many points in the cache
TUNE_RATES = {"lm": (1e-3, 3e-3, 1e-2), "mnist1d": (1e-3, 3e-3, 1e-2, 3e-2)}  # 3e-2: 1e-2 was the edge

HERE = Path(__file__).resolve().parent

DESCRIPTIONS = {
    BASELINE: "`optax.adamw(lr)`, S = 1, T iterations",
    "AS-a": "`adascale(chain(scale_by_adam, add_decayed_weights), lr)`: r·lr(⌊τ⌋), raw-gradient gain",
    "AS-b": "AS-a with `gain_exponent=0.5`: r^½·lr(⌊τ⌋), τ += r",
    "AS-c": "AS-a with `precondition=adam_preconditioner(b2, eps)`: gain of Adam-preconditioned gradients",
    "AS-c'": "AS-c with `gain_exponent=0.5` (AdaptDL's AdamScale)",
    "sqrt": "`optax.adamw(scaling_rules.square_root(lr, S))`, ⌈T/S⌉ iterations",
    "LSW": "`optax.adamw(scaling_rules.linear_warmup(lr, S, T))`, ⌈T/S⌉ iterations",
}


# --------------------------------------------------------------------------- optimizers


def program_of(method: str) -> str:
    """The compiled program a method runs in: each AdaScale candidate its own, the fixed rules one shared."""
    return method if method in ADASCALE else "fixed"


def build_optimizer(task: Task, program: str, scale: int, use_sqrt=None):
    """``(tx, lr_fn)``; ``lr_fn`` is ``None`` for AdaScale.

    ``"fixed"`` is ``optax.adamw`` on the square-root rule where the (traced)
    ``use_sqrt`` flag is set and on LSW elsewhere; at ``S = 1`` both are the
    base schedule (the ``adamw`` baseline).
    """
    base = task.schedule()
    adam = dict(b1=task.b1, b2=task.b2, eps=task.eps)
    if program in ADASCALE:
        exponent, preconditioned = ADASCALE[program]
        inner = optax.chain(optax.scale_by_adam(**adam), optax.add_decayed_weights(task.weight_decay, task.decay_mask))
        precondition = optax_adascale.adam_preconditioner(b2=task.b2, eps=task.eps) if preconditioned else None
        tx = optax_adascale.adascale(inner, base, axis_name=AXIS, gain_exponent=exponent, precondition=precondition)
        return tx, None
    if program != "fixed":
        raise ValueError(f"unknown program={program!r}")
    sqrt = scaling_rules.square_root(base, scale)
    lsw = scaling_rules.linear_warmup(base, scale, task.total_steps)
    lr = lambda count: jnp.where(use_sqrt, sqrt(count), lsw(count))  # noqa: E731
    return optax.adamw(lr, weight_decay=task.weight_decay, mask=task.decay_mask, **adam), lr


def num_iterations_for(task: Task, method: str, scale: int) -> int:
    if method in ADASCALE:
        return task.total_steps  # an upper bound (gain ≥ 1); the stop is τ ≥ T
    return math.ceil(task.total_steps / scale)


@functools.cache
def compiled_run(task: Task, program: str, scale: int, num_evals: int):
    """A jitted run ``(params, opt_state, key, targets, use_sqrt, data) -> (params, it, evals, logs)``.

    ``targets`` are int32 progress marks (``⌊τ⌋`` for AdaScale, iterations for
    the fixed rules); after reaching each the run evaluates. Batches come from
    ``fold_in(key, iteration)``: every method sees the same stream.
    """
    log_size = task.total_steps

    def run(params, opt_state, key, targets, use_sqrt, data):
        tx, lr_fn = build_optimizer(task, program, scale, use_sqrt)
        is_as = program in ADASCALE

        def replica_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(task.loss)(params, batch)
            if not is_as:
                grads = lax.pmean(grads, AXIS)  # plain data-parallel AdamW; AdaScale reduces inside
            updates, opt_state = tx.update(grads, opt_state, params)
            return lax.pmean(loss, AXIS), updates, opt_state

        step = jax.vmap(replica_step, in_axes=(None, None, 0), out_axes=None, axis_name=AXIS)

        def progress(opt_state, it):
            return optax_adascale.get_adascale_state(opt_state).tau_whole if is_as else it

        def body(carry):
            params, opt_state, it, logs = carry
            batch = task.sample(data, jax.random.fold_in(key, it), scale)
            loss, updates, opt_state = step(params, opt_state, batch)
            params = optax.apply_updates(params, updates)
            if is_as:
                m = optax_adascale.metrics(opt_state)
                new = {"lr": m["learning_rate"], "gain": m["gain"], "noise_scale": m["noise_scale"], "loss": loss}
            else:
                nan = jnp.float32(jnp.nan)
                new = {"lr": lr_fn(it), "gain": nan, "noise_scale": nan, "loss": loss}
            logs = {k: logs[k].at[it].set(jnp.asarray(v, jnp.float32)) for k, v in new.items()}
            return params, opt_state, it + 1, logs

        def segment(carry, target):
            carry = lax.while_loop(lambda c: (progress(c[1], c[2]) < target) & (c[2] < log_size), body, carry)
            params, opt_state, it, _ = carry
            if is_as:
                tau = optax_adascale.scale_invariant_steps(opt_state)
                skipped = optax_adascale.metrics(opt_state)["skipped_steps"]
            else:
                tau, skipped = it.astype(jnp.float32) * scale, jnp.int32(0)
            record = {"tau": tau, "it": it, "skipped": skipped, **task.evaluate(params, data)}
            return carry, record

        logs = {k: jnp.full((log_size,), jnp.nan, jnp.float32) for k in ("lr", "gain", "noise_scale", "loss")}
        carry = (params, opt_state, jnp.int32(0), logs)
        (params, opt_state, it, logs), evals = lax.scan(segment, carry, targets)
        return params, it, evals, logs

    return jax.jit(run)


# --------------------------------------------------------------------------- one cell


def run_cell(task: Task, method: str, scale: int, seed: int, *, num_evals: int = NUM_EVALS) -> dict:
    """Train one cell and return a JSON-able record."""
    start = time.perf_counter()
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params = task.init(k_init)
    program = program_of(method)
    tx, _ = build_optimizer(task, program, scale, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt_state = tx.init(params)
    n = num_iterations_for(task, method, scale)
    T = task.total_steps
    if program in ADASCALE:
        targets = [round(k * T / num_evals) for k in range(1, num_evals + 1)]
    else:
        targets = [math.ceil(k * n / num_evals) for k in range(1, num_evals + 1)]
    first = jax.jit(task.evaluate)(params, task.data)
    fn = compiled_run(task, program, scale, num_evals)
    t0 = time.perf_counter()
    _, it, ev, logs = fn(params, opt_state, k_data, np.asarray(targets, np.int32), method == "sqrt", task.data)
    it = int(it)
    ev, logs = jax.device_get((ev, logs))
    run_s = time.perf_counter() - t0
    evals = [{"tau": 0.0, "it": 0, "skipped": 0, **{k: float(v) for k, v in first.items()}}]
    evals += [{k: float(ev[k][j]) for k in ev} for j in range(num_evals)]
    keep = stats.thin(it, LOG_POINTS)
    last = evals[-1]
    return {
        "task": task.name,
        "method": method,
        "scale": scale,
        "seed": seed,
        "config": task.config(),
        "iterations": it,
        "tau": last["tau"],
        "skipped": int(last["skipped"]),
        "final": {k: last[k] for k in ("metric", "val_loss", "train_loss")},
        "curve": {k: [e[k] for e in evals] for k in evals[0]},
        "logs": {"it": [int(i) for i in keep], **{k: [float(v) for v in np.asarray(logs[k])[keep]] for k in logs}},
        "wall_s": time.perf_counter() - start,
        "run_s": run_s,  # the compiled run alone (includes compilation on its first call in a process)
    }


# --------------------------------------------------------------------------- the grid


def _cell_name(task: Task, method: str, scale: int, seed: int) -> str:
    tag = method.replace("'", "p")  # AS-c' → AS-cp
    return f"{task.name}_{tag}_S{scale}_seed{seed}_lr{task.learning_rate:g}"


def cells(scales, seeds, methods=METHODS):
    """``(method, S, seed)`` of the grid: the baseline at ``S = 1``, every candidate at each ``S > 1``."""
    out = []
    for seed in seeds:  # seed-major: a partial grid already compares every candidate
        out += [(BASELINE, 1, seed)] if 1 in scales else []
        out += [(m, s, seed) for s in scales if s > 1 for m in methods]
    return out


def run_grid(tasks, scales, seeds, cache, *, num_evals, methods=METHODS, only_cached=False, log=None):
    """All cells (cached ones loaded; with ``only_cached`` nothing runs); ``{(task, method, S, seed): record}``."""
    log = log or functools.partial(print, flush=True)
    results = {}
    for task in tasks:
        for method, scale, seed in cells(scales, seeds, methods):
            record = cache.get(task, method, scale, seed)
            if record is None and not only_cached:
                record = run_cell(task, method, scale, seed, num_evals=num_evals)
                cache.put(record, task)
                log(
                    f"  {task.name:8s} {method:6s} S={scale:<3d} seed={seed}  iters={record['iterations']:5d}  "
                    f"τ={record['tau']:.0f}  {task.metric}={record['final']['metric']:.4f}  "
                    f"val loss={record['final']['val_loss']:.4f}  {record['wall_s']:.0f} s"
                )
            if record is not None:
                results[(task.name, method, scale, seed)] = record
    return results


# --------------------------------------------------------------------------- tables


def worse_by(task: Task, base_values, values) -> tuple[float, float]:
    """``(how much worse than S = 1, two standard errors of the difference)``; positive is worse."""
    return stats.worse_by(task.higher_is_better, base_values, values)


def failed(task: Task, record) -> bool:
    """A run that did not train: final training loss non-finite or no better than uniform guessing (ln K)."""
    loss = record["final"]["train_loss"]
    return not math.isfinite(loss) or loss > 0.98 * task.chance_loss


def flag(task: Task, base_values, values, num_failed=0) -> str:
    """``✗``: worse than S = 1 by more than 2 SE of the difference *and* the task's tolerance, or a seed failed;
    ``~``: beyond 2 SE but within the tolerance."""
    if num_failed or not np.all(np.isfinite(values)):
        return " ✗"
    diff, se2 = worse_by(task, base_values, values)
    if diff > max(se2, task.tolerance):
        return " ✗"
    if diff > se2 and diff > 0:
        return " ~"
    return ""


def _recs(results, task, method, scale, seeds):
    recs = [results.get((task.name, method, scale, seed)) for seed in seeds]
    return None if any(r is None for r in recs) else recs


def table(task: Task, results, scales, seeds) -> str:
    digits = 2 if task.higher_is_better else 4
    show_val = task.metric != "val. loss (nats/byte)"  # the LM's metric is its validation loss
    head = f"| S | method | {task.metric} | Δ vs S = 1 |" + (" val. loss |" if show_val else "")
    head += " train loss | iterations | mean gain | examples ÷ S=1 | per seed |"
    lines = [head, "|---:|---|---:|---:|" + ("---:|" if show_val else "") + "---:|---:|---:|---:|---:|"]
    base = _recs(results, task, BASELINE, 1, seeds)
    base_metric = [r["final"]["metric"] for r in base] if base else None
    T = task.total_steps
    rows = [(1, BASELINE)] + [(s, m) for s in scales if s > 1 for m in METHODS]
    for scale, method in rows:
        recs = _recs(results, task, method, scale, seeds)
        if recs is None:
            lines.append(f"| {scale} | {method} | — | — |" + (" — |" if show_val else "") + " — | — | — | — | — |")
            continue
        metric = [r["final"]["metric"] for r in recs]
        mark = delta = ""
        num_failed = sum(failed(task, r) for r in recs)
        if base_metric is not None and scale > 1:
            mark = flag(task, base_metric, metric, num_failed)
            if num_failed:
                mark += f" ({num_failed}/{len(recs)} failed)"
            diff, se2 = worse_by(task, base_metric, metric)
            signed = -diff if task.higher_is_better else diff
            delta = f"{signed:+.{digits}f} (2 SE {se2:.{digits}f})"
        iters = stats.mean_std([r["iterations"] for r in recs])[0]
        gain = stats.mean_std([r["tau"] / r["iterations"] for r in recs])[0] if method in ADASCALE else float("nan")
        row = f"| {scale} | {method} | {stats.fmt(*stats.mean_std(metric)[:2], digits)}{mark} | {delta} |"
        if show_val:
            row += f" {stats.fmt(*stats.mean_std([r['final']['val_loss'] for r in recs])[:2], 4)} |"
        row += (
            f" {stats.fmt(*stats.mean_std([r['final']['train_loss'] for r in recs])[:2], 4)} | {iters:.0f} | "
            f"{'' if math.isnan(gain) else f'{gain:.2f}'} | {iters * scale / T:.2f} | "
            + " / ".join(f"{v:.{max(digits - 1, 1)}f}" for v in metric)
            + " |"
        )
        lines.append(row)
    return "\n".join(lines)


def tune_table(tasks, cache, rates) -> str:
    lines = ["| task | lr (peak) | metric (seed 0, S = 1) | val. loss | train loss |", "|---|---:|---:|---:|---:|"]
    for task in tasks:
        for lr in rates[task.name]:
            r = cache.get(dataclasses.replace(task, learning_rate=lr), BASELINE, 1, 0)
            if r is None:
                continue
            bold = "**" if lr == task.learning_rate else ""
            f = r["final"]
            lines.append(
                f"| {task.name} | {bold}{lr:g}{bold} | {f['metric']:.4f} | {f['val_loss']:.4f} | "
                f"{f['train_loss']:.4f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else "_(no `--tune` cells in the cache)_"


# --------------------------------------------------------------------------- plots


STYLES = {
    "AS-a": ("C0", "-"),
    "AS-b": ("C1", "-"),
    "AS-c": ("C2", "-"),
    "AS-c'": ("C3", "-"),
    "sqrt": ("C4", ":"),
    "LSW": ("C5", ":"),
    BASELINE: ("k", "--"),
}


def make_plots(tasks, results, scales, seeds, plot_dir: Path) -> list[Path]:
    plt = plots.pyplot()

    plot_dir.mkdir(parents=True, exist_ok=True)
    big = [s for s in scales if s > 1]
    paths = []

    # τ-aligned validation curves: one row per S > 1 (the largest last), S = 1 dashed.
    fig, axes = plt.subplots(len(big), len(tasks), figsize=(5.2 * len(tasks), 3.6 * len(big)), squeeze=False)
    for i, s in enumerate(big):
        for j, task in enumerate(tasks):
            ax = axes[i, j]
            for method in (BASELINE, *METHODS):
                tau, val = plots.mean_curve(results, task.name, method, 1 if method == BASELINE else s, seeds)
                if tau is None:
                    continue
                color, ls = STYLES[method]
                label = "S=1 (adamw)" if method == BASELINE else method
                ax.plot(tau[1:], val[1:], color=color, ls=ls, marker="." if method != BASELINE else None, label=label)
            ax.set_title(f"{task.title}, S={s}", fontsize=9)
            ax.set_xlabel("τ (base-batch steps)")
            ax.set_ylabel(task.metric)
            if task.higher_is_better:
                lo = min(50.0, ax.get_ylim()[1] - 1)
                ax.set_ylim(bottom=max(ax.get_ylim()[0], lo))
            else:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_curves.png"))

    # Gain trajectories (seed 0) of the AdaScale candidates at every S > 1.
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for s, ls in zip(big, ("--", "-", "-."), strict=False):
            for method in ADASCALE:
                r = results.get((task.name, method, s, seeds[0]))
                if r is not None:
                    ax.plot(plots.log_tau(r), r["logs"]["gain"], color=STYLES[method][0], ls=ls, lw=1,
                            label=f"{method}, S={s}")
            ax.axhline(s, color="grey", lw=0.5)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("gain r_t")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: gain (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_gain.png"))

    # Step size actually taken vs τ at the largest S, S = 1 dashed.
    s = big[-1] if big else 1
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.6), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0, j]
        for method in (BASELINE, *METHODS):
            r = results.get((task.name, method, 1 if method == BASELINE else s, seeds[0]))
            if r is None:
                continue
            color, ls = STYLES[method]
            ax.plot(plots.log_tau(r), r["logs"]["lr"], color=color, ls=ls, lw=1, label=method)
        ax.set_xlabel("τ (base-batch steps)")
        ax.set_ylabel("step size (lr × gain factor)")
        ax.set_yscale("log")
        ax.set_title(f"{task.title}: step size, S={s} (seed {seeds[0]})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(plots.save(fig, plot_dir / "adam_lr.png"))
    return paths


PLOT_CAPTIONS = {
    "adam_curves.png": "validation metric vs τ (base-batch steps; S·t for the fixed rules) for every candidate "
    "at S = 4 (top) and the largest S (bottom), means over seeds; S = 1 AdamW dashed.",
    "adam_gain.png": "gain r_t vs τ of the four AdaScale candidates (seed 0); dashed S = 4, solid S = 16, "
    "grey lines at r = S.",
    "adam_lr.png": "step size actually taken (r^p·lr(⌊τ⌋) for AdaScale, the rule's lr for sqrt/LSW) vs τ at the "
    "largest S (seed 0), S = 1 dashed.",
}


# --------------------------------------------------------------------------- report


def write_report(path: Path, tasks, results, scales, seeds, plot_paths, command, wall_s, cache, *, smoke=False):
    """Write the "adam" section of ``path`` (the study's README.md); its hand-written reading is kept."""
    rel = lambda p: report.relative(p, path)  # noqa: E731
    reading = report.kept_reading(path, "adam")
    run_s = sum(r["wall_s"] for r in results.values())
    out = [
        "## Adam",
        "",
        "Does AdaScale carry over to Adam(W)? Which gain rule keeps the S = 1 quality when the batch is S× larger, "
        "with a warm-up + cosine schedule tuned once at S = 1?",
        "",
        f"Command: `{command}` ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}, "
        f"S ∈ {{{', '.join(map(str, scales))}}}; "
        + ("smoke mode: tiny models and budgets" if smoke else "cells cached under `benchmarks/adam/.cache/`")
        + f"; the {len(results)} cells took {run_s / 60:.0f} min of wall time when they ran, compilation included, "
        f"this invocation {wall_s:.0f} s).",
        "",
        reading,
        "",
        "### Setup",
        "",
        "S replicas are a `jax.vmap` axis, each with the base batch B drawn i.i.d. with replacement; a whole run is "
        "one jitted program (`lax.scan` over evaluation checkpoints of `lax.while_loop` steps). For each seed every "
        "method starts from the same initialisation and, at a given S, sees the same stream of batches. The "
        "schedule is `optax.warmup_cosine_decay_schedule(0, lr, 5 % of T, T, lr/10)` of the base-batch step, tuned "
        "once at S = 1 (`--tune`, one seed) and never per S; weight decay is decoupled (AdamW), on the weight "
        "matrices (and the LM's tied embedding) only.",
        "",
        "| task | model | params | B | T (base steps) | peak lr | weight decay | β₁, β₂, ε |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in tasks:
        unit = "windows" if t.name == "lm" else "examples"
        out.append(
            f"| {t.name} | {t.info['model']} | {t.num_params():,} | {t.batch_size} {unit} | {t.total_steps} | "
            f"{t.learning_rate:g} | {t.weight_decay:g} | {t.b1}, {t.b2}, {t.eps:g} |"
        )
    lm = next((t for t in tasks if t.name == "lm"), None)
    if lm is not None:
        c = lm.config()
        out += [
            "",
            f"LM data: {c['files']} files `{c['corpus']}` (Python {c['python']}), {c['bytes']:,} bytes (sha256 "
            f"{c['sha256']}…); the first 95 % cut into {c['train_windows']:,} fixed windows of ctx+1 bytes for "
            f"training, the last 5 % into windows of which {c['val_windows']} evenly spaced ones are the validation "
            f"set ({c['train_eval_windows']} training windows for the training loss).",
        ]
    out += ["", "Methods:", ""]
    out += [f"- **{m}**: {DESCRIPTIONS[m]}" for m in (BASELINE, *METHODS)]
    out += [
        "",
        "Columns: mean ± std over seeds at the end (τ = T); Δ: difference of the means from S = 1 (positive = higher) "
        "with two standard errors of that difference; mean gain: τ/iterations; examples ÷ S=1: iterations·S/T. "
        "✗: worse than S = 1 by more than 2 SE of the difference *and* by the practical tolerance "
        + ", ".join(f"{t.tolerance:g} ({t.metric})" for t in tasks)
        + ", or a seed failed (final training loss non-finite or within 2 % of uniform guessing, ln K); "
        "~: beyond 2 SE but within the tolerance. Per seed: the final metric of seeds 0, 1, 2.",
    ]
    for t in tasks:
        out += ["", f"### {t.title}", "", table(t, results, scales, seeds)]
    out += ["", "### Learning-rate sweep at S = 1 (`--tune`)", "", tune_table(tasks, cache, TUNE_RATES)]
    out += ["", "### Plots", ""]
    for p in plot_paths:
        out += [f"- `{rel(p)}`: {PLOT_CAPTIONS.get(Path(p).name, '')}", "", f"  ![{Path(p).stem}]({rel(p)})", ""]
    return report.write_section(path, "adam", "\n".join(out))


# --------------------------------------------------------------------------- tuning


def tune(tasks, cache, rates, log=None):
    """The S = 1 learning-rate sweep, one seed (AdaScale at S = 1 is AdamW on ``lr(t)``)."""
    log = log or functools.partial(print, flush=True)
    for task in tasks:
        for lr in rates[task.name]:
            t = dataclasses.replace(task, learning_rate=lr)
            record = cache.get(t, BASELINE, 1, 0)
            if record is None:
                record = run_cell(t, BASELINE, 1, 0)
                cache.put(record, t)
            f = record["final"]
            log(f"{task.name:8s} lr={lr:<7g} {task.metric}={f['metric']:.4f}  val loss={f['val_loss']:.4f}  "
                f"train loss={f['train_loss']:.4f}  ({record['wall_s']:.0f} s)")


# --------------------------------------------------------------------------- CLI


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adam", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny models and grid (< 60 s on CPU)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="cell cache directory (default benchmarks/adam/.cache; none in smoke mode unless given)")
    parser.add_argument("--results", type=Path, default=None,
                        help="results file (default benchmarks/adam/README.md); the plots go to plots/ next to it")
    parser.add_argument("--tasks", nargs="+", default=None, choices=("lm", "mnist1d"))
    parser.add_argument("--scales", nargs="+", type=int, default=None)
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tune", action="store_true", help="S = 1 learning-rate sweep (1 seed)")
    parser.add_argument("--no-report", action="store_true", help="run cells only")
    parser.add_argument("--report", action="store_true", help="report from cached cells only; run nothing")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    results_path = args.results or HERE / "README.md"
    if args.smoke:
        # Compilation dominates a smoke run: ask XLA for less work (the legacy CPU emitters compile ~2× faster).
        # XLA reads XLA_FLAGS when the backend starts, which nothing above has done yet.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()
        jax.config.update("jax_disable_most_optimizations", True)
        cache_dir, scales, seeds, num_evals = args.cache, (1, 4), [0], 3
    else:
        cache_dir = args.cache or HERE / ".cache"
        scales, seeds, num_evals = SCALES, list(range(args.seeds)), NUM_EVALS
    scales = tuple(args.scales) if args.scales else scales
    cache = cell_cache.CellCache(cache_dir, _cell_name)
    all_tasks = make_tasks(smoke=args.smoke, cache_dir=cache_dir)
    tasks = [all_tasks[n] for n in (args.tasks or all_tasks)]
    methods = tuple(args.methods) if args.methods else METHODS

    if args.tune:
        tune(tasks, cache, {k: (v[:1] if args.smoke else v) for k, v in TUNE_RATES.items()})
        return 0
    results = run_grid(tasks, scales, seeds, cache, num_evals=num_evals, methods=methods, only_cached=args.report)
    if args.no_report:
        return 0
    plot_paths = make_plots(tasks, results, scales, seeds, results_path.parent / "plots")
    command = report.command_line("adam", argv)
    path = write_report(results_path, tasks, results, scales, seeds, plot_paths, command,
                        time.perf_counter() - start, cache, smoke=args.smoke)
    print(f"wrote {path} and {len(plot_paths)} plots in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
