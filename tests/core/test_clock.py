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


def _steps(gain, lr=0.1):
    """The keyword AdaScale hands an inner that counts base steps: an update worth ``gain`` base steps, run by hand
    (no statistics: the guard measures nothing)."""
    return {"base_steps": optax_adascale.BaseSteps.by_hand(jnp.float32(gain), lr)}


@pytest.mark.parametrize("nesterov", [False, True])
def test_trace_at_gain_one_is_optax_trace_bit_for_bit(nesterov):
    ours, theirs = _clock.trace(BETA, nesterov=nesterov), optax.trace(BETA, nesterov=nesterov)
    params = jnp.zeros(3)
    s1, s2 = ours.init(params), theirs.init(params)
    for i in range(4):
        u1, s1 = ours.update(_grads(i), s1, **_steps(1.0))
        u2, s2 = theirs.update(_grads(i), s2)
        assert bits_equal(u1, u2) and bits_equal(s1.trace, s2.trace)


@pytest.mark.parametrize("make", [_clock.trace, lambda b: _clock.scale_by_adam(b)], ids=["trace", "scale_by_adam"])
def test_an_inner_that_counts_base_steps_refuses_to_run_without_the_gain(make):
    """Outside AdaScale it would silently be optax's per-update average: it says so and names the way out."""
    tx = make(BETA)
    with pytest.raises(ValueError, match="counts base-batch steps.*base_steps"):
        tx.update(_grads(0), tx.init(jnp.zeros(3)))


@pytest.mark.parametrize("gain", [2, 3, 7])
def test_one_update_worth_r_base_steps_leaves_the_trace_of_r_base_steps(gain):
    """``β^r m + (1 + β + … + β^{r−1}) g``: what ``r`` steps of ``optax.trace`` on the same gradient leave."""
    ours, theirs = _clock.trace(BETA), optax.trace(BETA)
    start = ours.init(jnp.zeros(3))._replace(trace=_grads(0))
    g = _grads(1)
    _, after = ours.update(g, start, **_steps(gain))
    s = optax.TraceState(trace=start.trace)
    for _ in range(gain):
        _, s = theirs.update(g, s)
    np.testing.assert_allclose(after.trace, s.trace, rtol=1e-5, atol=1e-6)  # float32, r sums


@pytest.mark.parametrize("gain", [1.0, 2.5, 17.0, 64.0])
def test_a_constant_gradient_is_a_fixed_point_at_g_over_one_minus_beta_at_every_gain(gain):
    """In the steady state the step ``r·lr·m`` is ``r`` small-batch steps of ``lr·g/(1 − β)``."""
    g = _grads(2)
    fixed = g / (1 - BETA)
    tx = _clock.trace(BETA)
    out, state = tx.update(g, tx.init(g)._replace(trace=fixed), **_steps(gain))
    np.testing.assert_allclose(out, fixed, rtol=1e-5)
    np.testing.assert_allclose(state.trace, fixed, rtol=1e-5)


def test_adam_at_gain_one_is_optax_scale_by_adam_bit_for_bit():
    ours, theirs = _clock.scale_by_adam(), optax.scale_by_adam()
    s1, s2 = ours.init(jnp.zeros(3)), theirs.init(jnp.zeros(3))
    for i in range(3):
        u1, s1 = ours.update(_grads(i), s1, **_steps(1.0))
        u2, s2 = theirs.update(_grads(i), s2)
        assert bits_equal(u1, u2) and bits_equal([s1.count, s1.mu, s1.nu], list(s2))
    assert float(s1.base_steps) == 3.0


@pytest.mark.parametrize("gain", [2, 5])
def test_adam_averages_after_an_update_worth_r_base_steps_are_those_of_r_base_steps(gain):
    """``μ``, ``ν`` as ``r`` steps of ``optax.scale_by_adam`` on the same gradient leave them; debiased by ``τ``."""
    ours, theirs = _clock.scale_by_adam(), optax.scale_by_adam()
    s2 = theirs.init(jnp.zeros(3))
    for i in range(3):  # a history of three base steps (τ = 3)
        _, s2 = theirs.update(_grads(i), s2)
    # its own count of base steps, 3, where optax's counts 3 updates (one update of gain 3 would count 1)
    start = _clock.ScaleByAdamState(count=jnp.int32(1), base_steps=jnp.float32(3), mu=s2.mu, nu=s2.nu)
    g = _grads(9)
    out, after = ours.update(g, start, **_steps(gain))
    for _ in range(gain):
        base_out, s2 = theirs.update(g, s2)
    np.testing.assert_allclose(after.mu, s2.mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after.nu, s2.nu, rtol=1e-5, atol=1e-6)
    # the direction: the r-th base step's, times r^(-1/2) (Adam's √r, made explicit)
    np.testing.assert_allclose(out, base_out / np.sqrt(gain), rtol=1e-4)
    assert int(after.count) == 2  # count still counts updates
    assert float(after.base_steps) == 3 + gain  # and base_steps the base steps: the debias reads it


