"""Orbax checkpoints of a tensor-parallel run: sharded params and optimizer state under ``jax.shard_map``.

The model, data and layout are ``test_sharded.py``'s: a ``(data=4, model=2)`` mesh with
the MLP's weights split over ``model`` (``TP``), momentum split like its parameter,
AdaScale's scalars replicated. The checkpoint holds sharded arrays
(``orbax.checkpoint.StandardCheckpointer``) and is restored onto abstract targets
(``jax.ShapeDtypeStruct`` with a sharding):

* onto the same mesh, resuming bit-identically to a run that never stopped, also
  mid-accumulation (per-replica, per-model-shard buffers);
* onto a ``(data=2, model=2)`` mesh on 4 devices: the state's layout does not depend on
  the number of replicas, so the new mesh's shardings are the target, and the run goes on
  at S = 2 like the unsharded run (2 replicas as a vmap axis) from the same statistics.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
import test_sharded as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_checkpoint import assert_trees_equal, restore, save

import optax_adascale

TP = ts.TP
SAVED_AT, RESUMED = 4, 3  # updates before the checkpoint, updates after it
MESH_2x2 = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def place(params, mesh):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, TP)


def fresh(tx, mesh, accumulation: int = 1):
    """Params split over ``model`` on ``mesh``, their state, and the state's partition specs."""
    params = place(ts.init_params(), mesh)
    state = tx.init(params)
    if accumulation > 1:
        state = optax_adascale.replicate_buffers(state, mesh.shape["data"], model_shards=mesh.shape["model"])
    specs = optax_adascale.state_partition_specs(state, "data", TP, tx=tx)
    return params, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)), specs


