"""Random draws inside the loss, made as the global call makes them: a rewrite of the loss's jaxpr.

Used by :func:`optax_adascale.value_and_grad` (``_gspmd``), which evaluates ``loss_fn`` on one
sample's rows at a time (a ``vmap`` over the data shards, a ``scan`` over their micro-batches). A
draw shaped by the rows — a dropout mask of shape ``(rows, ...)`` from a key closed over or passed
unbatched — would then be the *same* for every sample, where the global call draws a different mask
for every row.

JAX's partitionable threefry (``jax_threefry_partitionable``, the default) makes element ``j`` (in
row-major order) of a draw of shape ``(B, ...)`` the threefry2x32 hash of ``(key, j)``, ``j`` a 64-bit
counter. Sample ``s``'s part of the global draw is therefore the draw at the counters of its rows in
the global shape, and costs what the sample's own draw costs. The loss is traced to a jaxpr twice, at
the sample's row count and at twice that, to find the ``random_bits`` / ``random_split`` equations
whose shape follows the rows (and along which dimension); it is re-evaluated with each of those
replaced by the sample's slice of the global draw. Draws of any other shape (noise of a parameter's
shape) are left as they are: they are the global call's already.

It recurses into ``jit``, ``scan``, ``while``, ``cond`` and ``checkpoint`` (:mod:`._interpret`); a
row-shaped draw inside a ``custom_jvp`` / ``custom_vjp`` function, from a key of another implementation
(``rbg``), or with ``jax_threefry_partitionable`` off raises a ``ValueError``: those draws cannot be
sliced.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale._interpret import Interpreter, subjaxprs, weak

_DRAWS = ("random_bits", "random_split")
_U32 = jnp.uint32


def rewrite(loss_fn, param_leaves, treedef, batch_shapes, per, n):
    """``loss(params, *batch, row_ids)`` with row-shaped draws as the global call's; ``None`` if it has none.

    ``batch_shapes``: one sample's batch (``per`` rows). ``row_ids`` (int32, the sample's global row
    numbers) tells the rewritten loss which sample it evaluates: ``row_ids[0] // per``.
    """
    batch_def = jax.tree.structure(batch_shapes)
    out_tree = []

    def flat_loss(*args):
        params = treedef.unflatten(list(args[: len(param_leaves)]))
        flat, tree = jax.tree.flatten(loss_fn(params, *batch_def.unflatten(args[len(param_leaves) :])))
        out_tree.append(tree)
        return flat

    def trace(rows):
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct((rows,) + s.shape[1:], s.dtype), batch_shapes)
        params = [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p), weak_type=weak(p)) for p in param_leaves]
        return jax.make_jaxpr(flat_loss)(*params, *jax.tree.leaves(shapes))

    closed = trace(per)
    if not _has_draws(closed.jaxpr):
        return None
    try:
        twice = trace(2 * per)
    except Exception as err:  # noqa: BLE001 - e.g. a shape written into the loss
        raise ValueError(
            f"loss_fn makes random draws, and value_and_grad(data_axes=...) traces it at {2 * per} rows (a sample "
            f"has {per}) to tell which draws follow the rows, but it fails there: {err}. Write the loss for any "
            "number of rows (shapes from its inputs)."
        ) from err
    plan = {}
    _plan(closed.jaxpr, twice.jaxpr, per, plan)
    if not plan:
        return None

    def loss(params, *batch_and_rows):
        *batch, row_ids = batch_and_rows
        sample = (row_ids[0] // per).astype(_U32)
        args = [*jax.tree.leaves(params), *jax.tree.leaves(batch)]
        flat = _Rewrite(plan, n, sample).eval(closed.jaxpr, closed.consts, args)
        return out_tree[0].unflatten(flat)

    return loss


def _has_draws(jaxpr):
    return any(e.primitive.name in _DRAWS or any(_has_draws(j) for j in subjaxprs(e)) for e in jaxpr.eqns)


def _plan(jaxpr, twice, per, plan):
    """Mark (by ``id``) each row-shaped draw with its row dimension and each equation holding one.

    ``twice`` is the same loss traced at ``2 · per`` rows: a draw's row dimension is the one that doubled.
    """
    names = [e.primitive.name for e in jaxpr.eqns]
    if names != [e.primitive.name for e in twice.eqns]:
        raise ValueError(
            "loss_fn makes random draws and traces to a different computation at another row count, so "
            "value_and_grad(data_axes=...) cannot tell which draws follow the batch rows. Make the loss's "
            "operations depend on the batch only through array shapes."
        )
    found = False
    for eqn, other in zip(jaxpr.eqns, twice.eqns, strict=True):
        if eqn.primitive.name in _DRAWS:
            shape, doubled = eqn.params["shape"], other.params["shape"]
            grown = [d for d, (a, b) in enumerate(zip(shape, doubled, strict=True)) if a != b]
            if not grown:
                continue
            if len(grown) > 1 or doubled[grown[0]] != 2 * shape[grown[0]] or shape[grown[0]] % per:
                raise ValueError(
                    f"loss_fn draws random numbers of shape {tuple(shape)} for {per} rows (of shape "
                    f"{tuple(doubled)} for {2 * per}): value_and_grad(data_axes=...) matches the global call's "
                    "draws only when one dimension is the rows (times a constant). Draw with the rows on one "
                    "dimension, e.g. jax.random.bernoulli(key, p, x.shape) for activations x."
                )
            plan[id(eqn)] = grown[0]
            found = True
        else:
            inner = [_plan(a, b, per, plan) for a, b in zip(subjaxprs(eqn), subjaxprs(other), strict=True)]
            if any(inner):
                plan[id(eqn)] = None
                found = True
    return found


class _Rewrite(Interpreter):
    """Evaluates a jaxpr with the planned draws replaced by sample ``sample``'s slice of the global draw."""

    def __init__(self, plan, n, sample):
        self.plan, self.n, self.sample = plan, n, sample

    def rewrites(self, eqn):
        return id(eqn) in self.plan

    def leaf(self, eqn, invals):
        return self.draw(eqn, invals[0])

    def opaque(self, eqn, invals):
        raise ValueError(
            f"loss_fn makes a random draw shaped by the batch rows inside a `{eqn.primitive.name}` (e.g. a "
            "jax.custom_vjp function): value_and_grad(data_axes=...) cannot give it the global call's draws "
            "there. Draw the random numbers outside it and pass them in."
        )

    def draw(self, eqn, keys):
        """Sample ``sample``'s part of the global draw: the threefry hashes at its counters in the global shape."""
        if not jax.config.jax_threefry_partitionable:
            raise ValueError(
                "loss_fn makes a random draw shaped by the batch rows with jax_threefry_partitionable off: "
                "value_and_grad(data_axes=...) can give each data shard its part of the global call's draw only "
                "with partitionable threefry. Set jax.config.update('jax_threefry_partitionable', True) (JAX's "
                "default)."
            )
        impl = str(jax.random.key_impl(keys))
        if impl != "threefry2x32":
            raise ValueError(
                f"loss_fn makes a random draw shaped by the batch rows from a key of implementation {impl!r}: "
                "value_and_grad(data_axes=...) can give each data shard its part of the global call's draw only "
                "for threefry2x32 keys (jax.random.key(seed), JAX's default)."
            )
        shape, row_dim = tuple(eqn.params["shape"]), self.plan[id(eqn)]
        hi, lo = _global_counters(shape, row_dim, self.n, self.sample)
        if eqn.primitive.name == "random_split":
            one = lambda k: jnp.stack(_threefry(k, hi, lo), axis=-1)  # noqa: E731 - as threefry's split
            return jax.random.wrap_key_data(_per_key(one, keys), impl=impl)
        bit_width = eqn.params["bit_width"]
        return _per_key(lambda k: _bits(_threefry(k, hi, lo), bit_width), keys)


