"""The GSPMD drop-in against the user's own step: collectives and memory from compiled HLO.

For each parameter layout on a ``(data 4, model 2)`` mesh of 8 CPU devices (Auto axes), one
training step of an MLP ``d → h → d`` over the global batch is compiled twice:

  drop-in   ``optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k)`` +
            ``adascale_sgd(momentum=0.9)`` (no ``axis_name``)
  baseline  ``jax.value_and_grad(loss)`` + ``optax.sgd(momentum=0.9)``

with the same ``in_shardings``/``out_shardings``. Reported: bytes moved by gradient-sized
collectives (tuple members summed; all float32, so elements = bytes / 4), the scalar-sized
all-reduces, gradient-sized collectives inside the micro-batch loop (``k > 1``), and per-device
memory (``compiled.memory_analysis()``: arguments + outputs + temporaries). No timing.

    python -m benchmarks.gspmd.run                 # 256 → 1024 → 256, 8192 rows; prints the table
    python -m benchmarks.gspmd.run --smoke         # 16 → 32 → 16, 64 rows
    python -m benchmarks.gspmd.run --loops         # also: hand-written micro-batch loops (docs/gspmd.md)
    python -m benchmarks.gspmd.run --stacked       # scanned layers (lax.scan + jax.checkpoint) under FSDP
    python -m benchmarks.gspmd.run --explicit      # the drop-in on an Explicit mesh
    python -m benchmarks.gspmd.run --explicit-loss # both on an Explicit mesh, the loss with out_sharding=
    python -m benchmarks.gspmd.run --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

LAYOUTS = ("replicated", "TP", "FSDP", "TP×FSDP")


def param_specs(layout: str):
    from jax.sharding import PartitionSpec as P

    return {
        "replicated": {"w1": P(), "b1": P(), "w2": P()},
        "TP": {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
        "FSDP": {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
        "TP×FSDP": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")},
    }[layout]


def mlp(d: int, h: int):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (d, h)) / d**0.5,
        "b1": jnp.zeros(h),
        "w2": jax.random.normal(k2, (h, d)) / h**0.5,
    }

    def loss(p, x, y):
        hidden = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean((hidden @ p["w2"] - y) ** 2)

    return params, loss


def explicit_mlp(d: int, h: int):
    """The MLP written the Explicit way: parameters resharded for use, ``out_sharding=`` naming the batch axis."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jax.sharding import reshard

    params, _ = mlp(d, h)

    def loss(p, x, y):
        w1, b1, w2 = reshard(p["w1"], P(None, "model")), reshard(p["b1"], P("model")), reshard(p["w2"], P("model"))
        hidden = jnp.tanh(jnp.einsum("bd,dh->bh", x, w1, out_sharding=P("data", "model")) + b1)
        return jnp.mean((jnp.einsum("bh,hd->bd", hidden, w2, out_sharding=P("data", None)) - y) ** 2)

    return params, loss


def compile_steps(
    layout: str, *, d: int, h: int, rows: int, k: int = 1, explicit: bool = False, explicit_loss: bool = False
):
    """The compiled drop-in step and baseline step: ``(ours, base)``.

    ``explicit``: the drop-in's step on a mesh with Explicit axes (``jax.make_mesh``'s default); the
    baseline stays on Auto axes (the same loss under ``jax.value_and_grad`` on an Explicit mesh would
    need ``out_sharding=`` on its TP matmuls). The devices and shardings are the same.
    ``explicit_loss``: both steps on the Explicit mesh, the loss written the Explicit way (:func:`explicit_mlp`).
    """
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params, loss = explicit_mlp(d, h) if explicit_loss else mlp(d, h)
    grad_fn = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k)
    compiled = []
    for tx, ours in ((optax_adascale.adascale_sgd(0.1, momentum=0.9), True), (optax.sgd(0.1, momentum=0.9), False)):
        mesh = jax.make_mesh((4, 2), ("data", "model")) if (ours and explicit) or explicit_loss else auto
        p_sh = jax.tree.map(lambda s, mesh=mesh: NamedSharding(mesh, s), param_specs(layout))
        x = jax.ShapeDtypeStruct((rows, d), np.float32, sharding=NamedSharding(mesh, P("data")))
        state = jax.eval_shape(tx.init, params)
        s_sh = (
            optax_adascale.state_shardings(state, params, p_sh)
            if hasattr(optax_adascale, "state_shardings")
            else _state_shardings(state, params, p_sh, mesh)
        )

        def step(p, s, x, y, tx=tx, ours=ours):
            if ours:
                value, grads, stats = grad_fn(p, x, y)
                updates, s = tx.update(grads, s, p, microbatch_stats=stats)
            else:
                value, grads = jax.value_and_grad(loss)(p, x, y)
                updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), params, p_sh)
        state_shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, s_sh)
        jitted = jax.jit(step, out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())))
        with jax.set_mesh(mesh):
            compiled.append(jitted.lower(shapes, state_shapes, x, x).compile())
    data_of = {d.id: i for i, row in enumerate(mesh.devices) for d in row}
    return (*compiled, data_of)


