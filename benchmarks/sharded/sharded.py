"""Sharded parameters and state: what AdaScale adds over SGD on the same sharding, read from compiled HLO.

For each layout, one training step of the same MLP (``--width``) on a ``(data=4, model=2)`` mesh of
8 devices is compiled twice, for AdaScale and for ``optax.sgd(momentum=0.9)`` + ``lax.pmean`` on
the same sharding, and compared: collectives (kind, count), bytes moved by gradient-sized
collectives, the scalar-sized all-reduces AdaScale adds, and per-device memory from
``compiled.memory_analysis()``. No timing: these are facts of the program.

Layouts:

  shard_map TP       shard_map over (data, model); w1 split by columns, w2 by rows (Megatron)
  partial-manual TP  shard_map(axis_names={"data"}); the partitioner splits over model
  GSPMD TP / FSDP / TP×FSDP   jit(vmap(step, axis_name="data")), replica axis sharded over data
  ZeRO               shard_optimizer_state=8 on a 1-D data mesh, against SGD with the same sharded update
  FSDP (shard_map)   fsdp_gather + shard_optimizer_state=8, against SGD with the same gather/scatter

    python -m benchmarks.sharded                # writes sharded.json and the section of README.md, here
    python -m benchmarks.sharded --smoke        # tiny widths
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.harness import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sharded", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (d_in = d_out = width)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("sharded.json"))
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("README.md"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.width = 64

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    rows = measure(jax, args.width)
    meta = {"command": report.command_line("sharded", argv), "jax": jax.__version__, "width": args.width}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    for row in rows:
        print(f"{row['layout']:22s} " + " | ".join(f"{k} {v}" for k, v in row.items() if k != "layout"))
    print(f"wrote {args.out}")
    if not args.smoke:
        print(f"wrote {write_report(meta, rows, args.results)}")
    return 0


def measure(jax, width: int) -> list[dict]:
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale
    from benchmarks import hlo as _hlo
    from optax_adascale.sharding._zero import from_rows, to_rows

    devices = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model"))
    mesh1 = jax.sharding.Mesh(devices, ("data",))
    d, h, c, rows_per = width, 4 * width, width, 8
    rng = np.random.default_rng(0)
    # Every leaf has at least `width` elements: "gradient-sized" means at least min(1024, width) elements.
    params0 = {
        "w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.normal(size=(h, c)) / np.sqrt(h)).astype(np.float32),
        "b2": np.zeros(c, np.float32),
    }
    x = rng.normal(size=(4, rows_per, d)).astype(np.float32)
    y = rng.normal(size=(4, rows_per, c)).astype(np.float32)
    tp = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    layouts = {
        "TP": tp,
        "FSDP": {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P()},
        "TP×FSDP": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P("data")},
    }

    def full_loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    def tp_loss(p, x, y):
        return jnp.mean((jax.lax.psum(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"], "model") + p["b2"] - y) ** 2)

    adascale = optax_adascale.adascale_sgd(0.01, momentum=0.9, axis_name="data")
    sgd = optax.sgd(0.01, momentum=0.9)

    min_elements = min(1024, width)  # smaller arrays are statistics (per-replica scalars, [n] vectors), not gradients

    def facts(compiled):
        text = compiled.as_text()
        mem = compiled.memory_analysis()
        return {
            "collectives": {k: v for k, v in _hlo.count_collectives(text).items() if v},
            "bytes": _hlo.collective_bytes(text, min_elements=min_elements),
            "memory": int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes),
            "host_callbacks": _hlo.count_host_callbacks(text),
        }

    def compare(layout, build):
        ours, base = facts(build(True)), facts(build(False))
        return {
            "layout": layout,
            "collectives (AdaScale)": ours["collectives"],
            "collectives (SGD)": base["collectives"],
            "gradient-sized bytes (AdaScale / SGD)": f"{ours['bytes']['large_bytes']} / {base['bytes']['large_bytes']}",
            "extra scalar all-reduces": ours["bytes"]["small_all_reduces"] - base["bytes"]["small_all_reduces"],
            "memory per device (AdaScale / SGD)": round(ours["memory"] / base["memory"], 4),
            "host callbacks": ours["host_callbacks"],
        }

    def placed(specs, m=mesh):
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(m, s)), params0, specs)

    rows = []

    def shard_map_tp(ours):
        t = adascale if ours else sgd
        params = placed(tp)
        specs = optax.tree_map_params(t, lambda _, s: s, t.init(params), tp, transform_non_params=lambda _: P())

        def step(p, s, x, y):
            g = jax.grad(tp_loss)(jax.lax.pcast(p, "data", to="varying"), x[0], y[0])
            if not ours:
                g = jax.lax.pmean(g, "data")
            u, s = t.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(tp, specs, P("data"), P("data")), out_specs=(tp, specs)))
        return f.lower(params, t.init(params), x, y).compile()

    rows.append(compare("shard_map TP", shard_map_tp))

    def partial_manual(ours):
        t = adascale if ours else sgd
        params = placed(tp)

        def step(p, s, x, y):
            g = jax.grad(full_loss)(jax.lax.pcast(p, "data", to="varying"), x[0], y[0])
            if not ours:
                g = jax.lax.pmean(g, "data")
            u, s = t.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(
            jax.shard_map(
                step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()), axis_names={"data"}
            )
        )
        return f.lower(params, t.init(params), x, y).compile()

    rows.append(compare("partial-manual TP", partial_manual))

    for name, specs in layouts.items():

        def gspmd(ours, specs=specs):
            t = adascale if ours else sgd
            params = placed(specs)

            def step(p, s, x, y):
                g = jax.grad(full_loss)(p, x, y)
                if not ours:
                    g = jax.lax.pmean(g, "data")
                u, s = t.update(g, s, p)
                return optax.apply_updates(p, u), s

            f = jax.jit(jax.vmap(step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))
            batch = NamedSharding(mesh, P("data"))
            return f.lower(params, t.init(params), jax.device_put(x, batch), jax.device_put(y, batch)).compile()

        rows.append(compare(f"GSPMD {name}", gspmd))

    x8 = x.reshape(8, rows_per // 2, d)
    y8 = y.reshape(8, rows_per // 2, c)
    zero_tx = optax_adascale.adascale_sgd(0.01, momentum=0.9, axis_name="data", shard_optimizer_state=8)

    def zero(ours):
        if ours:
            state = zero_tx.init(params0)
            specs = optax_adascale.state_partition_specs(state, "data")

            def step(p, s, x, y):
                u, s = zero_tx.update(jax.grad(full_loss)(jax.lax.pcast(p, "data", to="varying"), x[0], y[0]), s, p)
                return optax.apply_updates(p, u), s
        else:
            state = sgd.init(jax.tree.map(lambda p: to_rows(jnp.asarray(p), 8), params0))
            specs = jax.tree.map(lambda a: P("data") if a.ndim == 2 else P(), state)

            def step(p, s, x, y):
                g = jax.grad(full_loss)(jax.lax.pcast(p, "data", to="varying"), x[0], y[0])
                flat = jax.tree.map(lambda a: jnp.ravel(to_rows(a, 8)), g)
                r = jax.tree.map(lambda a: a / 8, jax.lax.psum_scatter(flat, "data", scatter_dimension=0, tiled=True))
                i = jax.lax.axis_index("data")
                pr = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(to_rows(a, 8), i, keepdims=False), p)
                local = jax.tree.map(lambda a: a.reshape(a.shape[1:]) if a.ndim == 2 else a, s)
                u, local = sgd.update(r, local, pr)
                s = jax.tree.map(lambda a, old: a.reshape(old.shape), local, s)
                full = jax.lax.all_gather(u, "data", axis=0, tiled=True, to="invarying")
                return optax.apply_updates(p, jax.tree.map(from_rows, full, p)), s

        f = jax.jit(
            jax.shard_map(step, mesh=mesh1, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs))
        )
        return f.lower(params0, state, x8, y8).compile()

    rows.append(compare("ZeRO (8 replicas)", zero))
    shapes = jax.eval_shape(lambda: params0)

    def fsdp(ours):
        rows_ = optax_adascale.fsdp_shard(params0, 8)
        row_specs = jax.tree.map(lambda _: P("data"), rows_)
        if ours:
            state = zero_tx.init(params0)
            specs = optax_adascale.state_partition_specs(state, "data")
        else:
            state = sgd.init(rows_)
            specs = jax.tree.map(lambda a: P("data") if a.ndim == 2 else P(), state)

        def step(r, s, x, y):
            def loss_of(r, probes):
                return full_loss(optax_adascale.fsdp_gather(r, probes, shapes, "data"), x[0], y[0])

            probes = optax_adascale.fsdp_probes(r, "data")
            g, stats = jax.grad(loss_of, argnums=(0, 1))(r, probes)
            if ours:
                u, s = zero_tx.update(g, s, r, microbatch_stats=stats)
            else:
                u, s = sgd.update(jax.tree.map(lambda a: a / 8, g), s, r)
            return optax.apply_updates(r, u), s

        f = jax.jit(
            jax.shard_map(
                step, mesh=mesh1, in_specs=(row_specs, specs, P("data"), P("data")), out_specs=(row_specs, specs)
            )
        )
        return f.lower(rows_, state, x8, y8).compile()

    rows.append(compare("FSDP (shard_map, 8)", fsdp))
    return rows


def gpt_shapes(d_model: int, layers: int, vocab: int, seq: int) -> dict:
    """Parameter shapes of a GPT-2-style decoder (tied embedding)."""
    import jax
    import jax.numpy as jnp

    f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    block = {
        "ln1": f(d_model),
        "qkv": f(d_model, 3 * d_model),
        "qkv_b": f(3 * d_model),
        "proj": f(d_model, d_model),
        "proj_b": f(d_model),
        "ln2": f(d_model),
        "fc": f(d_model, 4 * d_model),
        "fc_b": f(4 * d_model),
        "out": f(4 * d_model, d_model),
        "out_b": f(d_model),
    }
    return {"embed": f(vocab, d_model), "pos": f(seq, d_model), "blocks": [block] * layers, "ln_f": f(d_model)}


def memory_rows(jax) -> list[dict]:
    """Per-device optimizer-state bytes, replicated vs ZeRO, computed from the abstract states (no memory used)."""
    import optax

    import optax_adascale

    models = {
        "GPT 124M (d 768, 12 layers)": gpt_shapes(768, 12, 50257, 1024),
        "GPT 1.3B (d 2048, 24 layers)": gpt_shapes(2048, 24, 50257, 2048),
    }
    inners = {"momentum SGD": optax.trace(0.9), "Adam": optax.scale_by_adam()}
    rows = []
    for model, shapes in models.items():
        n_params = sum(int(np_prod(x.shape)) for x in jax.tree.leaves(shapes))
        for inner_name, inner in inners.items():
            rep = jax.eval_shape(optax_adascale.adascale(inner, 0.1, axis_name="data").init, shapes)
            row = {"model": model, "params": n_params, "inner": inner_name, "replicated": _device_bytes(jax, rep, 1)}
            for n in (8, 64, 1024):
                tx = optax_adascale.adascale(inner, 0.1, axis_name="data", shard_optimizer_state=n)
                row[n] = _device_bytes(jax, jax.eval_shape(tx.init, shapes), n)
            rows.append(row)
    return rows


def np_prod(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _device_bytes(jax, state, n: int) -> int:
    """Bytes one device holds: ZeRO rows ``(n, m)`` count ``1/n``, everything else whole."""
    total = 0
    for leaf in jax.tree.leaves(state):
        size = np_prod(leaf.shape) * leaf.dtype.itemsize
        total += size // n if n > 1 and len(leaf.shape) == 2 and leaf.shape[0] == n else size
    return total


def write_report(meta: dict, rows: list[dict], results_md: Path) -> Path:
    out = [
        "## Sharded models and state",
        "",
        f"Command: `{meta['command'].strip()}` (JAX {meta['jax']}, 8 virtual CPU devices; an MLP "
        f"{meta['width']}→{4 * meta['width']}→{meta['width']}). Facts of the compiled step, no timing: "
        "AdaScale against `optax.sgd(momentum=0.9)` + `pmean` on the same sharding (for ZeRO and FSDP, "
        "against SGD with the same sharded update).",
        "",
        report.kept_reading(results_md, "sharded"),
        "",
        "| layout | collectives, AdaScale | collectives, SGD | gradient-sized bytes (AdaScale / SGD) | "
        "extra scalar all-reduces | memory per device, AdaScale / SGD |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        fmt = lambda c: ", ".join(f"{k} {v}" for k, v in c.items()) or "none"  # noqa: E731
        out.append(
            f"| {r['layout']} | {fmt(r['collectives (AdaScale)'])} | {fmt(r['collectives (SGD)'])} | "
            f"{r['gradient-sized bytes (AdaScale / SGD)']} | {r['extra scalar all-reduces']} | "
            f"{r['memory per device (AdaScale / SGD)']:.4f} |"
        )
    import jax

    out += [
        "",
        "### Optimizer state per device, replicated vs ZeRO (computed)",
        "",
        "From `jax.eval_shape(tx.init, shapes)` of `adascale(inner, ..., shard_optimizer_state=n)`: the rows "
        "`(n, m)` count 1/n per device (the last row's padding included), the O(1) scalars whole. MB = 10⁶ bytes.",
        "",
        "| model | inner | replicated | n = 8 | n = 64 | n = 1024 | replicated / ZeRO at 1024 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in memory_rows(jax):
        mb = lambda b: f"{b / 1e6:,.1f}"  # noqa: E731
        out.append(
            f"| {r['model']} | {r['inner']} | {mb(r['replicated'])} | {mb(r[8])} | {mb(r[64])} | "
            f"{mb(r[1024])} | {r['replicated'] / r[1024]:.0f}× |"
        )
    return report.write_section(results_md, "sharded", "\n".join(out))
