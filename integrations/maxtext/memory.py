"""Per-device memory of MaxText 0.2.5's compiled train step, with and without the patch, on a parameter-dominated
decoder (issue 32): ``compiled.memory_analysis()`` of the ``jax.jit`` that MaxText builds (``jit_train_step``:
its in/out shardings, the state donated), argument + output + temp − alias bytes per device.

    python memory.py --mesh fsdp8 --shard-mode auto        # inside the MaxText venv (run.sh makes it)
    python memory.py --all                                 # every case of the README's table, one process each

The model: 8 layers, width 1024, MLP 4096 (gated: two 1024 × 4096 inputs and one 4096 × 1024 output), 8 heads
of 128, byte vocabulary (256), 256-token rows, one row per device, AdamW: 135 M float32 parameters (540 MB), so
parameters and optimizer state, not activations, fill a device. Only compiled, never run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # adascale_maxtext, imported by the patched train.py

MODEL = [
    "hardware=cpu",
    "skip_jax_distributed_system=true",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "base_emb_dim=1024",
    "base_mlp_dim=4096",
    "base_num_decoder_layers=8",
    "base_num_query_heads=8",
    "base_num_kv_heads=8",
    "head_dim=128",
    "vocab_size=256",
    "max_target_length=256",
    "per_device_batch_size=1",
]
MESHES = {
    "fsdp8": ["ici_fsdp_parallelism=8"],
    "d2f2t2": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
    "d2f4": ["ici_data_parallelism=2", "ici_fsdp_parallelism=4"],
    "f4t2": ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"],
}
MIB = 2**20
VARIANTS = ("maxtext", "adascale", "optimizer")
ALL = [
    ("fsdp8", "auto"),
    ("fsdp8", "explicit"),
    ("d2f2t2", "auto"),
    ("d2f2t2", "explicit"),
    ("d2f4", "auto"),
    ("f4t2", "auto"),
]


def measure(mesh_name: str, shard_mode: str, extra: list[str]) -> dict:
    import adascale_maxtext
    import jax
    import maxtext
    import numpy as np
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    argv = [sys.argv[0], base, "run_name=memory", "base_output_directory=/tmp/maxtext_memory", "steps=1"]
    config, recorder = train.initialize(argv + MODEL + MESHES[mesh_name] + [f"shard_mode={shard_mode}"] + extra)
    out = {"mesh": mesh_name, "shard_mode": shard_mode, "extra": extra}
    for variant in VARIANTS:
        if variant != "maxtext":
            adascale_maxtext.use_adascale()
        adascale_maxtext.ON = variant == "adascale"  # "optimizer": AdaScale's optimizer, MaxText's own gradient
        (_, _, state_mesh_shardings, _, mesh, _, _, data_loader, _, _, state) = train_utils.setup_train_loop(
            config, recorder
        )
        graphdef, state = nnx.split(state)
        params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
            config, state_mesh_shardings
        )
        p_train_step, _ = train_utils.jit_train_and_eval_step(
            config, graphdef, mesh, state, state_mesh_shardings, train.train_step, None, None, params_shardings
        )
        rows, length = config.global_batch_size_to_load, config.max_target_length
        keys = ("inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position")
        spec = jax.ShapeDtypeStruct((rows, length), np.int32, sharding=data_loader.input_data_shardings)
        batch = {k: spec for k in (*keys, "targets_segmentation")}
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            compiled = p_train_step.lower(state, batch).compile()
        m = compiled.memory_analysis()
        params = nnx.state(nnx.merge(graphdef, state).model, nnx.Param)
        leaves = jax.tree.leaves(params)
        per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
        out[variant] = {
            "argument": m.argument_size_in_bytes,
            "output": m.output_size_in_bytes,
            "temp": m.temp_size_in_bytes,
            "alias": m.alias_size_in_bytes,
            "total": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes,
        }
        out["param_bytes"] = sum(x.nbytes for x in leaves)
        out["param_bytes_per_device"] = per_device
        out["param_count"] = sum(x.size for x in leaves)
        out["mesh_shape"] = {k: v for k, v in mesh.shape.items() if v > 1}
        out["axis_types"] = sorted({str(t) for t in mesh.axis_types})
        del state, compiled
    if "adascale" in out and "maxtext" in out:
        out["ratio"] = out["adascale"]["total"] / out["maxtext"]["total"]
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| mesh | shard_mode | MaxText | AdaScale's optimizer, MaxText's gradient | the patch (AdaScale, drop-in) | "
        "ratio: patch / MaxText | patch / AdaScale's optimizer | temp: MaxText / optimizer / patch |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        a, o, b = r["maxtext"], r["optimizer"], r["adascale"]
        lines.append(
            f"| {' × '.join(f'{k} {v}' for k, v in r['mesh_shape'].items())} | {r['shard_mode']} | "
            f"{a['total'] / MIB:.1f} MiB | {o['total'] / MIB:.1f} MiB | {b['total'] / MIB:.1f} MiB | "
            f"{b['total'] / a['total']:.3f} | {b['total'] / o['total']:.3f} | "
            f"{a['temp'] / MIB:.1f} / {o['temp'] / MIB:.1f} / {b['temp'] / MIB:.1f} MiB |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", choices=sorted(MESHES), default="fsdp8")
    parser.add_argument("--shard-mode", choices=("auto", "explicit"), default="auto")
    parser.add_argument("--all", action="store_true", help="every mesh × shard_mode, one process each")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="more MaxText key=value overrides")
    args = parser.parse_args()
    if not args.all:
        row = measure(args.mesh, args.shard_mode, args.overrides)
        text = json.dumps(row)
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    rows = []
    for mesh_name, mode in ALL:
        out = Path(f"/tmp/maxtext_memory_{mesh_name}_{mode}.json")
        cmd = [sys.executable, __file__, "--mesh", mesh_name, "--shard-mode", mode, "--out", str(out)]
        subprocess.run([*cmd, "--", *args.overrides], check=True, capture_output=True)
        rows.append(json.loads(out.read_text()))
        print(json.dumps(rows[-1]), flush=True)
    (args.out or HERE / "memory.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
