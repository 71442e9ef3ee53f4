"""Errors and skips: a user's mistake raises naming the fix (or is counted and stops the loop); bad numbers never
corrupt the state.

* Bad arguments: a clear ValueError/TypeError naming the argument, the value and the fix.
* Mistakes that used to train with no message (an inner with its own learning rate, gradients averaged before
  ``update``, forgotten ``axis_name`` under shard_map, ...): each now raises, warns, or is counted.
* Odd trees (empty, scalar, None leaves, integer leaves, a frozen subtree, an inner that changes the tree).
* Non-finite steps: skipped identically on every replica (and for a whole accumulation window), losing nothing;
  training then goes on as if the step had never happened.
* Mixed precision: statistics square in float32, so large low-precision gradients neither overflow nor propagate.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits_equal, replica_grads, replica_update
from jax.sharding import PartitionSpec as P

import optax_adascale
from optax_adascale.core import _clock

N = 4
PARAMS = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]]), "b": jnp.array([0.5, -0.5])}
MESH = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))


def one_replica_grads(seed):
    """One replica's gradients: :func:`helpers.replica_grads` of ``PARAMS`` without the replica axis."""
    return jax.tree.map(lambda x: x[0], replica_grads(PARAMS, 1, seed))


def assert_skipped(before, after, updates, negative_lr=False):
    """The update is zero and the state is ``before`` but for one more skipped step (for the reason given)."""
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(after.skipped_steps) == int(before.skipped_steps) + 1
    assert int(after.negative_lr_steps) == int(before.negative_lr_steps) + int(negative_lr)
    counters = dict(skipped_steps=before.skipped_steps, skip_streak=before.skip_streak)
    assert bits_equal(after._replace(negative_lr_steps=before.negative_lr_steps, **counters), before)


# --------------------------------------------------------------------------- bad input


def _update(tx, grads=None, params=PARAMS):
    grads = PARAMS if grads is None else grads
    return tx.update(grads, tx.init(params), params)


def _summed_under_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] @ x[0]) + jnp.sum(p["b"]))(params)  # forgot pcast
        return tx.update(grads, state, params)

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("i")), out_specs=(P(), P()))
    return f(PARAMS, tx.init(PARAMS), jnp.ones((8, 2)))


BAD_INPUTS = {
    "accumulation_steps=0": (
        lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=0),
        ValueError,
        r"accumulation_steps=0",
    ),
    "accumulation_steps=2.0": (
        lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=2.0),
        TypeError,
        r"accumulation_steps=2\.0",
    ),
    "accumulation_steps=float array": (
        lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=jnp.array(2.0)),
        TypeError,
        r"accumulation_steps must be a static Python int",
    ),
    "learning_rate=an array of 100 values": (
        lambda: optax_adascale.adascale_sgd(jnp.linspace(0.1, 0.0, 100)),
        TypeError,
        r"^learning_rate must be a number or a schedule .*got an array of shape \(100,\) and dtype float32\. "
        r"To follow a table of values, pass a function of the step: [^\[\]]*\[jnp\.minimum\(t, len\(table\) - 1\)\]$",
    ),
    "scale=0.5": (lambda: optax_adascale.adascale_sgd(0.1, scale=0.5), ValueError, r"scale=0\.5"),
    "smoothing=1.0": (lambda: optax_adascale.adascale_sgd(0.1, smoothing=1.0), ValueError, r"smoothing=1\.0"),
    "smoothing=-0.1": (lambda: optax_adascale.adascale_sgd(0.1, smoothing=-0.1), ValueError, r"smoothing=-0\.1"),
    "eps=0": (lambda: optax_adascale.adascale_sgd(0.1, eps=0.0), ValueError, r"eps=0\.0"),
    "eps=-1": (lambda: optax_adascale.adascale_sgd(0.1, eps=-1.0), ValueError, r"eps=-1\.0"),
    "learning_rate=-0.1": (lambda: optax_adascale.adascale_sgd(-0.1), ValueError, r"learning_rate=-0\.1"),
    "learning_rate=nan": (lambda: optax_adascale.adascale_sgd(float("nan")), ValueError, r"learning_rate=nan"),
    "learning_rate=inf": (lambda: optax_adascale.adascale_sgd(float("inf")), ValueError, r"learning_rate=inf"),
    "averaging=typo": (
        lambda: optax_adascale.experimental.adascale(optax.identity(), 0.1, averaging="ema"),
        ValueError,
        r"averaging='ema'",
    ),
    "nesterov without momentum": (
        lambda: optax_adascale.adascale_sgd(0.1, nesterov=True),
        ValueError,
        r"momentum=None",
    ),
    "n=1 with S>1": (
        lambda: _update(optax_adascale.adascale_sgd(0.1, scale=4.0)),
        ValueError,
        r"n=1 sample.*scale=4\.0.*axis_name",
    ),
    "axis not bound": (
        lambda: _update(optax_adascale.adascale_sgd(0.1, axis_name="data")),
        ValueError,
        r"axis_name='data'.*not bound",
    ),
    "summed grads under shard_map": (
        _summed_under_shard_map,
        ValueError,
        r"summed.*pcast\(params, 'i', to='varying'\)",
    ),
    "grads tree differs from params": (
        lambda: _update(optax_adascale.adascale_sgd(0.1, accumulation_steps=2), grads={"w": PARAMS["w"]}),
        ValueError,
        r"same tree structure",
    ),
    "integer grads": (
        lambda: _update(
            optax_adascale.adascale_sgd(0.1, accumulation_steps=2),
            grads={"w": jnp.ones((2, 2), jnp.int32), "b": PARAMS["b"]},
        ),
        TypeError,
        r"floating-point grads, got dtype int32 at grads\['w'\]",
    ),
    "microbatch_stats of the wrong type": (
        lambda: optax_adascale.adascale_sgd(0.1, accumulation_steps=2).update(
            PARAMS,
            optax_adascale.adascale_sgd(0.1, accumulation_steps=2).init(PARAMS),
            PARAMS,
            microbatch_stats={"w": 1.0},
        ),
        TypeError,
        r"microbatch_stats must be a MicrobatchStats",
    ),
    "num_microbatches=0": (
        lambda: optax_adascale.value_and_grad(jnp.sum, num_microbatches=0),
        ValueError,
        r"num_microbatches=0",
    ),
}


