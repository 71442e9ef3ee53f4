"""The τ clock (``core/_clock``): momentum and Adam's averages that count base-batch steps, checked against optax.

Independent truths: ``optax.trace`` / ``optax.scale_by_adam`` run ``r`` base steps on the same gradient (what one
update worth ``r`` base steps must reproduce), their fixed points, and a quadratic with a known Hessian on which the
τ-clock run at gain ``r`` follows the small-batch run ``r`` steps at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits_equal, replica_update

import optax_adascale
from optax_adascale.core import _clock

BETA = 0.9


def _grads(seed, shape=(3,)):
    return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_without_a_gain_or_at_gain_one_is_optax_trace_bit_for_bit(nesterov):
    ours, theirs = _clock.trace(BETA, nesterov=nesterov), optax.trace(BETA, nesterov=nesterov)
    params = jnp.zeros(3)
    for gain in (None, 1.0):
        s1, s2 = ours.init(params), theirs.init(params)
        for i in range(4):
            extra = {} if gain is None else {"adascale_gain": jnp.float32(gain)}
            u1, s1 = ours.update(_grads(i), s1, **extra)
            u2, s2 = theirs.update(_grads(i), s2)
            assert bits_equal(u1, u2) and bits_equal(s1, s2)


@pytest.mark.parametrize("gain", [2, 3, 7])
def test_one_update_worth_r_base_steps_leaves_the_trace_of_r_base_steps(gain):
    """``β^r m + (1 + β + … + β^{r−1}) g``: what ``r`` steps of ``optax.trace`` on the same gradient leave."""
    ours, theirs = _clock.trace(BETA), optax.trace(BETA)
    start = optax.TraceState(trace=_grads(0))
    g = _grads(1)
    _, after = ours.update(g, start, adascale_gain=jnp.float32(gain))
    s = start
    for _ in range(gain):
        _, s = theirs.update(g, s)
    np.testing.assert_allclose(after.trace, s.trace, rtol=1e-5, atol=1e-6)  # float32, r sums


@pytest.mark.parametrize("gain", [1.0, 2.5, 17.0, 64.0])
def test_a_constant_gradient_is_a_fixed_point_at_g_over_one_minus_beta_at_every_gain(gain):
    """In the steady state the step ``r·lr·m`` is ``r`` small-batch steps of ``lr·g/(1 − β)``."""
    g = _grads(2)
    fixed = g / (1 - BETA)
    out, state = _clock.trace(BETA).update(g, optax.TraceState(trace=fixed), adascale_gain=jnp.float32(gain))
    np.testing.assert_allclose(out, fixed, rtol=1e-5)
    np.testing.assert_allclose(state.trace, fixed, rtol=1e-5)


def test_adam_without_a_gain_is_optax_scale_by_adam_bit_for_bit():
    ours, theirs = _clock.scale_by_adam(), optax.scale_by_adam()
    s1, s2 = ours.init(jnp.zeros(3)), theirs.init(jnp.zeros(3))
    for i in range(3):
        u1, s1 = ours.update(_grads(i), s1)
        u2, s2 = theirs.update(_grads(i), s2)
        assert bits_equal(u1, u2) and bits_equal(s1, s2)


@pytest.mark.parametrize("gain", [2, 5])
def test_adam_averages_after_an_update_worth_r_base_steps_are_those_of_r_base_steps(gain):
    """``μ``, ``ν`` as ``r`` steps of ``optax.scale_by_adam`` on the same gradient leave them; debiased by ``τ``."""
    ours, theirs = _clock.scale_by_adam(), optax.scale_by_adam()
    s2 = theirs.init(jnp.zeros(3))
    for i in range(3):  # a history of three base steps (τ = 3)
        _, s2 = theirs.update(_grads(i), s2)
    start = optax.ScaleByAdamState(count=jnp.int32(1), mu=s2.mu, nu=s2.nu)
    g = _grads(9)
    out, after = ours.update(g, start, adascale_gain=jnp.float32(gain), adascale_tau=jnp.float32(3))
    for _ in range(gain):
        base_out, s2 = theirs.update(g, s2)
    np.testing.assert_allclose(after.mu, s2.mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after.nu, s2.nu, rtol=1e-5, atol=1e-6)
    # the direction: the r-th base step's, times r^(-1/2) (Adam's √r, made explicit)
    np.testing.assert_allclose(out, base_out / np.sqrt(gain), rtol=1e-4)
    assert int(after.count) == 2  # count still counts updates


def test_adam_step_under_the_gain_is_sqrt_r_times_the_learning_rate():
    """A constant gradient: Adam's direction is ±1; AdaScale's gain ``r`` makes the step ``√r·lr``."""
    tx = optax_adascale.adascale_adamw(0.1, weight_decay=0.0, axis_name="i", clock="tau")
    params = jnp.zeros(2)
    updates, state = replica_update(tx)(jnp.eye(2), tx.init(params), params)  # orthogonal: gain 2
    assert float(optax_adascale.metrics(state)["gain"]) == 2.0
    np.testing.assert_allclose(updates, -0.1 * np.sqrt(2.0) * np.ones(2), rtol=1e-5)


@pytest.mark.parametrize("clock", ["tau", "update"])
def test_one_replica_is_exactly_optax_whatever_the_clock(clock):
    """``n = S = 1`` passes no gain to ``inner``: the τ clock's inners are optax's own, bit for bit."""
    params = {"w": jnp.ones(3)}
    for ours, theirs in (
        (optax_adascale.adascale_sgd(0.1, momentum=BETA, clock=clock), optax.sgd(0.1, momentum=BETA)),
        (optax_adascale.adascale_adamw(1e-2, clock=clock), optax.adamw(1e-2, weight_decay=1e-4)),
    ):
        s1, s2, p1, p2 = ours.init(params), theirs.init(params), params, params
        for i in range(3):
            g = {"w": _grads(i)}
            u1, s1 = ours.update(g, s1, p1)
            u2, s2 = theirs.update(g, s2, p2)
            p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        assert bits_equal(p1, p2)


def test_an_unknown_clock_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="clock"):
        optax_adascale.adascale_sgd(0.1, momentum=BETA, clock="updates")


# --------------------------------------------------------------------------- the analytic case


def _quadratic_run(inner, h, x0, lr, gain, updates):
    """``updates`` steps ``x ← x − gain·lr·inner(Hx)`` with ``adascale_gain = gain``; ``x`` after each."""
    inner = optax.with_extra_args_support(inner)
    state = inner.init(x0)

    def body(carry, _):
        x, s = carry
        d, s = inner.update(h * x, s, adascale_gain=jnp.float32(gain))
        x = x - gain * lr * d
        return (x, s), x

    return jax.lax.scan(body, (x0, state), None, length=updates)[1]


@pytest.mark.parametrize("gain", [4, 8])
def test_on_a_quadratic_an_update_at_gain_r_does_the_work_of_r_small_steps_on_the_tau_clock_only(gain):
    """Known Hessian ``H = diag(h)``, the small-step (SDE) regime of momentum SGD: the loss after ``k`` updates at
    gain ``r`` is predicted to be the small batch's after ``k·r`` steps. On the τ clock it is, to a few per cent of the
    progress; on the paper's clock (momentum per update) the buffer of ``r/(1 − β)`` base steps overshoots it by
    much more (the over-credit ``benchmarks/scale_quality`` measures)."""
    h = jnp.asarray(np.logspace(-1.0, -2.5, 16), jnp.float32)
    x0 = jnp.ones(16)
    lr, k = 0.002, 40
    loss = lambda x: 0.5 * jnp.sum(h * x * x)  # noqa: E731
    base = _quadratic_run(optax.trace(BETA), h, x0, lr, 1, k * gain)[gain - 1 :: gain]
    predicted = jax.vmap(loss)(base)
    start = loss(x0)
    for inner, bound in ((_clock.trace(BETA), 0.05), (optax.trace(BETA), None)):
        measured = jax.vmap(loss)(_quadratic_run(inner, h, x0, lr, gain, k))
        error = float(jnp.max(jnp.abs(measured - predicted)) / (start - predicted[-1]))
        if bound is not None:
            assert error < bound, error
            tau_error = error
        else:
            assert error > 3 * tau_error, (error, tau_error)


@pytest.mark.parametrize("gain", [2, 8, 32])
def test_the_tau_clocks_stability_limit_is_the_documented_one_and_below_heavy_balls(gain):
    """``docs/noise_scale.md``: along a curvature λ the τ clock's update at gain ``r`` is stable while
    ``r·lr·λ·(1 − β^r)/(1 − β) < 2(1 + β^r)`` (its linear map's Jury conditions), heavy-ball's (the update clock)
    while ``r·lr·λ < 2(1 + β)``: at 0.98× its limit the τ clock decays, at 1.02× it grows, and its limit is the
    lower one (by 2× at r = 2, 18× at r = 32)."""
    h = jnp.ones(1)
    power = BETA**gain
    tau_limit = 2 * (1 + power) * (1 - BETA) / (gain * (1 - power))  # lr·λ
    heavy_ball_limit = 2 * (1 + BETA) / gain
    assert tau_limit < heavy_ball_limit
    for factor, grows in ((0.98, False), (1.02, True)):
        xs = _quadratic_run(_clock.trace(BETA), h, jnp.ones(1), factor * tau_limit, gain, 2000)
        assert (not float(jnp.abs(xs[-1, 0])) < 1.0) == grows, (factor, xs[-1])  # grown: large, inf or nan
    xs = _quadratic_run(optax.trace(BETA), h, jnp.ones(1), 1.02 * tau_limit, gain, 2000)
    assert float(jnp.abs(xs[-1, 0])) < 1e-3  # heavy-ball at the τ clock's unstable rate: it converges


@pytest.mark.parametrize("rule", ["tau", "paper"])
def test_on_a_noisy_quadratic_the_expected_loss_of_updates_at_gain_r_is_the_closed_forms(rule):
    """The noisy quadratic with known ``H`` (``benchmarks/scale_quality/analytic.py``: the second moments of
    ``(x, m)`` evolve exactly by ``M ← A M Aᵀ + b bᵀ Σ/(B·S)``): the predicted expected loss after each of 60 updates at
    gain r = 5, S = 8, equals the mean over 4096 sampled runs of the package's inner (the τ clock's trace, or
    optax's per-update trace: the paper's rule) to the Monte-Carlo error."""
    from benchmarks.scale_quality import analytic

    h = np.logspace(0.0, -2.0, 8)
    noise, x0, r, S, a, updates, runs = h.copy(), np.ones(8), 5.0, 8, 0.03, 60, 4096
    A, b = analytic.transition(rule, r, a, h, BETA)
    M = np.zeros((8, 2, 2))
    M[:, 0, 0] = x0**2
    predicted = []
    for _ in range(updates):
        M = np.einsum("dij,djk,dlk->dil", A, M, A) + np.einsum("di,dj->dij", b, b) * (noise / S)[:, None, None]
        predicted.append(0.5 * float(np.sum(h * M[:, 0, 0])))

    inner = optax.with_extra_args_support(_clock.trace(BETA) if rule == "tau" else optax.trace(BETA))
    hj, scale = jnp.asarray(h, jnp.float32), jnp.asarray(np.sqrt(noise / S), jnp.float32)

    def one_run(key):
        def body(carry, k):
            x, s = carry
            g = hj * x + scale * jax.random.normal(k, x.shape)
            d, s = inner.update(g, s, adascale_gain=jnp.float32(r))
            x = x - r * a * d
            return (x, s), 0.5 * jnp.sum(hj * x * x)

        x = jnp.asarray(x0, jnp.float32)
        return jax.lax.scan(body, (x, inner.init(x)), jax.random.split(key, updates))[1]

    measured = jax.jit(jax.vmap(one_run))(jax.random.split(jax.random.key(0), runs))
    mean, se = np.asarray(measured.mean(0)), np.asarray(measured.std(0)) / np.sqrt(runs)
    assert np.all(np.abs(mean - np.asarray(predicted)) < 4 * se + 1e-5 * np.asarray(predicted)), (mean, predicted)
