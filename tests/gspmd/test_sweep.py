"""Every primitive JAX's public differentiable functions bind, applied to a parameter, is in the drop-in's table
(``optax_adascale/gspmd/_table.py``) or refused there with a reason (``_table.REFUSED``), on the JAX that runs this.

The functions are found, not listed: every public callable of ``jax.numpy``, ``jax.numpy.linalg``, ``jax.numpy.fft``,
``jax.nn``, ``jax.lax`` and ``jax.lax.linalg`` is called on a parameter, by the first generic call that traces (a
matrix, a vector, two or three of them, an axis, ...) or by its own call below; the primitives it binds are read off
``jax.make_jaxpr`` of the function and of ``jax.value_and_grad`` of a scalar of it (its backward pass: what a custom
rule's backward pass re-evaluated per copy binds), tracing only, nothing compiled. A function that no call fits and
no reason skips fails the test: a new JAX function is seen, not missed.
"""

import inspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_adascale import _compat
from optax_adascale.gspmd import _table

MODULES = ("jax.numpy", "jax.numpy.linalg", "jax.numpy.fft", "jax.nn", "jax.lax", "jax.lax.linalg")

W = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)  # the parameter (its values never matter: traced)
I4 = np.array([0, 2, 1, 3], np.int32)

GENERIC = (  # tried in order: the first that traces is the function's call
    lambda f, w: f(w),
    lambda f, w: f(w, w),
    lambda f, w: f(w, w, w),
    lambda f, w: f(w, 1),
    lambda f, w: f(w, (0,)),
    lambda f, w: f(w, I4),
    lambda f, w: f(w, 0, 1),
    lambda f, w: f(w, 0.5),
    lambda f, w: f(w, (2, 8)),
    lambda f, w: f(w, (1, 0)),
    lambda f, w: f(w, jnp.float32),
    lambda f, w: f(w[0]),
    lambda f, w: f(w[0], w[0]),
    lambda f, w: f(w[0], w[0], w[0]),
    lambda f, w: f([w, w], 0),
)

lax = jax.lax
_DN = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_SDN = lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
_IDX = I4[:2, None]
_CONV = ("NCH", "OIH", "NCH")

