"""Per-layer probes for stacked (scanned) parameter leaves: a rewrite of the loss's jaxpr.

Used by :func:`optax_adascale.value_and_grad` (``_gspmd``) when ``num_microbatches = 1``. A parameter
leaf whose only use is as the scanned-over operand of a ``lax.scan`` holds stacked layers; a probe on
the whole leaf would materialise every layer's per-shard gradient at once. Re-evaluating the jaxpr with
the probe inside the scan body (and inside the layer's ``jax.checkpoint``) keeps one layer's per-shard
gradient at a time, reduced inside the backward loop as SGD's is. Reads ``jax.extend.core`` and the
primitive names (``scan``, ``jit``/``pjit``, ``remat``); anything it does not recognise falls back to the
whole-leaf probe (correct, with the old memory).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from optax_adascale._norms import leaf_sq_norm, low_precision


def probed_loss(loss_fn, has_aux, treedef, leaves, split):
    """The loss with per-layer probes on its scanned parameter leaves, and their indices; ``None`` if none.

    The loss is traced once (one shard's shapes) to a jaxpr; a parameter leaf whose only use is as a
    scanned-over operand (``xs``) of a ``lax.scan`` — at the top level or inside ``jax.jit`` /
    ``jax.checkpoint`` — is stacked layers. Re-evaluating the jaxpr with that scan's body wrapped so
    that each layer's slice passes through :func:`_layer_probe` gives the same values and gradients,
    plus each shard's ``‖g_l‖²`` per layer; everything else is evaluated as traced.
    """
    shapes = [jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p), weak_type=_weak(p)) for p in leaves]
    batch_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), split)
    batch_def = jax.tree.structure(split)
    out_tree = []

    def flat_loss(*args):
        ps, bs = args[: len(leaves)], batch_def.unflatten(args[len(leaves) :])
        out = loss_fn(treedef.unflatten(list(ps)), *bs)
        flat, tree = jax.tree.flatten(out)
        out_tree.append(tree)
        return flat

    closed = jax.make_jaxpr(flat_loss)(*shapes, *jax.tree.leaves(batch_shapes))
    invars = closed.jaxpr.invars
    stacked = {i for i in range(len(leaves)) if jnp.ndim(leaves[i]) >= 1 and _only_scanned(closed.jaxpr, invars[i])}
    if not stacked:
        return None

    def probed_loss(leaves, batch, layer_probes, n):
        probes = {invars[i]: (layer_probes[i], n, "stacked") for i in stacked}
        flat = _eval(closed.jaxpr, closed.consts, [*leaves, *jax.tree.leaves(batch)], probes)
        return out_tree[0].unflatten(flat)

    return probed_loss, stacked


def _weak(x):
    try:
        return bool(jax.typeof(x).weak_type)
    except (AttributeError, TypeError):
        return False


def _inner(eqn):
    """The sub-jaxpr of a ``jit`` or ``checkpoint`` equation (``(jaxpr, consts)``), or ``None``."""
    name = eqn.primitive.name
    if name in ("jit", "pjit") or name.startswith("remat") or name == "checkpoint":
        inner = eqn.params.get("jaxpr")
        if inner is None:
            return None
        return (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
    return None


def _only_scanned(jaxpr, var):
    """``var`` is used once, as a scanned-over operand of a ``lax.scan`` (possibly under jit/checkpoint)."""
    from jax.extend.core import Literal

    if any(v is var for v in jaxpr.outvars):
        return False
    uses = [(e, i) for e in jaxpr.eqns for i, v in enumerate(e.invars) if not isinstance(v, Literal) and v is var]
    if len(uses) != 1:
        return False
    eqn, i = uses[0]
    if eqn.primitive.name == "scan":
        return i >= eqn.params["num_consts"] + eqn.params["num_carry"]
    inner = _inner(eqn)
    return inner is not None and _only_scanned(inner[0], inner[0].invars[i])


def _uses(jaxpr, var):
    from jax.extend.core import Literal

    return [(e, i) for e in jaxpr.eqns for i, v in enumerate(e.invars) if not isinstance(v, Literal) and v is var]


def _eval(jaxpr, consts, args, probes):
    """``jax.core.eval_jaxpr`` with probes: ``probes[var] = (probe, n, kind)``.

    ``kind="stacked"``: ``var`` is stacked layers, sliced by a scan whose body gets a ``"layer"``
    probe per slice. ``kind="layer"``: ``var`` is one layer's parameters; it passes through
    :func:`_layer_probe` here, or — if its only use is a ``jax.checkpoint`` / ``jax.jit`` — inside that,
    so that the probe's (per-shard) output is rematerialised with the layer rather than saved.
    """
    from jax.extend.core import Literal

    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    probes = dict(probes)
    for v, (p, n, kind) in list(probes.items()):
        if kind != "layer":
            continue
        uses = _uses(jaxpr, v)
        if len(uses) == 1 and _inner(uses[0][0]) is not None and not any(o is v for o in jaxpr.outvars):
            continue  # pushed down into the checkpoint / jit
        env[v] = _layer_probe(n, env[v], p)
        del probes[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        mine = {i: probes[v] for i, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in probes}
        if not mine:
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
        elif eqn.primitive.name == "scan":
            ans = _probed_scan(eqn, invals, mine)
        else:
            ans = _probed_call(eqn, invals, mine)
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, ans, strict=True):
                env[v] = x
        else:
            env[eqn.outvars[0]] = ans
    return [read(v) for v in jaxpr.outvars]


def _probed_call(eqn, invals, mine):
    """A ``jit`` (inlined) or ``checkpoint`` (re-applied with its policy) that uses a probed variable."""
    jaxpr, consts = _inner(eqn)
    positions = sorted(mine)
    meta = [mine[i][1:] for i in positions]

    def body(*args):
        vals, probe_vals = args[: len(invals)], args[len(invals) :]
        probes = {jaxpr.invars[i]: (p, *m) for i, p, m in zip(positions, probe_vals, meta, strict=True)}
        return _eval(jaxpr, consts, list(vals), probes)

    probe_vals = [mine[i][0] for i in positions]
    if eqn.primitive.name in ("jit", "pjit"):
        return body(*invals, *probe_vals)
    fn = jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy"))
    return fn(*invals, *probe_vals)


def _probed_scan(eqn, invals, mine):
    """The scan, with a per-layer probe on each slice of a stacked operand."""
    params = eqn.params
    nc, ncarry = params["num_consts"], params["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
    body = params["jaxpr"]
    positions = sorted(i - nc - ncarry for i in mine)
    ns = [mine[nc + ncarry + j][1] for j in positions]
    xs_invars = body.jaxpr.invars[nc + ncarry :]

    def step(carry, inputs):
        x_slices, probe_slices = inputs
        probes = {xs_invars[j]: (p, m, "layer") for j, p, m in zip(positions, probe_slices, ns, strict=True)}
        out = _eval(body.jaxpr, body.consts, [*consts, *carry, *x_slices], probes)
        return list(out[:ncarry]), list(out[ncarry:])

    probe_xs = [mine[nc + ncarry + j][0] for j in positions]
    carry, ys = lax.scan(
        step,
        list(init),
        (list(xs), probe_xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer_probe(n, x, probe):
    """Identity on one layer's parameters; the backward pass records the shard's ``‖g_l‖²`` as ``probe``'s cotangent.

    Under the vmap over shards ``x`` is unbatched and ``probe`` batched; adding ``0 · probe`` makes the
    output batched, so the cotangent arriving here is each shard's own (not yet summed). Returning it as
    ``x``'s cotangent, JAX sums it over the shards right here, inside the backward scan's body: one
    layer's per-shard gradient exists at a time.
    """
    del n
    return x + (0 * probe).astype(x.dtype)


def _layer_probe_fwd(n, x, probe):
    return _layer_probe(n, x, probe), None


def _layer_probe_bwd(n, _, cotangent):
    # As _spread_bwd: 16-bit gradients are divided by n before the sum over shards, wider ones after.
    sq = leaf_sq_norm(cotangent)
    return ((cotangent / n).astype(cotangent.dtype) if low_precision(cotangent) else cotangent), sq


_layer_probe.defvjp(_layer_probe_fwd, _layer_probe_bwd)
