"""The user's ``param_specs`` and ``arg_specs`` checked: a pytree prefix of the arguments broadcast to one spec per
leaf, each spec fitting the mesh and its leaf's rank; on Explicit axes, ``param_specs`` agreeing with the types."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._types import partitions, spec_axes


def specs_like(given: Any, tree: Any, layout: Layout, name: str = "param_specs") -> list[P]:
    """``given`` (``PartitionSpec``\\ s or ``NamedSharding``\\ s, a pytree prefix of ``tree``) as one spec per leaf
    of ``tree``, checked against the mesh and the leaves' ranks."""
    is_spec = lambda x: x is None or isinstance(x, (P, jax.sharding.NamedSharding))  # noqa: E731
    leaves, treedef = jax.tree.flatten(tree)
    try:
        flat = broadcast_prefix(given, tree, is_spec)
    except (ValueError, TypeError) as err:
        spec_tree = jax.tree.structure(given, is_leaf=is_spec)
        what = "params" if name == "param_specs" else "the arguments after params"
        raise ValueError(
            f"{name} must be a pytree like {what} with one PartitionSpec per leaf (or per subtree): got {spec_tree} "
            f"for {treedef}."
        ) from err
    out = []
    for x, spec in zip(leaves, flat, strict=True):
        if isinstance(spec, jax.sharding.NamedSharding):
            spec = spec.spec
        if spec is None:
            spec = P()
        if not isinstance(spec, P):
            raise TypeError(f"{name} leaves must be PartitionSpecs or NamedShardings, got {spec!r}")
        parts = tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))
        unknown = [a for e in parts for a in spec_axes(e) if a not in layout.axis_names]
        if len(parts) > jnp.ndim(x) or unknown:
            raise ValueError(
                f"{name}: {spec} does not fit an array of shape {tuple(jnp.shape(x))} on the mesh with axes "
                f"{layout.axis_names}."
            )
        out.append(P(*parts))
    return out


class _Group(tuple):
    """One prefix leaf's copies, one per leaf of the subtree it covers (a tuple JAX does not flatten into)."""


def broadcast_prefix(prefix: Any, tree: Any, is_leaf) -> list[Any]:
    """One entry of ``prefix`` (a pytree prefix of ``tree``; ``is_leaf`` says what its leaves are) per leaf of
    ``tree``, in ``tree``'s flattening order."""
    groups = jax.tree.map(lambda s, sub: _Group([s] * len(jax.tree.leaves(sub))), prefix, tree, is_leaf=is_leaf)
    return [s for group in jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, _Group)) for s in group]


def param_specs_like(param_specs: Any, params: Any, layout: Layout) -> list[P] | None:
    """``param_specs`` as one spec per leaf of ``params``; ``None`` if not given."""
    return None if param_specs is None else specs_like(param_specs, params, layout)


def check_specs_agree(specs: list[P], params: Any) -> None:
    """On Explicit axes the parameters' types carry their layout: ``param_specs`` must say the same."""
    for i, (spec, x) in enumerate(zip(specs, jax.tree.leaves(params), strict=True)):
        if tuple(spec) != partitions(x):
            raise ValueError(
                f"param_specs: leaf {i} is typed {P(*partitions(x))} on this mesh of Explicit axes, but param_specs "
                f"says {spec}. On Explicit axes the parameters' types are their layout; give the specs they are "
                "placed with, or leave param_specs out."
            )
