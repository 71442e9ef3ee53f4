"""``optax_adascale.goodput``: the gain, step-time models, and the goodput-maximising scale.

Cross-checked against AdaptDL's ``GoodputFunction`` (petuum/adaptdl, ``adaptdl/goodput.py``),
re-implemented below from its documented equations (not imported), and anchored on numbers
recorded from AdaptDL's own code.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale
from optax_adascale import goodput

# --------------------------------------------------------------------------- the gain


def test_gain_on_hand_values():
    assert goodput.gain(4, 4.0, 1.0) == pytest.approx(2.5)  # (4 + 1)/(4/4 + 1)
    assert goodput.gain(2, 1.0, 1.0) == pytest.approx(4 / 3)  # (1 + 1)/(1/2 + 1)
    assert goodput.gain(8, 3.0, 2.0) == pytest.approx(5 / (3 / 8 + 2))
    # AdaptDL's own unit tests (scaling_rules_test / gradient_noise_scale_test): var 2, sqr 1 at S = 2, 4, 10;
    # var 3, sqr 1 at S = 3.
    np.testing.assert_allclose(goodput.gain([2, 4, 10], 2.0, 1.0), [1.5, 2.0, 2.5], rtol=1e-12)
    assert goodput.gain(3.0, 3.0, 1.0) == pytest.approx(2.0)


def test_gain_limits_and_edge_cases():
    scales = np.array([1, 2, 4, 8, 16, 1000])
    # S = 1 is exactly 1, whatever the statistics.
    for var, sqr in ((0.0, 0.0), (5.0, 0.0), (0.0, 5.0), (3.0, 7.0), (1e30, 1e-30)):
        assert goodput.gain(1, var, sqr) == 1.0
    np.testing.assert_array_equal(goodput.gain(scales, 2.5, 0.0), scales)  # μ̄² = 0: pure noise, gain S
    np.testing.assert_array_equal(goodput.gain(scales, 0.0, 2.5), np.ones(6))  # σ̄² = 0: no noise, gain 1
    np.testing.assert_array_equal(goodput.gain(scales, 0.0, 0.0), np.ones(6))  # no statistics: 1
    r = goodput.gain(scales, 4.0, 1.0)
    assert r.shape == scales.shape and np.all(np.diff(r) > 0) and np.all((r >= 1) & (r <= scales))
    assert r[-1] < 1 + 4.0  # saturates below 1 + B_noise
    assert goodput.gain(np.array([[2, 4], [8, 16]]), 1.0, 1.0).shape == (2, 2)


def test_gain_rejects_bad_inputs():
    with pytest.raises(ValueError, match="scale"):
        goodput.gain(0.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="grad_var"):
        goodput.gain(2, -1.0, 1.0)
    with pytest.raises(ValueError, match="grad_sqr"):
        goodput.gain(2, 1.0, float("nan"))


def test_gain_is_the_gain_adascale_used():
    """On a real AdaScale state (8 vmap replicas), gain(S, σ̄², μ̄²) is the state's own gain."""
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    params = jnp.zeros(3)
    state = tx.init(params)
    rng = np.random.default_rng(0)
    step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), in_axes=(0, None), out_axes=None, axis_name="i"))
    for _ in range(3):
        _, state = step(jnp.asarray(rng.normal(size=(8, 3)) + 1.0, jnp.float32), state)
    m = optax_adascale.metrics(state)
    assert float(m["scale"]) == 8
    assert goodput.gain(8, m["grad_var"], m["grad_sqr"]) == pytest.approx(float(m["gain"]), rel=1e-5)


# --------------------------------------------------------------------------- step-time models


