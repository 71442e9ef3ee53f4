"""Every example's ``--smoke`` run, each in a fresh interpreter: it succeeds and prints a table that holds.

* ``quickstart.py``: S = 1 is plain SGD; S = 8 takes fewer iterations to the same τ; the model learns.
* ``train_mnist1d.py`` (the flagship): the table and the PNG; S = 1 is plain SGD; larger S, fewer iterations;
  accuracy above chance; ``--mesh pmap``, ``gspmd`` and ``vmap`` print what ``shard_map`` prints.
* ``elastic.py``: scale 2 -> 4 -> 8 through checkpoints, each phase stopping at its τ boundary.
* ``elastic_goodput.py``: S re-chosen by goodput as the noise scale grows beats every fixed S.
* ``nnx_quickstart.py``: NNX with micro-batches and with shard_map replicas train alike.
* ``flax_mnist.py``: Flax's NNX MNIST example through the drop-in: S = 8 reaches T in fewer updates, both learn.
* ``flax_seq2seq.py``: Flax's Linen seq2seq LSTM through the drop-in and under pmap: the same updates.
* ``sharded_lm.py``: a tensor-parallel NNX transformer at S = 1 and S = 4.

(``multihost.py`` runs as two processes in ``test_multihost.py``.) Tests that share one run share an
``xdist_group``, so that the run happens once, on one worker.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import run_example, scratch_dir

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- quickstart.py

QUICKSTART_COLUMNS = ("S", "batch", "iterations", "tau", "mean gain", "train acc", "test acc", "time (s)")


@functools.cache
def _quickstart_table() -> dict[int, dict[str, float]]:
    """Runs ``quickstart.py --smoke`` once; returns its table as ``{S: {column: value}}``."""
    stdout = run_example("quickstart.py", "--smoke")
    lines = stdout.splitlines()
    header = [i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"]]
    assert len(header) == 1, stdout
    rows = {}
    for line in lines[header[0] + 1 :]:
        if not line.split() or not line.split()[0].isdigit():
            break  # the end of the table
        values = [float(v) for v in line.split()]
        assert len(values) == len(QUICKSTART_COLUMNS), line
        rows[int(values[0])] = dict(zip(QUICKSTART_COLUMNS, values, strict=True))
    return rows


@pytest.fixture
def quickstart_table():
    """_quickstart_table, computed once per process (xdist may tear module fixtures down between tests)."""
    return _quickstart_table()


quickstart = pytest.mark.xdist_group("quickstart")


@quickstart
def test_quickstart_table_has_one_row_per_scale(quickstart_table):
    assert sorted(quickstart_table) == [1, 8]
    assert quickstart_table[1]["batch"] == 32 and quickstart_table[8]["batch"] == 256


@quickstart
def test_quickstart_single_replica_is_plain_sgd(quickstart_table):
    row = quickstart_table[1]
    assert row["mean gain"] == 1.0
    assert row["iterations"] == row["tau"]


@quickstart
def test_quickstart_eight_replicas_take_fewer_iterations_with_gain_in_range(quickstart_table):
    s1, s8 = quickstart_table[1], quickstart_table[8]
    assert 1.0 <= s8["mean gain"] <= 8.0
    assert s8["iterations"] < s1["iterations"]
    # Both runs stop at the same scale-invariant budget; S = 8 overshoots by less than one gain.
    assert s1["tau"] <= s8["tau"] < s1["tau"] + 8.0
    assert s8["iterations"] == pytest.approx(s8["tau"] / s8["mean gain"], abs=1.0)


@quickstart
@pytest.mark.parametrize("scale", [1, 8])
def test_quickstart_model_learns(scale, quickstart_table):
    # Ten classes: chance is 0.1; the smoke budget gets well above it.
    assert 0.2 < quickstart_table[scale]["test acc"] <= 1.0
    assert 0.2 < quickstart_table[scale]["train acc"] <= 1.0


# --------------------------------------------------------------------------- train_mnist1d.py (the flagship)

FLAGSHIP_BUDGET = 150  # the smoke budget T
FLAGSHIP_MIN_ACCURACY = 15.0  # % on 10 classes (chance: 10 %); see test_flagship_smoke_learns_above_chance
FLAGSHIP_ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+"
    r"(?P<acc>[\d.]+)%\s+(?P<loss>[\d.]+)\s+(?P<seconds>[\d.]+)\s*$"
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_flagship(out: Path, *args: str) -> tuple[dict[int, dict[str, str]], Path]:
    """Run the flagship's smoke mode; return its table rows by S and the PNG path."""
    stdout = run_example("train_mnist1d.py", "--smoke", "--out", str(out), *args)
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"])
    rows = {}
    for line in lines[header + 2 :]:
        match = FLAGSHIP_ROW.match(line)
        if match is None:
            break
        rows[int(match["S"])] = match.groupdict()
    png = out / "adascale_mnist1d.png"
    assert f"wrote {png}" in stdout
    return rows, png


