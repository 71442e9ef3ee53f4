"""A loss that names shardings, evaluated one sample at a time: its sharding annotations rewritten.

A loss written the Explicit way (``jax.make_mesh``'s default axes) names shardings with the batch axis
among them: ``jnp.einsum(..., out_sharding=P("data", "model"))``, ``jax.sharding.reshard``,
``jax.lax.with_sharding_constraint`` — as MaxText and Flax's lm1b write theirs. ``value_and_grad
(data_axes=...)`` evaluates the loss on one sample's rows at a time, ``vmap``-ed over the data shards
with ``spmd_axis_name=data_axes`` and, on an Explicit mesh, with the axes Auto
(``jax.sharding.auto_axes``). There JAX refuses mesh axes in ``out_sharding=``, and a spec naming a data
axis cannot be honoured on one sample's rows: the vmapped dimension holds the data axes.

So the loss is traced once, on one sample's shapes, on an abstract copy of the mesh whose data axes
have size 1 (a sample is one data shard: every spec the loss writes is valid there, and its data axes
mean nothing), and re-evaluated with each sharding annotation turned into a sharding constraint with
the data axes dropped: ``P("data", "model")`` becomes ``P(None, "model")``, which under the ``vmap``
is ``P(data_axes, None, "model")`` — the global call's layout. The model axes stay constrained as the
loss wrote them; the numbers do not depend on any of it. Recurses into ``jit``, ``scan``, ``while``,
``cond`` and ``checkpoint`` (:mod:`._interpret`); ``custom_jvp`` / ``custom_vjp`` functions are bound
as traced (annotations inside them are not rewritten).
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale._interpret import Interpreter, subjaxprs, weak

_ANNOTATIONS = ("reshard", "sharding_constraint", "mesh_cast")


def rewrite(loss_fn, params, batch, per, data_axes, mesh, explicit):
    """``(loss, why_not)``: ``loss(params, *batch)`` for one sample's rows with its shardings rewritten.

    ``loss`` is ``None`` if the loss names no mesh axis in a sharding, or (``why_not``, the error) if on an
    Explicit mesh it does not trace the Explicit way on one sample's rows (e.g. a matmul contracting
    model-sharded dimensions without ``out_sharding=``): it then runs with the axes Auto, as written.
    ``batch`` is the global batch (scalar leaves go to every sample as they are); ``explicit``: the loss
    is traced on the size-1-data-axes copy of the mesh with the arguments' Explicit shardings.
    """
    param_leaves, treedef = jax.tree.flatten(params)
    batch_leaves, batch_def = jax.tree.flatten(batch)
    leaves = [*param_leaves, *batch_leaves]
    specs = [jax.typeof(x).sharding.spec if explicit else None for x in leaves]
    # The data axes at size 1; an extra axis, named in no spec, keeps the device count JAX requires.
    shards = math.prod(mesh.shape[a] for a in data_axes)
    shard_mesh = jax.sharding.AbstractMesh(
        (*(1 if a in data_axes else mesh.shape[a] for a in mesh.axis_names), shards),
        (*mesh.axis_names, "_samples"),
        axis_types=(*mesh.axis_types, jax.sharding.AxisType.Explicit),
    )
    out_tree = []
    traced = {}

    def flat_loss(*args):
        ps = treedef.unflatten(list(args[: len(param_leaves)]))
        flat, tree = jax.tree.flatten(loss_fn(ps, *batch_def.unflatten(list(args[len(param_leaves) :]))))
        out_tree.append(tree)
        return flat

    def trace(shapes):
        """The loss's jaxpr at these argument shapes (another row count too: ``_global_draws`` traces at two)."""
        if shapes not in traced:
            if explicit:
                avals = [
                    jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(shard_mesh, spec), weak_type=weak(x))
                    for x, shape, spec in zip(leaves, shapes, specs, strict=True)
                ]
                with jax.sharding.use_abstract_mesh(shard_mesh):
                    traced[shapes] = jax.make_jaxpr(flat_loss)(*avals)
            else:
                avals = [jax.ShapeDtypeStruct(s, x.dtype, weak_type=weak(x)) for x, s in zip(leaves, shapes)]
                traced[shapes] = jax.make_jaxpr(flat_loss)(*avals)
        return traced[shapes]

    sample = tuple(jnp.shape(x) for x in param_leaves) + tuple(
        (per,) + jnp.shape(x)[1:] if jnp.ndim(x) else () for x in batch_leaves
    )
    try:
        closed = trace(sample)
    except Exception as err:  # noqa: BLE001 - not written the Explicit way: it runs with the axes Auto
        if not explicit:
            raise
        return None, err
    if not _annotated(closed.jaxpr):
        return None, None

    def loss(params, *batch):
        args = [*jax.tree.leaves(params), *jax.tree.leaves(batch)]
        closed = trace(tuple(jnp.shape(x) for x in args))
        rewrite = _Rewrite(set(data_axes), jax.sharding.get_abstract_mesh(), mesh)
        return out_tree[-1].unflatten(rewrite.eval(closed.jaxpr, closed.consts, args))

    return loss, None


def _specs(eqn):
    if eqn.primitive.name in _ANNOTATIONS:
        sharding = eqn.params.get("dst_sharding", eqn.params.get("sharding"))
        return [getattr(sharding, "spec", P())]
    return [v.spec for v in eqn.params.values() if isinstance(v, NamedSharding)]


def _annotated(jaxpr):
    """Whether any equation (in any sub-jaxpr) names a mesh axis in a sharding."""
    for eqn in jaxpr.eqns:
        if any(_axes(spec) for spec in _specs(eqn)) or any(_annotated(j) for j in subjaxprs(eqn)):
            return True
    return False


def _axes(spec):
    names = set()
    for entry in spec:
        names.update((entry,) if isinstance(entry, str) else entry or ())
    return names


def _strip(spec, data_axes):
    """The spec without the data axes (and without ``reduced`` / ``unreduced``: the partitioner reduces)."""

    def entry(e):
        kept = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in data_axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(entry(e) for e in spec))


class _Rewrite(Interpreter):
    """Every equation re-bound without its shardings, which become constraints without the data axes."""

    def __init__(self, data_axes, context, mesh):
        self.data_axes, self.context, self.mesh = data_axes, context, mesh

    def bind(self, eqn, invals, params=None):
        params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
        with eqn.ctx.manager, jax.sharding.use_abstract_mesh(self.context):  # not the trace's size-1-data-axes mesh
            return eqn.primitive.bind(*invals, **params)

    def rewrites(self, eqn):
        return True

    def leaf(self, eqn, invals):
        if eqn.primitive.name in _ANNOTATIONS:
            return self.constrain(invals[0], _specs(eqn)[0])
        params = {k: None if isinstance(v, NamedSharding) else v for k, v in eqn.params.items()}
        out = self.bind(eqn, invals, params)
        specs = _specs(eqn)
        if specs and not eqn.primitive.multiple_results:
            out = self.constrain(out, specs[0])
        return out

    def opaque(self, eqn, invals):
        return self.bind(eqn, invals)

    def constrain(self, x, spec):
        if not jnp.issubdtype(x.dtype, jnp.number) and x.dtype != jnp.bool_:
            return x  # PRNG keys
        spec = _strip(spec, self.data_axes)  # a bare spec means the context's mesh; with none set, ``mesh=``'s
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec) if self.context.empty else spec)
