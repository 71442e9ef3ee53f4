"""The named axes of an ``update`` call: which are data axes (they define the replicas, ``n`` and the reduction)
and which are model axes (a parameter split over one is one replica's parameter in pieces), read from the names
the user gives, shard_map's varying types and the mesh; the checks that read those types (gradients already summed
over the data axes, gradients varying where their parameters do not, a vmap axis that is an Explicit mesh axis,
per-replica buffers); and one call's :class:`Axes`, resolved once.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale import _compat
from optax_adascale.core import _checks

Array = jax.Array
AxisName = str | tuple[str, ...]

# --------------------------------------------------------------------------- named axes


def axis_names(axis_name: AxisName | None) -> tuple[str, ...]:
    """``axis_name`` as a tuple of names (empty for ``None``)."""
    if axis_name is None:
        return ()
    if isinstance(axis_name, str):
        return (axis_name,)
    return tuple(axis_name)


def axis_size(axis_name: AxisName | None) -> int:
    """Number of replicas on ``axis_name`` at the call site (1 for ``None``).

    Raises:
      ValueError: if a name is not bound by an enclosing pmap, shard_map or vmap.
    """
    size = 1
    for name in axis_names(axis_name):
        try:
            size *= lax.axis_size(name)
        except NameError as err:
            bound = [a for a in manual_axes() if a not in axis_names(axis_name)]
            hint = (
                (
                    f" The axes bound here are {bound}: if one of them is the data-parallel axis, pass "
                    f"axis_name={bound[0] if len(bound) == 1 else tuple(bound)!r}."
                )
                if bound
                else ""
            )
            raise ValueError(
                f"axis_name={axis_name!r}: the axis {name!r} is not bound where update() "
                "was called. Call update inside jax.pmap(..., axis_name=...), "
                "jax.shard_map over a mesh with that axis, or jax.vmap(..., axis_name=...); "
                "or pass axis_name=None for a single replica." + hint
            ) from err
    return int(size)


def varying_axes(x: Any) -> frozenset[str]:
    """The manual axes ``x`` varies over (shard_map's varying type); empty where JAX records none."""
    return _compat.varying_axes(x)


def vma_checked(name: str) -> bool:
    """Whether shard_map tracks varying types for axis ``name`` here.

    ``axis_index`` always varies over its axis; it only *reads* as varying under
    ``jax.shard_map(..., check_vma=True)``. Under pmap, vmap or
    ``check_vma=False`` everything reads unvarying, so checks built on the
    types must stay silent there.
    """
    try:
        return name in varying_axes(lax.axis_index(name))
    except NameError:
        return False


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes at the call site (shard_map and pmap axes), in mesh order."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        return tuple(getattr(mesh, "manual_axes", ()))
    except Exception:  # noqa: BLE001 - no mesh context API: nothing to report
        return ()


def partitioned_axes(tree: Any) -> dict[str, int]:
    """The mesh axes (name → size, sizes > 1) a jit step over ``tree`` is partitioned over by the compiler.

    Read from the arrays' types (their sharding's mesh: Explicit meshes, and arrays placed on any mesh)
    and from the context mesh (``jax.set_mesh``); manual axes (shard_map's, pmap's) are not the
    partitioner's and do not count. Empty on one device, under ``vmap``, and where nothing records
    the mesh (uncommitted arrays placed by ``jax.jit``'s ``in_shardings`` alone).
    """
    meshes: list[Any] = [jax.sharding.get_abstract_mesh()]
    meshes += [getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None) for leaf in jax.tree.leaves(tree)]
    found: dict[str, int] = {}
    for mesh in meshes:
        if mesh is None or getattr(mesh, "empty", True):
            continue
        kinds = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
        for name, size in dict(mesh.shape).items():
            if size > 1 and kinds.get(name) != jax.sharding.AxisType.Manual:
                found[name] = int(size)
    return found


def warn_if_partitioned(grads: Any, calls: Any = None) -> None:
    """Warn where ``update`` gets no ``microbatch_stats`` and has no ``axis_name`` in a step over several devices: a
    jit step over the global batch that forgot ``microbatch_stats=stats`` sees one sample per call. ``calls``:
    ``None`` (one call per update: ``n = 1``, gain 1), or the calls an update accumulates (``k``, or the ramp's
    description): ``n = k``, not one sample per data shard per call."""
    axes = partitioned_axes(grads)
    if not axes:
        return
    devices = 1
    for size in axes.values():
        devices *= size
    data = next(iter(axes))
    if calls is None:
        what = (
            "AdaScale sees n = 1 gradient sample per update and is the identity (gain 1, S = 1: your inner "
            "optimizer's own step on lr(t), as without AdaScale)"
        )
    else:
        what = (
            f"AdaScale sees one gradient sample per call (the whole global batch's), so an update ({calls}) "
            f"has n = S = k samples, not one per data shard and call ({devices} × k): the gain is capped at k and "
            "the schedule's clock runs at S = k"
        )
    _checks.warn(
        f"update got no microbatch_stats and the optimizer has no axis_name, but this step is partitioned over "
        f"{devices} devices (mesh axes {axes}): {what}. In a jax.jit step over the global batch take the statistics "
        "from the drop-in and pass them: loss, grads, stats = "
        f"optax_adascale.value_and_grad(loss_fn, data_axes={data!r})(params, *batch); "
        "tx.update(grads, opt_state, params, microbatch_stats=stats). If no mesh axis is data parallel (tensor "
        "parallelism alone), "
        + (
            "take samples as micro-batches: value_and_grad(loss_fn, num_microbatches=k)."
            if calls is None
            else "each call's gradient is the sample you meant, and this warning can be filtered."
        )
    )


