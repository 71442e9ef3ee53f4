"""The traps a new user of the drop-in met (issue 26 §6): each is refused with the fix, or works.

Each test here failed on 0.2: the mis-named data axis trained on model shards as samples, a 1-device mesh
said nothing, ``optax.MultiSteps`` around AdaScale reported one call's scale, and clipping ``grads`` before
``update`` pinned the gain at S.
"""

import contextlib
import warnings

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

ROWS, DIM, CLASSES = 64, 8, 4


def batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(ROWS,)).astype(np.int32)
    return x, y


def init_params():
    rng = np.random.default_rng(1)
    return {"w": (rng.normal(size=(DIM, CLASSES)) / 3).astype(np.float32), "b": np.zeros(CLASSES, np.float32)}


def loss_fn(params, x, y):
    logits = jax.nn.relu(x @ params["w"] + params["b"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_data_axes_naming_an_axis_the_batch_is_not_sharded_over_raises():
    # The batch is split over "data"; data_axes="model" would take the model shards (copies of the same rows'
    # computation) as gradient samples.
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch())
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="model"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"no argument is sharded over \('model',\).*data_axes="):
        fn(init_params(), x, y)


@pytest.mark.parametrize("params", [{}, {"w": None}], ids=["empty", "only None"])
@pytest.mark.parametrize("data_axes", ["data", None], ids=["global batch", "per replica"])
def test_params_with_nothing_to_differentiate_are_refused_naming_the_fix(params, data_axes):
    # 0.3 raised JAX's "in_specs passed to shard_map ..." on the global batch.
    mesh = jax.make_mesh((8,), ("data",))
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch())
    fn = jax.jit(optax_adascale.value_and_grad(lambda p, x, y: loss_fn(init_params(), x, y), data_axes=data_axes))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"^value_and_grad got params with no array leaves"):
        fn(params, x, y)


def test_a_one_device_data_axis_warns_that_adascale_is_the_identity():
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch())
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data"))
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match=r"single device.*n = 1.*num_microbatches"):
        value, grads, stats = fn(init_params(), x, y)
    ref_value, ref_grads = jax.value_and_grad(loss_fn)(init_params(), *batch())
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert stats.num_microbatches == 1
    with jax.set_mesh(mesh), warnings.catch_warnings():  # k = 2 gives two samples: no warning
        warnings.simplefilter("error")
        value, grads, stats = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=2))(
            init_params(), x, y
        )
    halves = [jax.grad(loss_fn)(init_params(), *(a[h * 32 : (h + 1) * 32] for a in batch())) for h in (0, 1)]
    np.testing.assert_allclose(grads["w"], (halves[0]["w"] + halves[1]["w"]) / 2, rtol=1e-5, atol=1e-7)
    expected = np.mean([np.sum(np.square(h["w"])) for h in halves])  # each half's gradient is a sample
    assert stats.num_microbatches == 2 and float(stats.sq_norms["w"]) == pytest.approx(expected, rel=1e-5)


def test_optax_multisteps_around_adascale_is_refused_with_the_fix():
    tx = optax.MultiSteps(optax_adascale.adascale_sgd(0.1, momentum=0.9), every_k_schedule=4)
    state = tx.init(init_params())
    for reader in (optax_adascale.metrics, optax_adascale.scale_invariant_steps, optax_adascale.get_adascale_state):
        with pytest.raises(ValueError, match=r"optax.MultiSteps around AdaScale.*num_microbatches=k"):
            reader(state)
    with pytest.raises(ValueError, match=r"optax.MultiSteps around AdaScale"):
        optax_adascale.done(state, 100)
    # AdaScale around an optimizer that is not MultiSteps, inside a chain, is still read
    chained = optax.chain(optax.clip_by_global_norm(1.0), optax_adascale.adascale_sgd(0.1)).init(init_params())
    assert float(optax_adascale.metrics(chained)["scale_invariant_steps"]) == 0.0


