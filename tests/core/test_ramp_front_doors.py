"""A batch ramp through every front door: vmap, pmap, shard_map (per-replica loops, buffers per replica) and the
GSPMD drop-in (``value_and_grad(loss, data_axes=...)`` in one ``jax.jit`` step over the global batch, the tx
accumulating across calls). The same micro-batches give the same rungs and the same training, each with one
compile for the whole ramp; under accumulation the drop-in's statistics are those of the accumulated mean.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DIM, backend_compiles, init_mlp, mlp_loss, synthetic_batches
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

# Auto meshes without param_specs on purpose: the parameters replicate inside the loss, and the values are
# what these tests check; test_semantics checks the warning about the lost memory saving.
pytestmark = pytest.mark.filterwarnings("ignore:value_and_grad.*on a mesh with Auto axes:UserWarning")

R, ROWS, CALLS = 4, 3, 15
SCHEDULE = optax.exponential_decay(0.3, transition_steps=10, decay_rate=0.5)
K_OF_UPDATE = [1, 2, 4, 2, 4]  # the k the policy asks for after each update: up, down, up again
EXPECTED_KS = [2, 4, 2, 4, 4]  # the k held after updates 1 … 5 (update 1 runs at the lowest rung, 1)


def policy(inputs):
    table = jnp.asarray(K_OF_UPDATE, jnp.float32)
    return table[jnp.minimum(inputs.updates, len(K_OF_UPDATE) - 1)]


def make_tx(axis_name):
    ramp = optax_adascale.BatchRamp(1, 4, hysteresis=1.0, patience=1, policy=policy)
    return optax_adascale.adascale_sgd(SCHEDULE, momentum=0.9, axis_name=axis_name, accumulation_steps=ramp)


def data():
    x, y = synthetic_batches(CALLS, R, ROWS)  # call c, replica r
    return x, y


def loop(step, params, state, put=lambda c, x, y: (x, y), later=None):
    """Feed the calls in order (the loader's position read from the state); log the rung after each update.

    ``later`` collects every compilation after the first call: the rest of the ramp must compile nothing.
    """
    x, y = data()
    ks = []
    with contextlib.ExitStack() as stack:
        for call in range(CALLS):
            if call == 1 and later is not None:
                later.extend(stack.enter_context(backend_compiles()))
            c = int(optax_adascale.batch_plan(state)["microbatches_seen"])
            params, state = step(params, state, *put(c, x[c], y[c]))
            s = optax_adascale.get_adascale_state(state)
            if int(s.micro_step) == 0:
                ks.append(int(s.ramp.microbatches))
    return params, state, ks


def placed(mesh, params, state, axis):
    """Params and state where the step's outputs live (as a trainer's jitted init puts them)."""
    specs = optax_adascale.state_partition_specs(state, axis)
    put = lambda tree, specs: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)  # noqa: E731
    return put(params, jax.tree.map(lambda _: P(), params)), put(state, specs)


def per_replica(tx):
    def ramp_step(params, state, x, y):
        updates, state = tx.update(jax.grad(mlp_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    return ramp_step


def run_vmap():
    tx = make_tx("i")
    state = optax_adascale.replicate_buffers(tx.init(init_mlp()), R)
    axes = optax_adascale.state_axes(state)
    step = jax.jit(jax.vmap(per_replica(tx), in_axes=(None, axes, 0, 0), out_axes=(None, axes), axis_name="i"))
    return step, init_mlp(), state


def run_pmap():
    tx = make_tx("i")
    state = optax_adascale.replicate_buffers(tx.init(init_mlp()), R)
    axes = optax_adascale.state_axes(state)
    step = jax.pmap(
        per_replica(tx), axis_name="i", in_axes=(None, axes, 0, 0), out_axes=(None, axes), devices=jax.devices()[:R]
    )
    return (step, *placed(jax.sharding.Mesh(np.array(jax.devices()[:R]), ("i",)), init_mlp(), state, "i"))


def run_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:R]), ("i",))
    tx = make_tx("i")
    state = optax_adascale.replicate_buffers(tx.init(init_mlp()), R)
    specs = optax_adascale.state_partition_specs(state, "i")

    def ramp_step(params, state, x, y):
        grads = jax.grad(mlp_loss)(jax.lax.pcast(params, "i", to="varying"), x[0], y[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(ramp_step, mesh=mesh, in_specs=(P(), specs, P("i"), P("i")), out_specs=(P(), specs)))
    return (step, *placed(mesh, init_mlp(), state, "i"))


def gspmd_setup():
    mesh = jax.make_mesh((R,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:R])
    tx = make_tx(None)  # the statistics arrive reduced from value_and_grad
    grad_fn = optax_adascale.value_and_grad(mlp_loss, data_axes="data", mesh=mesh)
    batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def ramp_step(params, state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    def put(c, x, y):  # the global micro-batch: replica r's rows are data shard r's
        return jax.device_put(x.reshape(R * ROWS, DIM), batch), jax.device_put(y.reshape(R * ROWS), batch)

    return mesh, tx, ramp_step, put


RUNS = {"vmap": run_vmap, "pmap": run_pmap, "shard_map": run_shard_map}


@pytest.fixture(scope="module")
def reference():
    step, params, state = run_vmap()
    return loop(step, params, state)


@pytest.mark.parametrize("door", ["pmap", "shard_map", "gspmd"])
def test_every_front_door_takes_the_same_rungs_and_the_same_steps_with_one_compile(door, reference):
    ref_params, ref_state, ref_ks = reference
    assert ref_ks == EXPECTED_KS
    later = []
    with backend_compiles("ramp_step") as compiles, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if door == "gspmd":
            mesh, tx, step, put = gspmd_setup()
            with jax.set_mesh(mesh):
                params, state, ks = loop(step, init_mlp(), jax.jit(tx.init)(init_mlp()), put, later)
        else:
            step, params, state = RUNS[door]()
            params, state, ks = loop(step, params, state, later=later)
    assert ks == EXPECTED_KS
    assert not [w for w in caught if "BatchRamp got a batch" in str(w.message)]  # one micro-batch per call
    assert later == []  # nothing compiles after the first call: rungs 2 and 4, up and down, run the same program
    if door != "pmap":  # (pmap's program has an internal name)
        assert len(compiles) == 1 and step._cache_size() == 1, compiles
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), params, ref_params)
    m, ref = optax_adascale.metrics(state), optax_adascale.metrics(ref_state)
    for key in ("gain", "scale_invariant_steps", "grad_var", "grad_sqr", "scale", "next_scale", "microbatches_seen"):
        np.testing.assert_allclose(np.asarray(m[key]), np.asarray(ref[key]), rtol=2e-5, err_msg=key)


def test_gspmd_accumulated_statistics_are_those_of_the_accumulated_mean():
    """After the first update of k = 2 calls × 4 shards: σ̂², μ̂² from the 8 per-shard gradients, by hand."""
    ramp = optax_adascale.BatchRamp(2, 4)
    tx = optax_adascale.adascale_sgd(SCHEDULE, accumulation_steps=ramp)
    mesh = jax.make_mesh((R,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:R])
    grad_fn = optax_adascale.value_and_grad(mlp_loss, data_axes="data", mesh=mesh)
    batch = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(params, state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        return tx.update(grads, state, params, microbatch_stats=stats)

    x, y = data()
    params, state = init_mlp(), tx.init(init_mlp())
    with jax.set_mesh(mesh):
        for c in range(2):
            put = lambda a: jax.device_put(a.reshape((R * ROWS, *a.shape[2:])), batch)  # noqa: E731
            _, state = step(params, state, put(x[c]), put(y[c]))
    flat = lambda g: jnp.concatenate([v.ravel() for v in jax.tree.leaves(g)])  # noqa: E731
    samples = jnp.stack([flat(jax.grad(mlp_loss)(params, x[c][r], y[c][r])) for c in range(2) for r in range(R)])
    n = 2 * R
    a = jnp.mean(jnp.sum(samples**2, axis=1))
    b = jnp.sum(jnp.mean(samples, axis=0) ** 2)
    var = n / (n - 1) * (a - b)
    m = optax_adascale.metrics(state)
    np.testing.assert_allclose(m["grad_var"], var, rtol=1e-5)  # the first update's averages are its estimates
    np.testing.assert_allclose(m["grad_sqr"], b - var / n, rtol=1e-4)
    assert float(m["scale"]) == n


def test_gspmd_buffers_lie_like_the_params_and_the_ramp_compiles_once():
    """In a jit step over the global batch the accumulation buffer has no replica axis: state_partition_specs gives
    it the parameter's spec (here split over the data axis, as FSDP would), so a trainer's jitted init puts the
    state where the step leaves it and the whole ramp runs one program."""
    mesh = jax.make_mesh((R,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:R])
    param_specs = {"hidden": {"w": P(None, "data"), "b": P("data")}, "out": {"w": P("data", None), "b": P()}}
    tx = make_tx(None)
    specs = optax_adascale.state_partition_specs(jax.eval_shape(tx.init, init_mlp()), "data", param_specs, tx=tx)
    state_specs = optax_adascale.get_adascale_state(specs)
    assert state_specs.acc_grads == param_specs and state_specs.acc_sq_norm == P()
    assert state_specs.ramp == optax_adascale.RampState(P(), P(), P(), P())
    shard = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree)  # noqa: E731
    grad_fn = optax_adascale.value_and_grad(mlp_loss, data_axes="data", mesh=mesh)

    @jax.jit
    def ramp_step(params, state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), state

    step = jax.jit(ramp_step, out_shardings=(shard(param_specs), shard(specs)))
    params = jax.device_put(init_mlp(), shard(param_specs))
    state = jax.jit(tx.init, out_shardings=shard(specs))(params)
    _, _, _, put = gspmd_setup()
    with jax.set_mesh(mesh):
        params, state, ks = loop(step, params, state, put)
    assert ks == EXPECTED_KS and step._cache_size() == 1
    leaf = optax_adascale.get_adascale_state(state).acc_grads["hidden"]["w"]
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), leaf.ndim)


def test_a_loader_that_feeds_the_whole_updates_batch_every_call_is_warned_about():
    """Issue 40 item 4: fed k_t micro-batches at once every call (the whole update's batch), a ramp recompiled at
    every rung and read k_t times the data, with no word. The drop-in's statistics carry the batch's rows, and an
    update under a ramp warns when they change; the loop of one micro-batch per call says nothing."""
    mesh, tx, step, put = gspmd_setup()
    x, y = data()

    def whole_update(state):  # the wrong loader: k_t micro-batches per call, starting at the update count
        k = int(optax_adascale.batch_plan(state)["microbatches"])
        start = int(optax_adascale.get_adascale_state(state).count) * k
        rows = NamedSharding(mesh, P("data"))
        xs, ys = x[start : start + k].reshape(-1, DIM), y[start : start + k].reshape(-1)
        return jax.device_put(xs, rows), jax.device_put(ys, rows)

    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params, state = init_mlp(), jax.jit(tx.init)(init_mlp())
        for _ in range(3):  # k: 1, then 2 (EXPECTED_KS)
            params, state = step(params, state, *whole_update(state))
    said = [str(w.message) for w in caught if "BatchRamp got a batch" in str(w.message)]
    assert len(said) == 1 and f"[{2 * R * ROWS}, {2 * R * ROWS}] rows, after [{R * ROWS}, {R * ROWS}]" in said[0]
    assert "microbatches_seen" in said[0]
    # (the loop of one micro-batch per call warns nothing: test_every_front_door_..., gspmd)
