"""The jit/GSPMD path: replicas as a ``vmap(axis_name=...)`` axis sharded over a mesh, under ``jit``.

No shard_map, no pmap: the replica axis of the batch is sharded over the devices with a
``NamedSharding`` and XLA's SPMD partitioner turns AdaScale's ``pmean`` over the vmap axis
into a cross-device all-reduce. The truth is the same training under ``jax.shard_map``.

JAX 0.10 supports this with **Auto** mesh axes (``jax.sharding.Mesh(devices, names)`` or
``jax.make_mesh(..., axis_types=(AxisType.Auto,))``). With **Explicit** axes
(``jax.make_mesh``'s default) any ``psum``/``pmean`` over a vmap axis whose inputs are
sharded on an Explicit mesh axis fails inside JAX (e.g. "Sharding spec ('i',) implies
that array axis 0 is partitioned 8 times, but does not evenly divide the dimension size
3"). Workarounds, tested below: an Auto-axes mesh, or wrap the vmapped step in
``jax.sharding.auto_axes`` under ``jax.set_mesh(mesh)``; or use ``jax.shard_map``.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import DIM, make_tx, synthetic_batches
from helpers import init_mlp as init_params
from helpers import mlp_loss as loss_fn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from benchmarks import hlo as _hlo

N, ROWS, STEPS = 8, 4, 6
AXIS = "i"
SCHEDULE = optax.exponential_decay(0.3, transition_steps=4, decay_rate=0.5)
RTOL, ATOL = 1e-5, 1e-6


def data():
    """(STEPS, N, ROWS, ...): update t, replica i."""
    return synthetic_batches(STEPS, N, ROWS)


def make_replica_step(tx, microbatches, *, mark_varying):
    grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=microbatches)

    def replica_step(params, opt_state, x, y):
        p = jax.lax.pcast(params, AXIS, to="varying") if mark_varying else params
        if microbatches == 1:
            grads = jax.grad(loss_fn)(p, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
        else:
            _, grads, stats = grad_fn(p, x, y)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    return replica_step


def gspmd_step(tx, microbatches=1):
    """``jit(vmap(step, axis_name))``: the replica axis is whatever the batch's sharding makes it."""
    step = make_replica_step(tx, microbatches, mark_varying=False)
    return jax.jit(jax.vmap(step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name=AXIS))


def train(step, place, microbatches=1):
    """Run STEPS updates; ``place(x)`` puts a (replicas, rows, ...) batch where the step wants it."""
    tx = make_tx(SCHEDULE, axis_name=AXIS)
    params = init_params()
    opt_state = tx.init(params)
    step = step(tx, microbatches)
    log = []
    xs, ys = data()
    replicas = N // microbatches
    for x, y in zip(xs, ys, strict=True):
        # Replica r gets samples r·k … r·k + k − 1, one micro-batch each.
        x, y = x.reshape(replicas, -1, DIM), y.reshape(replicas, -1)
        params, opt_state = step(params, opt_state, place(x), place(y))
        m = optax_adascale.metrics(opt_state)
        log.append((float(m["gain"]), float(m["scale_invariant_steps"])))
    return params, opt_state, log


def auto_mesh(replicas=N):
    return jax.sharding.Mesh(np.array(jax.devices()[:replicas]), (AXIS,))


@functools.cache
def shard_map_run(microbatches=1):
    mesh = auto_mesh(N // microbatches)

    def step(tx, microbatches):
        body = make_replica_step(tx, microbatches, mark_varying=True)
        local = lambda params, opt_state, x, y: body(params, opt_state, x[0], y[0])  # noqa: E731
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P())))

    params, _, log = train(step, lambda a: a, microbatches)
    return params, log


def assert_matches_shard_map(params, log, microbatches=1):
    ref_params, ref_log = shard_map_run(microbatches)
    np.testing.assert_allclose(np.array(log), np.array(ref_log), rtol=RTOL)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), params, ref_params)


@pytest.mark.slow  # > 10 s on a 2-core CPU
@pytest.mark.parametrize("microbatches", [1, 2])
def test_gspmd_on_auto_mesh_matches_shard_map(microbatches):
    """8 samples per update: 8 replicas, or 4 replicas × 2 micro-batches."""
    mesh = auto_mesh(N // microbatches)
    assert mesh.axis_types == (AxisType.Auto,)
    sharding = NamedSharding(mesh, P(AXIS))
    params, opt_state, log = train(gspmd_step, lambda a: jax.device_put(a, sharding), microbatches)
    assert_matches_shard_map(params, log, microbatches)
    # The result lives, replicated, on every device of the mesh.
    for leaf in jax.tree.leaves((params, opt_state)):
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(mesh.devices.flat)


def test_gspmd_step_is_partitioned_with_one_all_reduce():
    """The vmap axis really spans the devices: the pmean became one cross-device all-reduce."""
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P(AXIS))
    tx = make_tx(SCHEDULE, axis_name=AXIS)
    params = init_params()
    x, y = (jax.device_put(a[0], sharding) for a in data())
    text = _hlo.compiled_text(gspmd_step(tx), params, tx.init(params), x, y)
    assert _hlo.count(text, "all-reduce") == 1
    assert _hlo.count_host_callbacks(text) == 0


