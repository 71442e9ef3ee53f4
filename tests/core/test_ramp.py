"""The batch follows the noise: ``accumulation_steps=BatchRamp(...)``.

* The controller against hand-worked rungs: the measured target ``S* = (B + 1)/e − B``, the ladder, the hysteresis
  (no flip-flop between neighbours), the patience, a skipped update, a non-finite target.
* The mechanism against independent truth: a ramp pinned at ``k`` is ``accumulation_steps=k`` (bit for bit), and a
  scheduled ramp is the same training as a sequence of fixed-``k`` optimizers carried over by ``transfer_state``.
* One compile for a whole ramp from the lowest rung to the highest (the jit cache and JAX's compile events).
* The estimator with a traced ``n`` is the formula; AdamW ramps too; the readers; the refusals.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import backend_compiles, bits_equal

import optax_adascale
from optax_adascale.core import _ramp
from optax_adascale.core._estimator import step_moments

R = 2  # replicas on a vmap axis


# --------------------------------------------------------------------------- the controller, by hand


def inputs(noise_scale, *, per_microbatch=2, updates=10):
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    i = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return optax_adascale.RampInputs(
        tau=f(100.0),
        updates=i(updates),
        noise_scale=f(noise_scale),
        gain=f(1.5),
        microbatches=i(1),
        scale_per_microbatch=i(per_microbatch),
        microbatches_seen=i(50),
    )


def decide(ramp, k, noise_scale, *, streak=0, applied=True, per_microbatch=2):
    """``(k, streak)`` after one update at ``k``; ``streak``: the samples of the updates that already asked to move
    (this update holds ``k × per_microbatch``)."""
    state = _ramp.RampState(
        jnp.asarray(k, jnp.int32), jnp.asarray(streak, jnp.int32), jnp.int32(50), jnp.int32(per_microbatch)
    )
    update = inputs(noise_scale, per_microbatch=per_microbatch)._replace(microbatches=jnp.asarray(k, jnp.int32))
    new = _ramp.after_update(ramp, state, update, jnp.bool_(applied))
    return int(new.microbatches), int(new.streak)


def _walk(ramp, k, noise_scale, per_microbatch=2):
    """The rungs the measured controller visits from ``k`` under a steady noise scale, one decision each."""
    path = [k]
    for _ in range(8):
        k = decide(ramp, k, noise_scale, per_microbatch=per_microbatch)[0]
        if k == path[-1]:
            return path
        path.append(k)
    return path


# B → S* = (B + 1)/0.9 − B = B/9 + 10/9 → k* = S*/2 (two samples per micro-batch step) → the largest rung ≤ k*.
@pytest.mark.parametrize(
    ("noise_scale", "expected"),
    [(0.0, 1), (10.0, 1), (30.0, 2), (60.0, 2), (70.0, 4), (130.0, 4), (140.0, 8), (280.0, 16), (np.inf, 16)],
)
def test_the_measured_target_from_one_rung_is_the_largest_rung_within_the_efficiency(noise_scale, expected):
    # k* by hand: B = 10 → 1.11, 30 → 2.22, 60 → 3.89, 70 → 4.44, 130 → 7.78, 140 → 8.33, 280 → 16.1. The controller
    # walks there one rung a decision (a noisy estimate never jumps the ladder): 1 → 2 → 4 → … → the target.
    ramp = optax_adascale.BatchRamp(1, 16, efficiency=0.9, patience=1)
    path = _walk(ramp, 1, noise_scale)
    assert path[-1] == expected
    assert path == [r for r in ramp.ladder if r <= expected]  # every rung on the way, none skipped


def test_the_critical_batch_efficiency_one_half_targets_b_plus_two():
    ramp = optax_adascale.BatchRamp(1, 16, efficiency=0.5, patience=1)
    assert _walk(ramp, 1, 6.0, per_microbatch=1)[-1] == 8  # S* = 6 + 2 = 8
    assert _walk(ramp, 1, 5.9, per_microbatch=1)[-1] == 4  # S* = 7.9


@pytest.mark.parametrize(
    ("k", "k_star", "expected"),
    [
        (4, 3.9, 4),  # inside the dead band [k/h, next rung): stay
        (4, 2.0, 4),  # exactly k/h: stay
        (4, 1.99, 2),  # below k/h = 2: down to the largest rung ≤ k*·h = 3.98
        (4, 0.9, 1),  # k*·h = 1.8: down to 1
        (4, 7.9, 4),  # the next rung is not reached yet
        (4, 8.0, 8),
        (4, 40.0, 16),
    ],
)
def test_hysteresis_moves_up_at_the_next_rung_and_down_only_below_k_over_h(k, k_star, expected):
    ramp = optax_adascale.BatchRamp(1, 16, patience=1, policy=lambda inp: jnp.float32(k_star))
    assert decide(ramp, k, 0.0)[0] == expected


def test_a_target_wandering_around_a_rung_boundary_changes_the_rung_once():
    targets = [3.6, 4.3, 3.7, 4.6, 3.2, 4.1, 2.9, 4.4, 3.0, 4.9]  # around the 2 → 4 boundary
    k, history = 2, []
    for t in targets:
        k, _ = decide(optax_adascale.BatchRamp(1, 16, patience=1, policy=lambda inp, t=t: jnp.float32(t)), k, 0.0)
        history.append(k)
    assert history == [2, 4, 4, 4, 4, 4, 4, 4, 4, 4]  # default hysteresis 2: back to 2 only below k* = 2


def test_patience_counts_the_samples_of_consecutive_updates_asking_the_same_way():
    up = optax_adascale.BatchRamp(1, 16, patience=8, policy=lambda inp: jnp.float32(16))
    assert decide(up, 1, 0.0, streak=4) == (1, 6)  # n = 2 more samples asking to go up: 6 of 8
    assert decide(up, 1, 0.0, streak=6) == (16, 0)  # 8: move, and the streak restarts
    assert decide(up, 1, 0.0, streak=-6) == (1, 2)  # it asked to go down before: a new streak
    down = optax_adascale.BatchRamp(1, 16, patience=8, policy=lambda inp: jnp.float32(1))
    assert decide(down, 8, 0.0) == (2, 0)  # one update of n = 16 samples is enough; down to the largest rung ≤ 2
    stay = optax_adascale.BatchRamp(1, 16, patience=8, policy=lambda inp: jnp.float32(6))
    assert decide(stay, 4, 0.0, streak=6) == (4, 0)  # inside the dead band: the streak is broken


def test_one_noisy_estimate_moves_nothing():
    targets = [1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 50.0, 50.0, 50.0, 50.0]  # a one-update spike, then a real change
    k, streak, history = 1, 0, []
    for t in targets:
        ramp = optax_adascale.BatchRamp(1, 16, patience=8, policy=lambda inp, t=t: jnp.float32(t))  # 4 updates
        k, streak = decide(ramp, k, 0.0, streak=streak)
        history.append(k)
    assert history == [1, 1, 1, 1, 1, 1, 1, 1, 1, 16]


def test_a_skipped_update_or_a_nan_target_moves_nothing():
    ramp = optax_adascale.BatchRamp(1, 16, patience=2)
    assert decide(ramp, 2, 1e6, applied=False, streak=1) == (2, 1)  # a skipped update leaves the streak be
    assert decide(ramp, 2, np.nan, streak=1) == (2, 0)


def test_the_default_ladder_is_the_powers_of_two_between_the_ends():
    assert optax_adascale.BatchRamp(1, 16).ladder == (1, 2, 4, 8, 16)
    assert optax_adascale.BatchRamp(3, 20).ladder == (3, 4, 8, 16, 20)
    assert optax_adascale.BatchRamp(4, 4).ladder == (4,)
    assert optax_adascale.BatchRamp(1, 6, ladder=[1, 3, 6]).ladder == (1, 3, 6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_microbatches=0, max_microbatches=4), "min_microbatches"),
        (dict(min_microbatches=8, max_microbatches=4), "min_microbatches <= max_microbatches"),
        (dict(min_microbatches=1, max_microbatches=8, ladder=(1, 4, 2, 8)), "ladder must increase"),
        (dict(min_microbatches=1, max_microbatches=8, ladder=(2, 4, 8)), "ladder must increase"),
        (dict(min_microbatches=1, max_microbatches=8, efficiency=1.0), "efficiency"),
        (dict(min_microbatches=1, max_microbatches=8, efficiency=0.0), "efficiency"),
        (dict(min_microbatches=1, max_microbatches=8, hysteresis=0.5), "hysteresis"),
        (dict(min_microbatches=1, max_microbatches=8, patience=0), "patience"),
        (dict(min_microbatches=1, max_microbatches=8, policy="fast"), "policy"),
        (dict(min_microbatches=1.5, max_microbatches=8), "min_microbatches"),
    ],
)
def test_a_bad_ramp_raises_naming_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        optax_adascale.BatchRamp(**kwargs)


# --------------------------------------------------------------------------- refusals


def test_fairscale_estimator_with_a_ramp_raises_naming_the_fix():
    ramp = optax_adascale.BatchRamp(2, 8)
    with pytest.raises(ValueError, match=r"θ = max\(1 − n/1000, 0\).*smoothing="):
        optax_adascale.adascale_sgd(0.1, accumulation_steps=ramp, estimator="fairscale")
    # FairScale's estimator with a fixed θ is defined for any n: accepted.
    optax_adascale.adascale_sgd(
        0.1, accumulation_steps=ramp, estimator=optax_adascale.Estimator(fairscale=True, smoothing=0.9)
    )


def test_a_scale_with_a_ramp_raises():
    with pytest.raises(ValueError, match="takes no scale="):
        optax_adascale.adascale_sgd(0.1, accumulation_steps=optax_adascale.BatchRamp(2, 8), scale=4.0)


def test_one_sample_at_the_lowest_rung_raises_naming_the_fix():
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=optax_adascale.BatchRamp(1, 8))
    params = jnp.zeros(2)
    with pytest.raises(ValueError, match=r"n = 1 gradient sample.*min_microbatches >= 2"):
        tx.update(jnp.ones(2), tx.init(params), params)
    # Two replicas give n = 2 at k = 1: fine.
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=optax_adascale.BatchRamp(1, 8))
    state = optax_adascale.replicate_buffers(tx.init(params), R)
    axes = optax_adascale.state_axes(state)
    jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")(jnp.eye(2), state, params)


def test_a_state_without_ramp_raises_and_batch_plan_needs_a_ramp():
    params = jnp.zeros(2)
    static = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    ramped = optax_adascale.adascale_sgd(0.1, accumulation_steps=optax_adascale.BatchRamp(2, 8))
    with pytest.raises(ValueError, match="no ramp state"):
        ramped.update(jnp.ones(2), static.init(params), params)
    with pytest.raises(ValueError, match="BatchRamp"):
        optax_adascale.batch_plan(static.init(params))
    assert "microbatches" not in optax_adascale.metrics(static.init(params))


# --------------------------------------------------------------------------- the mechanism


def noisy_grads(call, *, growth=0.0, dim=3):
    """Per-replica gradients ``1 + σ_t·ξ`` (``σ_t² = e^{growth·call}``), stacked over the R replicas."""
    key = jax.random.fold_in(jax.random.key(7), call)
    sigma = np.exp(0.5 * growth * call)
    return {"w": 1.0 + sigma * jax.random.normal(key, (R, dim)), "b": sigma * jax.random.normal(key, (R,))}


PARAMS = {"w": jnp.zeros(3), "b": jnp.zeros(())}
WIDE = {"w": jnp.zeros(64), "b": jnp.zeros(())}  # a μ² the estimator can measure at a noise scale of 100


def vmapped(tx, name="step", params=PARAMS):
    state = optax_adascale.replicate_buffers(tx.init(params), R)
    axes = optax_adascale.state_axes(state)

    def body(g, s, p):
        return tx.update(g, s, p)

    body.__name__ = name
    return state, jax.jit(jax.vmap(body, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i"))


def train(tx, calls, **grads_kw):
    state, step = vmapped(tx)
    params, ks = PARAMS, []
    for call in range(calls):
        updates, state = step(noisy_grads(call, **grads_kw), state, params)
        params = optax.apply_updates(params, updates)
        s = optax_adascale.get_adascale_state(state)
        if s.ramp is not None and int(s.micro_step) == 0:
            ks.append(int(s.ramp.microbatches))
    return params, state, ks


PINNED_SCHEDULE = optax.cosine_decay_schedule(0.1, 200)  # τ passes 10 in 40 calls: the schedule moves


@pytest.mark.parametrize(
    "factory, clock, k",
    [("sgd", "update", 2), ("sgd", "update", 3), ("sgd", "update", 4), ("sgd", "tau", 4), ("adamw", "tau", 4)],
    ids=["sgd-update-k2", "sgd-update-k3", "sgd-update-k4", "sgd-tau-k4", "adamw-tau-k4"],
)
def test_a_ramp_pinned_at_k_is_accumulation_steps_k(factory, clock, k):
    """Over 40 calls under vmap with a cosine schedule, on each clock: bit for bit on the default ladder's powers of
    two; at k = 3 the division by a traced 3 may round apart from XLA's division by the constant (1 ulp)."""
    if factory == "sgd":
        make = functools.partial(optax_adascale.adascale_sgd, PINNED_SCHEDULE, momentum=0.9, axis_name="i", clock=clock)
    else:
        make = functools.partial(
            optax_adascale.adascale_adamw, PINNED_SCHEDULE, weight_decay=1e-2, axis_name="i", clock=clock
        )
    (p1, s1), (p2, s2) = (
        _every_call(make(accumulation_steps=steps), 40) for steps in (k, optax_adascale.BatchRamp(k, k))
    )
    assert int(s1[-1].count) == 40 // k and int(s1[-1].tau_whole) > 10  # the schedule moved
    # JAX 0.10's XLA:CPU (at the tests' -O0) rounds AdamW's parameter update −r·lr·(r^(−½)·d + wd·p) 1 ulp apart in the
    # two programs from the third update on (not with wd = 0, on the update clock, or on JAX 0.12), and the params feed
    # the next gradients: there both runs are held to float32 rounding (rtol 1e-6), as at k = 3.
    rounding = factory == "adamw" and tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
    for call in range(40):  # after every call, not only the last (a field rewritten each update hides a drift)
        if k & (k - 1) == 0 and not rounding:
            assert bits_equal(p1[call], p2[call]), call
            assert bits_equal(s1[call], s2[call]), call
        else:
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), p1[call], p2[call])


