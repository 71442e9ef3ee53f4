"""``optax_adascale.value_and_grad`` in a training run: the drop-in equals the per-replica paths.

For a loss that is a mean over rows, data shard ``i`` of the global batch is replica ``i`` of a
``jax.vmap(..., axis_name="data")`` per-replica AdaScale run (tx with ``axis_name``), unsharded: the
same gains, τ and parameters over 12 updates. The drop-in runs one ``jax.jit`` step over the global
batch on a (data 4, model 2) mesh with the parameters replicated, split over "model" (TP), over "data"
(FSDP) or both; the tx has no axis_name. (``test_semantics.py``: any loss, against jax.value_and_grad.)
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

# Auto meshes without param_specs on purpose: the parameters replicate inside the loss, and the values are
# what these tests check; test_semantics checks the warning about the lost memory saving.
pytestmark = pytest.mark.filterwarnings("ignore:value_and_grad.*on a mesh with Auto axes:UserWarning")

D_IN, HIDDEN, CLASSES, ROWS, STEPS = 16, 32, 8, 128, 12
SCHEDULE = optax.exponential_decay(0.5, transition_steps=6, decay_rate=0.5)

LAYOUTS = {
    "replicated": {"w1": P(), "b1": P(), "w2": P()},
    "TP": {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)},
    "FSDP": {"w1": P("data", None), "b1": P("data"), "w2": P("data", None)},
    "TPxFSDP": {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", "data")},
}


def init_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (D_IN, HIDDEN)) * 0.4,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) * 0.4,
    }
    return jax.tree.map(lambda p: p.astype(dtype), params)


def loss_fn(params, x, y):
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    logits = (h @ params["w2"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def batches(steps=STEPS, rows=ROWS):
    """A noisy teacher's labels, from NumPy's generator (jax.random here costs seconds of threefry compilation)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps, rows, D_IN), dtype=np.float32)
    teacher = rng.standard_normal((D_IN, CLASSES), dtype=np.float32)
    noise = rng.standard_normal((steps, rows, CLASSES), dtype=np.float32)
    return x, np.argmax(x @ teacher + 2.0 * noise, axis=-1).astype(np.int32)


def auto_mesh(shape=(4, 2), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def record(opt_state):
    m = optax_adascale.metrics(opt_state)
    return float(m["gain"]), float(m["scale_invariant_steps"])


@functools.cache
def replicated_run(replicas, k, dtype=jnp.float32):
    """Per-replica AdaScale (axis_name="data"): replica i gets rows i·B/replicas … of each global batch."""
    tx = optax_adascale.adascale_sgd(SCHEDULE, momentum=0.9, axis_name="data")
    grad_fn = optax_adascale.value_and_grad(loss_fn, num_microbatches=k)

    def replica_step(params, opt_state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jax.vmap(replica_step, in_axes=(None, None, 0, 0), out_axes=(None, None), axis_name="data"))
    params = init_params(dtype)
    opt_state = tx.init(params)
    log = []
    for x, y in zip(*batches(), strict=True):
        params, opt_state = step(params, opt_state, x.reshape(replicas, -1, D_IN), y.reshape(replicas, -1))
        log.append(record(opt_state))
    return params, np.array(log)


def state_shardings(tx, params, mesh, specs, data_axes="data"):
    """The documented way: state_partition_specs of jax.eval_shape(tx.init, params), as NamedShardings."""
    state_specs = optax_adascale.state_partition_specs(jax.eval_shape(tx.init, params), data_axes, specs, tx=tx)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)


def global_run(mesh, specs, data_axes, k, dtype=jnp.float32, loss=loss_fn):
    """The user's step: one jit over the global batch, the drop-in, a tx without axis_name."""
    tx = optax_adascale.adascale_sgd(SCHEDULE, momentum=0.9)
    grad_fn = optax_adascale.value_and_grad(loss, data_axes=data_axes, num_microbatches=k)
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put(init_params(dtype), p_sh)
    s_sh = state_shardings(tx, params, mesh, specs, data_axes)
    opt_state = jax.jit(tx.init, out_shardings=s_sh)(params)
    batch_sh = NamedSharding(mesh, P(data_axes))

    @functools.partial(jax.jit, out_shardings=(p_sh, s_sh))
    def step(params, opt_state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    log = []
    with jax.set_mesh(mesh):
        for x, y in zip(*batches(), strict=True):
            params, opt_state = step(params, opt_state, jax.device_put(x, batch_sh), jax.device_put(y, batch_sh))
            log.append(record(opt_state))
    for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(p_sh), strict=True):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    return params, np.array(log)