@pytest.mark.parametrize("make, error, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_a_clear_error(make, error, message):
    with pytest.raises(error, match=message):
        make()


# --------------------------------------------------------------------------- inner with its own learning rate


@pytest.mark.parametrize(
    "inner",
    [optax.sgd(0.1), optax.sgd(0.01, momentum=0.9), optax.adamw(1e-3), optax.adamw(1.0), optax.adam(3e-4)],
    ids=["sgd", "sgd-momentum", "adamw", "adamw-lr1", "adam"],
)
@pytest.mark.parametrize("traced_init", [False, True], ids=["eager", "jit"])
def test_inner_with_its_own_learning_rate_is_rejected_at_init(inner, traced_init):
    tx = optax_adascale.adascale(inner, 0.1, axis_name="data")
    init = jax.jit(tx.init) if traced_init else tx.init
    with pytest.raises(ValueError, match=r"against the gradient.*optax\.trace\(0\.9\)"):
        init(PARAMS)


@pytest.mark.parametrize(
    "inner",
    [
        optax.trace(0.9),
        optax.identity(),
        optax.scale_by_adam(),
        optax.chain(optax.clip_by_global_norm(1.0), optax.trace(0.9, nesterov=True)),
        optax.chain(optax.add_decayed_weights(1e-4), optax.trace(0.9)),
        optax.multi_transform({"a": optax.trace(0.9), "b": optax.identity()}, {"w": "a", "b": "b"}),
    ],
    ids=["trace", "identity", "scale_by_adam", "clip-nesterov", "decay-trace", "multi_transform"],
)
def test_learning_rate_free_inners_are_accepted(inner):
    tx = optax_adascale.adascale(inner, 0.1)
    updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
    # The step points against the gradient (every gradient entry here is >= -0.5 and the sum positive).
    assert float(sum(jnp.vdot(u, g) for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(PARAMS)))) < 0


# --------------------------------------------------------------------------- gradients averaged before update


@pytest.mark.parametrize("path", ["vmap", "pmap"])
def test_gradients_averaged_before_update_are_counted_as_floored_steps(path):
    n, steps = 4, 3
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="data")

    def averaged_first(g, s, p):  # the mistake: pmean before AdaScale sees the per-replica gradients
        return tx.update(jax.lax.pmean(g, "data"), s, p)

    if path == "vmap":
        wrong = jax.jit(jax.vmap(averaged_first, in_axes=(0, None, None), out_axes=(None, None), axis_name="data"))
        right = replica_update(tx, axis_name="data", axis_size=n)
    else:
        wrong = jax.pmap(
            averaged_first, axis_name="data", in_axes=(0, None, None), out_axes=(None, None), devices=jax.devices()[:n]
        )
        right = jax.pmap(
            tx.update, axis_name="data", in_axes=(0, None, None), out_axes=(None, None), devices=jax.devices()[:n]
        )
    s_wrong = s_right = tx.init(PARAMS)
    for seed in range(steps):
        _, s_wrong = wrong(replica_grads(PARAMS, n, seed), s_wrong, PARAMS)
        _, s_right = right(replica_grads(PARAMS, n, seed), s_right, PARAMS)
    m_wrong, m_right = optax_adascale.metrics(s_wrong), optax_adascale.metrics(s_right)
    assert int(m_wrong["floored_steps"]) == steps  # every update: identical replicas
    assert float(m_wrong["gain"]) == pytest.approx(1.0, abs=1e-5)
    assert int(m_right["floored_steps"]) == 0
    assert float(m_right["gain"]) > 1.05


