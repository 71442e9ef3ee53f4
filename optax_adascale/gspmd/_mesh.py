"""The drop-in's mesh and batch: the data axes named, the mesh in context, the replica axis bound."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType

from optax_adascale import _compat


def data_axis_names(data_axes: Any) -> tuple[str, ...]:
    """``data_axes`` as a tuple of axis names; a ``TypeError`` for anything else."""
    names = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"data_axes must be a mesh axis name or a tuple of names, got data_axes={data_axes!r}")
    return names


def resolve_mesh(mesh: Any, names: tuple[str, ...]) -> Any:
    """``mesh``, else the one set by ``jax.set_mesh``; a ``ValueError`` if none, or if it lacks ``names``."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            legacy = _compat.legacy_mesh()
            hint = (
                " A `with mesh:` block is in effect: that old form is invisible here; use "
                "`with jax.set_mesh(mesh):` instead."
                if legacy is not None
                else ""
            )
            raise ValueError(
                f"value_and_grad(data_axes={names if len(names) > 1 else names[0]!r}) needs the mesh: call the step "
                "under `with jax.set_mesh(mesh):` (or `jax.set_mesh(mesh)`), or pass "
                f"optax_adascale.value_and_grad(..., mesh=mesh).{hint}"
            )
    missing = [a for a in names if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"data_axes={names if len(names) > 1 else names[0]!r}: {missing} not in the mesh, whose axes are "
            f"{tuple(mesh.axis_names)}; name the axes the batch is sharded over."
        )
    return mesh


def check_one_axis_type(mesh: Any, names: tuple[str, ...]) -> None:
    """A mesh whose axes are partly Auto and partly Explicit is refused: the per-copy types need every axis Explicit
    inside the loss, and converting only the Auto ones gave statistics 11 % off, silently, on a data-Auto,
    model-Explicit mesh (JAX 0.10 and 0.12)."""
    kinds = {a: t for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)}
    if len({t for t in kinds.values() if t in (AxisType.Auto, AxisType.Explicit)}) > 1:
        said = ", ".join(f"{a}: {t.name}" for a, t in kinds.items())
        raise ValueError(
            f"value_and_grad(data_axes={names if len(names) > 1 else names[0]!r}) takes a mesh whose axes are all "
            f"Explicit (jax.make_mesh's default) or all Auto (jax.sharding.Mesh's default, with param_specs=), not "
            f"a mix ({said}): its statistics would not be exact there. Build the mesh with one kind of axis, e.g. "
            "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))."
        )


def check_replica_axis_bound(mesh: Any, tree: Any) -> None:
    """``data_axes=None`` under a jit over a multi-device mesh with no replica axis bound: the user forgot data_axes."""
    sizes_here = _compat.named_axis_sizes()
    if sizes_here is None or sizes_here:  # unreadable (stay silent rather than misfire), or inside vmap/pmap/
        return  # shard_map with named axes: per replica, as documented
    context = jax.sharding.get_abstract_mesh()
    if getattr(context, "manual_axes", ()):
        return
    sizes = [] if mesh is None else [mesh.size]
    if not context.empty:
        sizes.append(context.size)
    legacy = _compat.legacy_mesh()
    if legacy is not None:
        sizes.append(legacy.size)
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        leaf_mesh = getattr(sharding, "mesh", None)
        if leaf_mesh is not None and not leaf_mesh.empty:
            sizes.append(leaf_mesh.size)
    if any(s > 1 for s in sizes):
        raise ValueError(
            "value_and_grad(data_axes=None) computes per-replica statistics, but no replica axis is bound "
            f"here and the mesh has {max(sizes)} devices: under a jax.jit over the global batch the samples "
            "would be only the micro-batches (n = num_microbatches). Pass data_axes= naming the mesh axes "
            "the batch is sharded over (e.g. data_axes='data')."
        )


def auto_axes(mesh: Any) -> tuple[str, ...]:
    """The mesh's axes that are not Explicit (Auto, Manual), in mesh order."""
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Explicit)


def in_context(the_mesh: Any, given: Any) -> Any:
    """``mesh=`` given and none set: run under it (``jax.sharding`` reads the context's mesh)."""
    import contextlib

    if given is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(getattr(the_mesh, "abstract_mesh", the_mesh))