def assert_same_run(ours, ref, rtol, params_tol=None):
    (params, log), (ref_params, ref_log) = ours, ref
    # (the first updates of SGD's guarded τ clock grow from 1 by 10 % an update: 1.1, 1.21, then above)
    assert np.all(ref_log[2:, 0] > 1.2), "the reference must have gains well above 1 for the test to mean anything"
    np.testing.assert_allclose(log, ref_log, rtol=rtol)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=params_tol or rtol, atol=params_tol or rtol
        ),
        params,
        ref_params,
    )


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_global_batch_run_equals_replicated_run(layout, k):
    """Data shard i = replica i: gain, τ and params over 12 updates, for every parameter layout."""
    ours = global_run(auto_mesh(), LAYOUTS[layout], "data", k)
    assert_same_run(ours, replicated_run(4, k), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", ["replicated", "TPxFSDP"])
def test_bfloat16_params_run_equals_replicated_run(layout, k):
    """bfloat16 parameters, statistics in float32: the same run as the replicated bfloat16 one."""
    ours = global_run(auto_mesh(), LAYOUTS[layout], "data", k, jnp.bfloat16)
    # The per-shard bfloat16 gradients themselves differ in rounding between a batched (vmap) and a
    # sharded computation (XLA's reduction order): 2⁻⁸ relative is one bfloat16 rounding step. Gain and τ
    # agree to that; bfloat16 parameters drift apart by a few such steps over 12 updates.
    assert_same_run(ours, replicated_run(4, k, jnp.bfloat16), rtol=2**-8, params_tol=4 * 2**-8)


@pytest.mark.parametrize("k", [1, 2])
def test_data_axes_tuple_on_three_axis_mesh(k):
    """data_axes=("data", "fsdp"): the batch over both, parameters FSDP over both and TP over "model"."""
    mesh = auto_mesh((2, 2, 2), ("data", "fsdp", "model"))
    specs = {"w1": P(("data", "fsdp"), "model"), "b1": P("model"), "w2": P("model", ("data", "fsdp"))}
    ours = global_run(mesh, specs, ("data", "fsdp"), k)
    assert_same_run(ours, replicated_run(4, k), rtol=1e-5)


# --------------------------------------------------------------------------- what a call returns


def place(mesh, specs, *batch):
    params = jax.device_put(init_params(), jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    return params, [jax.device_put(b, NamedSharding(mesh, P("data"))) for b in batch]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", ["replicated", "TPxFSDP"])
def test_value_and_grads_equal_jax_value_and_grad_on_the_global_batch(layout, k):
    mesh = auto_mesh()
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS[layout], x, y)
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=k))
    with jax.set_mesh(mesh):
        value, grads, stats = fn(params, xs, ys)
    ref_value, ref_grads = jax.value_and_grad(loss_fn)(init_params(), x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    # The statistics: per leaf the mean over the n = 4k samples (contiguous row blocks) of ‖g_i‖².
    n = 4 * k
    samples = [jax.grad(loss_fn)(init_params(), x.reshape(n, -1, D_IN)[i], y.reshape(n, -1)[i]) for i in range(n)]
    expected = jax.tree.map(lambda *g: np.mean([np.sum(np.square(a)) for a in g]), *samples)
    assert stats.num_microbatches == n
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats.sq_norms, expected)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(stats.sq_norms))