def test_adam_step_under_the_gain_is_sqrt_r_times_the_learning_rate():
    """A constant gradient: Adam's direction is ±1; AdaScale's gain ``r`` makes the step ``√r·lr``."""
    tx = optax_adascale.adascale_adamw(0.1, weight_decay=0.0, axis_name="i", clock="tau")
    params = jnp.zeros(2)
    updates, state = replica_update(tx)(jnp.eye(2), tx.init(params), params)  # orthogonal: gain 2
    assert float(optax_adascale.metrics(state)["gain"]) == 2.0
    np.testing.assert_allclose(updates, -0.1 * np.sqrt(2.0) * np.ones(2), rtol=1e-5)


@pytest.mark.parametrize("clock", ["tau", "update"])
def test_one_replica_is_exactly_optax_whatever_the_clock(clock):
    """``n = S = 1``: every update is worth one base step, and the τ clock's inners are optax's own, bit for bit."""
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
    """``updates`` steps ``x ← x − gain·lr·inner(Hx)`` with ``base_steps`` worth ``gain``; ``x`` after each."""
    inner = optax.with_extra_args_support(inner)
    state = inner.init(x0)

    def body(carry, _):
        x, s = carry
        d, s = inner.update(h * x, s, **_steps(gain, lr))
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
            d, s = inner.update(g, s, **_steps(r, a))
            x = x - r * a * d
            return (x, s), 0.5 * jnp.sum(hj * x * x)

        x = jnp.asarray(x0, jnp.float32)
        return jax.lax.scan(body, (x, inner.init(x)), jax.random.split(key, updates))[1]

    measured = jax.jit(jax.vmap(one_run))(jax.random.split(jax.random.key(0), runs))
    mean, se = np.asarray(measured.mean(0)), np.asarray(measured.std(0)) / np.sqrt(runs)
    assert np.all(np.abs(mean - np.asarray(predicted)) < 4 * se + 1e-5 * np.asarray(predicted)), (mean, predicted)


# --------------------------------------------------------------------------- the stability guard, through adascale_sgd


def _run(h, x0, lr, n, noise, updates, *, nesterov=False, guard=True):
    """``adascale_sgd`` on the quadratic ``½ Σ h_i x_i²`` with ``n`` vmap replicas whose gradients are ``h·x ± ξ``
    (``ξ`` fixed, half the replicas ``+``, half ``−``: ``ḡ = h·x`` exactly, the noise seen only by the estimator,
    which then proposes a gain above 1), ``updates`` updates in one ``lax.scan``. ``guard=False``: the same τ clock
    without its guard (``optax_adascale.trace(..., guard=False)``). Returns the iterates and each update's metrics."""
    if guard:
        tx = optax_adascale.adascale_sgd(lr, momentum=BETA, nesterov=nesterov, axis_name="i")
    else:
        tx = optax_adascale.adascale(_clock.trace(BETA, nesterov=nesterov, guard=False), lr, axis_name="i")
    sign = jnp.where(jnp.arange(n) % 2 == 0, 1.0, -1.0)[:, None]
    update = replica_update(tx, jit=False)

    def step(carry, _):
        x, state = carry
        u, state = update(h * x + sign * noise, state, x)
        x = optax.apply_updates(x, u)
        m = optax_adascale.metrics(state)
        keys = ("gain", "estimated_gain", "gain_limit", "curvature", "grad_var", "scale_invariant_steps")
        return (x, state), (x, {k: m[k] for k in keys})

    (_, _), (xs, ms) = jax.jit(lambda x, s: jax.lax.scan(step, (x, s), length=updates))(x0, tx.init(x0))
    return np.asarray(xs), jax.tree.map(np.asarray, ms)


