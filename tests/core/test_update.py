"""The optax contract for ``update``: optax's own optimizer checks in three configurations, then chaining and S = 1.

Part 1 (after optax/contrib/_common_test.py and the other harnesses below) runs each check on two optimizers
in three configurations; part 2 checks what is ours: the S = 1 identity, ``inject_hyperparams`` with static
structural arguments, chaining and clipping around AdaScale, donation, and ``MultiSteps`` inside ``inner``.


optax checks every optimizer it ships for the same properties (contrib/_common_test.py, _src/alias_test.py,
transforms/_accumulation_test.py, _src/float64_test.py, _src/sharding_test.py): extra ``update`` keyword
arguments, no recompilation, ``tree_map_params``, convergence on small problems, ``inject_hyperparams``,
dtype preservation, ``MultiSteps``, shape/dtype stability under ``lax.cond``, explicit and mixed dtypes,
sharding-in-types. Here every check runs for two optimizers (``adascale_sgd(lr, momentum=0.9)`` and
``adascale(optax.trace(0.9), lr)``) in three configurations:

* ``no_axis``: one replica (``S = 1``: AdaScale is exactly the inner optimizer);
* ``accumulation``: ``accumulation_steps=2`` without an axis (an update is two calls; the first returns zeros);
* ``vmap``: two replicas as a ``jax.vmap(..., axis_name="i")`` axis, gradients stacked on a leading axis.

:class:`Setup` builds each configuration's ``init``, ``update`` call and inputs, so each check is written once.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import replica_grads, replica_update
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale

CONFIGS = ("no_axis", "accumulation", "vmap")
OPTIMIZERS = ("adascale_sgd", "adascale_trace")
REPLICAS = 2


# --------------------------------------------------------------------------- the configurations


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration: how to build, initialise and call an optimizer in it."""

    config: str
    accumulation_steps: int = 1

    @classmethod
    def of(cls, config: str) -> "Setup":
        return cls(config, accumulation_steps=2 if config == "accumulation" else 1)

    @property
    def axis_name(self):
        return "i" if self.config == "vmap" else None

    @property
    def replicas(self) -> int:
        return REPLICAS if self.config == "vmap" else 1

    @property
    def kwargs(self) -> dict:
        return {"axis_name": self.axis_name, "accumulation_steps": self.accumulation_steps}

    def make(self, optimizer: str, learning_rate=0.1, inner=None, **kw):
        """``adascale_sgd(lr, momentum=0.9)`` or ``adascale(inner or optax.trace(0.9), lr)`` in this configuration."""
        if optimizer == "adascale_sgd":
            assert inner is None
            return optax_adascale.adascale_sgd(learning_rate, momentum=0.9, **self.kwargs, **kw)
        return optax_adascale.adascale(optax.trace(0.9) if inner is None else inner, learning_rate, **self.kwargs, **kw)

    def init(self, tx, params):
        """``tx.init``, with one set of accumulation buffers per replica where there are several."""
        state = tx.init(params)
        if self.replicas > 1 and self.accumulation_steps > 1:
            state = optax_adascale.replicate_buffers(state, self.replicas)
        return state

    def call(self, tx, state, *, params_as_keyword=False, **extra):
        """One call of ``update``: ``(inputs, state, params) -> (updates, state)``; see :meth:`inputs`."""
        if params_as_keyword:
            update = lambda g, s, p: tx.update(g, s, params=p, **extra)
        else:
            update = lambda g, s, p: tx.update(g, s, p, **extra)
        if self.replicas == 1:
            return update
        axes = optax_adascale.state_axes(state)
        return jax.vmap(update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")

    def call_input(self, grads, noise=0.0, call=0):
        """The ``update`` input of call number ``call`` (an int, or traced) of an update, for the true gradient.

        Replicas (stacked on a leading axis) and the calls of an accumulation window see ``grads ± noise`` with
        alternating signs, so that the mean over an update is ``grads``.
        """
        sign = 1 - 2 * (call % 2)
        sample = lambda s: jax.tree.map(lambda g: g + jnp.asarray(s * noise, g.dtype), grads)
        if self.replicas == 1:
            return sample(sign)
        return jax.tree.map(lambda a, b: jnp.stack([a, b]), sample(sign), sample(-sign))

    def inputs(self, grads, noise=0.0):
        """The ``update`` inputs of one update: one per call."""
        return [self.call_input(grads, noise, c) for c in range(self.accumulation_steps)]


@functools.cache
def _compiler_options():
    """XLA:CPU compiles these small optimizer programs about 3x faster without its fusion emitters (the file
    compiles ~150 of them); where this XLA does not know the option, its defaults."""
    options = {"xla_cpu_use_fusion_emitters": False}
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(jnp.float32(1)).compile()
    except Exception:  # noqa: BLE001 - an unknown option: keep XLA's defaults
        return None
    return options


def jit(fun):
    """``jax.jit`` with :func:`_compiler_options` (codegen only: the programs and their types are jax.jit's)."""
    return jax.jit(fun, compiler_options=_compiler_options())


setups = pytest.mark.parametrize("config", CONFIGS)
optimizers = pytest.mark.parametrize("optimizer", OPTIMIZERS)


def types(tree):
    """``jax.typeof`` of every leaf: shape, dtype, weak_type and sharding (what the jit cache keys on)."""
    return jax.tree.map(jax.typeof, tree)


def abstract(tree):
    """``ShapeDtypeStruct`` (shape, dtype, weak_type, sharding) of every leaf of arrays or of abstract values."""
    return jax.eval_shape(lambda t: t, tree)


def dtypes(tree):
    return jax.tree.map(lambda x: jnp.dtype(x.dtype) if hasattr(x, "dtype") else jnp.asarray(x).dtype, tree)


def assert_trees_close(a, b, rtol, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


# --------------------------------------------------------------------------- the test problems


def parabola(dtype=jnp.float32):
    init = jnp.array([-1.0, 10.0, 1.0], dtype)
    target = jnp.array([1.0, -1.0, 1.0], dtype)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        target = target * (1 + 1j)
    return init, target, lambda p: jnp.sum(jnp.real(jnp.conj(p - target) * (p - target)))


def rosenbrock(dtype=jnp.float32):
    a, b = 1.0, 100.0
    init = jnp.zeros(2, dtype)
    target = jnp.array([a, a**2], dtype)
    return init, target, lambda p: (a - p[0]) ** 2 + b * (p[1] - p[0] ** 2) ** 2


def descent_direction(loss, params):
    """``∇loss``, conjugated for complex parameters (as optax's tests do) so that ``p − lr·g`` descends."""
    return jax.tree.map(jnp.conj, jax.grad(loss)(params))


def train(setup, tx, problem, steps, noise=0.0):
    """``steps`` updates of ``tx`` on ``problem`` in one jitted ``lax.scan``; the final params.

    The scan runs over calls (``accumulation_steps`` per update; the first calls of a window return zero
    updates, so the gradient is taken at the same params), which keeps one ``update`` in the compiled body.
    """
    init, _, loss = problem
    state = setup.init(tx, init)
    call = setup.call(tx, state)

    def body(carry, i):
        params, state = carry
        x = setup.call_input(descent_direction(loss, params), noise, i % setup.accumulation_steps)
        updates, state = call(x, state, params)
        return (optax.apply_updates(params, updates), state), None

    calls = jnp.arange(steps * setup.accumulation_steps)
    (params, state), _ = jit(lambda p, s: lax.scan(body, (p, s), calls))(init, state)
    assert int(optax_adascale.get_adascale_state(state).count) == steps
    return params


# --------------------------------------------------------------------------- 1. extra arguments


def recording_inner(seen: list):
    """``optax.trace(0.9)`` followed by a transformation that records the ``note`` extra argument it receives."""

    def update(updates, state, params=None, *, note=None, **extra):
        seen.append(note)
        return updates, state

    return optax.chain(optax.trace(0.9), optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update))


@optimizers
@setups
def test_update_accepts_unexpected_extra_keyword_args_under_jit_and_forwards_them_to_inner(optimizer, config):
    setup = Setup.of(config)
    seen = []
    inner = recording_inner(seen) if optimizer == "adascale_trace" else None
    tx = setup.make(optimizer, 1e-3, inner=inner)
    params, _, loss = rosenbrock()
    state = setup.init(tx, params)
    seen.clear()  # init probes inner without extra arguments
    call = jit(setup.call(tx, state, unexpected_extra_arg=1, note="hello"))
    for _ in range(2):
        for x in setup.inputs(descent_direction(loss, params), 0.01):
            updates, state = call(x, state, params)
            params = optax.apply_updates(params, updates)
    assert bool(jnp.all(jnp.isfinite(params)))
    assert int(optax_adascale.get_adascale_state(state).count) == 2
    if inner is not None:  # inner saw the extra argument (when the call was traced)
        assert seen and set(seen) == {"hello"}


# --------------------------------------------------------------------------- 2. no recompilation


@optimizers
@setups
def test_second_jitted_call_does_not_retrace(optimizer, config):
    setup = Setup.of(config)
    tx = setup.make(optimizer, 1e-3)
    params, _, loss = rosenbrock()
    state0 = setup.init(tx, params)
    call = setup.call(tx, state0)
    traces = []

    @jit
    def step(x, state, params):
        traces.append(None)
        return call(x, state, params)

    state = state0
    for _ in range(2):  # two updates: every call of an accumulation window is the same compiled program
        for x in setup.inputs(descent_direction(loss, params), 0.01):
            updates, state = step(x, state, params)
            assert types(state) == types(state0)  # weak_type included: the state must not change its jit key
            params = optax.apply_updates(params, updates)
    assert len(traces) == 1
    assert int(optax_adascale.get_adascale_state(state).count) == 2


# --------------------------------------------------------------------------- 3. tree_map_params


@optimizers
@setups
def test_tree_map_params_identity_is_a_no_op(optimizer, config):
    setup = Setup.of(config)
    tx = setup.make(optimizer)
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    state = setup.init(tx, params)
    mapped = optax.tree_map_params(tx, lambda v: v, state)
    assert jax.tree.structure(mapped) == jax.tree.structure(state)
    assert types(mapped) == types(state)
    jax.tree.map(np.testing.assert_array_equal, mapped, state)
    # The params-shaped buffers are the ones it maps: the momentum (and the accumulation buffer, if any).
    marked = optax.tree_map_params(tx, lambda v: jnp.full_like(v, 7.0), state)
    assert np.all(np.asarray(optax.tree.get(marked, "trace")["w"]) == 7.0)
    assert int(optax_adascale.get_adascale_state(marked).count) == 0


# --------------------------------------------------------------------------- 4. convergence and schedules


PROBLEMS = {
    "parabola_float32": lambda: parabola(jnp.float32),
    "rosenbrock_float32": lambda: rosenbrock(jnp.float32),
    "parabola_complex64": lambda: parabola(jnp.complex64),
}


@pytest.mark.parametrize("problem", PROBLEMS)
@optimizers
@setups
def test_converges_to_the_minimum(optimizer, config, problem):
    # optax's setting for sgd: lr 1e-3, momentum 0.9, 10 000 steps. Replicas and accumulated calls see the
    # gradient ± small opposite noise, so the gain (and τ) exceed 1 while the mean gradient is exact.
    setup = Setup.of(config)
    init, target, loss = PROBLEMS[problem]()
    params = train(setup, setup.make(optimizer, 1e-3), (init, target, loss), steps=10_000, noise=0.01)
    np.testing.assert_allclose(params, target, rtol=3e-2, atol=3e-2)


@optimizers
@setups
def test_constant_schedule_equals_the_float_learning_rate(optimizer, config):
    setup = Setup.of(config)
    problem = parabola()
    with_float = train(setup, setup.make(optimizer, 1e-3), problem, steps=10, noise=0.1)
    with_schedule = train(setup, setup.make(optimizer, optax.constant_schedule(1e-3)), problem, steps=10, noise=0.1)
    np.testing.assert_allclose(with_schedule, with_float, rtol=1e-6, atol=0)
    assert not np.array_equal(with_float, problem[0])  # it moved


# --------------------------------------------------------------------------- 5. inject_hyperparams


@optimizers
@setups
def test_inject_hyperparams_matches_the_plain_optimizer(optimizer, config):
    setup = Setup.of(config)
    if optimizer == "adascale_sgd":
        static = ("accumulation_steps", "axis_name", "nesterov")
        injected = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=static)(
            learning_rate=0.1, momentum=0.9, **setup.kwargs
        )
    else:
        factory = lambda learning_rate: optax_adascale.adascale(optax.trace(0.9), learning_rate, **setup.kwargs)
        injected = optax.inject_hyperparams(factory)(learning_rate=0.1)
    plain = setup.make(optimizer, 0.1)
    params = [-jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    grads = [jnp.ones((2, 3)), -jnp.ones((2, 5, 2))]

    def one_update(tx):
        state = tx.init(params)
        call = jit(setup.call(tx, state))
        for x in setup.inputs(grads, 0.5):
            updates, state = call(x, state, params)
        return updates, state

    u_inj, s_inj = one_update(injected)
    u_plain, s_plain = one_update(plain)
    assert_trees_close(u_inj, u_plain, rtol=1e-5)
    # weight_decay=0.0 (and eps) become arrays under inject_hyperparams: the inner state's structure must not change.
    assert jax.tree.structure(s_inj.inner_state) == jax.tree.structure(s_plain)
    assert dtypes(s_inj.inner_state) == dtypes(s_plain)
    assert_trees_close(s_inj.inner_state, s_plain, rtol=1e-5, atol=1e-5)
    assert int(optax_adascale.get_adascale_state(s_inj).count) == 1
    # The usual idiom to read the injected learning rate finds exactly one match.
    assert float(optax.tree.get(s_inj, "learning_rate")) == pytest.approx(0.1)


# --------------------------------------------------------------------------- 6. updates keep dtypes


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bfloat16", "float16", "float32"])
@optimizers
@setups
def test_updates_keep_the_params_dtype(optimizer, config, dtype):
    # Under strict dtype promotion (scoped to our code): no silent bf16/f16 -> f32 promotion anywhere.
    setup = Setup.of(config)
    tx = setup.make(optimizer)
    params = jnp.array([1.0, 2.0], dtype)
    grads = jax.grad(lambda p: jnp.sum(p**2))(params)
    assert grads.dtype == params.dtype
    state0 = state = jit(tx.init)(params)
    call = jit(setup.call(tx, state))
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        for i, x in enumerate(setup.inputs(grads, 0.5)):
            updates, state = call(x, state, params)
            assert updates.dtype == params.dtype == grads.dtype
            assert types(state) == types(state0)
            if i < setup.accumulation_steps - 1:  # a call that only accumulates returns exact zeros
                np.testing.assert_array_equal(updates, jnp.zeros_like(params))
    s = optax_adascale.get_adascale_state(state)
    assert int(s.count) == 1
    assert s.gain.dtype == s.grad_var.dtype == jnp.float32  # statistics stay in float32
    assert not np.any(np.asarray(updates) == 0)


# --------------------------------------------------------------------------- 7. MultiSteps


@optimizers
@setups
def test_multisteps_around_adascale_is_refused_when_update_is_traced(optimizer, config):
    # optax's contract suite checks that MultiSteps' first update is zero. Around AdaScale MultiSteps hands one
    # call's statistics to an update (and under vmap its per-replica accumulator failed inside JAX, "vmap has mapped
    # output but out_axes is None"): refused in every configuration with the fix, as under shard_map.
    setup = Setup.of(config)
    multi = optax.MultiSteps(setup.make(optimizer), every_k_schedule=4)
    params = jnp.array([1.0, 2.0])
    update = multi.update
    if setup.replicas > 1:
        update = jax.vmap(multi.update, in_axes=(0, None, None), out_axes=(None, None), axis_name="i")
    x = setup.inputs(jnp.array([0.5, -1.5]), 0.25)[0]
    with pytest.raises(ValueError, match=r"optax.MultiSteps around AdaScale.*accumulation_steps=k"):
        jit(update)(x, jit(multi.init)(params), params)


# --------------------------------------------------------------------------- 8. lax.cond stability

COND_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", COND_DTYPES)
@optimizers
@setups
def test_state_keeps_tree_shape_and_dtype_under_lax_cond(optimizer, config, dtype):
    # lax.cond needs both branches to have identical types: the updates those of the params, the new state the
    # old state's (tree, shape, dtype, weak_type). That is decided when the jitted step is traced, so
    # jax.eval_shape checks it without compiling (two steps, the second on the first one's output types).
    setup = Setup.of(config)
    with jax.enable_x64(dtype in ("float64", "complex128")):
        dtype = jnp.dtype(dtype)
        tx = setup.make(optimizer)
        params, _, loss = parabola(dtype)
        state0 = setup.init(tx, params)
        call = setup.call(tx, state0)

        @jit
        def step(params, state, key):
            pred = jax.random.randint(key, (), 0, 2) == 1  # data-dependent: not folded at trace time
            (x,) = setup.inputs(descent_direction(loss, params), 0.1)[:1]
            updates, state = lax.cond(
                pred, lambda: call(x, state, params), lambda: (jax.tree.map(jnp.zeros_like, params), state)
            )
            return optax.apply_updates(params, updates), state

        expected_params, expected_state = abstract(params), abstract(state0)
        p, s = params, state0
        for seed in range(2):
            p, s = jax.eval_shape(step, p, s, jax.random.key(seed))
            assert p == expected_params and p.dtype == dtype
            assert s == expected_state
        # Outside jit too: the initial and the stepped state can be the two branches of one cond.
        either = jax.eval_shape(lambda pred, a, b: lax.cond(pred, lambda: a, lambda: b), jnp.bool_(True), state0, s)
        assert either == expected_state


# --------------------------------------------------------------------------- 9. explicit dtypes


@optimizers
@setups
def test_explicit_inner_state_dtype_is_kept(optimizer, config):
    # adascale(optax.trace(0.9, accumulator_dtype=bfloat16)) keeps a bfloat16 momentum for float32 params;
    # adascale_sgd has no accumulator_dtype argument, and its momentum follows the params (float32).
    setup = Setup.of(config)
    if optimizer == "adascale_sgd":
        accumulator_dtype = None
        tx = setup.make(optimizer)
    else:
        accumulator_dtype = jnp.bfloat16
        tx = setup.make(optimizer, inner=optax.trace(0.9, accumulator_dtype=accumulator_dtype))
    params = jnp.zeros(2, jnp.float32)
    state = setup.init(tx, params)
    call = jit(setup.call(tx, state))
    for x in setup.inputs(jnp.array([1.0, -2.0]), 0.5):
        updates, state = call(x, state, params)
    assert int(optax_adascale.get_adascale_state(state).count) == 1
    assert optax.tree.get(state, "trace").dtype == (accumulator_dtype or jnp.float32)
    # The updates' dtype is optax's own momentum SGD's on the same inputs.
    reference = optax.sgd(0.1, momentum=0.9, accumulator_dtype=accumulator_dtype)
    assert updates.dtype == jax.eval_shape(reference.update, params, reference.init(params), params)[0].dtype


# --------------------------------------------------------------------------- 10. float64 mixed dtypes


@optimizers
@setups
def test_mixed_float32_float64_inputs_keep_their_dtypes(optimizer, config):
    setup = Setup.of(config)
    with jax.enable_x64(True):
        tx = setup.make(optimizer)
        params = (jnp.array([1.0, 2.0], jnp.float32), jnp.array([3.0, 4.0], jnp.float64))
        grads = (jnp.array([10.0, 21.0], jnp.float32), jnp.array([33.0, 42.0], jnp.float64))
        state0 = jit(lambda p: setup.init(tx, p))(params)
        update = jit(setup.call(tx, state0, params_as_keyword=True))  # as optax's test passes them
        state = state0
        for x in setup.inputs(grads, 1.0):
            updates, state = update(x, state, params)
            assert dtypes(state) == dtypes(state0)
            assert dtypes(updates) == dtypes(params)
            assert dtypes(optax.apply_updates(params, updates)) == dtypes(params)
        assert int(optax_adascale.get_adascale_state(state).count) == 1


# --------------------------------------------------------------------------- 11. sharding


@optimizers
@setups
def test_init_accepts_abstract_params(optimizer, config):
    setup = Setup.of(config)
    tx = setup.make(optimizer)
    spec = jax.ShapeDtypeStruct((2, 4, 8), jnp.float32)
    state = tx.init(spec)
    assert state is not None
    concrete = tx.init(jnp.zeros((2, 4, 8), jnp.float32))
    assert jax.tree.structure(state) == jax.tree.structure(concrete)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == jax.tree.map(lambda x: (x.shape, x.dtype), concrete)


def jax_can_psum_over_a_vmap_axis_on_an_explicit_mesh(mesh) -> bool:
    """Whether plain JAX can ``psum`` over a vmap axis, under jit, an array sharded on an Explicit mesh axis."""
    with jax.set_mesh(mesh):
        x = jnp.zeros((REPLICAS, 2, 8, 4), jnp.float32, out_sharding=P(None, None, "x"))
        try:
            jit(jax.vmap(lambda a: lax.psum(a, "i"), axis_name="i", out_axes=None))(x)
        except ValueError:
            return False
    return True


@optimizers
@setups
@pytest.mark.filterwarnings("ignore:update got no microbatch_stats")  # no_axis on 8 devices: n = 1, as it says
def test_state_types_match_across_init_update_and_jit_on_an_explicit_mesh(optimizer, config):
    setup = Setup.of(config)
    tx = setup.make(optimizer)
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    if setup.replicas > 1 and not jax_can_psum_over_a_vmap_axis_on_an_explicit_mesh(mesh):
        pytest.skip(
            "JAX 0.10.2 cannot lower lax.psum over a vmap axis of an array sharded on an Explicit mesh axis "
            "under jit (ValueError: 'Sharding spec ... does not evenly divide'), AdaScale or not"
        )
    with jax.set_mesh(mesh):
        # A float16 leaf split over the mesh and a float32 leaf replicated on it.
        params = {
            "w": jnp.zeros((2, 8, 4), jnp.float16, out_sharding=P(None, "x")),
            "b": jnp.zeros((8,), jnp.float32, out_sharding=P()),
        }
        grads = {
            "w": jax.device_put(jnp.full((2, 8, 4), 0.5, jnp.float16), NamedSharding(mesh, P(None, "x"))),
            "b": jax.device_put(jnp.full((8,), 0.5, jnp.float32), NamedSharding(mesh, P())),
        }
        eager_init = setup.init(tx, params)
        jit_init = jit(lambda p: setup.init(tx, p))(params)
        assert types(jit_init) == types(eager_init)
        call = setup.call(tx, eager_init)
        eager_state, jit_state = eager_init, jit_init
        jit_call = jit(call)
        for x in setup.inputs(grads, 0.25):
            eager_updates, eager_state = call(x, eager_state, params)
            jit_updates, jit_state = jit_call(x, jit_state, params)
            assert types(eager_state) == types(eager_init)
            assert types(jit_state) == types(eager_state)
            assert types(jit_updates) == types(eager_updates) == types(params)
        assert int(optax_adascale.get_adascale_state(eager_state).count) == 1
        for x in setup.inputs(grads, 0.25):  # a second update from the first one's jitted output: same types
            jit_updates, jit_state = jit_call(x, jit_state, params)
            assert types(jit_state) == types(eager_init)
        assert int(optax_adascale.get_adascale_state(jit_state).count) == 2


# --------------------------------------------------------------------------- 12. mixed-precision accumulation

MIXED = {"f32": jnp.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}


@optimizers
@setups
def test_accumulation_with_mixed_precision_grads_and_params(optimizer, config):
    # After optax's MultiSteps mixed-precision check: accumulation_steps=2 against accumulation_steps=1 on the
    # same inputs, for every (grad dtype, param dtype) pair. The nine pairs are the leaves of one tree (one
    # compilation instead of nine; every leaf's dtypes are handled leaf by leaf).
    if config == "no_axis":
        pytest.skip("accumulation without an axis is the 'accumulation' configuration of this test")
    accumulating = dataclasses.replace(Setup.of(config), accumulation_steps=2)
    single = dataclasses.replace(Setup.of(config), accumulation_steps=1)
    pairs = [(g, p) for g in MIXED for p in MIXED]
    params = {f"grads_{g}-params_{p}": jnp.array([1.0, -2.0, 0.5], MIXED[p]) for g, p in pairs}
    grads = {f"grads_{g}-params_{p}": jnp.array([0.3, -1.0, 2.0], MIXED[g]) for g, p in pairs}
    tx, tx1 = accumulating.make(optimizer), single.make(optimizer)
    state1 = single.init(tx1, params)
    (x1,) = single.inputs(grads, 0.125)
    expected = dtypes(jax.eval_shape(single.call(tx1, state1), x1, state1, params)[0])
    state = accumulating.init(tx, params)
    call = jit(accumulating.call(tx, state))
    for i in range(5):
        updates, state = call(accumulating.inputs(grads, 0.125)[i % 2], state, params)
        assert dtypes(updates) == expected
        assert dtypes(optax.apply_updates(params, updates)) == dtypes(params)
        assert all(bool(jnp.all(jnp.isfinite(u.astype(jnp.float32)))) for u in jax.tree.leaves(updates))
    assert int(optax_adascale.get_adascale_state(state).count) == 2


# --------------------------------------------------------------------------- 13. complex parameters


@optimizers
@setups
def test_complex_params_at_scale_one_match_optax_sgd(optimizer, config):
    # S = 1: no axis is S = n = 1; with two samples per update, scale=1.0 sets S = 1 and identical samples
    # make their mean the gradient exactly.
    setup = Setup.of(config)
    tx = setup.make(optimizer, 0.1, **({} if config == "no_axis" else {"scale": 1.0}))
    ref = optax.sgd(0.1, momentum=0.9)
    params, _, loss = parabola(jnp.complex64)
    state, ref_state = setup.init(tx, params), ref.init(params)
    call = jit(setup.call(tx, state))
    for _ in range(5):
        grads = descent_direction(loss, params)
        for x in setup.inputs(grads):
            updates, state = call(x, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        assert updates.dtype == jnp.complex64
        np.testing.assert_allclose(updates, ref_updates, rtol=1e-6, atol=0)
        params = optax.apply_updates(params, updates)
    assert float(optax_adascale.metrics(state)["gain"]) == 1.0


@optimizers
@setups
def test_complex_gain_statistics_use_the_squared_modulus(optimizer, config):
    # Samples 1+0j and 0+1j are orthogonal (Re⟨g1, g2⟩ = 0): a = mean|g_i|² = 1, b = |ḡ|² = 1/2, so the
    # gradient is all noise: σ̂² = S/(n−1)·(a − b) = 1, μ̂² = b − σ̂²/S = 0 and the estimated gain is S = 2. Squares
    # without the modulus (g²) would give a = (1 + (−1))/2 = 0.
    setup = Setup.of(config)
    if setup.replicas * setup.accumulation_steps == 1:
        pytest.skip("one sample per update (S = 1): there is no variance to estimate and the gain is 1")
    tx = setup.make(optimizer, 0.1)
    params = jnp.zeros(1, jnp.complex64)
    state = setup.init(tx, params)
    samples = [jnp.array([1 + 0j], jnp.complex64), jnp.array([0 + 1j], jnp.complex64)]
    call = jit(setup.call(tx, state))
    if setup.replicas > 1:
        updates, state = call(jnp.stack(samples), state, params)
    else:
        for g in samples:
            updates, state = call(g, state, params)
    m = optax_adascale.metrics(state)
    if optimizer == "adascale_sgd":
        # The guarded τ clock: the first update's applied gain is min(2, 1.1 · max(1, 1)) = 1.1, and its momentum
        # buffer takes ḡ with weight (1 − 0.9^1.1)/(1 − 0.9) (1.1 base steps of the same gradient).
        gain, weight = 1.1, (1 - 0.9**1.1) / (1 - 0.9)
    else:  # optax.trace: the update clock, the estimated gain S = 2 and a first momentum step of ḡ itself
        gain, weight = 2.0, 1.0
    np.testing.assert_allclose(m["gain"], gain, rtol=1e-6)
    np.testing.assert_allclose(m["grad_var"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(m["grad_sqr"], 0.0, atol=1e-6)
    # u = −gain · lr · m, the first momentum buffer m = weight · ḡ.
    np.testing.assert_allclose(updates, -gain * 0.1 * weight * jnp.array([0.5 + 0.5j]), rtol=1e-6)


# =========================================================================== part 2: chaining, S = 1, donation


def params_tree(dtype=jnp.float32):
    return {"a": jnp.array([1.0, -2.0, 3.0], dtype), "b": {"c": jnp.array([[0.5, -0.5]], dtype)}}


def assert_same_updates(tx_a, tx_b, *, steps, rtol):
    """Train both transformations on the same single-replica gradients; updates must agree every step."""
    params = params_tree()
    s_a, s_b = tx_a.init(params), tx_b.init(params)
    for seed in range(steps):
        grads = jax.tree.map(lambda x: x[0], replica_grads(params, n=1, seed=seed))
        u_a, s_a = jax.jit(tx_a.update)(grads, s_a, params)
        u_b, s_b = jax.jit(tx_b.update)(grads, s_b, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=0), u_a, u_b)
        params = optax.apply_updates(params, u_a)
    return s_a, s_b


@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_state_leaves_are_distinct_buffers_and_donation_works(accumulation_steps):
    tx = optax_adascale.adascale_sgd(0.1, momentum=0.9, accumulation_steps=accumulation_steps, axis_name="i")
    params = params_tree()
    for state in (tx.init(params), jax.jit(tx.init)(params)):
        pointers = [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(state)]
        assert len(set(pointers)) == len(pointers)
    state = optax_adascale.replicate_buffers(jax.jit(tx.init)(params), 4)
    axes = optax_adascale.state_axes(state)
    update = jax.vmap(lambda g, s, p: tx.update(g, s, p), in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    step = jax.jit(update, donate_argnums=1)
    for seed in range(2 * accumulation_steps):
        old_leaves = jax.tree.leaves(state)
        _, state = step(replica_grads(params, seed=seed), state, params)
        assert all(leaf.is_deleted() for leaf in old_leaves)  # every state buffer was donated
    assert int(optax_adascale.get_adascale_state(state).count) == 2


@pytest.mark.parametrize("nesterov", [False, True])
def test_scale_one_is_exactly_the_inner_optimizer(nesterov):
    schedule = optax.exponential_decay(0.1, transition_steps=3, decay_rate=0.5)
    ours = optax_adascale.adascale_sgd(schedule, momentum=0.9, nesterov=nesterov, weight_decay=1e-2)
    theirs = optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(schedule, momentum=0.9, nesterov=nesterov))
    # With Nesterov the two programs fuse `g + μ·m` differently: equal to float32 rounding (a few ulps, the
    # docs' "to float32 rounding"), not bit for bit; how many ulps depends on XLA's code generation.
    s_ours, _ = assert_same_updates(ours, theirs, steps=7, rtol=4e-7 if nesterov else 1e-7)
    m = optax_adascale.metrics(s_ours)
    assert float(m["gain"]) == 1.0 and float(m["scale_invariant_steps"]) == 7.0
    assert float(m["learning_rate"]) == pytest.approx(float(schedule(6)))


def test_inject_hyperparams_with_structural_args_static():
    # Options beyond the explicit keywords (param_labels, ...) pass through inject_hyperparams untouched.
    static = ("learning_rate", "nesterov", "axis_name", "accumulation_steps", "scale", "estimator")
    injected = optax.inject_hyperparams(optax_adascale.adascale_sgd, static_args=static)(
        learning_rate=optax.linear_schedule(0.2, 0.05, 10), momentum=0.9, weight_decay=1e-3, accumulation_steps=2
    )
    plain = optax_adascale.adascale_sgd(
        optax.linear_schedule(0.2, 0.05, 10), 0.9, weight_decay=1e-3, accumulation_steps=2
    )
    s_inj, s_plain = assert_same_updates(injected, plain, steps=6, rtol=1e-6)
    np.testing.assert_allclose(
        optax_adascale.metrics(s_inj)["scale_invariant_steps"], optax_adascale.metrics(s_plain)["scale_invariant_steps"]
    )
    # The injected momentum is a live hyperparameter.
    params = params_tree()
    s_inj.hyperparams["momentum"] = jnp.asarray(0.0)
    assert injected.update(params, s_inj, params)[1].hyperparams["momentum"] == 0.0


def test_chaining_after_adascale_and_reading_state_through_the_chain():
    tx = optax.chain(optax_adascale.adascale_sgd(0.1, axis_name="i"), optax.scale(0.5))
    params = params_tree()
    state = tx.init(params)
    updates, state = replica_update(tx, jit=False)(replica_grads(params), state, params)
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    ref, ref_state = replica_update(alone, jit=False)(replica_grads(params), alone.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.5 * b, rtol=1e-6), updates, ref)
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]


def test_clipping_inside_inner_sees_the_averaged_gradient():
    lr, clip = 0.1, 0.5
    tx = optax_adascale.adascale(optax.chain(optax.clip_by_global_norm(clip), optax.trace(0.9)), lr, axis_name="i")
    params = params_tree()
    grads = replica_grads(params)
    updates, state = replica_update(tx, jit=False)(grads, tx.init(params), params)
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    clipped = jax.tree.map(lambda g: g * clip / optax.tree.norm(mean), mean)
    gain = optax_adascale.metrics(state)["gain"]
    jax.tree.map(lambda u, c: np.testing.assert_allclose(u, -gain * lr * c, rtol=1e-5), updates, clipped)
    assert float(optax.tree.norm(updates)) == pytest.approx(float(gain) * lr * clip, rel=1e-5)


def test_clipping_chained_before_adascale_sees_per_replica_gradients():
    # Documented pitfall: a transformation before AdaScale clips each replica's gradient, which
    # changes the samples AdaScale estimates the variance from.
    clip = 0.5
    before = optax.chain(optax.clip_by_global_norm(clip), optax_adascale.adascale_sgd(0.1, axis_name="i"))
    params = params_tree()
    grads = replica_grads(params)
    _, state = replica_update(before, jit=False)(grads, before.init(params), params)

    per_replica_clipped = jax.vmap(lambda g: optax.clip_by_global_norm(clip).update(g, None)[0])(grads)
    alone = optax_adascale.adascale_sgd(0.1, axis_name="i")
    _, ref_state = replica_update(alone, jit=False)(per_replica_clipped, alone.init(params), params)
    _, unclipped_state = replica_update(alone, jit=False)(grads, alone.init(params), params)
    assert optax_adascale.metrics(state)["gain"] == optax_adascale.metrics(ref_state)["gain"]
    assert optax_adascale.metrics(state)["grad_sqr"] != optax_adascale.metrics(unclipped_state)["grad_sqr"]


def test_apply_if_finite_inside_inner_is_harmless_and_superseded_by_the_skip():
    tx = optax_adascale.adascale(optax.apply_if_finite(optax.trace(0.9), 3), 0.1, axis_name="i")
    params = params_tree()
    state = tx.init(params)
    _, state = replica_update(tx, jit=False)(replica_grads(params, seed=0), state, params)
    bad = replica_grads(params, seed=1)
    bad["a"] = bad["a"].at[0, 0].set(jnp.nan)
    updates, after = replica_update(tx, jit=False)(bad, state, params)
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    # AdaScale skipped the step and kept the inner state, apply_if_finite's counters included.
    assert int(after.skipped_steps) == 1 and int(after.inner_state.total_notfinite) == 0


@pytest.mark.parametrize("wrap", ["gradient_transformation", "multisteps_object"])
def test_multisteps_inside_inner_is_rejected_at_init_and_accumulation_steps_is_the_fix(wrap):
    # With optax.MultiSteps inside `inner` every call would be an AdaScale update, so τ would advance on
    # every call although the parameters move every k-th call. We refuse it; accumulation_steps=k is the
    # right tool: one update, one gain, per k calls.
    params = params_tree()
    multi = optax.MultiSteps(optax.trace(0.9), 2)
    wrong = optax_adascale.adascale(
        multi.gradient_transformation() if wrap == "gradient_transformation" else multi, 0.1, axis_name="i"
    )
    with pytest.raises(ValueError, match=r"optax.MultiSteps.*accumulation_steps=k"):
        wrong.init(params)
    right = optax_adascale.adascale(optax.trace(0.9), 0.1, axis_name="i", accumulation_steps=2)
    s_right = optax_adascale.replicate_buffers(right.init(params), 4)
    axes = optax_adascale.state_axes(s_right)
    step_right = jax.vmap(right.update, in_axes=(0, axes, None), out_axes=(None, axes), axis_name="i")
    for seed in range(2):
        _, s_right = step_right(replica_grads(params, seed=seed), s_right, params)
    assert int(optax_adascale.get_adascale_state(s_right).count) == 1
    assert float(optax_adascale.metrics(s_right)["scale"]) == 8.0  # 4 replicas × 2 calls
