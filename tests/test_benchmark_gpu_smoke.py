"""The accelerator suite (``python -m benchmarks.gpu``) runs end to end on a CPU in smoke mode and reports.

A reduced run: every JAX case, only its baseline and the exact AdaScale variant, two rounds, no
torch/FairScale peer. No timing is asserted: only that every ratio is a finite positive number and
that the bandwidth model and the report are there.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = [sys.executable, "-m", "benchmarks.gpu"]
JAX_CASES = ("update", "lm", "lm_vmap", "cnn")


def _finite_ratios(row):
    assert row["ratios"], row
    for name, r in row["ratios"].items():
        for key in ("median", "min", "max"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, r)
        assert r["min"] <= r["median"] <= r["max"], (name, r)
    assert row["ratios"][row["baseline"]]["median"] == 1.0
    assert all(ms > 0 for ms in row["median_ms"].values())


def test_gpu_benchmark_smoke_runs_every_case_and_writes_the_report(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [*STUDY, "--smoke", "--no-peer", "--variants", "adascale", "--rounds", "2",
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    meta, cases = data["meta"], data["cases"]
    assert meta["backend"] == "cpu" and meta["device_kind"] and meta["jax"] and meta["date"] and meta["command"]
    assert not meta["errors"]
    assert set(cases) == {*JAX_CASES, "profile"}

    update = cases["update"]
    assert update["bytes_model"]["sgd_words_per_param"] == 5
    assert update["bytes_model"]["copy_words_per_element"] == 2
    assert len(update["rows"]) == 2
    for row in update["rows"]:
        _finite_ratios(row)
        assert {"sgd", "adascale", "copy"} <= set(row["ratios"])
        assert row["bytes_per_update"] == 5 * 4 * row["params"]
        assert row["copy_bytes"] == 2 * 4 * row["params"]
        for name in ("sgd", "adascale", "copy"):
            assert math.isfinite(row["achieved_GBps"][name]) and row["achieved_GBps"][name] > 0
            assert row["fraction_of_copy_bandwidth"][name] > 0
    for name in ("lm", "lm_vmap", "cnn"):
        _finite_ratios(cases[name])
        assert set(cases[name]["ratios"]) == {"sgd", "adascale"}
    assert cases["lm"]["tokens_per_step"] == cases["lm_vmap"]["tokens_per_step"]

    # The AdaScale update at the LM's shapes: the package's scopes show in the HLO, and it moves
    # more bytes than SGD's (the ‖ḡ‖² pass) but not twice as many.
    programs = cases["profile"]["programs"]
    assert programs["adascale"]["top"]
    assert {"adascale/scale_updates", "adascale/reduce"} <= set(programs["adascale"]["bytes_by_scope"])
    assert programs["sgd"]["total_bytes"] < programs["adascale"]["total_bytes"] < 2 * programs["sgd"]["total_bytes"]

    results = tmp_path / "README.md"
    subprocess.run([*STUDY, "--report", str(out), "--results", str(results)],
                   cwd=ROOT, check=True, timeout=120)
    text = results.read_text()
    assert "<!-- gpu:start -->" in text and "<!-- gpu:end -->" in text
    assert meta["device"] in text
    assert "CPU smoke numbers" in text and "no GPU was available" in text
    assert "Bandwidth model" in text and "FairScale" in text and "Top costs" in text
    assert "`python -m benchmarks.gpu --smoke --no-peer" in text  # the command, as a user types it
