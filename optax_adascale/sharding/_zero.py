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

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import _axes, _clock
from optax_adascale.sharding import _stand_in, _tensor

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


# Stand-ins with the parameters' real shapes up to this many elements (masks computed from sizes are seen);
# beyond it, two elements per dimension.
_REAL_SHAPES_LIMIT = 1 << 22


def check_elementwise(inner: optax.GradientTransformationExtraArgs, params: Any, n: int = 2) -> None:
    """Raise unless ``inner`` on ``n`` rows (a vmap axis) computes what it computes on the whole.

    Catches transformations that need the whole tensor (``optax.clip_by_global_norm``,
    ``optax.scale_by_trust_ratio``) and masks computed from shapes or sizes
    (each row is a flattened ``1/n`` of the leaf), on a stand-in with the
    params' real shapes (when under ``2²²`` elements) at gradient magnitudes
    from ``1e-3`` to ``1e12``. An ``inner`` that cannot run on the stand-in is
    refused unless declared with :func:`elementwise`.
    """
    if _stand_in.is_declared_elementwise(inner):
        return
    leaves, treedef = jax.tree.flatten(params)
    real = sum(math.prod(jnp.shape(p)) for p in leaves) <= _REAL_SHAPES_LIMIT
    shapes = [tuple(jnp.shape(p)) if real else (2,) * jnp.ndim(p) for p in leaves]

    def pieces(full_p: Any, full_g_of):
        rows_p = jax.tree.map(lambda x: to_rows(x, n), full_p)
        rows_state = inner.init(rows_p)

        def one_row(g, s, p):
            sq_norm = _tensor.sq_norm_fn(jax.tree.structure(g), _axes.ModelAxes(), "zero_probe")
            return inner.update(g, s, p, **_clock.probe_args(sq_norm))[0]

        axes = jax.tree.map(lambda x: 0 if jnp.ndim(x) else None, rows_state)
        rows_update = jax.vmap(one_row, in_axes=(0, axes, 0), axis_name="zero_probe")

        def run(full_g):
            whole = [jnp.ravel(to_rows(u, n)) for u in full_g_of(full_g)]
            shards = rows_update(jax.tree.map(lambda x: to_rows(x, n), full_g), rows_state, rows_p)
            return whole, [jnp.ravel(u) for u in jax.tree.leaves(shards)]

        return run

    _stand_in.compare(
        inner,
        treedef,
        shapes,
        [jnp.result_type(p) for p in leaves],
        pieces,
        cannot_run=(
            f"shard_optimizer_state={n}: AdaScale could not run inner on a stand-in of the parameters to check "
            "that it computes on a 1/n row what it computes on the whole"
        ),
        differs=(
            "shard_optimizer_state: inner computes something different on a 1/n shard of the parameters "
            "than on the whole, so the sharded update would be wrong. inner must be elementwise "
            "(optax.trace, optax.scale_by_adam, optax.add_decayed_weights). Norm-based transformations "
            "need the global norm: use optax_adascale.clip_by_global_norm instead of "
            "optax.clip_by_global_norm; masks and labels must be given as trees, not computed from "
            "shapes or sizes (each shard is a flattened row)."
        ),
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
    is not the global one; AdaScale hands every ``inner`` the function that sums
    squared norms over the shards (``base_steps.sq_norm``), and this
    transformation uses it. Outside AdaScale (no ``base_steps``: every leaf whole)
    it is ``optax.clip_by_global_norm``.

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

    def update_fn(updates, state, params=None, *, base_steps=None, **extra_args):
        del params, extra_args
        sq = (_clock.local_sq_norm if base_steps is None else base_steps.sq_norm)(updates)
        norm = jnp.sqrt(sq)
        factor = jnp.where(norm < max_norm, 1.0, max_norm / jnp.where(norm > 0, norm, 1.0))
        return jax.tree.map(lambda u: (u * factor.astype(u.dtype)).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)
