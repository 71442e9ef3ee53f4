"""Flax NNX graph nodes as arguments of the drop-in, taken as ``nnx.value_and_grad`` takes them.

Flax's NNX examples write ``nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)``: ``model`` a module
holding parameters *and* state it advances (BatchNorm's running statistics, dropout's RNG counts), ``rngs`` an
``nnx.Rngs`` the loss draws from at call time. ``nnx.value_and_grad`` differentiates the ``nnx.Param`` variables
of the modules ``argnums`` names (or a ``nnx.DiffState(i, filter)``'s filter), returns their gradients as an
``nnx.State`` shaped like ``nnx.state(model, nnx.Param)`` (what ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
takes), and writes what the loss changed in every graph node back into it.

:func:`call` does the same around the drop-in: the graph nodes among the top-level arguments are split (together,
so shared references stay shared) into the differentiated variables and the rest; the rest goes in as the
drop-in's threaded state (``state_argnum``), so it advances through the micro-batches as the user's own
accumulation would, and is written back into the nodes after the call. ``grads`` and ``stats.sq_norms`` are shaped
like the differentiated ``nnx.State``. Flax is never imported here: the nodes are recognised through
``sys.modules["flax.nnx"]``, which is loaded whenever such a node exists.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def positions(args: tuple[Any, ...]) -> list[int]:
    """The positions of the top-level arguments that are NNX graph nodes (modules, ``nnx.Rngs``, optimizers)."""
    nnx = _nnx()
    if nnx is None:
        return []
    import jax

    def is_node(x: Any) -> bool:  # a Variable on its own is a pytree of its value (and a graph node on Flax 0.12.8)
        return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)

    found = [i for i, a in enumerate(args) if is_node(a)]
    for i, a in enumerate(args):
        if i not in found and any(is_node(x) for x in jax.tree.leaves(a, is_leaf=is_node)):
            raise ValueError(
                f"value_and_grad: argument {i} holds an NNX module or nnx.Rngs inside a {type(a).__name__}. The "
                "drop-in takes NNX objects as nnx.value_and_grad does, each as an argument of its own (e.g. "
                "loss_fn(model, batch, rngs)): pass them so, or nnx.split them and pass their states."
            )
    return found


def split_argnums(argnums: Any) -> tuple[Any, dict[int, Any]]:
    """``argnums`` with each ``nnx.DiffState(i, filter)`` replaced by ``i``, and ``{i: filter}`` for those."""
    nnx = _nnx()
    if nnx is None or not hasattr(nnx, "DiffState"):
        return argnums, {}
    items = argnums if isinstance(argnums, (tuple, list)) else (argnums,)
    filters = {d.argnum: d.filter for d in items if isinstance(d, nnx.DiffState)}
    if not filters:
        return argnums, {}
    ints = tuple(d.argnum if isinstance(d, nnx.DiffState) else d for d in items)
    return (ints if isinstance(argnums, (tuple, list)) else ints[0]), filters


def call(
    make: Callable[..., Callable[..., Any]],
    loss_fn: Callable[..., Any],
    args: tuple[Any, ...],
    nodes: list[int],
    *,
    argnums: tuple[int, ...],
    single: bool,
    filters: dict[int, Any],
    has_aux: bool,
    state_argnum: int | None,
    arg_specs: Any,
    param_specs: Any,
) -> Any:
    """The drop-in (``make(pure_loss, argnums=..., has_aux=True, state_argnum=..., arg_specs=..., param_specs=...)``)
    called on ``args`` with the graph nodes at ``nodes`` split into pure state, as ``nnx.value_and_grad`` does."""
    import jax

    nnx = _nnx()
    to_predicate = nnx.filterlib.to_predicate
    group = {i: g for g, i in enumerate(nodes)}  # argument position -> index in the tuple of nodes
    diff_groups = {group[i]: to_predicate(filters.get(i, nnx.Param)) for i in argnums if i in group}

    def is_diff(path: tuple[Any, ...], x: Any) -> bool:
        pred = diff_groups.get(path[0])
        return pred is not None and pred(path[1:], x)

    node_args = tuple(args[i] for i in nodes)
    graphdef, diff, rest = nnx.split(node_args, is_diff, ...)
    parts = {g: diff[g] if g in diff else nnx.State({}) for g in diff_groups}

    pure = list(args)
    for i in nodes:
        pure[i] = parts[group[i]] if group[i] in parts else None
    user_state = None
    if state_argnum is not None:
        user_state, pure[state_argnum] = args[state_argnum], None
    pure.append((rest, user_state))
    new_state_argnum = len(args)

    def pure_loss(*xs: Any) -> Any:
        *pos, (rest_in, user_in) = xs
        merged = nnx.merge(graphdef, nnx.State({g: pos[nodes[g]] for g in parts}), rest_in, copy=True)
        call_args = list(pos)
        for g, i in enumerate(nodes):
            call_args[i] = merged[g]
        if state_argnum is not None:
            call_args[state_argnum] = user_in
        out: Any = loss_fn(*call_args)
        loss: Any
        aux: Any
        loss, aux = out if has_aux else (out, None)
        new_user: Any = None
        if state_argnum is not None:
            aux, new_user = aux
        _, _, new_rest = nnx.split(merged, is_diff, ...)
        return loss, (aux, (new_rest, new_user))

    specs = param_specs
    if specs is None:  # the layout the variables' sharding metadata records (nnx.with_partitioning): P() where none
        read = [nnx.get_partition_spec(parts[group[i]]) if i in group else None for i in argnums]
        if all(r is not None for r in read):
            specs = read[0] if single else tuple(read)
    new_arg_specs = None
    if arg_specs is not None:
        others = [i for i in range(len(args)) if i not in argnums]
        given = (arg_specs,) * len(others) if _is_spec(arg_specs) else tuple(arg_specs)
        if len(given) != len(others):
            raise ValueError(
                f"arg_specs must give one entry per argument that is not differentiated ({len(others)} here: "
                f"positions {others}), or one PartitionSpec for all of them, got arg_specs={arg_specs!r}"
            )
        by_pos = dict(zip(others, given, strict=True))
        user_spec = None if state_argnum is None else by_pos[state_argnum]
        replicated = jax.sharding.PartitionSpec()
        new_arg_specs = (
            *(None if (i in group or i == state_argnum) else by_pos[i] for i in others),
            (replicated, replicated if user_spec is None else user_spec),
        )

    grad_fn = make(
        pure_loss,
        argnums=argnums[0] if single else argnums,
        has_aux=True,
        state_argnum=new_state_argnum,
        arg_specs=new_arg_specs,
        param_specs=specs,
    )
    (loss, (aux, (new_rest, new_user))), grads, stats = grad_fn(*pure)
    nnx.update(node_args, new_rest)  # BatchNorm's statistics, the RNG counts: back into the user's objects
    if state_argnum is not None:
        aux = (aux, new_user)
    return ((loss, aux) if has_aux else loss), grads, stats


def _is_spec(x: Any) -> bool:
    import jax

    return x is None or isinstance(x, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding))