def test_has_aux_is_as_from_the_global_call_and_averaged_over_micro_batches():
    """k = 1: the global call's aux; k = 2: floating aux averaged over the two global micro-batches."""

    def loss_with_aux(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.mean(), {"per_example": losses, "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}

    mesh = auto_mesh()
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TP"], x, y)
    (ref_loss, ref_aux), _ = jax.value_and_grad(loss_with_aux, has_aux=True)(init_params(), x, y)
    halves = np.arange(ROWS).reshape(4, 2, -1)
    micro = [
        jax.value_and_grad(loss_with_aux, has_aux=True)(init_params(), x[h], y[h])[0][1]
        for h in (halves[:, 0].ravel(), halves[:, 1].ravel())
    ]
    for k, expected in ((1, ref_aux), (2, jax.tree.map(lambda a, b: (a + b) / 2, *micro))):
        fn = jax.jit(optax_adascale.value_and_grad(loss_with_aux, data_axes="data", num_microbatches=k, has_aux=True))
        with jax.set_mesh(mesh):
            (loss, aux), _, _ = fn(params, xs, ys)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
        np.testing.assert_allclose(aux["per_example"], expected["per_example"], rtol=1e-5)
        np.testing.assert_allclose(aux["accuracy"], expected["accuracy"], rtol=1e-6)


DROP = 0.7


def dropout_loss(params, x, y, mask, noise):
    """The loss with its random draws as inputs: the truth the drop-in's draws are held to."""
    h = jnp.where(mask, jnp.tanh(x @ params["w1"] + params["b1"]) / DROP, 0.0)
    return optax.softmax_cross_entropy_with_integer_labels(h @ (params["w2"] + noise), y).mean()


def draws(key, rows):
    """A dropout mask shaped by the rows and a noise of w2's shape (not shaped by the rows)."""
    k_mask, k_noise = jax.random.split(key)
    return jax.random.bernoulli(k_mask, DROP, (rows, HIDDEN)), 0.01 * jax.random.normal(k_noise, (HIDDEN, CLASSES))


def random_loss(params, x, y, key):
    """Dropout from a key passed unbatched (a scalar batch leaf), split inside the loss."""
    return dropout_loss(params, x, y, *draws(key, x.shape[0]))


@pytest.mark.parametrize(("axis_type", "k"), [(AxisType.Auto, 1), (AxisType.Auto, 2), (AxisType.Explicit, 1)])
def test_random_draws_inside_the_loss_are_the_loss_calls(axis_type, k):
    """A key passed unbatched: k = 1, the global call's draws; k = 2, each micro-batch's call with that key (the
    mean of jax.value_and_grad on each). The statistics are those of the samples' gradients under those draws."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    x, y = (b[0][:32] for b in batches())
    key = jax.random.key(3)
    params, (xs, ys) = place(mesh, LAYOUTS["replicated"], x, y)
    fn = jax.jit(optax_adascale.value_and_grad(random_loss, data_axes="data", num_microbatches=k))
    with jax.set_mesh(mesh):
        value, grads, stats = fn(params, xs, ys, key)
    blocks = np.arange(32).reshape(4, k, -1)
    calls = [random_reference(tuple(blocks[:, j].ravel())) for j in range(k)]
    ref_value, ref_grads = (
        np.mean([c[0] for c in calls]),
        jax.tree.map(lambda *g: np.mean(g, 0), *[c[1] for c in calls]),
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats.sq_norms, dropout_stats(k))


@functools.cache
def random_reference(rows):
    x, y = (b[0][:32][list(rows)] for b in batches())
    return jax.jit(jax.value_and_grad(random_loss))(init_params(), x, y, jax.random.key(3))


@functools.cache
def dropout_stats(k, n_shards=4, rows=32):
    """Per leaf, mean over the n samples of ‖g_i‖²: sample (i, j) is shard i's block of micro-batch j, under the
    mask of micro-batch j's call (drawn at the micro-batch's shape)."""
    x, y = (b[0][:rows] for b in batches())
    blocks = np.arange(rows).reshape(n_shards, k, -1)
    per_sample = jax.jit(jax.vmap(jax.grad(dropout_loss), in_axes=(None, 0, 0, 0, None)))
    norms = []
    for j in range(k):
        r = blocks[:, j].ravel()
        mask, noise = draws(jax.random.key(3), len(r))
        split = (a.reshape((n_shards, -1) + a.shape[1:]) for a in (x[r], y[r], mask))
        grads = per_sample(init_params(), *split, noise)
        # a sample's loss is its block's share of the call's mean: the gradient of the block's own mean / shards
        norms.append(jax.tree.map(lambda g: jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim))), grads))
    return jax.tree.map(lambda *a: jnp.mean(jnp.concatenate(a)), *norms)


@pytest.mark.parametrize(("axis_type", "k"), [(AxisType.Auto, 1), (AxisType.Auto, 2)])
def test_flax_dropout_inside_the_loss_is_the_global_calls(axis_type, k):
    """Flax nn.Dropout in an nn.Module applied with rngs={"dropout": key} (a key closed over). On an Explicit
    mesh linen's Dropout fails in JAX itself (its `select` of a replicated mask against batch-sharded rows), for
    the user's own jax.value_and_grad as well: the Explicit way is NNX's or a mask drawn with out_sharding."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(HIDDEN)(x)))
            return nn.Dense(CLASSES)(h)

    model, key = MLP(), jax.random.key(4)
    x, y = (b[0][:32] for b in batches())
    variables = jax.jit(model.init)(jax.random.key(0), x)  # one compilation, not one per eager op

    def loss(variables, x, y):
        logits = model.apply(variables, x, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    # k = 2: the mean of jax.value_and_grad on each micro-batch (the j-th block of every shard's rows), each call
    # drawing its own mask with the same key at the micro-batch's shape.
    blocks = np.arange(32).reshape(4, k, -1)
    calls = [jax.jit(jax.value_and_grad(loss))(variables, x[r], y[r]) for r in (blocks[:, j].ravel() for j in range(k))]
    ref = jax.tree.map(lambda *c: np.mean(c, 0), *calls)
    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k))
    with jax.set_mesh(mesh):
        ours = fn(variables, *(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in (x, y)))[:2]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, ref)


