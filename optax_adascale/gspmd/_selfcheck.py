"""The drop-in checks the JAX rules its statistics rest on, once per process and mesh layout, before it reports one.

The per-copy statistics come from JAX's sharding types and transposes (``reduced`` copies, ``unreduced`` partials) and
from the interpreter's rules around them. A JAX release can change a rule without changing a name: JAX 0.12.1 made
the transpose of a cast into Auto axes return a copy's gradient whole on one device, and the drop-in's statistics of
an embedding on an Auto mesh came out 8 % (and 140 %) off while the gradients stayed exact. The dispatch table
refuses a primitive it does not know; this module catches a primitive it knows whose rule moved.

:func:`verify` runs a small probe loss through the drop-in on a mesh shaped like the user's (same axes, sizes, data
axes, Auto or Explicit): an embedding lookup (``gather``), two contractions with the rows (``dot_general``), a bias
added to the rows (``add``) and a scalar scale (``mul``), one parameter each. Its per-copy ``‖g_i‖²`` and ``‖ḡ‖²``
are compared, leaf by leaf, with each data shard's own gradient in forward mode (``jax.jacfwd`` of the probe's loss
on that shard's rows, no mesh: JAX's JVP rules, not the transposes under test). Where they disagree and the user's
loss binds that leaf's primitive, the drop-in raises our ``ValueError`` naming the primitive and the JAX version;
it never reports a gain from a statistic it has seen to be wrong. The verdict is kept per layout for the process:
one probe compile (0.2-0.5 s on a CPU) the first time a layout is traced. The probe runs in a thread of its own (no
trace of the user's is active there), on the first devices of the process; on a multi-process mesh it is skipped
(every process would have to run it in step) and the package's supported JAX range is the guard.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optax_adascale.gspmd._layout import Layout

# Each probe parameter and the primitive its per-copy statistic goes through.
PROBED: dict[str, str] = {"emb": "gather", "w": "dot_general", "b": "add", "s": "mul", "c": "dot_general"}
RTOL = 1e-4  # float32 on a loss of a few dozen terms: agreement is ~1e-6
_V, _D, _H, _C, _ROWS = 6, 3, 4, 2, 4  # table rows, features, hidden, outputs; rows per data shard
_ACTIVE = threading.local()  # inside a probe's own drop-in call: no check of the check


def _params(rng: np.random.Generator) -> dict[str, Any]:
    f = lambda *shape: np.asarray(rng.normal(size=shape), np.float32)  # noqa: E731
    return {"emb": f(_V, _D), "w": f(_D, _H) / 2, "b": f(_H) / 4, "s": np.float32(1.3), "c": f(_H, _C) / 2}


def _probe_loss(explicit: bool, rows: Any):
    """The probe, written as a user writes it for the mesh: ``out_sharding=`` on Explicit axes, nothing on Auto."""

    def loss(p, tok, x, y):
        if explicit:
            e = p["emb"].at[tok].get(out_sharding=P(rows, None))
            h = jnp.einsum("bd,dh->bh", x + e, p["w"], out_sharding=P(rows, None))
        else:
            h = (x + p["emb"][tok]) @ p["w"]
        h = jnp.tanh(h + p["b"]) * p["s"]
        out = jnp.einsum("bh,hc->bc", h, p["c"], out_sharding=P(rows, None)) if explicit else h @ p["c"]
        return jnp.mean((out - y) ** 2)

    return loss


def _reference(params, batch, shards: int) -> tuple[dict[str, float], dict[str, float]]:
    """``mean_i ‖g_i‖²`` and ``‖mean_i g_i‖²`` per leaf, ``g_i`` data shard ``i``'s gradient in forward mode."""
    loss = _probe_loss(False, None)
    grads = []
    for i in range(shards):
        rows = [np.asarray(b[i * _ROWS : (i + 1) * _ROWS]) for b in batch]
        grads.append(jax.jacfwd(loss)(params, *rows))
    a = {k: float(np.mean([np.sum(np.square(np.asarray(g[k], np.float64))) for g in grads])) for k in params}
    b = {k: float(np.sum(np.square(np.mean([np.asarray(g[k], np.float64) for g in grads], axis=0)))) for k in params}
    return a, b


