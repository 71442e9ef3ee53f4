"""One ``update`` call's named axes, resolved once and checked: the data axes and their size, the model axes,
and the checks that read shard_map's varying types (gradients already summed over the data axes, gradients
varying where their parameters do not, a vmap axis that is an Explicit mesh axis, per-replica buffers).
"""

import dataclasses
from typing import Any

import jax

from optax_adascale import _compat
from optax_adascale.core import _collect
from optax_adascale.core._collect import (
    AxisName,
    ModelAxes,
    axis_names,
    axis_size,
    model_axes,
    varying_axes,
    vma_checked,
)

Array = jax.Array


def _where(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def check_not_summed(grads: Any, axis_name: AxisName | None) -> None:
    """Raise if the gradients reaching ``update`` do not vary over a (type-checked) data axis.

    Inside ``jax.shard_map``, ``jax.grad`` with respect to replicated
    (unvarying) parameters returns the gradient *summed* over the axis; a
    ``psum``/``pmean`` by the user, or an ``optax.MultiSteps`` around AdaScale,
    reduces it too. Genuine per-replica gradients vary.
    """
    for name in axis_names(axis_name):
        if not vma_checked(name):
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
            if name not in varying_axes(leaf):
                raise ValueError(
                    f"grads{_where(path)} does not vary over the shard_map axis {name!r}: these are not "
                    "per-replica gradients, and AdaScale needs each replica's own gradient to estimate "
                    "the noise. Causes: (1) jax.grad with respect to replicated parameters inside "
                    "shard_map returns gradients already summed over the axis; mark the parameters "
                    f"varying before differentiating: jax.lax.pcast(params, {name!r}, to='varying'); "
                    "(2) the gradients were reduced before update (jax.lax.psum/pmean): pass the local "
                    "gradients, AdaScale reduces them itself; (3) optax.MultiSteps around AdaScale: use "
                    "adascale(..., accumulation_steps=k) instead."
                )


def check_grads_follow_params(grads: Any, params: Any, axis_name: AxisName | None) -> None:
    """Raise where a gradient varies over a shard_map axis that neither its parameter nor ``axis_name`` has.

    With ``axis_name=None`` that is data parallelism without a reduction (JAX
    would fail at ``out_specs`` with advice, ``check_vma=False``, that makes
    every replica train alone). With a model axis it is a replicated
    parameter differentiated as if it were split (it was ``pcast`` over the
    model axis), whose squared norm would be counted once per shard.
    """
    if params is None:
        return
    data = set(axis_names(axis_name))
    for (path, g), p in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(params), strict=True):
        extra = sorted(varying_axes(g) - varying_axes(p) - data)
        if not extra:
            continue
        if not data:
            raise ValueError(
                f"grads{_where(path)} varies over the shard_map axes {extra} but the parameters and "
                "axis_name=None do not: each replica would train on its own gradients. For data "
                f"parallelism pass axis_name={extra[0]!r} (AdaScale then reduces the gradients and "
                "estimates the noise from them)."
            )
        raise ValueError(
            f"grads{_where(path)} varies over {extra} but its parameter does not (it is replicated over "
            f"{extra}): the parameters were pcast over more than the data axes {sorted(data)} before "
            f"jax.grad. Cast over the data axes only, jax.lax.pcast(params, {tuple(sorted(data))!r}, "
            "to='varying'): shard_map's autodiff then sums a replicated parameter's gradient over the "
            "model axes for you."
        )