def _per_key(fn, keys):
    """``fn(key_data)`` for each key of a (possibly batched) key array, stacked like the keys."""
    data = jax.random.key_data(keys)
    if keys.ndim == 0:
        return fn(data)
    out = jax.vmap(fn)(data.reshape((-1, data.shape[-1])))
    return out.reshape(keys.shape + out.shape[1:])


def _threefry(key_data, hi, lo):
    from jax.extend.random import threefry2x32_p

    return threefry2x32_p.bind(key_data[0], key_data[1], hi, lo)


def _bits(pair, bit_width):
    """As JAX's partitionable threefry turns the two hash words into ``bit_width`` bits."""
    bits1, bits2 = pair
    if bit_width == 64:
        dtype = jnp.uint64
        return lax.shift_left(bits1.astype(dtype), jnp.asarray(32, dtype)) | bits2.astype(dtype)
    bits = bits1 ^ bits2
    return bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])


def _global_counters(shape, row_dim, n, sample):
    """64-bit row-major indices, as ``(hi, lo)`` uint32, of sample ``sample``'s elements in the global draw.

    The global draw has ``n · shape[row_dim]`` rows on ``row_dim``; sample ``s`` holds rows
    ``s · shape[row_dim] …`` (the contiguous blocks ``value_and_grad`` gives the samples).
    """
    glob = list(shape)
    glob[row_dim] *= n
    if glob[row_dim] >= 2**32 or any(d >= 2**32 for d in glob):
        raise ValueError(f"a random draw of global shape {tuple(glob)}: a dimension exceeds 2**32")
    hi = lo = jnp.zeros(shape, _U32)
    for d in range(len(shape)):
        index = lax.broadcasted_iota(_U32, shape, d)
        if d == row_dim:
            index = index + sample * _U32(shape[d])
        hi, lo = _add(hi, lo, *_mul(index, math.prod(glob[d + 1 :])))
    return hi, lo


def _add(a_hi, a_lo, b_hi, b_lo):
    lo = a_lo + b_lo
    return a_hi + b_hi + (lo < a_lo).astype(_U32), lo


def _mul(x, c):
    """``x · c`` as 64-bit ``(hi, lo)`` for uint32 ``x`` and a Python int ``0 ≤ c < 2**64``."""
    c_hi, c_lo = _U32(c >> 32), c & 0xFFFFFFFF
    x1, x0 = x >> 16, x & 0xFFFF
    q1, q0 = _U32(c_lo >> 16), _U32(c_lo & 0xFFFF)
    p00, p01, p10, p11 = x0 * q0, x0 * q1, x1 * q0, x1 * q1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)
    lo = p00 + (mid << 16)
    hi = p11 + (mid >> 16) + (mid_carry << 16) + (lo < p00).astype(_U32)
    return hi + x * c_hi, lo
