"""``delayed_gain=True`` against the exact (FairScale) gain on FairScale's golden scenarios.

FairScale's golden cases (``fair_dev/testing/golden_testing_data.py``): ``Linear(2, 2)``, a sum loss,
two samples per update as two vmap replicas, ``SGD(lr=0.1)``; each scenario runs two updates. The exact
mode's gain of update t uses this step's sample; the delayed mode's uses the averages through update
t − 1 (1 for the first update). The table reports both trajectories and the relative difference of the
last gain (the number FairScale checks). The quality side of the comparison (the scaling benchmark's
three tasks) is in the scaling study's README.md, method ``AS-delayed``.

    python -m benchmarks.delayed_fidelity     # prints the table and writes the "delayed" section of README.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.harness import report

SCENARIOS = [  # inputs of the two samples, per update (FairScale's golden_testing_data.py)
    [[[1.0, 0.0], [0.0, 1.0]]] * 2,
    [[[1.0, 1.0], [1.0, 1.0]]] * 2,
    [[[-1.0, 1.0], [1.0, -1.0]]] * 2,
    [[[1.0, 4.0], [5.0, 0.5]]] * 2,
    [[[-0.2, 3.0], [5.0, 0.5]]] * 2,
    [[[-0.2, 3.3], [5.2, 0.7]], [[1.0, 4.0], [3.1, 0.1]]],
]


def gains(scenario, delayed: bool) -> list[float]:
    import jax
    import jax.numpy as jnp

    import optax_adascale

    tx = optax_adascale.adascale_sgd(0.1, axis_name="replica", delayed_gain=delayed)
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}
    grad = jax.grad(lambda p, x: jnp.sum(x @ p["w"].T + p["b"]))
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="replica"))
    state, out = tx.init(params), []
    for inputs in scenario:
        samples = jax.vmap(grad, in_axes=(None, 0))(params, jnp.asarray(inputs)[:, None, :])
        _, state = step(samples, state, params)
        out.append(float(optax_adascale.metrics(state)["gain"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.delayed_fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("README.md"))
    args = parser.parse_args(argv)
    rows = [
        "| scenario (sample inputs) | exact gains | delayed gains | last gain, delayed vs exact |",
        "|---|---|---|---:|",
    ]
    for scenario in SCENARIOS:
        exact, delayed = gains(scenario, False), gains(scenario, True)
        inputs = " then ".join(str(u) for u in dict.fromkeys(map(str, scenario)))
        rows.append(
            f"| {inputs} | {', '.join(f'{g:.6f}' for g in exact)} | "
            f"{', '.join(f'{g:.6f}' for g in delayed)} | {100 * (delayed[-1] / exact[-1] - 1):+.1f} % |"
        )
    print("\n".join(rows))
    body = [
        "## Delayed gain: fidelity",
        "",
        "Command: `python -m benchmarks.delayed_fidelity`. FairScale's golden scenarios (two samples per update "
        "as two vmap replicas, two updates each): the exact gain of each update against `delayed_gain=True`, "
        "whose first update uses gain 1 and whose second uses the exact mode's first gain. The quality side "
        "(AS vs `AS-delayed` on the scaling benchmark's three tasks, 5 seeds) is in the "
        "[scaling study](../scaling/README.md)'s estimator tables.",
        "",
        report.kept_reading(args.results, "delayed"),
        "",
        *rows,
    ]
    print(f"wrote {report.write_section(args.results, 'delayed', chr(10).join(body))}")
    return 0