@functools.cache
def tp_step(mesh, accumulation: int = 1):
    """One call of ``test_sharded``'s TP training step under shard_map over ``mesh``; returns ``(tx, step, specs)``."""
    tx = ts.make_tx(accumulation_steps=accumulation)
    _, _, specs = fresh(tx, mesh, accumulation)

    def step(params, state, x, y):
        p = jax.lax.pcast(params, "data", to="varying")
        updates, state = tx.update(jax.grad(ts.tp_loss)(p, x[0], y[0]), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.shard_map(step, mesh=mesh, in_specs=(TP, specs, P("data"), P("data")), out_specs=(TP, specs))
    return tx, jax.jit(step), specs


def abstract(tree, specs, mesh):
    """The restore target: ``tree``'s shapes and dtypes with ``specs`` on ``mesh``."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs
    )


def run(step, params, state, xs, ys):
    """One call per ``(x, y)``; the ``(gain, τ)`` after each."""
    log = []
    for x, y in zip(xs, ys, strict=True):
        params, state = step(params, state, x, y)
        log.append(ts.log_of(state))
    return params, state, log


def momentum_of(state):
    return optax.tree.get(state, "trace")


def assert_same_shardings(tree, target) -> None:
    for (path, a), t in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(target), strict=True):
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``SAVED_AT`` TP updates on the (4, 2) mesh, checkpointed; returns the path and the in-memory run."""
    tx, step, specs = tp_step(ts.MESH)
    params, state, _ = fresh(tx, ts.MESH)
    x, y = ts.batches(ts.DATA)
    params, state, log = run(step, params, state, x[:SAVED_AT], y[:SAVED_AT])
    assert int(state.count) == SAVED_AT and float(state.scale) == ts.DATA and min(g for g, _ in log) > 1
    path = tmp_path_factory.mktemp("tp") / "ckpt"
    save(path, {"params": params, "opt_state": state})
    return path, params, state, specs


def test_tp_checkpoint_resumes_bit_identically_on_the_same_mesh(saved):
    path, params, state, specs = saved
    _, step, _ = tp_step(ts.MESH)
    target = {"params": abstract(params, TP, ts.MESH), "opt_state": abstract(state, specs, ts.MESH)}
    restored = restore(path, target)
    assert isinstance(restored["opt_state"], optax_adascale.AdaScaleState)
    assert_trees_equal(restored, {"params": params, "opt_state": state})
    assert_same_shardings(restored, target)
    momentum = momentum_of(restored["opt_state"])["w1"]
    assert momentum.sharding.spec == TP["w1"] and momentum.addressable_shards[0].data.shape == (ts.D, ts.H // 2)

    x, y = ts.batches(ts.DATA)
    later = slice(SAVED_AT, SAVED_AT + RESUMED)
    p_r, s_r, log_r = run(step, restored["params"], restored["opt_state"], x[later], y[later])
    p_k, s_k, log_k = run(step, params, state, x[later], y[later])  # never stopped
    assert_trees_equal(p_r, p_k)
    assert_trees_equal(s_r, s_k)
    assert log_r == log_k


def test_tp_checkpoint_restores_onto_fewer_replicas_and_matches_the_unsharded_run(saved):
    path, params, state, _ = saved
    tx, step, specs = tp_step(MESH_2x2)
    assert jax.tree.leaves(specs) == jax.tree.leaves(saved[3])  # the layout does not depend on the data size
    target = {"params": abstract(params, TP, MESH_2x2), "opt_state": abstract(state, specs, MESH_2x2)}
    restored = restore(path, target)
    assert_trees_equal(restored, {"params": params, "opt_state": state})
    assert_same_shardings(restored, target)
    assert restored["params"]["w1"].sharding.device_set == set(MESH_2x2.devices.flat)

    n = MESH_2x2.shape["data"]
    x, y = ts.batches(ts.DATA)
    later = slice(SAVED_AT, SAVED_AT + RESUMED)
    xs, ys = x[later, :n], y[later, :n]  # update t: the first n samples
    p_r, s_r, log_r = run(step, restored["params"], restored["opt_state"], xs, ys)
    assert float(s_r.scale) == n and int(s_r.count) == SAVED_AT + RESUMED

    # The truth: the unsharded run, n replicas as a vmap axis, from the saved params and statistics.
    def ref_step(params, state, x, y):
        updates, state = tx.update(jax.grad(ts.full_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ref_step = jax.jit(jax.vmap(ref_step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))
    p_ref, s_ref, log_ref = run(ref_step, jax.device_get(params), jax.device_get(state), xs, ys)
    np.testing.assert_allclose(np.array(log_r), np.array(log_ref), rtol=1e-5)
    assert min(g for g, _ in log_ref) > 1.0  # the gains are not trivially 1
    for name in p_ref:
        np.testing.assert_allclose(np.asarray(p_r[name]), p_ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for name, m in momentum_of(s_ref).items():
        np.testing.assert_allclose(np.asarray(momentum_of(s_r)[name]), m, rtol=1e-5, atol=1e-6, err_msg=name)


def test_tp_checkpoint_mid_accumulation_resumes_bit_identically(tmp_path):
    k = 2
    tx, step, specs = tp_step(ts.MESH, accumulation=k)
    params, state, _ = fresh(tx, ts.MESH, k)
    x, y = ts.batches(ts.DATA * k)
    # Update t, call c: replica r takes sample r·k + c.
    xs = [x[t, c::k] for t in range(3) for c in range(k)]
    ys = [y[t, c::k] for t in range(3) for c in range(k)]
    mid = 3  # an odd call: one update applied, one call in the buffers

    p_ref, s_ref, log_ref = run(step, params, state, xs, ys)
    p_mid, s_mid, log_mid = run(step, params, state, xs[:mid], ys[:mid])
    assert int(s_mid.count) == 1 and int(s_mid.micro_step) == 1
    assert s_mid.acc_grads["w1"].shape == (ts.DATA, ts.D, ts.H)
    assert s_mid.acc_sq_norm.shape[:2] == (ts.DATA, ts.MODEL) and np.all(np.asarray(s_mid.acc_sq_norm) > 0)
    save(tmp_path / "ckpt", {"params": p_mid, "opt_state": s_mid})

    target = {"params": abstract(p_mid, TP, ts.MESH), "opt_state": abstract(s_mid, specs, ts.MESH)}
    restored = restore(tmp_path / "ckpt", target)
    assert_trees_equal(restored, {"params": p_mid, "opt_state": s_mid})
    assert_same_shardings(restored, target)
    buffers = restored["opt_state"].acc_grads["w1"]
    assert buffers.sharding.spec == P("data", None, "model")
    assert buffers.addressable_shards[0].data.shape == (1, ts.D, ts.H // ts.MODEL)

    p_r, s_r, log_r = run(step, restored["params"], restored["opt_state"], xs[mid:], ys[mid:])
    assert_trees_equal(p_r, p_ref)
    assert_trees_equal(s_r, s_ref)
    assert log_mid + log_r == log_ref
    assert int(s_r.count) == 3 and int(s_r.micro_step) == 0
