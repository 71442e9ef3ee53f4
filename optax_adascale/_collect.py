"""Where AdaScale's statistics come from: local squared norms and the one collective.

Everything that touches named axes lives here: the axis size, the checks for
summed shard_map gradients and Explicit-mesh vmap axes, the single ``lax.psum``
of ``(gradients, squared norms)``, the varying-type bookkeeping for
``lax.cond`` under shard_map, and the within-step micro-batching helper.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
AxisName = str | tuple[str, ...]

STAT_DTYPE = jnp.float32


def axis_names(axis_name: AxisName | None) -> tuple[str, ...]:
    """``axis_name`` as a tuple of names (empty for ``None``)."""
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        return (axis_name,)
    return tuple(axis_name)


def axis_size(axis_name: AxisName | None) -> int:
    """Number of replicas on ``axis_name`` at the call site (1 for ``None``).

    Raises:
      ValueError: if a name is not bound by an enclosing pmap, shard_map or vmap.
    """
    size = 1
    for name in axis_names(axis_name):
        try:
            size *= lax.axis_size(name)
        except NameError as err:
            raise ValueError(
                f"axis_name={axis_name!r}: the axis {name!r} is not bound where update() "
                "was called. Call update inside jax.pmap(..., axis_name=...), "
                "jax.shard_map over a mesh with that axis, or jax.vmap(..., axis_name=...); "
                "or pass axis_name=None for a single replica."
            ) from err
    return int(size)


def varying_axes(x: Any) -> frozenset[str]:
    """The manual axes ``x`` varies over (shard_map's type system); empty elsewhere."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _vma_checked(name: str) -> bool:
    """Whether shard_map tracks varying types for ``name`` here.

    ``axis_index`` always varies over its axis; it only *reads* as varying under
    ``jax.shard_map(..., check_vma=True)``. Under pmap, vmap or
    ``check_vma=False`` everything reads unvarying, so the summed-gradient check
    must stay silent there.
    """
    return name in varying_axes(lax.axis_index(name))


def check_not_summed(grads: Any, axis_name: AxisName | None) -> None:
    """Raise if shard_map's autodiff already summed the gradients over the axis.

    Inside ``jax.shard_map``, ``jax.grad`` with respect to replicated
    (unvarying) parameters returns the gradient *summed* over the axis. The
    leaves then read as unvarying; genuine per-replica gradients vary.
    """
    for name in axis_names(axis_name):
        if not _vma_checked(name):
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
            if name not in varying_axes(leaf):
                where = jax.tree_util.keystr(path) or "<root>"
                raise ValueError(
                    f"grads{where} does not vary over the shard_map axis {name!r}: "
                    "jax.grad with respect to replicated parameters inside shard_map "
                    "returns gradients already summed over the axis. Mark the parameters "
                    f"varying before differentiating: params = jax.lax.pcast(params, "
                    f"{name!r}, to='varying'), then pass the local gradients to update()."
                )


def check_vmap_axis_not_explicit(grads: Any, axis_name: AxisName | None) -> None:
    """Raise a clear error where JAX 0.10 would fail obscurely: a reduction over a vmap axis whose
    inputs are sharded on an Explicit mesh axis (``jax.make_mesh``'s default) under jit.

    Reads JAX internals (the batching trace of the gradient leaves); if they
    change, the check silently does nothing and JAX's own error remains.
    """
    names = set(axis_names(axis_name))
    if not names:
        return
    try:
        from jax._src.interpreters import batching
    except ImportError:  # pragma: no cover - internals moved
        return
    found = {}
    for leaf in jax.tree.leaves(grads):
        trace = getattr(leaf, "_trace", None)
        while trace is not None:
            data = getattr(trace, "axis_data", None) if isinstance(trace, batching.BatchTrace) else None
            if data is not None and data.name in names and getattr(data, "explicit_mesh_axis", None):
                found[data.name] = data.explicit_mesh_axis
            trace = getattr(trace, "parent_trace", None)
    if found:
        raise ValueError(
            f"axis_name={axis_name!r}: the jax.vmap axes {found} map over arrays sharded on Explicit "
            "mesh axes, which JAX 0.10 cannot reduce over under jit. Use a mesh with Auto axes "
            "(jax.sharding.Mesh(devices, names), or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))), "
            "wrap the vmapped step in jax.sharding.auto_axes under jax.set_mesh(mesh), or use jax.shard_map."
        )


def match_varying(x: Any, like: Any) -> Any:
    """``lax.pcast`` each leaf of ``x`` to vary over the axes its twin in ``like`` varies over.

    Needed where the two branches of a ``lax.cond`` under shard_map return a
    per-replica value from one branch and a fresh (unvarying) one from the
    other. A no-op under pmap, vmap and ``check_vma=False``.
    """

    def cast(a, b):
        missing = varying_axes(b) - varying_axes(a)
        if not missing:
            return a
        return lax.pcast(a, tuple(sorted(missing)), to="varying")

    return jax.tree.map(cast, x, like)


def fresh_zeros(x: Any) -> Array:
    """Zeros with ``x``'s shape, dtype and sharding, but not its varying type (a new, replica-invariant value)."""
    return jnp.zeros(x.shape, x.dtype, out_sharding=jax.typeof(x).sharding)


def stat_dtype(dtype: Any) -> Any:
    """Dtype statistics are computed in: float32, or wider if the input is wider."""
    return jnp.dtype(dtype) if jnp.finfo(dtype).bits > 32 else jnp.dtype(STAT_DTYPE)


def leaf_sq_norm(x: Array) -> Array:
    """``‖x‖²`` in float32 (or wider), squared after the upcast so f16/bf16 cannot overflow."""
    x = x.astype(stat_dtype(x.dtype))
    return jnp.sum(x * x).astype(STAT_DTYPE)


def group_sums(values: Sequence[Array], groups: Sequence[int], num_groups: int) -> Array:
    """Sum per-leaf scalars into a float32 ``[G]`` vector by group index."""
    totals = [jnp.zeros((), STAT_DTYPE) for _ in range(num_groups)]
    for value, group in zip(values, groups, strict=True):
        totals[group] = totals[group] + value.astype(STAT_DTYPE)
    return jnp.stack(totals)


def reduce_statistics(
    grads: Any, local_sq: Array, axis_name: AxisName | None, leaf_group: Sequence[int], num_groups: int
) -> tuple[Any, Array, Array]:
    """The one collective, and ``‖ḡ‖²`` read straight off its output.

    One ``lax.psum`` of ``(grads, local_sq)`` (XLA emits one all-reduce). The
    squared norm of the mean is taken on the *sum* and divided by ``n²``, and
    the mean ``ḡ = sum/n`` is handed on as an expression: XLA then fuses the
    division into the optimizer update instead of materializing ``ḡ`` for its
    two consumers. 16-bit floats are divided by ``n`` *before* the sum so that
    values near the float16 maximum cannot overflow in the reduction.

    Returns:
      ``(ḡ, a, b)``: the mean gradient, ``a`` = mean of the local squared norms
      (float32 ``[G]``), ``b = ‖ḡ‖²`` per group (float32 ``[G]``).
    """
    if axis_name is None:
        b = group_sums([leaf_sq_norm(g) for g in jax.tree.leaves(grads)], leaf_group, num_groups)
        return grads, local_sq, b
    n = axis_size(axis_name)
    low = lambda x: jnp.finfo(x.dtype).bits <= 16
    sums, sq_sum = lax.psum((jax.tree.map(lambda x: x / n if low(x) else x, grads), local_sq), axis_name)
    leaves = jax.tree.leaves(sums)
    b = group_sums([leaf_sq_norm(s) if low(s) else leaf_sq_norm(s) / (n * n) for s in leaves], leaf_group, num_groups)
    mean = jax.tree.map(lambda s: s if low(s) else s / n, sums)
    return mean, sq_sum / n, b


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MicrobatchStats:
    """Second moment of a replica's micro-batch gradients, for ``update(..., microbatch_stats=)``.

    Attributes:
      sq_norms: pytree shaped like the gradients; each leaf is the float32 mean
        over micro-batches of that leaf's squared norm, ``mean_j ‖g_j‖²``.
      num_microbatches: ``k``, static. The replica's gradient is the mean of
        ``k`` samples, so an update sees ``n = k × replicas × accumulation_steps``.
    """

    sq_norms: Any
    num_microbatches: int = dataclasses.field(metadata=dict(static=True))


def value_and_microbatch_grad(
    loss_fn: Callable[..., Any], num_microbatches: int, *, has_aux: bool = False, unroll: int | bool = 1
) -> Callable[..., tuple[Any, Any, MicrobatchStats]]:
    """Like ``jax.value_and_grad``, over ``k`` micro-batches with ``lax.scan``.

    The returned function takes ``(params, *batch)``; every leaf of ``batch``
    is split along its leading axis into ``k`` contiguous micro-batches
    (micro-batch ``j`` holds rows ``j·m … (j+1)·m − 1``). It returns
    ``(value, grads, stats)``: the mean loss (``(loss, aux)`` with ``has_aux``,
    ``aux`` stacked along a leading ``k`` axis), the mean gradient, and
    :class:`MicrobatchStats` with each leaf's mean micro-batch squared norm.
    Pass ``grads`` and ``microbatch_stats=stats`` to AdaScale's ``update``:
    one jitted step, one collective, no per-replica optimizer state.

    Under ``jax.shard_map`` the parameters must vary over the data axis before
    differentiation, as for ``jax.grad``: ``jax.lax.pcast(params, axis, to="varying")``.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)``).
      num_microbatches: ``k ≥ 1``; must divide the batch's leading dimension.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      unroll: passed to ``lax.scan``. ``True`` trades compile time and memory
        for speed where the backend runs loop bodies slowly (XLA:CPU
        convolutions inside a loop run much slower than unrolled).

    Returns:
      A function ``(params, *batch) -> (value, grads, stats)``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import optax_adascale
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> fn = optax_adascale.value_and_microbatch_grad(loss, num_microbatches=2)
      >>> value, grads, stats = fn(jnp.ones(2), jnp.array([[1.0, 0.0], [0.0, 1.0]]))
      >>> grads, stats.sq_norms, stats.num_microbatches
      (Array([0.5, 0.5], dtype=float32), Array(1., dtype=float32), 2)
    """
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got num_microbatches={num_microbatches!r}")
    k = num_microbatches
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def split(x):
        if x.shape[0] % k:
            raise ValueError(
                f"num_microbatches={k} must divide the batch's leading dimension, got shape {x.shape}"
            )
        return x.reshape((k, x.shape[0] // k) + x.shape[1:])

    def fn(params, *batch):
        micro = jax.tree.map(split, batch)

        def body(carry, mb):
            grad_sum, sq_sum = carry
            value, grads = grad_fn(params, *mb)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
            sq_sum = jax.tree.map(lambda s, g: s + leaf_sq_norm(g), sq_sum, grads)
            return (grad_sum, sq_sum), value

        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, stat_dtype(p.dtype)), params)
        sq0 = jax.tree.map(lambda p: jnp.zeros((), STAT_DTYPE), params)
        carry0 = (match_varying(grads0, params), match_varying(sq0, params))
        (grad_sum, sq_sum), values = lax.scan(body, carry0, micro, unroll=unroll)
        grads = jax.tree.map(lambda s, p: (s / k).astype(p.dtype), grad_sum, params)
        sq_norms = jax.tree.map(lambda s: s / k, sq_sum)
        if has_aux:
            losses, aux = values
            value = (jnp.mean(losses), aux)
        else:
            value = jnp.mean(values)
        return value, grads, MicrobatchStats(sq_norms, k)

    return fn
