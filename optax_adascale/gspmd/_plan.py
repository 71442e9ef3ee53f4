"""Where the loss gathers its FSDP leaves: one walk over its jaxpr before it is re-evaluated.

A parameter sharded over the data axes is *gathered* where a value derived from it alone (through
views: reshape, transpose, casts) meets the batch or is resharded off the data axes. :func:`walk`
records each leaf's gather sites; a leaf gathered at one site is probed there (the probe reads each
device's partial before the gather's transpose reduce-scatters it). A leaf gathered at several sites,
or on every iteration of a loop that is not over its own layers, is gathered once at the loss's entry
instead (``Plan.hoist``). The interpreter asks :func:`gathered_inputs` of every equation it
evaluates, so the two agree on what a gather is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from optax_adascale import _compat
from optax_adascale.gspmd import _types
from optax_adascale.gspmd._table import Kind, kind_of

# Classes whose bodies the plan and the interpreter walk with the lineage (the interpreter gathers nothing at the
# equation itself). A while loop is not among them: JAX cannot transpose one, so no gradient reaches a parameter
# through it, and its body uses the parameter as the user's step does (sharded), gathering nothing.
CARRIES_LINEAGE = frozenset({Kind.CALL, Kind.REMAT, Kind.SCAN, Kind.COND})
# Equations of one parameter whose VJP hands the cotangent back unchanged but for layout or dtype: an FSDP leaf
# passes through them before its gather. Any other use gathers it first, so that the probe sees ∂L/∂θ_i itself.
_TRANSPARENT = frozenset({Kind.VIEW, Kind.HINT})


def _var_axes(v: Any) -> frozenset[str]:
    """The mesh axes a jaxpr variable's type is sharded over (Explicit types)."""
    aval = getattr(v, "aval", None)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return frozenset()
    return frozenset(a for e in spec.partitions for a in _types.spec_axes(e))


def typed_axes(data: frozenset[str], typed: bool):
    """``(eqn, i) -> axes`` of input ``i`` as the plan reads them: from the jaxpr's types (Explicit axes), or,
    for a loss traced on Auto axes (whose types record no sharding), the data axes for every value still
    derived from FSDP leaves alone (nothing gathered it: a gather ends the lineage)."""
    if typed:
        return lambda eqn, i: _var_axes(_compat.inputs(eqn)[i])
    return lambda eqn, i: data


def gathered_inputs(eqn, pure: list[bool], data: frozenset[str], axes_of) -> list[int]:
    """The inputs of ``eqn`` that are FSDP gathers: values derived from FSDP leaves alone, sharded over the data
    axes, met by something else (a mixing equation) or resharded off the data axes. ``axes_of(eqn, i)``: the
    mesh axes input ``i`` is sharded over."""
    kind = kind_of(_compat.primitive_name(eqn))
    real = [i for i, v in enumerate(_compat.inputs(eqn)) if not _compat.is_literal(v)]
    if kind is Kind.GATHER:
        target = _compat.target_sharding(eqn).spec
        off = data & axes_of(eqn, 0) - frozenset(a for e in target.partitions for a in _types.spec_axes(e))
        return [0] if pure[0] and off else []
    if kind is Kind.WHILE or (all(pure[i] for i in real) and kind in _TRANSPARENT):
        return []  # a view of the parameter (its cotangent the same numbers), or no gradient: evaluated as traced
    return [i for i in real if pure[i] and data & axes_of(eqn, i)]


@dataclasses.dataclass
class Plan:
    """Where each FSDP leaf is gathered: the distinct gathered values, and uses that rule out probing it."""

    sites: dict[int, set] = dataclasses.field(default_factory=dict)
    hoist: set = dataclasses.field(default_factory=set)

    def probed(self, fsdp: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(i for i in fsdp if i not in self.hoist and len(self.sites.get(i, ())) == 1)


def walk(jaxpr, lineage: dict[Any, frozenset], data: frozenset[str], plan: Plan, axes_of, loop: bool = False) -> None:
    """Walk the jaxpr with each variable's FSDP lineage (``lineage[var] = {(leaf, sliced)}``: derived from those
    leaves alone; ``sliced``: a per-iteration slice of a scanned stack) and record the gathers (``axes_of``: see
    :func:`typed_axes`)."""

    def rule(eqn, ins):
        kind = kind_of(_compat.primitive_name(eqn))
        if kind in CARRIES_LINEAGE:
            for sub, inner in _inner(eqn, kind, ins):
                walk(sub, dict(zip(sub.invars, inner, strict=True)), data, plan, axes_of, loop or kind is Kind.SCAN)
        else:
            pure = [bool(lin) for lin in ins]
            for i in gathered_inputs(eqn, pure, data, axes_of):
                for leaf, sliced in ins[i]:
                    plan.sites.setdefault(leaf, set()).add(_compat.inputs(eqn)[i])
                    if loop and not sliced:
                        plan.hoist.add(leaf)  # the same copy gathered on every iteration
                ins[i] = frozenset()  # gathered: a plain value from here on, as the interpreter sees it
                pure[i] = False
            real = [i for i, v in enumerate(_compat.inputs(eqn)) if not _compat.is_literal(v)]
            if kind is not Kind.WHILE and real and not all(pure[i] for i in real):
                for i in real:  # a replicated FSDP-derived value meets the batch
                    if pure[i] and not data & axes_of(eqn, i):
                        plan.hoist.update(leaf for leaf, _ in ins[i])
        return [pure_leaves(eqn, ins)] * len(_compat.outputs(eqn))

    args = [lineage.get(v, frozenset()) for v in jaxpr.invars]
    _compat.walk(jaxpr, [frozenset()] * len(jaxpr.constvars), args, rule, literal=lambda _: frozenset())


def _inner(eqn, kind: Kind, ins: list[frozenset]) -> list[tuple[Any, list[frozenset]]]:
    """Each body an equation of a class in :data:`CARRIES_LINEAGE` runs, with the lineage of its inputs: a scan's
    slices of the stacked operands marked ``sliced``, a cond's branches without the index."""
    if kind is Kind.SCAN:
        n = sum(_compat.scan_params(eqn)[:2])
        return [(_compat.body(eqn)[0], [*ins[:n], *(frozenset((leaf, True) for leaf, _ in x) for x in ins[n:])])]
    if kind is Kind.COND:
        return [(branch, ins[1:]) for branch, _ in _compat.cond_branches(eqn)]
    return [(_compat.body(eqn)[0], ins)]


def pure_leaves(eqn, ins) -> frozenset:
    """The FSDP leaves an equation's outputs derive from, if they derive from parameters alone (else none)."""
    real = [lin for v, lin in zip(_compat.inputs(eqn), ins, strict=True) if not _compat.is_literal(v)]
    if not real or not all(real):
        return frozenset()
    return frozenset().union(*real)
