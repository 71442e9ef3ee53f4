"""FairScale's published golden gains and hand-derived cases, through every way of collecting samples.

FairScale (``fair_dev/testing/golden_testing_data.py``) runs ``Linear(2, 2)`` with a
sum loss on two samples (micro-batches or ranks) of one input row each, with
``SGD(lr=0.1)`` wrapped in ``AdaScale``, and checks the gain with ``np.allclose``.
The gradient of ``sum(W x + b)`` is ``W: [x, x]``, ``b: [1, 1]`` whatever the
parameters, so the samples are known in closed form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale

# (inputs per update, expected gain after the last update, expected averaged weight gradient)
GOLDEN = [
    ([[[1.0, 0.0], [0.0, 1.0]]] * 2, 4.0 / 3, [[0.5, 0.5], [0.5, 0.5]]),
    ([[[1.0, 1.0], [1.0, 1.0]]] * 2, 1.0000001249999846, [[1.0, 1.0], [1.0, 1.0]]),
    ([[[-1.0, 1.0], [1.0, -1.0]]] * 2, 2.0, [[0.0, 0.0], [0.0, 0.0]]),
    ([[[1.0, 4.0], [5.0, 0.5]]] * 2, 1.4688796680497926, [[3.0, 2.25], [3.0, 2.25]]),
    ([[[-0.2, 3.0], [5.0, 0.5]]] * 2, 1.8472893901708, [[2.4000000953674316, 1.75], [2.4000000953674316, 1.75]]),
    ([[[-0.2, 3.3], [5.2, 0.7]], [[1.0, 4.0], [3.1, 0.1]]], 1.6720968158031417, [[2.05, 2.05], [2.05, 2.05]]),
]
LR = 0.1


def linear_params():
    return {"w": jnp.zeros((2, 2), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}


def sum_loss(params, x):
    """FairScale's ``model(x).sum()`` for ``Linear(2, 2)``, on a batch of rows."""
    return jnp.sum(x @ params["w"].T + params["b"])


def sample_grad(x):
    return jax.grad(sum_loss)(linear_params(), jnp.asarray(x, jnp.float32)[None])


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def run_accumulation(updates_inputs):
    tx = optax_adascale.adascale_sgd(LR, accumulation_steps=2, estimator="fairscale")
    params, state = linear_params(), None
    state = tx.init(params)
    update = jax.jit(tx.update)
    for inputs in updates_inputs:
        for x in inputs:
            updates, state = update(sample_grad(x), state, params)
    return updates, state


def run_vmap_axis(updates_inputs):
    tx = optax_adascale.adascale_sgd(LR, axis_name="replica", estimator="fairscale")
    params = linear_params()
    state = tx.init(params)
    update = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="replica"))
    for inputs in updates_inputs:
        updates, state = update(stack([sample_grad(x) for x in inputs]), state, params)
    return updates, state


def run_pmap_axis(updates_inputs):
    tx = optax_adascale.adascale_sgd(LR, axis_name="replica", estimator="fairscale")
    params = linear_params()
    state = tx.init(params)
    update = jax.pmap(
        tx.update, axis_name="replica", in_axes=(0, None, None), out_axes=(None, None), devices=jax.devices()[:2]
    )
    for inputs in updates_inputs:
        updates, state = update(stack([sample_grad(x) for x in inputs]), state, params)
    return updates, state


def run_within_step(updates_inputs):
    tx = optax_adascale.adascale_sgd(LR, estimator="fairscale")
    params = linear_params()
    state = tx.init(params)
    grad_fn = optax_adascale.value_and_grad(sum_loss, num_microbatches=2)

    @jax.jit
    def step(state, x):
        _, grads, stats = grad_fn(params, x)
        return tx.update(grads, state, params, microbatch_stats=stats)

    for inputs in updates_inputs:
        updates, state = step(state, jnp.asarray(inputs, jnp.float32))
    return updates, state


RUNNERS = {
    "accumulation_steps=2": run_accumulation,
    "vmap axis": run_vmap_axis,
    "pmap axis": run_pmap_axis,
    "within-step microbatches": run_within_step,
}


@pytest.mark.parametrize("runner", RUNNERS.values(), ids=RUNNERS.keys())
@pytest.mark.parametrize("inputs, expected_gain, expected_w_grad", GOLDEN)
def test_fairscale_golden_gain(runner, inputs, expected_gain, expected_w_grad):
    updates, state = runner(inputs)
    gain = optax_adascale.metrics(state)["gain"]
    assert np.allclose(gain, expected_gain, rtol=1e-5), (gain, expected_gain)
    # Plain SGD: the update is -gain * lr * mean gradient, so the mean gradient is recoverable.
    mean_w_grad = -np.asarray(updates["w"]) / (LR * float(gain))
    assert np.allclose(mean_w_grad, expected_w_grad, rtol=1e-5)
    assert np.allclose(-np.asarray(updates["b"]) / (LR * float(gain)), [1.0, 1.0])


