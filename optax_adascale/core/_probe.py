"""The stability guard's statistics: six dot products per leaf of the averaged gradient ``ḡ``, the momentum ``m`` and
the parameters ``θ`` (``ḡ·m``, ``‖ḡ‖²``, ``ḡ·θ``, ``‖m‖²``, ``m·θ``, ``‖θ‖²``), on a strided sample of each leaf, scaled
to the whole leaf. AdaScale takes them in its statistics' own reduction (``core/_collect``, ``sharding/_reduce``) and
hands them to the τ clock's :func:`optax_adascale.trace` through ``BaseSteps.probe`` (``core/_clock``)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale import _compat
from optax_adascale.core import _norms

Array = jax.Array

# The guard's dot products read a strided sample of each leaf of more than SAMPLE_MIN elements, about SAMPLE_SIZE
# of them, scaled to the whole leaf: power-of-two strides dividing each dimension's local size, taken from the
# first dimension on (the sampled rows of a matrix are contiguous; where the type does not say how a dimension is
# split, a stride is at most 1/16 of it, so that a 16-way shard keeps whole strides). 4 KB per buffer and leaf, all
# six dot products in one pass over the three samples, where a pass over the gradient, the momentum and the params
# would read them whole.
SAMPLE_MIN = 1 << 11
SAMPLE_SIZE = 1 << 9


def _local_shape(x: Array) -> tuple[tuple[int, ...], bool]:
    """Each device's block of ``x`` and whether its type says so: its shape divided along the dimensions an Explicit
    mesh splits; the whole shape where the type records no split (``True`` under ``shard_map``, where the array is a
    local block, and for a replicated leaf; ``False`` on an Auto mesh, where the compiler decides)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or getattr(mesh, "empty", True):
        return tuple(x.shape), True
    kinds = set(mesh.axis_types)
    if kinds == {jax.sharding.AxisType.Manual}:  # inside a shard_map over every axis: a local block
        return tuple(x.shape), True
    if kinds != {jax.sharding.AxisType.Explicit}:
        return tuple(x.shape), False
    sizes = dict(mesh.shape)
    out = []
    for d, n in enumerate(x.shape):
        entry = spec[d] if d < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(n // math.prod(sizes.get(a, 1) for a in names))
    return tuple(out), True


def _strides(x: Array) -> tuple[int, ...] | None:
    """The strides of :func:`_sample` for a leaf shaped as ``x``, or ``None`` to read it whole."""
    size = math.prod(x.shape)
    if size <= SAMPLE_MIN:
        return None
    want = size // SAMPLE_SIZE
    local, known = _local_shape(x)
    strides = []
    for n in local:
        top = n if known else n // 16  # where the split is unknown, strides that divide a 16-way shard too
        s = 1
        while s * 2 <= want and n % (s * 2) == 0 and s * 2 <= top:
            s *= 2
        strides.append(s)
        want //= s
    return None if all(s == 1 for s in strides) else tuple(strides)


def _sample(x: Array, strides: tuple[int, ...] | None) -> Array:
    """A strided sample of ``x`` (about :data:`SAMPLE_SIZE` elements where it has more than :data:`SAMPLE_MIN`): powers
    of two dividing each dimension's local size, taken from the first dimension on, so that the sample of a sharded
    leaf is a sample of each device's block and a slice of the buffer itself (no pass over the rest of it)."""
    return x if strides is None else x[tuple(slice(None, None, s) for s in strides)]


def probe_dots(
    grads: list[Array], trace: list[Array], params: list[Array] | None, scale: Any = 1.0, strides: Any = None
) -> Array:
    """Per leaf, ``(ḡ·m, ‖ḡ‖², ḡ·θ, ‖m‖², m·θ, ‖θ‖²)`` on a strided sample of each buffer (the same positions in each,
    :func:`_sample`), scaled to the whole leaf: float32 ``[L, 6]`` (the θ terms 0 without ``params``). ``grads``:
    buffers ``1/scale`` times the averaged gradient (an all-reduce's output, so that the sample is a slice of that
    buffer). The samples of the leaves of one dtype, one varying type (under ``shard_map``) and one power-of-two
    length are stacked, padded with zeros, and reduced together: a variadic reduction per such bucket, not one per
    leaf (many small leaves: a few reductions). A large leaf read whole (more than :data:`SAMPLE_MIN` elements, none
    of whose strides divides its blocks) is reduced in place, on its own: stacked, it would be copied. ``strides``:
    per leaf, those of :func:`_strides` (a ``shard_map`` body passes the whole leaves', which its blocks cannot
    tell). Each device's own pieces: summing over the pieces of a split leaf is the caller's
    (its statistics' reduction)."""
    if not grads:
        return jnp.zeros((0, 6), jnp.float32)
    sets, factors, whole = [], [], []
    for i, (g, m) in enumerate(zip(grads, trace, strict=True)):
        leaf_strides = _strides(g) if strides is None else strides[i]
        buffers = [g, m] if params is None else [g, m, params[i]]
        sampled = [_sample(x, leaf_strides).reshape(-1) for x in buffers]
        factors.append(math.prod(g.shape) / sampled[0].shape[0])
        sets.append(sampled)
        whole.append(leaf_strides is None)
    pairs = [(0, 1), (0, 0), (1, 1)] if params is None else [(0, 1), (0, 0), (0, 2), (1, 1), (1, 2), (2, 2)]
    buckets: dict[Any, list[int]] = {}
    dots: list[Any] = [None] * len(sets)
    for i, sampled in enumerate(sets):  # padded to the next power of two: at most twice each sample
        if whole[i] and sampled[0].shape[0] > SAMPLE_MIN:
            dots[i] = _norms.gram_dots(sampled, pairs)
            continue
        width = 1 << max(sampled[0].shape[0] - 1, 0).bit_length()
        key = (_norms.compute_dtype(jnp.result_type(*sampled)), _compat.varying_axes(sampled[0]), width)
        buckets.setdefault(key, []).append(i)
    for (_, _, width), members in buckets.items():
        stacked = [
            jnp.stack([jnp.pad(sets[i][j], (0, width - sets[i][j].shape[0])) for i in members])
            for j in range(len(sets[members[0]]))
        ]
        sums = _norms.gram_dots(stacked, pairs, axis=1)
        for row, i in enumerate(members):
            dots[i] = [x[row] for x in sums]
    scale = jnp.asarray(scale, jnp.float32)
    zero = jnp.zeros([], jnp.float32)
    rows = []
    for values, factor in zip(dots, factors, strict=True):
        if params is None:
            gm, gg, mm = values
            gt = mt = tt = zero
        else:
            gm, gg, gt, mm, mt, tt = values
        rows.append(factor * jnp.stack([scale * gm, scale * scale * gg, scale * gt, mm, mt, tt]))
    return jnp.stack(rows)


def probe_dots_partitioned(
    grads: list[Array], trace: list[Array], params: list[Array] | None, specs: Any = None
) -> Array | None:
    """:func:`probe_dots` of leaves a jit step partitions over a mesh, in one ``shard_map`` over the whole mesh: each
    device's sample of its own blocks, a block replicated over an axis counted once (index 0 along it), then one
    ``psum`` over every axis. Its all-reduce spans every device, as the GSPMD drop-in's statistics' does, and depends
    on nothing the update writes: XLA combines the two. The layout is the leaves' types' on an Explicit mesh, or
    ``specs`` (per leaf, the drop-in's ``param_specs``) on one with Auto axes; ``None`` where neither says it (the
    compiler's own reductions then)."""
    if specs is not None:  # an Auto mesh: the buffers laid out as the gradients are
        context = jax.sharding.get_abstract_mesh()
        if getattr(context, "empty", True) or len(specs) != len(grads):
            return None
        # The momentum's layout is not in its type here (an Auto mesh's jit of tx.init may replicate it): the samples
        # are sliced by the partitioner first, so that only they, not the buffers, are laid out as the gradients are.
        strides = [_strides(g) for g in grads]
        factors = jnp.asarray(
            [math.prod(g.shape) / math.prod(_sample(g, st).shape) for g, st in zip(grads, strides, strict=True)],
            jnp.float32,
        )
        sample = lambda xs: [_sample(x, st) for x, st in zip(xs, strides, strict=True)]  # noqa: E731
        taken_params = sample(params) if params is not None else None
        specs = [*specs, *specs, *(specs if params is not None else [])]
        rows = _probe_on_mesh(context, specs, sample(grads), sample(trace), taken_params, strides=[None] * len(grads))
        return rows * factors[:, None]
    sharding = [getattr(jax.typeof(x), "sharding", None) for x in [*grads, *trace, *(params or [])]]
    meshes = {getattr(sh, "mesh", None) for sh in sharding}
    if len(meshes) != 1 or any(getattr(sh, "spec", None) is None for sh in sharding):
        return None
    (mesh,) = meshes
    if mesh is None or getattr(mesh, "empty", True) or set(mesh.axis_types) != {jax.sharding.AxisType.Explicit}:
        return None
    return _probe_on_mesh(mesh, [sh.spec for sh in sharding if sh is not None], grads, trace, params)


def _probe_on_mesh(
    mesh: Any, specs: list[Any], grads: list[Array], trace: list[Array], params: Any, strides: Any = None
) -> Array:
    axes = tuple(mesh.axis_names)
    n = len(grads)
    if strides is None:  # the whole leaves' (they divide each device's block)
        strides = [_strides(g) for g in grads]

    def body(*blocks):
        g, m = list(blocks[:n]), list(blocks[n : 2 * n])
        t = list(blocks[2 * n :]) if params is not None else None
        rows = probe_dots(g, m, t, strides=strides)
        for i, spec in enumerate(specs[:n]):
            used = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else tuple(entry or ()))}
            for a in axes:
                if a not in used:
                    rows = rows.at[i].multiply(jnp.where(lax.axis_index(a) == 0, 1.0, 0.0))
        return lax.psum(rows, axes)

    return jax.shard_map(
        body, mesh=mesh, in_specs=tuple(specs), out_specs=jax.sharding.PartitionSpec(), check_vma=False
    )(*grads, *trace, *(params or []))
