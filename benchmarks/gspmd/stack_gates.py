"""The drop-in's HLO cost gates on the parameter-dominated scanned stack (8 × 512² weights, 32 rows), every way a loss
meets a sharded weight (einsum, jax.reshard per layer, Auto with param_specs), FSDP and TP × FSDP, k = 1 and 2.

    python -m benchmarks.gspmd.stack_gates    # on each CI JAX; the output of this round is in stack_gates.txt
    python -m benchmarks.gspmd.stack_gates --adascale-clock update    # optax.sgd's arithmetic: the drop-in alone

AdaScale is ``adascale_sgd(0.1, momentum=0.9)`` as a user gets it (the guarded τ clock: the budget is the
defaults', DESIGN §5); ``--adascale-clock update`` measures the drop-in's own cost on optax.sgd's arithmetic. The
gates printed are this round's (issue "the honest default at the old default's cost"): memory ≤ 1.005× the user's
step (with and without out_shardings), ≤ +1 scalar all-reduce at k = 1 and ≤ +2 at k = 2, gradient bytes ≤ the
user's, no host callbacks.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)
import numpy as np  # noqa: E402

from benchmarks.gspmd import cost, models  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--adascale-clock", choices=("default", "update"), default="default")
args = parser.parse_args()
SIZE = {"d": 512, "h": 512, "layers": 8, "rows": 32}  # parameter-dominated: 8 × 512² weights, 32 rows
explicit = jax.make_mesh((4, 2), ("data", "model"))
auto = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
clock = None if args.adascale_clock == "default" else args.adascale_clock
print("JAX", jax.__version__, "| AdaScale:", "adascale_sgd's default" if clock is None else f"clock={clock!r}")
print(f"{'layout':8s} {'gather':8s} k  mem drop-in/user  ratio  grad bytes drop-in/user  +scalar AR  gates")
for layout in ("FSDP", "TP×FSDP"):
    for gather in ("einsum", "reshard", "auto"):
        for k in (1, 2):
            model = models.build("stack", layout, gather=gather, **SIZE)
            row = cost.measure(model, k, mesh=auto if model.auto else explicit, rounds=1, adascale_clock=clock)
            g = cost.gates(row)
            g.pop("compile")
            o, s = row["drop-in"], row["sgd"]
            g["memory"] = o["memory"] <= 1.005 * s["memory"] + 4096
            g["memory_out_shardings"] = o["memory_out_shardings"] <= 1.005 * s["memory_out_shardings"] + 4096
            g["scalar_all_reduces"] = o["scalar_all_reduces"] - s["scalar_all_reduces"] <= k
            o, s = row["drop-in"], row["sgd"]
            mem = f"{o['memory'] / 2**20:6.2f}/{s['memory'] / 2**20:6.2f} MiB  {o['memory'] / s['memory']:.3f}"
            grad = f"{o['gradient_bytes'] / 1e6:6.2f}/{s['gradient_bytes'] / 1e6:6.2f} MB"
            extra = o["scalar_all_reduces"] - s["scalar_all_reduces"]
            verdict = "pass" if all(g.values()) else "FAIL " + str([n for n, v in g.items() if not v])
            print(f"{layout:8s} {gather:8s} {k}  {mem}  {grad}  {extra:+d}  {verdict}", flush=True)
