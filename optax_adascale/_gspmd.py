"""The drop-in for ``jax.value_and_grad`` under ``jax.jit`` over the global batch (GSPMD).

Big-model trainers (MaxText, Levanter, big_vision, Flax's lm1b) differentiate the
*global* batch under one ``jax.jit`` with sharded inputs: no per-replica gradient
ever exists, yet AdaScale needs the spread of per-shard gradients. The helper
keeps everything in global semantics and lets the SPMD partitioner place it:

- each batch leaf ``(B, ...)`` is viewed as ``(shards, k, B/(shards·k), ...)``
  (a free reshape: the rows of a shard stay on its devices), and the loss is
  ``jax.vmap``-ed over the shards with ``spmd_axis_name=data_axes`` (the vmapped
  dimension is pinned to the data axes) and the parameters unbatched;
- ``k = 1``: every parameter enters the loss through a ``custom_vjp`` *probe*.
  Its backward pass sees the leaf's per-shard cotangent ``g_i`` (batched over
  the shards), returns ``‖g_i‖²`` (float32) as the cotangent of a per-shard
  scalar, and passes ``g_i`` on: vmap's sum over the unbatched parameter gives
  the global gradient, leaf by leaf, as plain ``jax.grad`` would — the
  per-shard gradients exist only transiently;
- ``k > 1``: within each shard a ``lax.scan`` over its ``k`` micro-batches
  accumulates the shard's gradient locally (``vmap`` of ``grad``: batched over
  the shards) and each micro-batch's squared norm (as small per-block partial
  sums, so that a model-split leaf needs no cross-device sum inside the loop);
  the shards' sums are reduced once, after the loop;
- stacked layers (``k = 1``): a parameter leaf whose only use is as the
  scanned-over operand of a ``lax.scan`` is found in the loss's jaxpr (traced
  once on one shard's shapes) and probed per layer inside the scan body — inside
  the layer's ``jax.checkpoint`` if it has one — so its per-shard gradient exists
  one layer at a time and is reduced inside the backward loop, as ``jax.grad``
  reduces it. The partitioner cannot do this: the per-shard gradient of the
  whole stacked leaf is what a leaf-level probe sees;
- Explicit mesh axes (``jax.make_mesh``'s default): the computation runs under
  ``jax.sharding.auto_axes`` (Auto inside); ``grads`` come back with the
  parameters' shardings;
- two rewrites of the loss's jaxpr make a loss written for the global batch
  right on one sample's rows: shardings it names lose their data axes
  (``_explicit_loss``), and random draws shaped by the rows become the sample's
  slice of the global draw (``_global_draws``).
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale import _checks, _explicit_loss, _global_draws, _microbatch, _scan_probes
from optax_adascale._microbatch import MicrobatchStats
from optax_adascale._norms import STAT_DTYPE, compute_dtype, leaf_sq_norm, low_precision


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    data_axes: str | tuple[str, ...] | None = None,
    num_microbatches: int = 1,
    has_aux: bool = False,
    mesh: Any = None,
    unroll: int | bool = 1,
) -> Callable[..., tuple[Any, Any, MicrobatchStats]]:
    """Like ``jax.value_and_grad``, plus the statistics AdaScale needs: ``(value, grads, stats)``.

    **Global batch** (``data_axes`` set): call the returned function inside a
    ``jax.jit`` step over the global batch, with the mesh set by
    ``jax.set_mesh(mesh)`` (or passed as ``mesh=``). ``data_axes`` names the mesh
    axes the batch is sharded over. The gradient samples are each data shard's
    gradient, and with ``num_microbatches=k`` each of ``k`` contiguous
    micro-batches within a shard: ``n = shards × k`` samples, shard ``i`` holding
    rows ``i·B/shards … (i+1)·B/shards − 1`` (the rows a ``P(data_axes)`` sharding
    puts on it). Nothing in the user's code changes but the call::

        tx = optax_adascale.adascale_sgd(schedule, momentum=0.9)        # no axis_name
        grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads, stats = grad_fn(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), opt_state, loss

    - ``grads`` equals ``jax.value_and_grad(loss_fn)`` on the global batch for a
      loss that is an equal-weight mean over rows (float32 rounding): it is the
      mean of the ``n`` samples' gradients, and ``value`` the mean of their losses.
      A loss normalised by a count that differs between samples (tokens with a
      padding mask, MaxText's weights) is the *mean of per-sample means*, not the
      global weighted mean: return the weighted sum divided by a constant instead
      (e.g. the padded token count), or see ``docs/gspmd.md`` for the recipe.
    - ``stats`` is :class:`MicrobatchStats`: per leaf, the float32 mean over the
      ``n`` samples of ``‖g_i‖²``, and ``num_microbatches=n``. Pass it to an
      AdaScale ``tx`` built **without** ``axis_name``:
      ``tx.update(grads, opt_state, params, microbatch_stats=stats)``. Without
      ``microbatch_stats`` the tx sees one sample and is plain SGD at gain 1.
    - ``aux`` (``has_aux=True``): leaves whose leading dimension is the rows of a
      sample (per-example outputs) come back in the global batch's row order;
      every other floating leaf is averaged over the ``n`` samples (equal to the
      global call for batch means); other leaves are the first sample's.
    - Random draws inside the loss are the global call's: a draw shaped by the
      rows (a dropout mask from a key closed over, or passed as a scalar batch
      argument — scalar leaves go to every sample as they are) gives each sample
      its rows of the global draw (partitionable threefry, JAX's default; a
      ``ValueError`` for ``rbg`` keys or with it off). Other draws are unchanged.
    - Parameters may be replicated, split over model axes (TP), over the data
      axes (FSDP) or both: the partitioner keeps their shardings; statistics are
      computed in float32 for bfloat16 parameters. Stacked layers applied with
      ``lax.scan`` (with or without ``jax.checkpoint``) are probed layer by layer.
    - Meshes with Auto or Explicit axes. A loss may name shardings the Explicit
      way (``out_sharding=``, ``reshard``, constraints, with the batch axis among
      them) or constrain the batch axis on an Auto mesh: the data axes are
      dropped from its shardings, the model axes kept (``docs/gspmd.md``).

    **Your own micro-batch loop** (MaxText's scan, Levanter's ``microbatched``):
    the simplest is ``num_microbatches=k``, which reduces once per step. To keep
    the loop, call this function per micro-batch and sum ``grads`` and
    ``stats.sq_norms``; then pass ``grads / k`` and
    ``MicrobatchStats(sq_sum / k, num_microbatches=shards * k)``. Each
    micro-batch's gradient is then reduced inside the loop (``k`` reductions
    instead of 1): ``‖g_j‖²`` needs it. With ``jax.value_and_grad`` in the loop,
    the samples are the ``k`` global micro-batches:
    ``MicrobatchStats(mean_j ‖g_j‖², num_microbatches=k)``. Weighted losses
    (token counts): make each sample's loss its weighted *sum* times ``n / W``
    (``W`` the batch's total weight), so that the samples' mean is the global
    weighted gradient. Details and measurements: ``docs/gspmd.md``.

    **Per replica** (``data_axes=None``): inside ``shard_map``, ``pmap`` or
    ``vmap`` the batch is already the replica's; the ``k`` micro-batches are the
    samples (``n = k``) and the tx has ``axis_name`` set. Under ``shard_map``
    mark the parameters varying first: ``jax.lax.pcast(params, axis, to="varying")``.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)``); every
        leaf of ``batch`` but scalars (a PRNG key) has the batch as its leading
        dimension.
      data_axes: mesh axis name(s) the batch is sharded over, or ``None``.
      num_microbatches: ``k ≥ 1`` micro-batches per shard (per replica).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      mesh: the mesh, if not set by ``jax.set_mesh``.
      unroll: passed to the micro-batch ``lax.scan``. ``True`` trades compile
        time and memory for speed where loop bodies run slowly (XLA:CPU
        convolutions).

    Returns:
      ``fn(params, *batch) -> (value, grads, stats)``.

    Raises:
      ValueError: the batch is not divisible by shards × k; ``data_axes`` not in
        the mesh; no mesh set; ``data_axes=None`` under a jit over a
        multi-device mesh with no replica axis bound; a loss naming axes in
        ``out_sharding=`` that does not trace the Explicit way on one shard's
        rows; a row-shaped random draw that cannot be sliced (``rbg`` key,
        threefry not partitionable, inside a ``custom_vjp``).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax_adascale
      >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=2, mesh=mesh))
      >>> value, grads, stats = fn(jnp.ones(2), jnp.array([[1.0, 0.0], [0.0, 1.0]]))
      >>> grads, stats.sq_norms, stats.num_microbatches
      (Array([0.5, 0.5], dtype=float32), Array(1., dtype=float32), 2)
    """
    _checks.check_static_int("num_microbatches", num_microbatches)
    _checks.check_bool("has_aux", has_aux)
    if data_axes is None:
        per_replica = _microbatch.per_replica(loss_fn, num_microbatches, has_aux=has_aux, unroll=unroll)

        def replica_fn(params, *batch):
            _checks.check_replica_axis_bound(mesh, (params, batch))
            value, grads, stats = per_replica(params, *batch)
            if has_aux:  # aux stacked over the k micro-batches: combined as for the global batch
                loss, aux = value
                per = _checks.batch_rows(batch, 1, num_microbatches) // num_microbatches
                value = (loss, _combine_aux(jax.tree.map(lambda a: a[None], aux), 1, num_microbatches, per))
            return value, grads, stats

        return replica_fn
    names = _checks.data_axis_names(data_axes)
    k = num_microbatches

    def fn(params, *batch):
        the_mesh = _checks.resolve_mesh(mesh, names)
        explicit = tuple(
            a for a, t in zip(the_mesh.axis_names, the_mesh.axis_types, strict=True) if "Explicit" in str(t)
        )
        shards = math.prod(the_mesh.shape[a] for a in names)
        n = shards * k
        per = _checks.batch_rows(batch, shards, k) // n
        # Shardings named in the loss (out_sharding=, reshard, constraints): data axes dropped (_explicit_loss).
        loss, not_explicit = _explicit_loss.rewrite(loss_fn, params, batch, per, names, the_mesh, bool(explicit))
        loss = loss or loss_fn
        if explicit:
            aux_specs = None
            if has_aux:  # per-example leaves come back split like the batch, the rest replicated
                shard_shapes = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct((per,) + x.shape[1:] if jnp.ndim(x) else (), x.dtype), batch
                )
                param_shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
                sizes = tuple(the_mesh.shape[a] for a in the_mesh.axis_names)
                auto = (jax.sharding.AxisType.Auto,) * len(sizes)  # as the loss runs: under auto_axes
                with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(sizes, the_mesh.axis_names, auto)):
                    aux = jax.eval_shape(lambda p, b: loss(p, *b)[1], param_shapes, shard_shapes)
                spec = jax.sharding.PartitionSpec(names if len(names) > 1 else names[0])
                aux_specs = jax.tree.map(
                    lambda a: spec if len(a.shape) >= 1 and a.shape[0] == per else jax.sharding.PartitionSpec(), aux
                )
            explicit_fn = functools.partial(auto_fn, loss)
            return _on_explicit_mesh(explicit_fn, the_mesh, explicit, n, aux_specs, params, batch, not_explicit)
        return auto_fn(loss, params, *batch)

    def auto_fn(loss, params, *batch):
        the_mesh = _checks.resolve_mesh(mesh, names)
        shards = math.prod(the_mesh.shape[a] for a in names)
        spmd = names[0] if len(names) == 1 else names
        n = shards * k
        loss, batch = _close_over_scalars(loss, batch)
        rows = _checks.batch_rows(batch, shards, k)
        per = rows // n
        leaves, treedef = jax.tree.flatten(params)
        sample_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((per,) + x.shape[1:], x.dtype), batch)
        global_draws = _global_draws.rewrite(loss, leaves, treedef, sample_shapes, per, n)
        if global_draws is not None:  # the rewritten loss reads its sample from the rows' global numbers
            loss, batch = global_draws, (*batch, jnp.arange(rows, dtype=jnp.int32))
        split = jax.tree.map(lambda x: x.reshape((shards, k, per) + x.shape[1:]), batch)
        try:
            if k == 1:
                value, aux, grads, sq = _probed(loss, has_aux, spmd, params, split, n)
            else:
                other = math.prod(size for a, size in the_mesh.shape.items() if a not in names)
                value, aux, grads, sq = _scanned(loss, has_aux, spmd, params, split, n, unroll, other)
        except ValueError as err:
            if "spmd_axis_name" not in str(err):
                raise
            raise ValueError(
                f"loss_fn constrains an array's sharding over the data axes {names} inside a jax.custom_jvp or "
                "jax.custom_vjp function: value_and_grad(data_axes=...) evaluates loss_fn on one data shard's rows "
                "at a time and drops the data axes from the loss's shardings, but not inside those. Drop the data "
                "axes there (keep the model axes, e.g. P(None, 'model')); the batch stays sharded over them."
            ) from err
        stats = MicrobatchStats(sq, n)
        if has_aux:
            return (value, _combine_aux(aux, shards, k, per)), grads, stats
        return value, grads, stats

    return fn


def _on_explicit_mesh(auto_fn, mesh, explicit, n, aux_specs, params, batch, not_explicit=None):
    """Explicit mesh axes: the computation runs with them Auto inside (``jax.sharding.auto_axes``).

    The outputs come back Explicit: ``grads`` sharded like ``params`` (their types carry the specs),
    the value and statistics replicated, per-example ``aux`` leaves split like the batch.
    ``not_explicit``: why the loss's shardings could not be read the Explicit way (for the error).
    """
    from jax.sharding import PartitionSpec as P

    param_specs = jax.tree.map(lambda p: jax.typeof(p).sharding.spec, params)
    value_spec = P() if aux_specs is None else (P(), aux_specs)
    out = (value_spec, param_specs, MicrobatchStats(jax.tree.map(lambda _: P(), params), n))
    try:
        if jax.sharding.get_abstract_mesh().empty:  # mesh= given, none set: auto_axes reads the context's
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.sharding.auto_axes(auto_fn, axes=explicit, out_sharding=out)(params, *batch)
        return jax.sharding.auto_axes(auto_fn, axes=explicit, out_sharding=out)(params, *batch)
    except ValueError as err:
        if "type Auto" not in str(err):
            raise
        where = (
            f"it does not trace the Explicit way on one data shard's rows ({not_explicit})"
            if not_explicit is not None
            else "inside a jax.custom_jvp / jax.custom_vjp function, where value_and_grad cannot rewrite them"
        )
        raise ValueError(
            f"loss_fn names the Explicit mesh axes {explicit} in an out_sharding= (or reshard), but {where}; "
            "value_and_grad(data_axes=...) then runs it with the axes Auto (jax.sharding.auto_axes), where JAX "
            "refuses such specs. Make loss_fn valid on the Explicit mesh for one shard's rows, or drop "
            "out_sharding= from its operations, or build the mesh with "
            f"axis_types=(jax.sharding.AxisType.Auto,) * {len(mesh.axis_names)}."
        ) from err


# --------------------------------------------------------------------------- k = 1: probes


def _probed(loss_fn, has_aux, spmd, params, split, n):
    """One sample per shard: grads through probes; the per-shard gradients are reduced leaf by leaf.

    A stacked leaf whose only use is as ``xs`` of a ``lax.scan`` (scanned layers) is probed per layer
    inside the scan body instead (:func:`_scan_probes.probed_loss`), so that its per-shard gradient exists one
    layer at a time and is reduced inside the backward loop, as ``jax.grad`` reduces it.
    """
    leaves, treedef = jax.tree.flatten(params)
    scanned = _scan_probes.probed_loss(loss_fn, has_aux, treedef, leaves, split)
    stacked = set() if scanned is None else scanned[1]
    probes = [jnp.zeros((n, p.shape[0]) if i in stacked else (n,), STAT_DTYPE) for i, p in enumerate(leaves)]

    def shard_loss(leaves, layer_probes, batch):
        batch = jax.tree.map(lambda x: x[0], batch)
        if scanned is None:
            out = loss_fn(treedef.unflatten(leaves), *batch)
        else:
            out = scanned[0](leaves, batch, layer_probes, n)
        loss, aux = out if has_aux else (out, None)
        return loss, (loss, aux)

    def total(leaves, probes):
        spread = [p if i in stacked else _spread(p, q) for i, (p, q) in enumerate(zip(leaves, probes, strict=True))]
        leaf_axes = [None if i in stacked else 0 for i in range(len(leaves))]
        layer_probes = {i: probes[i] for i in stacked}
        losses, (per_loss, aux) = jax.vmap(shard_loss, in_axes=(leaf_axes, 0, 0), spmd_axis_name=spmd)(
            spread, layer_probes, split
        )
        return jnp.sum(losses), (per_loss, aux)

    (_, (losses, aux)), (grad_leaves, sq) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(leaves, probes)
    grads = [g if low_precision(g) else g / n for g in grad_leaves]
    sq_norms = [jnp.sum(s) / n for s in sq]
    aux = None if aux is None else jax.tree.map(lambda a: a[:, None], aux)  # (shards, k=1, ...)
    return jnp.mean(losses), aux, treedef.unflatten(grads), treedef.unflatten(sq_norms)


@jax.custom_vjp
def _spread(param, probe):
    """``param`` repeated once per shard (``(n, *shape)``); the backward pass records each shard's ``‖g_i‖²``."""
    return jnp.broadcast_to(param, probe.shape + param.shape)