@pytest.mark.parametrize("nesterov", [False, True])
def test_on_a_quadratic_the_guarded_step_converges_where_the_unguarded_one_diverges(nesterov):
    """Known Hessian ``diag(1, 0.1, 0.01)``, 16 replicas whose noise makes the estimator propose a gain near 15 at lr
    0.05: the τ clock's update is past its stability limit along λ = 1 (r·lr·λ·(1 − β^r)/(1 − β) > 2(1 + β^r)) and
    does not converge (it swings out until the gradient's size lowers the estimated gain, then grows again: chaotic,
    so where the 200th iterate lands is chance; over the last 100 updates it keeps leaving |x₀| ≤ 1); the guard
    measures λ along its steps and caps the gain where the step lands on the minimum of that curvature: it
    converges."""
    h, x0 = jnp.asarray([1.0, 0.1, 0.01, 0.0]), jnp.asarray([1.0, 1.0, 1.0, 0.0])
    noise = jnp.asarray([0.0, 0.0, 0.0, 30.0])  # on a flat direction: the mean gradient stays h·x
    unguarded, m_off = _run(h, x0, 0.05, 16, noise, 200, nesterov=nesterov, guard=False)
    guarded, m_on = _run(h, x0, 0.05, 16, noise, 200, nesterov=nesterov)
    late = np.abs(unguarded[100:, 0])
    assert m_off["gain"].max() > 10 and not np.all(late < 1.0)  # swings past its start (large, inf or nan)
    assert np.all(np.abs(guarded[-1][:3]) < 5e-2) and abs(guarded[-1][0]) < 1e-3, guarded[-1]  # down from 1
    assert 1.0 <= m_on["gain"][5:].min() and m_on["gain"][5:].max() < 14.0  # once measured: above 1, below unstable


def _cap(lam, lr, beta=BETA):
    """The gain ``r`` solving ``lr·λ·r(1 − β^r)/((1 − β)(1 + β^r)) = 1`` (half the τ clock's stability limit,
    ``docs/noise_scale.md``), by bisection in float64: the closed form the guard's float32 cap must match."""
    f = lambda r: lr * lam * r * (1 - beta**r) / ((1 - beta) * (1 + beta**r)) - 1.0  # noqa: E731
    if f(1.0) >= 0:
        return 1.0
    lo, hi = 1.0, 2.0**24
    for _ in range(200):
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return lo


@pytest.mark.parametrize("lr", [0.05, 0.02, 0.2])
def test_the_applied_gains_and_the_credited_tau_are_the_closed_forms(lr):
    """1-D curvature λ = 1 (the other coordinate flat, carrying the replicas' noise): through ``adascale_sgd`` itself,
    each applied gain is ``min(estimated gain, 1.1·max(r_{t−1}, 1), limit_{t−1})``, each limit the float64 closed
    form ``r_cap`` at the curvature the guard holds, that curvature the float64 secant of the run's own steps (its
    expected noise removed: ``σ̄²/S`` of the state before, times the weight ``(1 − β^r)/(1 − β)`` and the step), held
    at its peak and halved by a lower one; τ the sum of the applied gains."""
    h, x0, noise, updates = jnp.asarray([1.0, 0.0]), jnp.asarray([1.0, 0.0]), jnp.asarray([0.0, 3.0]), 40
    xs, m = _run(h, x0, lr, 8, noise, updates)
    xs = np.concatenate([np.asarray(x0)[None], xs]).astype(np.float64)
    gains, est = m["gain"].astype(np.float64), m["estimated_gain"].astype(np.float64)
    prev_gain, prev_limit, curv = 1.0, np.inf, 0.0
    trace, slope, reach, noise_share = np.zeros(2), 0.0, 0.0, 0.0
    for t in range(updates):
        r = gains[t]
        np.testing.assert_allclose(r, min(est[t], 1.1 * max(prev_gain, 1.0), prev_limit), rtol=2e-6)
        g = np.asarray(h, np.float64) * xs[t]  # ḡ: the replicas' noise cancels
        crossed = lr * prev_gain * (g @ trace) if t else 0.0
        if reach > 0:
            secant = (slope - crossed - noise_share) / reach
            if secant > 0 and abs(slope - crossed) > 1e-4 * (abs(slope) + abs(crossed)):
                curv = max(secant, 0.5 * curv)
        keep, weight = BETA**r, (1 - BETA**r) / (1 - BETA)
        trace = keep * trace + weight * g
        eta = lr * r
        slope, reach = eta * (g @ trace), eta * eta * (trace @ trace)
        noise_share = eta * weight * (m["grad_var"][t - 1] / 8 if t else 0.0)
        np.testing.assert_allclose(m["curvature"][t], curv, rtol=2e-3, atol=1e-6)
        expected_limit = _cap(curv, lr) if curv > 0 else np.inf
        np.testing.assert_allclose(m["gain_limit"][t], expected_limit, rtol=2e-3)
        prev_gain, prev_limit = r, m["gain_limit"][t]
    assert np.isfinite(prev_limit) and gains.max() > gains[0]  # the cap was measured and the gain grew
    np.testing.assert_allclose(m["scale_invariant_steps"][-1], gains.sum(), rtol=2e-6)