@functools.cache
def _flagship_run():
    """The default run (``--mesh shard_map``, S = 1, 8, 32), shared by the tests below."""
    return run_flagship(scratch_dir("shard_map"))


@pytest.fixture
def flagship_run():
    """_flagship_run, computed once per process (xdist may tear module fixtures down between tests)."""
    return _flagship_run()


flagship = pytest.mark.xdist_group("flagship")


@flagship
def test_flagship_smoke_prints_the_table_and_writes_the_png(flagship_run):
    rows, png = flagship_run
    assert sorted(rows) == [1, 8, 32]
    assert png.read_bytes()[:8] == PNG_MAGIC
    for scale, row in rows.items():
        assert int(row["batch"]) == 32 * scale
        tau, gain, iterations = float(row["tau"]), float(row["gain"]), int(row["iterations"])
        assert tau >= FLAGSHIP_BUDGET  # trained until τ reached the budget...
        assert 1.0 <= gain <= scale  # ...with gains in [1, S]
        assert tau == pytest.approx(gain * iterations, abs=0.01 * iterations)  # τ is the sum of the gains


@flagship
def test_flagship_smoke_learns_above_chance(flagship_run):
    # 10 balanced classes: an untrained (or diverged) model scores about 10 % with a cross-entropy of
    # ln 10 ≈ 2.303. The smoke run (150 base steps, width 8) reaches 23.3 / 20.5 / 19.7 % and a train loss of
    # 1.84 / 2.11 / 2.20 at S = 1 / 8 / 32; 15 % is more than 3 standard deviations of a chance score on the test
    # split above 10 %, and below every scale's accuracy.
    rows, _ = flagship_run
    for scale, row in rows.items():
        assert FLAGSHIP_MIN_ACCURACY < float(row["acc"]) <= 100.0, (scale, row)
        assert float(row["loss"]) < math.log(10), (scale, row)  # better than a uniform prediction


@flagship
def test_flagship_smoke_s1_is_plain_sgd(flagship_run):
    rows, _ = flagship_run
    assert int(rows[1]["iterations"]) == FLAGSHIP_BUDGET
    assert float(rows[1]["tau"]) == FLAGSHIP_BUDGET
    assert float(rows[1]["gain"]) == 1.0


@flagship
def test_flagship_smoke_larger_scale_takes_fewer_iterations(flagship_run):
    rows, _ = flagship_run
    assert int(rows[32]["iterations"]) < int(rows[8]["iterations"]) < int(rows[1]["iterations"])


@flagship
@pytest.mark.parametrize("mesh", ["pmap", "gspmd", "vmap"])
def test_flagship_smoke_mesh_matches_shard_map(mesh, flagship_run, tmp_path):
    # The example draws the same batches under every mesh, so four parallel mechanisms must print the same
    # iterations, τ, gains, accuracies and losses (to the printed precision). One scale per mesh: S = 32 has
    # the most replicas per device (4 on 8 devices), the case where the mechanisms differ most.
    rows, png = run_flagship(tmp_path, "--mesh", mesh, "--scales", "32")
    assert png.read_bytes()[:8] == PNG_MAGIC
    reference, _ = flagship_run
    for scale in (32,):
        for key in ("iterations", "tau", "gain", "acc", "loss"):
            assert rows[scale][key] == reference[scale][key], (mesh, scale, key)


