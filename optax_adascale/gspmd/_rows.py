"""Whether a computation is local to the rows: a walk over a jaxpr that follows each value's row dimensions.

The per-shard rule (``_local``) runs an equation's VJP on each data shard's rows alone. That is the equation's
own VJP only where no output row depends on another shard's rows: :func:`coupling` walks the equation's jaxpr
(or the primitive itself) with the dimensions of each value that index rows of the batch, and names the first
step that mixes rows (a reduction, contraction, sort, cumulative op, gather or slice along a row dimension, or
a primitive it does not know applied to rows). ``None``: local to the rows, the per-shard rule is exact.
"""

from __future__ import annotations

from typing import Any

from optax_adascale import _compat

# Primitives whose output has the shape of their (broadcast) operands and whose element i reads element i of
# each operand only: rows stay rows.
_AXIS_OPS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort", "argsort", "top_k")
_REDUCE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin")
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
_PER_ROW_COLLECTIVES = ("psum", "pmax", "pmin", "ppermute", "all_gather", "pvary", "pcast", "axis_index")


def coupling(jaxpr, rows: list[frozenset[int]], row_axes: frozenset[str] = frozenset()) -> str | None:
    """The first equation of ``jaxpr`` that mixes rows, as ``"name"``, or ``None``. ``rows[i]``: the dimensions
    of input ``i`` that index rows; ``row_axes``: manual axes (inside a ``shard_map``) that split the rows, over
    which a collective mixes them."""
    literal = _compat.literal_type()
    env: dict[Any, frozenset[int]] = {v: r for v, r in zip(jaxpr.invars, rows, strict=True)}
    for eqn in jaxpr.eqns:
        ins = [frozenset() if isinstance(v, literal) else env.get(v, frozenset()) for v in eqn.invars]
        outs = _rule(eqn, ins, row_axes)
        if isinstance(outs, str):
            return outs
        for v, r in zip(eqn.outvars, outs, strict=True):
            env[v] = r
    return None


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _rule(eqn, ins: list[frozenset[int]], row_axes: frozenset[str]) -> list[frozenset[int]] | str:
    name = eqn.primitive.name
    out_shapes = [_shape(v) for v in eqn.outvars]
    if not any(ins):
        return [frozenset()] * len(eqn.outvars)
    p = eqn.params
    if name in _CALLS or name.startswith("remat") or name == "checkpoint":
        inner = p.get("jaxpr", p.get("call_jaxpr", p.get("fun_jaxpr")))
        inner = getattr(inner, "jaxpr", inner)
        found = coupling(inner, ins, row_axes)
        return found if found else _same_rank_outputs(eqn, ins)
    if name == "shard_map":
        manual = _compat.shard_map_manual_axes(p)
        body = getattr(p["jaxpr"], "jaxpr", p["jaxpr"])
        found = coupling(body, ins, row_axes | (manual & row_axes))
        return found if found else _same_rank_outputs(eqn, ins)
    if name == "scan":
        nc, ncarry = _compat.scan_counts(p)
        if any(0 in r for r in ins[nc + ncarry :]):
            return "scan over the rows"
        body = p["jaxpr"].jaxpr
        inner = ins[:nc] + ins[nc : nc + ncarry] + [frozenset(d - 1 for d in r) for r in ins[nc + ncarry :]]
        found = coupling(body, inner, row_axes)
        return found if found else _same_rank_outputs(eqn, ins)
    if name in ("while", "cond"):
        for sub in (p.get("body_jaxpr"), p.get("cond_jaxpr"), *p.get("branches", ())):
            if sub is None:
                continue
            jaxpr = getattr(sub, "jaxpr", sub)
            k = len(ins) - len(jaxpr.invars)
            found = coupling(jaxpr, ins[max(k, 0) :][: len(jaxpr.invars)], row_axes)
            if found:
                return found
        return _same_rank_outputs(eqn, ins)
    if name in _PER_ROW_COLLECTIVES:
        axes = p.get("axes", p.get("axis_name", ()))
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if set(axes) & row_axes and name != "pvary" and name != "pcast" and name != "axis_index":
            return f"{name} over the rows' axes {tuple(sorted(set(axes) & row_axes))}"
        return _same_rank_outputs(eqn, ins)
    if name in _REDUCE:
        axes = set(p.get("axes", ()))
        if axes & set().union(*ins):
            return f"{name} over the rows"
        kept = [d for d in range(len(_shape(eqn.invars[0]))) if d not in axes]
        return [frozenset(kept.index(d) for d in ins[0] if d in kept)] * len(eqn.outvars)
    if name in _AXIS_OPS:
        axis = p.get("axis", p.get("dimension", -1))
        nd = len(_shape(eqn.invars[0]))
        if name == "top_k" or (axis % max(nd, 1)) in set().union(*ins):
            return f"{name} along the rows"
        return [ins[0]] * len(eqn.outvars)
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        if set(lc) & ins[0] or set(rc) & ins[1]:
            return "dot_general contracting the rows"
        lhs_nd, rhs_nd = (len(_shape(v)) for v in eqn.invars)
        free_l = [d for d in range(lhs_nd) if d not in lc and d not in lb]
        free_r = [d for d in range(rhs_nd) if d not in rc and d not in rb]
        out = {i for i, (a, b) in enumerate(zip(lb, rb, strict=True)) if a in ins[0] or b in ins[1]}
        out |= {len(lb) + free_l.index(d) for d in ins[0] if d in free_l}
        out |= {len(lb) + len(free_l) + free_r.index(d) for d in ins[1] if d in free_r}
        return [frozenset(out)]
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        lhs_batch, out_batch = dn.lhs_spec[0], dn.out_spec[0]
        if ins[1] or ins[0] - {lhs_batch}:
            return "conv_general_dilated over the rows"
        if p.get("batch_group_count", 1) != 1:
            return "conv_general_dilated grouping the rows"
        return [frozenset({out_batch}) if ins[0] else frozenset()]
    if name == "broadcast_in_dim":
        dims = p["broadcast_dimensions"]
        return [frozenset(dims[d] for d in ins[0])] + [frozenset()] * (len(eqn.outvars) - 1)
    if name == "transpose":
        perm = list(p["permutation"])
        return [frozenset(perm.index(d) for d in ins[0])]
    if name in ("squeeze", "expand_dims", "reshape"):
        return _reshaped(_shape(eqn.invars[0]), out_shapes[0], ins[0], name)
    if name in ("slice", "dynamic_slice", "pad", "rev", "concatenate", "gather", "scatter", "scatter-add"):
        return _indexed(eqn, ins)
    if all(s == out_shapes[0] for s in out_shapes) and all(_broadcasts(_shape(v), out_shapes[0]) for v in eqn.invars):
        return [frozenset().union(*ins)] * len(eqn.outvars)  # elementwise (select_n, convert, arithmetic)
    return f"{name} applied to the rows"


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """An operand of an elementwise equation: a scalar, or of the output's rank with each dimension equal or 1."""
    return not shape or (len(shape) == len(out) and all(a in (b, 1) for a, b in zip(shape, out, strict=True)))