CALLS = {  # functions no generic call fits: how each is applied to the parameter
    "jax.numpy.einsum": lambda w: jnp.einsum("ij,jk->ik", w, w),
    "jax.numpy.broadcast_to": lambda w: jnp.broadcast_to(w, (2, 4, 4)),
    "jax.numpy.reshape": lambda w: jnp.reshape(w, (16,)),
    "jax.numpy.take_along_axis": lambda w: jnp.take_along_axis(w, jnp.argsort(w, axis=1), axis=1),
    "jax.numpy.put_along_axis": lambda w: jnp.put_along_axis(w, I4[:, None], w[:, :1], axis=1, inplace=False),
    "jax.numpy.put": lambda w: jnp.put(w, I4, w[0], inplace=False),
    "jax.numpy.fill_diagonal": lambda w: jnp.fill_diagonal(w, w[0], inplace=False),
    "jax.numpy.choose": lambda w: jnp.choose(I4 % 2, [w[0], w[1]], mode="wrap"),
    "jax.numpy.compress": lambda w: jnp.compress(np.array([True, False, True, True]), w, axis=0, size=3),
    "jax.numpy.extract": lambda w: jnp.extract(w > 0, w, size=4),
    "jax.numpy.cross": lambda w: jnp.cross(w[:, :3], w[:, 1:]),
    "jax.numpy.linalg.cross": lambda w: jnp.linalg.cross(w[:, :3], w[:, 1:]),
    "jax.numpy.linalg.multi_dot": lambda w: jnp.linalg.multi_dot([w, w, w]),
    "jax.numpy.linalg.outer": lambda w: jnp.linalg.outer(w[0], w[1]),
    "jax.numpy.cumulative_sum": lambda w: jnp.cumulative_sum(w, axis=0),
    "jax.numpy.cumulative_prod": lambda w: jnp.cumulative_prod(w, axis=0),
    "jax.numpy.dsplit": lambda w: jnp.dsplit(w[None], 2),
    "jax.numpy.permute_dims": lambda w: jnp.permute_dims(w, (1, 0)),
    "jax.numpy.quantile": lambda w: jnp.quantile(w, 0.5),
    "jax.numpy.nanquantile": lambda w: jnp.nanquantile(w, 0.5),
    "jax.numpy.interp": lambda w: jnp.interp(w[0], jnp.sort(w[1]), w[2]),
    "jax.numpy.searchsorted": lambda w: jnp.searchsorted(jnp.sort(w[0]), w[1]),
    "jax.numpy.convolve": lambda w: jnp.convolve(w[0], w[1]),
    "jax.numpy.correlate": lambda w: jnp.correlate(w[0], w[1]),
    "jax.numpy.polyder": lambda w: jnp.polyder(w[0]),
    "jax.numpy.polymul": lambda w: jnp.polymul(w[0], w[1]),
    "jax.numpy.polydiv": lambda w: jnp.polydiv(w[0], w[1] + 2.0),
    "jax.numpy.polyfit": lambda w: jnp.polyfit(w[0], w[1], 2),
    "jax.numpy.roots": lambda w: jnp.roots(w[0], strip_zeros=False),
    "jax.numpy.vander": lambda w: jnp.vander(w[0]),
    "jax.numpy.unique": lambda w: jnp.unique(w, size=4),
    "jax.numpy.apply_along_axis": lambda w: jnp.apply_along_axis(jnp.sum, 0, w),
    "jax.numpy.apply_over_axes": lambda w: jnp.apply_over_axes(jnp.sum, w, [0]),
    "jax.numpy.vectorize": lambda w: jnp.vectorize(jnp.sin)(w),
    "jax.numpy.piecewise": lambda w: jnp.piecewise(w, [w > 0], [jnp.sin, jnp.cos]),
    "jax.numpy.astype": lambda w: jnp.astype(w, jnp.bfloat16),
    "jax.lax.argmax": lambda w: lax.argmax(w, 0, np.int32),
    "jax.lax.argmin": lambda w: lax.argmin(w, 0, np.int32),
    "jax.lax.broadcast_in_dim": lambda w: lax.broadcast_in_dim(w, (2, 4, 4), (1, 2)),
    "jax.lax.concatenate": lambda w: lax.concatenate([w, w], 0),
    "jax.lax.convert_element_type": lambda w: lax.convert_element_type(w, jnp.bfloat16),
    "jax.lax.real": lambda w: lax.real(lax.complex(w, w)),
    "jax.lax.imag": lambda w: lax.imag(lax.complex(w, w)),
    "jax.lax.fft": lambda w: lax.fft(w.astype(jnp.complex64), "FFT", (4,)),
    "jax.lax.dot_general": lambda w: lax.dot_general(w, w, (((1,), (0,)), ((), ()))),
    "jax.lax.ragged_dot": lambda w: lax.ragged_dot(w, jnp.stack([w, w]), np.array([1, 3], np.int32)),
    "jax.lax.ragged_dot_general": lambda w: lax.ragged_dot_general(
        w,
        jnp.stack([w, w]),
        np.array([1, 3], np.int32),
        lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,)),
    ),
    "jax.lax.conv": lambda w: lax.conv(w[None, None], w[None, None, :2, :2], (1, 1), "SAME"),
    "jax.lax.conv_general_dilated": lambda w: lax.conv_general_dilated(
        w[None], w[None, :, :2], (1,), "SAME", dimension_numbers=_CONV
    ),
    "jax.lax.conv_with_general_padding": lambda w: lax.conv_with_general_padding(
        w[None, None], w[None, None, :2, :2], (1, 1), ((0, 0), (0, 0)), None, None
    ),
    "jax.lax.conv_transpose": lambda w: lax.conv_transpose(
        w[None], w[None, :, :2], (1,), "SAME", dimension_numbers=_CONV
    ),
    "jax.lax.conv_general_dilated_local": lambda w: lax.conv_general_dilated_local(
        w[None, None], jnp.broadcast_to(w, (1, 4, 4, 4)), (1, 1), "SAME", (2, 2)
    ),
    "jax.lax.conv_general_dilated_patches": lambda w: lax.conv_general_dilated_patches(
        w[None, None], (2, 2), (1, 1), "SAME"
    ),
    "jax.lax.reduce_window": lambda w: lax.reduce_window(w, 0.0, lax.add, (2, 2), (1, 1), "VALID"),
    "jax.lax.reduce": lambda w: lax.reduce(w, 0.0, lax.add, (0,)),
    "jax.lax.reduce_and": lambda w: lax.reduce_and(w > 0, (0,)),
    "jax.lax.reduce_or": lambda w: lax.reduce_or(w > 0, (0,)),
    "jax.lax.reduce_xor": lambda w: lax.reduce_xor(w > 0, (0,)),
    "jax.lax.reduce_precision": lambda w: lax.reduce_precision(w, 5, 10),
    "jax.lax.gather": lambda w: lax.gather(w, _IDX, _DN, (1, 4)),
    "jax.lax.index_take": lambda w: lax.index_take(w, (I4,), (0,)),
    "jax.lax.scatter": lambda w: lax.scatter(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_add": lambda w: lax.scatter_add(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_sub": lambda w: lax.scatter_sub(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_mul": lambda w: lax.scatter_mul(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_min": lambda w: lax.scatter_min(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_max": lambda w: lax.scatter_max(w, _IDX, w[:2], _SDN),
    "jax.lax.scatter_apply": lambda w: lax.scatter_apply(w, _IDX, jnp.sin, _SDN, update_shape=(2, 4)),
    "jax.lax.dynamic_slice": lambda w: lax.dynamic_slice(w, (1, 0), (2, 4)),
    "jax.lax.dynamic_update_slice": lambda w: lax.dynamic_update_slice(w, w[:2], (1, 0)),
    "jax.lax.dynamic_update_slice_in_dim": lambda w: lax.dynamic_update_slice_in_dim(w, w[:2], 1, 0),
    "jax.lax.dynamic_update_index_in_dim": lambda w: lax.dynamic_update_index_in_dim(w, w[0], 1, 0),
    "jax.lax.pad": lambda w: lax.pad(w, 0.0, ((1, 1, 0), (0, 0, 1))),
    "jax.lax.select": lambda w: lax.select(w > 0, w, -w),
    "jax.lax.select_n": lambda w: lax.select_n(w > 0, w, -w),
    "jax.lax.slice": lambda w: lax.slice(w, (0, 0), (2, 4)),
    "jax.lax.split": lambda w: lax.split(w, (1, 3), axis=1),
    "jax.lax.squeeze": lambda w: lax.squeeze(w[None], (0,)),
    "jax.lax.tile": lambda w: lax.tile(w, (2, 1)),
    "jax.lax.transpose": lambda w: lax.transpose(w, (1, 0)),
    "jax.lax.cond": lambda w: lax.cond(True, jnp.sin, jnp.cos, w),
    "jax.lax.switch": lambda w: lax.switch(1, [jnp.sin, jnp.cos], w),
    "jax.lax.fori_loop": lambda w: lax.fori_loop(0, 2, lambda i, v: jnp.sin(v), w),
    "jax.lax.while_loop": lambda w: lax.while_loop(lambda v: v[0, 0] < 0, jnp.sin, lax.stop_gradient(w)) + w,
    "jax.lax.scan": lambda w: lax.scan(lambda c, x: (c * x, c), w[0], w)[0],
    "jax.lax.map": lambda w: lax.map(jnp.sin, w),
    "jax.lax.associative_scan": lambda w: lax.associative_scan(jnp.add, w),
    "jax.lax.custom_root": lambda w: lax.custom_root(
        lambda x: x - w, w, lambda f, x0: x0, lambda g, y: y, has_aux=False
    ),
    "jax.lax.custom_linear_solve": lambda w: lax.custom_linear_solve(lambda x: w @ x, w[0], lambda mv, b: b),
    "jax.lax.linalg.cholesky_update": lambda w: lax.linalg.cholesky_update(jnp.triu(w) + 4 * jnp.eye(4), w[0]),
    "jax.lax.linalg.householder_product": lambda w: lax.linalg.householder_product(w, w[0, :3]),
    "jax.lax.linalg.tridiagonal_solve": lambda w: lax.linalg.tridiagonal_solve(w[0], w[1] + 4.0, w[2], w),
    "jax.lax.linalg.ormqr": lambda w: lax.linalg.ormqr(w, w[0, :3], w),
    "jax.lax.linalg.lu_pivots_to_permutation": lambda w: lax.linalg.lu_pivots_to_permutation(I4, 4),
}

NO_PARAMETER = "creates an array from shapes, scalars or files: no parameter goes in"
INTEGER = "integers or booleans only: no gradient flows through it"
DATA_SHAPE = "its output's shape depends on the values: not traceable in a jit (nor in the drop-in) without size="
HOST = "a host-side helper (dtypes, shapes, printing, dimension numbers): binds nothing"
COLLECTIVE = (
    "a collective over a named axis (shard_map, pmap): its primitive is in the table (OPAQUE) where it is bound"
)
SHARDING = "a sharding annotation: its primitive (sharding_constraint) is in the table (HINT)"
GPU = "a block-scaled matmul for GPUs (cuDNN): no CPU lowering to trace against"

SKIP = {
    NO_PARAMETER: "jax.numpy.arange jax.numpy.empty jax.numpy.eye jax.numpy.full jax.numpy.identity jax.numpy.indices "
    "jax.numpy.ones jax.numpy.zeros jax.numpy.tri jax.numpy.bartlett jax.numpy.blackman jax.numpy.hamming "
    "jax.numpy.hanning jax.numpy.kaiser jax.numpy.fromfunction jax.numpy.frombuffer jax.numpy.fromfile "
    "jax.numpy.fromiter jax.numpy.fromstring jax.numpy.from_dlpack jax.numpy.load jax.numpy.diag_indices "
    "jax.numpy.tril_indices jax.numpy.triu_indices jax.numpy.mask_indices jax.numpy.fft.fftfreq "
    "jax.numpy.fft.rfftfreq jax.lax.iota jax.lax.broadcasted_iota jax.lax.full jax.lax.empty jax.lax.rng_uniform "
    "jax.lax.after_all",
    INTEGER: "jax.numpy.bitwise_and jax.numpy.bitwise_count jax.numpy.bitwise_invert jax.numpy.bitwise_left_shift "
    "jax.numpy.bitwise_not jax.numpy.bitwise_or jax.numpy.bitwise_right_shift jax.numpy.bitwise_xor "
    "jax.numpy.invert jax.numpy.left_shift jax.numpy.right_shift jax.numpy.gcd jax.numpy.lcm jax.numpy.packbits "
    "jax.numpy.unpackbits jax.numpy.bincount jax.numpy.ravel_multi_index jax.numpy.histogram2d jax.lax.bitwise_and "
    "jax.lax.bitwise_not jax.lax.bitwise_or jax.lax.bitwise_xor jax.lax.clz jax.lax.population_count "
    "jax.lax.shift_left jax.lax.shift_right_arithmetic jax.lax.shift_right_logical jax.lax.mulhi "
    "jax.lax.bitcast_convert_type",
    DATA_SHAPE: "jax.numpy.argwhere jax.numpy.flatnonzero jax.numpy.nonzero jax.numpy.unique_all "
    "jax.numpy.unique_counts jax.numpy.unique_inverse jax.numpy.unique_values jax.numpy.intersect1d "
    "jax.numpy.setdiff1d jax.numpy.setxor1d jax.numpy.union1d jax.numpy.trim_zeros jax.numpy.place",
    HOST: "jax.numpy.array_repr jax.numpy.array_str jax.numpy.broadcast_shapes jax.numpy.einsum_path "
    "jax.numpy.get_printoptions jax.numpy.printoptions jax.numpy.set_printoptions jax.numpy.promote_types "
    "jax.numpy.result_type jax.numpy.save jax.numpy.savez jax.numpy.frompyfunc jax.lax.dtype jax.lax.padtype_to_pads "
    "jax.lax.conv_dimension_numbers jax.lax.conv_general_permutations jax.lax.conv_general_shape_tuple "
    "jax.lax.conv_shape_tuple jax.lax.conv_transpose_shape_tuple jax.lax.reduce_window_shape_tuple "
    "jax.lax.ConvGeneralDilatedDimensionNumbers jax.lax.PrecisionLike jax.lax.broadcast_shapes "
    "jax.nn.get_scaled_dot_general_config jax.lax.platform_dependent jax.lax.composite",
    COLLECTIVE: "jax.lax.all_gather jax.lax.all_to_all jax.lax.axis_index jax.lax.axis_size jax.lax.pbroadcast "
    "jax.lax.pcast jax.lax.pmean jax.lax.ppermute jax.lax.precv jax.lax.psend jax.lax.pshuffle jax.lax.psum_scatter "
    "jax.lax.psum_scatter_start jax.lax.pswapaxes jax.lax.ragged_all_to_all",
    SHARDING: "jax.lax.with_sharding_constraint",
    GPU: "jax.nn.scaled_matmul jax.nn.scaled_dot_general",
}
SKIPPED = {name: reason for reason, names in SKIP.items() for name in names.split()}


def _functions(module_name):
    module = {"jax.numpy": jnp, "jax.numpy.linalg": jnp.linalg, "jax.numpy.fft": jnp.fft, "jax.nn": jax.nn}.get(
        module_name
    ) or {"jax.lax": lax, "jax.lax.linalg": lax.linalg}[module_name]
    for name in sorted(dir(module)):
        value = getattr(module, name)
        if name.startswith("_") or not callable(value) or isinstance(value, types.ModuleType):
            continue
        if inspect.isclass(value):  # dtypes and abstract scalar types (a cast: lax.convert_element_type's call)
            continue
        yield f"{module_name}.{name}", value


def _names(jaxpr, found):
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub, _ in _compat.sub_jaxprs(eqn):
            _names(sub, found)
    return found


def _scalar(out):
    leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    return sum((jnp.sum(jnp.real(x)).astype(jnp.float32) for x in leaves), jnp.float32(0))


def _bound(call):
    """The primitives ``call(W)`` binds, and those of its backward pass where JAX differentiates it (tracing only)."""
    found = _names(jax.make_jaxpr(call)(W).jaxpr, set())
    try:
        backward = jax.make_jaxpr(jax.value_and_grad(lambda w: _scalar(call(w))))(W)
    except (TypeError, ValueError, NotImplementedError):  # not differentiable (integer output, no JVP rule)
        return found
    return _names(backward.jaxpr, found)


def _sweep(module_name):
    """``{primitive: a function binding it}`` and the functions no call fits."""
    seen, uncalled = {}, []
    for qualified, f in _functions(module_name):
        if qualified in SKIPPED:
            continue
        if qualified in CALLS:
            calls = [CALLS[qualified]]
        else:
            calls = [lambda w, g=g, f=f: g(f, w) for g in GENERIC]
        for call in calls:
            try:
                found = _bound(call)
            except Exception:  # noqa: BLE001 - this call does not fit the function: the next one is tried
                if qualified in CALLS:
                    raise
                continue
            for name in found:
                seen.setdefault(name, qualified)
            break
        else:
            uncalled.append(qualified)
    return seen, uncalled


# Primitives the drop-in once refused (issue 44) and JAX's linear algebra: the sweep must see them where they are bound.
SEEN = {
    "jax.numpy": {"split", "stack", "unstack"},
    "jax.numpy.fft": {"fft"},
    "jax.numpy.linalg": {"cholesky", "triangular_solve", "eigh", "qr", "svd", "lu", "custom_linear_solve"},
    "jax.lax": {"ragged_dot_general", "approx_top_k", "tile"},
}


@pytest.mark.parametrize("module_name", MODULES)
def test_every_primitive_a_public_function_binds_on_a_parameter_is_classified_or_refused(module_name):
    seen, uncalled = _sweep(module_name)
    assert SEEN.get(module_name, set()) <= set(seen), SEEN[module_name] - set(seen)
    assert not uncalled, f"add a call to CALLS or a reason to SKIP for {uncalled} (JAX {jax.__version__})"
    known = set(_table.TABLE) | set(_table.REFUSED)
    missing = {name: by for name, by in seen.items() if name not in known}
    assert not missing, f"classify in gspmd/_table.py (or refuse with a reason): {missing} (JAX {jax.__version__})"


def test_a_refused_primitive_is_never_in_the_table_and_our_error_gives_the_reason_and_the_way_out():
    assert not set(_table.REFUSED) & set(_table.TABLE)
    for name, reason in _table.REFUSED.items():
        message = _table.unknown(name, carries_jaxprs=False)
        assert f"'{name}'" in message and reason in message
        assert "table of primitives" not in message  # not the message of a primitive nobody looked at


def test_a_refused_primitive_on_a_parameter_is_refused_by_the_drop_in_with_the_reason():
    """``lax.scaled_dot`` (no derivative in JAX) applied to a parameter: our reason and way out, at trace time."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_adascale

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        x = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P("data")))
        loss = lambda w, x: jnp.mean(x @ lax.scaled_dot(w, w.T))  # noqa: E731
        with pytest.raises(ValueError, match=r"primitive 'scaled_dot' to a parameter: .*no derivative rule"):
            jax.jit(optax_adascale.value_and_grad(loss, data_axes="data"))(np.eye(8, dtype=np.float32), x)