# --------------------------------------------------------------------------- elastic.py

ELASTIC_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$")


def test_elastic_example_smoke_prints_the_phase_table():
    stdout = run_example("elastic.py", "--smoke", timeout=300)
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["phase", "S"])
    rows = [ELASTIC_ROW.match(line) for line in lines[header + 1 : header + 4]]
    assert all(rows), stdout
    phases = [(int(m[1]), int(m[2]), int(m[3]), float(m[4]), float(m[5])) for m in rows]
    assert [p[:2] for p in phases] == [(1, 2), (2, 4), (3, 8)]
    T = 64  # the smoke budget
    for (_, scale, iterations, tau, gain), end in zip(phases, (T / 4, T / 2, T), strict=True):
        assert iterations > 0
        assert tau >= end  # each phase ran until τ reached its boundary
        assert 1.0 <= gain <= scale
    assert phases[0][3] < T / 2 and phases[1][3] < T  # ... and stopped there (one update overshoots at most)
    assert "total:" in lines[-1]


# --------------------------------------------------------------------------- elastic_goodput.py
# The smoke run (T = 2000 base steps, S in {2, 4, 8, 16}, re-chosen every 10 iterations) sees the noise scale
# grow from about 4-6 to about 10, so the best S under the synthetic model t(S) = 20 ms + 1.5 ms·S
# (S* = √(B·t0/t1) ≈ 8 → 12) moves from 8 to 16 once. That is enough for the adaptive run to beat the best
# fixed S (by 2-5 % over seeds 0-2); the full run (T = 10000, 11 candidates) walks S from 2 to 64.

GOODPUT_T = 2000  # the smoke budget
GOODPUT_CANDIDATES = (2, 4, 8, 16)
GOODPUT_T0, GOODPUT_T1 = 0.020, 0.0015  # the synthetic step-time model's defaults
GOODPUT_PHASE = re.compile(r"^\s*([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(n/a|inf|[\d.]+)\s+([\d.]+)\s+(n/a|[\d.]+x)\s*$")
GOODPUT_RUN = re.compile(
    r"^\s*(adaptive|fixed \d+)\s+(\d+)-?(\d+)?\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)%\s+([\d.]+)\s*$"
)


@functools.cache
def _goodput_stdout() -> str:
    return run_example("elastic_goodput.py", "--smoke", timeout=300)


@pytest.fixture
def goodput_stdout():
    """_goodput_stdout, computed once per process (xdist may tear module fixtures down between tests)."""
    return _goodput_stdout()


def _goodput_rows(lines: list[str], first_words: list[str], pattern: re.Pattern) -> list[re.Match]:
    header = next(i for i, line in enumerate(lines) if line.split()[: len(first_words)] == first_words)
    assert set(lines[header + 1]) == {"-"}
    rows = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        match = pattern.match(line)
        assert match, line
        rows.append(match)
    return rows


elastic_goodput = pytest.mark.xdist_group("elastic_goodput")


@elastic_goodput
def test_elastic_goodput_step_time_model_is_labelled_synthetic(goodput_stdout):
    assert "SYNTHETIC step-time model: t(S) = 0.02 + 0.0015·S s per iteration" in goodput_stdout
    assert "synthetic step-time model's seconds" in goodput_stdout