def _every_call(tx, calls, replicas=8):
    """The params and AdaScale's state (its ramp's left out) after each of ``calls`` calls, on 8 vmap replicas
    (``S = 8k``: where issue 44 saw the drift) with the gradients of :func:`noisy_grads`."""
    state = optax_adascale.replicate_buffers(tx.init(PARAMS), replicas)
    axes = optax_adascale.state_axes(state)
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i"))
    params, ps, ss = PARAMS, [], []
    for call in range(calls):
        key = jax.random.fold_in(jax.random.key(7), call)
        grads = {"w": 1.0 + jax.random.normal(key, (replicas, 3)), "b": jax.random.normal(key, (replicas,))}
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
        ps.append(params)
        ss.append(optax_adascale.get_adascale_state(state)._replace(ramp=None))
    return ps, ss


def test_a_ramp_pinned_at_one_is_the_unaccumulated_update_to_rounding():
    static = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    pinned = optax_adascale.adascale_sgd(
        0.1, momentum=0.9, axis_name="i", accumulation_steps=optax_adascale.BatchRamp(1, 1)
    )
    (p1, _, _), (p2, _, _) = train(static, 6), train(pinned, 6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p1, p2)


def test_a_scheduled_ramp_is_fixed_k_optimizers_carried_over_by_transfer_state():
    schedule = [1, 1, 2, 2, 4, 4, 2, 4]  # k of each update, down once
    policy = lambda inp: jnp.asarray(schedule, jnp.float32)[jnp.minimum(inp.updates, len(schedule) - 1)]  # noqa: E731
    ramp = optax_adascale.BatchRamp(1, 4, hysteresis=1.0, patience=1, policy=policy)
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp)
    params, state, ks = train(tx, sum(schedule))
    assert ks == [*schedule[1:], schedule[-1]]  # after update t the state holds k_{t+1}

    ref_params, ref_state, call = PARAMS, None, 0
    for k in schedule:  # the independent truth: a fresh fixed-k optimizer per update, the state carried over
        fixed = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=k)
        target, step = vmapped(fixed)
        ref_state = target if ref_state is None else optax_adascale.transfer_state(ref_state, target)
        for _ in range(k):
            updates, ref_state = step(noisy_grads(call), ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
            call += 1
    # Two different compiled programs: XLA may vectorise a sum differently on another CPU (1 ulp seen in CI), so
    # the comparison is to float32 rounding, not to the bit.
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)  # noqa: E731
    jax.tree.map(close, params, ref_params)
    m, ref = optax_adascale.metrics(state), optax_adascale.metrics(ref_state)
    for key in ("gain", "scale_invariant_steps", "grad_var", "grad_sqr", "scale"):
        close(m[key], ref[key])
    assert float(m["scale"]) == float(ref["scale"])


