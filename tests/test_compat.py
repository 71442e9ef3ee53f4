"""A test per read of JAX internals in ``optax_adascale._compat``: each fails where a JAX release moves what it
reads, on every JAX the suite runs on (CI: the oldest and the newest supported)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat


def test_literal_type_is_the_class_of_a_literal_operand():
    jaxpr = jax.make_jaxpr(lambda x: x * 2.0)(1.0).jaxpr
    assert any(isinstance(v, _compat.literal_type()) for eqn in jaxpr.eqns for v in eqn.invars)


def test_scan_counts_reads_the_consts_and_carries_of_a_scan_equation():
    w = jnp.ones(3)

    def f(c1, c2, xs):
        return jax.lax.scan(lambda c, x: ((c[0] + x * w, c[1] * 2.0), x), (c1, c2), xs)

    jaxpr = jax.make_jaxpr(f)(jnp.zeros(3), 1.0, jnp.ones((4, 3))).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert _compat.scan_counts(eqn.params) == (1, 2)  # w closed over; two carries (both change: not forwarded)


def test_shard_map_manual_axes_are_the_axes_the_equation_makes_manual():
    mesh = jax.make_mesh((2, 2), ("data", "stage"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):

        def f(x):
            return jax.shard_map(lambda b: b * 2, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"})(x)

        x = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, P("stage")))
        jaxpr = jax.make_jaxpr(f)(x).jaxpr
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert _compat.shard_map_manual_axes(eqn.params) == frozenset({"stage"})


def test_legacy_mesh_sees_the_old_with_mesh_form_only():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    assert _compat.legacy_mesh() is None
    with mesh:
        assert _compat.legacy_mesh().shape == mesh.shape
    with jax.set_mesh(mesh):
        assert _compat.legacy_mesh() is None


def test_named_axis_sizes_are_the_axes_bound_by_vmap():
    assert _compat.named_axis_sizes() == {}
    seen = []
    jax.vmap(lambda x: seen.append(_compat.named_axis_sizes()) or x, axis_name="i")(jnp.ones(3))
    assert seen == [{"i": 3}]


def test_varying_axes_is_shard_maps_varying_type():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # Auto axes: the inputs need no placing
    seen = []

    def body(w, v):
        seen.append((_compat.varying_axes(w), _compat.varying_axes(jax.lax.pcast(w, "x", to="varying") * v)))
        return v

    jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))(jnp.ones(2), jnp.ones(2))
    assert seen == [(frozenset(), frozenset({"x"}))]


def test_vma_checks_off_stops_shard_map_tracking_varying_types():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))  # Auto axes: the inputs need no placing
    seen = []

    def body(v):
        with _compat.vma_checks_off():
            seen.append(_compat.varying_axes(v * 2))
        seen.append(_compat.varying_axes(v * 2))
        return v

    jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.ones(2))
    assert seen == [frozenset(), frozenset({"x"})]


def test_batch_trace_axes_name_the_vmap_axes_a_value_is_batched_over():
    seen = []

    def inner(x):
        seen.append([getattr(d, "name", None) for d in _compat.batch_trace_axes(x)])
        return x

    jax.vmap(jax.vmap(inner, axis_name="j"), axis_name="i")(jnp.ones((2, 3)))
    assert seen == [["j", "i"]]
    assert _compat.batch_trace_axes(jnp.ones(2)) == []


def _custom_call(kind):
    """A custom_jvp / custom_vjp function whose rule is not its derivative (7 × the cotangent), and its equation."""
    if kind == "custom_jvp":

        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)

        f.defjvp(lambda primals, tangents: (jnp.sin(primals[0]), 7.0 * tangents[0]))
    else:

        @jax.custom_vjp
        def f(x):
            return jnp.sin(x)

        f.defvjp(lambda x: (jnp.sin(x), None), lambda _, g: (7.0 * g,))
    closed = jax.make_jaxpr(f)(0.5)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name.startswith("custom_")]
    return eqn


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_custom_call_reads_the_parts_jaxs_own_bind_functions_are_made_of(kind):
    eqn = _custom_call(kind)
    call = _compat.custom_call(eqn)
    assert call.jvp == (kind == "custom_jvp")
    assert call.num_consts == 0
    assert [e.primitive.name for e in call.body[0].eqns] == ["sin"]
    assert len(call.subfuns) == (2 if call.jvp else 3)
    # JAX's own bind functions, re-bound through bind(subfuns=): the value and the rule
    value, grad = jax.value_and_grad(lambda x: _compat.bind(eqn, [x], context=False, subfuns=call.subfuns)[0])(0.5)
    assert float(value) == pytest.approx(np.sin(0.5))
    assert float(grad) == pytest.approx(7.0)


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_custom_call_rebinds_through_an_evaluator_with_its_rule(kind):
    """The drop-in's re-binding of a custom call (gspmd/_custom.rebound) on this JAX's lifted functions: symbolic
    zeros, wrapped functions, the custom_vjp forward pass's flags."""
    from optax_adascale.gspmd import _custom

    eqn = _custom_call(kind)
    evaluated = []

    def evaluate(jaxpr, consts, args):
        evaluated.append(jaxpr)
        return jax.core.eval_jaxpr(jaxpr, consts, *args)

    bound = _custom.rebound(eqn, evaluate)
    value, grad = jax.value_and_grad(lambda x: bound(x)[0])(0.5)
    assert float(value) == pytest.approx(np.sin(0.5))
    assert float(grad) == pytest.approx(7.0)  # the rule survived
    assert evaluated  # the traced jaxprs ran through the evaluator


