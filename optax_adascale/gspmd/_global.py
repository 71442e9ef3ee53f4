"""The loss on the global batch over Explicit data axes: each parameter typed ``reduced`` (or probed at its FSDP
gather), ``jax.value_and_grad`` of the loss as written, the per-copy squared norms read from the ``unreduced``
partials and the partials reduced; with ``k`` micro-batches a ``lax.scan`` over them (``_split``). The single-shard
case (``one_shard``) is ``jax.value_and_grad`` with the statistics of ``n = 1``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.core._samples import MicrobatchStats
from optax_adascale.gspmd import _copies, _rewrite, _selfcheck, _split, _stats, _types
from optax_adascale.gspmd._layout import Layout


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter leaf: its spec, the mesh axes it is split over, whether that includes a data axis (FSDP)."""

    spec: P
    split: frozenset[str]
    fsdp: bool


def _leaf(layout: Layout, p: Any) -> _Leaf:
    parts = _types.partitions(p)
    split = frozenset(a for entry in parts for a in _types.spec_axes(entry))
    return _Leaf(P(*parts), split, bool(split & set(layout.data)))


def run(loss_fn, has_aux, layout: Layout, params, args, trace=None, unroll=1, n_state=0):
    """``(value, grads, stats)`` with the data axes Explicit: reduced params, unreduced partials, one reduction."""
    leaves, treedef = jax.tree.flatten(params)
    info = [_leaf(layout, p) for p in leaves]
    _check_batch_sharded(layout, args)
    layout = layout.with_batch(args)
    fsdp = tuple(i for i, leaf in enumerate(info) if leaf.fsdp)
    cast = [
        p if leaf.fsdp else jax.reshard(p, P(*leaf.spec.partitions, reduced=frozenset(layout.data)))
        for p, leaf in zip(leaves, info, strict=True)
    ]
    loss = _rewrite.Probed(loss_fn, treedef, fsdp, layout, has_aux, trace)
    split = _split.Split.of(layout, args, n_state)
    loss.prepare(leaves, args if layout.k == 1 else split.first_avals())
    _selfcheck.verify(layout, _compat.primitives_in(loss.closed.jaxpr))  # JAX's rules for them, probed once
    entry = loss.entry(cast)

    def one(batch):
        """One (micro-)batch: value, aux, partial gradients (probed FSDP leaves reduce-scattered), ‖·‖² arrays."""
        value, aux, partials, probe_sq = loss(entry, batch)
        own = [i for i in range(len(partials)) if i not in probe_sq]
        samples = [_copies.data_partial(layout, partials[i]) for i in own]
        local = _stats.local_sqs(layout, [(g, _types.partial_spec(g), True) for g in samples])
        if probe_sq:  # leaf order: the probed leaves' arrays in their places
            rows = {i: local[j] for j, i in enumerate(own)} | dict(probe_sq)
            local = jnp.stack([rows[i] for i in range(len(partials))])
        return jax.tree.map(_types.plain, (value, aux)) + (partials, local)

    if layout.k == 1:
        value, aux, partials, sq = one(args)
    else:
        fixed = _split.row_free_outputs(loss.closed.jaxpr, [len(leaves) + i for i in split.rows])[1:]
        value, aux, partials, sq = split.scan(one, [_zeros_like_partial(x) for x in entry], layout, unroll, fixed)
    # The partials sum the k micro-batches' gradients (each of weight 1/k in the mean).
    k = layout.k
    grads = [
        jax.reshard(g, leaf.spec) if _types.unreduced_axes(g) else g for g, leaf in zip(partials, info, strict=True)
    ]
    grads = [(g if k == 1 else g / k).astype(p.dtype) for g, p in zip(grads, leaves, strict=True)]
    # g_i = (n/k)·partial_i per sample (k micro-batches of weight 1/k): a = mean_i ‖g_i‖² = (n/k²)·Σ_i ‖partial_i‖².
    b_sq = _stats.local_sqs(layout, [(g, leaf.spec, False) for g, leaf in zip(grads, info, strict=True)])
    sums = _stats.totals(layout, jnp.concatenate([sq, b_sq]))
    m = len(leaves)
    a = sums[:m] * (layout.n / (k * k))
    specs = tuple(leaf.spec for leaf in info) if layout.convert else None  # an Auto mesh's types do not say it
    stats = MicrobatchStats(
        treedef.unflatten(list(a)), layout.n, mean_sq_norms=treedef.unflatten(list(sums[m:])), specs=specs
    )
    value = (value, aux) if has_aux else value
    return value, treedef.unflatten(grads), stats