def _same_rank_outputs(eqn, ins: list[frozenset[int]]) -> list[frozenset[int]]:
    """A call's outputs: conservatively, row dimension 0 where any input had rows and the output has dims."""
    rows = frozenset().union(*ins)
    return [frozenset({0}) if rows and _shape(v) else frozenset() for v in eqn.outvars]


def _reshaped(src: tuple[int, ...], dst: tuple[int, ...], rows: frozenset[int], name: str):
    """Row dimensions through a reshape: a row dimension kept whole, or split with its leading factor first."""
    out = set()
    for d in rows:
        before = 1
        for s in src[:d]:
            before *= s
        acc, j = 1, 0
        while j < len(dst) and acc < before:
            acc *= dst[j]
            j += 1
        if acc != before or j >= len(dst) or src[d] % dst[j]:
            return f"{name} merging the rows with other dimensions"
        out.add(j)
    return [frozenset(out)]


def _indexed(eqn, ins):
    name = eqn.primitive.name
    if name == "gather":
        operand_rows, index_rows = ins[0], ins[1]
        if operand_rows:
            return "gather from the rows"
        offset = set(eqn.params["dimension_numbers"].offset_dims)
        out_nd = len(_shape(eqn.outvars[0]))
        batch = [d for d in range(out_nd) if d not in offset]
        return [frozenset(batch[d] for d in index_rows if d < len(batch))]
    if name == "slice":
        src = _shape(eqn.invars[0])
        starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
        strides = eqn.params.get("strides") or (1,) * len(src)
        for d in ins[0]:
            if starts[d] != 0 or limits[d] != src[d] or strides[d] != 1:
                return "slice of the rows"
        return [ins[0]]
    if name in ("pad", "rev", "concatenate"):
        dims = set(eqn.params.get("dimensions", ())) | {eqn.params.get("dimension", -1)}
        if name == "pad":
            dims = {d for d, (lo, hi, mid) in enumerate(eqn.params["padding_config"]) if (lo, hi, mid) != (0, 0, 0)}
        if dims & set().union(*ins):
            return f"{name} along the rows"
        return [frozenset().union(*ins)]
    return f"{name} of the rows"


def equation_coupling(eqn, rows: list[frozenset[int]]) -> str | None:
    """What mixes rows in one equation (its inputs' row dimensions ``rows``), or ``None``."""
    out = _rule(eqn, rows, frozenset())
    return out if isinstance(out, str) else None


def has_subjaxprs(eqn) -> bool:
    """An equation that carries jaxprs (a call, a loop, a ``shard_map``): traced at the whole batch's shapes."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                return True
    return False