def _spread_fwd(param, probe):
    return _spread(param, probe), None


def _spread_bwd(_, cotangent):
    # cotangent: (n, *shape), row i = shard i's gradient. 16-bit gradients are divided by n before the sum
    # (as reduce_statistics does); wider ones are divided after it, by the caller.
    n = cotangent.shape[0]
    sq = jax.vmap(leaf_sq_norm)(cotangent)
    summed = jnp.sum((cotangent / n).astype(cotangent.dtype) if low_precision(cotangent) else cotangent, axis=0)
    return summed.astype(cotangent.dtype), sq


_spread.defvjp(_spread_fwd, _spread_bwd)


# --------------------------------------------------------------------------- k > 1: scan within a shard


def _scanned(loss_fn, has_aux, spmd, params, split, n, unroll=1, other=1):
    """``k`` micro-batches per shard: local accumulation in a scan, one reduction after it.

    ``‖g_j‖²`` is accumulated as per-block partial sums (:func:`_blocked_sq`) so that a leaf split over
    the other (model) axes, of total size ``other``, needs no reduction over them inside the loop.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def shard(micro):  # (k, m, ...) per leaf

        def body(carry, mb):
            grad_sum, sq_sum = carry
            value, grads = grad_fn(params, *mb)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
            sq_sum = jax.tree.map(lambda s, g: s + _blocked_sq(g, other), sq_sum, grads)
            return (grad_sum, sq_sum), value

        grads0 = jax.tree.map(lambda p: jnp.zeros(p.shape, compute_dtype(p.dtype)), params)
        sq0 = jax.tree.map(lambda p: jnp.zeros(_blocks(p.shape, other), STAT_DTYPE), params)
        (grad_sum, sq_sum), values = lax.scan(body, (grads0, sq0), micro, unroll=unroll)
        return grad_sum, sq_sum, values

    grad_sums, sq_sums, values = jax.vmap(shard, spmd_axis_name=spmd)(split)
    grads = jax.tree.map(lambda s, p: (jnp.sum(s, axis=0) / n).astype(p.dtype), grad_sums, params)
    sq_norms = jax.tree.map(lambda s: jnp.sum(s) / n, sq_sums)  # the one reduction over the model axes
    if has_aux:
        losses, aux = values
    else:
        losses, aux = values, None
    return jnp.mean(losses), aux, grads, sq_norms


def _blocks(shape, other):
    return tuple(math.gcd(d, other) for d in shape)


def _blocked_sq(g, other):
    """``‖g‖²`` as a small array of partial sums: dimension ``d`` cut into ``gcd(d, other)`` blocks.

    A dimension sharded over mesh axes of total size dividing ``other`` keeps its blocks on their
    devices, so each device sums only its own elements and the partial sums stay sharded; the scalar
    (one reduction across devices) is taken once, after the micro-batch loop.
    """
    x = g.astype(compute_dtype(g.dtype))
    sq = jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x
    blocks = _blocks(g.shape, other)
    split = [s for d, c in zip(g.shape, blocks, strict=True) for s in (c, d // c)]
    return jnp.sum(sq.reshape(split), axis=tuple(range(1, 2 * g.ndim, 2))).astype(STAT_DTYPE)


# --------------------------------------------------------------------------- aux


def _combine_aux(aux, shards, k, per):
    """Per-example leaves back in global row order; every other leaf averaged over the samples."""

    def combine(a):
        a = jnp.asarray(a)
        if a.ndim >= 3 and a.shape[2] == per:
            return a.reshape((shards * k * per,) + a.shape[3:])
        return jnp.mean(a, axis=(0, 1)) if jnp.issubdtype(a.dtype, jnp.inexact) else a[0, 0]

    return jax.tree.map(combine, aux)


def _close_over_scalars(loss_fn, batch):
    """Scalar leaves of the batch (a PRNG key, a step number) go to every sample as they are: closed over."""
    leaves, tree = jax.tree.flatten(batch)
    scalars = {i: x for i, x in enumerate(leaves) if not jnp.ndim(x)}
    if not scalars:
        return loss_fn, batch

    def loss(params, *rows):
        it = iter(rows)
        return loss_fn(params, *tree.unflatten([scalars[i] if i in scalars else next(it) for i in range(len(leaves))]))

    return loss, [x for i, x in enumerate(leaves) if i not in scalars]
