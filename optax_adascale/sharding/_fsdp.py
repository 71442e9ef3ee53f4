"""FSDP (ZeRO-3) under shard_map: parameters live in ZeRO rows and are gathered for the forward pass.

With parameters sharded over the data axis, autodiff hands ``update`` gradients that
are already reduce-scattered: each replica's full local gradient never exists
outside the backward pass, yet AdaScale needs its squared norm. :func:`fsdp_gather`
all-gathers a replica's rows into whole parameters, and its custom VJP takes the
squared norm of each whole local gradient *before* reduce-scattering it, returning
it as the cotangent of a scalar probe (one per leaf, varying over the data axis)::

    rows = optax_adascale.fsdp_shard(params, n)                 # host: (n, m) rows, P("data")
    tx = optax_adascale.adascale_sgd(lr, momentum=0.9, axis_name="data", shard_optimizer_state=n)
    opt_state = tx.init(params)                                  # inner state in the same rows

    def step(rows, opt_state, x, y):                             # inside jax.shard_map
        def loss_of(rows, probes):
            return loss_fn(optax_adascale.fsdp_gather(rows, probes, shapes, "data"), x, y)
        probes = optax_adascale.fsdp_probes(rows, "data")
        grads, stats = jax.grad(loss_of, argnums=(0, 1))(rows, probes)
        updates, opt_state = tx.update(grads, opt_state, rows, microbatch_stats=stats)
        return optax.apply_updates(rows, updates), opt_state

Each parameter must be gathered **once** per forward pass: gathered twice, its
probe receives ``‖g₁‖² + ‖g₂‖²`` instead of ``‖g₁ + g₂‖²`` and the variance
estimate is wrong (nothing can detect it). Re-use the gathered tree.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale.core import _axes, _norms
from optax_adascale.core._samples import MicrobatchStats
from optax_adascale.sharding import _zero


def fsdp_shard(params: Any, num_replicas: int) -> Any:
    """Each leaf of ``params`` as ``(num_replicas, m)`` rows (flattened, zero-padded): place with ``P(axis)``.

    Examples:
      >>> import jax.numpy as jnp, optax_adascale
      >>> optax_adascale.fsdp_shard({"w": jnp.arange(5.0)}, 2)["w"]
      Array([[0., 1., 2.],
             [3., 4., 0.]], dtype=float32)
    """
    return jax.tree.map(lambda p: _zero.to_rows(p, num_replicas), params)


def fsdp_unshard(rows: Any, shapes: Any) -> Any:
    """Whole parameters from their global ``(n, m)`` rows (for evaluation or export, outside shard_map).

    Args:
      rows: the rows from :func:`fsdp_shard` (or training), global arrays.
      shapes: the parameters (or their ``jax.ShapeDtypeStruct``), for the shapes.
    """
    return jax.tree.map(lambda r, like: _zero.from_rows(r, like), rows, shapes)


def fsdp_probes(rows: Any, axis_name: Any) -> MicrobatchStats:
    """Probes for :func:`fsdp_gather`: differentiate the loss with respect to them too.

    A :class:`MicrobatchStats` holding one float32 zero per leaf (varying over
    ``axis_name``). Its gradient is the :class:`MicrobatchStats` of this
    replica's squared gradient norms, to pass as ``update(...,
    microbatch_stats=)``.
    """
    names = _axes.axis_names(axis_name)

    def probe(_):
        zero = jnp.zeros([], jnp.float32)
        checked = tuple(n for n in names if _axes.vma_checked(n))
        return lax.pcast(zero, checked, to="varying") if checked else zero

    return MicrobatchStats(jax.tree.map(probe, rows), 1, fsdp=True)


def fsdp_gather(rows: Any, probes: Any, shapes: Any, axis_name: Any) -> Any:
    """Whole parameters from this replica's rows; the backward pass records each local squared gradient norm.

    Forward: ``lax.all_gather`` of the rows, trimmed and reshaped to ``shapes``.
    Backward: for each leaf the whole local cotangent ``g`` (this replica's
    gradient) gives the probe's cotangent ``‖g‖²`` (float32), and the rows'
    cotangent is ``lax.psum_scatter`` of ``g``: the sum over replicas of this
    row. Pass both to ``tx.update(grads, opt_state, rows, microbatch_stats=...)``.

    Args:
      rows: this replica's rows (``(1, m)`` per leaf under shard_map with ``P(axis)``).
      probes: from :func:`fsdp_probes`.
      shapes: the parameters (or ``jax.ShapeDtypeStruct``\\ s): each leaf's whole shape.
      axis_name: the data axes the rows are split over.

    Returns:
      The whole parameters.
    """
    if isinstance(probes, MicrobatchStats):
        probes = probes.sq_norms
    treedef = jax.tree.structure(rows)
    flat_shapes = [tuple(s.shape) for s in treedef.flatten_up_to(shapes)]
    gathered = [
        _gather_leaf(r, p, shape, axis_name)
        for r, p, shape in zip(jax.tree.leaves(rows), treedef.flatten_up_to(probes), flat_shapes, strict=True)
    ]
    return treedef.unflatten(gathered)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_leaf(row: jax.Array, probe: jax.Array, shape: tuple[int, ...], axis_name: Any) -> jax.Array:
    del probe
    whole = lax.all_gather(jnp.reshape(row, (-1,)), axis_name, axis=0, tiled=True)
    return whole[: math.prod(shape)].reshape(shape)


def _gather_fwd(row, probe, shape, axis_name):
    # The residual is an empty array with the row's leading shape and dtype: no copy of the row is kept.
    return _gather_leaf(row, probe, shape, axis_name), jnp.zeros(jnp.shape(row)[:-1] + (0,), row.dtype)


def _gather_bwd(shape, axis_name, like, cotangent):
    n = _axes.axis_size(axis_name)
    sq = _norms.leaf_sq_norm(cotangent)
    row = lax.psum_scatter(jnp.ravel(_zero.to_rows(cotangent, n)), axis_name, scatter_dimension=0, tiled=True)
    return jnp.reshape(row, like.shape[:-1] + (-1,)).astype(like.dtype), sq


_gather_leaf.defvjp(_gather_fwd, _gather_bwd)