def test_random_draws_inside_stacked_layers_are_the_global_calls():
    """Dropout per layer (fold_in of the layer index) inside a scanned, checkpointed stack (probed per layer)."""

    def loss(params, x, y, key):
        def layer(h, wi):
            w, i = wi
            keep = jax.random.bernoulli(jax.random.fold_in(key, i), 0.8, h.shape)
            return h + jnp.where(keep, jnp.tanh(h @ w), 0.0), None

        h = jax.lax.scan(jax.checkpoint(layer), x, (params["layers"]["w"], jnp.arange(3)))[0]
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], y).mean()

    mesh, key = auto_mesh(), jax.random.key(5)
    x, y = (b[0][:32] for b in batches())
    params = stacked_params()
    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))
    with jax.set_mesh(mesh):
        ours = fn(params, *(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in (x, y)), key)[:2]
    ref = jax.jit(jax.value_and_grad(loss))(params, x, y, key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, ref)


# --------------------------------------------------------------------------- per replica (data_axes=None)


def test_data_axes_none_is_the_per_replica_helper_and_the_old_name_warns():
    x, y = (b[0][:32] for b in batches())
    new = optax_adascale.value_and_grad(loss_fn, num_microbatches=4)(init_params(), x, y)
    with pytest.warns(DeprecationWarning, match="value_and_grad"):
        old_fn = optax_adascale.value_and_microbatch_grad(loss_fn, 4, unroll=2)
    old = old_fn(init_params(), x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), new, old)
    assert "value_and_microbatch_grad" not in optax_adascale.__all__
    assert "value_and_grad" in optax_adascale.__all__


def test_data_axes_none_under_a_jit_over_a_multi_device_mesh_raises():
    mesh = auto_mesh()
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["replicated"], x, y)
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, num_microbatches=2))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"no replica axis is bound.*data_axes="):
        fn(params, xs, ys)


def test_data_axes_none_on_one_device_is_allowed():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = (b[0][:32] for b in batches())
        _, _, stats = jax.jit(optax_adascale.value_and_grad(loss_fn, num_microbatches=2))(init_params(), x, y)
    assert stats.num_microbatches == 2


