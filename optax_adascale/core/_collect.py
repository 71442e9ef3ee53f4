"""The one reduction of AdaScale's statistics: ``lax.psum`` of ``(gradients, squared norms)`` over the data axes
(one all-reduce, as SGD + pmean), ``‖ḡ‖²`` read off its output, and, only where parameters are split over model
axes, one scalar-sized ``psum`` of the statistics over those axes. Which axes are which is ``_axes``'.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale.core import _axes, _groups, _probe
from optax_adascale.core._norms import STAT_DTYPE, fused_sq_norms, leaf_sq_norm, low_precision

Array = jax.Array


def statistic_keys(
    groups: _groups.Groups, model: _axes.ModelAxes, leaves: Any
) -> list[tuple[int, frozenset[str]]] | None:
    """Per leaf, which squared norms its own is summed with: its group and the model axes it is split over
    (``_norms.fused_sq_norms`` reduces the small leaves of one key together). ``None`` where the compiler
    partitions the leaves over a mesh (a jit step over the global batch): there every leaf keeps its own
    reduction, as a concatenation of differently sharded leaves would move them."""
    if _axes.partitioned_axes(leaves):
        return None
    splits = model.leaf_axes or (frozenset(),) * len(groups.leaf_group)
    return list(zip(groups.leaf_group, splits, strict=True))


# --------------------------------------------------------------------------- the reduction
def _probe_of_sums(sums: list[Array], low: list[bool], guard: "Guard", n: Any) -> Array:
    """:func:`_probe.probe_dots` of ``ḡ`` read off the all-reduce's output ``sums`` (``ḡ = sums/n``; a 16-bit float
    leaf was divided before the sum), the leaves of each kind in one call (one reduction per dtype)."""
    rows: list[Any] = [None] * len(sums)
    for lows, divisor in ((False, 1 / n), (True, 1.0)):
        idx = [i for i, lo in enumerate(low) if lo == lows]
        if not idx:
            continue
        params = None if guard.params is None else [guard.params[i] for i in idx]
        dots = _probe.probe_dots([sums[i] for i in idx], [guard.trace[i] for i in idx], params, divisor)
        for row, i in enumerate(idx):
            rows[i] = dots[row]
    return jnp.stack(rows)


class Guard(NamedTuple):
    """What the guard's probe reads besides ``ḡ``: the guarded trace's buffer and the params, as leaf lists (the params
    ``None`` where ``update`` was given none)."""

    trace: list[Array]
    params: list[Array] | None


def reduce_statistics(
    grads: Any,
    local_sq: Array,
    axes: _axes.Axes,
    groups: _groups.Groups,
    weights: Sequence[Array] | None = None,
    mean_sq: Sequence[Array] | None = None,
    guard: Guard | None = None,
    specs: Sequence[Any] | None = None,
) -> tuple[Any, Array, Array, Array | None]:
    """The gradient's reduction, and ``‖ḡ‖²`` read straight off its output.

    One ``lax.psum`` of ``(grads, local_sq)`` over the data axes (XLA emits one
    all-reduce, as for SGD + pmean). The squared norm of the mean is taken on
    the *sum* and divided by ``n²``, and the mean ``ḡ = sum/n`` is handed on as
    an expression: XLA then fuses the division into the optimizer update
    instead of materializing ``ḡ``. 16-bit floats are divided by ``n``
    *before* the sum so that values near the float16 maximum cannot overflow.
    With model axes, the per-group ``a`` and ``b`` (partial sums on each
    shard) are then summed over them in one scalar-sized ``psum``.

    Args:
      grads: this replica's gradients (its mean over its samples).
      local_sq: float32 ``[G]``, this replica's mean squared sample norm per group
        (already masked by ``axes.model.mask`` where leaves are replicated over model axes).
      axes: the call's data and model axes.
      groups: the parameter groups.
      weights: optional per-leaf multipliers ``P``: ``b = ‖P ⊙ ḡ‖²`` (preconditioned statistics).
      mean_sq: optional ``‖ḡ‖²`` per leaf taken where the samples were (the GSPMD drop-in): ``b`` comes from
        there, not from ``grads`` (which the user may have clipped or scaled); only without data axes.
      guard: the guarded τ-clock trace's buffers and the params (:class:`Guard`), or ``None``: the guard's probe
        (``_probe.probe_dots`` on a sample of ``ḡ``, read off the all-reduce's output, and of the buffers) is taken
        here, and summed over the model axes in the statistics' own ``psum``.
      specs: the gradients' layout on a mesh with Auto axes (the drop-in's), or ``None``.

    Returns:
      ``(ḡ, a, b, probe)``: the mean gradient, ``a`` = mean of the replicas' ``local_sq``
      (float32 ``[G]``), ``b = ‖ḡ‖²`` per group (float32 ``[G]``), the guard's probe (float32 ``[L, 6]``, or
      ``None``).
    """
    weigh = (lambda x, i: x) if weights is None else (lambda x, i: x * weights[i])  # noqa: E731
    model = axes.model
    keys = statistic_keys(groups, model, grads)
    if mean_sq is not None and axes.data:
        raise ValueError(
            f"microbatch_stats from value_and_grad(data_axes=...) are already reduced over the data shards, but the "
            f"optimizer was built with axis_name={axes.name!r}: build it without axis_name for a jit step over the "
            "global batch."
        )
    probe = None
    if not axes.data:
        mean, a = grads, local_sq
        if guard is not None:  # partitioned over an Explicit mesh: per device, one psum; else the compiler's sums
            leaves = jax.tree.leaves(grads)
            probe = _probe.probe_dots_partitioned(leaves, guard.trace, guard.params, specs)
            if probe is None:
                probe = _probe.probe_dots(leaves, guard.trace, guard.params)
        if mean_sq is not None:
            b_leaves = [jnp.asarray(b, STAT_DTYPE) for b in mean_sq]
        else:
            leaves = [weigh(g, i) for i, g in enumerate(jax.tree.leaves(grads))]
            b_leaves = [leaf_sq_norm(g) for g in leaves] if keys is None else fused_sq_norms(leaves, keys)
    else:
        n = axes.replicas
        sums, sq_sum = lax.psum((jax.tree.map(lambda x: x / n if low_precision(x) else x, grads), local_sq), axes.data)
        low = [low_precision(s) for s in jax.tree.leaves(sums)]
        leaves = [weigh(s, i) for i, s in enumerate(jax.tree.leaves(sums))]
        if keys is None:
            raw = [leaf_sq_norm(s) for s in leaves]
        else:
            raw = fused_sq_norms(leaves, list(zip(keys, low, strict=True)))
        b_leaves = [r if lo else r / (n * n) for r, lo in zip(raw, low, strict=True)]
        mean = jax.tree.map(lambda s: s if low_precision(s) else s / n, sums)
        a = sq_sum / n
        if guard is not None:  # a sample of the all-reduce's output buffer: ḡ = sums/n (16-bit floats: divided before)
            probe = _probe_of_sums(jax.tree.leaves(sums), low, guard, n)
    b = groups.sums(model.mask(b_leaves))
    if model.axes:
        if probe is None:
            a, b = model.psum((a, b))
        else:  # each leaf's probe counted once over the model axes it is replicated over, summed over its pieces
            masked = jnp.stack(model.mask([row for row in probe])) if len(probe) else probe
            a, b, probe = model.psum((a, b, masked))
    return mean, a, b, probe