@pytest.mark.parametrize("clip", [optax.clip_by_global_norm(1e-3), optax.scale(1e-2)])
def test_grads_changed_between_the_drop_in_and_update_leave_the_gain_as_unchanged(clip):
    """MaxText clips grads in train_step, loss scaling rescales them: AdaScale reads ‖ḡ‖² from stats (the true
    mean gradient, computed in the drop-in's program), so at every step of a clipped run the gain and the
    estimator's state equal those of the same update given the unchanged grads."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9)
    clip_state = clip.init(init_params())

    @jax.jit
    def step(params, opt_state, x, y):
        _, grads, stats = grad_fn(params, x, y)
        clipped, _ = clip.update(grads, clip_state)
        updates, new_state = tx.update(clipped, opt_state, params, microbatch_stats=stats)
        _, unclipped_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
        return optax.apply_updates(params, updates), new_state, unclipped_state, optax.tree.norm(clipped)

    with jax.set_mesh(mesh):
        params, opt_state = init_params(), tx.init(init_params())
        for seed in range(4):
            x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch(seed))
            params, opt_state, unclipped_state, norm = step(params, opt_state, x, y)
            ours, ref = (optax_adascale.get_adascale_state(s) for s in (opt_state, unclipped_state))
            for field in ("gain", "grad_var", "grad_sqr", "tau_frac"):
                np.testing.assert_allclose(float(getattr(ours, field)), float(getattr(ref, field)), rtol=1e-6)
            assert float(norm) < 0.1  # the clip (or scale) was active


@pytest.mark.parametrize(
    "accumulation", [2, optax_adascale.BatchRamp(1, 4, patience=1)], ids=["accumulation_steps=2", "BatchRamp(1, 4)"]
)
def test_clipping_before_an_accumulating_update_is_refused_and_inside_inner_trains(accumulation):
    """Issue 40 item 1. With accumulation AdaScale takes b from the mean of the gradients it is given, so the
    statistics' ‖ḡ‖² cannot cover a clip before update: on main the gain stuck at S, grad_sqr at 0 and τ ran
    ahead. The changed gradients are refused: every window is skipped (parameters and τ untouched), counted in
    skipped_altered_grads_steps, and done() raises naming the fix; the same clip inside inner trains."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")
    clip = optax.clip_by_global_norm(1e-3)
    before = optax.chain(clip, optax_adascale.adascale_sgd(0.1, accumulation_steps=accumulation))
    inside = optax_adascale.adascale(optax.chain(clip, optax.identity()), 0.1, accumulation_steps=accumulation)

    def run(tx, calls=8):
        @jax.jit
        def step(params, opt_state, x, y):
            _, grads, stats = grad_fn(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), opt_state

        with jax.set_mesh(mesh):
            params, opt_state = init_params(), tx.init(init_params())
            for seed in range(calls):
                x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch(seed))
                params, opt_state = step(params, opt_state, x, y)
        return params, optax_adascale.metrics(opt_state), opt_state

    params, m, state = run(before)
    updates = 4 if accumulation == 2 else 8  # the ramp's k stays at its lowest rung, 1: nothing is ever applied
    jax.tree.map(np.testing.assert_array_equal, params, init_params())
    assert float(m["scale_invariant_steps"]) == 0.0 and int(m["skipped_steps"]) == updates
    assert int(m["skipped_altered_grads_steps"]) == updates and int(m["skipped_nonfinite_steps"]) == 0
    with pytest.raises(RuntimeError, match=r"clip_by_global_norm.*Clip inside AdaScale.*optax.chain\(optax.clip"):
        optax_adascale.done(state, 100)

    params, m, state = run(inside)
    assert int(m["skipped_steps"]) == 0 and float(m["scale_invariant_steps"]) > 0
    assert not optax_adascale.done(state, 1e6)
    assert not jax.tree.all(jax.tree.map(np.array_equal, params, init_params()))


@pytest.mark.parametrize("placement", ["Auto, placed", "Auto, numpy", "Explicit"])
def test_a_batch_that_does_not_split_names_the_batch_and_the_sizes(placement):
    """Issue 40 item 7: 36 rows on 4 data shards × 2 micro-batches. On an Auto mesh the error said no argument is
    sharded over data and asked to name the axes; it names the batch's arguments and the sizes now."""
    kind = jax.sharding.AxisType.Explicit if placement == "Explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,), devices=jax.devices()[:4])
    x, y = batch()
    x, y = x[:36], y[:36]
    if placement != "Auto, numpy":
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    fn = jax.jit(optax_adascale.value_and_grad(loss_fn, data_axes="data", num_microbatches=2))
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"x has 36 rows, y has 36 rows.*4 × 2 = 8 .*multiple of 8"),
    ):
        fn(init_params(), x, y)


# --------------------------------------------------------------------------- a silent S = 1

AUTO = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
EXPLICIT = jax.make_mesh((8,), ("data",))


def _sharded_batch(mesh):
    return tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in batch())


def _forgetful_step(tx):
    """A jit step over the global batch that forgot ``microbatch_stats=stats``."""

    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        return tx.update(grads, opt_state, params)

    return jax.jit(step)


@pytest.mark.parametrize(
    "mesh, set_mesh",
    [(AUTO, True), (EXPLICIT, True), (AUTO, False)],
    ids=["Auto mesh set", "Explicit mesh set", "arrays placed on a mesh, none set"],
)
def test_a_global_batch_step_without_microbatch_stats_warns_that_adascale_is_the_identity(mesh, set_mesh):
    tx = optax_adascale.adascale_sgd(0.1)
    context = jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext()
    with context, pytest.warns(UserWarning, match=r"no microbatch_stats.*8 devices.*identity.*microbatch_stats=stats"):
        _forgetful_step(tx)(init_params(), tx.init(init_params()), *_sharded_batch(mesh))