# --------------------------------------------------------------------------- errors


def call_global(mesh_ctx, *, data_axes="data", k=1, rows=ROWS, mesh=None):
    x, y = (b[0][:rows] for b in batches())
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes=data_axes, num_microbatches=k, mesh=mesh))
    if mesh_ctx is None:
        return fn(init_params(), x, y)
    with mesh_ctx:
        return fn(init_params(), x, y)


def test_batch_not_divisible_by_shards_times_k_names_both_numbers():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x, y = (jax.device_put(b[0][:100], NamedSharding(mesh, P("data"))) for b in batches())  # 25 rows a shard
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=2))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"100 rows.*4 × 2"):
        fn(init_params(), x, y)


def test_data_axes_not_in_mesh_lists_the_mesh_axes():
    with pytest.raises(ValueError, match=r"\['batch'\] not in the mesh.*\('data', 'model'\)"):
        call_global(jax.set_mesh(auto_mesh()), data_axes="batch")


def test_no_mesh_names_set_mesh_and_mesh_keyword():
    with pytest.raises(ValueError, match=r"jax\.set_mesh.*mesh=mesh"):
        call_global(None)


def test_old_with_mesh_form_is_named():
    with pytest.raises(ValueError, match=r"`with mesh:` block.*invisible"):
        call_global(auto_mesh())


def test_mesh_keyword_without_context():
    _, _, stats = call_global(None, mesh=auto_mesh())
    assert stats.num_microbatches == 4


# --------------------------------------------------------------------------- optimizer state: shardings, Orbax


def test_state_shardings_follow_the_params_and_survive_an_orbax_round_trip(tmp_path):
    """jax.jit(tx.init, out_shardings=state_shardings) shards momentum like its parameter (TP×FSDP);
    Orbax saves that state and restores it onto the same shardings; the resumed run equals the unbroken one."""
    from helpers import assert_trees_equal, restore, save

    mesh, specs = auto_mesh(), LAYOUTS["TPxFSDP"]
    tx = optax_adascale.adascale_sgd(SCHEDULE, momentum=0.9)
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")
    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    params = jax.device_put(init_params(), p_sh)
    s_sh = state_shardings(tx, params, mesh, specs)
    opt_state = jax.jit(tx.init, out_shardings=s_sh)(params)
    momentum = optax.tree.get(opt_state, "trace")
    assert momentum["w1"].sharding.is_equivalent_to(p_sh["w1"], 2)
    assert not momentum["w1"].sharding.is_fully_replicated

    @functools.partial(jax.jit, out_shardings=(p_sh, s_sh), donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    batch_sh = NamedSharding(mesh, P("data"))
    xs, ys = (jax.device_put(b[:4], batch_sh) for b in batches())
    with jax.set_mesh(mesh):
        for t in range(2):
            params, opt_state = step(params, opt_state, xs[t], ys[t])
        save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            {"params": params, "opt_state": opt_state},
        )
        restored = restore(tmp_path / "ckpt", target)
        assert_trees_equal(restored, {"params": params, "opt_state": opt_state})
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        resumed = (restored["params"], restored["opt_state"])
        for t in range(2, 4):
            params, opt_state = step(params, opt_state, xs[t], ys[t])
            resumed = step(*resumed, xs[t], ys[t])
    assert_trees_equal(resumed, (params, opt_state))


def test_loss_constraining_the_batch_axis_on_an_auto_mesh_is_the_global_call():
    """with_sharding_constraint naming the data axis (it used to raise): the data axes are dropped from the
    constraint (the vmapped dimension carries them), the model axes kept; value and grads are the global call's."""

    def constrained(params, x, y):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ params["w1"] + params["b1"]), P("data", "model"))
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()

    mesh = auto_mesh()
    x, y = (b[0][:32] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TPxFSDP"], x, y)
    ref = jax.jit(jax.value_and_grad(loss_fn))(init_params(), x, y)
    fn = jax.jit(optax_adascale.value_and_grad(constrained, data_axes="data"))
    with jax.set_mesh(mesh):
        ours = fn(params, xs, ys)[:2]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, ref)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explicit_mesh_run_equals_replicated_run(layout, k):
    """jax.make_mesh's default (Explicit axes), the loss written the Explicit way: the same run."""
    ours = global_run(jax.make_mesh((4, 2), ("data", "model")), LAYOUTS[layout], "data", k, loss=explicit_way_loss)
    assert_same_run(ours, replicated_run(4, k), rtol=1e-5)


