"""The sharded update (ZeRO-1/2, FairScale's ``AdaScale(OSS)``): reduce-scatter, update a 1/n shard, all-gather.

With ``shard_optimizer_state=n`` every leaf of the parameters is flattened,
zero-padded to ``n·m`` elements and cut into ``n`` rows of ``m``; row ``i``
belongs to replica ``i`` (the linear index over the data axes). ``inner``'s
state lives in those rows (``(n, m)`` per params-shaped leaf, laid out with
``P(axis_name)``), so each replica holds ``1/n`` of it. An update:

1. reduce-scatters the local gradients (``lax.psum_scatter``): replica ``i``
   receives the sum of row ``i``;
2. takes ``‖ḡ_i‖²`` on its row and sums it, with the local squared norms, in
   one scalar-sized ``psum``;
3. runs ``inner`` on its row (parameters sliced the same way) and scales it;
4. all-gathers the rows (``lax.all_gather``) into the full, replicated update.

Gradient traffic is one reduce-scatter plus one all-gather, the bytes of one
all-reduce; the update and the read of ``ḡ`` that the gain needs shrink to
``1/n`` per device. ``inner`` must be elementwise (``trace``, ``scale_by_adam``,
``add_decayed_weights``) or shard-aware (:func:`clip_by_global_norm`); this is
checked at ``init`` by running ``inner`` on a stand-in of the parameters, whole and
in ``n`` rows, or declared with :func:`elementwise`.
"""

import contextlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_adascale import _compat
from optax_adascale.core import _collect, _norms

Array = jax.Array


class ShardedInnerState(NamedTuple):
    """``inner``'s state over ZeRO rows: params-shaped leaves are ``(n, m)``, row ``i`` on replica ``i``.

    Attributes:
      rows: the state of ``inner``, initialised on the ``(n, m)`` rows of the params.
    """

    rows: Any


def _row_len(size: int, n: int) -> int:
    return max(1, math.ceil(size / n))


def to_rows(x: Array, n: int) -> Array:
    """``x`` flattened, zero-padded and cut into ``(n, m)`` rows."""
    m = _row_len(x.size, n)
    flat = jnp.ravel(x)
    return jnp.pad(flat, (0, n * m - x.size)).reshape(n, m)


def from_rows(rows: Array, like: Any) -> Array:
    """The inverse of :func:`to_rows` for a leaf shaped like ``like``."""
    size = math.prod(like.shape)
    return jnp.ravel(rows)[:size].reshape(like.shape)


# --------------------------------------------------------------------------- init and checks


def init_inner(inner: optax.GradientTransformationExtraArgs, params: Any, n: int) -> ShardedInnerState:
    """``inner``'s state over the rows of ``params`` (full, replicated params; call outside shard_map)."""
    if jax.tree.leaves(params):
        check_elementwise(inner, params, n)
    rows = jax.tree.map(lambda p: to_rows(p, n), params)
    state = inner.init(rows)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape = jnp.shape(leaf)
        if shape and (len(shape) != 2 or shape[0] != n):
            raise ValueError(
                f"shard_optimizer_state={n}: inner's state leaf {jax.tree_util.keystr(path)} has shape {shape}, "
                "neither a scalar nor one row per replica. inner must be elementwise (optax.trace, "
                "optax.scale_by_adam, optax.add_decayed_weights) or shard-aware."
            )
    return ShardedInnerState(state)


class _Elementwise(optax.GradientTransformationExtraArgs):
    """An ``inner`` the user declared elementwise (or shard-aware): :func:`elementwise`."""