def test_step_time_models():
    lin = goodput.StepTimeModel.linear(0.02, 0.0015)
    np.testing.assert_allclose(lin([1, 2, 10]), [0.0215, 0.023, 0.035])
    assert "0.02" in lin.description and "0.0015" in lin.description
    measured = {2: 0.03, 4: 0.034, 8: 0.042, 16: 0.058}
    interp = goodput.StepTimeModel.interpolate(measured)
    np.testing.assert_allclose(interp(list(measured)), list(measured.values()), rtol=1e-12)  # exact where measured
    np.testing.assert_allclose(interp([3, 12]), [0.032, 0.050])  # linear in between
    np.testing.assert_allclose(interp([1, 32]), [0.028, 0.090])  # extended along the outermost segments
    fit = goodput.StepTimeModel.fit({1: 1.0 + 0.5, 2: 1.0 + 1.0, 4: 1.0 + 2.0})  # exactly t = 1 + 0.5 S
    np.testing.assert_allclose(fit([1, 10]), [1.5, 6.0])
    noisy = {s: 0.01 + 0.002 * s + e for s, e in zip((1, 2, 4, 8), (1e-4, -1e-4, 1e-4, -1e-4))}
    t1, t0 = np.polyfit(list(noisy), list(noisy.values()), 1)
    np.testing.assert_allclose(goodput.StepTimeModel.fit(noisy)([3.0]), [t0 + 3 * t1])
    np.testing.assert_allclose(goodput.StepTimeModel.interpolate({4: 0.5})([1, 4, 64]), [0.5] * 3)
    call = goodput.StepTimeModel.from_callable(lambda s: 0.1 + math.log(s))
    np.testing.assert_allclose(call([1, math.e]), [0.1, 1.1])


def test_non_positive_step_times_raise_naming_the_argument():
    stats = {"grad_var": 4.0, "grad_sqr": 1.0}
    with pytest.raises(ValueError, match="step_time"):
        goodput.choose_scale(stats, {1: 0.01, 2: 0.0})
    with pytest.raises(ValueError, match="step_time"):
        goodput.choose_scale(stats, {1: 0.01, 2: -0.5})
    with pytest.raises(ValueError, match="step_time"):
        goodput.choose_scale(stats, lambda s: 0.05 - 0.01 * s, [1, 2, 8])  # negative at S = 8
    with pytest.raises(ValueError, match="step_time"):
        goodput.choose_scale(stats, lambda s: float("nan"), [1, 2])
    with pytest.raises(ValueError, match="step_time"):
        goodput.StepTimeModel.linear(-0.01, 0.001)
    with pytest.raises(ValueError, match="step_time"):  # a fitted line that goes negative where asked
        goodput.choose_scale(stats, goodput.StepTimeModel.fit({1: 0.03, 2: 0.02}), [1, 2, 8])
    with pytest.raises(ValueError, match="step_time"):  # extended interpolation that goes negative
        goodput.choose_scale(stats, {2: 0.03, 4: 0.02}, [2, 4, 16])
    with pytest.raises(ValueError, match="step_time"):
        goodput.choose_scale(stats, goodput.StepTimeModel(lambda s: np.zeros_like(s)), [1])


def test_candidates_validation():
    stats = {"grad_var": 4.0, "grad_sqr": 1.0}
    with pytest.raises(ValueError, match="candidates"):
        goodput.choose_scale(stats, lambda s: 1.0)  # a callable needs candidates
    with pytest.raises(ValueError, match="candidates"):
        goodput.choose_scale(stats, lambda s: 1.0, [])
    with pytest.raises(ValueError, match="candidates"):
        goodput.choose_scale(stats, lambda s: 1.0, [0.5, 2])
    with pytest.raises(TypeError, match="step_time"):
        goodput.choose_scale(stats, 0.1, [1, 2])
    c = goodput.choose_scale(stats, lambda s: 0.02 + 0.001 * s, [8, 2, 2, 4.0, 1])
    np.testing.assert_array_equal(c.candidates, [1, 2, 4, 8])  # sorted, deduplicated
    assert isinstance(c.scale, int)


# --------------------------------------------------------------------------- the choice: known optima