def test_a_whole_measured_ramp_from_the_lowest_rung_to_the_highest_compiles_once():
    # The per-sample variance grows ×e every 100 calls: the noise scale B = 65σ²/64 climbs from 1 to ~1000.
    ramp = optax_adascale.BatchRamp(1, 16, efficiency=0.5)  # the critical batch: k* = (B + 2)/2
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp)
    state, step = vmapped(tx, name="whole_ramp_step", params=WIDE)
    params, ks = WIDE, []
    with backend_compiles("whole_ramp_step") as compiles:
        for call in range(700):
            updates, state = step(noisy_grads(call, growth=0.01, dim=64), state, params)
            params = optax.apply_updates(params, updates)
            if int(state.micro_step) == 0:
                ks.append(int(state.ramp.microbatches))
    visited = list(dict.fromkeys(ks))
    # From the lowest rung to the highest, up only, through the rungs between (the largest rung ≤ k* at each move).
    assert visited[0] == 1 and visited[-1] == 16 and visited == sorted(visited) and len(visited) >= 4, visited
    assert step._cache_size() == 1
    assert len(compiles) == 1, compiles
    m = optax_adascale.metrics(state)
    assert float(m["scale"]) == 32 and 1 <= float(m["gain"]) <= 32


def test_adamw_ramps_with_the_gain_in_one_to_s():
    ramp = optax_adascale.BatchRamp(1, 8, efficiency=0.5)
    tx = optax_adascale.adascale_adamw(1e-3, weight_decay=0.0, axis_name="i", accumulation_steps=ramp)
    state, step = vmapped(tx, params=WIDE)
    params, scales = WIDE, set()
    for call in range(300):
        updates, state = step(noisy_grads(call, growth=0.02, dim=64), state, params)
        params = optax.apply_updates(params, updates)
        if int(state.micro_step) == 0:
            m = optax_adascale.metrics(state)
            scales.add(float(m["scale"]))
            assert 1.0 <= float(m["gain"]) <= float(m["scale"])
    assert scales == {2.0, 4.0, 8.0, 16.0} and step._cache_size() == 1