def test_done_warns_after_a_run_of_updates_whose_replicas_agreed_exactly():
    # The pmean-before-update signature is only in the state (floored_steps); done() reads it on the host.
    n = 4
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    wrong = jax.jit(
        jax.vmap(
            lambda g, s, p: tx.update(jax.lax.pmean(g, "data"), s, p),
            in_axes=(0, None, None),
            out_axes=(None, None),
            axis_name="data",
        )
    )
    right = replica_update(tx, axis_name="data", axis_size=n)
    s_wrong = s_right = tx.init(PARAMS)
    for seed in range(optax_adascale._state.FLOORED_RUN):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not before FLOORED_RUN updates
            assert not optax_adascale.done(s_wrong, 1000)
        _, s_wrong = wrong(replica_grads(PARAMS, n, seed), s_wrong, PARAMS)
        _, s_right = right(replica_grads(PARAMS, n, seed), s_right, PARAMS)
    with pytest.warns(UserWarning, match=r"replicas agreed exactly.*gain stays at 1.*averaged before update"):
        optax_adascale.done(s_wrong, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not optax_adascale.done(s_right, 1000)


# --------------------------------------------------------------------------- every step non-finite


def test_done_raises_when_every_update_is_skipped_instead_of_looping_forever():
    tx = optax_adascale.adascale_sgd(lambda t: jnp.float32(jnp.nan), momentum=0.9, axis_name="data")
    step, state = replica_update(tx, axis_name="data", axis_size=4), tx.init(PARAMS)
    calls = 0
    with pytest.raises(RuntimeError, match=r"stuck.*last 5 updates were all skipped"):
        while not optax_adascale.done(state, total_steps=100, max_skip_streak=5):
            _, state = step(replica_grads(PARAMS, 4, calls), state, PARAMS)
            calls += 1
    assert calls == 5
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == 5


def poisson_run(lr, scale=8, budget=100):
    """AdaScale-SGD (momentum 0.9) at S = ``scale`` on a Poisson regression, ``lr`` constant, fresh rows each
    update, until ``done``; returns ``(updates called, state)``. The loss's ``exp`` overflows once a step
    overshoots, after which every gradient is non-finite and every update is skipped."""
    rng = np.random.default_rng(0)
    loss = lambda w, x, y: jnp.mean(jnp.exp(x @ w) - y * (x @ w))  # noqa: E731
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
    tx = optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data")
    step = replica_update(tx, axis_name="data", axis_size=scale)
    w, state, calls = jnp.zeros(4), tx.init(jnp.zeros(4)), 0
    while not optax_adascale.done(state, budget):
        x = rng.normal(size=(scale, 16, 4)).astype(np.float32)
        y = rng.poisson(np.exp(x @ np.array([0.5, -0.5, 0.3, 0.0], np.float32))).astype(np.float32)
        updates, state = step(grads(w, x, y), state, w)
        w, calls = optax.apply_updates(w, updates), calls + 1
    return calls, state


def test_done_says_the_schedule_is_written_for_the_base_batch_within_the_first_updates():
    # The base batch's lr trains to T; the same lr written for the batch of S = 8 (8x) overflows after a few
    # applied updates, and every later update is skipped. On main done() raised after 100 skips with "lower the
    # learning rate"; now it raises once the skips outnumber the applied updates, naming the base batch and S.
    calls, state = poisson_run(0.05)
    assert float(optax_adascale.scale_invariant_steps(state)) >= 100
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == 0
    with pytest.raises(RuntimeError, match=r"stuck.*written for the base batch.*divide it by S.*ran at S = 8") as err:
        poisson_run(0.05 * 8)
    message = str(err.value)
    applied, skipped = (int(re.search(p, message).group(1)) for p in (r"after only (\d+)", r"skipped_steps=(\d+)"))
    assert 1 <= applied < 20 and skipped == max(applied, optax_adascale._state.EARLY_SKIP_STREAK)  # not 100


def test_done_tolerates_a_short_skip_streak_at_the_start():
    # Fewer than EARLY_SKIP_STREAK skips at the very start (a dynamic loss scale settling) do not raise.
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    step, state = replica_update(tx, axis_name="data", axis_size=4), tx.init(PARAMS)
    for i in range(12):
        grads = replica_grads(PARAMS, 4, i)
        if i < optax_adascale._state.EARLY_SKIP_STREAK - 1:
            grads["w"] = grads["w"].at[0, 0, 0].set(jnp.inf)
        assert not optax_adascale.done(state, 1000)
        _, state = step(grads, state, PARAMS)
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == optax_adascale._state.EARLY_SKIP_STREAK - 1


def test_done_is_true_once_tau_reaches_the_budget_and_a_skip_does_not_reset_the_clock():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    step, state = replica_update(tx, axis_name="data", axis_size=4), tx.init(PARAMS)
    updates = 0
    while not optax_adascale.done(state, total_steps=12, max_skip_streak=3):
        grads = replica_grads(PARAMS, 4, updates)
        if updates == 2:  # one non-finite gradient: this update is skipped, the next ones are not
            grads["w"] = grads["w"].at[1, 0, 0].set(jnp.nan)
        _, state = step(grads, state, PARAMS)
        updates += 1
    tau = float(optax_adascale.scale_invariant_steps(state))
    assert 12 <= tau < 12 + 4  # stopped at the budget, overshooting by less than one gain (S = 4)
    s = optax_adascale.get_adascale_state(state)
    assert int(s.skip_streak) == 0 and int(s.skipped_steps) == 1
    assert updates == int(s.count) + int(s.skipped_steps)


# --------------------------------------------------------------------------- shard_map mistakes


def local_grads(params, x):
    """This replica's gradient under shard_map: params marked varying over the data axis first."""
    return jax.grad(lambda p: jnp.sum(p["w"] @ x[0]) + jnp.sum(p["b"] * x[0]))(
        jax.lax.pcast(params, "data", to="varying")
    )


def _shard_map(fn, n_in, check_vma=True):
    return jax.jit(
        jax.shard_map(
            fn, mesh=MESH, in_specs=(P(),) * (n_in - 1) + (P("data"),), out_specs=(P(), P()), check_vma=check_vma
        )
    )


def test_axis_name_none_with_per_replica_gradients_under_shard_map_names_the_axis():
    tx = optax_adascale.adascale_sgd(0.1)  # forgot axis_name="data"

    def step(params, state, x):
        grads = local_grads(params, x)
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"varies over the shard_map axes \[.data.\].*axis_name=.data."):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