def test_choose_scale_finds_the_analytic_optimum_of_an_affine_step_time():
    r"""Goodput for ``t(S) = a + b·S`` peaks at ``S* = √(B·a/b)``, ``B = σ²/μ²``.

    Derivation. ``r(S) = S(σ² + μ²)/(σ² + μ²S)``, so up to the constant ``σ² + μ²``,
    ``g(S) = r/t ∝ f(S) = S / ((σ² + μ²S)(a + bS))``. Then

        d/dS log f = 1/S − μ²/(σ² + μ²S) − b/(a + bS)
                   = σ²/(S(σ² + μ²S)) − b/(a + bS),

    which is zero iff ``σ²(a + bS) = bS(σ² + μ²S)``, i.e. ``σ²a = bμ²S²``:
    ``S* = √(σ²a/(μ²b)) = √(B·a/b)``. The derivative is positive below ``S*`` and
    negative above (``σ²a − bμ²S²`` changes sign once), and ``f → 0`` at ``0`` and
    ``∞``, so ``S*`` is the unique maximum; over integers the best is ``⌊S*⌋`` or ``⌈S*⌉``.

    Case 1: ``σ² = 16, μ² = 1`` (``B = 16``), ``a = 16 ms, b = 1 ms`` (``a/b = 16``): ``S* = 16``.
    Case 2: ``σ² = 10, μ² = 1``, ``a = 20 ms, b = 1.5 ms``: ``S* = √(400/3) ≈ 11.547``.
    Case 3: ``σ² = 0.3, μ² = 2`` (``B = 0.15``), ``a = 10 ms, b = 1 ms``: ``S* ≈ 1.22``.
    """
    c = goodput.choose_scale(
        {"grad_var": 16.0, "grad_sqr": 1.0}, goodput.StepTimeModel.linear(0.016, 0.001), range(1, 65)
    )
    assert c.scale == 16 and c.note == ""
    assert np.all(c.tau_per_second[c.index] > np.delete(c.tau_per_second, c.index))

    s_star = math.sqrt(10.0 / 1.0 * 0.020 / 0.0015)
    grid = np.round(np.arange(1.0, 100.0, 0.001), 3)
    c = goodput.choose_scale({"grad_var": 10.0, "grad_sqr": 1.0}, lambda s: 0.020 + 0.0015 * s, grid)
    assert abs(c.scale - s_star) <= 0.001
    c = goodput.choose_scale(
        {"grad_var": 10.0, "grad_sqr": 1.0}, goodput.StepTimeModel.linear(0.020, 0.0015), range(1, 100)
    )
    assert c.scale in (math.floor(s_star), math.ceil(s_star))

    s_star = math.sqrt(0.3 / 2.0 * 0.010 / 0.001)
    c = goodput.choose_scale({"grad_var": 0.3, "grad_sqr": 2.0}, goodput.StepTimeModel.linear(0.010, 0.001), grid)
    assert abs(c.scale - s_star) <= 0.001


def test_choose_scale_on_a_saturating_throughput_curve():
    """Step time flat up to 8 (idle hardware), then linear: with B ≫ 8 the knee S = 8 ... or beyond.

    ``t(S) = c`` for ``S ≤ 8`` makes goodput ``r(S)/c`` increasing there, so the best S is ≥ 8;
    above 8, ``t = c·S/8`` makes goodput ``8r(S)/(cS)``, decreasing (``r(S)/S`` decreases): exactly 8.
    """
    step_time = lambda s: 0.05 * max(1.0, s / 8)
    c = goodput.choose_scale({"grad_var": 100.0, "grad_sqr": 1.0}, step_time, [1, 2, 4, 8, 16, 32, 64])
    assert c.scale == 8
    # Pure noise (μ̄² = 0): gain S, so goodput is flat above 8; ties go to the smallest S.
    c = goodput.choose_scale({"grad_var": 1.0, "grad_sqr": 0.0}, step_time, [1, 2, 4, 8, 16, 32, 64])
    assert c.scale == 8 and "pure noise" in c.note
    np.testing.assert_allclose(c.tau_per_second[3:], c.tau_per_second[3])


