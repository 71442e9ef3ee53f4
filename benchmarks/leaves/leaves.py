"""Many small leaves: what AdaScale's per-leaf squared norms cost where a model has many small parameters.

A ResNet-like model has 60+ leaves, most of them small (biases, normalisation scales, 3×3 kernels of few
channels); each leaf's squared norm is one reduction, taken per sample and again on the mean. Three cases,
each compiled once per variant, warmed up, then timed in alternating blocks (A B C A B C ...): a block runs
``steps`` steps and blocks until done; a block's ratio is its time over the baseline block of the same
round; we report the median ratio with its min–max over ``--rounds`` rounds. Every step donates
parameters and optimizer state.

  update  the per-replica update alone on a ResNet-like parameter tree (62 leaves), 8 replicas as a
          ``jax.vmap(axis_name=...)`` axis on one device (no 8-thread rendezvous per collective, which a
          shared 2-core host starves), a fixed per-replica gradient:
            sgd       ``lax.pmean`` of the gradient, then ``optax.sgd(momentum=0.9)`` (the baseline: ratio 1)
            floor     sgd, plus the local squared norm (one sum over every leaf) in the same pmean
            adascale  ``adascale_sgd(momentum=0.9, axis_name=...)``
  cnn     a ResNet-like CNN training step on one device, ``k`` micro-batches in a ``lax.scan`` (the GPU
          suite's CNN case, CPU-sized, float32):
            sgd       the user's own scan of ``jax.value_and_grad``, mean gradient, ``optax.sgd(momentum=0.9)``
            adascale  ``optax_adascale.value_and_grad(loss, num_microbatches=k)`` + ``adascale_sgd``
  dropin  the flagship's MNIST-1D CNN (``examples/train_mnist1d.py``'s Flax model) over the global batch
          under ``jax.jit`` on 8 devices (Explicit mesh), 32 rows per device:
            sgd       the user's own step: ``jax.value_and_grad`` + ``optax.sgd(momentum=0.9)``
            same_opt  ``jax.value_and_grad`` + the same ``adascale_sgd``, fed statistics computed from the
                      gradient (the optimizer's whole estimator compiled: the difference is the drop-in's)
            dropin    ``optax_adascale.value_and_grad(loss, data_axes="data")`` + ``adascale_sgd``

    python -m benchmarks.leaves --out benchmarks/leaves/leaves.json   # about 5 minutes on 2 CPU cores
    python -m benchmarks.leaves --smoke --out /tmp/leaves.json        # seconds (the test's run)
    python -m benchmarks.leaves --report benchmarks/leaves/leaves.json   # -> README.md "leaves" section
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import report, xla
from benchmarks.harness.timing import fmt_ratio, ratios

CASES = ("update", "cnn", "dropin")
AXIS = "data"
REPLICAS = 8
LR = 0.01
CNN_FULL = {"widths": (16, 32, 64, 128), "blocks": 2, "image": 16, "batch": 64, "classes": 10, "k": 8}
CNN_SMOKE = {"widths": (4, 8, 8, 8), "blocks": 2, "image": 8, "batch": 16, "classes": 10, "k": 4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.leaves", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two rounds (seconds)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block-s", type=float, default=0.3, help="target seconds of one baseline block")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="cpu: the process's CPU seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("leaves.json"))
    parser.add_argument("--report", type=Path, nargs="+", help="write the results section from these JSON files")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("README.md"))
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {write_report(args.report, args.results)}")
        return 0
    if args.smoke:
        args.rounds, args.block_s = 2, 0.01
    else:  # on a loaded host 8 virtual devices' threads can miss XLA:CPU's collective rendezvous deadline (it aborts)
        xla.add_flags("--xla_cpu_collective_call_terminate_timeout_seconds=900")

    import jax

    jax.config.update("jax_num_cpu_devices", REPLICAS)
    devices = jax.devices()
    print(f"JAX {jax.__version__}, {len(devices)} x {devices[0].device_kind}, {os.cpu_count()} host cores", flush=True)
    cases = {"update": case_update, "cnn": case_cnn, "dropin": case_dropin}
    results = {}
    for name in args.cases:
        results[name] = cases[name](jax, args)
        print(f"{name}: " + ", ".join(f"{v} {fmt_ratio(r)}" for v, r in results[name]["ratios"].items()), flush=True)
    meta = {
        "command": report.command_line("leaves", argv),
        "jax": jax.__version__,
        "device": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": args.rounds,
        "clock": args.clock,
        "load_average": os.getloadavg()[0],
        "smoke": args.smoke,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def alternate(runners: dict, base: str, rounds: int, block_s: float, clock: str) -> dict:
    """Alternating blocks A B C A B C ...; each block's time over ``base``'s in the same round: median, min–max.

    ``clock="cpu"`` times the process's CPU seconds (every thread) instead of the wall clock: on a host shared
    with other work the wall clock also counts the time this process waited for a core.
    """
    now = CLOCKS[clock]
    t0 = time.perf_counter()
    runners[base](1)
    steps = int(min(256, max(1, math.ceil(block_s / max(time.perf_counter() - t0, 1e-9)))))
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t0 = now()
            run(steps)
            times[name].append((now() - t0) / steps)
    return {
        "baseline": base,
        "clock": clock,
        "rounds": rounds,
        "steps_per_block": steps,
        "ratios": ratios(times, base),
        "median_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
    }


def _timed(jax, fns: dict, carry: dict, consts: tuple, args) -> dict:
    from benchmarks import hlo
    from benchmarks.gpu.gpu import compile_variants

    runners, compile_s, exes = compile_variants(jax, fns, carry, consts, donate=(0, 1))
    row = alternate(runners, next(iter(fns)), args.rounds, args.block_s, args.clock)
    row["compile_s"] = compile_s
    row["reduces"] = {name: hlo.count(exe.as_text(), "reduce") for name, exe in exes.items()}
    return row


def _leaves(tree) -> int:
    import jax

    return len(jax.tree.leaves(tree))


# --------------------------------------------------------------------------- update: the per-replica update alone


def case_update(jax, args) -> dict:
    import jax.numpy as jnp
    import optax

    import optax_adascale
    from benchmarks.gpu.models import cnn_init

    cfg = CNN_SMOKE if args.smoke else CNN_FULL
    params0 = jax.tree.map(np.asarray, cnn_init(jax, jnp, cfg))  # host arrays: every device_put a fresh buffer
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: rng.standard_normal((REPLICAS, *p.shape), np.float32), params0)
    sgd = optax.sgd(LR, momentum=0.9)
    txs = {
        "sgd": sgd,
        "floor": sgd,
        "adascale": optax_adascale.adascale_sgd(LR, momentum=0.9, axis_name=AXIS),
    }

    def make(name, tx):
        def replica(params, state, g):
            extra = jnp.zeros([], jnp.float32)
            if name == "sgd":
                g = jax.lax.pmean(g, AXIS)
            elif name == "floor":
                sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))
                g, extra = jax.lax.pmean((g, sq), AXIS)
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, extra

        return jax.vmap(replica, in_axes=(None, None, 0), out_axes=(None, None, None), axis_name=AXIS)

    one = jax.devices()[0]
    put = lambda tree: jax.device_put(tree, one)  # noqa: E731
    fns = {name: make(name, tx) for name, tx in txs.items()}
    carry = {name: (put(params0), put(tx.init(params0))) for name, tx in txs.items()}
    row = _timed(jax, fns, carry, (put(grads),), args)
    return {"config": {**cfg, "widths": list(cfg["widths"])}, "leaves": _leaves(params0), **row}


# --------------------------------------------------------------------------- cnn: a CNN step, k micro-batches


def case_cnn(jax, args) -> dict:
    import jax.numpy as jnp
    import optax

    import optax_adascale
    from benchmarks.gpu.gpu import _scan_mean_grad
    from benchmarks.gpu.models import cnn_init, make_cnn_loss

    cfg = CNN_SMOKE if args.smoke else CNN_FULL
    k = cfg["k"]
    params0 = jax.tree.map(np.asarray, cnn_init(jax, jnp, cfg))  # host arrays: every device_put a fresh buffer
    loss_fn = make_cnn_loss(jax, jnp, compute_dtype=jnp.float32)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((cfg["batch"], cfg["image"], cfg["image"], 3), np.float32)
    y = rng.integers(0, cfg["classes"], cfg["batch"]).astype(np.int32)
    one = jax.devices()[0]
    txs = {
        "sgd": optax.sgd(LR, momentum=0.9),
        "adascale": optax_adascale.adascale_sgd(LR, momentum=0.9),
    }
    sgd_grad = _scan_mean_grad(jax, jnp, loss_fn, k, 1)
    micro_grad = optax_adascale.value_and_grad(loss_fn, num_microbatches=k)

    def make(name, tx):
        def step(params, state, xb, yb):
            if name == "sgd":
                loss, grads = sgd_grad(params, xb, yb)
                updates, state = tx.update(grads, state, params)
            else:
                loss, grads, stats = micro_grad(params, xb, yb)
                updates, state = tx.update(grads, state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), state, loss

        return step

    put = lambda tree: jax.device_put(tree, one)  # noqa: E731
    fns = {name: make(name, tx) for name, tx in txs.items()}
    carry = {name: (put(params0), put(tx.init(params0))) for name, tx in txs.items()}
    row = _timed(jax, fns, carry, (put(x), put(y)), args)
    return {"config": {**cfg, "widths": list(cfg["widths"])}, "leaves": _leaves(params0), **row}


# --------------------------------------------------------------------------- dropin: the flagship's CNN, GSPMD


def flagship_cnn(width: int):
    """``examples/train_mnist1d.py``'s model: three strided convolutions and a linear classifier (Flax Linen)."""
    import flax.linen as nn

    class CNN(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x):
            x = x[..., None]
            for kernel in (5, 3, 3):
                x = nn.relu(nn.Conv(self.width, (kernel,), strides=2)(x))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    return CNN(width)


