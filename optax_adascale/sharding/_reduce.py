"""How the gradient is reduced: a strategy object the factory chooses once.

* :class:`AllReduce` — the replicated update: one ``psum`` of (gradients, squared
  norms) over the data axes (nothing without them: the statistics are this call's
  own, or arrive already reduced from the GSPMD drop-in), then :func:`_step.apply`.
* :class:`ZeroRows` — ``shard_optimizer_state=n`` (ZeRO, FairScale's
  ``AdaScale(OSS)``): reduce-scatter, the statistics in one scalar ``psum``,
  :func:`_step.apply` on this replica's row, all-gather; FSDP statistics skip both
  collectives.

Both answer ``init_inner`` (the inner state's layout), ``check`` (what the call's
axes and state must be) and ``step``. With parameters split over model axes, the
``inner`` transformation sees shards and gets ``adascale_sq_norm``, the squared
norm summed over them.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale.core import _collect, _norms, _step
from optax_adascale.sharding import _tensor, _zero


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """The replicated update: one ``psum`` of (gradients, squared norms) over the data axes, then :func:`apply`.

    Without data axes (``axis_name=None``) nothing is reduced: the gradients and
    statistics are this call's own, or arrive already reduced (the GSPMD drop-in).
    """

    def init_inner(self, inner: optax.GradientTransformationExtraArgs, params: Any) -> Any:
        return inner.init(params)

    def check(self, axes: _collect.Axes, state: Any, params: Any, scattered: bool) -> None:
        if scattered:
            raise ValueError(
                "microbatch_stats come from fsdp_probes (the gradients are already reduce-scattered rows), "
                "which needs the ZeRO layout: adascale(..., shard_optimizer_state=n)."
            )

    def step(
        self,
        update: _step.Update,
        shape: _step.Shape,
        local_grads,
        local_sq,
        state,
        params,
        extra_args,
        *,
        weights=None,
        scattered: bool = False,
        mean_sq=None,
    ):
        del scattered
        model = shape.axes.model
        if model.axes:  # inner sees each device's piece of a split leaf: it must be shard-safe
            _tensor.check_model_split(update.inner, local_grads, model)
            extra_args = dict(extra_args, adascale_sq_norm=_tensor.sq_norm_fn(jax.tree.structure(local_grads), model))
        with jax.named_scope("adascale/reduce"):
            mean, a, b = _collect.reduce_statistics(local_grads, local_sq, shape.axes, shape.groups, weights, mean_sq)
        return _step.apply(update, shape, mean, a, b, state, params, extra_args)


# --------------------------------------------------------------------------- ZeRO rows


@dataclasses.dataclass(frozen=True)
class ZeroRows:
    """The sharded update (``shard_optimizer_state=n``): reduce-scatter, statistics in one scalar psum,
    :func:`_step.apply` on this replica's row, all-gather.

    With FSDP statistics (``scattered``: :func:`optax_adascale.fsdp_gather`'s probes) the
    gradients and ``params`` are already this replica's rows, the gradients summed over
    the replicas by the gather's backward pass: no reduce-scatter, no all-gather.
    """

    num_replicas: int

    def init_inner(self, inner: optax.GradientTransformationExtraArgs, params: Any) -> _zero.ShardedInnerState:
        return _zero.init_inner(inner, params, self.num_replicas)

    def check(self, axes: _collect.Axes, state: Any, params: Any, scattered: bool) -> None:
        if axes.replicas != self.num_replicas:
            raise ValueError(
                f"shard_optimizer_state={self.num_replicas} but the data axes {axes.name!r} have {axes.replicas} "
                "replicas here; pass shard_optimizer_state equal to the data-parallel size."
            )
        if not isinstance(state.inner_state, _zero.ShardedInnerState):
            raise ValueError("opt_state was not made by a transformation with shard_optimizer_state set")
        if scattered:
            if params is None:
                raise ValueError(
                    "FSDP statistics (fsdp_probes) need the parameter rows: "
                    "tx.update(grads, opt_state, rows, microbatch_stats=stats)"
                )
            return
        # FSDP rows (fsdp_shard, placed with P(axis)) are (1, m) slices varying over the data axes;
        # replicated parameters, pcast or not, keep their own shapes.
        leaves = [] if params is None else jax.tree.leaves(params)
        rows = bool(leaves) and all(jnp.ndim(p) == 2 and jnp.shape(p)[0] == 1 for p in leaves)
        split = [
            name
            for name in axes.data
            if rows and _collect.vma_checked(name) and all(name in _collect.varying_axes(p) for p in leaves)
        ]
        if split:
            raise ValueError(
                f"the parameters vary over the data axes {split}: they are FSDP rows (fsdp_shard), so the "
                "gradients reaching update are already reduce-scattered and the per-replica squared norms are "
                "lost. Differentiate with respect to optax_adascale.fsdp_probes(rows, axis) too and pass "
                "the probes' gradients: tx.update(grads, opt_state, rows, microbatch_stats=probe_grads)."
            )

    def step(
        self,
        update: _step.Update,
        shape: _step.Shape,
        local_grads,
        local_sq,
        state,
        params,
        extra_args,
        *,
        weights=None,
        scattered: bool = False,
        mean_sq=None,
    ):
        del weights, mean_sq  # weights: refused with shard_optimizer_state; mean_sq: only from the GSPMD drop-in
        axis, n = shape.axes.data, shape.axes.replicas
        groups, model = shape.groups, shape.axes.model
        low = _norms.low_precision
        lead = _local_lead(state.inner_state.rows)

        with jax.named_scope("adascale/reduce_scatter"):
            if scattered:
                mean = jax.tree.map(lambda g: jnp.ravel(g) / n, local_grads)
            else:
                flat = jax.tree.map(lambda g: jnp.ravel(_zero.to_rows(g / n if low(g) else g, n)), local_grads)
                sums = lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
                mean = jax.tree.map(lambda s: s if low(s) else s / n, sums)
            b_local = groups.sums(model.mask([_norms.leaf_sq_norm(s) for s in jax.tree.leaves(mean)]))
            a, b = lax.psum((local_sq / n, b_local), axis)
            a, b = model.psum((a, b))
        param_rows = None
        if params is not None and scattered:
            param_rows = jax.tree.map(jnp.ravel, params)
        elif params is not None:
            index = lax.axis_index(axis)
            param_rows = jax.tree.map(
                lambda p: lax.dynamic_index_in_dim(_zero.to_rows(p, n), index, keepdims=False), params
            )
        shard_state = state._replace(
            inner_state=jax.tree.map(
                lambda x: jnp.reshape(x, x.shape[len(lead) :]) if jnp.ndim(x) else x, state.inner_state.rows
            )
        )
        extra = dict(extra_args, adascale_sq_norm=_tensor.sq_norm_fn(jax.tree.structure(mean), model, axis))
        row_updates, new_state = _step.apply(update, shape, mean, a, b, shard_state, param_rows, extra)
        new_rows = jax.tree.map(
            lambda x, old: jnp.reshape(x, old.shape) if jnp.ndim(old) else x,
            new_state.inner_state,
            state.inner_state.rows,
        )
        new_state = new_state._replace(inner_state=_zero.ShardedInnerState(new_rows))
        if scattered:
            return jax.tree.map(lambda u, g: jnp.reshape(u, g.shape), row_updates, local_grads), new_state
        with jax.named_scope("adascale/all_gather"):
            gathered = _all_gather(row_updates, axis)
            updates = jax.tree.map(lambda u, g: _zero.from_rows(u, g).astype(u.dtype), gathered, local_grads)
        return updates, new_state


def _local_lead(rows: Any) -> tuple[int, ...]:
    """The leading dims of this replica's view of a row: ``(1,)`` under shard_map, ``()`` under vmap/pmap."""
    for x in jax.tree.leaves(rows):
        if jnp.ndim(x) == 2:
            return (1,)
        if jnp.ndim(x) == 1:
            return ()
    return ()


def _all_gather(tree: Any, axis: Any) -> Any:
    """All-gather rows into the full flat vector; under shard_map's type checks, replica-invariant."""
    names = _collect.axis_names(axis)
    if all(_collect.vma_checked(name) for name in names):
        return lax.all_gather(tree, axis, axis=0, tiled=True, to="invarying")
    return lax.all_gather(tree, axis, axis=0, tiled=True)
