"""``delayed_gain=True``: the gain of update t is the exact mode's gain of update t − 1 (the first is 1).

On a fixed stream of replica gradients the moving averages do not depend on the
parameters, so both modes see the same averages; the delayed mode applies each
gain one update later. τ, the learning rate and the updates follow from the
applied gain; the skip still zeroes every replica's update. (That every parallel path
agrees with the vmap run with ``delayed_gain=True`` is in ``test_parallel.py``.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale

N, STEPS = 4, 12
PARAMS = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
SCHEDULE = optax.piecewise_constant_schedule(0.1, {5: 0.5, 9: 0.5})


def grad_stream(step: int):
    """Replica gradients of update ``step``, shaped ``(N, ...)``: a mean that shrinks, noise that stays."""
    key = jax.random.key(step)
    return jax.tree.map(lambda p: 2.0 ** (-step / 3) + jax.random.normal(key, (N,) + p.shape), PARAMS)


def run(delayed: bool, inner=None, estimator="fairscale", **kw):
    """The default estimator's memory is a fraction of τ, which the applied gains move, so the two modes'
    averages would differ; a memory counted in updates (FairScale's) makes the shift exact."""
    inner = optax.trace(0.9) if inner is None else inner
    tx = optax_adascale.adascale(inner, SCHEDULE, axis_name="i", delayed_gain=delayed, estimator=estimator, **kw)
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i"))
    state, log = tx.init(PARAMS), []
    for t in range(STEPS):
        updates, state = step(grad_stream(t), state, PARAMS)
        s = optax_adascale.get_adascale_state(state)
        log.append(
            {
                "updates": updates,
                "gain": float(s.gain),
                "tau": float(optax_adascale.scale_invariant_steps(s)),
                "tau_whole": int(s.tau_whole),
                "var": float(sum(jax.tree.leaves(s.grad_var))),
                "sqr": float(sum(jax.tree.leaves(s.grad_sqr))),
                "group_gains": {k: float(v) for k, v in s.group_gains.items()},
            }
        )
    return log, state


def test_gains_are_the_exact_gains_shifted_by_one_update():
    exact, _ = run(False)
    delayed, _ = run(True)
    g_exact = np.array([r["gain"] for r in exact])
    g_delayed = np.array([r["gain"] for r in delayed])
    assert g_delayed[0] == 1.0
    np.testing.assert_allclose(g_delayed[1:], g_exact[:-1], rtol=1e-6)
    assert np.ptp(g_exact) > 0.2  # the gain moves, so the shift is visible


def test_moving_averages_do_not_depend_on_the_mode():
    exact, _ = run(False)
    delayed, _ = run(True)
    for field in ("var", "sqr"):
        np.testing.assert_allclose([r[field] for r in delayed], [r[field] for r in exact], rtol=1e-6)


def test_tau_learning_rate_and_updates_follow_the_applied_gain():
    delayed, _ = run(True, inner=optax.identity())
    tau = 0.0
    for t, r in enumerate(delayed):
        lr = float(SCHEDULE(int(np.floor(tau))))
        mean = jax.tree.map(lambda g: g.mean(0), grad_stream(t))
        expected = jax.tree.map(lambda g, lr=lr, r=r: -r["gain"] * lr * g, mean)
        jax.tree.map(lambda u, e: np.testing.assert_allclose(u, e, rtol=1e-5, atol=1e-7), r["updates"], expected)
        tau += r["gain"]
        np.testing.assert_allclose(r["tau"], tau, rtol=1e-6)


def test_group_gains_are_shifted_too():
    labels = {"w": "weights", "b": "bias"}
    exact, _ = run(False, param_labels=labels)
    delayed, _ = run(True, param_labels=labels)
    for label in labels.values():
        g_exact = np.array([r["group_gains"][label] for r in exact])
        g_delayed = np.array([r["group_gains"][label] for r in delayed])
        assert g_delayed[0] == 1.0
        np.testing.assert_allclose(g_delayed[1:], g_exact[:-1], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_replica_zeroes_every_update_and_keeps_the_state(bad):
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i", delayed_gain=True)
    step = jax.pmap(tx.update, axis_name="i", in_axes=(0, None, None), devices=jax.devices()[:N])
    state = tx.init(PARAMS)
    _, states = step(grad_stream(0), state, PARAMS)
    state = jax.tree.map(lambda x: x[0], states)
    poisoned = grad_stream(1)
    poisoned["w"] = poisoned["w"].at[2, 0, 1].set(bad)
    updates, new_states = step(poisoned, state, PARAMS)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    for r in range(N):
        s = jax.tree.map(lambda x, r=r: x[r], new_states)
        assert int(s.skipped_steps) == 1 and int(s.skip_streak) == 1
        same = s._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak)
        jax.tree.map(np.testing.assert_array_equal, same, state)