def test_symbolic_zeros_and_zero_cotangents_are_jaxs():
    zero = _compat.symbolic_zero_of(jnp.ones((2, 3)))
    assert _compat.is_symbolic_zero(zero) and not _compat.is_symbolic_zero(jnp.zeros(2))
    assert _compat.symbolic_zero_type(zero).shape == (2, 3)
    ct = _compat.zero_cotangent(jax.typeof(jnp.ones(3)))
    assert _compat.is_zero_cotangent(ct) and not _compat.is_zero_cotangent(jnp.zeros(3))
    assert isinstance(_compat.custom_vjp_error(), Exception)
    wrapped = _compat.wrap_fun(lambda x: [x * 2], like=_compat.custom_call(_custom_call("custom_jvp")).subfuns[0])
    assert wrapped.call_wrapped(3.0) == [6.0]


def test_an_equations_own_fields_and_the_backward_walk():
    jaxpr = jax.make_jaxpr(lambda x, y: (jnp.sin(x) * y, jax.lax.sort((x, y), num_keys=1)))(jnp.ones(3), jnp.ones(3))
    sin, mul, sort = jaxpr.jaxpr.eqns
    assert [_compat.primitive_name(e) for e in (sin, mul, sort)] == ["sin", "mul", "sort"]
    assert _compat.inputs(mul) == [_compat.outputs(sin)[0], jaxpr.jaxpr.invars[1]]
    assert _compat.multiple_results(sort) and not _compat.multiple_results(sin)
    assert _compat.traced_type(_compat.outputs(mul)[0]).shape == (3,)
    # which outputs each input reaches, from the last equation back
    seen = []

    def rule(eqn, outs):
        seen.append(_compat.primitive_name(eqn))
        return [frozenset().union(*outs)] * len(_compat.inputs(eqn))

    facts = [frozenset({i}) for i in range(3)]
    reached = _compat.walk_back(jaxpr.jaxpr, facts, rule, join=frozenset.union, empty=frozenset())
    assert seen == ["sort", "mul", "sin"]
    assert reached == [frozenset({0, 1, 2}), frozenset({0, 1, 2})]


# --------------------------------------------------------------------------- core reads


def test_is_tracer_tells_a_traced_value_from_a_concrete_one():
    seen = []
    jax.jit(lambda x: seen.append(_compat.is_tracer(x)) or x)(1.0)
    jax.vmap(lambda x: seen.append(_compat.is_tracer(x)) or x)(jnp.ones(2))
    jax.grad(lambda x: seen.append(_compat.is_tracer(x)) or x)(1.0)
    assert seen == [True, True, True]
    assert not any(_compat.is_tracer(v) for v in (1.0, np.float32(1.0), jnp.ones(2), None, "x"))


# --------------------------------------------------------------------------- the jaxpr facade (gspmd)