def test_explicit_mesh_aux_and_shardings():
    """On an Explicit mesh grads keep the params' shardings; per-example aux comes back split like the batch."""

    def loss_with_aux(params, x, y):
        w1 = jax.sharding.reshard(params["w1"], P(None, "model"))
        b1, w2 = jax.sharding.reshard(params["b1"], P("model")), jax.sharding.reshard(params["w2"], P("model", None))
        h = jnp.tanh(jnp.einsum("bd,dh->bh", x, w1, out_sharding=P("data", "model")) + b1)
        logits = jnp.einsum("bh,hc->bc", h, w2, out_sharding=P("data", None))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.mean(), {"per_example": losses}

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TPxFSDP"], x, y)
    fn = jax.jit(optax_adascale.value_and_grad(loss_with_aux, data_axes="data", has_aux=True))
    with jax.set_mesh(mesh):
        (loss, aux), grads, _ = fn(params, xs, ys)
        (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(loss_with_aux, has_aux=True))(params, xs, ys)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["per_example"], ref_aux["per_example"], rtol=1e-5)
    assert aux["per_example"].sharding.is_equivalent_to(ref_aux["per_example"].sharding, 1)
    for g, p, r in zip(jax.tree.leaves(grads), jax.tree.leaves(params), jax.tree.leaves(ref_grads), strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_explicit_mesh_passed_as_mesh_keyword():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TP"], x, y)
    ref = jax.value_and_grad(loss_fn)(init_params(), x, y)
    for k in (1, 2):
        value, grads, stats = jax.jit(
            optax_adascale.value_and_grad(explicit_way_loss, data_axes="data", num_microbatches=k, mesh=mesh)
        )(params, xs, ys)
        assert stats.num_microbatches == 4 * k
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), (value, grads), ref)


def explicit_way_loss(params, x, y):
    """loss_fn written the Explicit way, as MaxText and Flax's lm1b write theirs: parameters resharded for use,
    out_sharding= naming the batch and model axes, a constraint on the activations."""
    w1 = jax.sharding.reshard(params["w1"], P(None, "model"))
    b1, w2 = jax.sharding.reshard(params["b1"], P("model")), jax.sharding.reshard(params["w2"], P("model", None))
    h = jnp.tanh(jnp.einsum("bd,dh->bh", x, w1, out_sharding=P("data", "model")) + b1)
    h = jax.lax.with_sharding_constraint(h, P("data", "model"))
    logits = jnp.einsum("bh,hc->bc", h, w2, out_sharding=P("data", None))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.parametrize(("layout", "k"), [("TP", 1), ("TPxFSDP", 2)])
def test_explicit_way_loss_run_equals_replicated_run(layout, k):
    """On jax.make_mesh's Explicit mesh, a loss naming the batch axis in out_sharding= / reshard / constraints
    (it used to raise): the same run as the replicated one."""
    ours = global_run(jax.make_mesh((4, 2), ("data", "model")), LAYOUTS[layout], "data", k, loss=explicit_way_loss)
    assert_same_run(ours, replicated_run(4, k), rtol=1e-5)