def test_no_noise_means_the_smallest_scale_when_time_grows():
    c = goodput.choose_scale(
        {"grad_var": 0.0, "grad_sqr": 3.0}, goodput.StepTimeModel.linear(0.02, 0.001), [2, 4, 8, 16]
    )
    assert c.scale == 2 and "σ̄² = 0" in c.note
    np.testing.assert_array_equal(c.gain, np.ones(4))


def test_before_the_first_update_the_smallest_candidate_with_a_note():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    state = tx.init({"w": jnp.zeros(3)})
    flat_time = lambda s: 0.01  # every S costs the same: an argmax would not pick the smallest
    for stats in (state, optax_adascale.metrics(state), {"grad_var": 0.0, "grad_sqr": 0.0}):
        c = goodput.choose_scale(stats, flat_time, [16, 4, 64])
        assert c.scale == 4
        assert "no gradient statistics yet" in c.note and c.note in c.table()
        assert np.isnan(c.noise_scale)  # not measured yet, as metrics() reads it


def test_accepts_an_opt_state_or_its_metrics():
    tx = optax.chain(optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i"), optax.scale(1.0))
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    rng = np.random.default_rng(1)
    step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), in_axes=(0, None), out_axes=None, axis_name="i"))
    for _ in range(4):
        _, state = step({"w": jnp.asarray(rng.normal(size=(4, 4)) + 0.5, jnp.float32)}, state)
    model = goodput.StepTimeModel.linear(0.02, 0.002)
    a = goodput.choose_scale(state, model, [1, 2, 4, 8, 16, 32])
    b = goodput.choose_scale(optax_adascale.metrics(state), model, [1, 2, 4, 8, 16, 32])
    m = optax_adascale.metrics(state)
    assert a.grad_var == pytest.approx(float(m["grad_var"])) and a.grad_sqr == pytest.approx(float(m["grad_sqr"]))
    assert a.noise_scale == pytest.approx(float(m["noise_scale"]), rel=1e-5)
    assert a.scale == b.scale
    np.testing.assert_array_equal(a.tau_per_second, b.tau_per_second)
    # A checkpoint restored without a target (a plain dict of the state's fields) is read through metrics().
    restored = jax.tree.map(np.asarray, optax_adascale.get_adascale_state(state)._asdict())
    assert goodput.choose_scale(restored, model, [1, 2, 4, 8, 16, 32]).grad_var == a.grad_var
    with pytest.raises(ValueError, match="grad_var"):
        goodput.choose_scale({"grad_var": -1.0, "grad_sqr": 1.0}, model, [1, 2])
    stacked = {k: np.stack([np.asarray(v)] * 2) for k, v in m.items()}  # metrics of a pmap-stacked state
    with pytest.raises(ValueError, match="pmap"):
        goodput.choose_scale(stacked, model, [1, 2])


def test_choice_numbers_are_consistent_and_the_table_shows_them():
    c = goodput.choose_scale({"grad_var": 8.0, "grad_sqr": 1.0}, {2: 0.030, 4: 0.034, 8: 0.042, 16: 0.058})
    np.testing.assert_array_equal(c.candidates, [2, 4, 8, 16])
    np.testing.assert_allclose(c.gain, goodput.gain(c.candidates, 8.0, 1.0))
    np.testing.assert_allclose(c.step_time, [0.030, 0.034, 0.042, 0.058])
    np.testing.assert_allclose(c.tau_per_second, c.gain / c.step_time)
    np.testing.assert_allclose(c.efficiency, c.gain / c.candidates)
    np.testing.assert_allclose(c.seconds_per_tau, c.step_time / c.gain)
    assert c.scale == 8 and c.noise_scale == 8.0
    lines = c.table().splitlines()
    assert "noise scale" in lines[0] and "piecewise-linear" in lines[0]
    assert lines[1].split() == ["S", "gain", "efficiency", "step", "time", "(s)", "τ/s", "relative"]
    rows = [line for line in lines[2:] if not line.startswith("note")]
    assert len(rows) == 4
    assert [line[0] for line in rows] == [" ", " ", "*", " "]
    assert rows[2].split()[1:3] == ["8", f"{c.gain[2]:.2f}"] and rows[2].split()[-1] == "1.000"


