"""Parameter groups (FairScale's ``param_groups``): which leaf feeds which ``[G]`` statistic.

A static map from the leaves of the parameter tree to group indices, and the
packing of ``[G]`` float32 vectors into state fields (a scalar without labels, a
dict label → scalar with them).
"""

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from optax_adascale.core._norms import STAT_DTYPE

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Groups:
    """Leaf → group map. ``labels`` is ``None`` for the single unlabelled group."""

    labels: tuple[Hashable, ...] | None
    leaf_group: tuple[int, ...]

    @property
    def size(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    def pack(self, vec: Array) -> Any:
        """A ``[G]`` vector as a state field: a scalar, or a dict label → scalar."""
        if self.labels is None:
            return vec[0]
        return {label: vec[i] for i, label in enumerate(self.labels)}

    def pack_gains(self, vec: Array) -> Any:
        """Per-group gains as a state field: ``{}`` without labels."""
        return {} if self.labels is None else self.pack(vec)

    def unpack(self, value: Any) -> Array:
        """A state field back into a ``[G]`` vector."""
        if self.labels is None:
            return jnp.reshape(value, (1,))
        return jnp.stack([value[label] for label in self.labels])

    def sums(self, values: Sequence[Array]) -> Array:
        """Per-leaf scalars summed into a float32 ``[G]`` vector."""
        return group_sums(values, self.leaf_group, self.size)


def group_sums(values: Sequence[Array], leaf_group: Sequence[int], num_groups: int) -> Array:
    """Sum per-leaf scalars into a float32 ``[G]`` vector by group index."""
    totals = [jnp.zeros((), STAT_DTYPE) for _ in range(num_groups)]
    for value, group in zip(values, leaf_group, strict=True):
        totals[group] = totals[group] + value.astype(STAT_DTYPE)
    return jnp.stack(totals)


def resolve_groups(param_labels: Any, tree: Any) -> Groups:
    """The groups of ``tree``'s leaves from ``param_labels`` (labels shaped like the tree, or ``tree -> labels``).

    Labels are ordered by ``sorted()``, so they must be mutually comparable.
    """
    treedef = jax.tree.structure(tree)
    if param_labels is None:
        return Groups(None, (0,) * treedef.num_leaves)
    labels = param_labels(tree) if callable(param_labels) else param_labels
    try:
        flat = treedef.flatten_up_to(labels)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"param_labels must have the structure of the params ({treedef}), got param_labels={labels!r}"
        ) from err
    try:
        order = tuple(sorted(set(flat)))
    except TypeError as err:
        labels_seen = sorted(set(map(repr, flat)))
        raise TypeError(f"param_labels must be mutually sortable (e.g. all str), got {labels_seen}") from err
    index = {label: i for i, label in enumerate(order)}
    return Groups(order, tuple(index[label] for label in flat))
