r"""Every read of JAX internals, behind one module (``tests/test_compat.py`` has a test per read).

JAX moves its private modules and renames primitive parameters between releases (0.11
renamed ``scan``'s ``num_consts``/``num_carry`` to ``ft_in``/``ft_out``). Each read here is
feature-tested where a release may lack it, and says what happens then.

**The jaxpr facade.** The drop-in (``optax_adascale/gspmd``) re-evaluates a loss's jaxpr. What it may touch of a
jaxpr itself is exactly this, and nothing else:

* an equation only as a handle it passes back here: the traversals (:func:`walk`, :func:`walk_back`) hand it to a
  rule, and the rule reads it through :func:`primitive_name`, :func:`inputs`, :func:`outputs`,
  :func:`multiple_results`, :func:`traced_type` and the readers of its parameters by meaning (:func:`scan_params`,
  :func:`contraction_dims`, ...), and binds it again through :func:`bind` (custom calls: :func:`custom_call`).
  ``grep -n "eqn\.\|\.bind(" optax_adascale/gspmd/`` finds only the calls of :func:`bind` itself;
* a jaxpr's variable lists ``invars``, ``outvars`` and ``constvars`` (public fields of ``jax.extend.core.Jaxpr``),
  whose variables it uses only as dictionary keys and counts and tests with :func:`is_literal`: which input of the
  traced loss is which parameter is what the interpreter must know of a jaxpr besides its equations;
* values, meshes and shardings through public JAX (``jax.typeof``, ``jax.sharding``).

gspmd/ reads no ``eqn.params`` key and imports nothing of ``jax.core``, ``jax.extend`` or ``jax._src`` itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

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
# What the drop-in's re-evaluation of a custom rule (gspmd/_custom.py) reads of JAX's custom calls: the call's parts
# as JAX's own bind parameters hold them, and the private types its lifted functions pass (symbolic zeros).


class CustomCall(NamedTuple):
    """The parts of a ``custom_jvp_call``/``custom_vjp_call`` equation (JAX 0.10-0.12)."""

    jvp: bool  # a custom_jvp_call (else a custom_vjp_call)
    body: tuple[Any, list[Any]]  # (jaxpr, consts) of the function
    num_consts: int  # leading operands that are the function's constants
    rule: Any  # the traced rule: jvp_jaxpr_fun(*zeros) -> (jaxpr, consts, out_zeros) / fwd_jaxpr_thunk(*nonzeros)
    subfuns: tuple[Any, ...]  # JAX's own bind functions: (fun, jvp) / (fun, fwd, bwd), whose debug info is kept


def custom_call(eqn: Any) -> CustomCall:
    """The parts of a custom call, read from its parameters and ``get_bind_params`` (whose ``subfuns`` evaluate the
    traced jaxprs with ``core.eval_jaxpr``; ``bwd``, the user's backward function, is Python)."""
    jvp = eqn.primitive.name == "custom_jvp_call"
    rule = eqn.params["jvp_jaxpr_fun" if jvp else "fwd_jaxpr_thunk"]
    subfuns = tuple(eqn.primitive.get_bind_params(eqn.params)["subfuns"])
    return CustomCall(jvp, body(eqn), eqn.params["num_consts"], rule, subfuns)


def wrap_fun(f: Any, like: Any) -> Any:
    """``f`` as the ``linear_util.WrappedFun`` a custom call binds, with ``like``'s debug info."""
    from jax._src import linear_util as lu

    return lu.wrap_init(f, debug_info=like.debug_info)


def is_symbolic_zero(x: Any) -> bool:
    """Whether a tangent or cotangent a custom call's lifted function receives is JAX's symbolic zero."""
    from jax._src.custom_derivatives import SymbolicZero

    return type(x) is SymbolicZero


def symbolic_zero_of(primal: Any) -> Any:
    """The symbolic zero tangent of ``primal`` (``SymbolicZero`` of its tangent type)."""
    from jax._src.custom_derivatives import SymbolicZero

    return SymbolicZero(jax.typeof(primal).to_tangent_aval())


def symbolic_zero_type(zero: Any) -> Any:
    """The abstract type (shape, dtype, sharding) a symbolic zero stands for."""
    return zero.aval


def is_zero_cotangent(x: Any) -> bool:
    """Whether a cotangent a backward function returns is the AD machinery's ``Zero``."""
    from jax._src.interpreters import ad

    return isinstance(x, ad.Zero)


def zero_cotangent(primal_type: Any) -> Any:
    """The AD machinery's ``Zero`` cotangent of a value of type ``primal_type``."""
    from jax._src.interpreters import ad

    return ad.Zero(primal_type.to_ct_aval())


def custom_vjp_error() -> Exception:
    """What a ``custom_vjp``'s lifted forward pass raises for a differentiated constant (``ad.CustomVJPException``)."""
    from jax._src.interpreters import ad

    return ad.CustomVJPException()


# --------------------------------------------------------------------------- tracers
# The one read of jax.core.Tracer: core/ (the checks), the state readers and the drop-in all ask through it.


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is traced (an abstract value under ``jit``, ``grad``, ``vmap``...), not a concrete one:
    ``jax.core.Tracer``. A check of a hyperparameter's value runs only where it is concrete."""
    return isinstance(value, jax.core.Tracer)


# =========================================================================== the jaxpr facade (gspmd)
# Everything the drop-in's interpreter (optax_adascale/gspmd) reads of a jaxpr (the module docstring says what it may
# touch itself): the traversals, binding an equation as JAX's evaluator binds it (its parameters, context and name
# stack), an equation's own fields, its parameters by meaning (one function per read, with what each JAX calls it).


def closed_jaxpr(jaxpr: Any, consts: Any) -> Any:
    """``jaxpr`` closed over ``consts`` (``jax.extend.core.ClosedJaxpr``; JAX 0.12 makes it the ``Jaxpr`` class)."""
    from jax.extend.core import ClosedJaxpr

    return ClosedJaxpr(jaxpr, list(consts))


def open_jaxpr(jaxpr: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of a closed jaxpr, or of an open one (no consts): both kinds sit in equation parameters
    (``remat2`` and JAX 0.12 hold open ones, ``jit``, ``scan`` and ``cond`` closed ones on JAX 0.10-0.11)."""
    return getattr(jaxpr, "jaxpr", jaxpr), list(getattr(jaxpr, "consts", ()))


@contextlib.contextmanager
def source_of(eqn: Any) -> Iterator[None]:
    """Inside, what is bound carries ``eqn``'s name stack (the user's ``jax.named_scope``\\ s, under the current one)
    and traceback, as ``core.eval_jaxpr`` keeps them; where ``source_info_util`` moved, the ops lose their names."""
    try:
        from jax._src import source_info_util
    except ImportError:  # pragma: no cover - moved: profiles lose the names, nothing else
        yield
        return
    names = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=names):
        yield


def walk(jaxpr: Any, consts: Any, args: Any, rule: Any, literal: Any = None, *, named: bool = False) -> list[Any]:
    """The one traversal of a jaxpr: for each equation in order, ``rule(eqn, inputs) -> outputs`` (a list, one per
    output variable), the inputs being what ``consts``/``args`` (bound to its constvars and invars) or earlier
    equations gave their variables, a literal operand ``literal(its value)`` (its value by default). What flows can
    be values (an evaluator) or facts about them (a dataflow analysis). ``named``: each rule runs under
    :func:`source_of` its equation, so what it binds keeps the user's scopes. Returns what the outputs hold."""
    lit: Any = literal_type()
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: (v.val if literal is None else literal(v.val)) if isinstance(v, lit) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        with source_of(eqn) if named else contextlib.nullcontext():
            outs = rule(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def walk_back(jaxpr: Any, facts: Any, rule: Any, join: Any, empty: Any) -> list[Any]:
    """The one backward traversal of a jaxpr: ``facts`` about its outputs (one per output variable) flow back to its
    inputs. For each equation from the last, ``rule(eqn, facts of its outputs) -> facts of its inputs``; facts meeting
    at a variable are combined with ``join``; a variable nothing reaches holds ``empty``, a literal takes none.
    Returns the facts of the jaxpr's inputs."""
    lit: Any = literal_type()
    env: dict[Any, Any] = {}

    def add(v: Any, fact: Any) -> None:
        if not isinstance(v, lit):
            env[v] = join(env[v], fact) if v in env else fact

    for v, fact in zip(jaxpr.outvars, facts, strict=True):
        add(v, fact)
    for eqn in reversed(jaxpr.eqns):
        ins = rule(eqn, [env.get(v, empty) for v in eqn.outvars])
        for v, fact in zip(eqn.invars, ins, strict=True):
            add(v, fact)
    return [env.get(v, empty) for v in jaxpr.invars]


def primitives_in(jaxpr: Any) -> frozenset[str]:
    """The names of every primitive a jaxpr binds, in its equations and in the jaxprs they carry."""
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        names.add(primitive_name(eqn))
        for inner, _ in sub_jaxprs(eqn):
            names |= primitives_in(inner)
    return frozenset(names)


# ---- an equation's own fields


def primitive_name(eqn: Any) -> str:
    """The name of the primitive an equation binds (``dot_general``, ``scan``, ...): the dispatch table's key."""
    return eqn.primitive.name


def inputs(eqn: Any) -> list[Any]:
    """An equation's operands: jaxpr variables and literals (:func:`is_literal`), in order."""
    return list(eqn.invars)


def outputs(eqn: Any) -> list[Any]:
    """An equation's output variables, in order."""
    return list(eqn.outvars)


def multiple_results(eqn: Any) -> bool:
    """Whether binding the equation returns a list of outputs (else one value)."""
    return bool(eqn.primitive.multiple_results)


def traced_type(v: Any) -> Any:
    """The abstract type a jaxpr variable or literal was traced with (``shape``, ``dtype``, ``sharding``)."""
    return v.aval


def is_literal(v: Any) -> bool:
    """Whether a jaxpr operand is a literal (a constant written into the equation), not a variable."""
    return isinstance(v, literal_type())


def bind(
    eqn: Any,
    args: Any,
    params: dict[str, Any] | None = None,
    *,
    context: bool = True,
    drop: Any = None,
    subfuns: Any = None,
) -> Any:
    """``eqn``'s primitive bound to ``args`` as ``core.eval_jaxpr`` binds it: its bind parameters (``params`` in place
    of its own, ``get_bind_params``), inside its context (``eqn.ctx.manager``: compute type, threefry mode, XLA
    metadata, the mesh it was traced under) where ``context``. ``drop(value)``: a parameter it is true of is bound
    as ``None`` (a sharding the rebinding must not keep). ``subfuns``: the functions a call primitive binds in place
    of those ``get_bind_params`` lifts from its jaxprs (a custom call re-evaluated: :func:`custom_call`)."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    own, bind_params = bind_params if isinstance(bind_params, tuple) else ((), bind_params)
    if subfuns is not None:
        if "subfuns" in bind_params:  # custom calls (JAX 0.10-0.12) pass them as a parameter
            bind_params = {**bind_params, "subfuns": tuple(subfuns)}
        else:
            own = tuple(subfuns)
    if drop is not None:
        bind_params = {k: (None if drop(v) else v) for k, v in bind_params.items()}
    with eqn.ctx.manager if context else contextlib.nullcontext():
        return eqn.primitive.bind(*own, *args, **bind_params)


def with_params(eqn: Any, **changes: Any) -> dict[str, Any]:
    """``eqn``'s parameters with ``changes`` (to :func:`bind` it otherwise)."""
    return {**eqn.params, **changes}


# ---- an equation's parameters, by meaning


def sub_jaxprs(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """The jaxprs an equation carries (a call's body, a loop's, a ``cond``'s branches), as ``(jaxpr, consts)``, in a
    fixed order (by parameter name)."""
    out = []
    for key in sorted(eqn.params):
        value = eqn.params[key]
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns"):
                out.append(open_jaxpr(v))
    return out


def body(eqn: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)`` of a call-like equation's body: ``jaxpr`` (``jit``, ``remat2``, ``scan``, ``shard_map``) or
    ``call_jaxpr`` (``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``)."""
    return open_jaxpr(eqn.params["jaxpr"] if "jaxpr" in eqn.params else eqn.params["call_jaxpr"])


class Scan(NamedTuple):
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any


def scan_params(eqn: Any) -> Scan:
    """A ``scan``'s counts (:func:`scan_counts`) and options; its body is :func:`body`."""
    p = eqn.params
    return Scan(*scan_counts(p), p["length"], p["reverse"], p["unroll"])


class While(NamedTuple):
    cond_consts: int
    body_consts: int
    cond: tuple[Any, list[Any]]
    body: tuple[Any, list[Any]]


def while_params(eqn: Any) -> While:
    """A ``while``'s operands are ``(cond consts, body consts, carry)``; its cond and body, each ``(jaxpr, consts)``,
    take their own consts then the carry."""
    p = eqn.params
    return While(p["cond_nconsts"], p["body_nconsts"], open_jaxpr(p["cond_jaxpr"]), open_jaxpr(p["body_jaxpr"]))


def cond_branches(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """A ``cond``'s branches (its operands: the index, then the branches' arguments)."""
    return [open_jaxpr(b) for b in eqn.params["branches"]]


def remat_options(eqn: Any) -> tuple[bool, Any]:
    """``(prevent_cse, policy)`` of a ``remat2`` (``jax.checkpoint``)."""
    return eqn.params.get("prevent_cse", True), eqn.params.get("policy")


class ShardMap(NamedTuple):
    mesh: Any
    in_specs: tuple[Any, ...]
    out_specs: tuple[Any, ...]
    manual_axes: frozenset[str]
    check_vma: bool


def shard_map_params(eqn: Any) -> ShardMap:
    """A ``shard_map``'s mesh, specs, manual axes (:func:`shard_map_manual_axes`) and type checks (``check_vma``;
    ``check_rep`` before JAX 0.6); its body is :func:`body`."""
    p = eqn.params
    check = p.get("check_vma", p.get("check_rep", True))
    return ShardMap(p["mesh"], tuple(p["in_specs"]), tuple(p["out_specs"]), shard_map_manual_axes(p), check)


def target_sharding(eqn: Any) -> Any:
    """Where a ``reshard`` (``dst_sharding``) or ``sharding_constraint`` (``sharding``) puts its operand."""
    return eqn.params["dst_sharding"] if "dst_sharding" in eqn.params else eqn.params["sharding"]


def out_sharding(eqn: Any) -> tuple[str, Any] | None:
    """``(key, sharding)`` of the output sharding an equation was traced with (``out_sharding``: ``dot_general``,
    ``reduce_sum``; ``sharding``: ``reshape``, ``broadcast_in_dim``, casts), or ``None`` where it has none."""
    for key in ("out_sharding", "sharding"):
        if key in eqn.params:
            return key, eqn.params[key]
    return None


def contraction_dims(eqn: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """``((lhs contracting, rhs contracting), (lhs batch, rhs batch))`` of a ``dot_general``."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def reduced_dims(eqn: Any) -> tuple[int, ...]:
    """The dimensions a reduction (``reduce_*``, ``argmax``, ``argmin``) reduces."""
    return tuple(eqn.params["axes"])


def along_dims(eqn: Any, rank: int) -> tuple[int, ...]:
    """The dimensions an equation works along, of an operand of rank ``rank``: a cumulative op's or ``top_k``'s
    ``axis`` (``top_k`` before JAX 0.10: the last), ``sort``'s ``dimension``, ``rev``'s ``dimensions``,
    ``concatenate``'s ``dimension``, ``split``'s and ``unstack``'s ``axis``, ``approx_top_k``'s
    ``reduction_dimension``, ``fft``'s last ``len(fft_lengths)``; none of ``stack``'s operands' (its ``axis`` is a
    new dimension of its output)."""
    p = eqn.params
    if eqn.primitive.name == "stack":
        return ()
    if "dimensions" in p:
        return tuple(p["dimensions"])
    if "fft_lengths" in p:
        return tuple(range(rank - len(p["fft_lengths"]), rank))
    axis = p.get("axis", p.get("dimension", p.get("reduction_dimension", -1)))
    return (axis % max(rank, 1),)


def padded_dims(eqn: Any) -> tuple[int, ...]:
    """The dimensions a ``pad`` changes."""
    return tuple(d for d, cfg in enumerate(eqn.params["padding_config"]) if tuple(cfg) != (0, 0, 0))


def gather_dims(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset dims, indexed dims)`` of a ``gather``: the output dimensions that index within each slice (the
    others follow the indices), and the operand dimensions the indices index (``start_index_map``)."""
    dn = eqn.params["dimension_numbers"]
    return tuple(dn.offset_dims), tuple(dn.start_index_map)


def solves_left(eqn: Any) -> bool:
    """Whether a ``triangular_solve`` solves ``a x = b`` (``left_side``; else ``x a = b``)."""
    return bool(eqn.params["left_side"])


class Ragged(NamedTuple):
    """A ``ragged_dot_general``'s dimensions: the lhs's ragged one, its contracting and batch ones, the rhs's free
    ones (neither its group's nor contracting nor batch), and whether it takes a ``group_offset``."""

    ragged: int
    contracting: tuple[int, ...]
    batch: tuple[int, ...]
    rhs_free: tuple[int, ...]
    offset: bool


def ragged_dims(eqn: Any) -> Ragged:
    """The lhs's dimensions of a ``ragged_dot_general`` (:class:`Ragged`)."""
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (contracting, rhs_contracting), (batch, rhs_batch) = dn.dot_dimension_numbers
    (ragged,) = dn.lhs_ragged_dimensions
    taken = {*rhs_contracting, *rhs_batch, *dn.rhs_group_dimensions}
    rhs_free = tuple(d for d in range(len(eqn.invars[1].aval.shape)) if d not in taken)
    ints = lambda ds: tuple(int(d) for d in ds)  # noqa: E731
    has_offset = eqn.params.get("group_offset") is not None
    return Ragged(int(ragged), ints(contracting), ints(batch), rhs_free, has_offset)


def conv_batch(eqn: Any) -> tuple[int, int, int]:
    """``(lhs batch dimension, output batch dimension, batch_group_count)`` of a ``conv_general_dilated``."""
    dn = eqn.params["dimension_numbers"]
    return dn.lhs_spec[0], dn.out_spec[0], eqn.params.get("batch_group_count", 1)


def sharding_type_error() -> type[Exception]:
    """The exception JAX raises when an operation's sharding types do not allow it (a reshape merging a split
    dimension on Explicit axes): ``jax._src.core.ShardingTypeError`` on JAX 0.10-0.12; ``TypeError`` where a release
    lacks the name (its errors are ``TypeError``s of the types)."""
    from jax._src import core

    return getattr(core, "ShardingTypeError", TypeError)


def binds_on_reduced(name: str) -> bool:
    """Whether JAX's sharding rule for the view ``name`` takes an operand typed ``reduced``: the reshape rule of JAX
    0.10 and 0.11 iterates its operand's ``PartitionSpec``, which refuses one with reduced axes ("Using *pspec is
    dangerous"); from 0.12 it reads ``spec.partitions``. Where it does not, the interpreter applies the view per copy
    (``_local``), as JAX's types imply."""
    return name != "reshape" or jax.__version_info__ >= (0, 12)


# The newest JAX release CI ran the whole suite on (``constraints.txt`` pins it for the README's test command).
NEWEST_TESTED_JAX = (0, 12, 1)


def untested_jax() -> str | None:
    """The installed JAX's version where it is newer than :data:`NEWEST_TESTED_JAX`, else ``None``."""
    return jax.__version__ if tuple(jax.__version_info__[:3]) > NEWEST_TESTED_JAX else None


def auto_cast_keeps_partials() -> bool:
    """Whether a parameter's copy (typed ``reduced``) cast into Auto axes (``jax.sharding.auto_axes``) gets back, as
    its cotangent, each device's partial of its own rows. Up to JAX 0.12.0 the cast's transpose lowers to a sharding
    constraint ``unreduced`` and the partitioner leaves each device's partial sum where it was computed; JAX 0.12.1
    casts the Auto-typed (replicated) cotangent to ``unreduced`` by keeping it on one device and zeros elsewhere (the
    sum, so the gradient, is unchanged; every per-device partial is wrong). ``tests/gspmd/test_patterns.py`` shows both
    sides in plain JAX."""
    return jax.__version_info__ < (0, 12, 1)


def cast_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes a ``pvary`` makes its operand vary over."""
    return tuple(eqn.params["axes"])