def test_a_per_device_ensemble_without_axis_name_is_legitimate():
    # Parameters that vary over the axis too: each device trains its own member, no error.
    tx = optax_adascale.adascale_sgd(0.1)
    loss = lambda p, x: jnp.sum(p["w"] @ x) + jnp.sum(p["b"] * x)  # noqa: E731

    def member_step(stacked, state, x):
        params = jax.tree.map(lambda a: a[0], stacked)
        updates, _ = tx.update(jax.grad(loss)(params, x[0]), state, params)
        return jax.tree.map(lambda a: a[None], optax.apply_updates(params, updates))

    ensemble = jax.tree.map(lambda x: jnp.stack([x * (i + 1) for i in range(4)]), PARAMS)
    x = jnp.arange(8.0).reshape(4, 2)
    f = jax.jit(jax.shard_map(member_step, mesh=MESH, in_specs=(P("data"), P(), P("data")), out_specs=P("data")))
    out = f(ensemble, tx.init(PARAMS), x)
    for i in range(4):
        member = jax.tree.map(lambda a, i=i: a[i], ensemble)
        expected = optax.apply_updates(member, jax.tree.map(lambda g: -0.1 * g, jax.grad(loss)(member, x[i])))
        jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, rtol=1e-6), out, expected)


@pytest.mark.parametrize("reduction", ["psum", "pmean"])
def test_gradients_reduced_after_pcast_name_the_reduction_as_the_cause(reduction):
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")

    def step(params, state, x):
        grads = local_grads(params, x)
        grads = getattr(jax.lax, reduction)(grads, "data")
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"does not vary.*psum/pmean.*MultiSteps"):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


def test_accumulation_under_shard_map_without_replicate_buffers_names_the_fix():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data", accumulation_steps=2)

    def step(params, state, x):
        grads = local_grads(params, x)
        return tx.update(grads, state, params)

    with pytest.raises(ValueError, match=r"replicate_buffers.*state_partition_specs"):
        _shard_map(step, 3)(PARAMS, tx.init(PARAMS), jnp.ones((4, 2)))


@pytest.mark.parametrize("accumulation", [2, optax_adascale.BatchRamp(2, 4)], ids=["k=2", "BatchRamp(2, 4)"])
def test_accumulation_under_vmap_without_replicate_buffers_names_the_fix(accumulation):
    """Issue 40 item 5: under vmap the state's buffers with in_axes=None gave JAX's "vmap has mapped output
    (axis_name=i) but out_axes is None"; now our error, naming replicate_buffers and state_axes. With them it runs."""
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=accumulation)
    grads = jnp.stack([jnp.full((2,), i + 1.0) for i in range(4)])
    shared = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    with pytest.raises(ValueError, match=r"^accumulation_steps > 1.*jax.vmap.*replicate_buffers.*state_axes"):
        jax.jit(shared)(grads, tx.init(jnp.zeros(2)), jnp.zeros(2))
    state = optax_adascale.replicate_buffers(tx.init(jnp.zeros(2)), 4)
    axes = optax_adascale.state_axes(state)
    own = jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    _, state = jax.jit(own)(grads, state, jnp.zeros(2))
    np.testing.assert_array_equal(optax_adascale.get_adascale_state(state).acc_grads, grads)  # each its own


# --------------------------------------------------------------------------- one device meant to scale


def test_a_single_replica_axis_warns_that_adascale_is_the_identity():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="data")
    with pytest.warns(UserWarning, match=r"single replica.*identity.*value_and_grad"):
        replica_update(tx, axis_name="data", axis_size=1)(replica_grads(PARAMS, 1), tx.init(PARAMS), PARAMS)


# --------------------------------------------------------------------------- odd trees


def _first_update(tx, params):
    return tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)


EMPTY_TREES = {
    "empty": lambda tx: _first_update(tx, {}),
    "only None": lambda tx: _first_update(tx, {"w": None}),
    "all frozen by multi_transform": lambda tx: _first_update(
        optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, {"w": "frozen", "b": "frozen"}), PARAMS
    ),
}


@pytest.mark.parametrize("update", EMPTY_TREES.values(), ids=EMPTY_TREES.keys())
def test_a_param_tree_with_nothing_to_train_is_refused_at_the_first_update_naming_the_fix(update):
    # It used to train on nothing: with no gradient σ̂² = eps and μ̂² = 0, so the gain was S and τ advanced by S
    # per update while no parameter moved. (init accepts it: optax.tree_map_params initialises with a tree of
    # no leaves.)
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"AdaScale got grads with no array leaves.*leave AdaScale out"):
        update(tx)