def _eqn(f, *args, name=None):
    """The first equation of ``jax.make_jaxpr(f)(*args)`` binding ``name``, in calls too (the last one if ``name`` is
    None)."""
    eqns = jax.make_jaxpr(f)(*args).jaxpr.eqns
    if name is None:
        return eqns[-1]
    while eqns:
        found = [e for e in eqns if e.primitive.name == name]
        if found:
            return found[0]
        eqns = [e for eqn in eqns for jaxpr, _ in _compat.sub_jaxprs(eqn) for e in jaxpr.eqns]
    raise LookupError(name)


def test_closed_and_open_jaxprs_round_trip_with_their_consts():
    w = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda x: x * w)(jnp.ones(3))
    jaxpr, consts = _compat.open_jaxpr(closed)
    again = _compat.closed_jaxpr(jaxpr, [3 * c for c in consts])  # the same jaxpr over other consts
    (out,) = jax.core.eval_jaxpr(*_compat.open_jaxpr(again), jnp.full(3, 2.0))
    np.testing.assert_array_equal(out, 6.0 * np.arange(3.0))
    remat = _eqn(jax.checkpoint(lambda x: jnp.sin(x)), 1.0)  # an open jaxpr in the equation: no consts
    assert _compat.open_jaxpr(remat.params["jaxpr"])[1] == []


def test_walk_runs_a_rule_per_equation_with_literals_and_consts_read():
    w = jnp.float32(3.0)
    closed = jax.make_jaxpr(lambda x: jnp.sin(x * 2.0) + w)(1.0)
    jaxpr, consts = _compat.open_jaxpr(closed)
    seen = []

    def rule(eqn, ins):
        seen.append(eqn.primitive.name)
        return [_compat.bind(eqn, ins)]

    (out,) = _compat.walk(jaxpr, consts, [0.5], rule)
    assert float(out) == pytest.approx(np.sin(1.0) + 3.0)
    assert seen == [e.primitive.name for e in jaxpr.eqns]
    # facts in place of values: which outputs depend on the input (a literal depends on nothing)
    facts = _compat.walk(jaxpr, [False] * len(consts), [True], lambda e, ins: [any(ins)], literal=lambda _: False)
    assert facts == [True]


def test_walk_named_keeps_the_users_named_scopes_in_the_lowered_program():
    def scoped(a):
        with jax.named_scope("kept_by_walk"):
            return jnp.sin(a)

    jaxpr, consts = _compat.open_jaxpr(jax.make_jaxpr(scoped)(1.0))
    again = lambda a, named: _compat.walk(jaxpr, consts, [a], lambda e, ins: [_compat.bind(e, ins)], named=named)  # noqa: E731
    assert "kept_by_walk" in jax.jit(lambda a: again(a, True)).lower(1.0).as_text(debug_info=True)
    assert "kept_by_walk" not in jax.jit(lambda a: again(a, False)).lower(1.0).as_text(debug_info=True)


def test_is_literal_is_true_of_literal_operands_only():
    eqn = _eqn(lambda x: x * 2.0, 1.0)
    assert [_compat.is_literal(v) for v in eqn.invars] == [False, True]


def test_bind_rebinds_an_equation_with_its_own_or_changed_parameters():
    eqn = _eqn(lambda x: jnp.sum(x, axis=0), jnp.ones((2, 3)), name="reduce_sum")
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(_compat.bind(eqn, [x]), x.sum(0))
    np.testing.assert_array_equal(_compat.bind(eqn, [x], _compat.with_params(eqn, axes=(1,))), x.sum(1))
    cast = _eqn(lambda x: x.astype(jnp.bfloat16), jnp.ones(2), name="convert_element_type")
    assert _compat.bind(cast, [x], context=False, drop=lambda v: v is None).dtype == jnp.bfloat16


def test_sub_jaxprs_and_body_are_the_jaxprs_an_equation_carries():
    cond = _eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, name="cond")
    assert len(_compat.sub_jaxprs(cond)) == 2
    call = _eqn(lambda x: jax.jit(jnp.sin)(x), 1.0, name="jit")
    jaxpr, _ = _compat.body(call)
    assert [e.primitive.name for e in jaxpr.eqns] == ["sin"]
    custom = _eqn(jax.nn.relu, 1.0, name="custom_jvp_call")
    assert _compat.body(custom)[0].eqns


