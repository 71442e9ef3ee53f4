"""What does AdaScale cost per step? Side-by-side timing against SGD + pmean, plus compiled-HLO facts.

Variants, on the same MLP, mesh and data, compiled once and timed in alternating blocks:

  sgd       optax.sgd(momentum=0.9) on lax.pmean'd gradients (the baseline: ratio 1)
  floor     sgd, plus the local squared norm riding in the same pmean (the least AdaScale can do)
  floor_b   floor, plus ‖ḡ‖² read off the all-reduce output: the pass a current-step gain needs
            before the update can start (an ablation: what is left above it is bookkeeping)
  adascale  adascale_sgd(momentum=0.9, axis_name=...): current-step gain, one collective
  multi4    optax.MultiSteps(sgd, 4) on pmean'd gradients (a collective on every call)
  acc4      adascale_sgd(..., accumulation_steps=4): a collective on every 4th call only
  delayed   adascale_sgd(..., delayed_gain=True): the gain of the averages through the last update
  sgd_zero  SGD with the sharded update: reduce-scatter, momentum on a 1/n row, all-gather (shard_map only)
  zero_floor  sgd_zero plus each replica's local squared norm in a scalar psum: the least ZeRO AdaScale can do
  zero      adascale_sgd(..., shard_optimizer_state=n) (shard_map only): compare with sgd_zero

A block runs ``--steps`` updates (4 calls each for the accumulating variants) and then blocks
until done; one round times every variant once, in order; a block's ratio is its time over the
``sgd`` block of the same round. We report the median ratio with its min–max over the rounds.
Every step donates params and optimizer state, as a training loop would.

    python -m benchmarks.overhead --out benchmarks/overhead/overhead_2m.json --params 2e6
    python -m benchmarks.overhead --smoke        # seconds (used by the tests)
    python -m benchmarks.overhead --report benchmarks/overhead/overhead_*.json   # -> README.md "overhead" section
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import plots, report, timing

VARIANTS = (
    "sgd",
    "floor",
    "floor_b",
    "adascale",
    "update_clock",
    "multi4",
    "acc4",
    "delayed",
    "sgd_zero",
    "zero_floor",
    "zero",
)
SHARD_MAP_ONLY = ("sgd_zero", "zero_floor", "zero")
AXIS = "data"
_ratio = timing.fmt_ratio


def mlp_widths(params_target: int, depth: int = 3, d_in: int = 256, d_out: int = 10) -> list[int]:
    """Layer widths of an MLP with ``depth`` equal hidden layers and about ``params_target`` parameters."""
    lo, hi = 8, 16384
    while hi - lo > 8:
        mid = (lo + hi) // 2
        count = d_in * mid + (depth - 1) * mid * mid + mid * d_out
        lo, hi = (mid, hi) if count < params_target else (lo, mid)
    return [d_in] + [lo] * depth + [d_out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, few rounds (seconds)")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices to fake (ignored on accelerators)")
    parser.add_argument("--params", type=float, nargs="+", default=[2e6, 2e7], help="MLP sizes in parameters")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128], help="per-device batch sizes")
    parser.add_argument("--modes", nargs="+", default=["shard_map", "pmap"], choices=["shard_map", "pmap"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="updates per timed block")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("overhead.json"))
    parser.add_argument("--report", type=Path, nargs="+", help="write the results section from these JSON files")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("README.md"))
    args = parser.parse_args(argv)
    if args.report:
        print(f"wrote {write_report(args.report, args.results)}")
        return 0
    if args.smoke:
        args.params, args.batch, args.rounds, args.steps = [2e4], [8], 3, 2
    if "sgd" not in args.variants:
        args.variants.insert(0, "sgd")

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    devices = jax.devices()[: args.devices] if jax.default_backend() == "cpu" else jax.devices()
    print(
        f"JAX {jax.__version__}, {len(devices)} x {devices[0].device_kind} ({devices[0].platform}), "
        f"{os.cpu_count()} host cores",
        flush=True,
    )
    results = []
    for n_params in args.params:
        for batch in args.batch:
            for mode in args.modes:
                row = run_cell(jax, devices, mode, int(n_params), batch, args)
                results.append(row)
                print_row(row)
    meta = {
        "command": report.command_line("overhead", argv),
        "jax": jax.__version__,
        "device": f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})",
        "host": f"{platform.machine()}, {os.cpu_count()} cores",
        "rounds": args.rounds,
        "steps_per_block": args.steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")
    return 0


def run_cell(jax, devices, mode: str, n_params: int, batch: int, args) -> dict:
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale
    from benchmarks import hlo as _hlo

    n = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    widths = mlp_widths(n_params)
    rng = np.random.default_rng(0)
    params0 = [
        {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in zip(widths[:-1], widths[1:])
    ]
    x = rng.normal(size=(n * batch, widths[0])).astype(np.float32)
    y = rng.integers(0, widths[-1], size=(n * batch,)).astype(np.int32)
    largest = max((leaf["w"] for leaf in params0), key=lambda w: w.size)
    largest_shape = "f32[" + ",".join(map(str, largest.shape)) + "]"

    def loss_fn(params, xb, yb):
        h = xb
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
        logits = h @ params[-1]["w"] + params[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    lr = 0.01
    sgd = optax.sgd(lr, momentum=0.9)
    txs = {
        "sgd": (sgd, 1),
        "floor": (sgd, 1),
        "floor_b": (sgd, 1),
        "adascale": (optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name=AXIS), 1),
        "update_clock": (optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name=AXIS, clock="update"), 1),
        "multi4": (optax.MultiSteps(optax.sgd(lr, momentum=0.9), every_k_schedule=4), 4),
        "acc4": (
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name=AXIS, accumulation_steps=4),
            4,
        ),
        "delayed": (
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name=AXIS, delayed_gain=True),
            1,
        ),
        "sgd_zero": (sgd, 1),
        "zero_floor": (sgd, 1),
        "zero": (
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name=AXIS, shard_optimizer_state=n),
            1,
        ),
    }
    from optax_adascale.sharding._zero import from_rows, to_rows

    def zero_sgd_body(params, state, xb, yb, with_norm=False):
        """The honest baseline for ZeRO: SGD's own sharded update, same collectives, no statistics."""
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, AXIS, to="varying"), xb, yb)
        extra = jax.lax.psum(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)), AXIS) if with_norm else jnp.zeros([])
        flat = jax.tree.map(lambda g: jnp.ravel(to_rows(g, n)), grads)
        rows = jax.tree.map(lambda r: r / n, jax.lax.psum_scatter(flat, AXIS, scatter_dimension=0, tiled=True))
        index = jax.lax.axis_index(AXIS)
        p_rows = jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(to_rows(p, n), index, keepdims=False), params)
        local = jax.tree.map(lambda x: x.reshape(x.shape[1:]) if x.ndim == 2 else x, state)
        u, local = sgd.update(rows, local, p_rows)
        state = jax.tree.map(lambda x, old: x.reshape(old.shape), local, state)
        full = jax.lax.all_gather(u, AXIS, axis=0, tiled=True, to="invarying")
        updates = jax.tree.map(lambda f, p: from_rows(f, p), full, params)
        return optax.apply_updates(params, updates), state, extra

    def make_body(name, tx, vary):
        def body(params, state, xb, yb):
            grads = jax.grad(loss_fn)(vary(params), xb, yb)
            extra = jnp.zeros([])
            if name in ("sgd", "multi4"):
                grads = jax.lax.pmean(grads, AXIS)
            elif name == "floor":
                extra = sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))
                grads, extra = jax.lax.pmean((grads, extra), AXIS)
            elif name == "floor_b":
                extra = sum(jnp.sum(g * g) for g in jax.tree.leaves(grads))
                sums, extra = jax.lax.psum((grads, extra), AXIS)
                extra = extra + sum(jnp.sum(s * s) for s in jax.tree.leaves(sums)) / (n * n)
                grads = jax.tree.map(lambda s: s / n, sums)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, extra

        return body

    compiled, carry, hlo, compile_s = {}, {}, {}, {}
    for name in args.variants:
        if mode != "shard_map" and name in SHARD_MAP_ONLY:
            continue
        tx, k = txs[name]
        state0 = tx.init(params0)
        if name in ("sgd_zero", "zero_floor"):
            state0 = tx.init(jax.tree.map(lambda p: to_rows(jnp.asarray(p), n), params0))
        if mode == "shard_map":
            state0 = optax_adascale.replicate_buffers(state0, n)
            specs = optax_adascale.state_partition_specs(state0, AXIS)
            if name in ("sgd_zero", "zero_floor"):
                specs = jax.tree.map(lambda a: P(AXIS) if a.ndim == 2 else P(), state0)
            body = make_body(name, tx, lambda p: jax.lax.pcast(p, AXIS, to="varying"))
            if name in ("sgd_zero", "zero_floor"):
                body = functools.partial(zero_sgd_body, with_norm=name == "zero_floor")
            step = jax.jit(
                jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs, P())),
                donate_argnums=(0, 1),
            )
            params = jax.device_put(params0, NamedSharding(mesh, P()))
            state = jax.device_put(state0, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
            xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
            ys = jax.device_put(y, NamedSharding(mesh, P(AXIS)))
        else:
            body = make_body(name, tx, lambda p: p)
            step = jax.pmap(body, axis_name=AXIS, devices=devices, donate_argnums=(0, 1))
            stacked = NamedSharding(mesh, P(AXIS))

            def stack(tree, stacked=stacked):
                return jax.device_put(jax.tree.map(lambda leaf: np.stack([np.asarray(leaf)] * n), tree), stacked)

            params, state = stack(params0), stack(state0)
            xs = jax.device_put(x.reshape(n, batch, -1), stacked)
            ys = jax.device_put(y.reshape(n, batch), stacked)
        t0 = time.perf_counter()
        exe = step.lower(params, state, xs, ys).compile()
        compile_s[name] = time.perf_counter() - t0
        text = exe.as_text()
        hlo[name] = {
            "all_reduce": _hlo.count(text, "all-reduce"),
            "all_reduce_every_call": _hlo.count_unconditional(text, "all-reduce"),
            "collectives": {op: c for op, c in _hlo.count_collectives(text).items() if c},
            "host_callbacks": _hlo.count_host_callbacks(text),
            "largest_leaf_passes": _hlo.passes_over(text, largest_shape),
            "large_copies": _hlo.count_large_copies(text),
            "state_bytes": int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tx.init(params0)))),
            "state_bytes_per_device": int(
                sum(
                    a.size * a.dtype.itemsize // (n if name in SHARD_MAP_ONLY and a.ndim == 2 else 1)
                    for a in jax.tree.leaves(state0)
                )
            ),
            "collective_bytes": _hlo.collective_bytes(text, min_elements=2),
        }
        for _ in range(2 * k):  # warm up, keep the donated buffers flowing
            params, state, _ = exe(params, state, xs, ys)
        jax.block_until_ready(params)
        compiled[name], carry[name] = exe, (params, state, xs, ys)

    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(args.rounds):
        for name in compiled:
            exe, k = compiled[name], txs[name][1]
            params, state, xs, ys = carry[name]
            t0 = time.perf_counter()
            for _ in range(args.steps * k):
                params, state, _ = exe(params, state, xs, ys)
            jax.block_until_ready((params, state))
            times[name].append((time.perf_counter() - t0) / args.steps)
            carry[name] = (params, state, xs, ys)
        # free nothing: every variant keeps its own donated buffers

    return {
        "mode": mode,
        "params": int(sum(a.size for a in jax.tree.leaves(params0))),
        "widths": widths,
        "per_device_batch": batch,
        "ratios": timing.ratios(times, "sgd"),
        "median_ms_per_update": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "compile_ratio": {name: compile_s[name] / compile_s["sgd"] for name in compile_s},
        "hlo": hlo,
    }


