"""The overhead study (``python -m benchmarks.overhead``) runs in smoke mode, reports, and its compiled-HLO
gates hold (DESIGN §5)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUDY = [sys.executable, "-m", "benchmarks.overhead"]


def test_overhead_smoke_meets_the_hlo_gates_and_writes_the_report(tmp_path):
    out = tmp_path / "overhead.json"
    subprocess.run([*STUDY, "--smoke", "--out", str(out)], cwd=ROOT, check=True, timeout=600)
    rows = json.loads(out.read_text())["results"]
    assert {row["mode"] for row in rows} == {"shard_map", "pmap"}
    for row in rows:
        hlo = row["hlo"]
        # The same all-reduce count as SGD + pmean; none on accumulation-only calls; no host callbacks.
        assert hlo["adascale"]["all_reduce"] == hlo["sgd"]["all_reduce"] == 1
        assert hlo["acc4"]["all_reduce"] == 1 and hlo["acc4"]["all_reduce_every_call"] == 0
        assert all(h["host_callbacks"] == 0 for h in hlo.values())
        # One read pass more than the floor (the ‖ḡ‖² reduction), no extra writes; state = SGD's.
        assert hlo["adascale"]["largest_leaf_passes"]["reads"] == hlo["floor"]["largest_leaf_passes"]["reads"] + 1
        assert hlo["adascale"]["largest_leaf_passes"]["writes"] == hlo["floor"]["largest_leaf_passes"]["writes"]
        assert hlo["adascale"]["large_copies"] <= hlo["sgd"]["large_copies"]
        assert hlo["adascale"]["state_bytes"] - hlo["sgd"]["state_bytes"] < 128  # O(1) scalars
        assert set(row["ratios"]) >= {"sgd", "floor", "floor_b", "adascale", "multi4", "acc4"}

    results = tmp_path / "README.md"
    subprocess.run([*STUDY, "--report", str(out), "--results", str(results)], cwd=ROOT, check=True)
    text = results.read_text()
    assert "<!-- overhead:start -->" in text and "| shard_map |" in text and "| pmap |" in text
