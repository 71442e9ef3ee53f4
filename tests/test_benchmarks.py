"""Each benchmark study's smoke mode runs end to end in a fresh interpreter and writes its report (and plots).

* ``python -m benchmarks.scaling``: the report's tables and headings, the plots, nothing cached in smoke mode.
* ``python -m benchmarks.adam``: the Adam section (two task tables, every method at S = 4), the plots, the cache.
* ``python -m benchmarks.overhead``: the compiled-HLO gates of DESIGN §5 (one all-reduce, none on
  accumulation-only calls, one extra read pass, O(1) extra state) and the report.
* ``python -m benchmarks.gpu``: every JAX case on a CPU, finite positive ratios, the bandwidth model and the
  report. No timing is asserted.
* ``python -m benchmarks.estimator``: the tracking, summary and quality tables agree with each other.
* ``python -m benchmarks.large_batch`` and ``python -m benchmarks.adam.fair``: every ``+`` row ran exactly
  AdaScale's iterations at the same S, every other row ⌈T/S⌉, and the examples column is N·S/T.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def run_study(module: str, *args, timeout: int = 600) -> None:
    """``python -m benchmarks.<module> *args`` from the repository root on the CPU; fails with its output's tail."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# --------------------------------------------------------------------------- scaling

PLOTS_SCALING = (
    "scaling_curves.png",
    "scaling_lr.png",
    "scaling_gain.png",
    "scaling_elastic.png",
    "scaling_tracking.png",
)


@pytest.mark.study_smoke
def test_scaling_benchmark_smoke_writes_report_and_plots(tmp_path):
    run_study("scaling", "--smoke", "--out", tmp_path)

    report = (tmp_path / "README.md").read_text()
    for method in ("AS", "LSW+", "LSW"):
        assert f"| {method} val. accuracy (%) |" in report
    for heading in (
        "MNIST-1D MLP",
        "digits MLP",
        "noisy linear regression",
        "Elastic AdaScale",
        "Gain estimates",
        "A gain that keeps up",
        "Iterations at equal quality",
    ):
        assert heading in report
    assert "| `AS-fairscale` |" in report  # an estimator variant (the 0.1–0.2 default)
    for name in PLOTS_SCALING:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 0, name
        assert f"plots/{name}" in report
    assert "Command: `python -m benchmarks.scaling --smoke --out " in report
    assert not (tmp_path / ".cache").exists()  # smoke mode caches nothing


# --------------------------------------------------------------------------- adam

PLOTS_ADAM = ("adam_curves.png", "adam_gain.png", "adam_lr.png")
METHODS_ADAM = ("AS-a", "AS-b", "AS-c", "AS-c'", "sqrt", "LSW")


@pytest.mark.study_smoke
def test_adam_benchmark_smoke_writes_report_and_plots(tmp_path):
    results = tmp_path / "README.md"
    run_study("adam", "--smoke", "--cache", tmp_path / "cache", "--results", results)

    text = results.read_text()
    assert "<!-- adam:start -->" in text and "<!-- adam:end -->" in text
    assert "<!-- adam-reading:start -->" in text
    section = text[text.index("<!-- adam:start -->") : text.index("<!-- adam:end -->")]
    for heading in ("byte-level transformer LM", "MNIST-1D CNN", "Learning-rate sweep"):
        assert heading in section
    tables = section.split("### ")[2:4]  # the two task tables, in order
    for table in tables:
        rows = [line for line in table.splitlines() if line.startswith("| ")]
        assert any(row.startswith("| 1 | adamw | ") and "—" not in row for row in rows), table
        for method in METHODS_ADAM:
            assert any(row.startswith(f"| 4 | {method} | ") and "—" not in row for row in rows), (method, table)
    for name in PLOTS_ADAM:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 0, name
        assert f"plots/{name}" in section
    assert any((tmp_path / "cache").glob("lm_AS-cp_S4_seed0_*.json"))  # cells cached where --cache says


# --------------------------------------------------------------------------- overhead


def test_overhead_smoke_meets_the_hlo_gates_and_writes_the_report(tmp_path):
    out = tmp_path / "overhead.json"
    run_study("overhead", "--smoke", "--out", out)
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
    run_study("overhead", "--report", out, "--results", results)
    text = results.read_text()
    assert "<!-- overhead:start -->" in text and "| shard_map |" in text and "| pmap |" in text


# --------------------------------------------------------------------------- gpu