def _state_shardings(state, params, p_sh, mesh):
    """Optimizer-state shardings: leaves shaped like a parameter take its sharding, the rest replicated."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    by_shape = {}
    for p, sh in zip(jax.tree.leaves(params), jax.tree.leaves(p_sh), strict=True):
        by_shape.setdefault(p.shape, sh)
    return jax.tree.map(lambda a: by_shape.get(a.shape, NamedSharding(mesh, P())), state)


def facts(compiled, data_of: dict[int, int]) -> dict:
    from optax_adascale import _hlo

    text = compiled.as_text()
    mem = compiled.memory_analysis()
    moved = _hlo.collective_bytes(text)
    return {
        "gradient_bytes": moved["large_bytes"],
        "scalar_all_reduces": moved["small_all_reduces"],
        "data_reductions": data_reductions(text, data_of, in_loops=False),
        "data_reductions_in_loop": data_reductions(text, data_of, in_loops=True),
        "memory": int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes),
    }


def replica_groups(line: str, num_devices: int) -> list[set[int]]:
    """The device groups of one collective instruction, in any of XLA's three text formats."""
    import numpy as np

    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", line)
    if m:
        return [{int(v) for v in g.split(",") if v.strip()} for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(num_devices).reshape([int(v) for v in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(v) for v in m.group(4).split(",")])
        return [set(row) for row in ids.reshape(int(m.group(1)), int(m.group(2))).tolist()]
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}",
        line,
    )
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        ids = np.arange(num_devices)
        if m.group(2):
            ids = ids.reshape([int(v) for v in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        ids = ids.reshape([int(size) for _, size in axes])
        names = [name for name, _ in axes]
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        kept = [i for i in range(len(names)) if i not in reduced]
        ids = ids.transpose(kept + reduced).reshape(-1, int(np.prod([ids.shape[i] for i in reduced] or [1])))
        return [set(row) for row in ids.tolist()]
    return [set(range(num_devices))]  # no groups: all devices


def data_reductions(text: str, data_of: dict[int, int], *, in_loops: bool, min_elements: int = 64) -> int:
    """Gradient-sized reductions (all-reduce, reduce-scatter) across the data axis, inside loops or anywhere.

    ``data_of`` maps a device id to its data coordinate: a group spanning two coordinates reduces over data.
    """
    from optax_adascale import _hlo

    comps, entry = _hlo._split(text)
    if in_loops:
        roots = set()
        for lines in comps.values():
            for line in lines:
                if " while(" in line:
                    roots.update(re.findall(r"(?:body|condition)=%?([\w.\-]+)", line))
    else:
        roots = {entry}
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for _key, target in _hlo._CALLEE.findall(line):
                stack.extend(t.strip().lstrip("%") for t in target.strip("{}").split(","))
    total = 0
    for name in seen:
        for line in comps[name]:
            m = _hlo._COLLECTIVE_LINE.match(line)
            if not m or m.group(2) not in ("all-reduce", "reduce-scatter"):
                continue
            if not _hlo.collective_bytes(line, min_elements)["large_bytes"]:
                continue
            groups = replica_groups(line, len(data_of))
            total += any(len({data_of[d] for d in g}) > 1 for g in groups)
    return total


def compile_own_loop(recipe: str, layout: str, *, d: int, h: int, rows: int, k: int):
    """A user's own micro-batch loop (``lax.scan`` summing gradients, MaxText-style) feeding AdaScale.

    ``naive``: ``jax.value_and_grad`` of each global micro-batch, ``‖g_j‖²`` of the (reduced) result.
    ``drop_in``: ``optax_adascale.value_and_grad(data_axes="data")`` per micro-batch, its stats summed.
    ``sgd``: the same loop without statistics, into ``optax.sgd(momentum=0.9)`` (the user's own step).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    params, loss = mlp(d, h)
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(layout))
    x = jax.ShapeDtypeStruct((rows, d), np.float32, sharding=NamedSharding(mesh, P("data")))
    tx = optax.sgd(0.1, momentum=0.9) if recipe == "sgd" else optax_adascale.adascale_sgd(0.1, momentum=0.9)
    state = jax.eval_shape(tx.init, params)
    s_sh = _state_shardings(state, params, p_sh, mesh)
    drop_in = optax_adascale.value_and_grad(loss, data_axes="data")

    def step(p, s, x, y):
        # Strided micro-batches (MaxText): micro-batch j holds rows j, j + k, …, so each stays spread over the shards.
        micro = jax.tree.map(lambda a: a.reshape((-1, k) + a.shape[1:]).swapaxes(0, 1), (x, y))

        def body(carry, mb):
            grad_sum, sq_sum = carry
            if recipe in ("naive", "sgd"):
                value, grads = jax.value_and_grad(loss)(p, *mb)
                sq = jax.tree.map(lambda g: jnp.sum(jnp.square(g)) * (recipe == "naive"), grads)
            else:
                value, grads, stats = drop_in(p, *mb)
                sq = stats.sq_norms
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(grad_sum, grads), add(sq_sum, sq)), value

        zeros = (jax.tree.map(jnp.zeros_like, p), jax.tree.map(lambda _: jnp.zeros(()), p))
        (grad_sum, sq_sum), values = lax.scan(body, zeros, micro)
        n = k if recipe == "naive" else 4 * k
        stats = optax_adascale.MicrobatchStats(jax.tree.map(lambda a: a / k, sq_sum), n)
        extra = {} if recipe == "sgd" else {"microbatch_stats": stats}
        updates, s = tx.update(jax.tree.map(lambda g: g / k, grad_sum), s, p, **extra)
        return optax.apply_updates(p, updates), s, values.mean()

    shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), params, p_sh)
    state_shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, s_sh)
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(step, out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())))
            .lower(shapes, state_shapes, x, x)
            .compile()
        )
    return compiled, {dev.id: i for i, row in enumerate(mesh.devices) for dev in row}


def stacked_model(d: int, layers: int):
    """``layers`` residual tanh layers ``d → d`` stacked on a leading axis, applied by ``lax.scan`` under remat."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    kw, kb = jax.random.split(jax.random.key(0))
    params = {
        "layers": {"w": jax.random.normal(kw, (layers, d, d)) / d**0.5, "b": jax.random.normal(kb, (layers, d)) * 0.1},
        "scale": jnp.ones(d),
    }

    def loss(p, x, y):
        def layer(h, lp):
            return h + jnp.tanh(h @ lp["w"] + lp["b"]), None

        h, _ = lax.scan(jax.checkpoint(layer), x, p["layers"])
        return jnp.mean((h * p["scale"] - y) ** 2)

    return params, loss


def stacked_specs():
    """FSDP over all 8 devices ("data"): the stacked leaves split on a non-leading dimension."""
    from jax.sharding import PartitionSpec as P

    return {"layers": {"w": P(None, "data", None), "b": P(None, "data")}, "scale": P("data")}


def compile_stacked(*, d: int, layers: int, rows: int):
    """The drop-in step and ``jax.value_and_grad`` + SGD for the stacked model, FSDP over 8 devices."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, loss = stacked_model(d, layers)
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), stacked_specs())
    x = jax.ShapeDtypeStruct((rows, d), np.float32, sharding=NamedSharding(mesh, P("data")))
    grad_fn = optax_adascale.value_and_grad(loss, data_axes="data")
    compiled = []
    for tx, ours in ((optax_adascale.adascale_sgd(0.1, momentum=0.9), True), (optax.sgd(0.1, momentum=0.9), False)):
        state = jax.eval_shape(tx.init, params)
        s_sh = _state_shardings(state, params, p_sh, mesh)

        def step(p, s, x, y, tx=tx, ours=ours):
            if ours:
                value, grads, stats = grad_fn(p, x, y)
                updates, s = tx.update(grads, s, p, microbatch_stats=stats)
            else:
                value, grads = jax.value_and_grad(loss)(p, x, y)
                updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), params, p_sh)
        state_shapes = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), state, s_sh)
        jitted = jax.jit(step, out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())))
        with jax.set_mesh(mesh):
            compiled.append(jitted.lower(shapes, state_shapes, x, x).compile())
    return (*compiled, {dev.id: i for i, dev in enumerate(mesh.devices)})


def measure_stacked(*, d: int = 512, layers: int = 8, rows: int = 4096) -> dict:
    ours, base, data_of = compile_stacked(d=d, layers=layers, rows=rows)
    o, b = facts(ours, data_of), facts(base, data_of)
    return {
        "layout": "stacked FSDP",
        "k": 1,
        "shape": f"{layers} × {d}→{d} scanned, remat, {rows} rows",
        "drop_in": o,
        "sgd": b,
        "memory_ratio": o["memory"] / b["memory"],
    }


def measure(
    *, d: int, h: int, rows: int, ks=(1, 2), layouts=LAYOUTS, explicit: bool = False, explicit_loss: bool = False
) -> list[dict]:
    results = []
    for k in ks:
        for layout in layouts:
            ours, base, data_of = compile_steps(
                layout, d=d, h=h, rows=rows, k=k, explicit=explicit, explicit_loss=explicit_loss
            )
            o, b = facts(ours, data_of), facts(base, data_of)
            results.append(
                {
                    "layout": layout,
                    "k": k,
                    "shape": f"{d}→{h}→{d}, {rows} rows",
                    "drop_in": o,
                    "sgd": b,
                    "memory_ratio": o["memory"] / b["memory"],
                }
            )
    return results


def measure_loops(*, d: int, h: int, rows: int, k: int = 2, layouts=LAYOUTS) -> list[dict]:
    """A hand-written micro-batch loop (three recipes) against the drop-in's ``num_microbatches=k``."""
    results = []
    for layout in layouts:
        row = {"layout": layout, "k": k}
        for recipe in ("sgd", "naive", "drop_in"):
            compiled, data_of = compile_own_loop(recipe, layout, d=d, h=h, rows=rows, k=k)
            row[recipe] = facts(compiled, data_of)
        ours, _, data_of = compile_steps(layout, d=d, h=h, rows=rows, k=k)
        row["num_microbatches"] = facts(ours, data_of)
        results.append(row)
    return results


def loop_table(results: list[dict]) -> str:
    names = {
        "sgd": "own loop + SGD",
        "naive": "own loop, ‖g_j‖² of global micro-batches",
        "drop_in": "own loop, drop-in per micro-batch",
        "num_microbatches": "drop-in, num_microbatches=k",
    }
    lines = ["| layout | " + " | ".join(names.values()) + " |", "|---" * (len(names) + 1) + "|"]
    for r in results:
        cells = [f"{r[key]['data_reductions_in_loop']} in loop, {r[key]['memory'] / 2**20:.2f} MiB" for key in names]
        lines.append(f"| {r['layout']} (k = {r['k']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    lines = [
        "| layout | k | gradient-sized bytes moved (drop-in / SGD) | extra scalar all-reduces "
        "| gradient reductions over data: all / in the loop | memory per device, MiB (drop-in / SGD) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, b = r["drop_in"], r["sgd"]
        lines.append(
            f"| {r['layout']} | {r['k']} | {o['gradient_bytes']:,} / {b['gradient_bytes']:,} "
            f"| {o['scalar_all_reduces'] - b['scalar_all_reduces']} "
            f"| {o['data_reductions']} / {o['data_reductions_in_loop']} "
            f"| {o['memory'] / 2**20:.2f} / {b['memory'] / 2**20:.2f} | {r['memory_ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="16 → 32 → 16, 64 rows")
    parser.add_argument("--shape", default="256,1024,8192", help="d,h,rows (default 256,1024,8192)")
    parser.add_argument("--ks", default="1,2", help="micro-batches per shard to measure")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--loops", action="store_true", help="also compare hand-written micro-batch loops")
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="the drop-in on an Explicit mesh (jax.make_mesh's default); SGD stays on Auto axes",
    )
    parser.add_argument(
        "--explicit-loss",
        action="store_true",
        help="the MLP written the Explicit way (out_sharding= naming the batch axis); both steps on an Explicit mesh",
    )
    parser.add_argument(
        "--stacked",
        action="store_true",
        help="only the stacked (scanned, remat) layers under FSDP: 8 × 512 → 512, 4096 rows",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if args.stacked:
        results = [measure_stacked()]
        print(f"jax {jax.__version__}, FSDP over 8 devices (Auto), {results[0]['shape']}")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    d, h, rows = (16, 32, 64) if args.smoke else (int(v) for v in args.shape.split(","))
    ks = tuple(int(v) for v in args.ks.split(","))
    layouts = tuple(args.layouts.split(","))
    results = measure(
        d=d, h=h, rows=rows, ks=ks, layouts=layouts, explicit=args.explicit, explicit_loss=args.explicit_loss
    )
    kind = "Explicit (drop-in) / Auto (SGD)" if args.explicit else "Auto"
    kind = "Explicit, loss written the Explicit way," if args.explicit_loss else kind
    print(f"jax {jax.__version__}, (data 4 × model 2) {kind} mesh, MLP {d}→{h}→{d}, {rows} rows")
    print(table(results))
    if args.loops:
        loops = measure_loops(d=d, h=h, rows=rows, layouts=tuple(args.layouts.split(",")))
        print("\nGradient reductions over the data axis inside the micro-batch loop, and memory per device:")
        print(loop_table(loops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
