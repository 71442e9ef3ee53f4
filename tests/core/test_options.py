"""Options of the estimator against hand-derived values: noise scale, horizon, gain_exponent, precondition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import replica_update

import optax_adascale

# --------------------------------------------------------------------------- noise scale


@pytest.mark.parametrize("sigma2, mu2", [(4.0, 1.0), (50.0, 0.5)])
def test_noise_scale_on_a_noisy_quadratic_is_sigma2_over_mu2(sigma2, mu2):
    # At a fixed point the base-batch gradient is μ + ξ with ‖μ‖² = μ², E‖ξ‖² = σ²: B_noise = σ²/μ².
    n, d, steps = 8, 512, 600
    mean = jnp.full((d,), np.sqrt(mu2 / d), jnp.float32)
    tx = optax_adascale.adascale_sgd(0.0, axis_name="i", estimator="fairscale")  # the formula, a long memory
    params = jnp.zeros(d)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")

    @jax.jit
    def run(key):
        def body(state, key):
            _, state = update(mean + jax.random.normal(key, (n, d)) * jnp.sqrt(sigma2 / d), state, params)
            return state, None

        return jax.lax.scan(body, tx.init(params), jax.random.split(key, steps))[0]

    m = optax_adascale.metrics(run(jax.random.key(0)))
    assert float(m["noise_scale"]) == pytest.approx(sigma2 / mu2, rel=0.06)
    assert float(m["grad_var"]) == pytest.approx(sigma2, rel=0.06)  # each average, not only their ratio
    assert float(m["grad_sqr"]) == pytest.approx(mu2, rel=0.06)


def test_noise_scale_reads_nan_before_the_first_update_and_inf_for_pure_noise():
    # It read 0 in both cases (0 reads as "do not scale"): NaN is "not measured yet", +inf "every batch pays".
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i")
    params = jnp.zeros(2)
    m = optax_adascale.metrics(tx.init(params))
    assert np.isnan(float(m["noise_scale"])) and not bool(m["noise_scale_measured"])
    _, state = replica_update(tx)(jnp.array([[1.0, 0.0], [-1.0, 0.0]]), tx.init(params), params)  # mean exactly 0
    m = optax_adascale.metrics(state)
    assert float(m["grad_sqr"]) == 0.0 and float(m["grad_var"]) > 0
    assert float(m["noise_scale"]) == np.inf and bool(m["noise_scale_measured"])


def test_noise_scale_is_measured_once_the_mean_gradient_shows():
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i")
    params = jnp.zeros(2)
    _, state = replica_update(tx)(jnp.array([[3.0, 0.0], [1.0, 0.0]]), tx.init(params), params)
    m = optax_adascale.metrics(state)
    assert bool(m["noise_scale_measured"])
    np.testing.assert_allclose(m["noise_scale"], float(m["grad_var"]) / float(m["grad_sqr"]), rtol=1e-6)


# --------------------------------------------------------------------------- horizon


def test_horizon_sets_the_memory_in_base_batch_steps():
    # Orthogonal replicas (gain 2 at S = 2), then identical ones. With horizon H the second update
    # weighs the first sample by θ = exp(−r₁/H) with r₁ = 2 (the first update's gain).
    H = 3.0
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", estimator=optax_adascale.Estimator(horizon=H))
    params = jnp.zeros(2)
    step = replica_update(tx)
    _, state = step(jnp.array([[1.0, 0.0], [0.0, 1.0]]), tx.init(params), params)
    s1 = optax_adascale.get_adascale_state(state)
    var1, sqr1 = float(s1.grad_var), float(s1.grad_sqr)
    assert float(s1.gain) == pytest.approx(2.0)
    _, state = step(jnp.array([[3.0, 4.0], [3.0, 4.0]]), state, params)
    s2 = optax_adascale.get_adascale_state(state)
    theta = np.exp(-2.0 / H)
    w1 = 1 - np.exp(-1.0 / H)  # the first update's θ used the initial gain 1
    w2 = theta * w1 + (1 - theta)
    var_t, sqr_t = 1e-6, 25.0 - 1e-6 / 2  # identical samples: σ̂² at the floor, μ̂² = b − σ̂²/S
    assert float(s2.grad_var) == pytest.approx((theta * w1 * var1 + (1 - theta) * var_t) / w2, rel=1e-5)
    assert float(s2.grad_sqr) == pytest.approx((theta * w1 * sqr1 + (1 - theta) * sqr_t) / w2, rel=1e-5)


def test_a_horizon_pair_gives_each_average_its_own_memory():
    grads = [jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[3.0, 4.0], [3.0, 5.0]])]
    params = jnp.zeros(2)
    runs = {}
    for name, horizon in {"short": 1.0, "long": 100.0, "pair": (100.0, 1.0)}.items():
        tx = optax_adascale.adascale(
            optax.identity(), 0.1, axis_name="i", estimator=optax_adascale.Estimator(horizon=horizon)
        )
        state = tx.init(params)
        for g in grads:
            _, state = replica_update(tx)(g, state, params)
        runs[name] = optax_adascale.get_adascale_state(state)
    assert float(runs["pair"].grad_var) == pytest.approx(float(runs["long"].grad_var), rel=1e-6)
    assert float(runs["pair"].grad_sqr) == pytest.approx(float(runs["short"].grad_sqr), rel=1e-6)


@pytest.mark.parametrize("min_updates", [None, 2.0])
def test_memory_fraction_remembers_a_fixed_fraction_of_the_progress_so_far(min_updates):
    # memory_fraction=c: θ_t = exp(−r_{t−1}/(c·τ_t)). Update 1 (τ = 0): θ = 0, the averages are the sample;
    # orthogonal replicas give σ̂² = 1, μ̂² = 0, gain 2, τ = 2. Update 2: θ = exp(−2/(c·2)); update 3:
    # θ = exp(−r₂/(c·(2 + r₂))). Identical samples [3, 4] then [0, 1]: σ̂² at the eps floor. With
    # min_updates=m the memory is max(c·τ_t, m·r_{t−1}) base steps: θ₁ = exp(−1/m) (r₀ = 1), so the debiasing
    # weight after update 1 is 1 − θ₁, not 1; then the floor decides again (c·τ = 1 < 2·2).
    c, eps, S = 0.5, 1e-6, 2.0
    tx = optax_adascale.adascale(
        optax.identity(),
        0.1,
        axis_name="i",
        estimator=optax_adascale.Estimator(memory_fraction=c, min_updates=min_updates),
    )
    params = jnp.zeros(2)
    step = replica_update(tx)
    state = tx.init(params)
    grads = [jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([[3.0, 4.0], [3.0, 4.0]]), jnp.array([[0.0, 1.0]] * 2)]
    var, sqr, w, tau, gain = 0.0, 0.0, 0.0, 0.0, 1.0
    for g, (var_t, sqr_t) in zip(grads, [(1.0, 0.0), (eps, 25.0 - eps / 2), (eps, 1.0 - eps / 2)], strict=True):
        memory = c * tau if min_updates is None else max(c * tau, min_updates * gain)
        theta = 0.0 if memory == 0 else np.exp(-gain / memory)
        w_new = theta * w + (1 - theta)
        var = (theta * w * var + (1 - theta) * var_t) / w_new
        sqr = (theta * w * sqr + (1 - theta) * sqr_t) / w_new
        w, gain = w_new, (var + sqr) / (var / S + sqr)
        tau += gain
        _, state = step(g, state, params)
        s = optax_adascale.get_adascale_state(state)
        assert float(s.grad_var) == pytest.approx(var, rel=1e-5)
        assert float(s.grad_sqr) == pytest.approx(sqr, rel=1e-5)
        assert float(s.gain) == pytest.approx(gain, rel=1e-5)
        assert float(optax_adascale.scale_invariant_steps(state)) == pytest.approx(tau, rel=1e-5)


def test_the_default_estimator_is_a_memory_of_a_twentieth_of_tau_and_at_least_four_updates():
    default = optax_adascale.Estimator()
    assert (default.memory_fraction, default.min_updates, default.unbiased_sqr) == (0.05, 4.0, True)
    assert optax_adascale.Estimator(memory_fraction=0.05).min_updates is None  # a named memory has no floor
    for other in ({"horizon": 10.0}, {"smoothing": 0.9}, {"fairscale": True}):
        with pytest.raises(ValueError, match=r"min_updates=4 bounds the memory_fraction memory"):
            optax_adascale.Estimator(min_updates=4, **other)


def test_memory_fraction_with_horizon_or_smoothing_is_rejected():
    for other in ({"horizon": 10.0}, {"smoothing": 0.9}):
        with pytest.raises(ValueError, match=r"memory_fraction=0.1"):
            optax_adascale.Estimator(memory_fraction=0.1, **other)
    for bad in (0.0, float("inf")):
        with pytest.raises(ValueError, match=r"memory_fraction must be finite in \(0.0, inf\)"):
            optax_adascale.Estimator(memory_fraction=bad)


# --------------------------------------------------------------------------- gain exponent


def test_gain_exponent_scales_the_step_by_a_power_of_the_gain_and_tau_by_the_gain():
    tx = optax_adascale.experimental.adascale(optax.identity(), 0.1, axis_name="i", gain_exponent=0.5)
    params = jnp.zeros(2)
    updates, state = replica_update(tx)(jnp.eye(2), tx.init(params), params)  # orthogonal: gain 2
    m = optax_adascale.metrics(state)
    assert float(m["gain"]) == pytest.approx(2.0)
    np.testing.assert_allclose(updates, -np.sqrt(2.0) * 0.1 * np.array([0.5, 0.5]), rtol=1e-6)
    assert float(m["learning_rate"]) == pytest.approx(np.sqrt(2.0) * 0.1, rel=1e-6)
    assert float(m["scale_invariant_steps"]) == pytest.approx(2.0)


# --------------------------------------------------------------------------- Adam-preconditioned statistics


def test_adam_preconditioned_statistics_match_a_hand_computation():
    b2, eps, n = 0.999, 1e-8, 2
    tx = optax_adascale.experimental.adascale(
        optax.scale_by_adam(b2=b2, eps=eps),
        1e-3,
        axis_name="i",
        precondition=optax_adascale.experimental.adam_preconditioner(b2=b2, eps=eps),
        estimator="fairscale",
    )
    params = jnp.zeros(2)
    first = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
    second = np.array([[2.0, 0.0], [0.0, 4.0]], np.float32)
    _, state = replica_update(tx)(jnp.asarray(first), tx.init(params), params)
    _, state = replica_update(tx)(jnp.asarray(second), state, params)

    theta = 1 - n / 1000
    # Update 1: no second moment yet, P = 1. Orthogonal unit samples: a = mean ‖g_i‖² = 1,
    # b = ‖ḡ‖² = 0.5, σ̂² = S/(n−1)·(a − b) with S = 2.
    a1, b1 = 1.0, 0.5
    var1 = 2 / (n - 1) * (a1 - b1)
    sqr1 = b1 - var1 / 2
    # Update 2: v̂ = ν/(1 − β₂) = ḡ₁² = (0.25, 0.25), so P = 1/(0.5 + ε) per coordinate.
    p = 1.0 / (0.5 + eps)
    pg = second * p
    a2 = np.mean(np.sum(pg**2, axis=1))
    b2_ = np.sum(pg.mean(0) ** 2)
    var2 = max(2 / (n - 1) * (a2 - b2_), 1e-6)
    sqr2 = max(b2_ - var2 / 2, 0.0)
    w2 = theta * (1 - theta) + (1 - theta)
    var = (theta * (1 - theta) * var1 + (1 - theta) * var2) / w2
    sqr = (theta * (1 - theta) * max(sqr1, 0.0) + (1 - theta) * sqr2) / w2
    s = optax_adascale.get_adascale_state(state)
    # rel 1e-4: Adam's bias correction 1 − β₂ᵗ is computed in float32 (1 − 0.999 is off by 5e-5 relative).
    assert float(s.grad_var) == pytest.approx(var, rel=1e-4)
    assert float(s.grad_sqr) == pytest.approx(sqr, rel=1e-4)
    assert float(s.gain) == pytest.approx((var + sqr) / (var / 2 + sqr), rel=1e-4)


def test_adam_preconditioner_without_adam_in_inner_names_the_fix():
    tx = optax_adascale.experimental.adascale(
        optax.trace(0.9), 0.1, accumulation_steps=2, precondition=optax_adascale.experimental.adam_preconditioner()
    )
    with pytest.raises(ValueError, match="scale_by_adam"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))


# --------------------------------------------------------------------------- unbiased μ̄²


def test_unbiased_sqr_averages_the_unfloored_estimate_and_floors_only_the_average():
    # Update 1: samples [1, 0] and [−0.5, 0.5]: a = 0.75, ḡ = (0.25, 0.25), b = 0.125; n = S = 2 gives
    # σ̂² = 2·(a − b) = 1.25 and μ̂² = b − σ̂²/2 = −0.5 (FairScale floors it at 0).
    # Update 2: identical samples [3, 4]: σ̂² at the eps floor, μ̂² = 25 − eps/2.
    n, eps = 2, 1e-6
    theta = 1 - n / 1000
    w2 = theta * (1 - theta) + (1 - theta)
    sqr2 = 25.0 - eps / 2
    params = jnp.zeros(2)
    steps = [jnp.array([[1.0, 0.0], [-0.5, 0.5]]), jnp.array([[3.0, 4.0], [3.0, 4.0]])]
    for unbiased, first in ((False, 0.0), (True, -0.5)):
        estimator = optax_adascale.Estimator(smoothing=theta, unbiased_sqr=unbiased)
        tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", estimator=estimator)
        _, state = replica_update(tx)(steps[0], tx.init(params), params)
        s = optax_adascale.get_adascale_state(state)
        assert float(s.grad_sqr) == pytest.approx(first, abs=1e-6)
        assert float(optax_adascale.metrics(state)["grad_sqr"]) == 0.0  # readers floor the average
        assert float(s.gain) == pytest.approx(2.0)  # μ̄² ≤ 0: pure noise, gain S
        _, state = replica_update(tx)(steps[1], state, params)
        s = optax_adascale.get_adascale_state(state)
        assert float(s.grad_sqr) == pytest.approx((theta * (1 - theta) * first + (1 - theta) * sqr2) / w2, rel=1e-6)


def test_adam_preconditioner_floor_keeps_a_coordinate_without_history_from_pinning_the_gain():
    # A coordinate whose first gradients are zero has v̂ = 0: without a floor its P ≈ 1/ε = 1e8, one such
    # sample dominates the moving averages and the gain stays at S for the rest of the run.
    def final_gain(zero_first_column, relative_floor):
        tx = optax_adascale.experimental.adascale(
            optax.scale_by_adam(),
            1e-3,
            axis_name="i",
            precondition=optax_adascale.experimental.adam_preconditioner(relative_floor=relative_floor),
            estimator="fairscale",
        )
        params, key = jnp.zeros(3), jax.random.key(0)
        state, step = tx.init(params), replica_update(tx)
        for t in range(200):
            key, k = jax.random.split(key)
            g = 1.0 + jax.random.normal(k, (4, 3))
            if t == 0 and zero_first_column:
                g = g.at[:, 2].set(0.0)
            _, state = step(g, state, params)
        return float(optax_adascale.metrics(state)["gain"])

    clean = final_gain(False, 1e-2)
    assert final_gain(True, 0.0) == pytest.approx(4.0, rel=1e-3)  # the failure the floor prevents
    assert final_gain(True, 1e-2) == pytest.approx(clean, rel=0.15)


# --------------------------------------------------------------------------- adascale_adamw


def test_adascale_adamw_at_scale_one_is_optax_adamw():
    params = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]]), "b": jnp.array([0.1, -0.1])}
    kw = dict(b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.05)
    ours, ref = optax_adascale.adascale_adamw(3e-3, **kw), optax.adamw(3e-3, **kw)
    s_ours, s_ref = ours.init(params), ref.init(params)
    for t in range(5):
        grads = jax.tree.map(lambda p, t=t: jnp.sin(p * (t + 1)), params)
        u_ours, s_ours = ours.update(grads, s_ours, params)
        u_ref, s_ref = ref.update(grads, s_ref, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), u_ours, u_ref)
        params = optax.apply_updates(params, u_ref)


@pytest.mark.parametrize("clock", ["tau", "update"])
def test_adascale_adamw_scales_adams_direction_by_root_gain_and_the_decay_by_the_gain(clock):
    # Two orthogonal samples: gain r = 2. First Adam step: m̂ = ḡ, v̂ = ḡ², direction ḡ/(|ḡ| + ε). On the τ clock
    # the direction is scaled by r^(−½), so the Adam step is √r·lr (core/_clock.py), and the decoupled decay wd·p
    # joins it at the full r (the decay per base-batch step stays the S = 1 one); on the update clock (0.3's rule)
    # the gain multiplies both.
    lr, wd, eps, r = 1e-2, 0.1, 1e-8, 2.0
    params = jnp.array([2.0, -4.0])
    tx = optax_adascale.adascale_adamw(lr, weight_decay=wd, eps=eps, axis_name="i", clock=clock)
    updates, state = replica_update(tx)(jnp.array([[1.0, 0.0], [0.0, 1.0]]), tx.init(params), params)
    mean = np.array([0.5, 0.5])
    direction = mean / (np.abs(mean) + eps) * (r**-0.5 if clock == "tau" else 1.0)
    expected = -r * lr * (direction + wd * np.array([2.0, -4.0]))
    np.testing.assert_allclose(updates, expected, rtol=1e-4)  # Adam's 1 − β₂ᵗ in float32: 2e-5 relative
    assert float(optax_adascale.metrics(state)["gain"]) == pytest.approx(r)


R_PARAMS = jnp.zeros(3)


def vmap_update(tx, grads, state, params):
    """``tx.update`` with the replicas as a vmap axis ``"i"`` (one gradient row per replica)."""
    return jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")(grads, state, params)


# --------------------------------------------------------------------------- bug 4: a long horizon


def test_a_horizon_beyond_float32_resolution_averages_the_samples():
    # H = 1e9: θ = exp(−r/H) rounds to 1.0 in float32. As H → ∞, 1 − θ_t → r_{t−1}/H, so the debiased
    # average tends to the mean of the samples weighted by the previous gain; computed by hand from
    # each step's a and b.
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(6, 2, 3)).astype(np.float32) + np.float32(0.5)
    tx = optax_adascale.adascale(
        optax.identity(), 0.1, axis_name="i", estimator=optax_adascale.Estimator(horizon=1e9, unbiased_sqr=False)
    )
    state = tx.init(R_PARAMS)
    var_sum = sqr_sum = total = 0.0
    for g in grads:
        weight = float(state.gain)  # r_{t−1}: 1 before the first update
        _, state = vmap_update(tx, jnp.asarray(g), state, R_PARAMS)
        a = np.mean(np.sum(g.astype(np.float64) ** 2, axis=1))
        b = np.sum(np.mean(g.astype(np.float64), axis=0) ** 2)
        var = max(2 / (2 - 1) * (a - b), 1e-6)
        var_sum += weight * var
        sqr_sum += weight * max(b - var / 2, 0.0)
        total += weight
        v, m = var_sum / total, sqr_sum / total
        expected = min(max((v + m) / (v / 2 + m), 1.0), 2.0)
        assert float(optax_adascale.metrics(state)["gain"]) == pytest.approx(expected, rel=1e-4)
    assert float(optax_adascale.metrics(state)["gain"]) > 1.05  # not the stuck gain of 1


def test_a_horizon_beyond_float32_resolution_reports_a_finite_noise_scale():
    rng = np.random.default_rng(1)
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", estimator=optax_adascale.Estimator(horizon=1e9))
    state = tx.init(R_PARAMS)
    for _ in range(3):
        _, state = vmap_update(tx, jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) + 1.0, state, R_PARAMS)
    m = optax_adascale.metrics(state)
    assert np.isfinite(float(m["grad_var"])) and float(m["grad_var"]) > 0
    assert 0 < float(m["noise_scale"]) < np.inf


def test_noise_scale_of_a_non_finite_state_is_nan_not_zero():
    state = optax_adascale.adascale_sgd(0.1, accumulation_steps=2).init(R_PARAMS)
    state = state._replace(grad_var=jnp.float32(np.nan), grad_sqr=jnp.float32(np.nan))
    assert np.isnan(float(optax_adascale.metrics(state)["noise_scale"]))


def test_non_finite_moving_averages_skip_the_update():
    # A state whose averages are NaN (e.g. restored from a broken run) must not produce updates. (The default
    # memory, a fraction of τ, forgets everything at τ = 0; FairScale's keeps the NaN.)
    tx = optax_adascale.adascale(optax.identity(), 0.1, axis_name="i", estimator="fairscale")
    state = tx.init(R_PARAMS)._replace(grad_var=jnp.float32(np.nan), ema_weight=jnp.float32(0.5))
    updates, new_state = vmap_update(tx, jnp.eye(2, 3), state, R_PARAMS)
    np.testing.assert_array_equal(np.asarray(updates), 0.0)
    assert int(new_state.skipped_steps) == 1 and int(new_state.count) == 0


# --------------------------------------------------------------------------- bug 5: horizon's shape


@pytest.mark.parametrize(
    "horizon", [(2.0, None), (1, 2, 3), (2.0,), ()], ids=["none_inside", "triple", "single", "empty"]
)
def test_a_horizon_tuple_that_is_not_a_pair_of_numbers_is_rejected_at_construction(horizon):
    with pytest.raises((ValueError, TypeError), match=r"horizon.*got horizon="):
        optax_adascale.Estimator(horizon=horizon)
