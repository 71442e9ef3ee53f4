"""Which arguments are the batch, and whether its rows split into ``shards × k`` micro-batches: read off their
types on Explicit axes, from ``arg_specs`` or inferred (the arrays whose first dimension ``shards × k`` divide) on a
mesh of Auto axes, whose types do not record it. Refused, naming the arguments and sizes, where ambiguous or where
the rows do not split."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd import _specs, _types
from optax_adascale.gspmd._call import broadcast
from optax_adascale.gspmd._layout import Layout


def auto_specs(layout: Layout, state: Any, arrays: list[Any], given: Any, names: list[str]) -> list[P]:
    """Each argument leaf's spec inside the loss on an Auto mesh (whose types do not record it), the state's leaves
    first: ``arg_specs`` (:meth:`Call.arg_specs`), or the batch inferred (every array whose first dimension
    ``shards × k`` divide; state replicated), refused where ambiguous or where no array's rows split."""
    state_leaves = jax.tree.leaves(state)
    if given is not None:
        state_spec, array_specs = given
        state_specs = [P()] * len(state_leaves) if state_spec is None else broadcast(state_spec, state)
        per_leaf = state_specs + list(array_specs)
        specs = _specs.specs_like(per_leaf, [*state_leaves, *arrays], layout, "arg_specs")
        sharded = [i for i, spec in enumerate(specs[len(state_leaves) :]) if rows_over(layout, spec)]
        check_rows_split(layout, arrays, names, sharded)
        return specs
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    n = layout.shards * layout.k
    candidates = [i for i, x in enumerate(arrays) if jnp.ndim(x) and not is_key(x)]
    rows = [i for i in candidates if jnp.shape(arrays[i])[0] % n == 0]
    if not rows:  # nothing splits: name the arrays that could be the batch, not "no argument is sharded"
        check_rows_split(layout, arrays, names, candidates, inferred=True)
    sizes = sorted({arrays[i].shape[0] for i in rows})
    if len(sizes) > 1:
        raise ValueError(
            f"value_and_grad(data_axes={layout.data_spec!r}) on a mesh with Auto axes cannot tell which arguments "
            f"are the batch: the mesh does not record how they are sharded, and arguments with first dimensions "
            f"{sizes} could each be its rows. Pass arg_specs= (one entry per argument that is not differentiated: "
            f"P({layout.data_spec!r}) for the batch, P() for an argument passed whole; MaxText: the data sharding), "
            "or use a mesh with Explicit axes (jax.make_mesh's default)."
        )
    return [P()] * len(state_leaves) + [P(layout.data_spec) if i in rows else P() for i in range(len(arrays))]


def rows_over(layout: Layout, spec: Any) -> bool:  # the first dimension split over every data axis
    return bool(spec) and set(layout.data) <= set(_types.spec_axes(spec[0]))


def check_rows_split(layout: Layout, arrays: list[Any], names: list[str], batch: list[int], inferred=False) -> None:
    """Raise naming the batch's arguments and sizes where their rows do not split into ``shards × k`` blocks (data
    shard ``s``'s micro-batch ``j`` is the ``j``-th block of its rows)."""
    bad = [i for i in batch if jnp.shape(arrays[i])[0] % layout.n]
    if not bad:
        return
    which = ", ".join(f"{names[i] if i < len(names) else f'array {i}'} has {jnp.shape(arrays[i])[0]} rows" for i in bad)
    rows = jnp.shape(arrays[bad[0]])[0]
    per_shard = f"{rows / layout.shards:g}"
    raise ValueError(
        f"value_and_grad(data_axes={layout.data_spec!r}, num_microbatches={layout.k}): {which}: the batch does not "
        f"split into data shards × micro-batches = {layout.shards} × {layout.k} = {layout.n} equal blocks of rows "
        f"({per_shard} rows per data shard, {rows / layout.n:g} per micro-batch). Feed a batch whose rows are a "
        f"multiple of {layout.n} (e.g. {max(layout.n, rows // layout.n * layout.n)} or "
        f"{(rows // layout.n + 1) * layout.n}), or a num_microbatches that divides the rows of a data shard."
        + (" If these are not the batch, say which argument is with arg_specs=." if inferred else "")
    )


def check_explicit(layout: Layout, arrays: list[Any], names: list[str]) -> None:
    """On Explicit axes with ``k > 1``: the arrays sharded over the data axes on their first dimension are the batch,
    and their rows split into ``shards × k`` blocks (``k = 1``: the shardings themselves need the rows to divide the
    shards)."""
    if layout.k > 1:
        sharded = [i for i, x in enumerate(arrays) if jnp.ndim(x) and rows_over(layout, _types.partitions(x))]
        check_rows_split(layout, arrays, names, sharded)