def test_the_estimator_with_a_traced_n_is_the_formula():
    a, b = jnp.array([3.0, 2.0]), jnp.array([1.0, 0.5])
    static = step_moments(a, b, 6, 6, 1e-6, floor_sqr=False)
    traced = jax.jit(lambda n: step_moments(a, b, n, n, 1e-6, floor_sqr=False))(jnp.int32(6))
    by_hand = (6 / 5 * (a - b), b - (a - b) / 5)
    for x, y, z in zip(static, traced, by_hand, strict=True):
        np.testing.assert_allclose(x, z, rtol=1e-6)
        np.testing.assert_allclose(y, z, rtol=1e-6)


def test_readers_say_where_the_loader_stands():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=optax_adascale.BatchRamp(3, 12))
    state, step = vmapped(tx)
    plan = optax_adascale.batch_plan(state)
    assert {k: int(v) for k, v in plan.items()} == {
        "microbatches": 3,
        "remaining": 3,
        "next_scale": 0,
        "scale": 0,  # deprecated: next_scale's value
        "microbatches_seen": 0,
    }
    for call in range(4):
        _, state = step(noisy_grads(call), state, PARAMS)
    plan = {k: int(v) for k, v in optax_adascale.batch_plan(state).items()}
    assert plan == {"microbatches": 3, "remaining": 2, "next_scale": 6, "scale": 6, "microbatches_seen": 4}
    m = optax_adascale.metrics(state)
    assert int(m["microbatches"]) == 3 and int(m["next_scale"]) == 6 and int(m["microbatches_seen"]) == 4
    assert float(m["scale"]) == 6  # the last update's S


