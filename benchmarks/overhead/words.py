"""What does the update alone move? Bytes per parameter of each alias's compiled update, by XLA's cost model.

The update (gradient in, params and state out, donated) under ``shard_map`` over the CPU devices, on float32
parameters in three leaves; ``cost_analysis()["bytes accessed"]`` of the compiled program over 4 bytes per
parameter. A cost model's count, not a timing: compare rows with each other. Also counts the ``while`` loops in
the compiled update (the guard's stability limit is unrolled: none).

The gate (DESIGN §5, "the budget is the defaults'"): each alias's default moves at most ``GATE`` words per parameter
more than the same alias on ``clock="update"``, and holds no ``while``.

    python -m benchmarks.overhead.words                  # 1M parameters, prints the table
    python -m benchmarks.overhead.words --json out.json  # and writes it
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# Words per parameter a default may add to its update-clock twin: the guard's strided samples (512 to 1024 elements
# of three buffers per leaf) are 0.01 words at 1M parameters in three leaves.
GATE = 0.05


def _rows(n_params: int):
    import optax

    import optax_adascale

    lr = 0.1
    return [
        ("optax.sgd(momentum=0.9) + pmean", optax.sgd(lr, momentum=0.9), True),
        (
            "adascale_sgd, clock='update'",
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data", clock="update"),
            False,
        ),
        ("adascale_sgd, the default", optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data"), False),
        (
            "adascale_sgd, clock='update', delayed_gain",
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data", clock="update", delayed_gain=True),
            False,
        ),
        (
            "adascale_sgd, the default, delayed_gain",
            optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data", delayed_gain=True),
            False,
        ),
        ("optax.adamw + pmean", optax.adamw(1e-3), True),
        (
            "adascale_adamw, clock='update'",
            optax_adascale.adascale_adamw(1e-3, axis_name="data", clock="update"),
            False,
        ),
        ("adascale_adamw, the default", optax_adascale.adascale_adamw(1e-3, axis_name="data"), False),
    ]


def measure(n_params: int = 1 << 20) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    n_params = n_params // 4 * 4
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    params = {
        "a": jnp.ones((n_params // 2,), jnp.float32),
        "b": jnp.ones((n_params // 4,), jnp.float32),
        "c": jnp.ones((n_params // 4,), jnp.float32),
    }
    out = []
    for name, tx, pmean in _rows(n_params):
        state = tx.init(params)
        specs = jax.tree.map(lambda _: P(), state) if pmean else optax_adascale.state_partition_specs(state, "data")

        def step(p, s, g, tx=tx, pmean=pmean):
            g = jax.lax.pcast(g, "data", to="varying")
            if pmean:
                g = jax.lax.pmean(g, "data")
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        fn = jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs))
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, params).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        whiles = len(re.findall(r"\swhile\(", compiled.as_text()))
        out.append({"update": name, "words_per_param": cost["bytes accessed"] / 4 / n_params, "while_loops": whiles})
    return out


def gate(rows: list[dict]) -> list[str]:
    """The defaults' budget: a failure message per default that moves more than its update-clock twin + GATE."""
    by = {row["update"]: row for row in rows}
    failures = []
    for alias in ("adascale_sgd", "adascale_adamw"):
        for delayed in ("", ", delayed_gain"):
            default, update = by.get(f"{alias}, the default{delayed}"), by.get(f"{alias}, clock='update'{delayed}")
            if default is None or update is None:
                continue
            extra = default["words_per_param"] - update["words_per_param"]
            if extra > GATE:
                failures.append(f"{alias}{delayed}: the default moves {extra:.3f} words/param more than clock='update'")
            if default["while_loops"]:
                failures.append(f"{alias}{delayed}: the default's update holds {default['while_loops']} while loop(s)")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=float(1 << 20), help="parameters, in three leaves")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    import jax

    rows = measure(int(args.params))
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, {int(args.params)} params")
    print("| update | words per parameter | while loops |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['update']} | {row['words_per_param']:.2f} | {row['while_loops']} |")
    failures = gate(rows)
    for failure in failures:
        print("GATE FAILED:", failure)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "params": int(args.params), "rows": rows}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