def test_scalar_params_with_per_replica_accumulation():
    params = {"scalar": jnp.float32(1.0), "vector": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i", accumulation_steps=2)
    state = optax_adascale.replicate_buffers(tx.init(params), N)
    axes = optax_adascale.state_axes(state)
    step = jax.jit(
        jax.vmap(lambda g, s, p: tx.update(g, s, p), in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    )
    for seed in range(2):
        updates, state = step(replica_grads(params, N, seed), state, params)
    assert updates["scalar"].shape == () and float(updates["scalar"]) != 0.0
    assert 1.0 <= float(optax_adascale.metrics(state)["gain"]) <= 2 * N


def test_mixed_dtypes_in_one_tree_keep_their_dtypes():
    params = {"bf16": jnp.ones(3, jnp.bfloat16), "f16": jnp.ones(2, jnp.float16), "f32": jnp.ones(4)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    updates, state = replica_update(tx)(replica_grads(params), tx.init(params), params)
    assert {k: v.dtype for k, v in updates.items()} == {k: v.dtype for k, v in params.items()}
    assert optax_adascale.metrics(state)["gain"].dtype == jnp.float32


def test_none_leaves_are_ignored():
    params = {"w": jnp.ones(3), "unused": None}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    grads = {"w": replica_grads(params["w"]), "unused": None}
    updates, _ = replica_update(tx)(grads, tx.init(params), params)
    assert updates["unused"] is None and updates["w"].shape == (3,)


def test_frozen_subtree_via_multi_transform():
    params = {"train": {"w": jnp.ones(3)}, "frozen": {"w": jnp.ones(2)}}
    labels = {"train": {"w": "train"}, "frozen": {"w": "frozen"}}
    tx = optax.multi_transform(
        {"train": optax_adascale.adascale_sgd(0.1, axis_name="i"), "frozen": optax.set_to_zero()}, labels
    )
    grads = replica_grads(params)
    updates, state = replica_update(tx)(grads, tx.init(params), params)
    assert bool(jnp.all(updates["frozen"]["w"] == 0))
    # The trainable part is exactly AdaScale on the trainable subtree alone.
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    ref, ref_state = replica_update(alone)(grads["train"], alone.init(params["train"]), params["train"])
    np.testing.assert_array_equal(updates["train"]["w"], ref["w"])
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]


def test_integer_params_are_rejected_with_the_fix_named_and_the_fix_works():
    params = {"w": jnp.ones(3), "step": jnp.int32(0)}
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2), allow_int=True)(params)  # float0 for the int leaf
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    with pytest.raises(TypeError, match=r"params\['step'\].*set_to_zero"):
        tx.init(params)
    with pytest.raises(TypeError, match=r"grads\['step'\].*set_to_zero"):
        tx.update(grads, tx.init({"w": params["w"], "step": jnp.float32(0)}), params)
    fixed = optax.multi_transform(
        {"float": optax_adascale.adascale_sgd(0.1, accumulation_steps=2), "int": optax.set_to_zero()},
        {"w": "float", "step": "int"},
    )
    grads = {"w": grads["w"], "step": jnp.int32(0)}
    updates, _ = fixed.update(grads, fixed.init(params), params)
    assert updates["step"] == 0


def test_inner_that_changes_the_tree_structure_is_rejected():
    def bad_update(updates, state, params=None):
        return {"flat": jnp.concatenate([u.ravel() for u in jax.tree.leaves(updates)])}, state

    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), bad_update)
    tx = optax_adascale.adascale(inner, 0.1, accumulation_steps=1)
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    with pytest.raises(ValueError, match="inner must return updates with the structure of the gradients"):
        tx.update(params, tx.init(params), params)


# --------------------------------------------------------------------------- non-finite steps


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_in_one_replica_skips_the_step_on_every_replica(bad):
    n = 4
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")

    def step(grads, state):
        return tx.update(grads, state, PARAMS)

    # pmap with out_axes=0 returns every replica's own updates and state.
    step = jax.pmap(step, axis_name="i", in_axes=(0, None), devices=jax.devices()[:n])
    state = tx.init(PARAMS)
    _, state = step(replica_grads(PARAMS, n, 0), state)
    state = jax.tree.map(lambda x: x[0], state)
    poisoned = replica_grads(PARAMS, n, 1)
    poisoned["w"] = poisoned["w"].at[2, 0, 1].set(bad)

    updates, new_states = step(poisoned, state)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    for r in range(n):
        s = jax.tree.map(lambda x, r=r: x[r], new_states)
        assert int(s.skipped_steps) == 1
        assert bits_equal(s._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak), state)

    # Training then continues exactly as if the poisoned step had never happened.
    clean_updates, clean_state = step(replica_grads(PARAMS, n, 2), state)
    updates, after = step(replica_grads(PARAMS, n, 2), jax.tree.map(lambda x: x[0], new_states))
    assert bits_equal(updates, clean_updates)
    counters = dict(skipped_steps=clean_state.skipped_steps, skip_streak=clean_state.skip_streak)
    assert bits_equal(after._replace(**counters), clean_state)


def _adam(state):
    """The ``ScaleByAdamState`` (count, μ, ν) inside an AdaScale state's inner state: optax's, or the τ clock's
    (``core._clock.ScaleByAdamState``, which also counts the base steps its averages have seen)."""
    kinds = (optax.ScaleByAdamState, _clock.ScaleByAdamState)
    is_adam = lambda x: isinstance(x, kinds)  # noqa: E731
    return next(x for x in jax.tree.leaves(state.inner_state, is_leaf=is_adam) if is_adam(x))


ADAMW = {  # the alias's inner selects where it writes (core/_keeps_state.py); optax's own runs in a lax.cond
    "adascale_adamw": lambda b1, b2: optax_adascale.adascale_adamw(1e-2, b1=b1, b2=b2, axis_name="i"),
    "optax-chain": lambda b1, b2: optax_adascale.adascale(
        optax.chain(optax.scale_by_adam(b1, b2), optax.add_decayed_weights(1e-4)), 1e-2, axis_name="i"
    ),
}


