"""The drop-in's HLO cost gates on the parameter-dominated scanned stack (8 × 512² weights, 32 rows), every way a loss
meets a sharded weight (einsum, jax.reshard per layer, Auto with param_specs), FSDP and TP × FSDP, k = 1 and 2.

    python -m benchmarks.gspmd.stack_gates    # on each CI JAX; the output of this round is in stack_gates.txt
    python -m benchmarks.gspmd.stack_gates --adascale-clock tau    # adascale_sgd's default (the guarded τ clock)

AdaScale runs on the update clock by default here (optax.sgd's arithmetic: the ratio is the drop-in's own cost);
``--adascale-clock tau`` measures what a user of ``adascale_sgd``'s default pays against ``optax.sgd``.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)
import numpy as np  # noqa: E402

from benchmarks.gspmd import cost, models  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--adascale-clock", choices=("update", "tau"), default="update")
args = parser.parse_args()
SIZE = {"d": 512, "h": 512, "layers": 8, "rows": 32}  # parameter-dominated: 8 × 512² weights, 32 rows
explicit = jax.make_mesh((4, 2), ("data", "model"))
auto = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
print("JAX", jax.__version__, "| AdaScale's clock:", args.adascale_clock)
print(f"{'layout':8s} {'gather':8s} k  mem drop-in/user  ratio  grad bytes drop-in/user  +scalar AR  gates")
for layout in ("FSDP", "TP×FSDP"):
    for gather in ("einsum", "reshard", "auto"):
        for k in (1, 2):
            model = models.build("stack", layout, gather=gather, **SIZE)
            row = cost.measure(
                model, k, mesh=auto if model.auto else explicit, rounds=1, adascale_clock=args.adascale_clock
            )
            g = cost.gates(row)
            g.pop("compile")
            o, s = row["drop-in"], row["sgd"]
            mem = f"{o['memory'] / 2**20:6.2f}/{s['memory'] / 2**20:6.2f} MiB  {o['memory'] / s['memory']:.3f}"
            grad = f"{o['gradient_bytes'] / 1e6:6.2f}/{s['gradient_bytes'] / 1e6:6.2f} MB"
            extra = o["scalar_all_reduces"] - s["scalar_all_reduces"]
            verdict = "pass" if all(g.values()) else "FAIL " + str([n for n, v in g.items() if not v])
            print(f"{layout:8s} {gather:8s} {k}  {mem}  {grad}  {extra:+d}  {verdict}", flush=True)