def elementwise(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Declare that ``inner`` computes on a shard of the parameters what it computes on the whole.

    AdaScale runs ``inner`` on shards where the parameters are split: each
    replica's ``1/n`` row with ``shard_optimizer_state=n`` (ZeRO), and the
    model-axis pieces of tensor-parallel parameters. It checks that ``inner``
    is elementwise by running it on a stand-in of the parameters, whole and in
    shards, at gradient magnitudes from ``1e-3`` to ``1e12``. An ``inner`` that
    cannot run on the stand-in (it needs extra arguments, such as
    ``optax.scale_by_polyak``'s ``value``, or particular values) cannot be
    judged and is refused; declare it with this function if it is elementwise
    (``u_i`` depends on ``g_i``, ``p_i`` and its own state only) or shard-aware
    (it reduces across leaves only through the ``adascale_sq_norm`` extra
    argument, as :func:`clip_by_global_norm` does). A wrong declaration gives
    wrong updates: nothing is checked.

    Args:
      inner: the transformation to declare.

    Returns:
      The same transformation (an ``optax.GradientTransformationExtraArgs``),
      marked as elementwise.

    Examples:
      >>> import jax.numpy as jnp, optax, optax_adascale
      >>> inner = optax_adascale.elementwise(optax.trace(0.9))
      >>> tx = optax_adascale.adascale(inner, 0.1, axis_name="data", shard_optimizer_state=2)
      >>> tx.init(jnp.zeros(3)).inner_state.rows.trace.shape  # two rows of two
      (2, 2)
    """
    inner = optax.with_extra_args_support(inner)
    return _Elementwise(inner.init, inner.update)


def is_declared_elementwise(inner: Any) -> bool:
    return isinstance(inner, _Elementwise)


# Stand-ins with the parameters' real shapes up to this many elements (masks computed from sizes are seen);
# beyond it, two elements per dimension.
_REAL_SHAPES_LIMIT = 1 << 22
# Gradient magnitudes of the check: moderate ones show masks and decay; large ones reach any realistic clip
# threshold (the stand-in's norm is at least 1e12 at the last; its squares stay far from float32's range).
_GRAD_SCALES = (1e-3, 1.0, 1e3, 1e6, 1e9, 1e12)


def check_elementwise(inner: optax.GradientTransformationExtraArgs, params: Any, n: int = 2) -> None:
    """Raise unless ``inner`` on ``n`` rows (a vmap axis) computes what it computes on the whole.

    Catches transformations that need the whole tensor (``optax.clip_by_global_norm``,
    ``optax.scale_by_trust_ratio``) and masks computed from shapes or sizes
    (each row is a flattened ``1/n`` of the leaf), on a stand-in with the
    params' real shapes (when under ``2²²`` elements) at gradient magnitudes
    from ``1e-3`` to ``1e12``. An ``inner`` that cannot run on the stand-in is
    refused unless declared with :func:`elementwise`.
    """
    if is_declared_elementwise(inner):
        return
    leaves, treedef = jax.tree.flatten(params)
    real = sum(math.prod(jnp.shape(p)) for p in leaves) <= _REAL_SHAPES_LIMIT
    shapes = [tuple(jnp.shape(p)) if real else (2,) * jnp.ndim(p) for p in leaves]
    dtypes = [jnp.promote_types(jnp.result_type(p), jnp.float32) for p in leaves]
    pattern = lambda s, d, k: (1.0 + (jnp.arange(math.prod(s)) % k) / k).astype(d).reshape(s)  # noqa: E731
    try:
        with jax.ensure_compile_time_eval():
            full_p = treedef.unflatten([0.5 * pattern(s, d, 5) for s, d in zip(shapes, dtypes)])
            base_g = treedef.unflatten([pattern(s, d, 7) for s, d in zip(shapes, dtypes)])
            whole_state = inner.init(full_p)
            rows_p = jax.tree.map(lambda x: to_rows(x, n), full_p)
            rows_state = inner.init(rows_p)

            def one_row(g, s, p):
                sq_norm = _collect.sq_norm_fn(jax.tree.structure(g), _collect.ModelAxes(), "zero_probe")
                u, _ = inner.update(g, s, p, adascale_sq_norm=sq_norm)
                return u

            axes = jax.tree.map(lambda x: 0 if jnp.ndim(x) else None, rows_state)
            rows_update = jax.vmap(one_row, in_axes=(0, axes, 0), axis_name="zero_probe")
            results = []
            for scale in _GRAD_SCALES:
                full_g = jax.tree.map(lambda g, c=scale: g * jnp.asarray(c, g.dtype), base_g)
                whole, _ = inner.update(full_g, whole_state, full_p)
                shards = rows_update(jax.tree.map(lambda x: to_rows(x, n), full_g), rows_state, rows_p)
                results.append(
                    (
                        [np.asarray(jnp.ravel(to_rows(u, n))) for u in jax.tree.leaves(whole)],
                        [np.asarray(jnp.ravel(u)) for u in jax.tree.leaves(shards)],
                    )
                )
    except Exception as err:  # noqa: BLE001 - an inner we cannot run cannot be judged: refuse it
        raise ValueError(
            f"shard_optimizer_state={n}: AdaScale could not run inner on a stand-in of the parameters to check "
            f"that it computes on a 1/n row what it computes on the whole ({type(err).__name__}: {err}). If "
            "inner is elementwise (each entry of the update depends on the same entry of the gradient, the "
            "parameters and its own state only) or shard-aware, declare it: optax_adascale.elementwise(inner)."
        ) from err
    for expected, got in results:
        for e, g in zip(expected, got, strict=True):
            if not np.allclose(e, g, rtol=1e-4, atol=1e-6 * max(1.0, float(np.max(np.abs(e), initial=0.0)))):
                raise ValueError(
                    "shard_optimizer_state: inner computes something different on a 1/n shard of the parameters "
                    "than on the whole, so the sharded update would be wrong. inner must be elementwise "
                    "(optax.trace, optax.scale_by_adam, optax.add_decayed_weights). Norm-based transformations "
                    "need the global norm: use optax_adascale.clip_by_global_norm instead of "
                    "optax.clip_by_global_norm; masks and labels must be given as trees, not computed from "
                    "shapes or sizes (each shard is a flattened row)."
                )


@contextlib.contextmanager
def _off_mesh():
    """Leave the caller's shard_map (its mesh and varying-type checks): the probes' vmap axes are no mesh axes."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), _compat.vma_checks_off():
        yield


def check_model_split(inner: optax.GradientTransformationExtraArgs, grads: Any, model: _collect.ModelAxes) -> None:
    """Raise unless ``inner`` computes on model-axis pieces of the split leaves what it computes on the whole.

    Tensor parallelism hands ``inner`` each device's piece of a split leaf.
    On a stand-in (two elements per dimension, split leaves cut in two along
    their first dimension, a vmap axis standing for the model axes), ``inner``
    runs whole and in pieces, with the ``adascale_sq_norm`` AdaScale gives it,
    at gradient magnitudes from ``1e-3`` to ``1e12``. ``optax.clip_by_global_norm``
    (each piece clipped by its own norm) fails this; :func:`clip_by_global_norm`
    passes. An ``inner`` that cannot run on the stand-in is refused unless
    declared with :func:`elementwise`.
    """
    if is_declared_elementwise(inner):
        return
    leaves, treedef = jax.tree.flatten(grads)
    split = [bool(axes) and jnp.ndim(g) >= 1 for g, axes in zip(leaves, model.leaf_axes, strict=True)]
    if not any(split):
        return
    probe = _collect.ModelAxes(("tp_probe",), tuple(frozenset({"tp_probe"}) if s else frozenset() for s in split))
    shapes = [(2,) * jnp.ndim(g) for g in leaves]
    dtypes = [jnp.promote_types(jnp.result_type(g), jnp.float32) for g in leaves]
    pattern = lambda s, d, k: (1.0 + (jnp.arange(math.prod(s)) % k) / k).astype(d).reshape(s)  # noqa: E731
    cut = lambda x, s: jnp.reshape(x, (2, 1, *x.shape[1:])) if s else x  # noqa: E731
    in_axes = treedef.unflatten([0 if s else None for s in split])

    def pieces(g, p):
        u, _ = inner.update(g, inner.init(p), p, adascale_sq_norm=_collect.sq_norm_fn(treedef, probe))
        return u

    try:
        with jax.ensure_compile_time_eval(), _off_mesh():
            full_p = treedef.unflatten([0.5 * pattern(s, d, 5) for s, d in zip(shapes, dtypes)])
            base_g = treedef.unflatten([pattern(s, d, 7) for s, d in zip(shapes, dtypes)])
            cut_p = treedef.unflatten([cut(x, s) for x, s in zip(jax.tree.leaves(full_p), split)])
            state = inner.init(full_p)
            results = []
            for scale in _GRAD_SCALES:
                full_g = jax.tree.map(lambda g, c=scale: g * jnp.asarray(c, g.dtype), base_g)
                whole, _ = inner.update(full_g, state, full_p)
                cut_g = treedef.unflatten([cut(x, s) for x, s in zip(jax.tree.leaves(full_g), split)])
                got = jax.vmap(pieces, in_axes=(in_axes, in_axes), axis_name="tp_probe")(cut_g, cut_p)
                results.append(
                    ([np.asarray(u) for u in jax.tree.leaves(whole)], [np.asarray(u) for u in jax.tree.leaves(got)])
                )
    except Exception as err:  # noqa: BLE001 - an inner we cannot run cannot be judged: refuse it
        raise ValueError(
            f"parameters split over the model axes {list(model.axes)}: AdaScale could not run inner on a "
            "stand-in of the parameters to check that it computes on a model shard what it computes on the "
            f"whole ({type(err).__name__}: {err}). If inner is elementwise (each entry of the update depends "
            "on the same entry of the gradient, the parameters and its own state only) or shard-aware, "
            "declare it: optax_adascale.elementwise(inner)."
        ) from err
    for expected, got in results:
        for e, g, s in zip(expected, got, split, strict=True):
            g = np.reshape(g, e.shape) if s else g  # split: the pieces in order; replicated: a copy per piece
            if not np.allclose(
                np.broadcast_to(e, g.shape), g, rtol=1e-4, atol=1e-6 * max(1.0, float(np.max(np.abs(e), initial=0.0)))
            ):
                raise ValueError(
                    f"parameters split over the model axes {list(model.axes)}: inner computes something "
                    "different on a model shard of a parameter than on the whole, so the update would be wrong. "
                    "inner must be elementwise (optax.trace, optax.scale_by_adam, optax.add_decayed_weights) "
                    "or shard-aware: use optax_adascale.clip_by_global_norm instead of "
                    "optax.clip_by_global_norm (it clips by the norm summed over the shards)."
                )


# --------------------------------------------------------------------------- layout


def _rows_of(inner_state: Any) -> Any:
    return inner_state.rows if isinstance(inner_state, ShardedInnerState) else None


def row_axes(inner_state: Any) -> Any:
    """vmap/pmap axes for ``inner_state``: ``0`` on ZeRO rows, ``None`` elsewhere."""
    if not isinstance(inner_state, ShardedInnerState):
        return jax.tree.map(lambda _: None, inner_state)
    return ShardedInnerState(jax.tree.map(lambda x: 0 if jnp.ndim(x) else None, inner_state.rows))


def row_specs(inner_state: Any, lead: Any) -> Any:
    """shard_map specs for ``inner_state``: ``P(lead)`` on ZeRO rows; ``None`` if it is not sharded."""
    if not isinstance(inner_state, ShardedInnerState):
        return None
    P = jax.sharding.PartitionSpec
    return ShardedInnerState(jax.tree.map(lambda x: P(lead) if jnp.ndim(x) else P(), inner_state.rows))


def recut(source: Any, target: Any) -> Any:
    """``source``'s inner state re-cut into ``target``'s layout (rows for another ``n``, or replicated)."""
    src_rows, tgt_rows = _rows_of(source), _rows_of(target)
    if src_rows is None and tgt_rows is None:
        return source
    if src_rows is None or tgt_rows is None:
        raise ValueError(
            "transfer_state between a sharded (shard_optimizer_state) and a replicated inner "
            "state is not supported; keep shard_optimizer_state set in both"
        )

    def cut(s, t):
        if not jnp.ndim(t):
            return s
        n_new, m_new = t.shape
        flat = jnp.ravel(jnp.asarray(s))
        flat = flat[: n_new * m_new] if flat.size >= n_new * m_new else jnp.pad(flat, (0, n_new * m_new - flat.size))
        return flat.reshape(n_new, m_new)

    return ShardedInnerState(jax.tree.map(cut, src_rows, tgt_rows))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` that also works where ``inner`` sees a shard of the gradient.

    Inside ``adascale(..., shard_optimizer_state=n)`` (each replica updates a
    ``1/n`` row) or with parameters split over model axes, a shard's own norm
    is not the global one; AdaScale then hands ``inner`` the function that sums
    squared norms over the shards (the extra argument ``adascale_sq_norm``),
    and this transformation uses it. Elsewhere it is ``optax.clip_by_global_norm``.

    Args:
      max_norm: the largest global norm allowed.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> clip = optax_adascale.clip_by_global_norm(1.0)
      >>> clip.update(jnp.array([3.0, 4.0]), clip.init(None))[0]
      Array([0.6, 0.8], dtype=float32)
    """

    def update_fn(updates, state, params=None, *, adascale_sq_norm=None, **extra_args):
        del params, extra_args
        if adascale_sq_norm is None:
            sq = sum((_norms.leaf_sq_norm(u) for u in jax.tree.leaves(updates)), jnp.zeros([], jnp.float32))
        else:
            sq = adascale_sq_norm(updates)
        norm = jnp.sqrt(sq)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / jnp.where(norm > 0, norm, 1.0))
        return jax.tree.map(lambda u: (u * factor.astype(u.dtype)).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)