def test_explicit_way_loss_with_dropout_is_the_global_call():
    """Explicit mesh, k = 2: shardings naming the batch axis and a dropout mask from a key passed unbatched; value
    and grads are the mean over the two micro-batches of jax.value_and_grad of the same loss on that mesh."""

    def loss(params, x, y, key):
        h = jnp.tanh(jnp.einsum("bd,dh->bh", x, params["w1"], out_sharding=P("data", "model")) + params["b1"])
        h = jnp.where(jax.random.bernoulli(key, DROP, h.shape), h / DROP, 0.0)
        logits = jnp.einsum("bh,hc->bc", h, params["w2"], out_sharding=P("data", None))
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    mesh, key = jax.make_mesh((4, 2), ("data", "model")), jax.random.key(3)
    x, y = (b[0][:32] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TP"], x, y)
    halves = np.arange(32).reshape(4, 2, -1)
    with jax.set_mesh(mesh):
        ref_fn = jax.jit(jax.value_and_grad(loss))
        calls = [
            ref_fn(params, *place(mesh, LAYOUTS["TP"], x[h], y[h])[1], key)
            for h in (halves[:, 0].ravel(), halves[:, 1].ravel())
        ]
        ours = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=2))(params, xs, ys, key)
    ref = jax.tree.map(lambda a, b: (a + b) / 2, *calls)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours[:2], ref)


def test_explicit_mesh_loss_not_valid_the_explicit_way_fails_as_jax_value_and_grad_does():
    """out_sharding= on one matmul, the next contracting model-sharded dimensions without one: JAX refuses it on
    an Explicit mesh for the user's own step, and the drop-in (which runs the loss as written) the same way."""

    def half_explicit(params, x, y):
        h = jnp.tanh(jnp.einsum("bd,dh->bh", x, params["w1"], out_sharding=P("data", "model")) + params["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params, (xs, ys) = place(mesh, LAYOUTS["TP"], *(b[0][:32] for b in batches()))
    with jax.set_mesh(mesh):
        with pytest.raises(Exception, match=r"Contracting dimensions") as theirs:
            jax.jit(jax.value_and_grad(half_explicit))(params, xs, ys)
        with pytest.raises(type(theirs.value), match=r"Contracting dimensions"):
            jax.jit(optax_adascale.value_and_grad(half_explicit, data_axes="data"))(params, xs, ys)


def test_data_axis_constraint_inside_custom_vjp_on_an_auto_mesh_is_the_global_call():
    """A constraint naming the data axis inside a custom_vjp (an Auto mesh): its jaxprs are re-evaluated with the
    data axes made Explicit and the constraint dropped like any other: value and grads are the global call's."""

    @jax.custom_vjp
    def act(h):
        return jax.lax.with_sharding_constraint(jnp.tanh(h), P("data", None))

    act.defvjp(lambda h: (act(h), h), lambda h, g: (g * (1 - jnp.tanh(h) ** 2),))

    def loss(params, x, y):
        h = act(x @ params["w1"] + params["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()

    mesh = auto_mesh()
    x, y = (b[0][:32] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["replicated"], x, y)
    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))
    with jax.set_mesh(mesh):
        ours = fn(params, xs, ys)[:2]
        ref = jax.jit(jax.value_and_grad(loss))(params, xs, ys)  # the constraint needs the mesh too
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, ref)


# --------------------------------------------------------------------------- your own loop (docs/gspmd.md)


def test_own_loop_recipe_equals_num_microbatches():
    """The docs' loop (drop-in per micro-batch, stats summed) is num_microbatches=k when micro-batch j
    gives each shard the rows that num_microbatches=k's j-th micro-batch of that shard holds."""
    mesh, k, shards = auto_mesh(), 2, 4
    x, y = (b[0] for b in batches())
    params, (xs, ys) = place(mesh, LAYOUTS["TP"], x, y)
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")

    @jax.jit
    def own_loop(params, x, y):
        micro = jax.tree.map(
            lambda a: a.reshape((shards, k, -1) + a.shape[1:]).swapaxes(0, 1).reshape((k, -1) + a.shape[1:]), (x, y)
        )

        def body(carry, mb):
            grad_sum, sq_sum = carry
            loss, grads, stats = grad_fn(params, *mb)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            return (add(grad_sum, grads), add(sq_sum, stats.sq_norms)), loss

        zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda _: jnp.zeros(()), params))
        (grad_sum, sq_sum), losses = jax.lax.scan(body, zeros, micro)
        stats = optax_adascale.MicrobatchStats(jax.tree.map(lambda s: s / k, sq_sum), shards * k)
        return losses.mean(), jax.tree.map(lambda g: g / k, grad_sum), stats

    with jax.set_mesh(mesh):
        ours = own_loop(params, xs, ys)
        ref = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=k))(params, xs, ys)
    assert ours[2].num_microbatches == ref[2].num_microbatches == 8
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours[:2], ref[:2])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), ours[2].sq_norms, ref[2].sq_norms)


