"""One noise-scale convention in every reader: NaN while not measured, ``+inf`` for pure noise, the ratio otherwise.

The readers: ``optax_adascale.metrics`` of an AdaScale state, the ``RampInputs`` a :class:`BatchRamp`'s policy sees,
the ``noise_scale_monitor``'s metrics and ``goodput.Choice.noise_scale``. Each is fed the same stream of two
gradient samples per update, passed as ``microbatch_stats``: AdaScale and the monitor see the same ``a`` and ``b``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale
from optax_adascale import goodput
from optax_adascale.core import _read

D = 3


def _stream(case: str, steps: int = 4):
    """``steps`` updates of two samples each, as ``(mean gradient, microbatch_stats)``."""
    rng = np.random.default_rng(0)
    out = []
    for t in range(steps):
        g = rng.standard_normal(D).astype(np.float32)
        if case == "pure-noise":  # zero-mean samples, g and −g: μ̂² = −σ̂²/2 < 0 every update, so μ̄² = 0 < σ̄²
            samples = np.stack([g, -g])
        elif case == "identical":  # no spread: σ̂² at its eps floor, μ̂² = ‖g‖²: a tiny, finite noise scale
            samples = np.stack([g + 1.0, g + 1.0])
        elif case == "skipped-first" and t == 0:  # a non-finite first update: skipped, nothing measured
            samples = np.stack([g, np.full(D, np.nan, np.float32)])
        else:  # noise around a mean gradient of 3 per coordinate
            samples = np.stack([g + 3.0, -g + 3.0 + rng.standard_normal(D).astype(np.float32)])
        a = np.mean(np.sum(samples.astype(np.float64) ** 2, axis=1))
        out.append((jnp.asarray(samples.mean(0)), optax_adascale.MicrobatchStats(jnp.float32(a), 2)))
    return out


STEPS = {"before": 0, "skipped-first": 1, "pure-noise": 4, "identical": 4, "noisy": 4}


def _readings(case: str) -> dict[str, float]:
    """Every reader's noise scale after the stream (the ramp's: after its last update, if any)."""
    seen: list[float] = []

    def policy(inputs):
        jax.debug.callback(lambda b: seen.append(float(b)), inputs.noise_scale)
        return jnp.float32(1.0)

    ramp = optax_adascale.BatchRamp(1, 4, policy=policy)
    ada = optax_adascale.adascale(optax.identity(), 0.1, accumulation_steps=ramp)
    monitor = optax.chain(optax_adascale.noise_scale_monitor(), optax.sgd(0.1))
    params = jnp.zeros(D)
    s_ada, s_mon = ada.init(params), monitor.init(params)
    for grads, stats in _stream(case, STEPS[case]):
        s_ada = ada.update(grads, s_ada, params, microbatch_stats=stats)[1]
        s_mon = monitor.update(grads, s_mon, params, microbatch_stats=stats)[1]
    m = optax_adascale.metrics(s_ada)
    out = {
        "metrics": float(m["noise_scale"]),
        "monitor": float(optax_adascale.metrics(s_mon)["noise_scale"]),
        "goodput": goodput.choose_scale(m, goodput.StepTimeModel.linear(0.02, 0.001), [1, 2, 4]).noise_scale,
    }
    if seen:
        out["RampInputs"] = seen[-1]
    assert bool(m["noise_scale_measured"]) == (not math.isnan(out["metrics"]))
    return out


@pytest.mark.parametrize("case", ["before", "skipped-first"])
def test_every_reader_reads_nan_while_nothing_is_measured(case):
    readings = _readings(case)
    assert case == "before" or "RampInputs" in readings  # the ramp saw the skipped update
    assert all(math.isnan(v) for v in readings.values()), readings


def test_every_reader_reads_inf_under_pure_noise():
    readings = _readings("pure-noise")
    assert set(readings) == {"metrics", "monitor", "goodput", "RampInputs"}
    assert all(v == math.inf for v in readings.values()), readings


@pytest.mark.parametrize("case", ["noisy", "identical"])
def test_every_reader_reads_the_same_finite_ratio_otherwise(case):
    readings = _readings(case)
    assert set(readings) == {"metrics", "monitor", "goodput", "RampInputs"}
    assert all(math.isfinite(v) and v >= 0 for v in readings.values()), readings
    np.testing.assert_allclose(list(readings.values()), readings["metrics"], rtol=1e-6)
    if case == "identical":  # σ̄² at the eps floor (1e-6): B = eps/μ̄², far below one base batch
        assert 0 < readings["metrics"] < 1e-5


def test_the_noise_scale_is_grad_var_over_grad_sqr_as_metrics_reports_them():
    grads_stats = _stream("noisy")
    tx = optax_adascale.adascale(optax.identity(), 0.1)
    state = tx.init(jnp.zeros(D))
    for grads, stats in grads_stats:
        state = tx.update(grads, state, jnp.zeros(D), microbatch_stats=stats)[1]
    m = optax_adascale.metrics(state)
    np.testing.assert_allclose(m["noise_scale"], float(m["grad_var"]) / float(m["grad_sqr"]), rtol=1e-6)


@pytest.mark.parametrize(
    "grad_var, grad_sqr, expected",
    [
        (2.0, math.nan, math.nan),  # a broken μ̄² with a positive σ̄²: not measured (a host copy of the rule said +inf)
        (math.nan, 1.0, math.nan),
        (math.inf, 1.0, math.nan),
        (0.0, 0.0, math.nan),  # nothing measured yet
        (2.0, 0.0, math.inf),  # pure noise
        (2.0, -0.5, math.inf),  # μ̄² below 0 (unbiased_sqr) is floored at 0
        (0.0, 4.0, 0.0),  # identical samples
        (6.0, 4.0, 1.5),
    ],
)
def test_goodput_choice_reads_the_noise_scale_as_metrics_does(grad_var, grad_sqr, expected):
    # A Choice is a plain dataclass: one built (or edited) by hand may hold values choose_scale would refuse.
    one = np.ones(1)
    choice = goodput.Choice(1, one, one, one, one, one, grad_var, grad_sqr)
    b, measured = (float(x) for x in _read.noise_scale(grad_var, grad_sqr, True))
    if math.isnan(expected):
        assert math.isnan(choice.noise_scale) and math.isnan(b) and not measured
    else:
        assert choice.noise_scale == b == expected and measured