def _run(names: tuple[str, ...], sizes: tuple[int, ...], auto: bool, data: tuple[str, ...]) -> dict[str, float]:
    """The probe on a mesh of this process's first devices: each leaf's worst relative error against the reference."""
    from optax_adascale.gspmd._drop_in import value_and_grad

    types = (AxisType.Auto if auto else AxisType.Explicit,) * len(names)
    devices = np.array(jax.devices()[: int(np.prod(sizes))]).reshape(sizes)
    mesh = jax.sharding.Mesh(devices, names, axis_types=types)
    shards = int(np.prod([sizes[names.index(a)] for a in data]))
    rng = np.random.default_rng(0)
    params = _params(rng)
    tok = rng.integers(0, _V, size=(shards * _ROWS,)).astype(np.int32)
    x = rng.normal(size=(shards * _ROWS, _D)).astype(np.float32)
    y = rng.normal(size=(shards * _ROWS, _C)).astype(np.float32)
    rows = data[0] if len(data) == 1 else data
    specs = {k: P() for k in params} if auto else None
    fn = value_and_grad(_probe_loss(not auto, rows), data_axes=data, param_specs=specs)
    _ACTIVE.on = True
    try:
        with jax.set_mesh(mesh):
            put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))  # noqa: E731
            batch = [put(v, P(rows)) for v in (tok, x, y)]
            _, grads, stats = jax.jit(fn)({k: put(v, P()) for k, v in params.items()}, *batch)
            got_a = {k: float(v) for k, v in stats.sq_norms.items()}
            got_b = {k: float(np.sum(np.square(np.asarray(v, np.float64)))) for k, v in grads.items()}
    finally:
        _ACTIVE.on = False
    want_a, want_b = _reference(params, (tok, x, y), shards)
    err = lambda got, want: abs(got - want) / max(abs(want), 1e-30)  # noqa: E731
    return {k: max(err(got_a[k], want_a[k]), err(got_b[k], want_b[k])) for k in params}


@functools.cache
def _verdict(names: tuple[str, ...], sizes: tuple[int, ...], auto: bool, data: tuple[str, ...]) -> Any:
    """The probe's errors per leaf for this layout, computed once per process in a thread of its own (no trace is
    active there); or the exception the probe raised, which :func:`verify` reports."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="optax_adascale-selfcheck") as pool:
        future = pool.submit(_run, names, sizes, auto, data)
        return future.exception() or future.result()


def verify(layout: Layout, primitives: frozenset[str]) -> None:
    """Our ``ValueError`` where the probe of this layout found a wrong per-copy statistic through a primitive the
    user's loss binds (``primitives``); nothing where it agrees, or where no probe can run here."""
    if getattr(_ACTIVE, "on", False) or jax.process_count() > 1:
        return
    used = {leaf for leaf, name in PROBED.items() if name in primitives}
    if not used or jax.device_count() < int(np.prod(layout.axis_sizes)):
        return
    verdict = _verdict(layout.axis_names, layout.axis_sizes, bool(layout.convert), layout.data)
    where = f"a mesh {dict(zip(layout.axis_names, layout.axis_sizes, strict=True))} with data axes {layout.data}"
    where += " (Auto axes, run Explicit)" if layout.convert else " (Explicit axes)"
    if isinstance(verdict, Exception):
        raise ValueError(
            f"value_and_grad(data_axes={layout.data_spec!r}): the drop-in's check of JAX {jax.__version__}'s sharding "
            f"rules could not run its probe on {where}: {type(verdict).__name__}: {str(verdict).splitlines()[0]}. "
            "The per-copy statistics on this JAX are not verified, so no gain is reported from them. Please report "
            "it with your JAX version; use a JAX release the package lists as tested (pyproject.toml, CHANGELOG)."
        ) from verdict
    bad = sorted({PROBED[leaf] for leaf in used if verdict[leaf] > RTOL})
    if bad:
        worst = max(verdict[leaf] for leaf in used if PROBED[leaf] in bad)
        raise ValueError(
            f"value_and_grad(data_axes={layout.data_spec!r}): on JAX {jax.__version__}, the per-copy gradient "
            f"statistics through {', '.join(repr(b) for b in bad)} disagree with each data shard's own gradient "
            f"(relative error {worst:.2g} on a probe) on {where}: a rule of JAX's for that primitive changed under "
            "the drop-in, and the gain computed from these statistics would be wrong. The gradients may still be "
            "right. Use a JAX release the package lists as tested (pyproject.toml, CHANGELOG), or report it with "
            "your JAX version."
        )