# --------------------------------------------------------------------------- agreement with AdaptDL


# AdaptDL's performance model (PerfParams order: alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma),
# written from its documented equations:
#   T_acc  = alpha_c + beta_c·b                       (one forward/backward of b examples per replica)
#   T_net  = alpha_n + beta_n·max(R − 2, 1e-8)        if N > 1    (inter-node all-reduce)
#          = alpha_r + beta_r·max(R − 2, 1e-8)        elif R > 1  (intra-node)
#          = 1e-8 + 1e-8·max(R − 2, 1e-8)             else
#   T_step = s·T_acc + (T_acc^γ + T_net^γ)^(1/γ)      (s accumulation micro-steps, then the synchronous one)
#   throughput = R·b·(s + 1)/T_step  (examples per second)
#   efficiency(M) = gain(M/M0)/(M/M0),  gain(k) = (var + sqr)/(var/k + sqr) (1 where the denominator is 0)
#   goodput = throughput · efficiency(R·b·(s + 1)).


def adaptdl_step_time(p, nodes, replicas, atomic_bsz, accum_steps):
    alpha_c, beta_c, alpha_n, beta_n, alpha_r, beta_r, gamma = p
    t_acc = alpha_c + beta_c * atomic_bsz
    retro = max(replicas - 2, 1e-8)
    if nodes > 1:
        t_net = alpha_n + beta_n * retro
    elif replicas > 1:
        t_net = alpha_r + beta_r * retro
    else:
        t_net = 1e-8 + 1e-8 * retro
    return accum_steps * t_acc + (t_acc**gamma + t_net**gamma) ** (1 / gamma)


def adaptdl_throughput(p, nodes, replicas, atomic_bsz, accum_steps):
    return replicas * atomic_bsz * (accum_steps + 1) / adaptdl_step_time(p, nodes, replicas, atomic_bsz, accum_steps)


def adaptdl_efficiency(sqr, var, batch_size, init_batch_size):
    k = batch_size / init_batch_size
    denom = var / k + sqr
    return ((var + sqr) / denom if denom > 0 else 1.0) / k


def adaptdl_goodput(p, sqr, var, init_batch_size, nodes, replicas, atomic_bsz, accum_steps):
    batch = replicas * atomic_bsz * (accum_steps + 1)
    assert init_batch_size <= batch
    return adaptdl_throughput(p, nodes, replicas, atomic_bsz, accum_steps) * adaptdl_efficiency(
        sqr, var, batch, init_batch_size
    )


HAND_PERF = (0.1, 0.01, 0.5, 0.05, 0.2, 0.02, 2.0)


@pytest.mark.parametrize(
    "config, thr, eff, good",
    [  # recorded from AdaptDL's GoodputFunction with HAND_PERF, GradParams(sqr=1, var=4), init batch 16
        ((1, 1, 16, 0), 61.5384615384615, 1.0, 61.5384615384615),
        ((1, 1, 16, 1), 61.53846153846151, 0.8333333333333334, 51.28205128205126),
        ((1, 2, 16, 0), 97.55372169968547, 0.8333333333333334, 81.29476808307123),
        ((1, 4, 32, 0), 264.60743379031135, 0.4166666666666667, 110.25309741262973),
        ((2, 4, 32, 0), 174.7694763773953, 0.4166666666666667, 72.82061515724804),
        ((2, 8, 24, 2), 371.7921904188296, 0.125, 46.4740238023537),
        ((4, 8, 20, 3), 364.797003745975, 0.11363636363636362, 41.45420497113352),
    ],
)
def test_the_reimplementation_reproduces_adaptdl_numbers(config, thr, eff, good):
    n, r, b, s = config
    assert adaptdl_throughput(HAND_PERF, *config) == pytest.approx(thr, rel=1e-12)
    assert adaptdl_efficiency(1.0, 4.0, r * b * (s + 1), 16) == pytest.approx(eff, rel=1e-12)
    assert adaptdl_goodput(HAND_PERF, 1.0, 4.0, 16, *config) == pytest.approx(good, rel=1e-12)


