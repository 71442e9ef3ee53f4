"""The drop-in's cost gates from compiled HLO (``benchmarks/gspmd``), against the user's own step compiled the same
way: gradient-sized collective bytes ≤ SGD's, ≤ 2 extra scalar all-reduces, memory ≤ 1.05× + 4 KiB (with and
without ``out_shardings``), no host callbacks. On an MLP with a cross-entropy and a scanned LM (activations
dominate), and a parameter-dominated scanned stack (what FSDP is for), in the three ways a loss meets a sharded
weight: straight into ``einsum``, the user's ``jax.reshard`` per layer, and written for Auto axes with the
drop-in given ``param_specs``; k = 1 and 2. The compiled step's flops and bytes accessed (``cost_analysis()``, loops
unrolled) within 2 % of the user's own step's on the scanned LM (the MLPs and the stack at these sizes: the study,
``benchmarks/gspmd/step_cost.txt``). Compile time is a timer: it is gated in the committed study
(``benchmarks/gspmd/README.md``)."""

import jax
import numpy as np
import pytest

from benchmarks.gspmd import cost, models

pytestmark = pytest.mark.slow

# sizes where 4 KiB is ≤ 1 % of a device's memory, so the memory gate is the 1.05×
SIZES = {
    "lm": {"d": 64, "h": 128, "layers": 2, "seq": 32, "rows": 32},
    "mlp_xent": {"d": 64, "h": 256, "rows": 1024},
    "mlp_mse": {"d": 64, "h": 256, "rows": 1024},
    "stack": {"d": 128, "h": 256, "layers": 4, "rows": 32},
}
CASES = [
    (name, layout, "einsum", k) for name in ("mlp_xent", "lm") for layout in ("replicated", "TP×FSDP") for k in (1, 2)
]
CASES += [
    ("mlp_mse", "FSDP", "einsum", 1),
    ("lm", "FSDP", "einsum", 2),
    ("lm", "TP×FSDP", "reshard", 1),
    ("stack", "FSDP", "einsum", 1),
    ("stack", "FSDP", "reshard", 1),
    ("stack", "FSDP", "reshard", 2),
    ("stack", "FSDP", "auto", 2),
    ("stack", "TP×FSDP", "einsum", 2),
    ("stack", "TP×FSDP", "auto", 1),
    ("mlp_xent", "TP", "auto", 2),
]


def _mesh(auto: bool):
    if auto:  # MaxText's default: axes of kind Auto
        return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    return jax.make_mesh((4, 2), ("data", "model"))


@pytest.mark.parametrize(("name", "layout", "gather", "k"), CASES)
def test_the_drop_in_costs_what_the_users_own_step_does(name, layout, gather, k):
    model = models.build(name, layout, gather=gather, **SIZES[name])
    row = cost.measure(model, k, mesh=_mesh(model.auto), rounds=1)
    gates = cost.gates(row)
    gates.pop("compile")
    facts = {v: {m: row[v][m] for m in ("gradient_bytes", "scalar_all_reduces", "memory")} for v in cost.VARIANTS}
    assert all(gates.values()), (gates, facts)
    assert row["sgd"]["memory"] > 100 * 4096
    if k > 1:  # the partials accumulate unreduced: no data-axis reduction inside the micro-batch loop but FSDP's
        assert row["drop-in"]["data_reductions_in_loops"] <= row["sgd"]["data_reductions_in_loops"]


def test_the_drop_ins_compiled_step_costs_the_flops_and_bytes_of_the_users_own_on_the_scanned_lm():
    model = models.build("lm", "FSDP", unroll=True, **SIZES["lm"])
    c = cost.step_cost(model, 2, mesh=_mesh(False))
    assert all(v["loops"] == 0 for v in c.values()), c  # every loop unrolled: XLA counts each iteration
    assert all(cost.step_cost_gates(c).values()), {v: (c[v]["flops"], c[v]["bytes_accessed"]) for v in c}
