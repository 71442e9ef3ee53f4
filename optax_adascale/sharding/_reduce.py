"""How the gradient is reduced: a strategy object the factory chooses once.

* :class:`AllReduce` — the replicated update: one ``psum`` of (gradients, squared
  norms) over the data axes (nothing without them: the statistics are this call's
  own, or arrive already reduced from the GSPMD drop-in), then :func:`_step.apply`.
* :class:`ZeroRows` — ``shard_optimizer_state=n`` (ZeRO, FairScale's
  ``AdaScale(OSS)``): reduce-scatter, the statistics in one scalar ``psum``,
  :func:`_step.apply` on this replica's row, all-gather.
* :class:`FsdpRows` — the same rows when the samples say the gradients already are
  rows (FSDP probes, ``Samples.rows``): no reduce-scatter, no all-gather.

Each answers ``init_inner`` (the inner state's layout), ``for_samples`` (the strategy
this call's samples take), ``check`` (what the call's axes and state must be) and
``step``. With parameters split over model axes, the
``inner`` transformation sees shards and gets ``base_steps.sq_norm`` and
``base_steps.sums``, which sum over them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale.core import _axes, _clock, _collect, _norms, _probe, _samples, _step
from optax_adascale.sharding import _tensor, _zero


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """The replicated update: one ``psum`` of (gradients, squared norms) over the data axes, then :func:`apply`.

    Without data axes (``axis_name=None``) nothing is reduced: the gradients and
    statistics are this call's own, or arrive already reduced (the GSPMD drop-in).
    """

    def init_inner(self, inner: optax.GradientTransformationExtraArgs, params: Any) -> Any:
        return inner.init(params)

    def for_samples(self, samples: _samples.Samples) -> AllReduce:
        if samples.rows:
            raise ValueError(
                "microbatch_stats come from fsdp_probes (the gradients are already reduce-scattered rows), "
                "which needs the ZeRO layout: adascale(..., shard_optimizer_state=n)."
            )
        return self

    def check(self, axes: _axes.Axes, state: Any, params: Any) -> None:
        del axes, state, params

    def step(
        self,
        update: _step.Update,
        shape: _step.Shape,
        local_grads,
        local_sq,
        state,
        params,
        extra_args,
        samples: _samples.Samples,
    ):
        model = shape.axes.model
        sq_norm = _clock.local_sq_norm
        if model.axes:  # inner sees each device's piece of a split leaf: it must be shard-safe
            _tensor.check_model_split(update.inner, local_grads, model)
            sq_norm = _tensor.sq_norm_fn(jax.tree.structure(local_grads), model)
        with jax.named_scope("adascale/reduce"):
            mean, a, b, probe = _collect.reduce_statistics(
                local_grads,
                local_sq,
                shape.axes,
                shape.groups,
                samples.weights,
                samples.mean_sq,
                _guard(state.inner_state, local_grads, params),
                samples.specs,
            )
        reduced = _step.Reduced(probe, sq_norm)
        new_updates, new_state = _step.apply(update, shape, mean, a, b, state, params, extra_args, reduced)
        return new_updates, _samples.count_altered(a, state, new_state)


# --------------------------------------------------------------------------- ZeRO rows


@dataclasses.dataclass(frozen=True)
class ZeroRows:
    """The sharded update (``shard_optimizer_state=n``): reduce-scatter, statistics in one scalar psum,
    :func:`_step.apply` on this replica's row, all-gather."""

    num_replicas: int

    def init_inner(self, inner: optax.GradientTransformationExtraArgs, params: Any) -> _zero.ShardedInnerState:
        return _zero.init_inner(inner, params, self.num_replicas)

    def for_samples(self, samples: _samples.Samples) -> ZeroRows | FsdpRows:
        return FsdpRows(self.num_replicas) if samples.rows else self

    def check(self, axes: _axes.Axes, state: Any, params: Any) -> None:
        _check_rows(self.num_replicas, axes, state)
        # FSDP rows (fsdp_shard, placed with P(axis)) are (1, m) slices varying over the data axes;
        # replicated parameters, pcast or not, keep their own shapes.
        leaves = [] if params is None else jax.tree.leaves(params)
        rows = bool(leaves) and all(jnp.ndim(p) == 2 and jnp.shape(p)[0] == 1 for p in leaves)
        split = [
            name
            for name in axes.data
            if rows and _axes.vma_checked(name) and all(name in _axes.varying_axes(p) for p in leaves)
        ]
        if split:
            raise ValueError(
                f"the parameters vary over the data axes {split}: they are FSDP rows (fsdp_shard), so the "
                "gradients reaching update are already reduce-scattered and the per-replica squared norms are "
                "lost. Differentiate with respect to optax_adascale.fsdp_probes(rows, axis) too and pass "
                "the probes' gradients: tx.update(grads, opt_state, rows, microbatch_stats=probe_grads)."
            )

    def step(self, update: _step.Update, shape: _step.Shape, local_grads, local_sq, state, params, extra_args, samples):
        del samples  # weights: refused with shard_optimizer_state; mean_sq: only from the GSPMD drop-in
        axis, n = shape.axes.data, shape.axes.replicas
        low = _norms.low_precision
        with jax.named_scope("adascale/reduce_scatter"):
            flat = jax.tree.map(lambda g: jnp.ravel(_zero.to_rows(g / n if low(g) else g, n)), local_grads)
            sums = lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)
            mean = jax.tree.map(lambda s: s if low(s) else s / n, sums)
        param_rows = None
        if params is not None:
            index = lax.axis_index(axis)
            param_rows = jax.tree.map(
                lambda p: lax.dynamic_index_in_dim(_zero.to_rows(p, n), index, keepdims=False), params
            )
        row_updates, new_state = _row_step(update, shape, mean, local_sq, state, param_rows, extra_args)
        with jax.named_scope("adascale/all_gather"):
            gathered = _all_gather(row_updates, axis)
            updates = jax.tree.map(lambda u, g: _zero.from_rows(u, g).astype(u.dtype), gathered, local_grads)
        return updates, new_state