JAX_CASES = ("update", "lm", "lm_vmap", "cnn")


def _finite_ratios(row):
    assert row["ratios"], row
    for name, r in row["ratios"].items():
        for key in ("median", "min", "max"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, r)
        assert r["min"] <= r["median"] <= r["max"], (name, r)
    assert row["ratios"][row["baseline"]]["median"] == 1.0
    assert all(ms > 0 for ms in row["median_ms"].values())


@pytest.mark.study_smoke
def test_gpu_benchmark_smoke_runs_every_case_and_writes_the_report(tmp_path):
    out = tmp_path / "gpu.json"
    run_study("gpu", "--smoke", "--no-peer", "--variants", "adascale", "--rounds", "2", "--out", out)
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
    # more bytes than SGD's (the ‖ḡ‖² pass) but not twice as many, besides the stability guard's samples: at most
    # 2·SAMPLE_SIZE elements of each leaf's gradient, momentum and params, stacked (written and read once more),
    # a fixed cost that the smoke's 0.1M parameters feel (0.5 % of the budget) and a real model does not.
    from optax_adascale.core import _probe

    programs = cases["profile"]["programs"]
    assert programs["adascale"]["top"]
    # (the step's scaling fuses into the inner update, whose state is written in place under adascale/inner)
    assert {"adascale/inner", "adascale/reduce"} <= set(programs["adascale"]["bytes_by_scope"])
    samples = 3 * 3 * 4 * 2 * _probe.SAMPLE_SIZE * cases["lm"]["leaves"]
    sgd = programs["sgd"]["total_bytes"]
    assert sgd < programs["adascale"]["total_bytes"] < 2 * sgd + samples

    results = tmp_path / "README.md"
    run_study("gpu", "--report", out, "--results", results, timeout=120)
    text = results.read_text()
    assert "<!-- gpu:start -->" in text and "<!-- gpu:end -->" in text
    assert meta["device"] in text
    assert "CPU smoke numbers" in text and "no GPU was available" in text
    assert "Bandwidth model" in text and "FairScale" in text and "Top costs" in text
    assert "`python -m benchmarks.gpu --smoke --no-peer" in text  # the command, as a user types it


# --------------------------------------------------------------------------- estimator, large batch, fair Adam


def _table_rows(section: str, first_cell: str) -> list[list[str]]:
    """The cells of every Markdown table row of ``section`` whose first cell is ``first_cell``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()]
    return [r for r in rows if r and r[0] == first_cell]


# Not study_smoke: one of the four cheapest, run on every CI JAX (issue 40: 34-61 s each on JAX 0.12)
def test_estimator_smoke_tables_agree_with_each_other(tmp_path):
    run_study("estimator", "--smoke", "--out", tmp_path)
    text = (tmp_path / "README.md").read_text()
    for heading in ("### Tracking", "### Summary", "### Quality and iterations"):
        assert heading in text
    assert "not cached" in text and (tmp_path / "plots" / "estimator_tracking.png").stat().st_size > 0

    names = (
        'FairScale (`estimator="fairscale"`, the 0.1–0.2 default)',
        "memory 0.1·τ, unbiased_sqr",
    )  # the smoke's two
    tracking = {r[2]: r[3] for r in _table_rows(text, "regression")}
    summary = {r[0]: r for r in (_table_rows(text, n)[0] for n in names)}
    quality = text[text.index("**noisy linear regression**") :]
    iterations = {n: int(re.search(r", (\d+) it\.", _table_rows(quality, n)[0][2])[1]) for n in names}
    for name in names:
        # "bias / mean / max (per update) %": the mean error decides the ✓ and the summary's count and mean.
        error = int(re.fullmatch(r"[-+]\d+ / (\d+) / \d+ \(\d+\) %( ✓)?", tracking[name])[1])
        assert tracking[name].endswith("✓") == (error <= 10)
        assert summary[name][1] == f"{int(error <= 10)} / 1" and summary[name][2] == f"{error} %"
    change = round(100 * (iterations[names[1]] / iterations[names[0]] - 1))
    assert summary[names[0]][4].startswith("+0 %") and summary[names[1]][4].startswith(f"{change:+d} %")


def test_the_estimator_study_names_the_package_default():
    import optax_adascale
    from benchmarks.estimator import estimator

    options = estimator.candidate_options(None, estimator.PACKAGE_DEFAULT, 4)
    assert optax_adascale.Estimator(**options) == optax_adascale.Estimator()


# Not study_smoke: one of the four cheapest, run on every CI JAX (issue 40: 34-61 s each on JAX 0.12)
def test_the_committed_estimator_report_is_rebuilt_from_the_committed_cells(tmp_path):
    # The study's cells are committed: --report runs nothing and must give the committed section's tables.
    committed = (ROOT / "benchmarks" / "estimator" / "README.md").read_text()
    command = re.search(r"Command: `python -m benchmarks\.estimator ([^`]*)`", committed)[1].split()
    run_study("estimator", *command, "--out", tmp_path)
    rebuilt = (tmp_path / "README.md").read_text()

    def tables(text: str) -> str:  # the generated section, less the hand-written reading and the wall time
        section = text[text.index("<!-- estimator:start -->") : text.index("<!-- estimator:end -->")]
        reading = re.compile(r"<!-- estimator-reading:start -->.*<!-- estimator-reading:end -->", re.S)
        return re.sub(r"this invocation took \d+ s| --out \S+(?=`)", "", reading.sub("", section))

    assert "| FairScale" in tables(committed) and tables(rebuilt) == tables(committed)


def _fixed_rule_rows_are_consistent(section: str, adascale: str, total_steps: int, scale: int = 4):
    """``+`` rows ran exactly AdaScale's iterations at the same S, the others ⌈T/S⌉; examples ÷ S=1 = N·S/T."""
    rows = _table_rows(section, str(scale))
    assert len(rows) >= 5, section
    by_method = {r[1]: r for r in rows}
    n_as = int(by_method[adascale][5])
    for method, row in by_method.items():
        n = int(row[5])
        if method.endswith("+"):
            assert n == n_as, (method, n, n_as)
        elif method != adascale:
            assert n == math.ceil(total_steps / scale), (method, n)
        assert float(row[6]) == pytest.approx(n * scale / total_steps, abs=0.006), (method, row)
        assert row[3] and (method == adascale or row[4]), row  # Δ vs S = 1, and vs AdaScale for the others