@pytest.mark.parametrize("scale", [4.0 / 3, 2.0, 4.0, None])
def test_orthogonal_samples_give_gain_equal_to_scale(scale):
    # FairScale's test_scale_not_equal_default: 4 one-hot inputs, bias-free Linear(4, 2), 4 samples.
    # By hand: ‖g_i‖² = 2, ‖ḡ‖² = 2·4/16 = 0.5, σ̂² = S/3·(2 − 0.5) = S/2, μ̂² = 0.5 − 1/2 = 0,
    # so the gain is exactly S.
    tx = optax_adascale.adascale_sgd(LR, accumulation_steps=4, scale=scale, estimator="fairscale")
    params = jnp.zeros((2, 4))
    state = tx.init(params)
    update = jax.jit(tx.update)
    for x in np.eye(4, dtype=np.float32):
        updates, state = update(jnp.stack([x, x]), state, params)
    expected = 4.0 if scale is None else scale
    assert np.allclose(optax_adascale.metrics(state)["gain"], expected, rtol=1e-6)
    assert np.allclose(updates, -LR * expected * 0.25)


def test_identical_samples_give_gain_one_up_to_the_eps_floor():
    # FairScale's test_gradient_value: two identical samples, ‖g‖² = 2. σ̂² = 0 is floored at
    # eps, μ̂² = 2, so r = (eps + 2)/(eps/2 + 2) = 1 + eps/4 + O(eps²).
    eps = 1e-6
    tx = optax_adascale.adascale_sgd(LR, axis_name="i", estimator=optax_adascale.Estimator(fairscale=True, eps=eps))
    params = jnp.zeros((2, 2))
    g = jnp.array([[0.0, 1.0], [0.0, 1.0]])
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    _, state = update(jnp.stack([g, g]), tx.init(params), params)
    gain = float(optax_adascale.metrics(state)["gain"])
    expected = (eps + 2.0) / (eps / 2 + 2.0)
    assert gain == pytest.approx(expected, rel=2e-7)
    assert gain > 1.0
    assert float(optax_adascale.metrics(state)["grad_var"]) == pytest.approx(eps)


@pytest.mark.parametrize("n, scale", [(2, 6.0), (4, 2.0), (4, 1.0)])
def test_scale_different_from_num_samples_matches_hand_formula(n, scale):
    rng = np.random.default_rng(n)
    samples = rng.normal(size=(n, 5)).astype(np.float32) + 1.0
    a = np.mean(np.sum(samples.astype(np.float64) ** 2, axis=1))
    b = np.sum(samples.astype(np.float64).mean(axis=0) ** 2)
    var = max(scale / (n - 1) * (a - b), 1e-6)
    sqr = max(b - scale / (n - 1) * (a - b) / scale, 0.0)
    expected = np.clip((var + sqr) / (var / scale + sqr), 1.0, scale)

    tx = optax_adascale.adascale_sgd(LR, axis_name="i", scale=scale, estimator="fairscale")
    params = jnp.zeros(5)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    _, state = update(jnp.asarray(samples), tx.init(params), params)
    m = optax_adascale.metrics(state)
    assert np.allclose(m["gain"], expected, rtol=1e-5)
    assert np.allclose(m["grad_var"], var, rtol=1e-5)
    assert np.allclose(m["grad_sqr"], sqr, rtol=1e-5, atol=1e-6)
    assert np.allclose(m["scale"], scale)


def test_second_update_uses_debiased_moving_average_with_fairscale_smoothing():
    # Two updates of n = 2 samples: θ = 1 − 2/1000. Debiased EMA after two samples x1, x2:
    # (θ(1−θ)x1 + (1−θ)x2)/((1−θ)(1+θ)) = (θ x1 + x2)/(1 + θ).
    theta = 1 - 2 / 1000
    inputs = GOLDEN[-1][0]
    moments = []
    for pair in inputs:
        g = np.array([np.concatenate([x, x, [1.0, 1.0]]) for x in np.asarray(pair, np.float64)])
        a, b = np.mean(np.sum(g**2, axis=1)), np.sum(g.mean(axis=0) ** 2)
        var = max(2 * (a - b), 1e-6)
        moments.append((var, max(b - var / 2, 0.0)))
    var = (theta * moments[0][0] + moments[1][0]) / (1 + theta)
    sqr = (theta * moments[0][1] + moments[1][1]) / (1 + theta)
    _, state = run_accumulation(inputs)
    m = optax_adascale.metrics(state)
    assert np.allclose(m["grad_var"], var, rtol=1e-6)
    assert np.allclose(m["grad_sqr"], sqr, rtol=1e-6)
    assert np.allclose(m["gain"], (var + sqr) / (var / 2 + sqr), rtol=1e-6)
    assert np.allclose(m["gain"], GOLDEN[-1][1], rtol=1e-5)


def test_momentum_is_applied_before_the_gain():
    # PyTorch SGD: buf = μ buf + d; p -= lr·buf. AdaScale multiplies lr by the gain, so the
    # update is −r·lr·buf with buf including earlier (unscaled) gradients.
    tx = optax_adascale.adascale_sgd(LR, momentum=0.9, accumulation_steps=2, estimator="fairscale")
    params = linear_params()
    state = tx.init(params)
    gains = []
    buf = np.zeros((2, 2))
    update = jax.jit(tx.update)
    for pair in GOLDEN[3][0] + GOLDEN[4][0]:
        for x in pair:
            updates, state = update(sample_grad(x), state, params)
        buf = 0.9 * buf + np.asarray([pair[0], pair[0]], np.float64) / 2 + np.asarray([pair[1], pair[1]]) / 2
        gains.append(float(optax_adascale.metrics(state)["gain"]))
    assert np.allclose(updates["w"], -gains[-1] * LR * buf, rtol=1e-6)
    assert optax.tree.norm(updates) > 0
