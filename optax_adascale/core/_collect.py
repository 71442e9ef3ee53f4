"""Where AdaScale's statistics come from: local squared norms, the named axes and the one collective.

Everything that touches named axes lives here: which axes are data axes (they
define the replicas) and which are model axes (a parameter split over them is
one replica's parameter in pieces), and the reduction: one ``lax.psum`` of ``(gradients, squared norms)`` over
the data axes, plus, only where parameters are split over model axes, one
scalar-sized ``psum`` of the statistics over those axes.
"""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale import _compat
from optax_adascale.core import _checks, _groups
from optax_adascale.core._norms import STAT_DTYPE, fused_sq_norms, leaf_sq_norm, low_precision

if TYPE_CHECKING:
    from optax_adascale.core import _axes

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


def statistic_keys(groups: _groups.Groups, model: ModelAxes, leaves: Any) -> list[tuple[int, frozenset[str]]] | None:
    """Per leaf, which squared norms its own is summed with: its group and the model axes it is split over
    (``_norms.fused_sq_norms`` reduces the small leaves of one key together). ``None`` where the compiler
    partitions the leaves over a mesh (a jit step over the global batch): there every leaf keeps its own
    reduction, as a concatenation of differently sharded leaves would move them."""
    if partitioned_axes(leaves):
        return None
    splits = model.leaf_axes or (frozenset(),) * len(groups.leaf_group)
    return list(zip(groups.leaf_group, splits, strict=True))


# --------------------------------------------------------------------------- axis names as the user gives them


def _suggest_axis_name(data: frozenset[str], unchecked: list[str]) -> AxisName:
    """The bound axes as an ``axis_name`` value: the unbound data names dropped, the unchecked ones added."""
    names = [a for a in manual_axes() if a in data or a in unchecked]
    return names[0] if len(names) == 1 else tuple(names)


# --------------------------------------------------------------------------- the reduction


def reduce_statistics(
    grads: Any,
    local_sq: Array,
    axes: "_axes.Axes",
    groups: _groups.Groups,
    weights: Sequence[Array] | None = None,
    mean_sq: Sequence[Array] | None = None,
) -> tuple[Any, Array, Array]:
    """The gradient's reduction, and ``‖ḡ‖²`` read straight off its output.

    One ``lax.psum`` of ``(grads, local_sq)`` over the data axes (XLA emits one
    all-reduce, as for SGD + pmean). The squared norm of the mean is taken on
    the *sum* and divided by ``n²``, and the mean ``ḡ = sum/n`` is handed on as
    an expression: XLA then fuses the division into the optimizer update
    instead of materializing ``ḡ``. 16-bit floats are divided by ``n``
    *before* the sum so that values near the float16 maximum cannot overflow.
    With model axes, the per-group ``a`` and ``b`` (partial sums on each
    shard) are then summed over them in one scalar-sized ``psum``.

    Args:
      grads: this replica's gradients (its mean over its samples).
      local_sq: float32 ``[G]``, this replica's mean squared sample norm per group
        (already masked by ``axes.model.mask`` where leaves are replicated over model axes).
      axes: the call's data and model axes.
      groups: the parameter groups.
      weights: optional per-leaf multipliers ``P``: ``b = ‖P ⊙ ḡ‖²`` (preconditioned statistics).
      mean_sq: optional ``‖ḡ‖²`` per leaf taken where the samples were (the GSPMD drop-in): ``b`` comes from
        there, not from ``grads`` (which the user may have clipped or scaled); only without data axes.

    Returns:
      ``(ḡ, a, b)``: the mean gradient, ``a`` = mean of the replicas' ``local_sq``
      (float32 ``[G]``), ``b = ‖ḡ‖²`` per group (float32 ``[G]``).
    """
    weigh = (lambda x, i: x) if weights is None else (lambda x, i: x * weights[i])  # noqa: E731
    model = axes.model
    keys = statistic_keys(groups, model, grads)
    if mean_sq is not None and axes.data:
        raise ValueError(
            f"microbatch_stats from value_and_grad(data_axes=...) are already reduced over the data shards, but the "
            f"optimizer was built with axis_name={axes.name!r}: build it without axis_name for a jit step over the "
            "global batch."
        )
    if not axes.data:
        mean, a = grads, local_sq
        if mean_sq is not None:
            b_leaves = [jnp.asarray(b, STAT_DTYPE) for b in mean_sq]
        else:
            leaves = [weigh(g, i) for i, g in enumerate(jax.tree.leaves(grads))]
            b_leaves = [leaf_sq_norm(g) for g in leaves] if keys is None else fused_sq_norms(leaves, keys)
    else:
        n = axes.replicas
        sums, sq_sum = lax.psum((jax.tree.map(lambda x: x / n if low_precision(x) else x, grads), local_sq), axes.data)
        low = [low_precision(s) for s in jax.tree.leaves(sums)]
        leaves = [weigh(s, i) for i, s in enumerate(jax.tree.leaves(sums))]
        if keys is None:
            raw = [leaf_sq_norm(s) for s in leaves]
        else:
            raw = fused_sq_norms(leaves, list(zip(keys, low, strict=True)))
        b_leaves = [r if lo else r / (n * n) for r, lo in zip(raw, low, strict=True)]
        mean = jax.tree.map(lambda s: s if low_precision(s) else s / n, sums)
        a = sq_sum / n
    b = groups.sums(model.mask(b_leaves))
    if model.axes:
        a, b = model.psum((a, b))
    return mean, a, b
