"""The estimator against analytic truth, hand-derived averages, exact τ, and its invariances (hypothesis)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import optax_adascale
from optax_adascale.core import _estimator as est

# --------------------------------------------------------------------------- analytic truth


@pytest.mark.parametrize("n, scale", [(8, None), (8, 32.0), (4, 2.0)])
def test_gain_on_a_noisy_quadratic_matches_the_closed_form(n, scale):
    # At a fixed point of ½‖w − c‖² the base-batch gradient is μ + ξ with ‖μ‖² = μ² and
    # E‖ξ‖² = σ². Each of the n samples is S/n base batches, so its noise has trace σ²·n/S.
    d, sigma2, mu2, steps = 512, 4.0, 1.0, 600
    S = float(n if scale is None else scale)
    mean = jnp.full((d,), np.sqrt(mu2 / d), jnp.float32)
    tx = optax_adascale.adascale_sgd(0.0, axis_name="i", scale=scale)  # lr 0: stay at the fixed point
    params = jnp.zeros(d)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")

    @jax.jit
    def run(key):
        def body(state, key):
            noise = jax.random.normal(key, (n, d)) * jnp.sqrt(sigma2 * n / S / d)
            _, state = update(mean + noise, state, params)
            return state, None

        state, _ = jax.lax.scan(body, tx.init(params), jax.random.split(key, steps))
        return optax_adascale.metrics(state)

    m = run(jax.random.PRNGKey(0))
    assert float(m["gain"]) == pytest.approx((sigma2 + mu2) / (sigma2 / S + mu2), rel=0.03)
    assert float(m["grad_var"]) == pytest.approx(sigma2, rel=0.03)
    assert float(m["grad_sqr"]) == pytest.approx(mu2, rel=0.05)


# --------------------------------------------------------------------------- moving averages


def test_debiased_average_equals_fairscale_biased_over_unbias():
    theta, samples = 0.9, np.array([3.0, 1.0, 4.0, 1.0, 5.0], np.float32)
    avg, weight = jnp.zeros(()), jnp.zeros(())
    biased = unbias = 0.0
    for t, x in enumerate(samples, start=1):
        alpha, weight = est.ema_rate(jnp.int32(t), weight, theta, "debiased")
        avg = est.ema_update(avg, jnp.float32(x), alpha)
        biased, unbias = theta * biased + (1 - theta) * x, theta * unbias + (1 - theta)
        assert float(avg) == pytest.approx(biased / unbias, rel=1e-6)


def test_paper_averaging_is_the_plain_mean_then_the_ema():
    # θ = 0.6: 1/(1−θ) = 2.5, so updates 1 and 2 use the running mean, 3 onwards the EMA.
    theta, x = 0.6, [2.0, 4.0, 10.0, 0.0, 5.0]
    expected = [2.0, 3.0]  # means of the first one and two samples
    for sample in x[2:]:
        expected.append(theta * expected[-1] + (1 - theta) * sample)
    avg, weight = jnp.zeros(()), jnp.zeros(())
    for t, (sample, want) in enumerate(zip(x, expected), start=1):
        alpha, weight = est.ema_rate(jnp.int32(t), weight, theta, "paper")
        avg = est.ema_update(avg, jnp.float32(sample), alpha)
        assert float(avg) == pytest.approx(want, rel=1e-6), t


def test_paper_averaging_through_the_transformation():
    theta, n, S = 0.6, 2, 2.0
    rng = np.random.default_rng(0)
    samples = rng.normal(size=(5, n, 3)).astype(np.float32) + 0.5
    tx = optax_adascale.experimental.adascale(optax.identity(), 0.1, axis_name="i", smoothing=theta, averaging="paper")
    update = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i"))
    params, state = jnp.zeros(3), tx.init(jnp.zeros(3))
    var_avg = sqr_avg = None
    for t, g in enumerate(samples.astype(np.float64), start=1):
        a, b = np.mean(np.sum(g**2, axis=1)), np.sum(g.mean(0) ** 2)
        var = max(S / (n - 1) * (a - b), 1e-6)
        sqr = max(b - S / (n - 1) * (a - b) / S, 0.0)
        if t < 1 / (1 - theta):  # FairScale debias_ewma=False: total / count
            var_avg = var if t == 1 else (var_avg * (t - 1) + var) / t
            sqr_avg = sqr if t == 1 else (sqr_avg * (t - 1) + sqr) / t
        else:
            var_avg, sqr_avg = theta * var_avg + (1 - theta) * var, theta * sqr_avg + (1 - theta) * sqr
        _, state = update(jnp.asarray(g, jnp.float32), state, params)
        m = optax_adascale.metrics(state)
        assert float(m["grad_var"]) == pytest.approx(var_avg, rel=1e-5), t
        assert float(m["grad_sqr"]) == pytest.approx(sqr_avg, rel=1e-5, abs=1e-6), t
        gain = np.clip((var_avg + sqr_avg) / (var_avg / S + sqr_avg), 1, S)
        assert float(m["gain"]) == pytest.approx(gain, rel=1e-5), t


# --------------------------------------------------------------------------- exact τ


@jax.jit
def _sum_gains(gains):
    def body(i, carry):
        return est.advance_tau(*carry, gains[i])

    return jax.lax.fori_loop(0, gains.shape[0], body, (jnp.int32(0), jnp.float32(0.0)))


@pytest.mark.parametrize("kind", ["random in [1, 8)", "constant 1.1"])
def test_tau_is_exact_after_ten_million_increments(kind):
    count = 10_000_000
    if kind == "constant 1.1":
        gains = np.full(count, 1.1, np.float32)
    else:
        gains = (1.0 + 7.0 * np.random.default_rng(0).random(count, dtype=np.float32)).astype(np.float32)
    reference = np.sum(gains.astype(np.float64))  # exact: < 2^26 with 2^-23 resolution fits 53 bits
    whole, frac = _sum_gains(jnp.asarray(gains))
    assert int(whole) == int(np.floor(reference))
    assert float(frac) == reference - np.floor(reference)
    # A plain float32 accumulator is far off, so this test has teeth.
    naive = jax.jit(lambda g: jax.lax.fori_loop(0, count, lambda i, t: t + g[i], jnp.float32(0)))(jnp.asarray(gains))
    assert abs(float(naive) - reference) > 1.0


# --------------------------------------------------------------------------- properties (hypothesis)

N_REPLICAS, DIM = 4, 6
bounded = hnp.arrays(
    np.float32, (N_REPLICAS, DIM), elements=st.floats(-10, 10, width=32, allow_nan=False, allow_infinity=False)
)


@functools.cache
def _first_update(scale):
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", scale=scale)
    params = jnp.zeros(DIM)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    return jax.jit(lambda g: optax_adascale.metrics(update(g, tx.init(params), params)[1]))


@settings(max_examples=60, deadline=None)
@given(g=bounded, scale=st.sampled_from([None, 2.0, 16.0]))
def test_gain_lies_in_one_to_scale(g, scale):
    gain = float(_first_update(scale)(g)["gain"])
    assert 1.0 <= gain <= (N_REPLICAS if scale is None else scale)


@settings(max_examples=60, deadline=None)
@given(g=bounded, perm=st.permutations(range(N_REPLICAS)))
def test_gain_is_invariant_to_permuting_replicas(g, perm):
    f = _first_update(None)
    assert float(f(g[np.array(perm)])["gain"]) == pytest.approx(float(f(g)["gain"]), rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(g=bounded, c=st.sampled_from([-3.0, 0.5, 2.0, 10.0]))
def test_gain_is_invariant_to_scaling_all_gradients(g, c):
    # The eps floor is absolute, so keep ‖ḡ‖² and the variance well above it.
    g = g + np.float32(1.0)
    f = _first_update(None)
    base = f(g)
    if float(base["grad_var"]) < 1e-2:
        g[0] += np.float32(1.0)
        base = f(g)
    assert float(f(np.float32(c) * g)["gain"]) == pytest.approx(float(base["gain"]), rel=1e-4)


@settings(max_examples=40, deadline=None)
@given(
    row=hnp.arrays(np.float32, (DIM,), elements=st.floats(-10, 10, width=32)).filter(
        lambda r: float(np.sum(r.astype(np.float64) ** 2)) > 1e-2
    )
)
def test_identical_replicas_give_gain_one(row):
    gain = float(_first_update(None)(np.tile(row, (N_REPLICAS, 1)))["gain"])
    assert gain == pytest.approx(1.0, abs=1e-6 / np.sum(row.astype(np.float64) ** 2) + 1e-6)


@settings(max_examples=40, deadline=None)
@given(g=bounded.filter(lambda a: float(np.var(a, axis=0).sum()) > 1e-2))
def test_zero_mean_gradient_gives_gain_equal_to_scale(g):
    centred = g - g.mean(axis=0, keepdims=True)
    assert float(_first_update(None)(centred)["gain"]) == pytest.approx(N_REPLICAS, rel=1e-4)


@settings(max_examples=20, deadline=None)
@given(gs=hnp.arrays(np.float32, (5, N_REPLICAS, DIM), elements=st.floats(-10, 10, width=32)))
def test_tau_never_decreases_and_advances_by_the_reported_gain(gs):
    tx, update = _stepper()
    params = jnp.zeros(DIM)
    state = tx.init(params)
    tau = 0.0
    for g in gs:
        state = update(g, state, params)
        m = optax_adascale.metrics(state)
        assert float(m["scale_invariant_steps"]) >= tau
        assert float(m["scale_invariant_steps"]) == pytest.approx(tau + float(m["gain"]), rel=1e-6)
        tau = float(m["scale_invariant_steps"])


@functools.cache
def _stepper():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    return tx, jax.jit(lambda g, s, p: update(g, s, p)[1])