def test_scan_params_are_its_counts_and_options():
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c + x, x), c, xs, reverse=True, unroll=2)

    eqn = _eqn(f, 0.0, jnp.ones(4), name="scan")
    assert _compat.scan_params(eqn) == (0, 1, 4, True, 2)


def test_while_params_split_the_operands_between_cond_and_body():
    def f(bound, step, x):
        return jax.lax.while_loop(lambda c: c < bound, lambda c: c + step, x)

    eqn = _eqn(f, 5.0, 1.0, 0.0, name="while")
    cn, bn, (cond, _), (body, _) = _compat.while_params(eqn)
    assert (cn, bn) == (1, 1)
    assert len(cond.invars) == cn + 1 and len(body.invars) == bn + 1
    assert [v.aval.shape for v in eqn.invars] == [(), (), ()]


def test_cond_branches_take_the_operands_after_the_index():
    eqn = _eqn(
        lambda i, x, y: jax.lax.switch(i, [lambda a, b: a, lambda a, b: b, lambda a, b: a * b], x, y), 0, 1.0, 2.0
    )
    branches = _compat.cond_branches(eqn)
    assert len(branches) == 3 and all(len(b.invars) == len(eqn.invars) - 1 for b, _ in branches)


def test_remat_options_are_the_checkpoints():
    policy = jax.checkpoint_policies.nothing_saveable
    eqn = _eqn(jax.checkpoint(jnp.sin, prevent_cse=False, policy=policy), 1.0, name="remat2")
    assert _compat.remat_options(eqn) == (False, policy)


def test_shard_map_params_are_its_mesh_specs_and_manual_axes():
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
        f = jax.shard_map(lambda b: b * 2, in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
        eqn = _eqn(f, x, name="shard_map")
    sm = _compat.shard_map_params(eqn)
    assert (sm.in_specs, sm.out_specs, sm.manual_axes, sm.check_vma) == ((P("data"),), (P("data"),), {"data"}, True)
    assert tuple(sm.mesh.axis_names) == ("data", "model")
    assert _compat.body(eqn)[0].eqns


def test_target_and_out_shardings_are_where_equations_put_their_results():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data")))
        reshard = _eqn(lambda a: jax.reshard(a, P()), x, name="reshard")
        dot = _eqn(lambda a: jnp.einsum("bd,be->de", a, a, out_sharding=P()), x, name="dot_general")
    auto = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # Auto axes: a constraint is a hint
    hint = _eqn(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(auto, P("data"))), jnp.ones(4))
    assert tuple(_compat.target_sharding(reshard).spec) in [(), (None, None)]
    assert _compat.target_sharding(hint).spec == P("data")
    key, sharding = _compat.out_sharding(dot)
    assert key == "out_sharding" and tuple(sharding.spec) in [(), (None, None)]
    assert _compat.out_sharding(_eqn(jnp.sin, 1.0)) is None


def test_contraction_dims_are_a_dot_generals_dimension_numbers():
    eqn = _eqn(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))
    assert _compat.contraction_dims(eqn) == (((2,), (1,)), ((0,), (0,)))


@pytest.mark.parametrize(
    ("f", "name", "expected"),
    [
        (lambda x: jnp.cumsum(x, axis=1), "cumsum", (1,)),
        (lambda x: jnp.sort(x, axis=0), "sort", (0,)),
        (lambda x: jax.lax.top_k(x, 2)[0], "top_k", (1,)),
        (lambda x: jax.lax.rev(x, (0, 1)), "rev", (0, 1)),
        (lambda x: jnp.concatenate([x, x], axis=1), "concatenate", (1,)),
        (lambda x: jnp.split(x, 2, axis=1), "split", (1,)),
        (lambda x: jnp.unstack(x, axis=0), "unstack", (0,)),
        (lambda x: jnp.stack([x, x], axis=0), "stack", ()),
        (lambda x: jax.lax.approx_max_k(x, 2)[0], "approx_top_k", (1,)),
        (lambda x: jnp.fft.fft(x), "fft", (1,)),
        (lambda x: jnp.fft.fft2(x), "fft", (0, 1)),
    ],
)
def test_along_dims_are_the_dimensions_an_operation_works_along(f, name, expected):
    assert _compat.along_dims(_eqn(f, jnp.ones((3, 4)), name=name), 2) == expected