def check_buffers_per_replica(acc_sq_norm: Array, axis_name: AxisName | None, grads: Any = None) -> None:
    """Raise if accumulation buffers are shared by the replicas (no ``replicate_buffers``): under shard_map (the
    buffers do not vary over the axis), and under ``vmap`` (the gradients are batched over the axis, the buffers
    are not: JAX's own error would be "vmap has mapped output ... but out_axes is None")."""
    batched = lambda x: {getattr(d, "name", None) for d in _compat.batch_trace_axes(x)}  # noqa: E731
    mapped = set().union(*(batched(g) for g in jax.tree.leaves(grads))) if grads is not None else set()
    for name in axis_names(axis_name):
        if vma_checked(name) and name not in varying_axes(acc_sq_norm):
            where = (
                "jax.shard_map needs per-replica accumulation buffers, but opt_state's buffers do not vary over "
                f"{name!r}"
            )
            specs = (
                f"pass optax_adascale.state_partition_specs(opt_state, {axis_name!r}) as the state's in_specs and "
                "out_specs"
            )
        elif name in mapped and name not in batched(acc_sq_norm):
            where = (
                "jax.vmap needs per-replica accumulation buffers, but opt_state's buffers are not mapped over "
                f"{name!r} (in_axes=None)"
            )
            specs = "pass optax_adascale.state_axes(opt_state) as the state's in_axes and out_axes"
        else:
            continue
        raise ValueError(
            f"accumulation_steps > 1 (or a BatchRamp) under {where}. Give each replica its own: "
            f"opt_state = optax_adascale.replicate_buffers(tx.init(params), num_replicas), and {specs}."
        )


def check_vmap_axis_not_explicit(grads: Any, axis_name: AxisName | None) -> None:
    """Raise a clear error where JAX 0.10 would fail obscurely: a reduction over a vmap axis whose
    inputs are sharded on an Explicit mesh axis (``jax.make_mesh``'s default) under jit.

    Reads JAX internals (the batching trace of the gradient leaves) behind a
    feature test: if they move, the check does nothing and JAX's own error remains.
    """
    names = set(axis_names(axis_name))
    if not names:
        return
    found = {}
    for leaf in jax.tree.leaves(grads):
        explicit = _explicit_spec(leaf)
        for data in _compat.batch_trace_axes(leaf):
            if getattr(data, "name", None) in names:
                if getattr(data, "explicit_mesh_axis", None):
                    found[data.name] = data.explicit_mesh_axis
                elif explicit:  # the mapped arrays themselves are sharded on Explicit axes
                    found[data.name] = explicit
    if found:
        raise ValueError(
            f"axis_name={axis_name!r}: the jax.vmap axes {found} map over (or carry) arrays sharded on Explicit "
            "mesh axes, which JAX 0.10 cannot reduce over under jit. Use a mesh with Auto axes "
            "(jax.sharding.Mesh(devices, names), or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,))), "
            "wrap the vmapped step in jax.sharding.auto_axes under jax.set_mesh(mesh), or use jax.shard_map."
        )


@dataclasses.dataclass(frozen=True)
class Axes:
    """The named axes of one ``update`` call, resolved once: the data axes, their size, the model axes."""

    data: tuple[str, ...]
    replicas: int
    model: ModelAxes

    @property
    def name(self) -> AxisName | None:
        """The data axes as the user names them: ``None``, a name, or a tuple."""
        return None if not self.data else self.data[0] if len(self.data) == 1 else self.data

    @property
    def checked(self) -> bool:
        """Whether shard_map tracks varying types for every data axis here (``check_vma=True``)."""
        return bool(self.data) and all(vma_checked(name) for name in self.data)


def resolve_axes(axis_name: AxisName | None, grads: Any, params: Any, param_specs: Any = None) -> Axes:
    """The axes at this call, after every check that reads them (bound names, varying types, model axes)."""
    replicas = axis_size(axis_name)
    check_not_summed(grads, axis_name)
    check_grads_follow_params(grads, params, axis_name)
    check_vmap_axis_not_explicit(grads, axis_name)
    return Axes(axis_names(axis_name), replicas, model_axes(grads, params, axis_name, param_specs))


def _explicit_spec(x: Any) -> tuple[str, ...]:
    """The Explicit mesh axes ``x`` is sharded over (its type's sharding), or ``()``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "axis_types"):
        return ()
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    used = _collect.spec_axes(getattr(sharding, "spec", None))
    return tuple(sorted(a for a in used if kinds.get(a) == jax.sharding.AxisType.Explicit))
