"""This call's gradient samples, one object for every way they come in.

A sample is one gradient whose spread AdaScale measures: a replica's gradient (``axis_name``), one of its ``k``
micro-batches' (``value_and_grad(..., num_microbatches=k)``), a data shard's per-copy contribution (the GSPMD
drop-in), an accumulated call (``accumulation_steps``), or an FSDP replica's probe. Outside statistics arrive as
:class:`MicrobatchStats` (``update(..., microbatch_stats=)``, the one keyword); :meth:`Samples.of` turns the
call's gradients and statistics into :class:`Samples`, which says how many samples this replica holds, their
squared norms, whether ``‖ḡ‖²`` was already taken where they were (the drop-in), and whether the gradients are
ZeRO rows already reduce-scattered (FSDP): the reduction strategy is chosen from that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_adascale.core import _axes, _norms

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MicrobatchStats:
    """Second moment of a replica's micro-batch gradients, for ``update(..., microbatch_stats=)``.

    The one way statistics computed outside the optimizer enter ``update``:
    ``tx.update(grads, opt_state, params, microbatch_stats=stats)``. Made by
    :func:`value_and_grad` (micro-batches within a replica, or a jit over the
    global batch) and by differentiating :func:`fsdp_probes` (FSDP).

    Attributes:
      sq_norms: pytree shaped like the gradients; each leaf is the float32 mean
        over the samples of that leaf's squared norm, ``mean_j ‖g_j‖²``.
      num_microbatches: ``k``, static: the samples behind ``grads``. An update
        sees ``n = k × replicas × accumulation_steps``.
      fsdp: static; ``True`` for the gradients of :func:`fsdp_probes`: the
        gradients passed with them are already reduce-scattered ZeRO rows (the
        update then takes the FSDP reduction, :class:`Samples` ``.rows``).
      mean_sq_norms: ``None``, or a pytree shaped like the gradients: each leaf's
        ``‖ḡ‖²`` (float32) of the samples' true mean, taken where the samples were
        (the GSPMD drop-in). ``update`` then reads ``b`` here instead of from the
        gradients it is given, so clipping or scaling them first leaves the gain right. Accumulating
        across calls (``accumulation_steps > 1``, a :class:`BatchRamp`), ``b`` is that of the mean of
        the gradients ``update`` is given, and these values tell whether they are the ones measured
        (:data:`ALTERED_RTOL`): changed gradients skip the update (``metrics()``'s
        ``skipped_altered_grads_steps``; :func:`done` raises naming the fix).
      rows: static; ``None``, or the first dimensions of the arrays the drop-in (global batch) was called with
        besides the differentiated ones (the batch's rows among them). Under a :class:`BatchRamp`, whose
        micro-batch is fixed, ``update`` warns when a call brings other sizes (a loader feeding the whole
        update's batch every call).
      grad_sq_norms: ``None``, or a pytree shaped like the gradients: each leaf's ``‖g‖²`` (float32) of the
        gradients returned with these statistics (this replica's mean of its samples), as
        :func:`value_and_grad` with ``data_axes=None`` sets it. ``update`` compares the gradients it is given
        with them (:data:`ALTERED_RTOL`), on each replica and with no extra collective: gradients clipped,
        scaled or otherwise changed in between (a clip chained *before* AdaScale) would leave ``b`` without
        ``a``'s clip and inflate the variance, so the update is skipped on every replica (``metrics()``'s
        ``skipped_altered_grads_steps``; :func:`done` raises naming the fix: clip inside ``inner``).
        Statistics built by hand are checked the same way when they carry it.
      specs: static; ``None``, or per leaf (in ``jax.tree.leaves`` order) the ``PartitionSpec`` the gradients are
        laid out by on a mesh with Auto axes (the drop-in's ``param_specs``), where their types do not say it: the
        stability guard takes its statistics on each device's blocks by them (``_probe.probe_dots_partitioned``).
    """

    sq_norms: Any
    num_microbatches: int = dataclasses.field(default=1, metadata=dict(static=True))
    fsdp: bool = dataclasses.field(default=False, metadata=dict(static=True))
    mean_sq_norms: Any = None
    rows: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))
    grad_sq_norms: Any = None
    specs: tuple[Any, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class Samples:
    """Where this call's gradient samples came from, and this replica's per-leaf statistics of them.

    Attributes:
      sq_leaves: per leaf, the mean over this replica's samples of ``‖g_j‖²`` (of ``P ⊙ g_j`` with a
        preconditioner), float32; from the gradients themselves, the small leaves of one key (group and
        model axes) carry their total on the first of them (``_norms.fused_sq_norms``).
      count: this replica's samples: ``k`` micro-batches, or 1 (its own gradient).
      mean_sq: per leaf ``‖ḡ‖²`` of the samples' true mean, taken where they were (the GSPMD drop-in), or
        ``None``: then the reduction computes it from the gradients.
      rows: the gradients are ZeRO rows already reduce-scattered (FSDP probes).
      weights: the preconditioner's per-leaf multipliers, or ``None``.
      specs: the gradients' layout on a mesh with Auto axes (:attr:`MicrobatchStats.specs`), or ``None``.
      altered: ``None``, or a traced bool (this replica's): the gradients given are not those the statistics
        measured, their ``Σ‖g‖²`` off by more than :data:`ALTERED_RTOL` of ``Σ grad_sq_norms`` (or, accumulating
        the drop-in's statistics, of ``Σ mean_sq_norms``): clipped, scaled or otherwise changed between
        ``value_and_grad`` and ``update``. The update sets this call's squared norms to ``−∞``, which the one
        reduction carries to every replica (the update is skipped everywhere); :func:`count_altered` counts it.
    """

    sq_leaves: list[Array]
    count: int = 1
    mean_sq: list[Array] | None = None
    rows: bool = False
    weights: list[Array] | None = None
    altered: Array | None = None
    specs: tuple[Any, ...] | None = None

    @classmethod
    def of(
        cls,
        grads: Any,
        microbatch_stats: Any,
        accumulation_steps: Any,
        precondition: Any,
        inner_state: Any,
        keys: Sequence[Hashable] | None = None,
    ) -> Samples:
        """The samples of one ``update``: from ``microbatch_stats`` if given, else the gradients themselves (their
        squared norms in few reductions where ``keys`` say which leaves are summed together:
        ``_norms.fused_sq_norms``)."""
        if microbatch_stats is not None and not isinstance(microbatch_stats, MicrobatchStats):
            raise TypeError(
                "microbatch_stats must be a MicrobatchStats (from value_and_grad, or the gradient of fsdp_probes), "
                f"got {type(microbatch_stats).__name__}"
            )
        weights = _preconditioner(precondition, inner_state, grads, microbatch_stats)
        treedef = jax.tree.structure(grads)
        if microbatch_stats is None:
            leaves = jax.tree.leaves(grads)
            if weights is not None:
                leaves = [g * w for g, w in zip(leaves, weights, strict=True)]
            if keys is not None:
                return cls(_norms.fused_sq_norms(leaves, keys), weights=weights)
            return cls([_norms.leaf_sq_norm(g) for g in leaves], weights=weights)
        rows = microbatch_stats.fsdp
        if rows and (accumulation_steps != 1 or microbatch_stats.num_microbatches != 1):
            raise ValueError(
                "FSDP statistics (fsdp_probes) work with one sample per replica per update: "
                f"got accumulation_steps={accumulation_steps}; use more data-parallel replicas"
            )
        sq = _leaves(treedef, microbatch_stats.sq_norms, "sq_norms")
        mean_sq = altered = None
        if microbatch_stats.mean_sq_norms is not None:
            measured = _leaves(treedef, microbatch_stats.mean_sq_norms, "mean_sq_norms")
            if accumulation_steps == 1:
                mean_sq = measured
            else:  # b comes from the accumulated gradients: they must be the ones measured
                altered = _altered(jax.tree.leaves(grads), measured)
        if microbatch_stats.grad_sq_norms is not None and mean_sq is None:  # b comes from these gradients
            given = _altered(jax.tree.leaves(grads), _leaves(treedef, microbatch_stats.grad_sq_norms, "grad_sq_norms"))
            altered = given if altered is None else altered | given
        return cls(sq, microbatch_stats.num_microbatches, mean_sq, rows, weights, altered, microbatch_stats.specs)


# The gradients given to an accumulating update are the drop-in's when their total squared norm is within this
# (relative) of the one it measured: float32 summation order and a bfloat16 cast stay well inside (≤ 0.4 %), a
# clipping or a scale that changes b by more does not.
ALTERED_RTOL = 1e-2


def returned_sq_norms(leaves: list[Array]) -> list[Array]:
    """Each gradient leaf's ``‖g‖²`` as the check of the gradients given to ``update`` takes them (:func:`_altered`).

    ``value_and_grad(num_microbatches=k > 1)`` measures the gradients it returns with this very function, so that
    where ``update`` is given those gradients in the same program the compiler computes the norms once (common
    subexpressions): the check costs no pass of its own. Local leaves in few reductions; leaves the compiler
    partitions each alone (stacking them would gather them).
    """
    if _axes.partitioned_axes(leaves):
        return [_norms.leaf_sq_norm(g) for g in leaves]
    return _norms.leaf_sq_norms(leaves)


def _altered(grads: list[Array], measured: list[Array]) -> Array:
    """Whether ``Σ‖g‖²`` of the gradients differs from the measured ``Σ‖ḡ‖²`` by more than :data:`ALTERED_RTOL`."""
    given = sum(returned_sq_norms(grads), jnp.zeros([], jnp.float32))
    want = sum((jnp.asarray(m, jnp.float32) for m in measured), jnp.zeros([], jnp.float32))
    return jnp.abs(given - want) > ALTERED_RTOL * want


def count_altered(a: Array, state: Any, new_state: Any) -> Any:
    """After the reduction: an update skipped because a replica's gradients were not those its statistics measured
    (its squared norms set to ``−∞``, so the reduced ``a`` is ``−∞``) counts in ``altered_grads_steps``. ``a`` is
    replicated, so the count is (a replica's own flag is not)."""
    altered = jnp.any(jnp.isneginf(a)) & (new_state.skipped_steps != state.skipped_steps)
    count = new_state.altered_grads_steps
    return new_state._replace(altered_grads_steps=jnp.where(altered, optax.safe_increment(count), count))


def _leaves(treedef: Any, tree: Any, name: str) -> list[Array]:
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(f"microbatch_stats.{name} must have the structure of the gradients") from err


def _preconditioner(precondition: Any, inner_state: Any, grads: Any, microbatch_stats: Any) -> list[Array] | None:
    """The per-leaf multipliers ``P`` of the statistics (``precondition(inner_state)``), or ``None``."""
    if precondition is None:
        return None
    if microbatch_stats is not None:
        raise ValueError(
            "precondition needs the gradients themselves: it cannot be combined with microbatch_stats "
            "(use accumulation_steps or more replicas)"
        )
    weights = precondition(inner_state)
    if weights is None:
        return None
    try:
        return jax.tree.structure(grads).flatten_up_to(weights)
    except (ValueError, TypeError) as err:
        raise ValueError("precondition must return multipliers shaped like the params") from err
