"""Sharded parameters: tensor parallelism under shard_map, and the pjit/GSPMD recipes for TP, FSDP and TP×FSDP.

The truth is the unsharded run: the same samples as replicas of a ``jax.vmap`` axis on
one device, with whole parameters. A ``(data=4, model=2)`` mesh splits the MLP's
weights over ``model`` (``w1`` by columns, ``b1``, ``w2`` by rows; ``b2`` replicated):
each device's squared norms are partial sums, which AdaScale must add over ``model``
(from the parameters' varying types, or from ``param_specs``) for the gain, τ and the
parameters to equal the unsharded run's.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import TP, full_loss, make_tp_tx, tp_loss
from helpers import TP_D as D
from helpers import TP_DATA as DATA
from helpers import TP_MESH as MESH
from helpers import TP_MODEL as MODEL
from helpers import gain_and_tau as log_of
from helpers import init_tp_params as init_params
from helpers import tp_batches as batches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo

LAYOUTS = {
    "tp": TP,
    "fsdp": {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P()},
    "tp_x_fsdp": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data"), "b2": P("data")},
}


@functools.cache
def reference(samples: int):
    """The unsharded run: ``samples`` replicas as a vmap axis on one device."""
    tx = make_tp_tx()

    def step(params, state, x, y):
        updates, state = tx.update(jax.grad(full_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.vmap(step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))
    params = init_params()
    state, log = tx.init(params), []
    for x, y in zip(*batches(samples), strict=True):
        params, state = step(params, state, x, y)
        log.append(log_of(state))
    return params, np.array(log)


def assert_matches_reference(params, log, samples):
    ref_params, ref_log = reference(samples)
    np.testing.assert_allclose(np.array(log), ref_log, rtol=1e-5)
    for name in ref_params:
        np.testing.assert_allclose(np.asarray(params[name]), ref_params[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert ref_log[:, 0].min() > 1.0  # the gains are not trivially 1


# --------------------------------------------------------------------------- shard_map over (data, model)


def shard_map_tp(*, accumulation=1, micro=1, param_specs=None, check_vma=True):
    """Train under ``jax.shard_map`` over both axes; returns ``(params, log)``."""
    tx = make_tp_tx(accumulation_steps=accumulation, param_specs=param_specs)
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(MESH, s)), init_params(), TP)
    state = tx.init(params)
    if accumulation > 1:
        state = optax_adascale.replicate_buffers(state, DATA, model_shards=MODEL)
    specs = optax_adascale.state_partition_specs(state, "data", TP, tx=tx)
    grad_fn = optax_adascale.value_and_grad(tp_loss, num_microbatches=micro)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        if micro == 1:
            updates, state = tx.update(jax.grad(tp_loss)(p, x[0], y[0]), state, params)
        else:
            _, grads, stats = grad_fn(p, x.reshape(-1, D), y.reshape(-1))
            updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(
            step, mesh=MESH, in_specs=(TP, specs, P("data"), P("data")), out_specs=(TP, specs), check_vma=check_vma
        )
    )
    log = []
    for x, y in zip(*batches(DATA * accumulation * micro), strict=True):
        if accumulation == 1:
            params, state = step(params, state, x, y)
        else:
            for call in range(accumulation):  # replica r, call c: sample r·k + c
                params, state = step(params, state, x[call::accumulation], y[call::accumulation])
        log.append(log_of(state))
    return params, log


@pytest.mark.parametrize("accumulation,micro", [(1, 1), (2, 1), (1, 2)], ids=["plain", "accumulation2", "micro2"])
def test_tensor_parallel_shard_map_matches_the_unsharded_run(accumulation, micro):
    params, log = shard_map_tp(accumulation=accumulation, micro=micro)
    assert_matches_reference(params, log, DATA * accumulation * micro)


def test_model_axes_from_types_and_from_param_specs_agree():
    a = shard_map_tp()
    b = shard_map_tp(param_specs=TP)
    np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))


def _update_only(check_vma, param_specs):
    """AdaScale alone under shard_map, fed correct per-shard gradients (precomputed with check_vma=True)."""
    x, y = batches(DATA)
    params = init_params()
    full = jax.vmap(jax.grad(full_loss), in_axes=(None, 0, 0))(params, x[0], y[0])  # (DATA, ...) per replica
    tx = make_tp_tx(param_specs=param_specs)
    grad_specs = {k: P("data", *tuple(s)) for k, s in TP.items()}

    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return updates, state

    specs = optax_adascale.state_partition_specs(tx.init(params), "data", TP, tx=tx)
    f = jax.jit(
        jax.shard_map(step, mesh=MESH, in_specs=(TP, specs, grad_specs), out_specs=(TP, specs), check_vma=check_vma)
    )
    return f(params, tx.init(params), full)


@pytest.mark.slow  # > 10 s on a 2-core CPU
def test_check_vma_false_with_param_specs_matches_the_unsharded_update():
    x, y = batches(DATA)
    params = init_params()
    tx = make_tp_tx()
    grads = jax.vmap(jax.grad(full_loss), in_axes=(None, 0, 0))(params, x[0], y[0])
    ref_updates, ref_state = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="data")(
        grads, tx.init(params), params
    )
    updates, state = _update_only(check_vma=False, param_specs=TP)
    assert float(state.gain) == pytest.approx(float(ref_state.gain), rel=1e-6)
    for k in updates:
        np.testing.assert_allclose(updates[k], ref_updates[k], rtol=1e-5, atol=1e-7)


def test_check_vma_false_without_param_specs_is_an_error_naming_param_specs():
    with pytest.raises(ValueError, match=r"manual axes \['model'\].*param_specs="):
        _update_only(check_vma=False, param_specs=None)


def test_a_replicated_parameter_pcast_over_model_is_an_error():
    tx = make_tp_tx()
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(MESH, s)), init_params(), TP)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        p["b2"] = jax.lax.pcast(p["b2"], "model", to="varying")  # replicated, yet differentiated as if split
        return tx.update(jax.grad(tp_loss)(p, x[0], y[0]), state, params)

    f = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(TP, P(), P("data"), P("data")), out_specs=(TP, P())))
    x, y = batches(DATA)
    with pytest.raises(ValueError, match=r"grads\['b2'\] varies over \['model'\] but its parameter does not"):
        f(params, tx.init(params), x[0], y[0])


def test_one_scalar_collective_over_model_beyond_the_gradient_reduction():
    tx = make_tp_tx()
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(MESH, s)), init_params(), TP)
    specs = optax_adascale.state_partition_specs(tx.init(params), "data", TP, tx=tx)
    texts = {}
    for name, t in {"adascale": tx, "sgd": optax.sgd(0.1, momentum=0.9)}.items():

        def step(params, state, x, y, t=t, name=name):
            g = jax.grad(tp_loss)(jax.lax.pcast(params, "data", to="varying"), x[0], y[0])
            if name == "sgd":
                g = jax.lax.pmean(g, "data")
            u, state = t.update(g, state, params)
            return optax.apply_updates(params, u), state

        s_specs = (
            specs
            if name == "adascale"
            else optax.tree_map_params(t, lambda _, s: s, t.init(params), TP, transform_non_params=lambda _: P())
        )
        f = jax.jit(
            jax.shard_map(step, mesh=MESH, in_specs=(TP, s_specs, P("data"), P("data")), out_specs=(TP, s_specs))
        )
        x, y = batches(DATA)
        texts[name] = _hlo.compiled_text(f, params, t.init(params), x[0], y[0])
    ours, sgd = (_hlo.collective_bytes(texts[k], min_elements=2) for k in ("adascale", "sgd"))
    assert ours["large_bytes"] == sgd["large_bytes"]  # the gradient's reduction: same bytes as SGD + pmean
    assert ours["small_all_reduces"] - sgd["small_all_reduces"] <= 1  # + one scalar psum over model


# --------------------------------------------------------------------------- partial-manual shard_map


def test_partial_manual_shard_map_with_tp_params_matches_the_unsharded_run():
    tx = make_tp_tx()
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(MESH, s)), init_params(), TP)
    state = tx.init(params)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        updates, state = tx.update(jax.grad(full_loss)(p, x[0], y[0]), state, params)
        return optax.apply_updates(params, updates), state

    # Only "data" is manual; the partitioner splits the parameters over "model".
    step = jax.jit(
        jax.shard_map(
            step, mesh=MESH, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()), axis_names={"data"}
        )
    )
    log = []
    for x, y in zip(*batches(DATA), strict=True):
        params, state = step(params, state, x, y)
        log.append(log_of(state))
    assert_matches_reference(params, log, DATA)
    assert params["w1"].sharding.spec == TP["w1"]  # still split over model


# --------------------------------------------------------------------------- jit / GSPMD (sharded vmap axis)


def gspmd_step(tx, micro=1, sgd=False):
    grad_fn = optax_adascale.value_and_grad(full_loss, num_microbatches=micro)

    def step(params, state, x, y):
        if micro == 1:
            grads = jax.grad(full_loss)(params, x, y)
            if sgd:
                grads = jax.lax.pmean(grads, "data")
            updates, state = tx.update(grads, state, params)
        else:
            _, grads, stats = grad_fn(params, x, y)
            updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    return jax.jit(jax.vmap(step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))


def place(params, layout):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(MESH, s)), params, LAYOUTS[layout])


@pytest.mark.parametrize("micro", [1, 2], ids=["plain", "micro2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gspmd_sharded_params_match_the_unsharded_run(layout, micro):
    tx = make_tp_tx()
    params = place(init_params(), layout)
    state, log = tx.init(params), []
    step = gspmd_step(tx, micro)
    rows = NamedSharding(MESH, P("data"))
    for x, y in zip(*batches(DATA * micro), strict=True):
        x, y = x.reshape(DATA, -1, D), y.reshape(DATA, -1)  # replica r: samples r·k … r·k + k − 1
        params, state = step(params, state, jax.device_put(x, rows), jax.device_put(y, rows))
        log.append(log_of(state))
    assert_matches_reference(params, log, DATA * micro)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gspmd_accumulation_matches_the_unsharded_run(layout):
    tx = make_tp_tx(accumulation_steps=2)
    params = place(init_params(), layout)
    state = optax_adascale.replicate_buffers(tx.init(params), DATA)
    axes = optax_adascale.state_axes(state)

    def replica_step(p, s, x, y):
        updates, s = tx.update(jax.grad(full_loss)(p, x, y), s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(jax.vmap(replica_step, in_axes=(None, axes, 0, 0), out_axes=(None, axes), axis_name="data"))
    rows = NamedSharding(MESH, P("data"))
    log = []
    for x, y in zip(*batches(DATA * 2), strict=True):
        for call in range(2):
            params, state = step(params, state, jax.device_put(x[call::2], rows), jax.device_put(y[call::2], rows))
        log.append(log_of(state))
    assert_matches_reference(params, log, DATA * 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gspmd_adds_no_gradient_sized_collective_and_little_memory(layout):
    params = place(init_params(), layout)
    x, y = batches(DATA)
    rows = NamedSharding(MESH, P("data"))
    xs, ys = jax.device_put(x[0], rows), jax.device_put(y[0], rows)
    texts, memory = {}, {}
    for name, tx in {"adascale": make_tp_tx(), "sgd": optax.sgd(0.1, momentum=0.9)}.items():
        step = gspmd_step(tx, sgd=name == "sgd")
        compiled = step.lower(params, tx.init(params), xs, ys).compile()
        texts[name], memory[name] = compiled.as_text(), compiled.memory_analysis()
    ours, sgd = (_hlo.collective_bytes(texts[k], min_elements=2) for k in ("adascale", "sgd"))
    assert ours["large_bytes"] == sgd["large_bytes"]
    assert ours["small_all_reduces"] - sgd["small_all_reduces"] <= 2
    assert _hlo.count_host_callbacks(texts["adascale"]) == 0
    total = lambda m: m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes  # noqa: E731
    # Our state is SGD's plus O(1) scalars; on a model this small those scalars are most of the difference.
    assert total(memory["adascale"]) <= 1.05 * total(memory["sgd"]) + 1024