def test_gspmd_state_types_are_stable_across_updates():
    mesh = auto_mesh()
    sharding = NamedSharding(mesh, P(AXIS))
    tx = make_tx(SCHEDULE, axis_name=AXIS)
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
    before = jax.tree.map(jax.typeof, opt_state)
    x, y = (jax.device_put(a[0], sharding) for a in data())
    _, opt_state = gspmd_step(tx)(params, opt_state, x, y)
    assert jax.tree.map(jax.typeof, opt_state) == before


# --------------------------------------------------------------------------- Explicit mesh axes


def explicit_mesh():
    mesh = jax.make_mesh((N,), (AXIS,))
    assert mesh.axis_types == (AxisType.Explicit,)
    return mesh


def _jax_can_reduce_over_an_explicit_vmap_axis() -> bool:
    """The minimal case, no optimizer: a psum over a vmap axis sharded on an Explicit mesh axis."""
    x = jax.device_put(np.ones((N, 3), np.float32), NamedSharding(explicit_mesh(), P(AXIS)))
    try:
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: jax.lax.psum(v, AXIS), axis_name=AXIS))(x))
    except Exception:  # noqa: BLE001 - whatever JAX raises (its wording changes between versions)
        return False
    return True


def test_gspmd_on_explicit_mesh_raises_our_error_exactly_where_jax_cannot_reduce():
    """JAX 0.10 (and 0.11) cannot reduce over a vmap axis sharded on an Explicit mesh axis; AdaScale says so first,
    naming the workarounds. Where a JAX version can, our check must stay silent and training must work."""
    sharding = NamedSharding(explicit_mesh(), P(AXIS))
    if _jax_can_reduce_over_an_explicit_vmap_axis():
        params, _, log = train(gspmd_step, lambda a: jax.device_put(a, sharding))
        assert_matches_shard_map(params, log)
    else:
        with pytest.raises(ValueError, match=r"Explicit mesh axes.*Auto axes.*auto_axes.*shard_map"):
            train(gspmd_step, lambda a: jax.device_put(a, sharding))


def test_gspmd_workaround_make_mesh_with_auto_axes():
    mesh = jax.make_mesh((N,), (AXIS,), axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, P(AXIS))
    params, _, log = train(gspmd_step, lambda a: jax.device_put(a, sharding))
    assert_matches_shard_map(params, log)


def test_gspmd_workaround_auto_axes_on_explicit_mesh():
    """Keep the Explicit mesh; run the vmapped step with its axis switched to Auto."""
    mesh = explicit_mesh()
    sharding = NamedSharding(mesh, P(AXIS))

    def step(tx, microbatches):
        vmapped = jax.vmap(
            make_replica_step(tx, microbatches, mark_varying=False),
            in_axes=(None, None, 0, 0),
            out_axes=(None, None),
            axis_name=AXIS,
        )

        def run(params, opt_state, x, y):
            replicated = jax.tree.map(lambda _: P(), (params, opt_state))
            return jax.sharding.auto_axes(vmapped, axes=AXIS, out_sharding=replicated)(params, opt_state, x, y)

        jitted = jax.jit(run)

        def call(*args):
            with jax.set_mesh(mesh):
                return jitted(*args)

        return call

    params, _, log = train(step, lambda a: jax.device_put(a, sharding))
    assert_matches_shard_map(params, log)


def test_vmap_axis_over_params_sharded_on_explicit_axes_raises_our_error_where_jax_cannot_reduce():
    """Only the parameters are sharded (Explicit), the replica axis is not: JAX 0.10 fails inside psum too."""
    mesh = explicit_mesh()
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name=AXIS)
    with jax.set_mesh(mesh):
        params = jax.numpy.zeros((2, N, 4), out_sharding=P(None, AXIS))
        grads = jax.numpy.ones((2, 2, N, 4), out_sharding=P(None, None, AXIS))
        step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name=AXIS))
        try:
            jax.block_until_ready(
                jax.jit(jax.vmap(lambda g: jax.lax.psum(g, AXIS), axis_name=AXIS, out_axes=None))(grads)
            )
            jax_fails = False
        except Exception:  # noqa: BLE001 - whatever JAX raises
            jax_fails = True
        if jax_fails:
            with pytest.raises(ValueError, match=r"Explicit mesh axes.*Auto axes"):
                step(grads, tx.init(params), params)
        else:
            step(grads, tx.init(params), params)