def _zeros_like_partial(x: Any) -> Any:
    """Zeros typed as the gradient of ``x``: unreduced where ``x`` is reduced, float32 or wider."""
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    reduced = _types.reduced_axes(x)
    parts = _types.partitions(x)
    if reduced:
        return jax.reshard(jnp.zeros(x.shape, dtype, out_sharding=P(*parts)), P(*parts, unreduced=reduced))
    return jnp.zeros(x.shape, dtype, out_sharding=P(*parts))


def _check_batch_sharded(layout: Layout, args: Any) -> None:
    """Some argument must be sharded over the data axes on its first dimension: else they are not the batch's."""
    for x in jax.tree.leaves(args):
        if jnp.ndim(x) and set(layout.data) <= set(_types.spec_axes(_types.partitions(x)[0])):
            return
    raise ValueError(
        f"value_and_grad(data_axes={layout.data_spec!r}): no argument is sharded over {layout.data} on its first "
        "dimension, so these are not the axes the batch is sharded over and their shards would not be samples. "
        "Name the mesh axes the batch's rows are split over (e.g. data_axes='data'), and shard the batch that way "
        f"(jax.device_put(x, P({layout.data_spec!r})), or the jit's in_shardings)."
    )


def one_shard(loss_fn, has_aux, layout: Layout, params, args, unroll=1, n_state=0):
    """A single data shard: ``jax.value_and_grad`` per micro-batch, each micro-batch's gradient a sample."""
    _check_batch_sharded(layout, args)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    sq = lambda g: jnp.sum(jnp.square(g.astype(jnp.float32)))  # noqa: E731
    if layout.k == 1:
        value, grads = grad_fn(params, *args)
        sqs = jax.tree.map(sq, grads)
        return value, grads, MicrobatchStats(sqs, 1, mean_sq_norms=sqs)
    split = _split.Split.of(layout, args, n_state)

    def step(batch, carry):
        acc, sq_acc = carry
        value, grads = grad_fn(params, *batch)
        acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
        return (acc, jax.tree.map(lambda s, g: s + sq(g), sq_acc, grads)), (value if has_aux else (value, None))

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    sq_zeros = jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
    (acc, sq_acc), (values, auxes), state = split.loop(step, (zeros, sq_zeros), unroll)
    k = layout.k
    grads = jax.tree.map(lambda a, p: (a / k).astype(p.dtype), acc, params)
    if has_aux:
        value = (jnp.mean(values), split.aux(auxes, state, _row_free_aux(loss_fn, params, split)))
    else:
        value = jnp.mean(values)
    stats = MicrobatchStats(jax.tree.map(lambda s: s / k, sq_acc), k, mean_sq_norms=jax.tree.map(sq, grads))
    return value, grads, stats


def _row_free_aux(loss_fn, params, split: _split.Split) -> list[bool]:
    """Which aux leaves of ``loss_fn`` do not depend on the batch's rows (traced at one micro-batch's shapes)."""
    leaves, treedef = jax.tree.flatten(params)
    n = len(leaves)

    def flat(*xs):
        return jax.tree.leaves(loss_fn(treedef.unflatten(list(xs[:n])), *split.tree.unflatten(list(xs[n:]))))

    closed = jax.make_jaxpr(flat)(*leaves, *jax.tree.leaves(split.first_avals()))
    return _split.row_free_outputs(closed.jaxpr, [n + i for i in split.rows])[1:]