def test_where_the_step_is_far_from_the_cap_the_guard_is_inert_bit_for_bit():
    """lr·λ small (the cap at r ≈ 10⁴): once past the growth limit's ramp, every applied gain is the estimated gain
    itself (``min(r, limit)`` is ``r``, bit for bit)."""
    h, x0, noise = jnp.asarray([1.0, 0.1, 0.0]), jnp.asarray([1.0, 1.0, 0.0]), jnp.asarray([0.0, 0.0, 3.0])
    _, m = _run(h, x0, 1e-4, 8, noise, 60)
    assert np.all(m["gain_limit"][2:] > 1e3)
    ramp = np.maximum.accumulate(m["gain"]) >= m["estimated_gain"]  # the growth limit no longer binds
    assert ramp[-20:].all() and bits_equal(m["gain"][-20:], m["estimated_gain"][-20:])


def test_the_curvature_held_once_measured_survives_updates_that_measure_nothing():
    """After a few measured secants, steps whose secant is below its float32 resolution (a vanishing gradient: the
    loss at its minimum) or negative keep the curvature and the cap: the cap never fades because the steps stopped
    measuring (it halves only by a lower measurement)."""
    h, x0, noise = jnp.asarray([1.0, 0.0]), jnp.asarray([1.0, 0.0]), jnp.asarray([0.0, 3.0])
    xs, m = _run(h, x0, 0.05, 8, noise, 400)
    assert abs(xs[-1][0]) < 1e-6  # converged: the late secants measure nothing
    measured = m["curvature"][m["curvature"] > 0]
    assert measured.size and m["curvature"][-1] >= 0.5 * measured.max() * 0.5**0  # held, not faded
    assert np.isfinite(m["gain_limit"][-1]) and m["gain"][-1] <= m["gain_limit"][-2] * (1 + 1e-6)


@pytest.mark.parametrize("gain", [2.0, 5.0])
def test_nesterov_at_gain_r_keeps_the_fixed_point_and_tracks_r_small_steps(gain):
    """Nesterov on the τ clock: a constant gradient stays at ``g/(1 − β)`` at every gain, and on a quadratic in the
    small-step regime the update at gain ``r`` follows ``optax.trace(nesterov=True)`` ``r`` base steps at a time."""
    g = _grads(3)
    tx = _clock.trace(BETA, nesterov=True)
    out, _ = tx.update(g, tx.init(g)._replace(trace=g / (1 - BETA)), **_steps(gain))
    np.testing.assert_allclose(out, g / (1 - BETA), rtol=1e-5)
    h = jnp.asarray(np.logspace(-1.0, -2.5, 16), jnp.float32)
    x0, lr, k = jnp.ones(16), 0.002, 40
    loss = lambda x: 0.5 * jnp.sum(h * x * x)  # noqa: E731
    base = _quadratic_run(optax.trace(BETA, nesterov=True), h, x0, lr, 1, int(k * gain))[int(gain) - 1 :: int(gain)]
    measured = jax.vmap(loss)(_quadratic_run(tx, h, x0, lr, gain, k))
    predicted = jax.vmap(loss)(base)
    assert float(jnp.max(jnp.abs(measured - predicted)) / (loss(x0) - predicted[-1])) < 0.05


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_trace_keeps_optax_accumulator_dtype(dtype):
    params = jnp.zeros(3, jnp.float32)
    ours, theirs = _clock.trace(BETA, accumulator_dtype=dtype), optax.trace(BETA, accumulator_dtype=dtype)
    s1, s2 = ours.init(params), theirs.init(params)
    assert s1.trace.dtype == s2.trace.dtype == dtype
    u1, s1 = ours.update(_grads(0), s1, **_steps(1.0))
    u2, s2 = theirs.update(_grads(0), s2)
    assert s1.trace.dtype == dtype and bits_equal(u1, u2) and bits_equal(s1.trace, s2.trace)
