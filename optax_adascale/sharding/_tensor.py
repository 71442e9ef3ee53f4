"""Tensor parallelism: which model axes a leaf is split over, the squared norm of a tree of model shards, and the
check that ``inner`` computes on a model shard what it computes on the whole."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optax_adascale import _compat
from optax_adascale.core import _clock
from optax_adascale.core._axes import ModelAxes
from optax_adascale.core._norms import STAT_DTYPE, leaf_sq_norm
from optax_adascale.sharding import _stand_in

Array = jax.Array
AxisName = str | tuple[str, ...]


def sq_norm_fn(treedef: Any, model: ModelAxes, data_axes: AxisName | None = None):
    """``BaseSteps.sq_norm`` handed to ``inner``: the whole ``‖x‖²`` of a tree of shards.

    ``x`` is shaped like the gradients (``treedef``; a leaf may be a subtree
    such as optax's ``MaskedNode``, counted as its leaves). Each leaf's local
    ``Σ|x|²`` is masked as :meth:`ModelAxes.mask` does (a leaf replicated over a
    model axis counts once) and summed over the model axes and ``data_axes``
    (ZeRO's rows) in one scalar ``psum``.
    """
    data = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes or ())
    names = data + model.axes
    zero = lambda: jnp.zeros([], STAT_DTYPE)  # noqa: E731

    def sq_norm(tree: Any) -> Array:
        try:
            parts = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "base_steps.sq_norm (the global squared norm AdaScale hands to inner) needs a tree shaped like "
                f"the gradients {treedef}, got {jax.tree.structure(tree)}"
            ) from err
        values = [sum((leaf_sq_norm(x) for x in jax.tree.leaves(part)), zero()) for part in parts]
        local = sum(model.mask(values), zero())
        return lax.psum(local, names) if names else local

    return sq_norm


@contextlib.contextmanager
def _off_mesh():
    """Leave the caller's shard_map (its mesh and varying-type checks): the probes' vmap axes are no mesh axes."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), _compat.vma_checks_off():
        yield


def check_model_split(inner: optax.GradientTransformationExtraArgs, grads: Any, model: ModelAxes) -> None:
    """Raise unless ``inner`` computes on model-axis pieces of the split leaves what it computes on the whole.

    Tensor parallelism hands ``inner`` each device's piece of a split leaf.
    On a stand-in (two elements per dimension, split leaves cut in two along
    their first dimension, a vmap axis standing for the model axes), ``inner``
    runs whole and in pieces, with the ``base_steps.sq_norm`` AdaScale gives it,
    at gradient magnitudes from ``1e-3`` to ``1e12``. ``optax.clip_by_global_norm``
    (each piece clipped by its own norm) fails this; :func:`optax_adascale.clip_by_global_norm`
    passes. An ``inner`` that cannot run on the stand-in is refused unless
    declared with :func:`optax_adascale.elementwise`.
    """
    if _stand_in.is_declared_elementwise(inner):
        return
    leaves, treedef = jax.tree.flatten(grads)
    split = [bool(axes) and jnp.ndim(g) >= 1 for g, axes in zip(leaves, model.leaf_axes, strict=True)]
    if not any(split):
        return
    probe = ModelAxes(("tp_probe",), tuple(frozenset({"tp_probe"}) if s else frozenset() for s in split))
    cut = lambda x, s: jnp.reshape(x, (2, 1, *x.shape[1:])) if s else x  # noqa: E731
    in_axes = treedef.unflatten([0 if s else None for s in split])

    def piece(g, p):
        return inner.update(g, inner.init(p), p, **_clock.probe_args(sq_norm_fn(treedef, probe)))[0]

    def pieces(full_p: Any, whole_of):
        cut_p = treedef.unflatten([cut(x, s) for x, s in zip(jax.tree.leaves(full_p), split, strict=True)])

        def run(full_g):
            cut_g = treedef.unflatten([cut(x, s) for x, s in zip(jax.tree.leaves(full_g), split, strict=True)])
            got = jax.tree.leaves(jax.vmap(piece, in_axes=(in_axes, in_axes), axis_name="tp_probe")(cut_g, cut_p))
            whole = whole_of(full_g)
            # split: the pieces in order (as the whole); replicated: a copy of the whole per piece
            got = [jnp.reshape(g, w.shape) if s else g for g, w, s in zip(got, whole, split, strict=True)]
            return whole, got

        return run

    _stand_in.compare(
        inner,
        treedef,
        [(2,) * jnp.ndim(g) for g in leaves],
        [jnp.result_type(g) for g in leaves],
        pieces,
        cannot_run=(
            f"parameters split over the model axes {list(model.axes)}: AdaScale could not run inner on a "
            "stand-in of the parameters to check that it computes on a model shard what it computes on the whole"
        ),
        differs=(
            f"parameters split over the model axes {list(model.axes)}: inner computes something different on a "
            "model shard of a parameter than on the whole, so the update would be wrong. inner must be "
            "elementwise (optax.trace, optax.scale_by_adam, optax.add_decayed_weights) or shard-aware: use "
            "optax_adascale.clip_by_global_norm instead of optax.clip_by_global_norm (it clips by the norm "
            "summed over the shards)."
        ),
        context=_off_mesh,
    )
