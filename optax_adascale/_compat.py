"""Every read of JAX internals, behind one module (``tests/test_compat.py`` has a test per read).

JAX moves its private modules and renames primitive parameters between releases (0.11
renamed ``scan``'s ``num_consts``/``num_carry`` to ``ft_in``/``ft_out``). Each read here is
feature-tested where a release may lack it, and says what happens then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

# --------------------------------------------------------------------------- jaxprs


def shard_map_manual_axes(params: dict[str, Any]) -> frozenset[str]:
    """The axes a ``shard_map`` equation makes manual (``newly_manual_axes`` on JAX 0.10–0.12; older spellings
    ``manual_axes``/``axis_names``)."""
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        if key in params:
            return frozenset(params[key])
    raise KeyError(f"shard_map's manual axes: none of newly_manual_axes, manual_axes, axis_names in {sorted(params)}")


def literal_type() -> type:
    """The class of a literal operand in a jaxpr (``jax.extend.core.Literal``)."""
    from jax.extend.core import Literal

    return Literal


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation: 0.10's ``num_consts``/``num_carry``, else the lengths
    of the first two groups of ``ft_in`` (JAX ≥ 0.11: ``(consts, carry, xs)``)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params["ft_in"]  # a FlatTree of (consts, carry, xs); len() of a group counts its leaves
    groups = ft_in.unpack() if hasattr(ft_in, "unpack") else tuple(ft_in)
    return len(groups[0]), len(groups[1])


# --------------------------------------------------------------------------- meshes and axes


def legacy_mesh() -> Any:
    """The mesh of the old ``with mesh:`` form (invisible to ``jax.sharding.get_abstract_mesh``), or ``None``."""
    try:
        from jax._src import mesh as mesh_lib

        physical = mesh_lib.thread_resources.env.physical_mesh
        return None if physical.empty else physical
    except Exception:  # noqa: BLE001 - internals moved: nothing to report
        return None


def named_axis_sizes() -> dict[Any, int] | None:
    """The named axes bound here by ``vmap``/``pmap``/``shard_map`` and their sizes; ``None`` if unreadable."""
    try:
        from jax._src import core

        return dict(core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):
        return None


def varying_axes(x: Any) -> frozenset[str]:
    """The manual axes ``x`` varies over (shard_map's varying type); empty where JAX records none.

    ``manual_axis_type.varying`` (JAX 0.10), ``vma`` (other versions); neither present means no information.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


@contextlib.contextmanager
def vma_checks_off() -> Iterator[None]:
    """Inside, shard_map's varying-type checks are off (JAX's internal ``_check_vma`` switch); if the switch
    moved, nothing changes."""
    from jax._src import config as jax_config

    check_vma = getattr(jax_config, "_check_vma", None)
    if check_vma is None:
        yield
        return
    with check_vma(False):
        yield


def batch_trace_axes(x: Any) -> list[Any]:
    """The ``axis_data`` of every ``vmap`` trace ``x`` is batched under (innermost first); ``[]`` if unreadable."""
    try:
        from jax._src.interpreters import batching
    except ImportError:
        return []
    batch_trace = getattr(batching, "BatchTrace", None)
    if batch_trace is None:
        return []
    found = []
    trace = getattr(x, "_trace", None)
    while trace is not None:
        data = getattr(trace, "axis_data", None) if isinstance(trace, batch_trace) else None
        if data is not None:
            found.append(data)
        trace = getattr(trace, "parent_trace", None)
    return found


# --------------------------------------------------------------------------- custom derivative calls


def custom_call_bind_params(
    eqn: Any, evaluate: Any, trace_context: Any = contextlib.nullcontext, bwd_auto_axes: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``eqn.primitive.get_bind_params(eqn.params)`` of a ``custom_jvp_call``/``custom_vjp_call`` whose traced
    jaxprs (the function, its JVP or forward pass) run through ``evaluate(jaxpr, consts, args)``.

    JAX's own bind parameters evaluate those jaxprs with ``core.eval_jaxpr``, as traced; this mirrors
    ``custom_derivatives.lift_jvp``/``lift_fwd`` (JAX 0.10–0.12) with ``evaluate`` in its place. The user's
    backward function (``custom_vjp``) is Python and traces at the types it is given: kept. The JVP rule and
    forward pass are traced (lazily, at the types the loss was traced at) under ``trace_context()``.

    ``bwd_auto_axes``: the loss was traced with these axes Auto and runs with them Explicit. JAX checks the
    backward function's cotangents against the primal types of the trace (Auto: no sharding), so the backward
    function runs with those axes Auto again (``jax.sharding.auto_axes``), its cotangents sharded as the
    primal values the forward pass was given.
    """
    from jax._src import core
    from jax._src import linear_util as lu
    from jax._src.custom_derivatives import SymbolicZero
    from jax._src.interpreters import ad

    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = params["subfuns"]
    call = eqn.params["call_jaxpr"]
    num_consts = eqn.params["num_consts"]
    jaxpr, consts = (call.jaxpr, call.consts) if hasattr(call, "consts") else (call, ())
    fun = lu.wrap_init(lambda *args: evaluate(jaxpr, consts, list(args)), debug_info=subfuns[0].debug_info)
    if eqn.primitive.name == "custom_jvp_call":
        jvp_jaxpr_fun = eqn.params["jvp_jaxpr_fun"]

        def jvp(*xs):
            n = len(xs) // 2
            primals, tangents = xs[num_consts:n], xs[n + num_consts :]
            zeros = [type(t) is SymbolicZero for t in tangents]
            with trace_context():
                jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
            nonzero = [t for t in tangents if type(t) is not SymbolicZero]
            out = evaluate(jvp_jaxpr, jvp_consts, [*primals, *nonzero])
            out_primals, nz = out[: len(out_zeros)], iter(out[len(out_zeros) :])
            out_tangents = [
                SymbolicZero(core.typeof(p).to_tangent_aval()) if z else next(nz)
                for p, z in zip(out_primals, out_zeros, strict=True)
            ]
            return [*out_primals, *out_tangents]

        params["subfuns"] = (fun, lu.wrap_init(jvp, debug_info=subfuns[1].debug_info))
        return params
    fwd_jaxpr_thunk = eqn.params["fwd_jaxpr_thunk"]
    primal_types: list[Any] = []

    def fwd(*args):
        vals, nonzeros = args[::2], args[1::2]
        if any(nonzeros[:num_consts]):
            raise ad.CustomVJPException()
        primal_types[:] = [core.typeof(v) for v in vals]
        with trace_context():
            fwd_jaxpr, fwd_consts = fwd_jaxpr_thunk.call_wrapped(*nonzeros[num_consts:])
        return evaluate(fwd_jaxpr, fwd_consts, list(vals[num_consts:]))

    bwd = subfuns[2]
    if bwd_auto_axes:
        flat_bwd = bwd

        def bwd_fn(*args):
            types = list(primal_types)
            zero_at: list[int] = []
            with_logs: list[bool] = []

            def run(*a):
                out = flat_bwd.call_wrapped(*a)
                # JAX 0.12: (cotangents, logs); 0.10-0.11: the cotangents
                with_logs[:] = [isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], (list, tuple))]
                cts = out[0] if with_logs[0] else out
                if with_logs[0] and out[1] is not None:
                    raise NotImplementedError("a custom_vjp backward rule with logs, on a converted Auto mesh")
                zero_at[:] = [i for i, ct in enumerate(cts) if isinstance(ct, ad.Zero)]
                # a symbolic zero cannot leave auto_axes: a dense stand-in, dropped below (and by XLA)
                return [
                    jnp.zeros(t.shape, jnp.float32) if i in zero_at else ct for i, (ct, t) in enumerate(zip(cts, types))
                ]

            specs = [t.sharding.spec for t in types]
            # an output's symbolic-zero cotangent is not a JAX value: dense zeros of its type, made here
            args = [
                jnp.zeros(a.aval.shape, a.aval.dtype, out_sharding=a.aval.sharding) if type(a) is SymbolicZero else a
                for a in args
            ]
            out = jax.sharding.auto_axes(run, axes=bwd_auto_axes, out_sharding=specs)(*args)
            cts = [ad.Zero(t.to_ct_aval()) if i in zero_at else ct for i, (ct, t) in enumerate(zip(out, types))]
            return (cts, None) if with_logs[0] else cts

        bwd = lu.wrap_init(bwd_fn, debug_info=subfuns[2].debug_info)
    params["subfuns"] = (fun, lu.wrap_init(fwd, debug_info=subfuns[1].debug_info), bwd)
    return params


# --------------------------------------------------------------------------- core reads (issue 39, house-core)
# The reads the optimizer's own modules make (core/, the state readers), outside the drop-in's jaxpr walks.


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is traced (an abstract value under ``jit``, ``grad``, ``vmap``...), not a concrete one:
    ``jax.core.Tracer``. A check of a hyperparameter's value runs only where it is concrete."""
    return isinstance(value, jax.core.Tracer)
