"""The drop-in's cost gates from compiled HLO (``benchmarks/gspmd``), on an MLP with a cross-entropy and a scanned
LM, k = 1 and 2, against the user's own step compiled the same way: gradient-sized collective bytes ≤ SGD's,
≤ 2 extra scalar all-reduces, memory ≤ 1.05× + 4 KiB (with and without ``out_shardings``), no host callbacks.
Compile and wall time are timers: they are gated in the committed study (``benchmarks/gspmd/README.md``)."""

import jax
import pytest

from benchmarks.gspmd import cost, models

pytestmark = pytest.mark.slow

CASES = [(name, layout, k) for name in ("mlp_xent", "lm") for layout in ("replicated", "TP×FSDP") for k in (1, 2)] + [
    ("mlp_mse", "FSDP", 1),
    ("lm", "FSDP", 2),
]


@pytest.mark.parametrize(("name", "layout", "k"), CASES)
def test_the_drop_in_costs_what_the_users_own_step_does(name, layout, k):
    # sizes where 4 KiB is ≤ 1 % of a device's memory, so the memory gate is the 1.05×
    sizes = (
        {"d": 64, "h": 128, "layers": 2, "seq": 32, "rows": 32} if name == "lm" else {"d": 64, "h": 256, "rows": 1024}
    )
    row = cost.measure(models.build(name, layout, **sizes), k, mesh=jax.make_mesh((4, 2), ("data", "model")), rounds=1)
    gates = cost.gates(row)
    gates.pop("compile")
    facts = {v: {m: row[v][m] for m in ("gradient_bytes", "scalar_all_reduces", "memory")} for v in cost.VARIANTS}
    assert all(gates.values()), (gates, facts)
    assert row["sgd"]["memory"] > 100 * 4096
    if k > 1:  # the partials accumulate unreduced: no data-axis reduction inside the micro-batch loop but FSDP's
        assert row["drop-in"]["data_reductions_in_loops"] <= row["sgd"]["data_reductions_in_loops"]
