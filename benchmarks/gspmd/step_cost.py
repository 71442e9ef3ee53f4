"""The drop-in's compiled step against the user's own: ``compiled.cost_analysis()`` flops and bytes accessed per
device, every loop unrolled (``cost.step_cost``), on the MLPs, the scanned LM and the parameter-dominated stack,
replicated, FSDP and TP × FSDP, k = 1 and 2. Gate: the drop-in ≤ 1.02 × the user's own step (``same-opt``: the
user's ``jax.value_and_grad`` on the same shardings, the same ``adascale_sgd`` fed the gradient); the ratio to
``optax.sgd``'s step is printed beside it, and what the drop-in adds in units of one pass over each device's
gradient (``passes``: extra bytes ÷ the bytes of the per-device unreduced gradient, extra flops ÷ 2 per element).

    python -m benchmarks.gspmd.step_cost              # the test sizes of tests/gspmd/test_cost.py
    python -m benchmarks.gspmd.step_cost --size bench # the study's sizes (benchmarks/gspmd/__main__.py)
    python -m benchmarks.gspmd.step_cost --models stack --ks 1 --rows 512   # what changes with the rows

The output of this round, per JAX, is in step_cost.txt.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from benchmarks.gspmd import cost, models  # noqa: E402

SIZES = {
    "test": {
        "mlp_xent": {"d": 64, "h": 256, "rows": 1024},
        "lm": {"d": 64, "h": 128, "layers": 2, "seq": 32, "rows": 32},
        "stack": {"d": 128, "h": 256, "layers": 4, "rows": 32},
    },
    "bench": {
        "mlp_xent": {"d": 256, "h": 1024, "rows": 8192},
        "lm": {},
        "stack": {"d": 1024, "h": 1024, "layers": 8, "rows": 64, "gather": "einsum"},
    },
}


def gradient_elements(model: models.Model, mesh) -> int:
    """Elements of one device's unreduced gradient: every leaf, split only over the axes other than ``data`` (the
    per-copy partial is whole along the data axes)."""
    total = 0
    for name, x in model.params.items():
        split = 1
        for entry in model.specs[name]:
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                split *= mesh.shape[axis] if axis != "data" else 1
        total += x.size // split
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--models", nargs="+", default=["mlp_xent", "lm", "stack"])
    parser.add_argument("--layouts", nargs="+", default=["replicated", "FSDP", "TP×FSDP"])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 2], help="micro-batches per step")
    parser.add_argument("--rows", type=int, default=None, help="the batch's rows, in place of the size's")
    args = parser.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rows = f", rows {args.rows}" if args.rows else ""
    print(f"JAX {jax.__version__}, sizes: {args.size}{rows}; ratios drop-in / user's own step (same-opt), [/ sgd]")
    print(f"{'model':9s} {'layout':10s} k  {'flops':>16s}  {'bytes accessed':>16s}  passes (flops, bytes)  gates")
    failed = 0
    for name in args.models:
        for layout in args.layouts:
            for k in args.ks:
                sizes = {**SIZES[args.size][name], **({"rows": args.rows} if args.rows else {})}
                model = models.build(name, layout, unroll=True, **sizes)
                c = cost.step_cost(model, k, mesh=mesh)
                ours, same, sgd = c["drop-in"], c["same-opt"], c["sgd"]
                g = cost.step_cost_gates(c)
                failed += not all(g.values())
                ratios = "  ".join(
                    f"{ours[m] / same[m]:.4f} [{ours[m] / sgd[m]:.3f}]" for m in ("flops", "bytes_accessed")
                )
                verdict = "pass" if all(g.values()) else "FAIL " + ", ".join(m for m, ok in g.items() if not ok)
                elements = gradient_elements(model, mesh)
                passes = (
                    f"{(ours['flops'] - same['flops']) / (2 * elements):+.2f}, "
                    f"{(ours['bytes_accessed'] - same['bytes_accessed']) / (4 * elements):+.2f}"
                )
                print(f"{name:9s} {layout:10s} {k}  {ratios}  {passes:>21s}  {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
