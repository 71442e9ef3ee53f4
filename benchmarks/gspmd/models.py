"""The study's models, valid for ``jax.value_and_grad`` on every layout.

* ``mlp_mse``: ``d → h → d`` tanh MLP, squared error (the shape the 0.2 gates were tuned on);
* ``mlp_xent``: the same MLP with a softmax cross-entropy over ``d`` classes (integer labels);
* ``lm``: a byte-level decoder, embedding + ``L`` residual MLP blocks stacked on a leading axis and applied
  with ``lax.scan`` over ``jax.checkpoint``-ed layers, next-byte cross-entropy;
* ``stack``: a parameter-dominated model, what FSDP exists for: ``L`` residual Megatron blocks
  ``x + gelu(x W₁) W₂`` (``d × h`` each) stacked and scanned with remat, a few rows, squared error.

Layouts on a ``(data, model)`` mesh: replicated, TP (hidden units over ``model``), FSDP (the other
dimension over ``data``), TP×FSDP. How the loss meets a sharded weight (``gather``):

* ``"einsum"``: the sharded weight straight into ``jnp.einsum(..., out_sharding=)`` (Explicit axes);
* ``"reshard"``: ``jax.reshard(w, P(...))`` off the data axes before use, per layer inside the scan (MaxText's
  explicit mode, most hand-written trainers);
* ``"auto"``: written for Auto axes (``jax.sharding.Mesh``'s default, MaxText's ``shard_mode=auto``): no
  annotation at all, GSPMD decides; the drop-in is given the parameters' specs (``param_specs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LAYOUTS = ("replicated", "TP", "FSDP", "TP×FSDP")


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    name: str
    layout: str
    params: dict[str, Any]
    specs: dict[str, Any]
    batch: tuple[Any, ...]
    loss: Callable[..., Any]
    tied: tuple[str, ...] = ()  # leaves the loss uses at more than one place (a tied embedding)
    gather: str = "einsum"

    def hoisted_bytes(self, k: int) -> int:
        """The documented memory allowance: with k > 1 an FSDP leaf used at more than one place is gathered
        once, before the micro-batch loop, and its partial gradient accumulates at full size."""
        if k == 1 or "FSDP" not in self.layout:
            return 0
        return sum(int(np.asarray(self.params[name]).nbytes) for name in self.tied)

    @property
    def auto(self) -> bool:
        """Written for Auto axes: measured on a mesh of Auto axes, the drop-in given ``param_specs``."""
        return self.gather == "auto"

    def place(self, mesh) -> tuple[dict[str, Any], list[Any]]:
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        params = {k: put(v, self.specs[k]) for k, v in self.params.items()}
        return params, [put(b, P("data")) for b in self.batch]


def _matmul(gather: str, spec: str, x: Any, w: Any, w_spec: P, out: P) -> Any:
    """``einsum(spec, x, w)`` the way ``gather`` says the loss meets the sharded weight ``w`` (specs ``w_spec``)."""
    if gather == "auto":
        return jnp.einsum(spec, x, w)
    if gather == "reshard":
        w = jax.reshard(w, P(*(_strip_data(e) for e in w_spec)))
    return jnp.einsum(spec, x, w, out_sharding=out)


def _strip_data(entry: Any) -> Any:
    return None if entry == "data" else entry


def _col(layout: str) -> Any:
    return "model" if "TP" in layout else None


def _row(layout: str) -> Any:
    return "data" if "FSDP" in layout else None


def mlp(
    layout: str, *, d: int = 256, h: int = 1024, rows: int = 8192, xent: bool = False, gather: str = "einsum"
) -> Model:
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((d, h)) / d**0.5).astype(np.float32),
        "b1": np.zeros(h, np.float32),
        "w2": (rng.standard_normal((h, d)) / h**0.5).astype(np.float32),
    }
    col, row = _col(layout), _row(layout)
    specs = {"w1": P(row, col), "b1": P(col), "w2": P(col, row)}
    x = rng.standard_normal((rows, d), dtype=np.float32)
    y = rng.integers(0, d, rows).astype(np.int32) if xent else rng.standard_normal((rows, d), dtype=np.float32)

    def loss(p, x, y):
        hidden = _matmul(gather, "bd,dh->bh", x, p["w1"], specs["w1"], P("data", col))
        bias = p["b1"] if gather == "auto" else jax.reshard(p["b1"], P(col))
        hidden = jnp.tanh(hidden + bias)
        out = _matmul(gather, "bh,hd->bd", hidden, p["w2"], specs["w2"], P("data", None))
        if xent:
            return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
        return jnp.mean((out - y) ** 2)

    return Model("mlp_xent" if xent else "mlp_mse", layout, params, specs, (x, y), loss, gather=gather)


def lm(
    layout: str,
    *,
    vocab: int = 256,
    d: int = 128,
    h: int = 512,
    layers: int = 4,
    seq: int = 64,
    rows: int = 64,
    gather: str = "einsum",
    unroll: int | bool = 1,
) -> Model:
    rng = np.random.default_rng(0)
    params = {
        "embed": (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32),
        "w_in": (rng.standard_normal((layers, d, h)) / d**0.5).astype(np.float32),
        "w_out": (rng.standard_normal((layers, h, d)) / h**0.5).astype(np.float32),
        "scale": np.ones((layers, d), np.float32),
    }
    col, row = _col(layout), _row(layout)
    specs = {
        "embed": P(None, row),
        "w_in": P(None, row, col),
        "w_out": P(None, col, row),
        "scale": P(None, None),
    }
    tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)

    def loss(p, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if gather == "auto":
            x = p["embed"][inputs]
        else:
            x = p["embed"].at[inputs].get(out_sharding=P("data", None, None))

        def block(x, layer):
            w_in, w_out, scale = layer
            norm = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
            hidden = jax.nn.gelu(_matmul(gather, "btd,dh->bth", norm, w_in, specs["w_in"][1:], P("data", None, col)))
            return x + _matmul(gather, "bth,hd->btd", hidden, w_out, specs["w_out"][1:], P("data", None, None)), None

        x, _ = jax.lax.scan(jax.checkpoint(block), x, (p["w_in"], p["w_out"], p["scale"]), unroll=unroll)
        if gather == "auto":
            logits = jnp.einsum("btd,vd->btv", x, p["embed"])
        else:
            embed = jax.reshard(p["embed"], P(None, None))
            logits = jnp.einsum("btd,vd->btv", x, embed, out_sharding=P("data", None, None))
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return Model("lm", layout, params, specs, (tokens,), loss, tied=("embed",), gather=gather)


def stack(
    layout: str,
    *,
    d: int = 512,
    h: int = 1024,
    layers: int = 8,
    rows: int = 64,
    gather: str = "reshard",
    unroll: int | bool = 1,
) -> Model:
    """``L`` residual blocks ``x + gelu(x W₁) W₂`` scanned with remat, squared error: the parameters (``2·L·d·h``
    floats) dwarf the activations (``rows × max(d, h)`` per layer), as in the models FSDP is for."""
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((layers, d, h)) / d**0.5).astype(np.float32),
        "w2": (rng.standard_normal((layers, h, d)) / h**0.5 / layers**0.5).astype(np.float32),
    }
    col, row = _col(layout), _row(layout)
    specs = {"w1": P(None, row, col), "w2": P(None, col, row)}
    x = rng.standard_normal((rows, d), dtype=np.float32)
    y = rng.standard_normal((rows, d), dtype=np.float32)

    def loss(p, x, y):
        def block(x, layer):
            w1, w2 = layer
            hidden = jax.nn.gelu(_matmul(gather, "bd,dh->bh", x, w1, specs["w1"][1:], P("data", col)))
            return x + _matmul(gather, "bh,hd->bd", hidden, w2, specs["w2"][1:], P("data", None)), None

        out, _ = jax.lax.scan(jax.checkpoint(block), x, (p["w1"], p["w2"]), unroll=unroll)
        return jnp.mean((out - y) ** 2)

    return Model("stack", layout, params, specs, (x, y), loss, gather=gather)


def build(name: str, layout: str, **kw) -> Model:
    """``unroll``: the scanned models' layer loop unrolled (``True``) so that a cost analysis sees every layer (XLA's
    counts a loop's body once); the MLPs have no loop."""
    if name not in ("lm", "stack"):
        kw.pop("unroll", None)
    if name == "lm":
        return lm(layout, **kw)
    if name == "stack":
        return stack(layout, **kw)
    return mlp(layout, xent=name == "mlp_xent", **kw)