@elastic_goodput
def test_elastic_goodput_each_change_of_s_follows_the_measured_noise_scale(goodput_stdout):
    """What the advisor promises, not a path: ``choose_scale`` is the argmax of goodput at the noise scale measured
    then (no memory of its own: the example holds each choice for K = 10 iterations), so at every change S is the
    argmax recomputed here from the printed noise scale, and S moves the way the noise scale moved (under
    t(S) = t0 + t1·S the best S is non-decreasing in B_noise: goodput(S₂)/goodput(S₁) grows with B for S₂ > S₁).
    Whether the measured noise scale grows monotonically over a run is the numerics' business (JAX 0.12.1's went
    2 → 8 → 16 → 8 → 16), not asserted."""
    from optax_adascale import goodput

    phases = _goodput_rows(goodput_stdout.splitlines(), ["tau", "start", "S"], GOODPUT_PHASE)
    scales = [int(m[2]) for m in phases]
    noise = [float(m[5]) if m[5] != "n/a" else float("nan") for m in phases]
    iterations = [int(m[3]) for m in phases]
    # Before the first update there are no statistics: the smallest candidate, no ratio, no noise scale.
    assert float(phases[0][1]) == 0.0 and scales[0] == min(GOODPUT_CANDIDATES) and phases[0][7] == phases[0][5] == "n/a"
    assert len(set(scales[1:])) >= 2, scales  # S does change with what is measured
    assert [float(m[1]) for m in phases] == sorted(float(m[1]) for m in phases)
    model = goodput.StepTimeModel.linear(GOODPUT_T0, GOODPUT_T1)
    candidates = np.array(GOODPUT_CANDIDATES, float)
    for i in range(1, len(phases)):
        b = noise[i]
        assert np.isfinite(b) and b > 0, phases[i][0]
        rates = np.asarray(goodput.gain(candidates, b, 1.0)) / model(candidates)  # σ̄²/μ̄² = B: μ̄² = 1 loses nothing
        close = np.flatnonzero(rates >= rates.max() * (1 - 2e-3))  # the printed B has 2 decimals: near-ties either way
        assert scales[i] in candidates[close], (scales[i], b, rates)
        assert float(phases[i][7][:-1]) >= 1.0  # at its choice, at least as good as the best fixed S
        if i >= 2 and scales[i] != scales[i - 1]:
            assert (scales[i] > scales[i - 1]) == (b > noise[i - 1]), (scales, noise)
    assert all(n % 10 == 0 for n in iterations[:-1]), iterations  # a choice holds for K iterations at least
    for m in phases:  # the mean gain of a phase lies in [1, S]
        assert 1.0 <= float(m[4]) <= int(m[2])


@elastic_goodput
def test_elastic_goodput_every_run_reaches_T_and_the_adaptive_one_is_fastest(goodput_stdout):
    runs = {m[1]: m for m in _goodput_rows(goodput_stdout.splitlines(), ["run", "S"], GOODPUT_RUN)}
    assert set(runs) == {"adaptive"} | {f"fixed {s}" for s in GOODPUT_CANDIDATES}
    modelled = {name: float(m[6]) for name, m in runs.items()}
    for name, m in runs.items():
        assert float(m[5]) >= GOODPUT_T, name  # τ ≥ T: the same amount of base-batch progress
        assert float(m[8]) > 50.0, name  # and a sensible validation accuracy (10 classes)
        if name.startswith("fixed"):  # the time is the synthetic model's: iterations · t(S)
            s = int(name.split()[1])
            assert modelled[name] == pytest.approx(int(m[4]) * (GOODPUT_T0 + GOODPUT_T1 * s), abs=2e-3)
    assert int(runs["adaptive"][2]) == min(GOODPUT_CANDIDATES) and int(runs["adaptive"][3]) > min(GOODPUT_CANDIDATES)
    best_fixed = min(v for k, v in modelled.items() if k != "adaptive")
    assert modelled["adaptive"] <= 1.05 * best_fixed, modelled
    # Same quality target: the adaptive run's accuracy is within the spread of the fixed runs (± 3 points).
    fixed_acc = [float(m[8]) for k, m in runs.items() if k != "adaptive"]
    assert float(runs["adaptive"][8]) >= min(fixed_acc) - 3.0
    last = goodput_stdout.strip().splitlines()[-1]
    saved = re.search(r"time saved against the best fixed S: (-?[\d.]+)%", last)
    assert saved, last
    assert float(saved[1]) == pytest.approx(100 * (1 - modelled["adaptive"] / best_fixed), abs=0.2)


# --------------------------------------------------------------------------- nnx_quickstart.py

NNX_BUDGET = 100  # the smoke budget T
NNX_ROW = re.compile(
    r"^(?P<run>\S.*?)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+(?P<acc>[\d.]+)%\s+[\d.]+$"
)


