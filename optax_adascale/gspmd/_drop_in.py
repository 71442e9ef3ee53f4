"""``value_and_grad``: ``jax.value_and_grad`` of the unmodified loss, plus the per-copy statistics AdaScale needs.

The loss runs **as written, on the global batch**. Its samples come from JAX's sharding types
(JAX's "Autodiff and sharding"): every parameter replicated over the data axes is cast to
``reduced`` over them (a free cast), so ``jax.grad`` returns its gradient ``unreduced``: each
device holds the partial sum of its own rows, through its own copy of the parameter. That partial,
times ``n``, is data shard ``i``'s sample ``g_i = n·∂L/∂θ_i`` — for any loss (token-weighted,
batch norm, in-batch negatives, random draws, custom rules, ``shard_map`` inside), because nothing
about the loss changed. ``reshard`` back to the parameter's sharding is SGD's all-reduce. A parameter
sharded over the data axes (FSDP) is gathered inside the loss: the gather is made to return a
``reduced`` copy (``_rewrite``), a probe on it reads each device's partial in the backward pass, and
the gather's transpose reduce-scatters as before.

With ``num_microbatches=k`` the loss runs on ``k`` global micro-batches in a ``lax.scan`` (micro-batch
``j``: the ``j``-th block of every data shard's rows); the partials accumulate unreduced and are
reduced once, after the loop. On a mesh with Auto axes the data axes are made Explicit for the loss
(``jax.sharding.explicit_axes``; on JAX 0.10 every axis, which reduced types need there), and the
loss's ``with_sharding_constraint``\\ s lose those axes (``_rewrite``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from optax_adascale import _compat
from optax_adascale.core import _checks, _microbatch
from optax_adascale.core._samples import MicrobatchStats
from optax_adascale.gspmd import _global, _layout, _mesh, _nnx, _split
from optax_adascale.gspmd._call import Call, broadcast
from optax_adascale.gspmd._layout import Layout


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    data_axes: str | tuple[str, ...] | None = None,
    num_microbatches: int = 1,
    has_aux: bool = False,
    mesh: Any = None,
    param_specs: Any = None,
    argnums: int | tuple[int, ...] = 0,
    arg_specs: Any = None,
    state_argnum: int | None = None,
    unroll: int | bool = 1,
) -> Callable[..., tuple[Any, Any, MicrobatchStats]]:
    """``jax.value_and_grad`` of the loss as written, plus the statistics AdaScale needs: ``(value, grads, stats)``.

    **Global batch** (``data_axes`` set): call the returned function inside a
    ``jax.jit`` step over the global batch, with the mesh set by
    ``jax.set_mesh(mesh)`` (or passed as ``mesh=``). ``data_axes`` names the mesh
    axes the batch is sharded over::

        tx = optax_adascale.adascale_sgd(schedule, momentum=0.9)        # no axis_name
        grad_fn = optax_adascale.value_and_grad(loss_fn, data_axes="data")

        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads, stats = grad_fn(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params, microbatch_stats=stats)
            return optax.apply_updates(params, updates), opt_state, loss

    - ``value``, ``grads`` (and ``aux``) are ``jax.value_and_grad(loss_fn)``'s on
      the global batch, for any loss: the loss is not changed, split or vmapped.
    - The samples are the per-copy contributions ``g_i = n·∂L/∂θ_i``: ``θ_i`` is
      the copy of the parameters that data shard ``i``'s rows use (for a mean
      over rows, shard ``i``'s mean gradient). ``stats`` carries ``mean_i ‖g_i‖²``
      and ``‖ḡ‖²`` per leaf (``MicrobatchStats``): the gain is right whatever is
      done to ``grads`` before ``update`` (clipping, loss scaling).
    - ``num_microbatches=k``: the loss runs on ``k`` global micro-batches
      (micro-batch ``j`` is the ``j``-th contiguous block of every data shard's
      rows: the leaves of the arguments sharded over the data axes on their first
      dimension are split, every other argument goes to each micro-batch whole);
      ``value`` and ``grads`` are the mean over the micro-batches of
      ``jax.value_and_grad`` on each. ``aux``, leaf by leaf: floating the mean,
      integer the sum (counts), boolean any (flags), PRNG keys the last
      micro-batch's; state the loss advances (RNG counters, running statistics)
      is threaded when ``state_argnum`` names it, as the user's own
      accumulation threads it, and the last micro-batch's is returned. The
      samples are ``shards × k``; the partial gradients accumulate unreduced and
      are reduced once, after the loop.
    - Meshes: Explicit axes (``jax.make_mesh``'s default) for every layout
      (replicated, tensor-parallel, FSDP, stacked scanned layers, remat). Auto
      axes (``jax.sharding.Mesh``'s default, MaxText's ``shard_mode=auto``): the
      loss runs with the axes made Explicit, the parameters laid out by
      ``param_specs`` (without it they are replicated inside the loss, with a
      warning), and where Explicit types ask for a decision GSPMD makes by
      itself the drop-in makes GSPMD's: an FSDP weight is gathered at its use,
      a contraction over a tensor-parallel dimension sums its partial products.
      A loss that cannot run that way raises a ``ValueError`` naming the
      Explicit mesh as the fix.

    **Flax NNX**: modules and ``nnx.Rngs`` among the arguments are taken as
    ``nnx.value_and_grad`` takes them (``loss_fn(model, batch, rngs)`` inside
    ``nnx.jit``): the module ``argnums`` names is differentiated with respect to
    its ``nnx.Param`` variables (``argnums=nnx.DiffState(i, filter)`` for
    another filter), ``grads`` and ``stats.sq_norms`` are that ``nnx.State``
    (what ``nnx.Optimizer(model, tx, wrt=nnx.Param).update(model, grads,
    microbatch_stats=stats)`` takes), the other variables (BatchNorm's
    statistics, RNG counts) are threaded as state and written back into the
    objects, and on Auto axes the parameters' layout comes from the variables'
    sharding metadata unless ``param_specs`` is given.

    **Per replica** (``data_axes=None``): inside ``shard_map``, ``pmap`` or
    ``vmap`` the batch is already the replica's; its ``k`` contiguous micro-batches
    are the samples (``n = k``) and the tx has ``axis_name`` set. Under
    ``shard_map`` mark the parameters varying first:
    ``jax.lax.pcast(params, axis, to="varying")``.

    Args:
      loss_fn: ``loss_fn(params, *args) -> loss`` (or ``(loss, aux)``).
      data_axes: mesh axis name(s) the batch is sharded over, or ``None``.
      num_microbatches: ``k ≥ 1`` micro-batches per step (per replica).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      mesh: the mesh, if not set by ``jax.set_mesh``.
      param_specs: the parameters' ``PartitionSpec``\\ s (or ``NamedSharding``\\ s:
        MaxText's state shardings), a pytree like ``params``. On a mesh with
        Auto axes the parameters keep this layout inside the loss (an Auto
        mesh does not record it in their types). On Explicit axes the types
        say it; specs given there must agree with them.
      argnums: which positional arguments to differentiate, as
        ``jax.value_and_grad`` takes it (a tuple gives a tuple of gradients and
        of statistics). Arguments that are not arrays (a config object, Python
        numbers) are passed to ``loss_fn`` as they are.
      arg_specs: the same for the arguments that are not differentiated, on a
        mesh with Auto axes: one entry per such argument, in order (a
        ``PartitionSpec`` or a pytree prefix of the argument), or one spec for
        all, as ``shard_map``'s ``in_specs``. A leaf sharded over ``data_axes``
        on its first dimension is the batch, any other is passed whole. Without
        it every array whose first dimension ``shards × k`` divide is the batch,
        and arrays with different such first dimensions are refused
        (``ValueError``: which is the batch is then ambiguous).
      state_argnum: the positional argument holding state ``loss_fn`` advances
        (NNX's RNG counters, batch-norm statistics), or ``None``. ``loss_fn`` then
        returns ``(loss, (aux, new_state))`` (``has_aux=True``), ``new_state``
        shaped like that argument; with ``k`` micro-batches micro-batch ``j``
        starts from micro-batch ``j − 1``'s new state and the last one is
        returned. Not differentiated.
      unroll: passed to the micro-batch ``lax.scan`` (``True`` trades compile time
        and memory for speed where loop bodies run slowly, e.g. XLA:CPU convolutions).

    Returns:
      ``fn(*args) -> (value, grads, stats)``; ``grads`` and ``stats.sq_norms``
      shaped like the arguments ``argnums`` names (``fn(params, *args)`` for the
      default ``argnums=0``).

    Raises:
      ValueError: ``data_axes`` not in the mesh, or not an axis the batch is
        sharded over; no mesh set; a batch not divisible by ``shards × k``;
        ``data_axes=None`` under a jit over a multi-device mesh with no replica
        axis bound; a mesh of Auto and Explicit axes together; a loss that
        cannot run with the data axes Explicit.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax_adascale
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> loss = lambda w, x: jnp.mean(x @ w)
      >>> fn = jax.jit(optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=2, mesh=mesh))
      >>> x = jax.device_put(jnp.array([[1.0, 0.0], [0.0, 1.0]]), NamedSharding(mesh, P("data")))
      >>> value, grads, stats = fn(jnp.ones(2), x)
      >>> grads, stats.sq_norms, stats.num_microbatches
      (Array([0.5, 0.5], dtype=float32), Array(1., dtype=float32), 2)
    """
    _checks.check_static_int("num_microbatches", num_microbatches)
    _checks.check_bool("has_aux", has_aux)
    argnums, nnx_filters = _nnx.split_argnums(argnums)
    call = Call.of(argnums, state_argnum, has_aux)
    if data_axes is None:
        plain = _per_replica(loss_fn, call, num_microbatches, has_aux, mesh, unroll)
    else:
        plain = _global_batch(loss_fn, call, data_axes, num_microbatches, has_aux, mesh, param_specs, arg_specs, unroll)

    def make(pure_loss, **kwargs):
        return value_and_grad(
            pure_loss, data_axes=data_axes, num_microbatches=num_microbatches, mesh=mesh, unroll=unroll, **kwargs
        )

    def dispatch(*args):
        nodes = _nnx.positions(args)
        if not nodes:
            return plain(*args)
        return _nnx.call(
            make,
            loss_fn,
            args,
            nodes,
            argnums=call.argnums,
            single=call.single,
            filters=nnx_filters,
            has_aux=has_aux,
            state_argnum=state_argnum,
            arg_specs=arg_specs,
            param_specs=param_specs,
        )

    return dispatch


def _global_batch(loss_fn, call, data_axes, num_microbatches, has_aux, mesh, param_specs, arg_specs, unroll):
    names = _mesh.data_axis_names(data_axes)

    def fn(*args):
        inner, params, state, arrays = call.bind(loss_fn, args)
        _checks.check_has_leaves(params, "params", where="value_and_grad")
        inner_args = (state, *arrays)
        n_state = len(jax.tree.leaves(state))
        the_mesh = _mesh.resolve_mesh(mesh, names)
        _mesh.check_one_axis_type(the_mesh, names)
        layout = Layout.of(the_mesh, names, num_microbatches, mesh)
        specs = _layout.param_specs_like(param_specs, params, layout)
        if layout.shards == 1 and num_microbatches == 1:
            _checks.warn(
                f"value_and_grad(data_axes={data_axes!r}): the data axes have a single device, so each step has "
                "n = 1 gradient sample and AdaScale is the identity (gain 1). Use more data shards, or "
                "num_microbatches=k > 1 to take k samples per step."
            )
        with _mesh_context(the_mesh, mesh):
            if layout.shards == 1:  # one data shard: no copies to tell apart, the k micro-batches are the samples
                return _global.one_shard(inner, has_aux, layout, params, inner_args, unroll, n_state)
            convert = _layout.auto_axes(the_mesh)
            arg_names = call.array_names(loss_fn, args)
            if convert:
                batch = _batch_specs(layout, state, arrays, call.arg_specs(arg_specs, args), arg_names)
                return _converted(
                    inner, has_aux, layout, the_mesh, convert, specs, batch, params, inner_args, unroll, n_state
                )
            if specs is not None:
                _layout.check_specs_agree(specs, params)
            if layout.k > 1:  # (k = 1: the shardings themselves need the rows to divide the shards)
                sharded = [i for i, x in enumerate(arrays) if jnp.ndim(x) and _rows_over(layout, _layout.partitions(x))]
                _check_rows_split(layout, arrays, arg_names, sharded)
            return _global.run(inner, has_aux, layout, params, inner_args, unroll=unroll, n_state=n_state)

    def with_rows(*args):  # stats.rows: the arrays' first dimensions (static), which a BatchRamp's update holds fixed
        value, grads, stats = fn(*args)
        rows = tuple(int(jnp.shape(x)[0]) for x in call.bind(loss_fn, args)[3] if jnp.ndim(x))
        return value, grads, dataclasses.replace(stats, rows=rows) if isinstance(stats, MicrobatchStats) else stats

    return with_rows


def _per_replica(loss_fn, call, k, has_aux, mesh, unroll):
    threaded = call.state_argnum is not None

    def fn(*args):
        inner, params, state, arrays = call.bind(loss_fn, args)
        _checks.check_has_leaves(params, "params", where="value_and_grad")
        _mesh.check_replica_axis_bound(mesh, (params, arrays))
        if threaded:
            per_replica = _microbatch.per_replica(inner, k, has_aux=has_aux, unroll=unroll, threaded=True)
            value, grads, stats = per_replica(params, state, *arrays)
        else:
            per_replica = _microbatch.per_replica(lambda p, *xs: inner(p, None, *xs), k, has_aux=has_aux, unroll=unroll)
            value, grads, stats = per_replica(params, *arrays)
        if has_aux:  # stacked over the k micro-batches: combined as for the global batch
            loss, aux = value
            aux, new_state = aux if threaded else (aux, None)
            aux = jax.tree.map(_split.combine, aux)
            value = (loss, (aux, new_state) if threaded else aux)
        return value, grads, stats

    return fn


def _mesh_context(the_mesh, given):
    """``mesh=`` given and none set: run under it (``jax.sharding`` reads the context's mesh)."""
    import contextlib

    if given is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(getattr(the_mesh, "abstract_mesh", the_mesh))


# --------------------------------------------------------------------------- Auto axes


def _converted(loss_fn, has_aux, layout: Layout, mesh, convert, specs, arg_specs, params, args, unroll=1, n_state=0):
    """The Auto axes made Explicit for the loss, which is traced once on the Auto mesh.

    Reduced/unreduced types are only sound with every mesh axis Explicit (JAX 0.10 asserts it), so every Auto
    axis is converted (a mesh of both kinds is refused: ``_mesh.check_one_axis_type``). Inside, the parameters
    are laid out by ``specs`` (``param_specs``; replicated without them, with a warning) and the arguments by
    ``arg_specs`` (:func:`_batch_specs`: the batch sharded over the data axes); the loss's
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
        i for i, spec in enumerate(arg_specs) if set(layout.data) & set(_layout.spec_axes(spec[0] if spec else None))
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


def _batch_specs(layout: Layout, state: Any, arrays: list[Any], given: Any, names: list[str]) -> list[P]:
    """Each argument leaf's spec inside the loss on an Auto mesh (whose types do not record it), the state's leaves
    first: ``arg_specs`` (:meth:`Call.arg_specs`), or the batch inferred (every array whose first dimension
    ``shards × k`` divide; state replicated), refused where ambiguous or where no array's rows split."""
    state_leaves = jax.tree.leaves(state)
    if given is not None:
        state_spec, array_specs = given
        state_specs = [P()] * len(state_leaves) if state_spec is None else broadcast(state_spec, state)
        per_leaf = state_specs + list(array_specs)
        specs = _layout.specs_like(per_leaf, [*state_leaves, *arrays], layout, "arg_specs")
        sharded = [i for i, spec in enumerate(specs[len(state_leaves) :]) if _rows_over(layout, spec)]
        _check_rows_split(layout, arrays, names, sharded)
        return specs
    is_key = lambda x: jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    n = layout.shards * layout.k
    candidates = [i for i, x in enumerate(arrays) if jnp.ndim(x) and not is_key(x)]
    rows = [i for i in candidates if jnp.shape(arrays[i])[0] % n == 0]
    if not rows:  # nothing splits: name the arrays that could be the batch, not "no argument is sharded"
        _check_rows_split(layout, arrays, names, candidates, inferred=True)
    sizes = sorted({arrays[i].shape[0] for i in rows})
    if len(sizes) > 1:
        raise ValueError(
            f"value_and_grad(data_axes={layout.data_spec!r}) on a mesh with Auto axes cannot tell which arguments "
            f"are the batch: the mesh does not record how they are sharded, and arguments with first dimensions "
            f"{sizes} could each be its rows. Pass arg_specs= (one entry per argument that is not differentiated: "
            f"P({layout.data_spec!r}) for the batch, P() for an argument passed whole; MaxText: the data sharding), "
            "or use a mesh with Explicit axes (jax.make_mesh's default)."
        )
    return [P()] * len(state_leaves) + [P(layout.data_spec) if i in rows else P() for i in range(len(arrays))]


def _rows_over(layout: Layout, spec: Any) -> bool:  # the first dimension split over every data axis
    return bool(spec) and set(layout.data) <= set(_layout.spec_axes(spec[0]))


def _check_rows_split(layout: Layout, arrays: list[Any], names: list[str], batch: list[int], inferred=False) -> None:
    """Raise naming the batch's arguments and sizes where their rows do not split into ``shards × k`` blocks (data
    shard ``s``'s micro-batch ``j`` is the ``j``-th block of its rows)."""
    bad = [i for i in batch if jnp.shape(arrays[i])[0] % layout.n]
    if not bad:
        return
    which = ", ".join(f"{names[i] if i < len(names) else f'array {i}'} has {jnp.shape(arrays[i])[0]} rows" for i in bad)
    rows = jnp.shape(arrays[bad[0]])[0]
    per_shard = f"{rows / layout.shards:g}"
    raise ValueError(
        f"value_and_grad(data_axes={layout.data_spec!r}, num_microbatches={layout.k}): {which}: the batch does not "
        f"split into data shards × micro-batches = {layout.shards} × {layout.k} = {layout.n} equal blocks of rows "
        f"({per_shard} rows per data shard, {rows / layout.n:g} per micro-batch). Feed a batch whose rows are a "
        f"multiple of {layout.n} (e.g. {max(layout.n, rows // layout.n * layout.n)} or "
        f"{(rows // layout.n + 1) * layout.n}), or a num_microbatches that divides the rows of a data shard."
        + (" If these are not the batch, say which argument is with arg_specs=." if inferred else "")
    )


def _auto_refusal(layout: Layout, convert, err) -> str:
    return (
        f"value_and_grad(data_axes={layout.data_spec!r}) on a mesh with Auto axes runs loss_fn with the axes "
        f"{tuple(convert)} Explicit (their reduced/unreduced sharding types give the per-copy statistics, and "
        f"JAX has them on Explicit axes only), and loss_fn does not run that way: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}. Build the mesh with Explicit axes (jax.make_mesh's "
        "default) and write the loss the Explicit way (out_sharding= where JAX asks for it); value, grads and "
        "statistics are then exact for any loss."
    )