@dataclasses.dataclass(frozen=True)
class FsdpRows:
    """ZeRO rows whose gradients arrive reduce-scattered (FSDP: :func:`optax_adascale.fsdp_gather`'s backward
    pass summed them over the replicas, its probes took the per-replica squared norms): the row update alone."""

    num_replicas: int

    def check(self, axes: _axes.Axes, state: Any, params: Any) -> None:
        _check_rows(self.num_replicas, axes, state)
        if params is None:
            raise ValueError(
                "FSDP statistics (fsdp_probes) need the parameter rows: "
                "tx.update(grads, opt_state, rows, microbatch_stats=stats)"
            )

    def step(self, update: _step.Update, shape: _step.Shape, local_grads, local_sq, state, params, extra_args, samples):
        del samples
        n = shape.axes.replicas
        mean = jax.tree.map(lambda g: jnp.ravel(g) / n, local_grads)
        param_rows = jax.tree.map(jnp.ravel, params)
        row_updates, new_state = _row_step(update, shape, mean, local_sq, state, param_rows, extra_args)
        return jax.tree.map(lambda u, g: jnp.reshape(u, g.shape), row_updates, local_grads), new_state


def _check_rows(num_replicas: int, axes: _axes.Axes, state: Any) -> None:
    # Traced under optax.inject_hyperparams (an int of the factory made an array): n is the axes' size here.
    if isinstance(num_replicas, int) and axes.replicas != num_replicas:
        raise ValueError(
            f"shard_optimizer_state={num_replicas} but the data axes {axes.name!r} have {axes.replicas} "
            "replicas here; pass shard_optimizer_state equal to the data-parallel size."
        )
    if not isinstance(state.inner_state, _zero.ShardedInnerState):
        raise ValueError("opt_state was not made by a transformation with shard_optimizer_state set")


def _row_step(update: _step.Update, shape: _step.Shape, mean, local_sq, state, param_rows, extra_args):
    """The statistics (one scalar psum over the data, then the model axes) and :func:`_step.apply` on this
    replica's rows of the inner state."""
    axis, n = shape.axes.data, shape.axes.replicas
    groups, model = shape.groups, shape.axes.model
    b_local = groups.sums(model.mask([_norms.leaf_sq_norm(s) for s in jax.tree.leaves(mean)]))
    lead = _local_lead(state.inner_state.rows)
    shard_state = state._replace(
        inner_state=jax.tree.map(
            lambda x: jnp.reshape(x, x.shape[len(lead) :]) if jnp.ndim(x) else x, state.inner_state.rows
        )
    )
    guard = _guard(shard_state.inner_state, mean, param_rows)
    if guard is None:
        a, b = lax.psum((local_sq / n, b_local), axis)
        a, b = model.psum((a, b))
        probe = None
    else:  # the guard's probe on this replica's rows, summed over the rows in the statistics' own psum
        local = _probe.probe_dots(jax.tree.leaves(mean), guard.trace, guard.params)
        a, b, probe = lax.psum((local_sq / n, b_local, jnp.stack(model.mask(list(local)))), axis)
        a, b, probe = model.psum((a, b, probe))
    reduced = _step.Reduced(probe, _tensor.sq_norm_fn(jax.tree.structure(mean), model, axis))
    row_updates, new_state = _step.apply(update, shape, mean, a, b, shard_state, param_rows, extra_args, reduced)
    new_state = _samples.count_altered(a, shard_state, new_state)
    new_rows = jax.tree.map(
        lambda x, old: jnp.reshape(x, old.shape) if jnp.ndim(old) else x,
        new_state.inner_state,
        state.inner_state.rows,
    )
    return row_updates, new_state._replace(inner_state=_zero.ShardedInnerState(new_rows))


def _guard(inner_state: Any, grads: Any, params: Any) -> _collect.Guard | None:
    """The guarded τ-clock trace's buffer and the params as leaf lists shaped like ``grads``, or ``None``."""
    trace = _clock.guarded_trace(inner_state)
    if trace is None:
        return None
    treedef = jax.tree.structure(grads)
    return _collect.Guard(treedef.flatten_up_to(trace), None if params is None else treedef.flatten_up_to(params))


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
    names = _axes.axis_names(axis)
    if all(_axes.vma_checked(name) for name in names):
        return lax.all_gather(tree, axis, axis=0, tiled=True, to="invarying")
    return lax.all_gather(tree, axis, axis=0, tiled=True)