def test_reduced_padded_offset_and_batch_dims_are_read_from_their_equations():
    assert _compat.reduced_dims(_eqn(lambda x: jnp.max(x, axis=1), jnp.ones((2, 3)), name="reduce_max")) == (1,)
    assert _compat.padded_dims(_eqn(lambda x: jax.lax.pad(x, 0.0, [(0, 0, 0), (1, 2, 0)]), jnp.ones((2, 3)))) == (1,)
    gather = _eqn(lambda t, i: t[i], jnp.ones((5, 3)), jnp.zeros(4, jnp.int32), name="gather")
    assert _compat.gather_dims(gather) == ((1,), (0,))
    conv = _eqn(
        lambda x, k: jax.lax.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
        jnp.ones((2, 8, 3)),
        jnp.ones((3, 3, 4)),
    )
    assert _compat.conv_batch(conv) == (0, 0, 1)


def test_a_triangular_solves_side_and_a_ragged_dots_dimensions_are_read_from_their_equations():
    from jax.scipy.linalg import solve_triangular

    a, b = jnp.eye(3), jnp.ones((3, 5))
    assert _compat.solves_left(_eqn(lambda a, b: solve_triangular(a, b, lower=True), a, b, name="triangular_solve"))
    right = _eqn(lambda a, b: jax.lax.linalg.triangular_solve(a, b, left_side=False), a, b.T, name="triangular_solve")
    assert not _compat.solves_left(right)
    ragged = _eqn(
        jax.lax.ragged_dot,
        jnp.ones((8, 4)),
        jnp.ones((2, 4, 3)),
        jnp.array([3, 5], jnp.int32),
        name="ragged_dot_general",
    )
    assert _compat.ragged_dims(ragged) == _compat.Ragged(
        ragged=0, contracting=(1,), batch=(), rhs_free=(2,), offset=False
    )


def test_cast_axes_are_the_axes_pvary_makes_a_value_vary_over():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    f = jax.shard_map(lambda w: jax.lax.pcast(w, "x", to="varying"), mesh=mesh, in_specs=P(), out_specs=P("x"))
    body, _ = _compat.body(_eqn(f, jnp.ones(2), name="shard_map"))
    (eqn,) = [e for e in body.eqns if e.primitive.name == "pvary"]
    assert _compat.cast_axes(eqn) == ("x",)


def test_binds_on_reduced_says_whether_jaxs_reshape_takes_an_operand_typed_reduced():
    # A tensor-parallel bias (split over model, its copy reduced over data) reshaped to a row, as Flax NNX's Linear.
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])

    def row(b):
        return jnp.reshape(jax.reshard(b, P("model", reduced={"data"})), (1, -1))

    with jax.set_mesh(mesh):
        b = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("model")))
        if _compat.binds_on_reduced("reshape"):
            assert jax.jit(row).trace(b).jaxpr is not None
        else:
            with pytest.raises(ValueError, match="non-empty unreduced/reduced"):
                jax.jit(row).trace(b)
    assert _compat.binds_on_reduced("transpose")


def test_sharding_type_error_is_what_jax_raises_for_a_reshape_its_explicit_types_refuse():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((4, 3)), NamedSharding(mesh, P("data")))
        with pytest.raises(_compat.sharding_type_error(), match="reshape is not supported"):
            jax.jit(lambda x: x.T.reshape(-1)).trace(x)


def test_untested_jax_is_a_release_newer_than_the_newest_tested(monkeypatch):
    assert _compat.untested_jax() is None or tuple(jax.__version_info__[:3]) > _compat.NEWEST_TESTED_JAX
    monkeypatch.setattr(jax, "__version_info__", (*_compat.NEWEST_TESTED_JAX[:2], _compat.NEWEST_TESTED_JAX[2] + 1))
    monkeypatch.setattr(jax, "__version__", "9.9.9")
    assert _compat.untested_jax() == "9.9.9"
    monkeypatch.setattr(jax, "__version_info__", _compat.NEWEST_TESTED_JAX)
    assert _compat.untested_jax() is None


def test_primitives_in_lists_the_primitives_of_nested_jaxprs():
    def f(x):
        y = jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, length=2)[0]
        return jax.jit(lambda z: z @ z)(y)

    names = _compat.primitives_in(jax.make_jaxpr(f)(jnp.ones((2, 2))).jaxpr)
    assert {"scan", "sin", "dot_general"} <= names