def test_nnx_example_smoke_micro_batches_and_replicas_train_alike():
    stdout = run_example("nnx_quickstart.py", "--smoke")
    rows = {m["run"]: m.groupdict() for m in map(NNX_ROW.match, stdout.splitlines()) if m}
    assert list(rows) == ["S=1", "S=8, 8 micro-batches", "S=8, 8 shard_map replicas"], stdout
    base, micro, replicas = rows.values()
    assert int(base["iterations"]) == NNX_BUDGET and float(base["gain"]) == 1.0
    assert float(micro["tau"]) >= NNX_BUDGET
    assert 1.0 <= float(micro["gain"]) <= 8.0
    assert int(micro["iterations"]) < NNX_BUDGET
    # The same 256 examples per step, as 8 micro-batches on one device or as 8 replicas.
    for key in ("iterations", "tau", "gain", "acc"):
        assert micro[key] == replicas[key], key


# --------------------------------------------------------------------------- flax_mnist.py
# Flax's NNX MNIST example ported through the drop-in (the module and nnx.Rngs passed as to nnx.value_and_grad,
# nnx.Optimizer(wrt=nnx.Param) given microbatch_stats): S = 1 is Flax's step as written, S = 8 the port.

FLAX_MNIST_BUDGET = 20  # the smoke budget T
FLAX_MNIST_ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<seed>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+"
    r"(?P<gain>[\d.]+)\s+(?P<at_S>[\d.]+)\s+(?P<pinned>[\d.]+|nan)\s+(?P<acc>[\d.]+)%\s+(?P<loss>[\d.]+)\s+[\d.]+\s*$"
)


def test_flax_mnist_smoke_ports_flax_example_and_learns():
    stdout = run_example("flax_mnist.py", "--smoke", "--no-progress")
    rows = {int(m["S"]): m.groupdict() for m in map(FLAX_MNIST_ROW.match, stdout.splitlines()) if m}
    assert sorted(rows) == [1, 8], stdout
    base, port = rows[1], rows[8]
    assert int(base["iterations"]) == FLAX_MNIST_BUDGET and float(base["gain"]) == 1.0
    assert FLAX_MNIST_BUDGET <= float(port["tau"]) < FLAX_MNIST_BUDGET + 8  # stops at τ = T, within one gain
    assert 1.0 <= float(port["gain"]) <= 8.0 and int(port["iterations"]) < FLAX_MNIST_BUDGET
    assert int(port["iterations"]) == pytest.approx(float(port["tau"]) / float(port["gain"]), abs=1.0)
    for row in (base, port):  # held-out loss below chance's ln 10 = 2.303 (the smoke run: 2.03 and 2.12)
        assert float(row["loss"]) < math.log(10), row


# --------------------------------------------------------------------------- flax_seq2seq.py
# Flax's Linen seq2seq LSTM (nn.RNN over nn.LSTMCell, TrainState, optax.adam) ported: through the drop-in on an
# Auto mesh, and as Flax's per-replica step under jax.pmap. The two are the same update from the same data.

SEQ2SEQ_BUDGET = 60  # the smoke budget T


def test_flax_seq2seq_smoke_the_drop_in_and_pmap_take_the_same_updates_and_it_says_what_s_buys(tmp_path):
    import json

    out, stderr = tmp_path / "rows.json", []
    stdout = run_example("flax_seq2seq.py", "--smoke", "--no-progress", "--json", str(out), stderr=stderr)
    rows = {(r["S"], r["mesh"]): r for r in json.loads(out.read_text())}
    assert sorted(rows) == [(1, "-"), (8, "gspmd"), (8, "pmap")], stdout
    base, gspmd, pmap = rows[1, "-"], rows[8, "gspmd"], rows[8, "pmap"]
    assert base["iterations"] == SEQ2SEQ_BUDGET and base["mean_gain"] == 1.0
    for row in (gspmd, pmap):
        assert SEQ2SEQ_BUDGET <= row["tau"] < SEQ2SEQ_BUDGET + 8 and row["iterations"] <= SEQ2SEQ_BUDGET
        assert 1.0 <= row["mean_gain"] <= 8.0
        assert np.mean(row["losses"][-5:]) < row["losses"][0]  # it learns: the loss falls from its first update
    # Each update's loss (the mean over the 8 shards of the loss as written) from the same batches: the drop-in's
    # trajectory is pmap's to float32 rounding (the statistics' rounding moves the gain by less than 1e-2)
    assert gspmd["iterations"] == pmap["iterations"]
    np.testing.assert_allclose(gspmd["losses"], pmap["losses"], rtol=1e-3)
    np.testing.assert_allclose(gspmd["tau"], pmap["tau"], rtol=1e-2)
    # On this task the gradient is signal-dominated (the noise scale a fraction of a base batch): after 50 updates and
    # a quarter of T, done() says once what S buys, with the run's own numbers
    said = re.findall(
        r"UserWarning: optax_adascale: after (\d+) updates, at S = 8 each update is worth r = ([\d.]+)", stderr[0]
    )
    assert len(said) == 1, stderr[0][-2000:]
    assert int(said[0][0]) >= 50 and float(said[0][1]) / 8 < 1 / 3