def test_the_reimplementation_reproduces_adaptdl_on_its_test_parameters():
    # AdaptDL's goodput_test draws PERF_PARAMS then GRAD_PARAMS from RandomState(0).gamma(2, 2); entry 0,
    # init batch 128: GoodputFunction(...)(2, 4, 64, 1) = 0.5620472267724476 = 0.8625243454317504 · 0.6516305652695586.
    perf, (sqr, var) = _adaptdl_test_params()[0]
    assert adaptdl_throughput(perf, 2, 4, 64, 1) == pytest.approx(0.8625243454317504, rel=1e-12)
    assert adaptdl_efficiency(sqr, var, 512, 128) == pytest.approx(0.6516305652695586, rel=1e-12)
    assert adaptdl_goodput(perf, sqr, var, 128, 2, 4, 64, 1) == pytest.approx(0.5620472267724476, rel=1e-12)


def _adaptdl_test_params():
    rng = np.random.RandomState(0)
    perf = [tuple(rng.gamma(2.0, 2.0, [7])) for _ in range(10)]
    grad = [tuple(rng.gamma(2.0, 2.0, [2])) for _ in range(10)]  # (sqr, var)
    return list(zip(perf, grad))


# Ways of making the batch S·M0 in AdaptDL's terms (nodes, replicas, atomic batch, accumulation steps).
LAYOUTS = {
    # one replica per base batch, 4 per node
    "replicas": lambda S, M0: (max(1, math.ceil(S / 4)), S, M0, 0),
    # 4 replicas on one node, a bigger atomic batch each (S a multiple of 4, or S = 1, 2 on fewer)
    "atomic": lambda S, M0: (1, min(S, 4), S * M0 // min(S, 4), 0),
    # 2 replicas on 2 nodes, accumulating base batches
    "accumulate": lambda S, M0: (2, 2, M0, S // 2 - 1) if S >= 2 else (1, 1, M0, 0),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_goodput_and_argmax_agree_with_adaptdl(layout):
    """Same statistics, same init batch, same step times: τ/s · M0 is AdaptDL's goodput; same argmax."""
    M0 = 32
    candidates = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    cases = [(HAND_PERF, (1.0, 4.0))] + _adaptdl_test_params()
    cases += [(HAND_PERF, (sqr, var)) for sqr, var in ((1.0, 0.0), (1e-3, 5.0), (0.2, 30.0), (0.0, 1.0))]
    chosen = set()
    for perf, (sqr, var) in cases:
        configs = {S: LAYOUTS[layout](S, M0) for S in candidates}
        assert all(r * b * (s + 1) == S * M0 for S, (_, r, b, s) in configs.items())
        theirs = np.array([adaptdl_goodput(perf, sqr, var, M0, *configs[S]) for S in candidates])
        step_time = lambda S, p=perf, c=configs: adaptdl_step_time(p, *c[int(S)])
        ours = goodput.choose_scale({"grad_var": var, "grad_sqr": sqr}, step_time, candidates)
        np.testing.assert_allclose(ours.tau_per_second * M0, theirs, rtol=1e-6)
        np.testing.assert_allclose(ours.tau_per_second / ours.tau_per_second[0], theirs / theirs[0], rtol=1e-6)
        np.testing.assert_allclose(
            ours.efficiency, [adaptdl_efficiency(sqr, var, S * M0, M0) for S in candidates], rtol=1e-12
        )
        assert ours.scale == candidates[int(np.argmax(theirs))]
        chosen.add(ours.scale)
    assert len(chosen) >= 2, chosen  # the cases are not all decided the same way