@pytest.mark.parametrize("inner", sorted(ADAMW))
@pytest.mark.parametrize("transform", ["vmap", "shard_map"])
def test_adamw_keeps_adams_state_on_a_skip_and_updates_it_on_a_taken_step(transform, inner):
    """Adam's count, μ and ν are kept bit for bit on a skipped step, updated as Adam updates them on a taken one,
    and the step after a skip is the step the skip never happened before: for the alias's inner (which selects
    where it writes) and for optax's own Adam (run in a ``lax.cond``, ``core/_inner.py``)."""
    n, b1, b2 = 4, 0.9, 0.999
    tx = ADAMW[inner](b1, b2)
    if transform == "vmap":
        step = replica_update(tx)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("i",))

        def local(grads, state, params):
            updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
            return jax.tree.map(lambda u: jax.lax.pcast(u, "i", to="varying")[None], updates), state

        sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("i"), P(), P()), out_specs=(P("i"), P())))

        def step(grads, state, params):
            updates, state = sharded(grads, state, params)
            return jax.tree.map(lambda u: u[0], updates), state

    state = tx.init(PARAMS)
    _, state = step(replica_grads(PARAMS, n, 0), state, PARAMS)
    grads = replica_grads(PARAMS, n, 1)
    taken_updates, taken = step(grads, state, PARAMS)
    before, after = _adam(state), _adam(taken)
    assert int(after.count) == int(before.count) + 1 and int(taken.skipped_steps) == 0
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    # The alias's Adam runs on the τ clock: an update of gain r averages with β^r (core/_clock.py); optax's per update.
    r = float(optax_adascale.metrics(taken)["gain"]) if inner == "adascale_adamw" else 1.0
    c1, c2 = b1**r, b2**r
    if inner == "adascale_adamw":  # τ advances by the applied gain, and so does the count Adam debiases with
        np.testing.assert_allclose(after.base_steps, before.base_steps + r, rtol=1e-6)
    for name in PARAMS:
        np.testing.assert_allclose(after.mu[name], c1 * before.mu[name] + (1 - c1) * mean[name], rtol=3e-5)
        np.testing.assert_allclose(after.nu[name], c2 * before.nu[name] + (1 - c2) * mean[name] ** 2, rtol=3e-5)
    assert all(bool(jnp.all(u != 0)) for u in jax.tree.leaves(taken_updates))

    poisoned = replica_grads(PARAMS, n, 1)
    poisoned["w"] = poisoned["w"].at[1, 0, 1].set(np.nan)
    updates, skipped = step(poisoned, state, PARAMS)
    assert_skipped(state, skipped, updates)  # the whole state, Adam's count, μ and ν included, bit for bit
    assert bits_equal(_adam(skipped), before)

    # The step after the skip is the step from the state the skip kept.
    updates, after_skip = step(grads, skipped, PARAMS)
    assert bits_equal(updates, taken_updates)
    counters = dict(skipped_steps=taken.skipped_steps, skip_streak=taken.skip_streak)
    assert bits_equal(after_skip._replace(**counters), taken)


def test_non_finite_gradient_under_shard_map_gives_replicated_zero_updates():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")

    def step(state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, PARAMS)
        return jax.tree.map(lambda u: jax.lax.pcast(u, "i", to="varying")[None], updates), state

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("i")), out_specs=(P("i"), P())))
    grads = replica_grads(PARAMS, 8, 0)
    grads["b"] = grads["b"].at[5, 0].set(np.nan)
    state = tx.init(PARAMS)
    per_replica_updates, new_state = f(state, grads)
    assert all(u.shape[0] == 8 and bool(jnp.all(u == 0)) for u in jax.tree.leaves(per_replica_updates))
    assert bits_equal(new_state._replace(skipped_steps=state.skipped_steps, skip_streak=state.skip_streak), state)
    assert int(new_state.skipped_steps) == 1


def test_non_finite_call_drops_the_whole_accumulation_window():
    k = 3
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=k)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for seed in range(k):  # one good update first, so the state is not trivial
        _, state = update(one_replica_grads(seed), state, PARAMS)
    start = state

    poisoned = one_replica_grads(10)
    poisoned["b"] = poisoned["b"].at[1].set(np.nan)
    for g in (one_replica_grads(11), poisoned, one_replica_grads(12)):
        updates, state = update(g, state, PARAMS)
        assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert int(state.skipped_steps) == 1 and int(state.micro_step) == 0
    assert bits_equal(state.acc_grads, jax.tree.map(jnp.zeros_like, start.acc_grads))
    assert bits_equal(state._replace(skipped_steps=start.skipped_steps, skip_streak=start.skip_streak), start)

    # The next window trains normally.
    for seed in range(20, 20 + k):
        updates, state = update(one_replica_grads(seed), state, PARAMS)
    assert int(state.count) == 2 and optax.tree.norm(updates) > 0


# --------------------------------------------------------------------------- counted skips


