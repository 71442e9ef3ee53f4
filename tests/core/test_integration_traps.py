"""The traps of dropping AdaScale into existing trainers (docs/integrations.md): what the user sees.

(i) ``optax.inject_hyperparams`` evaluating a learning-rate schedule on its own count (Levanter);
(ii) count-based schedule readers and ``optax.scale_by_schedule`` (big_vision, Flax, MaxText);
(iii) gradients averaged before the optimizer (Flax imagenet under pmap);
(iv) ``optax.MultiSteps`` around AdaScale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import optax_adascale

N = 8  # replicas


def schedule(t):
    return 1.0 / (1.0 + jnp.asarray(t, jnp.float32))


def _run(tx, steps=3):
    """``steps`` updates of N replicas whose gradients are orthogonal (pure noise: gain N)."""
    params = jnp.zeros(N)
    state = tx.init(params)
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i"))
    for _ in range(steps):
        updates, state = step(jnp.eye(N), state, params)
    return updates, state


# --------------------------------------------------------------------------- (i) inject_hyperparams


@pytest.mark.parametrize("factory", [optax_adascale.adascale_sgd, optax_adascale.adascale_adamw])
def test_inject_hyperparams_schedule_is_refused(factory):
    # Recognised from the state inject_hyperparams keeps around AdaScale's (a schedule's state for the learning
    # rate), when the state is read: metrics, done, scale_invariant_steps, get_adascale_state.
    tx = optax.inject_hyperparams(factory, static_args=("accumulation_steps",))(learning_rate=schedule, axis_name="i")
    _, state = _run(tx)
    for reader in (optax_adascale.metrics, optax_adascale.scale_invariant_steps, optax_adascale.get_adascale_state):
        with pytest.raises(ValueError, match=r"static_args=\('learning_rate',\)"):
            reader(state)
    with pytest.raises(ValueError, match="inject_hyperparams around AdaScale with a schedule for 'learning_rate'"):
        optax_adascale.done(state, 100)


def test_inject_hyperparams_schedule_is_refused_through_a_levanter_style_factory():
    # Levanter's optim/config.py: `def _optimizer(learning_rate): ...; inject_hyperparams(_optimizer)(learning_rate=s)`.
    def _optimizer(learning_rate):
        return optax.chain(
            optax.clip_by_global_norm(1.0), optax_adascale.adascale(optax.scale_by_adam(), learning_rate, axis_name="i")
        )

    _, state = _run(optax.inject_hyperparams(_optimizer)(learning_rate=schedule))
    with pytest.raises(ValueError, match="inject_hyperparams' iteration count|evaluates it on its own iteration count"):
        optax_adascale.metrics(state)


def test_inject_hyperparams_with_static_learning_rate_runs_the_schedule_on_tau():
    # The refusal's advice, exactly as it reads: static_args=('learning_rate',) and nothing else.
    plain_updates, plain = _run(optax_adascale.adascale_sgd(schedule, axis_name="i"))
    injected = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("learning_rate",))(
        learning_rate=schedule, axis_name="i"
    )
    updates, state = _run(injected)
    m = optax_adascale.metrics(state)
    assert float(m["gain"]) == pytest.approx(N)
    # The third update runs at τ = 2N: lr(16), not lr(2) as the count would give.
    np.testing.assert_allclose(m["base_learning_rate"], schedule(2 * N), rtol=1e-6)
    np.testing.assert_array_equal(updates, plain_updates)


# inner(ḡ) per coordinate for N orthogonal unit samples (ḡ = 1/N): SGD's ḡ itself, Adam's first step ḡ/(|ḡ| + ε).
DIRECTIONS = {"adascale_sgd": 1.0 / N, "adascale_adamw": (1.0 / N) / (1.0 / N + 1e-8)}
# The step per unit of lr·inner(ḡ) at gain N: SGD's r = N; Adam's √N on the τ clock (core/_clock.py's
# scale_by_adam: its direction is already √r longer per unit of progress at an r-times smaller noise).
GAIN_STEP = {"adascale_sgd": N, "adascale_adamw": N**0.5}


@pytest.mark.parametrize("name", DIRECTIONS)
def test_inject_hyperparams_trains_with_no_static_args_and_the_injected_learning_rate_sets_the_step(name):
    # optax.inject_hyperparams makes every number an array of its state (accumulation_steps too); under jit the
    # factory gets them traced. Orthogonal samples: gain N, so the step is −GAIN_STEP·lr·inner(ḡ), for the lr set in
    # the state.
    tx = optax.inject_hyperparams(getattr(optax_adascale, name))(learning_rate=0.5, axis_name="i")
    params = jnp.zeros(N)
    state = tx.init(params)
    step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i"))
    updates, state = step(jnp.eye(N), state, params)
    np.testing.assert_allclose(updates, np.full(N, -GAIN_STEP[name] * 0.5 * DIRECTIONS[name]), rtol=1e-6)
    state.hyperparams["learning_rate"] = jnp.asarray(0.125)
    updates, state = step(jnp.eye(N), state, params)
    np.testing.assert_allclose(updates, np.full(N, -GAIN_STEP[name] * 0.125 * DIRECTIONS[name]), rtol=1e-5)
    # Every reader finds AdaScale's state inside inject_hyperparams'.
    assert int(optax_adascale.get_adascale_state(state).count) == 2
    m = optax_adascale.metrics(state)
    assert float(m["gain"]) == pytest.approx(N) and float(m["base_learning_rate"]) == 0.125
    assert float(optax_adascale.scale_invariant_steps(state)) == pytest.approx(2 * N)
    assert optax_adascale.done(state, 2 * N) and not optax_adascale.done(state, 2 * N + 1)


def test_inject_hyperparams_with_accumulation_steps_above_one_names_static_args_and_that_works():
    # k shapes the program: traced inside jit it cannot be read, and the refusal names the spelling that works.
    params = jnp.zeros(N)

    def vmapped(tx):  # per-replica accumulation buffers (state_axes)
        state = optax_adascale.replicate_buffers(tx.init(params), N)
        axes = optax_adascale.state_axes(state)
        return jax.jit(jax.vmap(tx.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")), state

    tx = optax.inject_hyperparams(optax_adascale.adascale_sgd)(learning_rate=0.5, axis_name="i", accumulation_steps=2)
    step, state = vmapped(tx)
    with pytest.raises(TypeError, match=r"static_args=\('accumulation_steps',\)"):
        step(jnp.eye(N), state, params)
    tx = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("accumulation_steps",))(
        learning_rate=0.5, axis_name="i", accumulation_steps=2
    )
    step, state = vmapped(tx)
    _, state = step(jnp.eye(N), state, params)
    updates, state = step(jnp.eye(N), state, params)
    # Replica i's samples are e_i twice: a = 1, b = 1/N, n = S = 2N; σ̂² = S(a − b)/(n − 1), μ̂² = b − σ̂²/S.
    n = S = 2 * N
    var = S * (1 - 1 / N) / (n - 1)
    sqr = 1 / N - var / S
    gain = (var + sqr) / (var / S + sqr)
    np.testing.assert_allclose(updates, np.full(N, -gain * 0.5 / N), rtol=1e-6)


def test_setting_an_injected_accumulation_steps_is_refused_by_the_readers():
    # accumulation_steps is an entry of opt_state.hyperparams, but the state fixes it: a new value would do nothing.
    tx = optax.inject_hyperparams(optax_adascale.adascale_sgd)(learning_rate=0.5, axis_name="i")
    state = tx.init(jnp.zeros(N))
    assert int(optax_adascale.get_adascale_state(state).count) == 0  # the value it was built with reads fine
    state.hyperparams["accumulation_steps"] = jnp.asarray(4)
    with pytest.raises(ValueError, match=r"hyperparams\['accumulation_steps'\] is 4.*transfer_state"):
        optax_adascale.metrics(state)


def test_inject_hyperparams_constant_learning_rate_is_accepted_and_can_be_set():
    tx = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=("accumulation_steps",))(
        learning_rate=0.5, axis_name="i"
    )
    params = jnp.zeros(N)
    state = tx.init(params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.25)
    step = jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    _, state = step(jnp.eye(N), state, params)
    np.testing.assert_allclose(optax_adascale.metrics(state)["base_learning_rate"], 0.25)


def test_a_schedule_transformed_inside_the_factory_is_refused_too():
    # 0.2 recognised the injected value itself (a frame walk), so lr·1 slipped through; the state does not lie.
    def _optimizer(learning_rate):
        return optax_adascale.adascale_sgd(learning_rate * 1.0, axis_name="i")

    _, state = _run(optax.inject_hyperparams(_optimizer)(learning_rate=schedule))
    with pytest.raises(ValueError, match="inject_hyperparams around AdaScale"):
        optax_adascale.metrics(state)


# --------------------------------------------------------------------------- (ii) count-based schedules


@pytest.mark.parametrize("wrap", [lambda t: t, lambda t: optax.masked(t, lambda p: jax.tree.map(lambda _: True, p))])
def test_count_based_schedule_inside_inner_is_refused(wrap):
    # big_vision's optax.py chains optax.masked(optax.scale_by_schedule(fn), mask) after the optimizer.
    inner = optax.chain(optax.scale_by_adam(), wrap(optax.scale_by_schedule(schedule)))
    tx = optax_adascale.adascale(inner, schedule)
    with pytest.raises(ValueError, match="scale_by_schedule"):
        tx.init({"w": jnp.zeros(2)})


def test_count_readers_find_no_schedule_state_and_the_count_is_in_adascales_state():
    # big_vision's get_count reads optax.ScaleByScheduleState.count; AdaScale has none. Its count is
    # AdaScaleState.count, and the schedule's value is metrics()["base_learning_rate"] = lr(⌊τ⌋), not lr(count).
    _, state = _run(optax_adascale.adascale_sgd(schedule, axis_name="i"))
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
    assert not [x for x in leaves if isinstance(x, optax.ScaleByScheduleState)]
    assert int(optax_adascale.get_adascale_state(state).count) == 3
    m = optax_adascale.metrics(state)
    np.testing.assert_allclose(m["base_learning_rate"], schedule(2 * N), rtol=1e-6)
    assert float(m["base_learning_rate"]) < float(schedule(2))  # what a count-based reader would log
    np.testing.assert_allclose(m["learning_rate"], N * schedule(2 * N), rtol=1e-6)


# --------------------------------------------------------------------------- (iii) averaged before update


def _local_grads():
    return jax.random.normal(jax.random.key(0), (N, 16)) + 0.5


def test_gradients_pmeaned_before_update_under_pmap_show_only_in_floored_steps():
    tx = optax_adascale.adascale_sgd(0.1, axis_name="batch")
    params = jnp.zeros(16)

    def run(pmean_first):
        def step(state, g):
            if pmean_first:  # Flax examples/imagenet/train.py: grads = lax.pmean(grads, axis_name='batch')
                g = lax.pmean(g, "batch")
            return tx.update(g, state, params)[1]

        p_step = jax.pmap(step, axis_name="batch", in_axes=(None, 0), out_axes=None)
        state = tx.init(params)
        for _ in range(3):
            state = p_step(state, _local_grads())
        return optax_adascale.metrics(state)

    wrong, right = run(True), run(False)
    assert int(wrong["floored_steps"]) == 3  # every update: the replicas looked identical
    assert float(wrong["gain"]) == pytest.approx(1.0)
    assert int(right["floored_steps"]) == 0 and float(right["gain"]) > 1.5


def test_gradients_pmeaned_before_update_under_shard_map_raise():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
    tx = optax_adascale.adascale_sgd(0.1, axis_name="batch")
    params = jnp.zeros(16)

    def step(state, g):
        return tx.update(lax.pmean(g[0], "batch"), state, params)[1]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
    with pytest.raises(ValueError, match="not per-replica gradients"):
        f(tx.init(params), _local_grads())


# --------------------------------------------------------------------------- (iv) optax.MultiSteps around AdaScale


@pytest.mark.parametrize("front_door", ["vmap", "pmap", "shard_map"])
def test_multisteps_around_adascale_is_refused_by_our_message_at_every_front_door(front_door):
    # Under vmap JAX failed first ("vmap has mapped output but out_axes is None"), under shard_map a generic
    # "does not vary" listed three causes, under pmap it ran until a reader refused the state.
    tx = optax.MultiSteps(optax_adascale.adascale_sgd(0.1, axis_name="i"), every_k_schedule=2)
    params = jnp.zeros(N)
    if front_door == "vmap":
        step = jax.jit(jax.vmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i"))
    elif front_door == "pmap":
        step = jax.pmap(tx.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
        local = lambda g, s, p: tx.update(g[0], s, p)  # noqa: E731
        step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("i"), P(), P()), out_specs=(P(), P())))
    with pytest.raises(ValueError, match=r"^optax.MultiSteps around AdaScale.*accumulation_steps=k"):
        step(jnp.eye(N), tx.init(params), params)


# --------------------------------------------------------------------------- clipping before update


def _stats(samples, measured=True):
    """Hand-built statistics of ``samples`` (stacked on axis 0): their mean squared norm, and, with ``measured``,
    the squared norm of their mean (the gradients they come with)."""
    grads = samples.mean(0)
    return grads, optax_adascale.MicrobatchStats(
        jnp.mean(jnp.sum(samples**2, axis=-1)), samples.shape[0], grad_sq_norms=jnp.sum(grads**2) if measured else None
    )


def test_clipping_before_update_with_hand_built_statistics_is_skipped_and_done_names_the_fix():
    # MaxText clips ḡ in train_step, before the optimizer, while the samples' statistics stay unclipped: a would be
    # the unclipped samples', b the clipped mean's, and the variance inflated (it was, silently: issue 44). With the
    # norms of the gradients they measured, the statistics tell the change.
    samples = jax.random.normal(jax.random.key(4), (N, 16)) + 2.0
    grads, stats = _stats(samples)
    params, clip = jnp.zeros(16), optax.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(params))  # what optax.chain(clip, tx) hands AdaScale
    tx = optax_adascale.adascale(optax.identity(), 0.1)
    update = jax.jit(tx.update)
    m_clean = optax_adascale.metrics(update(grads, tx.init(params), params, microbatch_stats=stats)[1])
    updates, s_clipped = update(clipped, tx.init(params), params, microbatch_stats=stats)
    m_clipped = optax_adascale.metrics(s_clipped)
    a, b = float(stats.sq_norms), float(jnp.sum(grads**2))
    np.testing.assert_allclose(m_clean["grad_var"], N / (N - 1) * (a - b), rtol=1e-5)  # unclipped: taken, right
    assert int(m_clean["skipped_steps"]) == 0
    assert int(m_clipped["skipped_altered_grads_steps"]) == int(m_clipped["skipped_steps"]) == 1
    assert float(m_clipped["grad_var"]) == 0.0 and not bool(jnp.any(updates))  # nothing learned from the wrong b
    with pytest.raises(RuntimeError, match=r"clip_by_global_norm\(c\), inner"):
        optax_adascale.done(s_clipped, 100)
    # Statistics without the measured norms: nothing to compare them with, the update is taken (documented).
    _, unmeasured = _stats(samples, measured=False)
    s = update(clipped, tx.init(params), params, microbatch_stats=unmeasured)[1]
    assert int(optax_adascale.metrics(s)["skipped_steps"]) == 0


def _replica_microbatches(seed):
    """Per replica, a batch of 4 rows of a linear regression (2 micro-batches of 2)."""
    x = jax.random.normal(jax.random.key(seed), (N, 4, 3))
    return x, x @ jnp.array([1.0, -2.0, 0.5]) + 3.0


def _loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


@pytest.mark.parametrize(
    "front_door, accumulation", [("shard_map", "none"), ("pmap", "none"), ("vmap", "k=2"), ("vmap", "BatchRamp")]
)
def test_clipping_before_update_on_per_replica_statistics_is_caught_at_every_front_door(front_door, accumulation):
    """value_and_grad(num_microbatches=2) per replica, a clip chained before AdaScale, with or without accumulation:
    each replica compares the gradients it is given with those it measured, and the skip rides the one reduction
    (−∞ squared norms), so every replica skips the update and counts it, with no extra collective."""
    k = {"none": 1, "k=2": 2, "BatchRamp": optax_adascale.BatchRamp(2, 2)}[accumulation]
    vg = optax_adascale.value_and_grad(_loss, num_microbatches=2)
    w = jnp.zeros(3)

    def run(clipped):
        ada = optax_adascale.adascale_sgd(0.05, axis_name="i", accumulation_steps=k)
        tx = optax.chain(optax.clip_by_global_norm(1e-3), ada) if clipped else ada

        def step(state, x, y):
            _, g, stats = vg(lax.pcast(w, "i", to="varying") if front_door == "shard_map" else w, x, y)
            return tx.update(g, state, w, microbatch_stats=stats)[1]

        state = tx.init(w)
        if k != 1:
            state = optax_adascale.replicate_buffers(state, N)
        if front_door == "shard_map":
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
            specs = optax_adascale.state_partition_specs(state, "i")
            local = lambda s, x, y: step(s, x[0], y[0])  # noqa: E731
            f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P("i"), P("i")), out_specs=specs))
        else:
            axes = optax_adascale.state_axes(state)
            mapped = jax.pmap if front_door == "pmap" else lambda fn, **kw: jax.jit(jax.vmap(fn, **kw))
            f = mapped(step, in_axes=(axes, 0, 0), out_axes=axes, axis_name="i")
        for seed in range(4):
            state = f(state, *_replica_microbatches(seed))
        return optax_adascale.metrics(state)

    clean, clipped = run(False), run(True)
    updates = 4 // (1 if k == 1 else 2)
    assert int(clean["skipped_steps"]) == 0 and float(clean["grad_var"]) > 0
    assert int(clipped["skipped_altered_grads_steps"]) == int(clipped["skipped_steps"]) == updates
    assert float(clipped["grad_var"]) == 0.0 and float(clipped["scale_invariant_steps"]) == 0.0


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit_mesh", "auto_mesh"])
def test_the_readers_read_a_pmap_state_under_a_mesh_kept_around_the_loop(explicit):
    """A ``jax.set_mesh(mesh)`` left around a ``jax.pmap`` loop: JAX refuses an eager operation on the pmap's arrays
    under an Explicit context mesh ("context mesh ... should match the aval mesh"); ``done``, ``metrics``,
    ``scale_invariant_steps`` and ``scale_advice`` read them as outside the mesh."""
    from jax.sharding import Mesh

    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, axis_name="data")
    params = jnp.ones(4)
    copies = jax.tree.map(lambda x: jnp.stack([x] * N), (params, tx.init(params)))

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    grads = jnp.asarray(np.random.default_rng(0).normal(size=(N, 4)), jnp.float32)
    _, state = jax.pmap(step, axis_name="data")(*copies, grads)
    outside = (optax_adascale.metrics(state), float(optax_adascale.scale_invariant_steps(state)[0]))
    mesh = jax.make_mesh((N,), ("data",)) if explicit else Mesh(np.array(jax.devices()[:N]), ("data",))
    with jax.set_mesh(mesh):
        assert not optax_adascale.done(state, 10)
        inside = (optax_adascale.metrics(state), float(optax_adascale.scale_invariant_steps(state)[0]))
        assert "each update is worth" in optax_adascale.scale_advice(state)
    assert inside[1] == outside[1] > 1.0
    for key in ("gain", "grad_var", "grad_sqr", "scale"):
        np.testing.assert_array_equal(inside[0][key], outside[0][key])