# Not study_smoke: one of the four cheapest, run on every CI JAX (issue 40: 34-61 s each on JAX 0.12)
def test_large_batch_smoke_stretches_every_rule_to_adascales_iterations(tmp_path):
    run_study("large_batch", "--smoke", "--out", tmp_path)
    section = (tmp_path / "README.md").read_text().split("### digits MLP")[1]
    total_steps = int(_table_rows(section, "1")[0][5])
    assert {r[1] for r in _table_rows(section, "1")} == {"SGD", "LAMB", "LARS"}
    assert {r[1] for r in _table_rows(section, "4")} == {"AS", "SGD LSW+", "LAMB", "LAMB+", "LARS", "LARS+"}
    _fixed_rule_rows_are_consistent(section, "AS", total_steps)
    assert not (tmp_path / ".cache").exists()  # smoke mode caches nothing


@pytest.mark.study_smoke
def test_fair_adam_smoke_stretches_every_rule_to_adascales_iterations(tmp_path):
    results = tmp_path / "README.md"
    run_study("adam.fair", "--smoke", "--cache", tmp_path / "cache", "--results", results)
    text = results.read_text()
    assert "<!-- adam-fair:start -->" in text and f"cells cached under `{tmp_path / 'cache'}`" in text
    section = text.split("### MNIST-1D CNN")[1]
    labels = {"AS-a", "LAMB", "LAMB+", "LARS", "LARS+"} | {f"AdamW {r}" for r in ("id", "sqrt", "LSW")}
    assert {r[1] for r in _table_rows(section, "4")} == labels | {f"AdamW {r}+" for r in ("id", "sqrt", "LSW")}
    _fixed_rule_rows_are_consistent(section, "AS-a", int(_table_rows(section, "1")[0][5]))
    assert any((tmp_path / "cache").glob("mnist1d_LAMBplus_*_S4_seed0.json"))  # cells cached where --cache says


# --------------------------------------------------------------------------- ramp


