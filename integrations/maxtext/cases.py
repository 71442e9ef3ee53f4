"""Every case of the MaxText 0.2.5 trial, four runs each, the issue-33 checks, and the tables in README.md.

Per case: (1) ``--check`` in float32 for 3 steps: our gradient against MaxText's own ``jax.value_and_grad`` of
the same loss (with accumulation, its own accumulation: micro-batches of rows ``j, j + k, …``, NNX's ``rest``
threaded, Σ over micro-batches / Σ tokens) inside the same step; (2) AdaScale, MaxText's default bfloat16, until
τ ≥ T; (3) MaxText unmodified for T iterations, its held-out loss read also at AdaScale's iteration count; (4)
MaxText at the base batch (one sample's rows). MaxText's gradient clipping (``gradient_clipping_threshold=1.0``)
stays on in all. ``CHECKS``: the check alone, for issue 33's failure cases.

    python cases.py [--steps 80] [--only NAME ...]     # inside the MaxText venv (run.sh makes it)
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FSDP8 = ["ici_fsdp_parallelism=8"]
# float32: in MaxText's default bfloat16 its own step fails with the qwix adapters in the scanned decoder
# ("scan body function carry input and carry output must have equal types": bfloat16[8,1,64] in, float32 out)
LORA = ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8", "dtype=float32"]
CASES = {
    "default: auto, scan, fsdp 8": (["shard_mode=auto", "scan_layers=true", *FSDP8], []),
    "auto, no scan": (["shard_mode=auto", "scan_layers=false", *FSDP8], []),
    "explicit, scan": (["shard_mode=explicit", "scan_layers=true", *FSDP8], []),
    "explicit, no scan": (["shard_mode=explicit", "scan_layers=false", *FSDP8], []),
    "auto, data 2 × fsdp 4": (["shard_mode=auto", "ici_data_parallelism=2", "ici_fsdp_parallelism=4"], []),
    "explicit, data 2 × fsdp 4": (["shard_mode=explicit", "ici_data_parallelism=2", "ici_fsdp_parallelism=4"], []),
    "auto, data 8": (["shard_mode=auto", "ici_data_parallelism=8", "ici_fsdp_parallelism=1"], []),
    "explicit, data 8": (["shard_mode=explicit", "ici_data_parallelism=8", "ici_fsdp_parallelism=1"], []),
    "auto, accumulation 2": (["shard_mode=auto", *FSDP8, "gradient_accumulation_steps=2"], []),
    # MaxText's Tunix accumulation: the loss is then each micro-batch's mean (xent_sum / W_j), the gradient their mean
    "auto, accumulation 2, tunix": (
        ["shard_mode=auto", *FSDP8, "gradient_accumulation_steps=2", "use_tunix_gradient_accumulation=true"],
        [],
    ),
    "explicit, accumulation 2": (["shard_mode=explicit", *FSDP8, "gradient_accumulation_steps=2"], []),
    "auto, unequal tokens": (["shard_mode=auto", *FSDP8], ["--unequal"]),
    "explicit, unequal tokens": (["shard_mode=explicit", *FSDP8], ["--unequal"]),
    "explicit, accumulation 2, unequal tokens": (
        ["shard_mode=explicit", *FSDP8, "gradient_accumulation_steps=2"],
        ["--unequal"],
    ),
    "auto, dropout 0.1": (["shard_mode=auto", *FSDP8, "dropout_rate=0.1"], []),
    "explicit, dropout 0.1": (["shard_mode=explicit", *FSDP8, "dropout_rate=0.1"], []),
    # Mixtral-style MoE, dense dispatch (no megablox/ragged kernels on CPU), GShard capacity with token dropping, the
    # load-balancing loss on. Auto only: MaxText 0.2.5's own step fails on an Explicit mesh with these MoE layers.
    "auto, MoE 4 experts top-2, dense, capacity 1.25": (
        [
            "shard_mode=auto",
            *FSDP8,
            "decoder_block=mixtral",
            "num_experts=4",
            "num_experts_per_tok=2",
            "base_moe_mlp_dim=128",
            "sparse_matmul=false",
            "megablox=false",
            "capacity_factor=1.25",
            "load_balance_loss_weight=0.01",
        ],
        [],
    ),
    # LoRA adapters (rank 4) on every attention and MLP kernel, as MaxText's SFT trainer adds them (trial.py --lora):
    # train_step then trains nnx.LoRAParam alone, the frozen base weights ride in NNX's rest (state_argnum=2)
    "auto, LoRA rank 4": (["shard_mode=auto", *FSDP8, *LORA], ["--lora"]),
    "explicit, LoRA rank 4": (["shard_mode=explicit", *FSDP8, *LORA], ["--lora"]),
}
# Issue 33's failures, the gradient check alone (float32, 3 steps): the drop-in on a lambda closing over NNX's rest
# (--closure, as the reviewer called it) and the patch's state_argnum=2, with accumulation and dropout keys
# of MaxText's unsafe_rbg and of threefry.
CHECKS = {
    "closure, auto, accumulation 2": (["shard_mode=auto", *FSDP8, "gradient_accumulation_steps=2"], ["--closure"]),
    "closure, auto, dropout 0.1 (unsafe_rbg)": (["shard_mode=auto", *FSDP8, "dropout_rate=0.1"], ["--closure"]),
    "closure, auto, dropout 0.1 (threefry)": (
        ["shard_mode=auto", *FSDP8, "dropout_rate=0.1"],
        ["--closure", "--prng", "threefry2x32"],
    ),
    "closure, auto, accumulation 2, dropout 0.1": (
        ["shard_mode=auto", *FSDP8, "gradient_accumulation_steps=2", "dropout_rate=0.1"],
        ["--closure"],
    ),
    "patch, auto, dropout 0.1 (threefry)": (
        ["shard_mode=auto", *FSDP8, "dropout_rate=0.1"],
        ["--prng", "threefry2x32"],
    ),
    "patch, explicit, dropout 0.1 (threefry)": (
        ["shard_mode=explicit", *FSDP8, "dropout_rate=0.1"],
        ["--prng", "threefry2x32"],
    ),
    "patch, auto, accumulation 2, dropout 0.1": (
        ["shard_mode=auto", *FSDP8, "gradient_accumulation_steps=2", "dropout_rate=0.1"],
        [],
    ),
    "patch, explicit, accumulation 2, dropout 0.1": (
        ["shard_mode=explicit", *FSDP8, "gradient_accumulation_steps=2", "dropout_rate=0.1"],
        [],
    ),
}


def trial(mode: str, steps: int, out: Path, overrides, flags, extra=()) -> dict:
    if out.exists() and not FRESH:  # a run made before with the same command (runs/ is a cache)
        record = json.loads(out.read_text())
        if record.get("command") == [mode, steps, list(overrides), list(flags), list(extra)]:
            return record
    cmd = [sys.executable, str(HERE / "trial.py"), "--mode", mode, "--steps", str(steps), "--out", str(out)]
    cmd += [*flags, *extra, "--", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=HERE)
    if proc.returncode:
        lines = [line for line in proc.stderr.splitlines() if "[DECOUPLED NO-OP]" not in line]  # MaxText's stubs
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {lines[-5:]}")
    record = json.loads(out.read_text())
    record["command"] = [mode, steps, list(overrides), list(flags), list(extra)]
    out.write_text(json.dumps(record))
    return record


FRESH = False


def run_case(name: str, steps: int, runs: Path) -> dict:
    overrides, flags = CASES[name]
    stem = "".join(c if c.isalnum() else "_" for c in name)
    check = trial("adascale", 3, runs / f"{stem}_check.json", [*overrides, "dtype=float32"], flags, ["--check"])
    ada = trial("adascale", steps, runs / f"{stem}_adascale.json", overrides, flags)
    ref = trial(
        "maxtext", steps, runs / f"{stem}_maxtext.json", overrides, flags, ["--eval-at", str(ada["iterations"])]
    )
    # AdaScale's promise: the quality of the base batch (one sample's rows: the global batch / n) after T steps
    # (shard_mode=auto: MaxText's fractional per-device batch slices the loaded rows, which Explicit types refuse;
    # the model and its initialisation are the same)
    base_overrides = [
        "shard_mode=auto" if o.startswith("shard_mode") else o
        for o in overrides
        if not o.startswith("gradient_accumulation_steps")
    ]
    base = trial("maxtext", steps, runs / f"{stem}_base.json", [*base_overrides, "per_device_batch_size=0.25"], flags)
    step_time = lambda r: float(np.median(r["step_s"][2:]))  # noqa: E731 - past compilation
    return {
        "case": name,
        "grad_rel_error_step1_f32": check["checks"][0]["grad_rel_error"],
        "grad_rel_error_max_f32": max(c["grad_rel_error"] for c in check["checks"]),
        "iterations": ada["iterations"],
        "maxtext_iterations": ref["iterations"],
        "tau": ada["tau"][-1],
        "gain_mean": float(np.mean(ada["gain"])),
        "gain_last": ada["gain"][-1],
        "loss_adascale": ada["eval"]["end"],
        "loss_maxtext_equal_tau": ref["eval"]["end"],
        "loss_maxtext_equal_iterations": ref["eval"][f"it={ada['iterations']}"],
        "loss_maxtext_base_batch": base["eval"]["end"],
        "step_time_ratio": step_time(ada) / step_time(ref),
        "total_weights_logged": ada["total_weights_logged"],
        "total_weights_true": ada["total_weights_true"],
        "mesh": {k: v for k, v in ada["mesh"].items() if v > 1},
        "axis_types": sorted(set(ada["axis_types"])),
    }


def check_case(name: str, runs: Path) -> dict:
    overrides, flags = CHECKS[name]
    stem = "".join(c if c.isalnum() else "_" for c in name)
    try:
        check = trial("adascale", 3, runs / f"{stem}_check.json", [*overrides, "dtype=float32"], flags, ["--check"])
    except RuntimeError as err:
        return {"case": name, "error": str(err).split(" failed: ")[-1]}
    c = check["checks"]
    return {
        "case": name,
        "grad_rel_error_max_f32": max(x["grad_rel_error"] for x in c),
        "grad_rel_error_blocks_max_f32": max(
            (x["grad_rel_error_blocks"] for x in c if "grad_rel_error_blocks" in x), default=None
        ),
        "rest_equal": all(x["rest_equal"] for x in c),
        "steps": len(c),
    }


def check_table(rows) -> str:
    lines = [
        "| case | gradient vs MaxText's own (max over steps, float32) | vs the same sum over the drop-in's "
        "micro-batches | NNX rest (RNG counters) after the step = MaxText's |",
        "|---|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} | | |")
            continue
        blocks = r["grad_rel_error_blocks_max_f32"]
        lines.append(
            f"| {r['case']} | {r['grad_rel_error_max_f32']:.1e} | {'—' if blocks is None else f'{blocks:.1e}'} | "
            f"{'yes' if r['rest_equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def table(rows, steps: int) -> str:
    lines = [
        "| case | gradient vs MaxText's, step 1 (float32) | iterations (MaxText: T) | τ | mean gain | held-out "
        "loss: AdaScale / MaxText, base batch, T steps / MaxText, global batch, T steps (equal τ) / MaxText, "
        "global batch, AdaScale's iterations | step time ÷ MaxText's | total_weights logged = true |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['grad_rel_error_step1_f32']:.1e} | {r['iterations']} ({r['maxtext_iterations']}) | "
            f"{r['tau']:.0f} | {r['gain_mean']:.2f} | {r['loss_adascale']:.3f} / {r['loss_maxtext_base_batch']:.3f} / "
            f"{r['loss_maxtext_equal_tau']:.3f} / "
            f"{r['loss_maxtext_equal_iterations']:.3f} | {r['step_time_ratio']:.2f} | "
            f"{'yes' if r['total_weights_logged'] == r['total_weights_true'] else 'NO'} "
            f"({r['total_weights_logged']:.0f}) |"
        )
    return "\n".join(lines)


# The batch ramp (issue 34), on the default case: the same endpoints, 8 → 64 rows (1 → 8 per device), fed one stream
# of training windows in order through MaxText's data loader; the held-out loss on the same 4 × 64 windows.
RAMP_MESH = ["shard_mode=auto", "scan_layers=true", *FSDP8]
RAMP_K = 8  # max micro-batches: MaxText's per_device_batch_size / per_device_batch_size_start
RAMP_FLAGS = ["--stream", "--eval-rows", "64"]
MAXTEXT_RAMP = [
    "per_device_batch_size=8",
    "enable_rampup_batch_size=true",
    "per_device_batch_size_start=1",
    "per_device_batch_size_increment=1",
]


def maxtext_ramp_steps(examples: int, samples: int) -> int:
    """MaxText's steps to train on ``examples`` rows under its own ramp over ``samples`` (``RampupBatchManager``:
    ``global_batch_size_current`` per step, 8 → 64 rows in steps of 8)."""
    from types import SimpleNamespace

    from maxtext.utils.rampup_batch import RampupBatchManager

    config = SimpleNamespace(
        per_device_batch_size=8,
        per_device_batch_size_start=1,
        per_device_batch_size_increment=1,
        global_rampup_samples=samples,
        num_target_devices=8,
    )
    manager, fed, steps = RampupBatchManager(config, -1), 0, 0
    while fed < examples:
        fed += manager.global_batch_size_current
        manager.update()
        steps += 1
    return steps


def ramp_rows(steps: int, runs: Path) -> list[dict]:
    """Every arm of the ramp table: AdaScale's measured ramp, MaxText's linear rule in our mechanism, MaxText's own
    ``enable_rampup_batch_size`` at the measured ramp's examples (ramp lengths ¼, ½, ¾ of them), fixed S = 8 and
    S = 64 with AdaScale, and MaxText's own patched ``train_loop`` on the measured ramp and on its own."""
    micro = [*RAMP_MESH, "per_device_batch_size=1"]
    ramp = ["--ramp", str(RAMP_K)]
    out = []

    def row(name, record, kind):
        out.append({"arm": name, "kind": kind, **{k: v for k, v in record.items() if k not in BULKY}})
        if record.get("updates_log"):  # the ramp's micro-batches per update, run-length: [[k, updates], ...]
            calls = [u[0] for u in record["updates_log"]]
            ks = [b - a for a, b in zip([0, *calls], calls)]
            out[-1]["k_runs"] = [[k, len(list(g))] for k, g in itertools.groupby(ks)]
        print(json.dumps(out[-1]), flush=True)

    measured = trial("adascale", steps, runs / "ramp_measured.json", micro, RAMP_FLAGS, ramp)
    row("AdaScale, measured ramp: BatchRamp(1, 8)", measured, "adascale")
    examples = measured["examples"]
    half = examples // 2
    linear = trial("adascale", steps, runs / "ramp_linear.json", micro, RAMP_FLAGS, [*ramp, "--ramp-linear", str(half)])
    row(f"AdaScale, MaxText's linear rule over {half} examples: BatchRamp(1, 8, policy=...)", linear, "adascale")
    for samples in (examples // 4, half, 3 * examples // 4):
        n = maxtext_ramp_steps(examples, samples)
        own = trial(
            "maxtext",
            n,
            runs / f"ramp_maxtext_{samples}.json",
            [*RAMP_MESH, *MAXTEXT_RAMP, f"global_rampup_samples={samples}"],
            RAMP_FLAGS,
        )
        row(f"MaxText's own ramp over {samples} examples (enable_rampup_batch_size), {n} steps", own, "maxtext")
    fixed_small = trial("adascale", steps, runs / "ramp_fixed_8.json", micro, RAMP_FLAGS)
    row("AdaScale, fixed S = 8 (S_min)", fixed_small, "adascale")
    # τ counts base batches of one device's rows: 8 rows here, so T / 8 is the same work in rows as the others' T
    fixed_large = trial(
        "adascale", steps // RAMP_K, runs / "ramp_fixed_64.json", [*RAMP_MESH, "per_device_batch_size=8"], RAMP_FLAGS
    )
    row(
        f"AdaScale, fixed S = 64 (S_max), T = {steps // RAMP_K} (base batch 8 rows: T × 8 = {steps} rows of work)",
        fixed_large,
        "adascale",
    )
    loop = trial("adascale", steps, runs / "ramp_measured_train_loop.json", micro, RAMP_FLAGS, [*ramp, "--train-loop"])
    row("AdaScale, measured ramp, in MaxText's own patched train_loop", loop, "train_loop")
    n = maxtext_ramp_steps(examples, half)
    own_loop = trial(
        "maxtext",
        n,
        runs / "ramp_maxtext_train_loop.json",
        [*RAMP_MESH, *MAXTEXT_RAMP, f"global_rampup_samples={half}"],
        RAMP_FLAGS,
        ["--train-loop"],
    )
    row(f"MaxText's own ramp over {half} examples, in its own train_loop, {n} steps", own_loop, "train_loop")
    return out


BULKY = (
    "loss",
    "gain",
    "tau",
    "step_s",
    "rows",
    "updates_log",
    "mesh",
    "axis_types",
    "compile_names",
    "checks",
    "acc_grads_specs",
    "command",
)


def per_device_rows(record: dict) -> int:
    """The run's ``per_device_batch_size``: AdaScale's base batch is one device's rows (its scale counts them)."""
    return int([o for o in record["overrides"] if o.startswith("per_device_batch_size=")][-1].split("=")[1])


def ramp_table(rows: list[dict]) -> str:
    lines = [
        "| arm | optimizer steps | calls of the train step | examples (64-token rows) | held-out loss | "
        "train-step compiles | τ | S at the end (rows) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["kind"] == "train_loop":
            continue
        tau = f"{r['tau_end']:.0f}" if r["kind"] == "adascale" else "—"
        rows_end = r["scale_end"] * (per_device_rows(r) if r["kind"] == "adascale" else 1)  # AdaScale: in base batches
        lines.append(
            f"| {r['arm']} | {r['updates']} | {r['iterations']} | {r['examples']} | {r['eval']['end']:.3f} | "
            f"{r['train_step_compiles']} | {tau} | {rows_end:.0f} |"
        )
    loops = [r for r in rows if r["kind"] == "train_loop"]
    lines += [
        "",
        "| MaxText's own patched `train_loop` (same stream) | train-step compiles (its ahead-of-time compile "
        "included) | optimizer steps | calls of the train step | examples (64-token rows) | held-out loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in loops:
        lines.append(
            f"| {r['arm']} | {r['train_step_compiles']} | {r.get('updates', r['calls'])} | {r['calls']} | "
            f"{r['examples']} | {r['eval']['end']:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="T (MaxText's steps)")
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--fresh", action="store_true", help="re-run every trial (default: reuse runs/)")
    parser.add_argument(
        "--ramp", action="store_true", help="the batch-ramp table alone (results.json's ramp section; T = --steps)"
    )
    args = parser.parse_args()
    global FRESH
    FRESH = args.fresh
    runs = HERE / "runs"
    runs.mkdir(exist_ok=True)
    if args.ramp:
        rows = ramp_rows(args.steps, runs)
        results = json.loads(args.out.read_text()) if args.out.exists() else {}
        command = f"bash integrations/maxtext/run.sh --ramp --steps {args.steps}"
        results["ramp"] = {"T": args.steps, "command": command, "rows": rows}
        args.out.write_text(json.dumps(results, indent=1))
        print(ramp_table(rows))
        return 0
    rows = []
    failed = []
    for name in [n for n in args.only or CASES if n in CASES]:
        try:
            row = run_case(name, args.steps, runs)
        except RuntimeError as err:
            failed.append({"case": name, "error": str(err)})
            print(json.dumps(failed[-1]), flush=True)
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
    checks = [check_case(name, runs) for name in [n for n in args.only or CHECKS if n in CHECKS]]
    for row in checks:
        print(json.dumps(row), flush=True)
    ramp = json.loads(args.out.read_text()).get("ramp") if args.out.exists() else None  # --ramp's section, kept
    results = {"T": args.steps, "rows": rows, "failed": failed, "checks": checks}
    args.out.write_text(json.dumps({**results, **({"ramp": ramp} if ramp else {})}, indent=1))
    print(table(rows, args.steps))
    print(check_table(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
