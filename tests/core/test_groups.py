"""Per-parameter-group gains (FairScale's param_groups) with ``param_labels``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_adascale

# FairScale tests/optim/test_single_node_adascale.py::test_add_param_group, first step.
FAIRSCALE_TOTAL, FAIRSCALE_GROUP0, FAIRSCALE_GROUP1 = 1.1440223454935758, 1.1428571428571428, 1.1471258476157762
LR = 0.1


def two_linear_params():
    return {
        "first": {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.full((2,), 0.1)},
        "second": {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), "b": jnp.full((3,), 0.2)},
    }


def sum_loss(params, x):
    h = x @ params["first"]["w"].T + params["first"]["b"]
    return jnp.sum(h @ params["second"]["w"].T + params["second"]["b"])


LABELS = {"first": {"w": "g0", "b": "g0"}, "second": {"w": "g1", "b": "g1"}}
MICROBATCHES = jnp.array([[1.0, 2.0], [3.0, 4.0]])


def by_accumulation(param_labels):
    tx = optax_adascale.adascale_sgd(LR, accumulation_steps=2, param_labels=param_labels)
    params = two_linear_params()
    state = tx.init(params)
    for x in MICROBATCHES:
        updates, state = jax.jit(tx.update)(jax.grad(sum_loss)(params, x[None]), state, params)
    return updates, state


def by_vmap_axis(param_labels):
    tx = optax_adascale.adascale_sgd(LR, axis_name="i", param_labels=param_labels)
    params = two_linear_params()
    grads = jax.vmap(lambda x: jax.grad(sum_loss)(params, x[None]))(MICROBATCHES)
    update = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    return update(grads, tx.init(params), params)


def by_microbatches(param_labels):
    tx = optax_adascale.adascale_sgd(LR, param_labels=param_labels)
    params = two_linear_params()
    _, grads, stats = optax_adascale.value_and_grad(sum_loss, num_microbatches=2)(params, MICROBATCHES)
    return tx.update(grads, tx.init(params), params, microbatch_stats=stats)


@pytest.mark.parametrize("run", [by_accumulation, by_vmap_axis, by_microbatches])
def test_fairscale_first_step_group_gains(run):
    updates, state = run(LABELS)
    m = optax_adascale.metrics(state)
    assert np.allclose(m["gain"], FAIRSCALE_TOTAL, rtol=1e-5)
    assert set(m["group_gains"]) == {"g0", "g1"}
    assert np.allclose(m["group_gains"]["g0"], FAIRSCALE_GROUP0, rtol=1e-5)
    assert np.allclose(m["group_gains"]["g1"], FAIRSCALE_GROUP1, rtol=1e-5)
    # τ advances by the total gain; each group's update is scaled by its own gain.
    assert np.allclose(m["scale_invariant_steps"], FAIRSCALE_TOTAL, rtol=1e-5)
    mean_grads = jax.tree.map(
        lambda *g: (g[0] + g[1]) / 2, *[jax.grad(sum_loss)(two_linear_params(), x[None]) for x in MICROBATCHES]
    )
    for name, gain in (("first", FAIRSCALE_GROUP0), ("second", FAIRSCALE_GROUP1)):
        for leaf in ("w", "b"):
            np.testing.assert_allclose(updates[name][leaf], -LR * gain * mean_grads[name][leaf], rtol=1e-5)


def test_labels_may_be_a_function_of_the_params():
    fn = lambda params: {k: jax.tree.map(lambda _, k=k: "g0" if k == "first" else "g1", v) for k, v in params.items()}
    _, state_fn = by_accumulation(fn)
    _, state_tree = by_accumulation(LABELS)
    assert optax_adascale.metrics(state_fn)["group_gains"] == optax_adascale.metrics(state_tree)["group_gains"]


def test_a_single_label_equals_the_unlabelled_run():
    one = jax.tree.map(lambda _: "all", two_linear_params())
    tx_l = optax_adascale.adascale_sgd(LR, momentum=0.9, axis_name="i", param_labels=one)
    tx_u = optax_adascale.adascale_sgd(LR, momentum=0.9, axis_name="i")
    params = two_linear_params()
    s_l, s_u = tx_l.init(params), tx_u.init(params)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = jnp.asarray(rng.normal(size=(4, 1, 2)), jnp.float32)
        grads = jax.vmap(jax.grad(sum_loss), in_axes=(None, 0))(params, x)
        upd = lambda tx: jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
        u_l, s_l = upd(tx_l)(grads, s_l, params)
        u_u, s_u = upd(tx_u)(grads, s_u, params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), u_l, u_u)
        params = optax.apply_updates(params, u_u)
    m_l, m_u = optax_adascale.metrics(s_l), optax_adascale.metrics(s_u)
    assert m_l["group_gains"]["all"] == m_u["gain"]
    for key in ("gain", "scale_invariant_steps", "grad_sqr", "grad_var", "learning_rate"):
        assert m_l[key] == m_u[key], key


def test_labels_with_the_wrong_structure_are_rejected():
    tx = optax_adascale.adascale_sgd(LR, accumulation_steps=2, param_labels={"first": "g0"})
    with pytest.raises(ValueError, match="param_labels must have the structure of the params"):
        tx.init(two_linear_params())