def case_dropin(jax, args) -> dict:
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    width, rows = (8, 8) if args.smoke else (32, 32)
    model = flagship_cnn(width)
    params0 = jax.tree.map(np.asarray, model.init(jax.random.key(0), jnp.zeros((1, 40)))["params"])
    mesh = jax.make_mesh((REPLICAS,), (AXIS,))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((REPLICAS * rows, 40), np.float32)
    y = rng.integers(0, 10, REPLICAS * rows).astype(np.int32)

    def loss_fn(params, xb, yb):
        logits = model.apply({"params": params}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    txs = {
        "sgd": optax.sgd(LR, momentum=0.9),
        "same_opt": optax_adascale.adascale_sgd(LR, momentum=0.9),
        "dropin": optax_adascale.adascale_sgd(LR, momentum=0.9),
    }
    drop_in = optax_adascale.value_and_grad(loss_fn, data_axes=AXIS)

    def make(name, tx):
        def step(params, state, xb, yb):
            if name == "dropin":
                loss, grads, stats = drop_in(params, xb, yb)
                updates, state = tx.update(grads, state, params, microbatch_stats=stats)
            else:
                loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
                if name == "sgd":
                    updates, state = tx.update(grads, state, params)
                else:  # the statistics of n samples from the gradient itself: the estimator's whole work, compiled
                    sq = jax.tree.map(lambda g: jnp.sum(jnp.square(g)), grads)
                    stats = optax_adascale.MicrobatchStats(sq, REPLICAS, mean_sq_norms=sq)
                    updates, state = tx.update(grads, state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), state, loss

        return step

    with jax.set_mesh(mesh):
        put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
        fns = {name: make(name, tx) for name, tx in txs.items()}
        carry = {name: (put(params0, P()), put(tx.init(params0), P())) for name, tx in txs.items()}
        row = _timed(jax, fns, carry, (put(x, P(AXIS)), put(y, P(AXIS))), args)
    return {"width": width, "rows_per_device": rows, "leaves": _leaves(params0), **row}


# --------------------------------------------------------------------------- the report


def write_report(files: list[Path], results_md: Path) -> Path:
    """The "leaves" section of ``results_md`` from JSON files (one per run, e.g. before and after a change)."""
    runs = [(f, json.loads(f.read_text())) for f in files]
    out = ["## Many small leaves", "", "Runs (each wrote one JSON file; `--report` turns them into this section):", ""]
    out += [
        f"- `{run['meta']['command'].strip()}` → `{f.name}`: JAX {run['meta']['jax']} on {run['meta']['device']}, "
        f"host {run['meta']['host']} (load average {run['meta'].get('load_average', float('nan')):.1f} at the end), "
        f"{run['meta']['rounds']} rounds, {run['meta'].get('clock', 'wall')} clock"
        for f, run in runs
    ]
    out += ["", report.kept_reading(results_md, "leaves"), ""]
    titles = {
        "update": "Update alone, 8 replicas as a vmap axis: ratios to SGD + pmean",
        "cnn": "CNN step, one device, k micro-batches: ratio to the user's own scan + SGD",
        "dropin": "Flagship CNN over the global batch, 8 devices: ratios to the user's own `jax.value_and_grad` step",
    }
    for case, title in titles.items():
        rows = [(f, run["results"][case]) for f, run in runs if case in run["results"]]
        if not rows:
            continue
        variants = [v for v in rows[0][1]["ratios"] if v != rows[0][1]["baseline"]]
        out += [f"### {title}", "", "| run | leaves | " + " | ".join(variants) + " | reduce ops |", ""]
        out[-1:] = ["|---|---:|" + "---:|" * len(variants) + "---|"]
        for f, row in rows:
            cells = " | ".join(fmt_ratio(row["ratios"][v]) for v in variants)
            reduces = ", ".join(f"{v} {c}" for v, c in row["reduces"].items())
            out.append(f"| `{f.stem}` | {row['leaves']} | {cells} | {reduces} |")
        if case == "dropin":
            out += [
                "",
                "dropin / same_opt: "
                + ", ".join(
                    f"`{f.stem}` {row['median_ms']['dropin'] / row['median_ms']['same_opt']:.3f}" for f, row in rows
                ),
            ]
        out.append("")
    return report.write_section(results_md, "leaves", "\n".join(out))