# --------------------------------------------------------------------------- sharded_lm.py
# The example trains under a partial-manual jax.shard_map (only "data" manual; the parameters split over "model"
# by the partitioner) until τ ≥ T, checks inside the program that the momentum of every split weight is split
# like the weight, and prints one table row per scale.

LM_BUDGET = 40  # the smoke budget T
LM_ROW = re.compile(
    r"^\s*(?P<S>\d+)\s+(?P<batch>\d+)\s+(?P<iterations>\d+)\s+(?P<tau>[\d.]+)\s+(?P<gain>[\d.]+)\s+"
    r"(?P<loss>[\d.]+|nan|inf)\s+(?P<seconds>[\d.]+)\s*$"
)


def test_sharded_lm_smoke():
    stdout = run_example("sharded_lm.py", "--smoke")
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["S", "batch", "iterations"])
    rows = {}
    for line in lines[header + 2 :]:
        match = LM_ROW.match(line)
        if match is None:
            break
        rows[int(match["S"])] = match.groupdict()
    assert sorted(rows) == [1, 4], stdout
    assert "split over 'model'" in stdout  # the parameter shardings were printed
    for scale, row in rows.items():
        tau, gain, loss = float(row["tau"]), float(row["gain"]), float(row["loss"])
        assert tau >= LM_BUDGET, (scale, row)  # trained until τ reached T
        assert 1.0 <= gain <= scale, (scale, row)
        assert math.isfinite(loss) and loss < math.log(256), (scale, row)  # learned more than uniform bytes
    assert int(rows[1]["iterations"]) == LM_BUDGET and float(rows[1]["gain"]) == 1.0  # S = 1: plain SGD
    assert int(rows[4]["iterations"]) < int(rows[1]["iterations"])
    assert int(rows[4]["batch"]) == 4 * int(rows[1]["batch"])


# --------------------------------------------------------------------------- batch_ramp.py

RAMP_ROW = re.compile(r"^\s*(?P<tau>\d+)\s+(?P<k>\d+)\s+(?P<S>\d+)\s+(?P<noise>[\d.]+|inf)\s+(?P<calls>\d+)\s*$")


def test_batch_ramp_smoke_grows_the_batch_in_one_compile_and_resumes_from_a_checkpoint(tmp_path):
    stdout = run_example("batch_ramp.py", "--smoke", "--out", str(tmp_path), timeout=300)
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["τ", "k"])
    rows = [m.groupdict() for m in map(RAMP_ROW.match, lines[header + 1 :]) if m]
    assert rows and int(rows[0]["k"]) == 1, stdout  # the ramp starts at its lowest rung
    for row in rows:
        assert int(row["k"]) in (1, 2, 4, 8, 16) and int(row["S"]) == 4 * int(row["k"]), row
    assert "compiled programs of the train step for the whole ramp: 1" in stdout
    assert "saved, restored (identical), resuming at call" in stdout
    summary = next(line for line in lines if line.startswith("updates "))
    tau = float(re.search(r"τ ([\d.]+)", summary)[1])
    loss = float(re.search(r"validation loss ([\d.]+)", summary)[1])
    assert tau >= 60 and loss < math.log(256), summary
    assert (tmp_path / "batch_ramp.png").stat().st_size > 0