# --------------------------------------------------------------------------- stacked (scanned) layers


@functools.cache  # jax arrays are immutable: one set for every test
def stacked_params(layers=3, d=D_IN):
    @jax.jit  # one compilation, not one per eager op
    def make():
        kw, kb = jax.random.split(jax.random.key(7))
        w, b = jax.random.normal(kw, (layers, d, d)) * 0.3, jax.random.normal(kb, (layers, d)) * 0.1
        return {"layers": {"w": w, "b": b}, "head": jax.random.normal(jax.random.key(8), (d, CLASSES)) * 0.4}

    return make()


def stacked_loss(params, x, y, *, remat=True, inner_jit=False):
    def layer(h, lp):
        return h + jnp.tanh(h @ lp["w"] + lp["b"]), None

    def trunk(h, stack):
        return jax.lax.scan(jax.checkpoint(layer) if remat else layer, h, stack)[0]

    h = (jax.jit(trunk) if inner_jit else trunk)(x, params["layers"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], y).mean()


STACKED_SPECS = {"layers": {"w": P(None, "data", "model"), "b": P(None, "data")}, "head": P("data", "model")}


@pytest.mark.parametrize("variant", ["remat", "plain", "inner_jit", "reverse", "remat_k2"])
def test_stacked_scanned_layers_give_the_per_shard_statistics(variant):
    """Stacked layers applied by lax.scan (probed per layer inside the scan): value, grads and per-leaf
    statistics as from jax.grad on each shard's rows, with the stacked leaf FSDP×TP on a non-leading dim."""
    if variant == "reverse":

        def loss(params, x, y):
            h = jax.lax.scan(
                lambda h, lp: (h + jnp.tanh(h @ lp["w"] + lp["b"]), None), x, params["layers"], reverse=True
            )[0]
            return optax.softmax_cross_entropy_with_integer_labels(h @ params["head"], y).mean()
    else:
        loss = functools.partial(stacked_loss, remat=variant != "plain", inner_jit=variant == "inner_jit")
    mesh = auto_mesh()
    x, y = (b[0] for b in batches())
    params = stacked_params()
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), STACKED_SPECS))
    xs, ys = (jax.device_put(b, NamedSharding(mesh, P("data"))) for b in (x, y))
    k = 2 if variant.endswith("k2") else 1
    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=k))
    with jax.set_mesh(mesh):
        value, grads, stats = fn(placed, xs, ys)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    n = 4 * k
    samples = [jax.grad(loss)(params, x.reshape(n, -1, D_IN)[i], y.reshape(n, -1)[i]) for i in range(n)]
    expected = jax.tree.map(lambda *g: np.mean([np.sum(np.square(a)) for a in g]), *samples)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats.sq_norms, expected)


def test_stacked_leaf_used_outside_the_scan_too_is_probed_whole():
    """A stacked leaf also read outside the scan (here: a penalty on it) is not split per layer: its
    statistics are still each shard's whole-leaf ‖g_i‖²."""

    def loss(params, x, y):
        return stacked_loss(params, x, y) + 0.01 * jnp.sum(params["layers"]["w"] ** 2)

    mesh = auto_mesh()
    x, y = (b[0] for b in batches())
    params = stacked_params()
    fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))
    with jax.set_mesh(mesh):
        _, _, stats = fn(params, *(jax.device_put(b, NamedSharding(mesh, P("data"))) for b in (x, y)))
    samples = [jax.grad(loss)(params, x.reshape(4, -1, D_IN)[i], y.reshape(4, -1)[i]) for i in range(4)]
    expected = jax.tree.map(lambda *g: np.mean([np.sum(np.square(a)) for a in g]), *samples)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), stats.sq_norms, expected)
