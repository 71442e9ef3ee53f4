"""Shared test fixtures (not a test module): the optimizer, the replica step, the models and their data.

* :func:`make_tx`: ``adascale_sgd(learning_rate, momentum=0.9, ...)``, the optimizer most tests train with.
* :func:`replica_update` / :func:`replica_grads`: ``tx.update`` over replicas stacked on a leading axis
  (a ``jax.vmap`` axis), and noisy per-replica gradients for a parameter tree.
* The data-parallel MLP (:func:`init_mlp`, :func:`mlp_loss`, :func:`synthetic_batches`) and the tensor-parallel
  one (``TP_*``: a ``(data=4, model=2)`` mesh, weights split over ``model``).
* :func:`run_example`: an example script in a fresh interpreter.
* :func:`backend_compiles`: the XLA compilations while a block runs (JAX's monitoring events).
* :func:`primitive`: the primitive JAX binds under a name (the dispatch table's tests).
"""

import contextlib
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import optax_adascale

# --------------------------------------------------------------------------- the optimizer and the replica step


def make_tx(learning_rate, **kw):
    """``adascale_sgd(learning_rate, momentum=0.9, **kw)``."""
    return optax_adascale.adascale_sgd(learning_rate, momentum=0.9, **kw)


def replica_update(tx, *, axis_name="i", axis_size=None, jit=True, **extra):
    """``(grads, state, params) -> (updates, state)`` with ``grads`` stacked over replicas on a leading vmap axis.

    The state and params are shared (``in_axes=None``), the outputs replicated; ``extra`` goes to ``tx.update``.
    """
    update = jax.vmap(
        lambda g, s, p: tx.update(g, s, p, **extra),
        in_axes=(0, None, None),
        out_axes=(None, None),
        axis_name=axis_name,
        axis_size=axis_size,
    )
    return jax.jit(update) if jit else update


def replica_grads(params, n=4, seed=0):
    """``1 + N(0, 1)`` gradients for ``n`` replicas, stacked on a leading axis, in each leaf's dtype."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
    return treedef.unflatten(
        [(1.0 + jax.random.normal(k, (n,) + jnp.shape(x))).astype(jnp.result_type(x)) for k, x in zip(keys, leaves)]
    )


def bits_equal(a, b) -> bool:
    """Whether two trees hold bit-identical arrays."""
    return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b))


# --------------------------------------------------------------------------- the data-parallel MLP

DIM, CLASSES = 6, 3


def init_mlp():
    """A 6 → 16 → 3 tanh MLP with fixed weights."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "hidden": {"w": jax.random.normal(k1, (DIM, 16)) * 0.5, "b": jnp.zeros(16)},
        "out": {"w": jax.random.normal(k2, (16, CLASSES)) * 0.5, "b": jnp.zeros(CLASSES)},
    }


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    logits = h @ params["out"]["w"] + params["out"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def synthetic_batches(steps: int, n: int, rows: int, dim: int = DIM, classes: int = CLASSES):
    """``(steps, n, rows, dim)`` inputs and ``(steps, n, rows)`` labels: update t, sample i."""
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (steps, n, rows, dim))
    y = jax.random.randint(ky, (steps, n, rows), 0, classes)
    return np.asarray(x), np.asarray(y)


# --------------------------------------------------------------------------- the tensor-parallel MLP

TP_D, TP_H, TP_C = 8, 16, 4
TP_ROWS, TP_STEPS = 4, 8
TP_DATA, TP_MODEL = 4, 2
TP_SCHEDULE = optax.exponential_decay(0.3, transition_steps=4, decay_rate=0.5)
TP_MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(TP_DATA, TP_MODEL), ("data", "model"))  # Auto axes
TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def init_tp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (TP_D, TP_H)) * 0.5,
        "b1": jnp.zeros(TP_H),
        "w2": jax.random.normal(k2, (TP_H, TP_C)) * 0.5,
        "b2": jnp.zeros(TP_C),
    }


def full_loss(p, x, y):
    """The tensor-parallel MLP on whole parameters."""
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], y).mean()


def tp_loss(p, x, y):
    """The same model on one ``model`` shard: column-parallel then row-parallel, one psum."""
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(jax.lax.psum(h @ p["w2"], "model") + p["b2"], y).mean()


@functools.cache
def tp_batches(samples: int):
    """``(TP_STEPS, samples, TP_ROWS, TP_D)`` inputs and labels: update t, sample i."""
    kx, ky = jax.random.split(jax.random.key(1))
    return (
        np.asarray(jax.random.normal(kx, (TP_STEPS, samples, TP_ROWS, TP_D))),
        np.asarray(jax.random.randint(ky, (TP_STEPS, samples, TP_ROWS), 0, TP_C)),
    )


def make_tp_tx(**kw):
    """The tensor-parallel runs' optimizer: momentum SGD over ``data`` (``adascale``, which takes ``param_specs``)."""
    return optax_adascale.adascale(optax.trace(0.9), TP_SCHEDULE, axis_name="data", **kw)


def gain_and_tau(state):
    m = optax_adascale.metrics(state)
    return float(m["gain"]), float(m["scale_invariant_steps"])


# --------------------------------------------------------------------------- examples


def scratch_dir(name: str) -> Path:
    """A fresh temporary directory for a run cached across tests (``tmp_path`` is per test)."""
    return Path(tempfile.mkdtemp(prefix=f"optax_adascale_{name}_"))


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, timeout: float = 300, stderr: list[str] | None = None) -> str:
    """Run ``examples/<name>`` in a fresh CPU-only interpreter; assert it succeeds; return its stdout (and append its
    stderr to ``stderr`` where given)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout


# --------------------------------------------------------------------------- Orbax round trips


def save(path, tree) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore(path, target=None):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path) if target is None else checkpointer.restore(path, target)


def assert_trees_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


@contextlib.contextmanager
def backend_compiles(name: str = ""):
    """The XLA compilations (JAX's events) of functions whose name contains ``name`` while the block runs."""
    seen: list[str] = []

    def listener(event, duration, **kw):
        del duration
        if event == "/jax/core/compile/backend_compile_duration" and name in str(kw.get("fun_name", "")):
            seen.append(kw["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# --------------------------------------------------------------------------- JAX's primitives by name


def primitive(name: str):
    """The primitive JAX binds under ``name``: from its public surface (``jax.extend.core.primitives``, ``jax.lax``)
    where it is there, else from the private module that defines it on JAX 0.10-0.12; ``None`` if this JAX has
    none by that name (it was renamed or removed)."""
    import importlib

    from jax.extend.core import Primitive
    from jax.extend.core import primitives as public

    for module in (public, jax.lax):
        for value in vars(module).values():
            if isinstance(value, Primitive) and value.name == name:
                return value
    private = (
        "shard_map",
        "pjit",
        "core",
        "lax.parallel",
        "random.prng",
        "lax.control_flow.conditionals",
        "lax.lax",
        "lax.linalg",
        "interpreters.partial_eval",
    )
    for where in (f"jax._src.{module}" for module in private):
        try:
            module = importlib.import_module(where)
        except ImportError:  # pragma: no cover - moved: looked for in the others
            continue
        for value in vars(module).values():
            if isinstance(value, Primitive) and value.name == name:
                return value
    return None