def write_report(files: list[Path], results_md: Path) -> Path:
    """The "overhead" section of ``results_md`` (the study's README.md) from JSON files; the reading is kept."""

    runs = [json.loads(f.read_text()) for f in files]
    rows = [(run["meta"], row) for run in runs for row in run["results"]]
    plot = plot_ratios(
        [row for _, row in rows if "multi4" in row["ratios"]], results_md.parent / "plots" / "overhead_ratios.png"
    )
    out = ["## Overhead", "", "Commands (each writes one JSON file; `--report` turns them into this section):", ""]
    out += [
        f"- `{run['meta']['command'].strip()}` on {run['meta']['device']}, host {run['meta']['host']}, "
        f"{run['meta']['rounds']} rounds of {run['meta']['steps_per_block']} updates per block"
        for run in runs
    ]
    out += ["", report.kept_reading(results_md, "overhead"), ""]
    out += [
        "### Step time, as ratios to SGD + pmean (median over rounds, min–max)",
        "",
        "| mode | params | batch/device | floor | floor + ‖ḡ‖² pass | **adascale** | adascale / floor | "
        "MultiSteps(4) per update | **accumulation 4** per update |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, row in rows:
        r = row["ratios"]
        if "multi4" not in r:
            continue  # a ZeRO / delayed-gain run: its own table below
        floor_b = _ratio(r["floor_b"]) if "floor_b" in r else "–"
        out.append(
            f"| {row['mode']} | {row['params'] / 1e6:.1f}M | {row['per_device_batch']} | {_ratio(r['floor'])} | "
            f"{floor_b} | **{_ratio(r['adascale'])}** | {r['adascale']['median'] / r['floor']['median']:.3f} | "
            f"{_ratio(r['multi4'])} | **{_ratio(r['acc4'])}** |"
        )
    zero_rows = [row for _, row in rows if "zero" in row["ratios"]]
    if zero_rows:
        out += [
            "",
            "### Sharded optimizer state (ZeRO) and the delayed gain",
            "",
            "Ratios to replicated SGD + pmean in the same rounds. `sgd_zero` is SGD with the same sharded update "
            "(reduce-scatter, momentum on a 1/n row, all-gather): the honest baseline for `zero` "
            "(`shard_optimizer_state=n`). `zero_floor` adds each replica's local squared norm in a scalar psum: "
            "the least a sharded AdaScale can do.",
            "",
            "| params | sgd_zero | zero_floor | **zero** | zero / sgd_zero | zero / zero_floor | replicated adascale |"
            " delayed |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in zero_rows:
            r = row["ratios"]
            out.append(
                f"| {row['params'] / 1e6:.1f}M | {_ratio(r['sgd_zero'])} | {_ratio(r['zero_floor'])} | "
                f"**{_ratio(r['zero'])}** | {r['zero']['median'] / r['sgd_zero']['median']:.3f} | "
                f"{r['zero']['median'] / r['zero_floor']['median']:.3f} | {_ratio(r['adascale'])} | "
                f"{_ratio(r['delayed'])} |"
            )
    out += [
        "",
        "### Compiled-HLO facts",
        "",
        "All-reduces in the step (and how many run on every call: 0 means only inside the k-th call's branch), "
        "passes over the largest gradient leaf (instructions in the entry computation reading / writing an "
        "array of its shape: the forward and backward matmuls, the local norm, the all-reduce, the optimizer "
        "update...), copies of arrays of 1024+ elements, host callbacks, optimizer-state bytes and compile time "
        "relative to SGD.",
        "",
        "| mode | params | batch/device | variant | all-reduce (every call) | largest-leaf reads / writes | "
        "large copies | host callbacks | state MB | compile × |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for _, row in rows:
        if row["per_device_batch"] != min(r["per_device_batch"] for _, r in rows) and "zero" not in row["ratios"]:
            continue  # the HLO does not depend on the batch size beyond shapes
        for name, h in row["hlo"].items():
            p = h["largest_leaf_passes"]
            out.append(
                f"| {row['mode']} | {row['params'] / 1e6:.1f}M | {row['per_device_batch']} | {name} | "
                f"{h['all_reduce']} ({h['all_reduce_every_call']}) | {p['reads']} / {p['writes']} | "
                f"{h['large_copies']} | {h['host_callbacks']} | {h['state_bytes'] / 1e6:.1f} | "
                f"{row['compile_ratio'][name]:.2f} |"
            )
    rel = plot.relative_to(results_md.parent)
    out += ["", f"![step-time ratios]({rel})", "", f"`{rel}`: median step time over SGD + pmean (bars: min–max)."]
    return report.write_section(results_md, "overhead", "\n".join(out))


def plot_ratios(rows: list[dict], path: Path) -> Path:
    """Grouped bars: each variant's median ratio to SGD + pmean per cell, min–max whiskers."""
    plt = plots.pyplot()

    variants = [v for v in ("floor", "floor_b", "adascale") if all(v in r["ratios"] for r in rows)]
    labels = [f"{r['mode']}\n{r['params'] / 1e6:.0f}M, b{r['per_device_batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 3.6))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        med = np.array([r["ratios"][v]["median"] for r in rows])
        lo = med - np.array([r["ratios"][v]["min"] for r in rows])
        hi = np.array([r["ratios"][v]["max"] for r in rows]) - med
        xs = np.arange(len(rows)) + (i - (len(variants) - 1) / 2) * width
        ax.bar(xs, med - 1, width, bottom=1, yerr=[lo, hi], capsize=2, label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(rows)), labels, fontsize=8)
    ax.set_ylabel("step time / SGD + pmean")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return plots.save(fig, path, dpi=120)


def print_row(row: dict) -> None:
    head = f"{row['mode']:9s} {row['params'] / 1e6:5.2f}M params, batch/device {row['per_device_batch']:4d}"
    ratios = [(name, r) for name, r in row["ratios"].items() if name != "sgd"]
    parts = [f"{name} {r['median']:.3f} [{r['min']:.2f}-{r['max']:.2f}]" for name, r in ratios]
    print(head + " | " + " | ".join(parts), flush=True)
    for name, h in row["hlo"].items():
        p = h["largest_leaf_passes"]
        print(
            f"    {name:9s} all-reduce {h['all_reduce']} (every call {h['all_reduce_every_call']}), "
            f"largest leaf reads {p['reads']} writes {p['writes']}, large copies {h['large_copies']}, "
            f"host callbacks {h['host_callbacks']}, state {h['state_bytes'] / 1e6:.1f} MB, "
            f"compile x{row['compile_ratio'][name]:.2f}",
            flush=True,
        )