@pytest.mark.parametrize("bad_value", [float("nan"), -0.5])
def test_schedule_returning_nan_or_negative_skips_and_counts(bad_value):
    # Decision: the effective learning rate must be finite and >= 0, else the update is skipped.
    # τ then stays put, so every later step skips too: `skipped_steps` growing is the signal.
    schedule = lambda count: jnp.where(count >= 3, bad_value, 0.1)
    tx = optax_adascale.adascale_sgd(schedule, axis_name="i", scale=1.0)
    params = {"w": jnp.ones(3)}
    update = replica_update(tx)
    state = tx.init(params)
    for seed in range(3):
        _, state = update(replica_grads(params, N, seed), state, params)
    assert int(state.tau_whole) == 3 and int(state.skipped_steps) == 0
    for seed in range(3, 5):
        before = state
        updates, state = update(replica_grads(params, N, seed), state, params)
        assert_skipped(before, state, updates, negative_lr=bad_value < 0)
    assert int(state.skipped_steps) == 2
    m = optax_adascale.metrics(state)
    reason = "skipped_negative_lr_steps" if bad_value < 0 else "skipped_nonfinite_steps"
    other = "skipped_nonfinite_steps" if bad_value < 0 else "skipped_negative_lr_steps"
    assert int(m[reason]) == 2 and int(m[other]) == 0


def test_a_rounding_level_negative_learning_rate_is_zero_not_a_skip():
    # optax.linear_schedule(lr, 0, n) under jit computes 1 - n·(1/n) < 0 for some n: a learning rate of
    # about -1e-7·lr past n. That is zero: the update is taken (with no step) and τ keeps advancing.
    peak = 0.1
    schedule = lambda count: jnp.where(count >= 3, -1e-8, peak)  # noqa: E731 - rounding-sized, below 0
    tx = optax_adascale.adascale_sgd(schedule, axis_name="i", scale=1.0)
    params = {"w": jnp.ones(3)}
    update = replica_update(tx)
    state = tx.init(params)
    for seed in range(6):
        updates, state = update(replica_grads(params, N, seed), state, params)
    assert int(state.tau_whole) == 6 and int(state.skipped_steps) == 0
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    assert float(optax_adascale.metrics(state)["base_learning_rate"]) == 0.0


def test_a_linear_schedule_that_ends_before_the_run_lets_done_finish():
    # optax.linear_schedule(0.05, 0.0, n) under jit returns -(rounding) past its end for some n, which n depends
    # on the JAX version (none below 400 on JAX 0.11.2): the same schedule with its rounding written out
    n = 50
    linear = optax.linear_schedule(0.05, 0.0, n)
    schedule = lambda count: jnp.where(count < n, linear(count), jnp.float32(-3e-10))  # noqa: E731
    assert float(jax.jit(schedule)(n + 1)) < 0
    tx = optax_adascale.adascale_sgd(schedule, axis_name="i")
    params = {"w": jnp.ones(3)}
    update = replica_update(tx)
    state, steps = tx.init(params), 0
    while not optax_adascale.done(state, 2 * n):
        _, state = update(replica_grads(params, N, steps), state, params)
        steps += 1
    assert int(optax_adascale.metrics(state)["skipped_steps"]) == 0


def test_nan_only_in_the_squared_norm_path_is_skipped():
    params = {"w": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9)
    loss = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    _, grads, stats = optax_adascale.value_and_grad(loss, num_microbatches=2)(params, jnp.ones((4, 3)))
    state = tx.init(params)
    _, state = tx.update(grads, state, params, microbatch_stats=stats)
    poisoned = optax_adascale.MicrobatchStats({"w": jnp.float32(jnp.nan)}, 2)
    updates, after = tx.update(grads, state, params, microbatch_stats=poisoned)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert_skipped(state, after, updates)


def test_replica_gradient_of_1e30_is_skipped_not_propagated():
    # ‖g‖² = 3e60 overflows float32: the statistic is non-finite, so the step is skipped.
    params = {"w": jnp.ones(3)}
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    state = tx.init(params)
    _, state = replica_update(tx)(replica_grads(params, N, 0), state, params)
    grads = replica_grads(params, N, 1)
    grads["w"] = grads["w"].at[0].set(1e30)
    updates, after = replica_update(tx)(grads, state, params)
    assert_skipped(state, after, updates)


def test_bfloat16_gradient_near_its_maximum_is_skipped_not_propagated():
    # bf16 shares float32's range: a squared norm of entries near 3e38 has no finite float32 value,
    # so the statistic is non-finite and the step is skipped (and counted), never half-applied.
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="i")
    state = tx.init(params)
    _, state = replica_update(tx)(replica_grads(params, N, 0), state, params)
    grads = replica_grads(params, N, 1)
    grads["w"] = grads["w"].at[2, 1].set(jnp.bfloat16(3.0e38))
    assert bool(jnp.all(jnp.isfinite(grads["w"])))
    updates, after = replica_update(tx)(grads, state, params)
    assert_skipped(state, after, updates)


# --------------------------------------------------------------------------- mixed precision


@pytest.mark.parametrize("dtype, big", [(jnp.float16, 6.0e4), (jnp.bfloat16, 1.0e18)])
def test_squared_norms_of_large_low_precision_gradients_do_not_overflow(dtype, big):
    # 60000² overflows float16 (max 65504) and 1e18² overflows bfloat16's float32-sized range only
    # after summing in low precision: statistics square after casting to float32.
    rng = np.random.default_rng(0)
    g = (big * (0.5 + 0.5 * rng.random((N, 8)))).astype(np.float32)
    g_low = jnp.asarray(g, dtype)
    tx = optax_adascale.adascale_sgd(1e-12, axis_name="i")
    params = jnp.zeros(8, dtype)
    _, state = replica_update(tx)(g_low, tx.init(params), params)
    g64 = np.asarray(g_low.astype(jnp.float32), np.float64)
    a, b = np.mean(np.sum(g64**2, axis=1)), np.sum(g64.mean(0) ** 2)
    var = max(N / (N - 1) * (a - b), 1e-6)
    sqr = max(b - var / N, 0.0)
    m = optax_adascale.metrics(state)
    assert int(m["skipped_steps"]) == 0
    assert float(m["grad_sqr"]) == pytest.approx(sqr, rel=1e-2)
    assert float(m["gain"]) == pytest.approx((var + sqr) / (var / N + sqr), rel=1e-2)