def test_a_skipped_window_keeps_k_and_counts_its_calls():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=optax_adascale.BatchRamp(2, 8))
    state, step = vmapped(tx)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), noisy_grads(0))
    _, state = step(noisy_grads(1), state, PARAMS)
    _, state = step(bad, state, PARAMS)
    plan = {k: int(v) for k, v in optax_adascale.batch_plan(state).items()}
    assert plan["microbatches"] == 2 and plan["remaining"] == 2 and plan["microbatches_seen"] == 2
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == 1


def test_transfer_state_into_and_out_of_a_ramp():
    static = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=2)
    _, state, _ = train(static, 4)
    ramped = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=optax_adascale.BatchRamp(2, 8))
    target, _ = vmapped(ramped)
    moved = optax_adascale.transfer_state(state, target)
    assert int(moved.ramp.microbatches) == 2 and float(moved.tau_whole) == float(state.tau_whole)
    back = optax_adascale.transfer_state(moved, vmapped(static)[0])
    assert back.ramp is None and bits_equal(back.grad_var, state.grad_var)


MOVING = dict(hysteresis=1.0, patience=1, policy=lambda inp: jnp.where(inp.updates % 4 < 2, 2.0, 1.0))


def _gain(var, sqr, scale):
    """The gain by hand: ``(σ̄² + μ̄²)/(σ̄²/S + μ̄²)`` (``μ̄²`` floored at 0), 1 without statistics, in ``[1, S]``."""
    sqr = max(float(sqr), 0.0)
    den = float(var) / scale + sqr
    return min(max((float(var) + sqr) / den, 1.0), scale) if den > 0 else 1.0


