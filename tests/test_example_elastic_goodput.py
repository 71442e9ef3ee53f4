"""``examples/elastic_goodput.py --smoke``: S re-chosen by goodput as the noise scale grows; time against fixed S.

The smoke run (T = 2000 base steps, S in {2, 4, 8, 16}, re-chosen every 10 iterations) sees the
noise scale grow from about 4-6 to about 10, so the best S under the synthetic model
``t(S) = 20 ms + 1.5 ms·S`` (``S* = √(B·t0/t1)`` ≈ 8 → 12) moves from 8 to 16 once. That is
enough for the adaptive run to beat the best fixed S (by 2-5 % over seeds 0-2); the full run
(T = 10000, 11 candidates) walks S from 2 to 64.
"""

from __future__ import annotations

import re

import pytest
from helpers import run_example

T = 2000  # the smoke budget
CANDIDATES = (2, 4, 8, 16)
T0, T1 = 0.020, 0.0015  # the synthetic step-time model's defaults

PHASE = re.compile(r"^\s*([\d.]+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(n/a|[\d.]+x)\s*$")
RUN = re.compile(
    r"^\s*(adaptive|fixed \d+)\s+(\d+)-?(\d+)?\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)%\s+([\d.]+)\s*$"
)


@pytest.fixture(scope="module")
def stdout() -> str:
    return run_example("elastic_goodput.py", "--smoke", timeout=150)


def _rows(lines: list[str], first_words: list[str], pattern: re.Pattern) -> list[re.Match]:
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


def test_the_step_time_model_is_labelled_synthetic(stdout):
    assert "SYNTHETIC step-time model: t(S) = 0.02 + 0.0015·S s per iteration" in stdout
    assert "synthetic step-time model's seconds" in stdout


def test_s_changes_and_grows_with_the_noise_scale(stdout):
    phases = _rows(stdout.splitlines(), ["tau", "start", "S"], PHASE)
    starts = [float(m[1]) for m in phases]
    scales = [int(m[2]) for m in phases]
    noise = [float(m[5]) for m in phases]
    # Before the first update there are no statistics: the smallest candidate, no ratio.
    assert starts[0] == 0.0 and scales[0] == min(CANDIDATES) and phases[0][7] == "n/a"
    # After it, the advisor's choices: at least two different S, growing over τ with the noise scale.
    assert len(set(scales[1:])) >= 2, scales
    assert scales == sorted(scales) and starts == sorted(starts), (scales, starts)
    assert noise[1:] == sorted(noise[1:]) and noise[-1] > noise[1], noise
    assert all(s in CANDIDATES for s in scales)
    # The chosen S is the advisor's argmax, so at its choice it is at least as good as the best fixed S.
    assert all(float(m[7][:-1]) >= 1.0 for m in phases[1:])
    for m in phases:  # the mean gain of a phase lies in [1, S]
        assert 1.0 <= float(m[4]) <= int(m[2])


def test_every_run_reaches_T_and_the_adaptive_one_is_fastest(stdout):
    runs = {m[1]: m for m in _rows(stdout.splitlines(), ["run", "S"], RUN)}
    assert set(runs) == {"adaptive"} | {f"fixed {s}" for s in CANDIDATES}
    modelled = {name: float(m[6]) for name, m in runs.items()}
    for name, m in runs.items():
        assert float(m[5]) >= T, name  # τ ≥ T: the same amount of base-batch progress
        assert float(m[8]) > 50.0, name  # and a sensible validation accuracy (10 classes)
        if name.startswith("fixed"):  # the time is the synthetic model's: iterations · t(S)
            s = int(name.split()[1])
            assert modelled[name] == pytest.approx(int(m[4]) * (T0 + T1 * s), abs=2e-3)
    assert int(runs["adaptive"][2]) == min(CANDIDATES) and int(runs["adaptive"][3]) > min(CANDIDATES)
    best_fixed = min(v for k, v in modelled.items() if k != "adaptive")
    assert modelled["adaptive"] <= 1.05 * best_fixed, modelled
    # Same quality target: the adaptive run's accuracy is within the spread of the fixed runs (± 3 points).
    fixed_acc = [float(m[8]) for k, m in runs.items() if k != "adaptive"]
    assert float(runs["adaptive"][8]) >= min(fixed_acc) - 3.0
    last = stdout.strip().splitlines()[-1]
    saved = re.search(r"time saved against the best fixed S: (-?[\d.]+)%", last)
    assert saved, last
    assert float(saved[1]) == pytest.approx(100 * (1 - modelled["adaptive"] / best_fixed), abs=0.2)
