"""A loss written for a mesh of Auto axes, run with those axes made Explicit: the per-copy statistics need
reduced/unreduced sharding types, which JAX has on Explicit axes only.

The loss is traced once on the Auto mesh as the user set it (at one micro-batch's shapes), and its jaxpr is
re-evaluated inside ``jax.sharding.explicit_axes`` with the parameters laid out by ``param_specs`` and the arguments
by the batch's specs (``_batch``); GSPMD's decisions where Explicit types ask for one are ``_auto``'s.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.core import _checks
from optax_adascale.gspmd import _global, _types
from optax_adascale.gspmd._layout import Layout


def run(loss_fn, has_aux, layout: Layout, mesh, convert, specs, arg_specs, params, args, unroll=1, n_state=0):
    """The Auto axes made Explicit for the loss, which is traced once on the Auto mesh.

    Reduced/unreduced types are only sound with every mesh axis Explicit (JAX 0.10 asserts it), so every Auto
    axis is converted (a mesh of both kinds is refused: ``_mesh.check_one_axis_type``). Inside, the parameters
    are laid out by ``specs`` (``param_specs``; replicated without them, with a warning) and the arguments by
    ``arg_specs`` (``_batch.auto_specs``: the batch sharded over the data axes); the loss's
    jaxpr is re-evaluated there with those axes dropped from its ``with_sharding_constraint``\\ s, and the
    decisions Explicit types ask for made as GSPMD makes them (``_rewrite``).
    """
    layout = dataclasses.replace(layout, convert=frozenset(convert))
    if layout.mesh is not None:  # the concrete mesh named in the shard_maps must carry the converted types
        explicit = (jax.sharding.AxisType.Explicit,) * len(layout.axis_names)
        layout = dataclasses.replace(
            layout, mesh=jax.sharding.Mesh(layout.mesh.devices, layout.axis_names, axis_types=explicit)
        )
    leaves, treedef = jax.tree.flatten(params)
    if specs is None:
        specs = [P()] * len(leaves)
        if math.prod(layout.axis_sizes) > 1 and leaves:
            _checks.warn(
                f"value_and_grad(data_axes={layout.data_spec!r}) on a mesh with Auto axes: the mesh does not record "
                "how the parameters are laid out, so they are replicated inside the loss and the memory saving of "
                "FSDP or tensor parallelism is lost on every device (the values are exact). Pass their "
                "PartitionSpecs as param_specs= (a pytree like params; MaxText: the state's shardings), or use a "
                "mesh with Explicit axes (jax.make_mesh's default)."
            )
    flat, tree = jax.tree.flatten(args)
    n_leaves = len(leaves)
    out_tree = []

    def flat_loss(*xs):
        out = loss_fn(treedef.unflatten(list(xs[:n_leaves])), *tree.unflatten(list(xs[n_leaves:])))
        flat_out, t = jax.tree.flatten(out if has_aux else (out, None))
        out_tree.append(t)
        return flat_out

    # The loss traced here, on the Auto mesh as the user set it, at the shapes it runs at (one micro-batch's).
    # What it closes over from the enclosing jit (outer tracers, typed on the Auto mesh) goes in with the
    # arguments, so that inside it is typed on the Explicit mesh too.
    rows = [
        i for i, spec in enumerate(arg_specs) if set(layout.data) & set(_types.spec_axes(spec[0] if spec else None))
    ]
    micro = [
        jax.ShapeDtypeStruct(((x.shape[0] // layout.k,) + x.shape[1:]) if i in rows else jnp.shape(x), x.dtype)
        for i, x in enumerate(flat)
    ]
    plain = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
        closed = jax.make_jaxpr(flat_loss)(*plain, *micro)
    outer = [i for i, c in enumerate(closed.consts) if _compat.is_tracer(c)]

    def inner(leaves, flat, captured):
        consts = list(closed.consts)
        for i, c in zip(outer, captured, strict=True):
            consts[i] = c
        trace = lambda *_: (_compat.closed_jaxpr(closed.jaxpr, consts), out_tree[-1])  # noqa: E731
        try:
            params_in, args_in = treedef.unflatten(leaves), tree.unflatten(flat)
            return _global.run(loss_fn, has_aux, layout, params_in, args_in, trace, unroll, n_state)
        except _compat.sharding_type_error() as err:  # JAX refuses the loss on Explicit axes: our refusal, the fix
            raise ValueError(_auto_refusal(layout, convert, err)) from err

    captured = [closed.consts[i] for i in outer]
    in_sharding = (list(specs), arg_specs, [P()] * len(captured))
    converted = jax.sharding.explicit_axes(inner, axes=convert, in_sharding=in_sharding)
    return converted(leaves, flat, captured)


def _auto_refusal(layout: Layout, convert, err) -> str:
    return (
        f"value_and_grad(data_axes={layout.data_spec!r}) on a mesh with Auto axes runs loss_fn with the axes "
        f"{tuple(convert)} Explicit (their reduced/unreduced sharding types give the per-copy statistics, and "
        f"JAX has them on Explicit axes only), and loss_fn does not run that way: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}. Build the mesh with Explicit axes (jax.make_mesh's "
        "default) and write the loss the Explicit way (out_sharding= where JAX asks for it); value, grads and "
        "statistics are then exact for any loss."
    )