# --------------------------------------------------------------------------- model axes


def spec_axes(spec: Any) -> frozenset[str]:
    names: set[str] = set()
    for entry in tuple(spec or ()):
        if entry is None:
            continue
        names.update((entry,) if isinstance(entry, str) else tuple(entry))
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class ModelAxes:
    """Which model axes each leaf is split over; ``axes`` is their union (in mesh order).

    A leaf split over model axes ``A`` has partial squared norms on each
    device; summing over ``A`` gives the replica's. A leaf replicated over a
    model axis holds the whole value on every shard of it: its contribution is
    kept on shard 0 of that axis only, so that one ``psum`` over all model axes
    counts every leaf once.
    """

    axes: tuple[str, ...] = ()
    leaf_axes: tuple[frozenset[str], ...] = ()

    def mask(self, values: Sequence[Array]) -> list[Array]:
        """Per-leaf scalars, each zeroed off shard 0 of the model axes its leaf is replicated over."""
        if not self.axes:
            return list(values)
        out = []
        for value, split in zip(values, self.leaf_axes, strict=True):
            for name in self.axes:
                if name not in split:
                    value = jnp.where(lax.axis_index(name) == 0, value, jnp.zeros_like(value))
            out.append(value)
        return out

    def psum(self, x: Any) -> Any:
        """The one scalar-sized collective over the model axes (a no-op without them)."""
        if not self.axes:
            return x
        return lax.psum(x, self.axes)


def model_axes(grads: Any, params: Any, axis_name: AxisName | None, param_specs: Any = None) -> ModelAxes:
    """The model axes of every leaf: from ``param_specs`` if given, else the parameters' varying types.

    A parameter that varies over a manual axis other than the data axes is
    split over it (tensor parallelism). Where the types carry no information
    (``check_vma=False``, pmap) the layout comes from ``param_specs``; if the
    mesh has manual axes besides the data axes and nothing declares how the
    parameters lie on them, raise.
    """
    data = frozenset(axis_names(axis_name))
    manual = manual_axes()
    leaves = jax.tree.leaves(grads)
    if param_specs is not None:
        try:
            specs = jax.tree.structure(grads).flatten_up_to(param_specs)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "param_specs must be PartitionSpecs shaped like the params (as passed to shard_map's "
                f"in_specs), got param_specs={param_specs!r}"
            ) from err
        # Axes that are not manual here (Auto axes of a partial-manual shard_map) are the partitioner's.
        split = [frozenset(a for a in spec_axes(s) - data if a in manual) for s in specs]
    elif params is not None:
        split = [varying_axes(p) - data for p in jax.tree.leaves(params)]
    else:
        split = [frozenset()] * len(leaves)
        extra = sorted(set().union(*(varying_axes(g) for g in leaves)) - data) if leaves else []
        if extra:
            raise ValueError(
                f"grads vary over the shard_map axes {extra} besides the data axes {sorted(data)}: pass "
                "params to update (tx.update(grads, opt_state, params)) so that AdaScale can tell "
                "parameters split over those axes from replicated ones."
            )
    if param_specs is None:
        others = [a for a in manual if a not in data]
        unchecked = [a for a in others if not vma_checked(a)]
        if unchecked:
            raise ValueError(
                f"axis_name={axis_name!r}, but the manual axes {unchecked} bound here are not among the "
                f"data axes {sorted(data)}, and here (jax.pmap, or shard_map with check_vma=False) JAX "
                "records no varying types to tell what they are. If "
                f"{unchecked} is your data-parallel axis (jax.pmap(..., axis_name=...), or the batch axis of "
                f"shard_map), pass it to the optimizer: axis_name={_suggest_axis_name(data, unchecked)!r}. "
                "If it is a model axis (tensor parallelism), pass param_specs= (the params' PartitionSpecs, "
                "as given to shard_map's in_specs), or use check_vma=True."
            )
    axes = tuple(a for a in manual if any(a in s for s in split))
    return ModelAxes(axes, tuple(split))


# --------------------------------------------------------------------------- axis names as the user gives them


def _suggest_axis_name(data: frozenset[str], unchecked: list[str]) -> AxisName:
    """The bound axes as an ``axis_name`` value: the unbound data names dropped, the unchecked ones added."""
    names = [a for a in manual_axes() if a in data or a in unchecked]
    return names[0] if len(names) == 1 else tuple(names)


# --------------------------------------------------------------------------- one call's axes and their checks


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
    used = spec_axes(getattr(sharding, "spec", None))
    return tuple(sorted(a for a in used if kinds.get(a) == jax.sharding.AxisType.Explicit))