def _no_warning(run):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()


def test_a_single_device_step_does_not_warn():
    tx = optax_adascale.adascale_sgd(0.1)
    _no_warning(lambda: _forgetful_step(tx)(init_params(), tx.init(init_params()), *batch()))


@pytest.mark.parametrize("factory", [optax_adascale.adascale_sgd, optax_adascale.adascale_adamw])
def test_the_identity_warning_names_the_inner_optimizer_not_plain_sgd(factory):
    """Issue 40 item 2: the warning said "plain SGD on lr(t)" for adascale_adamw too."""
    tx = factory(0.1)
    with jax.set_mesh(AUTO), pytest.warns(UserWarning, match=r"identity") as record:
        _forgetful_step(tx)(init_params(), tx.init(init_params()), *_sharded_batch(AUTO))
    assert all("plain SGD" not in str(w.message) for w in record)


@pytest.mark.parametrize("accumulation", [2, optax_adascale.BatchRamp(2, 8)], ids=["k=2", "BatchRamp(2, 8)"])
def test_a_global_batch_step_with_accumulation_and_no_microbatch_stats_warns_that_s_is_k(accumulation):
    """Issue 40 item 2: with accumulation each call's global-batch gradient is one sample, so the run trained at
    S = k (2) instead of one sample per data shard (8 × 2 = 16), with no word."""
    tx = optax_adascale.adascale_adamw(0.1, accumulation_steps=accumulation)
    with jax.set_mesh(AUTO), pytest.warns(UserWarning, match=r"no microbatch_stats.*8 devices.*n = S = k.*8 × k"):
        _forgetful_step(tx)(init_params(), tx.init(init_params()), *_sharded_batch(AUTO))


def test_a_ramp_from_one_microbatch_without_microbatch_stats_names_the_statistics_first():
    """Issue 40 item 2: BatchRamp(1, 8) without microbatch_stats in a jit step over 8 devices said "Set
    min_microbatches >= 2" first; following it trains at S = k. The missing statistics come first now."""
    tx = optax_adascale.adascale_adamw(0.1, accumulation_steps=optax_adascale.BatchRamp(1, 8))
    with (
        jax.set_mesh(AUTO),
        pytest.raises(ValueError, match=r"^update got no microbatch_stats.*8 devices.*microbatch_stats=stats"),
    ):
        _forgetful_step(tx)(init_params(), tx.init(init_params()), *_sharded_batch(AUTO))


@pytest.mark.parametrize("front_door", ["vmap", "pmap", "shard_map"])
def test_per_replica_steps_with_axis_name_do_not_warn_inside_a_mesh(front_door):
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    grads = jax.tree.map(lambda p: np.stack([p * (i + 1) for i in range(8)]), init_params())
    if front_door == "vmap":
        step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="data"))
    elif front_door == "pmap":
        step = jax.pmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="data")
    else:
        local = lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p)  # noqa: E731
        step = jax.jit(jax.shard_map(local, mesh=AUTO, in_specs=(P("data"), P(), P()), out_specs=(P(), P())))
    with jax.set_mesh(AUTO):
        _no_warning(lambda: step(grads, tx.init(init_params()), init_params()))


# --------------------------------------------------------------------------- the flagship's CNN


@pytest.mark.parametrize("mesh", [EXPLICIT, AUTO], ids=["Explicit", "Auto"])
def test_the_flagships_convolutional_model_runs_through_the_drop_in_exactly(mesh):
    # examples/train_mnist1d.py's Flax CNN: the convolutions' per-shard backward raised JAX's ShardingTypeError
    # ("This reshape is not supported") on both meshes; jax.value_and_grad's numbers are the truth.
    from benchmarks.leaves.leaves import flagship_cnn

    model = flagship_cnn(4)
    params = model.init(jax.random.key(0), np.zeros((1, 40), np.float32))["params"]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 40)).astype(np.float32), rng.integers(0, 10, 64).astype(np.int32)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

    with jax.set_mesh(mesh):
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
        value, grads, stats = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))(params, xs, ys)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, ref_grads)
    # The samples: each device's 8 rows' mean gradient.
    shard = [jax.grad(loss)(params, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]) for i in range(8)]
    expected = np.mean([float(optax.tree.norm(g, squared=True)) for g in shard])
    assert sum(float(v) for v in jax.tree.leaves(stats.sq_norms)) == pytest.approx(expected, rel=1e-4)