@pytest.mark.study_smoke
def test_ramp_smoke_writes_every_arm_the_goals_and_the_proxy(tmp_path):
    results = tmp_path / "README.md"
    run_study("ramp", "--smoke", "--cache", tmp_path / "cells", "--results", results)
    text = results.read_text()
    section = text[text.index("<!-- ramp:start -->") : text.index("<!-- ramp:end -->")]
    for arm in ("fixed-min", "fixed-max", "linear-0.25", "linear-1", "seesaw", "measured-0.6"):
        assert len(_table_rows(section, f"`{arm}`")) == 4, arm  # a row in each task's table
    assert section.count("fewer updates with ≤ 10 % more examples") == 4 * 4  # the goals, per task and efficiency
    assert "B_crit (measured)" in section and "(**the package default**)" in section
    for name in ("ramp_curves.png", "ramp_controller.png", "ramp_proxy.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 0 and f"plots/{name}" in section


# Not study_smoke: one of the four cheapest, run on every CI JAX (issue 40: 34-61 s each on JAX 0.12)
def test_the_committed_ramp_report_is_rebuilt_from_the_committed_cells(tmp_path):
    # The study's cells are committed: --report runs nothing and must give the committed section's tables.
    committed = (ROOT / "benchmarks" / "ramp" / "README.md").read_text()
    run_study("ramp", "--report", "--results", tmp_path / "README.md")
    rebuilt = (tmp_path / "README.md").read_text()

    def tables(text: str) -> str:  # the generated section, less the hand-written reading and the command
        section = text[text.index("<!-- ramp:start -->") : text.index("<!-- ramp:end -->")]
        reading = re.compile(r"<!-- ramp-reading:start -->.*<!-- ramp-reading:end -->", re.S)
        return re.sub(r"Command: `[^`]*`", "", reading.sub("", section))

    assert "| `measured-0.6` |" in tables(committed) and tables(rebuilt) == tables(committed)


def test_the_ramp_study_names_the_package_default():
    import optax_adascale
    from benchmarks.ramp import results

    assert results.DEFAULT == f"measured-{optax_adascale.BatchRamp(1, 2).efficiency:g}"
    assert results.DEFAULT in results.MEASURED


# --------------------------------------------------------------------------- scale quality


@pytest.mark.study_smoke
def test_scale_quality_smoke_writes_the_sweep_the_adam_table_and_the_diagnosis(tmp_path):
    results = tmp_path / "README.md"
    run_study("scale_quality", "--smoke", "--cache", tmp_path / "cells", "--results", results)
    text = results.read_text()
    section = text[text.index("<!-- scale-quality:start -->") : text.index("<!-- scale-quality:end -->")]
    # a summary row per task and method, S = 4 against S = 2 (`guarded`: SGD's default; AdamW's τ clock has no guard)
    for task, methods in (("quadratic", ["`guarded`", "`paper`", "`tau`"]), ("lm_adamw", ["`paper`", "`tau`"])):
        rows = [r for r in _table_rows(section, task) if len(r) == 7 and r[1] in ("`guarded`", "`paper`", "`tau`")]
        assert sorted(r[1] for r in rows) == methods, task
    adam = [r for r in _table_rows(section, "lm_adamw") if len(r) == 7 and r[2] in ("`paper`", "`tau`")]  # vs AdamW
    assert sorted(r[2] for r in adam) == ["`paper`", "`tau`"] and all(math.isfinite(float(r[6])) for r in adam)
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 0


# Not study_smoke: cheap (nothing runs), on every CI JAX
def test_the_committed_scale_quality_report_is_rebuilt_from_the_committed_cells(tmp_path):
    committed = (ROOT / "benchmarks" / "scale_quality" / "README.md").read_text()
    run_study("scale_quality", "--report", "--results", tmp_path / "README.md")
    rebuilt = (tmp_path / "README.md").read_text()

    def tables(text: str) -> str:  # the generated section, less the hand-written reading, command and timing
        section = text[text.index("<!-- scale-quality:start -->") : text.index("<!-- scale-quality:end -->")]
        reading = re.compile(r"<!-- scale-quality-reading:start -->.*<!-- scale-quality-reading:end -->", re.S)
        return re.sub(r"Command: `[^`]*` \([^)]*\)", "", reading.sub("", section))

    assert "| teacher | `tau` |" in tables(committed) and tables(rebuilt) == tables(committed)


def test_the_scale_quality_study_compares_each_aliass_default_clock():
    from benchmarks.scale_quality import engine
    from optax_adascale import _alias

    spelled = {"update": "paper", "tau": "tau"}  # the study's method for each clock
    for clock in _alias.DEFAULT_CLOCK.values():
        assert f'clock="{clock}"' in engine.METHODS[spelled[clock]]


# --------------------------------------------------------------------------- many small leaves


@pytest.mark.study_smoke
def test_leaves_smoke_times_every_case_and_writes_the_report(tmp_path):
    out = tmp_path / "leaves.json"
    run_study("leaves", "--smoke", "--out", out)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"update", "cnn", "dropin"}
    assert results["update"]["leaves"] >= 60 and results["cnn"]["leaves"] >= 60
    for case, variants in {"update": {"sgd", "floor", "adascale"}, "cnn": {"sgd", "adascale"}}.items():
        assert set(results[case]["ratios"]) == variants
    assert set(results["dropin"]["ratios"]) == {"sgd", "same_opt", "dropin"}
    for row in results.values():
        assert all(math.isfinite(r["median"]) and r["median"] > 0 for r in row["ratios"].values())
    # The update's own reductions: a few for the small leaves, not two per leaf (SGD's pmean is one per leaf here).
    reduces = results["update"]["reduces"]
    assert reduces["adascale"] - reduces["sgd"] < 16 < results["update"]["leaves"]

    readme = tmp_path / "README.md"
    run_study("leaves", "--report", out, "--results", readme)
    text = readme.read_text()
    assert "<!-- leaves:start -->" in text and "| `leaves` | " in text