def _guard(before):
    """The default τ clock's growth cap on the next update's gain: ``1.1·max(r_{t−1}, 1)`` (1.1 on the first update),
    the same for every group's gain. Its curvature cap is left out: it only lowers the gain, so where a gain matches
    ``min(estimate, this)`` the curvature cap did not bind (these 18 calls at lr 0.1 on gradients ``1 + ξ``)."""
    return 1.1 * max(float(before.gain), 1.0)


def _applied(tx, calls):
    """Train ``calls`` calls; the states before and after each applied update, and the final params."""
    state, step = vmapped(tx)
    params, pairs = PARAMS, []
    for call in range(calls):
        before = optax_adascale.get_adascale_state(state)
        updates, state = step(noisy_grads(call), state, params)
        params = optax.apply_updates(params, updates)
        after = optax_adascale.get_adascale_state(state)
        if int(after.count) > int(before.count):
            pairs.append((before, after))
    return params, pairs


@functools.cache
def _plain_ramp_run():
    """The plain ramp's 18 calls that every variant below is compared with: run once per worker (the variants share
    one ``xdist_group``), not once per variant."""
    ramp = optax_adascale.BatchRamp(1, 2, **MOVING)
    return _applied(optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp), 18)


@pytest.mark.xdist_group("ramp_composes")
@pytest.mark.parametrize(
    "variant",
    [
        dict(shard_optimizer_state=R),
        dict(param_labels={"w": "a", "b": "c"}),
        dict(delayed_gain=True),
        dict(inject=True),
    ],
    ids=["ZeRO", "param_labels", "delayed_gain", "inject_hyperparams"],
)
def test_a_ramp_composes_with_the_other_options(variant):
    """The same ramp (k = 2, 2, 1, 1, ...) with ZeRO rows, labels, delayed gain or inject_hyperparams: the same rungs,
    and each option's own arithmetic at each update's ``S``: ZeRO and inject_hyperparams train as the plain ramp does;
    labels give each group the gain of its own averages at ``S_t`` (and one label for every leaf is the plain ramp);
    the delayed gain is the gain of the averages *before* the update at ``S_t``; every gain capped by the default τ
    clock's guard (:func:`_guard`)."""
    ramp = optax_adascale.BatchRamp(1, 2, **MOVING)
    variant = dict(variant)
    if variant.pop("inject", False):
        factory = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("learning_rate",))
        tx = factory(learning_rate=0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp)
    else:
        tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp, **variant)
    p_ref, pairs_ref = _plain_ramp_run()
    params, pairs = _applied(tx, 18)
    scales = [float(after.scale) for _, after in pairs]
    assert scales == [float(after.scale) for _, after in pairs_ref]  # the same rungs, update by update
    assert set(scales) == {R * 1.0, R * 2.0}  # both rungs' S were applied
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    if "param_labels" in variant:
        for before, after in pairs:
            cap = _guard(before)
            for label in ("a", "c"):  # each group's growth from its own last gain
                S, group_cap = float(after.scale), 1.1 * max(float(before.group_gains[label]), 1.0)
                close(after.group_gains[label], min(_gain(after.grad_var[label], after.grad_sqr[label], S), group_cap))
            total = (sum(after.grad_var.values()), sum(after.grad_sqr.values()))
            close(after.gain, min(_gain(*total, float(after.scale)), cap))  # τ: the summed statistics' gain, capped
        one_label = dict(variant, param_labels={"w": "a", "b": "a"})
        same, _ = _applied(
            optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", accumulation_steps=ramp, **one_label), 18
        )
        jax.tree.map(close, same, p_ref)
    elif "delayed_gain" in variant:
        for before, after in pairs:
            close(after.gain, min(_gain(before.grad_var, before.grad_sqr, float(after.scale)), _guard(before)))
        assert any(float(after.gain) > 1.01 for _, after in pairs)
    else:
        jax.tree.map(close, params, p_ref)
