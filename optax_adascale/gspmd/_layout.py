"""The static facts of one call (:class:`Layout`): the mesh, the data axes and the axes the batch's rows are split
over besides them, the micro-batches, the mesh axes made Explicit for a loss traced on an Auto mesh."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd._types import partitions, spec_axes


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static facts of one call: the mesh, the data axes, the samples.

    Attributes:
      axis_names, axis_sizes: the mesh's axes, in mesh order.
      data: the data axes (``data_axes``), in mesh order.
      shards: data shards, ``∏`` of the data axes' sizes.
      k: micro-batches per shard.
      mesh: the concrete mesh when passed as ``mesh=`` (else ``None``: the context's).
      extra: mesh axes the batch is split over besides the data axes (a sequence axis; HSDP's ``fsdp`` when
        ``data_axes`` names ``data`` alone). A parameter's copy is ``reduced`` over every axis its rows are split
        over (:attr:`rows`), so its partials are ``unreduced`` over them; the samples are the data shards, whose
        partials sum those over the extra axes (:func:`data_partial`).
      convert: the mesh axes made Explicit for a loss traced with them Auto (``_convert.run``).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    data: tuple[str, ...]
    k: int
    mesh: Any = None
    extra: tuple[str, ...] = ()
    convert: frozenset[str] = frozenset()

    @classmethod
    def of(cls, mesh: Any, names: tuple[str, ...], k: int, given: Any = None) -> Layout:
        """``given``: the ``mesh=`` argument; a concrete mesh passed that way is named in every ``shard_map``
        (no mesh set around the jit: it tells JAX the devices)."""
        order = tuple(mesh.axis_names)
        data = tuple(a for a in order if a in names)
        concrete = given if isinstance(given, jax.sharding.Mesh) else None
        return cls(order, tuple(mesh.shape[a] for a in order), data, k, concrete)

    @property
    def shards(self) -> int:
        return math.prod(self.size(a) for a in self.data)

    @property
    def n(self) -> int:
        return self.shards * self.k

    def size(self, axis: str) -> int:
        return self.axis_sizes[self.axis_names.index(axis)]

    @property
    def data_spec(self) -> Any:
        """The batch dimension's spec entry: the data axes."""
        return self.data[0] if len(self.data) == 1 else self.data

    def mesh_spec(self) -> P:
        """The spec of a mesh-shaped array of per-device values: one dimension per mesh axis."""
        return P(*self.axis_names)

    @property
    def rows(self) -> frozenset[str]:
        """Every mesh axis the batch's rows are split over: the data axes and :attr:`extra`."""
        return frozenset(self.data) | frozenset(self.extra)

    def with_batch(self, args: Any) -> Layout:
        """This layout with :attr:`extra` read off the batch: the axes its leaves (those sharded over the data
        axes on their first dimension) are split over besides the data axes."""
        data = set(self.data)
        extra: set[str] = set()
        for x in jax.tree.leaves(args):
            if hasattr(x, "shape") and jnp.ndim(x) and data <= set(spec_axes(partitions(x)[0])):
                extra |= {a for e in partitions(x) for a in spec_axes(e)}
        ordered = tuple(a for a in self.axis_names if a in extra - data and self.size(a) > 1)
        return dataclasses.replace(self, extra=ordered)