def test_loss_scaled_float16_gradients_unscaled_before_update_match_float32():
    # Mixed-precision recipe: scale the loss by L for the backward pass, divide the gradient by L
    # (in float32) before handing it to AdaScale, as for any optax optimizer.
    L = 2.0**12
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, 16, 8)), jnp.float32)
    params32 = {"w": jnp.asarray(np.random.default_rng(2).normal(size=(8,)), jnp.float32)}
    params16 = jax.tree.map(lambda p: p.astype(jnp.float16), params32)
    loss = lambda p, xb: jnp.mean((xb.astype(p["w"].dtype) @ p["w"]) ** 2)
    g32 = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params32, x)
    g16 = jax.vmap(jax.grad(lambda p, xb: loss(p, xb) * L), in_axes=(None, 0))(params16, x)
    unscaled = jax.tree.map(lambda g: g.astype(jnp.float32) / L, g16)

    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    _, s32 = replica_update(tx)(g32, tx.init(params32), params32)
    _, s16 = replica_update(tx)(unscaled, tx.init(params32), params32)
    assert float(optax_adascale.metrics(s16)["gain"]) == pytest.approx(
        float(optax_adascale.metrics(s32)["gain"]), rel=1e-2
    )


R_PARAMS = jnp.zeros(3)


def _vmap_update(tx, grads, state, params):
    """``tx.update`` with the replicas as a vmap axis ``"i"`` (one gradient row per replica)."""
    return jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")(grads, state, params)


# --------------------------------------------------------------------------- bug 6: pmap without the right axis


@pytest.mark.parametrize("axis_name", [None, "data"])
def test_pmap_over_an_axis_the_optimizer_does_not_name_says_to_set_axis_name(axis_name):
    tx = optax_adascale.adascale_sgd(0.1, axis_name=axis_name)
    step = jax.pmap(lambda g, s: tx.update(g, s, R_PARAMS), axis_name="batch", in_axes=(0, None))
    with pytest.raises(ValueError, match=r"axis_name=.*'batch'") as err:
        step(jnp.ones((2, 3)), tx.init(R_PARAMS))
    assert f"axis_name={axis_name!r}" in str(err.value)


# --------------------------------------------------------------------------- bug 8: smaller ones


def test_a_constant_learning_rate_of_zero_warns_naming_learning_rate():
    with pytest.warns(UserWarning, match=r"learning_rate=0"):
        optax_adascale.adascale_sgd(0.0, axis_name="i")


def test_a_learning_rate_schedule_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optax_adascale.adascale_sgd(optax.constant_schedule(0.0), axis_name="i")
        optax_adascale.adascale_sgd(0.1, axis_name="i")


def test_the_single_replica_warning_points_at_the_users_call_through_the_flax_train_state():
    from optax_adascale.flax import TrainState

    params = {"w": R_PARAMS}
    state = TrainState.create(apply_fn=None, params=params, tx=optax_adascale.adascale_sgd(0.1, axis_name="i"))

    def step(state, grads):
        return state.apply_gradients(grads=grads)  # the user's call

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.vmap(step, in_axes=(None, 0), out_axes=None, axis_name="i")(state, {"w": jnp.ones((1, 3))})
    found = [w for w in caught if "single replica" in str(w.message)]
    assert found and found[0].filename == __file__


def test_the_single_replica_warning_points_at_the_users_call_of_update():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="i")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _vmap_update(tx, jnp.ones((1, 3)), tx.init(R_PARAMS), R_PARAMS)
    found = [w for w in caught if "single replica" in str(w.message)]
    assert found and found[0].filename == __file__


def test_a_state_from_an_inner_of_another_structure_is_a_value_error_naming_transfer_state():
    tx = optax_adascale.adascale(optax.trace(0.9), 0.1, accumulation_steps=2)
    other = optax_adascale.adascale(optax.identity(), 0.1, accumulation_steps=2).init(R_PARAMS)
    with pytest.raises(ValueError, match=r"opt_state does not match this transformation.*transfer_state"):
        tx.update(jnp.ones(3), other, R_PARAMS)


def test_a_state_that_is_not_adascales_is_a_value_error_naming_transfer_state():
    tx = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    with pytest.raises(ValueError, match=r"opt_state does not match this transformation.*transfer_state"):
        tx.update(jnp.ones(3), optax.sgd(0.1).init(R_PARAMS), R_PARAMS)


@pytest.mark.parametrize("labelled_source", [True, False], ids=["labelled_to_plain", "plain_to_labelled"])
def test_transfer_state_between_labelled_and_unlabelled_names_param_labels(labelled_source):
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    labelled = optax_adascale.adascale_sgd(0.1, accumulation_steps=2, param_labels={"a": "x", "b": "y"})
    plain = optax_adascale.adascale_sgd(0.1, accumulation_steps=2)
    source, target = (labelled, plain) if labelled_source else (plain, labelled)
    with pytest.raises(ValueError, match=r"param_labels"):
        optax_adascale.transfer_state(source.init(params), target.init(params))