GATES = (
    "tests/gspmd/test_cost.py",
    "benchmarks/gspmd/cost.py",
    "benchmarks/gspmd/stack_gates.py",
    "benchmarks/overhead/overhead.py",
    "benchmarks/gpu/gpu.py",
    "benchmarks/leaves/leaves.py",
)


def test_every_cost_gate_measures_the_aliases_as_a_user_gets_them():
    """DESIGN §5: the budget is the defaults'. In every gate and cost benchmark, an ``adascale_sgd``/``adascale_adamw``
    given a ``clock`` is a row of its own named for it (a dict entry whose key says ``update``), beside the default's;
    the GSPMD harness's ``adascale_clock`` defaults to the alias's own (``None``)."""
    import ast
    import inspect

    from benchmarks.gspmd import cost

    root = Path(__file__).resolve().parents[1]
    for name in GATES:
        tree = ast.parse((root / name).read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in ast.walk(tree):
            func = getattr(call, "func", None)
            if not isinstance(call, ast.Call) or getattr(func, "attr", getattr(func, "id", "")) not in (
                "adascale_sgd",
                "adascale_adamw",
            ):
                continue
            clocks = [k.value for k in call.keywords if k.arg == "clock"]
            if not clocks or (isinstance(clocks[0], ast.Constant) and clocks[0].value is None):
                continue
            if isinstance(clocks[0], ast.Name) and clocks[0].id == "adascale_clock":  # the harness's: checked below
                continue
            node, key = call, None
            while node in parents and key is None:
                parent = parents[node]
                if isinstance(parent, ast.Dict):
                    key = parent.keys[parent.values.index(node)] if node in parent.values else None
                node = parent
            named = isinstance(key, ast.Constant) and "update" in str(key.value)
            assert named, f"{name}:{call.lineno}: a gate's optimizer with a clock of its own is not a named row"
    for fn in (cost.make_step, cost.measure, cost.step_cost):
        assert inspect.signature(fn).parameters["adascale_clock"].default is None, fn.__name__


# --------------------------------------------------------------------------- the update's words per parameter


def test_each_default_update_moves_what_its_update_clock_twin_moves_and_holds_no_while():
    from benchmarks.overhead import words

    rows = {row["update"]: row for row in words.measure(1 << 20)}
    assert words.gate(list(rows.values())) == []
    # XLA:CPU's cost model counts 8 words for SGD + pmean; AdaScale's update clock adds exactly two reads, of the
    # local g (for ‖g‖², before the all-reduce) and of ḡ (for ‖ḡ‖²): 10.
    assert rows["optax.sgd(momentum=0.9) + pmean"]["words_per_param"] == pytest.approx(8.0, abs=0.01)
    assert rows["adascale_sgd, clock='update'"]["words_per_param"] == pytest.approx(10.0, abs=0.01)
    sgd_default = rows["adascale_sgd, the default"]["words_per_param"]
    assert 10.0 < sgd_default <= 10.0 + words.GATE  # the guard's strided samples, and nothing whole
    # The gate can fail: a guard that read its three buffers whole (0.4.0) would move 3 words more.
    assert (
        words.gate(
            [dict(rows["adascale_sgd, clock='update'"]), {**rows["adascale_sgd, the default"], "words_per_param": 13.0}]
        )
        != []
    )
