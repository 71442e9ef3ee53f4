"""What big models are made of, written once for the mesh and once per copy (no mesh), for test_patterns.py.

Each :class:`Pattern` has parameters, their layouts, a batch, and ``apply(p, *rows)``: the model on some rows,
written the Explicit way through :func:`mm` and :func:`put` (which annotate only where a mesh is set, so the same
code runs per copy without one), and ``head(out, p, *batch)``: the loss of the whole batch's outputs (it may couple
rows, and may hold terms of the parameters alone). The global loss is ``head(apply(p, *batch), p, *batch)``. The
per-copy loss gives data shard ``i``'s rows their own copy ``θ_i`` of the parameters (``apply`` per shard), the
terms of the parameters alone seeing the copies' mean: its gradient with respect to ``θ_i``, times ``n``, is
sample ``i`` (``g_i = n·∂L/∂θ_i``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def on_mesh() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


def mm(eq: str, a: Any, b: Any, out: P | None = None) -> Any:
    """``jnp.einsum(eq, a, b)``, with ``out_sharding=out`` on a mesh."""
    if out is not None and on_mesh():
        return jnp.einsum(eq, a, b, out_sharding=out)
    return jnp.einsum(eq, a, b)


def put(x: Any, spec: P) -> Any:
    """``jax.reshard(x, spec)`` on a mesh (the Explicit way's gathers and layouts), ``x`` without one."""
    return jax.reshard(x, spec) if on_mesh() else x


@dataclasses.dataclass(frozen=True, eq=False)
class Pattern:
    params: dict[str, np.ndarray]
    layouts: dict[str, dict[str, P]]
    batch: tuple[np.ndarray, ...]
    apply: Callable[..., Any]
    head: Callable[..., Any]
    batch_specs: tuple[P, ...] = ()
    mesh_shape: tuple[int, ...] = (4, 2)
    axis_names: tuple[str, ...] = ("data", "model")
    data_axes: Any = "data"
    copies: Callable[..., Any] | None = None  # the per-copy loss, where apply couples the rows (batch norm)

    @property
    def shards(self) -> int:
        names = (self.data_axes,) if isinstance(self.data_axes, str) else self.data_axes
        return int(np.prod([self.mesh_shape[self.axis_names.index(a)] for a in names]))

    def loss(self, p, *batch):
        return self.head(self.apply(p, *batch), p, *batch)

    def copies_loss(self, stack, *batch):
        if self.copies is not None:
            return self.copies(stack, *batch)
        n = self.shards
        split = [b.reshape(n, b.shape[0] // n, *b.shape[1:]) for b in batch]
        outs = jax.vmap(self.apply)(stack, *split)
        out = jax.tree.map(lambda o: o.reshape(o.shape[0] * o.shape[1], *o.shape[2:]), outs)
        return self.head(out, jax.tree.map(lambda a: a.mean(0), stack), *batch)

    def micro_batch(self, j: int, k: int) -> tuple[np.ndarray, ...]:
        """Micro-batch ``j`` of ``k``: the ``j``-th contiguous block of every data shard's rows."""
        n = self.shards
        return tuple(b.reshape(n, k, -1, *b.shape[1:])[:, j].reshape(-1, *b.shape[1:]) for b in self.batch)

    def samples(self, k: int = 1) -> dict[str, float]:
        """``mean_{i,j} ‖n·∂L_j/∂θ_i‖²`` per leaf, ``L_j`` the loss of micro-batch ``j`` of ``k``."""
        n = self.shards
        stack = jax.tree.map(lambda a: np.stack([a] * n), self.params)
        out = dict.fromkeys(self.params, 0.0)
        for j in range(k):
            grads = jax.jit(jax.grad(self.copies_loss))(stack, *self.micro_batch(j, k))
            for name, g in grads.items():
                out[name] += float(np.mean(np.sum((n * np.asarray(g)) ** 2, axis=tuple(range(1, g.ndim))))) / k
        return out


B, D, H, C, R = 32, 8, 16, 4, 2


def _rng(seed=0):
    return np.random.default_rng(seed)


def _xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _classify(seed=0):
    rng = _rng(seed)
    x = rng.normal(size=(B, D)).astype(np.float32)
    y = rng.integers(0, C, size=(B,)).astype(np.int32)
    return x, y


def _mlp_params(rng, **extra):
    params = {
        "w1": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "w2": (rng.normal(size=(H, C)) / 4).astype(np.float32),
    }
    params.update({k: v.astype(np.float32) for k, v in extra.items()})
    return params


LAYOUTS_MLP = {
    "replicated": {"w1": P(), "w2": P()},
    "TP": {"w1": P(None, "model"), "w2": P("model", None)},
    "FSDP": {"w1": P("data", None), "w2": P("data", None)},
}


def _with(layouts, **extra):
    return {name: dict(specs, **{k: v(name) for k, v in extra.items()}) for name, specs in layouts.items()}


def lora() -> Pattern:
    """LoRA merged into the weight: ``W + A @ B`` (a parameter times a parameter), then ``x @ W_eff``."""
    rng = _rng(1)
    params = _mlp_params(rng, a=rng.normal(size=(D, R)) / 3, b=rng.normal(size=(R, H)) / 3)
    col = lambda layout: "model" if layout == "TP" else None  # noqa: E731
    layouts = _with(LAYOUTS_MLP, a=lambda _: P(), b=lambda name: P(None, col(name)))

    def apply(p, x, y):
        hid = col_of(p["w1"])
        w_eff = p["w1"] + mm("dr,rh->dh", p["a"], p["b"], P(None, hid))
        h = jnp.tanh(mm("bd,dh->bh", x, w_eff, P("data", hid)))
        return mm("bh,hc->bc", h, p["w2"], P("data", None))

    return Pattern(params, layouts, _classify(1), apply, lambda out, p, x, y: _xent(out, y))


def col_of(w) -> Any:
    """The mesh axis a weight's second dimension is split over (None without a mesh)."""
    if not on_mesh():
        return None
    spec = jax.typeof(w).sharding.spec
    return spec[1] if len(spec) > 1 else None


def param_terms() -> Pattern:
    """Terms of the parameters alone next to the data: an orthogonality penalty ``‖W Wᵀ − I‖²``, a spectral term
    ``(u W v)²`` and a bias read from a table by constant indices (``one_hot(ids) @ table``)."""
    rng = _rng(2)
    params = _mlp_params(rng, u=rng.normal(size=(D,)) / 3, v=rng.normal(size=(H,)) / 3, table=rng.normal(size=(6, C)))
    layouts = _with(LAYOUTS_MLP, u=lambda _: P(), v=lambda _: P(), table=lambda _: P())
    ids = np.array([1, 3, 3, 5], np.int32)

    def apply(p, x, y):
        hid = col_of(p["w1"])
        h = jnp.tanh(mm("bd,dh->bh", x, p["w1"], P("data", hid)))
        bias = jnp.mean(mm("ic,cd->id", jax.nn.one_hot(ids, 6), p["table"]), axis=0)
        return mm("bh,hc->bc", h, p["w2"], P("data", None)) + bias

    def head(out, p, x, y):
        w = p["w1"]
        gram = mm("dh,eh->de", w, w, P())
        ortho = jnp.sum((gram - jnp.eye(D)) ** 2)
        spectral = mm("d,d->", p["u"], mm("dh,h->d", w, p["v"], P()), P()) ** 2
        return _xent(out, y) + 1e-2 * ortho + 1e-2 * spectral

    return Pattern(params, layouts, _classify(2), apply, head)


E, CAP = 4, 4  # experts, capacity per expert and group


def _top2_dispatch(gates):
    """GShard top-2 dispatch with capacity: the (G, S, E, CAP) combine weights, the load-balancing loss per group."""
    mask1 = jax.nn.one_hot(jnp.argmax(gates, -1), E)
    mask2 = jax.nn.one_hot(jnp.argmax(gates * (1 - mask1), -1), E)
    density = jnp.mean(mask1, axis=1)  # (G, E): tokens routed first to each expert
    aux = E * jnp.sum(density * jnp.mean(gates, axis=1), axis=-1)  # (G,)
    pos1 = jnp.cumsum(mask1, axis=1) - 1
    mask1 = mask1 * (pos1 < CAP)
    pos2 = jnp.cumsum(mask2, axis=1) - 1 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < CAP)
    g1, g2 = jnp.sum(gates * mask1, -1), jnp.sum(gates * mask2, -1)
    norm = g1 + g2 + 1e-9
    slot = lambda pos, mask: jax.nn.one_hot(jnp.sum(pos * mask, -1).astype(jnp.int32), CAP)  # noqa: E731
    combine = (g1 / norm)[..., None, None] * mask1[..., None] * slot(pos1, mask1)[:, :, None, :]
    combine += (g2 / norm)[..., None, None] * mask2[..., None] * slot(pos2, mask2)[:, :, None, :]
    return combine, aux


def moe(layout: str = "replicated") -> Pattern:
    """A GShard top-2 mixture of experts with dense dispatch (einsums with one-hot masks), capacity and the
    load-balancing loss; each data shard's rows are one group. Experts replicated, over ``model`` (expert
    parallelism) or their weights over ``data`` (FSDP)."""
    rng = _rng(3)
    params = {
        "router": (rng.normal(size=(D, E)) / 3).astype(np.float32),
        "w_in": (rng.normal(size=(E, D, H)) / 3).astype(np.float32),
        "w_out": (rng.normal(size=(E, H, D)) / 4).astype(np.float32),
        "head": (rng.normal(size=(D, C)) / 3).astype(np.float32),
    }
    layouts = {
        "replicated": {"router": P(), "w_in": P(), "w_out": P(), "head": P()},
        "EP": {"router": P(), "w_in": P("model", None, None), "w_out": P("model", None, None), "head": P()},
        "FSDP": {"router": P(), "w_in": P(None, "data", None), "w_out": P(None, None, "data"), "head": P()},
    }
    group = B // 4

    def apply(p, x, y):
        ep = "model" if on_mesh() and jax.typeof(p["w_in"]).sharding.spec[0] == "model" else None
        xg = (
            x.reshape(x.shape[0] // group, group, D)
            if not on_mesh()
            else x.reshape(x.shape[0] // group, group, D, out_sharding=P("data", None, None))
        )
        gates = jax.nn.softmax(mm("gsd,de->gse", xg, p["router"], P("data", None, None)))
        combine, aux = _top2_dispatch(gates)
        dispatched = mm("gsec,gsd->gecd", combine, xg, P("data", ep, None, None))
        hidden = jax.nn.relu(mm("gecd,edh->gech", dispatched, p["w_in"], P("data", ep, None, None)))
        expert_out = mm("gech,ehd->gecd", hidden, p["w_out"], P("data", ep, None, None))
        out = mm("gsec,gecd->gsd", combine, expert_out, P("data", None, None))
        out = out.reshape(x.shape[0], D) if not on_mesh() else out.reshape(x.shape[0], D, out_sharding=P("data", None))
        return mm("bd,dc->bc", out + x, p["head"], P("data", None)), aux

    def head(out, p, x, y):
        logits, aux = out
        return _xent(logits, y) + 0.01 * jnp.mean(aux)

    pattern = Pattern(params, layouts, _classify(3), apply, head)
    return pattern


def sequence_parallel() -> Pattern:
    """Rows over ``data``, the sequence over ``seq``: a token MLP, a causal mixer across the sequence (a cumulative
    mean, which couples the sequence shards) and mean pooling."""
    rng = _rng(4)
    T = 8
    params = {
        "w1": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "w2": (rng.normal(size=(H, C)) / 4).astype(np.float32),
    }
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    y = rng.integers(0, C, size=(B,)).astype(np.int32)

    def apply(p, x, y):
        h = jnp.tanh(mm("btd,dh->bth", x, p["w1"], P("data", "seq", None)))
        steps = jnp.arange(1, h.shape[1] + 1, dtype=h.dtype)[None, :, None]
        mixed = put(jnp.cumsum(put(h, P("data", None, None)), axis=1), P("data", "seq", None)) / steps
        pooled = jnp.mean(mixed, axis=1)
        return mm("bh,hc->bc", pooled, p["w2"], P("data", None))

    return Pattern(
        params,
        {"replicated": {"w1": P(), "w2": P()}},
        (x, y),
        apply,
        lambda out, p, x, y: _xent(out, y),
        batch_specs=(P("data", "seq", None), P("data")),
        axis_names=("data", "seq"),
    )


def hsdp(data_axes: Any = "data") -> Pattern:
    """HSDP: the batch over (``data``, ``fsdp``), the weights over ``fsdp`` and replicated over ``data``, gathered
    by the loss (the Explicit way) before use."""
    rng = _rng(5)
    params = _mlp_params(rng)

    def apply(p, x, y):
        rows = ("data", "fsdp") if on_mesh() else None
        h = jnp.tanh(mm("bd,dh->bh", x, put(p["w1"], P()), P(rows, None)))
        return mm("bh,hc->bc", h, put(p["w2"], P()), P(rows, None))

    pattern = Pattern(
        params,
        {"HSDP": {"w1": P("fsdp", None), "w2": P("fsdp", None)}},
        _classify(5),
        apply,
        lambda out, p, x, y: _xent(out, y),
        batch_specs=(P(("data", "fsdp")), P(("data", "fsdp"))),
        axis_names=("data", "fsdp"),
        data_axes=data_axes,
    )
    return pattern


def kernel_data(x, w):
    """A kernel written with ``shard_map`` over the data axes, taking a parameter (a Pallas matmul's shape)."""
    if not on_mesh():
        return x @ w
    return jax.shard_map(
        lambda xb, wb: xb @ wb, in_specs=(P("data", None), P()), out_specs=P("data", None), axis_names={"data"}
    )(x, w)


def kernel_experts(x, w, manual_data: bool = True):
    """An expert block written with ``shard_map`` over the model axis (and the data axis where ``manual_data``):
    each device applies its experts to the rows (``w``: ``(E, D, H)`` over ``model``); out ``(B, E, H)``."""
    if not on_mesh():
        return jnp.einsum("bd,edh->beh", x, w)
    rows = "data" if manual_data else None
    return jax.shard_map(
        lambda xb, wb: jnp.einsum("bd,edh->beh", xb, wb),
        in_specs=(P(rows), P("model", None, None)),
        out_specs=P(rows, "model", None),
        axis_names={"model", "data"} if manual_data else {"model"},
    )(x, w)


def kernels(manual_data: bool = True) -> Pattern:
    rng = _rng(6)
    params = {
        "w1": (rng.normal(size=(D, H)) / 3).astype(np.float32),
        "experts": (rng.normal(size=(E, H, H)) / 4).astype(np.float32),
        "w2": (rng.normal(size=(H, C)) / 4).astype(np.float32),
    }
    layouts = {
        "replicated": {"w1": P(), "experts": P("model", None, None), "w2": P()},
    }

    def apply(p, x, y):
        h = jnp.tanh(kernel_data(x, p["w1"]))
        mixed = jnp.mean(jax.nn.relu(kernel_experts(h, p["experts"], manual_data)), axis=1)
        return mm("bh,hc->bc", put(mixed, P("data", None)) if on_mesh() else mixed, p["w2"], P("data", None))

    return Pattern(params, layouts, _classify(6), apply, lambda out, p, x, y: _xent(out, y))


def pipeline(manual_data: bool = False) -> Pattern:
    """Two pipeline stages: the weights ``(2, D, D)`` over ``stage``, a ``shard_map`` over it whose ``lax.scan``
    runs each stage in turn and passes the activations on with ``ppermute``; the rows over ``data``, which the
    ``shard_map`` makes manual too where ``manual_data``."""
    rng = _rng(7)
    params = {
        "stages": (rng.normal(size=(2, D, D)) / 3).astype(np.float32),
        "head": (rng.normal(size=(D, C)) / 3).astype(np.float32),
    }

    def stages(w, x):
        if not on_mesh():
            return jnp.tanh(jnp.tanh(x @ w[0]) @ w[1])

        def body(ws, h):
            s = jax.lax.axis_index("stage")
            h = jax.lax.pcast(h, "stage", to="varying")

            def step(h, t):
                h = jnp.where(s == t, jnp.tanh(h @ ws[0]), h)
                return jax.lax.ppermute(h, "stage", [(0, 1), (1, 0)]), None

            h, _ = jax.lax.scan(step, h, jnp.arange(2))
            return jax.lax.psum(jnp.where(s == 0, h, jnp.zeros_like(h)), "stage")

        if manual_data:
            return jax.shard_map(
                body, in_specs=(P("stage", None, None), P("data")), out_specs=P("data"), axis_names={"stage", "data"}
            )(w, x)
        return jax.shard_map(body, in_specs=(P("stage", None, None), P()), out_specs=P(), axis_names={"stage"})(w, x)

    def apply(p, x, y):
        return mm("bd,dc->bc", stages(p["stages"], x), p["head"], P("data", None))

    return Pattern(
        params,
        {"stages": {"stages": P("stage", None, None), "head": P()}},
        _classify(7),
        apply,
        lambda out, p, x, y: _xent(out, y),
        axis_names=("data", "stage"),
    )


def cond_constant_branch() -> Pattern:
    """``lax.cond`` with one branch of the parameters and the other a constant (a regulariser switched on)."""
    rng = _rng(8)
    params = _mlp_params(rng)

    def apply(p, x, y):
        h = jnp.tanh(mm("bd,dh->bh", x, p["w1"], P("data", col_of(p["w1"]))))
        return mm("bh,hc->bc", h, p["w2"], P("data", None))

    def head(out, p, x, y):
        reg = jax.lax.cond(jnp.sum(y) > 0, lambda w: 1e-2 * jnp.sum(w**2), lambda w: jnp.float32(0.0), p["w2"])
        return _xent(out, y) + reg

    return Pattern(params, LAYOUTS_MLP, _classify(8), apply, head)


@jax.custom_jvp
def batch_norm(h, gamma):
    """Batch norm over the rows, scaled by a parameter: a custom_jvp whose rule is its true derivative."""
    mean = jnp.mean(h, axis=0)
    var = jnp.mean((h - mean) ** 2, axis=0)
    return gamma * (h - mean) / jnp.sqrt(var + 1e-3)


@batch_norm.defjvp
def _batch_norm_jvp(primals, tangents):
    h, gamma = primals
    dh, dgamma = tangents
    mean = jnp.mean(h, axis=0)
    centred = h - mean
    var = jnp.mean(centred**2, axis=0)
    inv = 1 / jnp.sqrt(var + 1e-3)
    normed = centred * inv
    dcentred = dh - jnp.mean(dh, axis=0)
    dvar = 2 * jnp.mean(centred * dcentred, axis=0)
    dnormed = dcentred * inv - centred * inv**3 * dvar / 2
    return gamma * normed, dgamma * normed + gamma * dnormed


def _ste_matmul(quantize_x, quantize_w):
    """``x @ w`` through quantizers, as AQT writes it: a custom_vjp whose backward pass is straight through."""

    @jax.custom_vjp
    def matmul(x, w):
        return mm("bd,dh->bh", quantize_x(x), quantize_w(w), P("data", col_of(w)))

    def fwd(x, w):
        return matmul(x, w), (x, w)

    def bwd(res, ct):
        x, w = res
        w_spec = jax.typeof(w).sharding.spec if on_mesh() else None
        return mm("bh,dh->bd", ct, w, P("data", None)), mm("bd,bh->dh", x, ct, w_spec)

    matmul.defvjp(fwd, bwd)
    return matmul


def _pow2(scale):
    """Scales rounded up to a power of two (AQT's option): quantizing is then exact in float arithmetic, so the
    global and the per-copy computations round every value alike."""
    return 2.0 ** jnp.ceil(jnp.log2(scale + 1e-30))


def _per_row_int8(x):
    scale = _pow2(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127)
    return jnp.round(x / scale) * scale


def _per_column_int8(w):
    scale = _pow2(jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127)
    return jnp.round(w / scale) * scale


def _per_tensor_int4(x, scale=None):
    """``scale``: the whole tensor's (the per-copy reference quantizes a shard's rows with the batch's scale)."""
    scale = _pow2(jnp.max(jnp.abs(x)) / 7) if scale is None else scale  # over the whole tensor: couples the rows
    return jnp.round(x / scale) * scale


QUANTIZERS = {  # (x's, w's)
    "linear": (lambda x: x, lambda w: w),
    "aqt_per_row_int8": (_per_row_int8, _per_column_int8),
    "per_tensor_int4": (_per_tensor_int4, _per_tensor_int4),
}
RULES = {kind: _ste_matmul(*q) for kind, q in QUANTIZERS.items()}


def custom_rule(kind: str) -> Pattern:
    """A custom rule applied to a parameter: batch norm with a true-derivative custom_jvp (couples the rows), or a
    matmul with a straight-through custom_vjp (``linear``; AQT per-row int8; per-tensor int4)."""
    rng = _rng(9)
    params = _mlp_params(rng, gamma=np.ones(H) + 0.1 * rng.normal(size=(H,)))
    layouts = _with(LAYOUTS_MLP, gamma=lambda name: P("model") if name == "TP" else P())

    def apply(p, x, y):
        hid = col_of(p["w1"])
        if kind == "batch_norm":
            h = jnp.tanh(batch_norm(mm("bd,dh->bh", x, p["w1"], P("data", hid)), p["gamma"]))
        else:
            h = jnp.tanh(RULES[kind](x, p["w1"]) * p["gamma"])
        return mm("bh,hc->bc", h, p["w2"], P("data", None))

    def copies(stack, x, y):  # the rows couple in the forward pass: each row through its shard's copy
        n = stack["w1"].shape[0]
        rows = lambda a: jnp.repeat(a, x.shape[0] // n, axis=0)  # noqa: E731 - a copy per row
        if kind == "batch_norm":
            h = jnp.tanh(batch_norm(jnp.einsum("bd,bdh->bh", x, rows(stack["w1"])), rows(stack["gamma"])))
        else:  # each shard's rows through their copy of the rule, x quantized with the whole batch's scale
            quantize_x, quantize_w = QUANTIZERS[kind]
            if kind == "per_tensor_int4":
                scale = _pow2(jnp.max(jnp.abs(x)) / 7)
                quantize_x = lambda xs: _per_tensor_int4(xs, scale)  # noqa: E731
            rule = _ste_matmul(quantize_x, quantize_w)
            h = jax.vmap(rule)(x.reshape(n, -1, x.shape[1]), stack["w1"]).reshape(x.shape[0], -1)
            h = jnp.tanh(h * rows(stack["gamma"]))
        return _xent(jnp.einsum("bh,bhc->bc", h, rows(stack["w2"])), y)

    return Pattern(
        params,
        layouts,
        _classify(9),
        apply,
        lambda out, p, x, y: _xent(out, y),
        copies=copies,
    )


def conv() -> Pattern:
    """A 1-D convolution over each row's sequence (its kernel a parameter), then a classifier: JAX has no reduced rule
    for ``conv_general_dilated``, which is local to the rows (its batch dimension): each device's VJP on its rows."""
    rng = _rng(10)
    T = 8
    params = {
        "kernel": (rng.normal(size=(3, D, H)) / 4).astype(np.float32),
        "w2": (rng.normal(size=(H, C)) / 4).astype(np.float32),
    }
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    y = rng.integers(0, C, size=(B,)).astype(np.int32)

    def apply(p, x, y):
        h = jax.lax.conv_general_dilated(x, p["kernel"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
        return mm("bh,hc->bc", jnp.mean(jnp.tanh(h), axis=1), p["w2"], P("data", None))

    return Pattern(
        params, {"replicated": {"kernel": P(), "w2": P()}}, (x, y), apply, lambda out, p, x, y: _xent(out, y)
    )


def reshaped_bias() -> Pattern:
    """A bias reshaped to a row before it is added, as Flax NNX's ``Linear`` writes it
    (``jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))``): a view of a parameter's copy alone (JAX 0.10-0.11 reshape
    rule refuses an operand typed ``reduced``; CI once failed on it through ``examples/gspmd_lm.py``)."""
    rng = _rng(12)
    params = _mlp_params(rng, b1=rng.normal(size=(H,)) / 4)

    def apply(p, x, y):
        h = mm("bd,dh->bh", x, p["w1"], P("data", None)) + jnp.reshape(p["b1"], (1, -1))
        return mm("bh,hc->bc", jnp.tanh(h), p["w2"], P("data", None))

    bias = {"replicated": P(), "TP": P("model"), "FSDP": P()}
    return Pattern(params, _with(LAYOUTS_MLP, b1=bias.get), _classify(12), apply, lambda out, p, x, y: _xent(out, y))


def _unit(v):
    return v / jnp.sqrt(jnp.sum(v * v) + 1e-12)


def spectral_norm() -> Pattern:
    """Spectral normalisation (SN-GAN): the first weight divided by its largest singular value σ, estimated by power
    iteration in a ``lax.while_loop`` whose cond closes over a bound computed from the batch and whose body closes over
    the weight (its operands: the cond's consts, the body's, the carry), the iterates held fixed (``stop_gradient``),
    then ``σ = uᵀ W v`` differentiated. JAX cannot transpose a while loop: no gradient goes through it."""
    rng = _rng(11)
    params = _mlp_params(rng)

    def apply(p, x, y):
        w = p["w1"]
        limit = 3 + jnp.sum(y < 0)  # three iterations, a bound the loop's cond closes over

        def body(carry):
            u, i = carry
            v = _unit(mm("dh,d->h", w, u, P()))
            return _unit(mm("dh,h->d", w, v, P())), i + 1

        u, _ = jax.lax.while_loop(lambda c: c[1] < limit, body, (jnp.ones(D) / np.sqrt(D), 0))
        u = jax.lax.stop_gradient(u)
        v = jax.lax.stop_gradient(_unit(mm("dh,d->h", w, u, P())))
        sigma = mm("d,d->", u, mm("dh,h->d", w, v, P()), P())
        h = jnp.tanh(mm("bd,dh->bh", x, w, P("data", col_of(w))) / sigma)
        return mm("bh,hc->bc", h, p["w2"], P("data", None))

    return Pattern(params, LAYOUTS_MLP, _classify(11), apply, lambda out, p, x, y: _xent(out, y))


def fused_split() -> Pattern:
    """Fused weights split where they are used (LLaMA-style code): attention's ``w_qkv`` split into q, k and v
    (``jnp.split(w, 3, axis=-1)``), and a gated MLP's ``w_gate_up`` split into its gate and up halves."""
    rng = _rng(13)
    params = {
        "w_qkv": (rng.normal(size=(D, 3 * H)) / 3).astype(np.float32),
        "w_gate_up": (rng.normal(size=(D, 2 * H)) / 3).astype(np.float32),
        "w_out": (rng.normal(size=(H, C)) / 4).astype(np.float32),
    }
    layouts = {
        "replicated": {"w_qkv": P(), "w_gate_up": P(), "w_out": P()},
        "TP": {"w_qkv": P(None, "model"), "w_gate_up": P(None, "model"), "w_out": P()},
        "FSDP": {"w_qkv": P("data", None), "w_gate_up": P("data", None), "w_out": P("data", None)},
    }

    def apply(p, x, y):
        q, k, v = (put(w, P()) for w in jnp.split(p["w_qkv"], 3, axis=-1))
        gate, up = (put(w, P()) for w in jnp.split(p["w_gate_up"], 2, axis=-1))
        rows = lambda w: mm("bd,dh->bh", x, w, P("data", None))  # noqa: E731
        attn = jax.nn.sigmoid(jnp.sum(rows(q) * rows(k), axis=-1, keepdims=True)) * rows(v)
        h = attn + jax.nn.silu(rows(gate)) * rows(up)
        return mm("bh,hc->bc", h, p["w_out"], P("data", None))

    return Pattern(params, layouts, _classify(13), apply, lambda out, p, x, y: _xent(out, y))


def stacked_slices() -> Pattern:
    """Per-expert weights, separate parameters, stacked (``jnp.stack``) for one ``einsum`` over every expert, and the
    slices of one weight stacked the same way (``jnp.stack([w[:, :H], w[:, H:]])``)."""
    rng = _rng(14)
    params = {f"e{i}": (rng.normal(size=(D, H)) / 3).astype(np.float32) for i in range(E)}
    params["w"] = (rng.normal(size=(H, 2 * C)) / 4).astype(np.float32)
    layouts = {
        "replicated": {name: P() for name in params},
        "TP": {**{f"e{i}": P(None, "model") for i in range(E)}, "w": P()},
        "FSDP": {**{f"e{i}": P("data", None) for i in range(E)}, "w": P("data", None)},
    }

    def apply(p, x, y):
        experts = put(jnp.stack([p[f"e{i}"] for i in range(E)]), P())  # (E, D, H)
        h = jnp.mean(jnp.tanh(mm("bd,edh->beh", x, experts, P("data", None, None))), axis=1)
        w = put(p["w"], P())
        halves = jnp.stack([w[:, :C], w[:, C:]])  # (2, H, C)
        return jnp.sum(mm("bh,shc->bsc", h, halves, P("data", None, None)), axis=1)

    return Pattern(params, layouts, _classify(14), apply, lambda out, p, x, y: _xent(out, y))


def cholesky_layer() -> Pattern:
    """A Gaussian likelihood with a learned covariance ``Σ = A Aᵀ + D·I`` (Gaussian-process and normalising-flow
    layers): ``L = cholesky(Σ)``, each row whitened by a triangular solve (the rows in its right-hand side's columns),
    the negative log-likelihood ``½‖L⁻¹(x − μ)‖² + Σ log Lᵢᵢ`` averaged over the rows."""
    rng = _rng(15)
    params = {
        "a": (rng.normal(size=(D, D)) / 3).astype(np.float32),
        "mu": (rng.normal(size=(D,)) / 3).astype(np.float32),
    }
    layouts = {
        "replicated": {"a": P(), "mu": P()},
        "TP": {"a": P(None, "model"), "mu": P()},
        "FSDP": {"a": P("data", None), "mu": P()},
    }
    x = _rng(15).normal(size=(B, D)).astype(np.float32)

    def factor(p):
        a = put(p["a"], P())
        return jnp.linalg.cholesky(mm("ij,kj->ik", a, a, P()) + D * jnp.eye(D))

    def apply(p, x):
        centred = put((x - p["mu"]).T, P(None, "data"))  # (D, rows): each row a column of the right-hand side
        z = jax.scipy.linalg.solve_triangular(factor(p), centred, lower=True)
        return 0.5 * jnp.sum(z * z, axis=0)

    def head(quad, p, x):
        return jnp.mean(quad) + jnp.sum(jnp.log(jnp.diagonal(factor(p))))

    return Pattern(params, layouts, (x,), apply, head)


def _ragged_experts(x, experts, router, explicit: bool):
    """A sparse mixture of experts as MaxText writes it, top-1: each token routed to one expert, the tokens sorted by
    expert within their dispatch group (a data shard's rows), one grouped matmul (``lax.ragged_dot``) over the groups'
    experts, the outputs unsorted and scaled by the router's probability. ``explicit``: written for an Explicit mesh,
    ``out_sharding=`` where JAX asks (``lax.ragged_dot`` included)."""
    groups = 4 if on_mesh() else 1
    rows, per = x.shape[0], x.shape[0] // groups
    at = lambda spec: {"out_sharding": spec} if explicit else {}  # noqa: E731
    probs = jax.nn.softmax(jnp.einsum("bd,de->be", x, router, **at(P("data", None))))
    ids = jnp.argmax(probs, axis=-1)
    gate = jnp.max(probs, axis=-1)
    grouped = lambda a: a.reshape(groups, per, *a.shape[1:], **at(P("data")))  # noqa: E731
    flat = lambda a: a.reshape(rows, *a.shape[2:], **at(P("data")))  # noqa: E731
    order = jnp.argsort(grouped(ids), axis=1, stable=True)  # within each group: rows stay on their shard
    xs = flat(jnp.take_along_axis(grouped(x), order[..., None], axis=1))
    counts = jnp.sum(jax.nn.one_hot(grouped(ids), E, dtype=jnp.int32), axis=1).reshape(groups * E)
    table = jnp.tile(experts, (groups, 1, 1))  # group g's expert e is matrix g·E + e
    h = jax.lax.ragged_dot(xs, table, counts, **at(P("data", None)))
    back = jnp.argsort(order, axis=1)
    out = flat(jnp.take_along_axis(grouped(jnp.tanh(h)), back[..., None], axis=1))
    return out * gate[:, None]


def ragged_moe(explicit: bool = True) -> Pattern:
    """A top-1 sparse MoE through ``lax.ragged_dot`` (:func:`_ragged_experts`), its experts separate parameters
    stacked for it (``jnp.stack``; FSDP experts gathered first). ``explicit``: written for an Explicit mesh
    (``out_sharding=``), else for an Auto one (no annotation). On an Explicit mesh JAX 0.10-0.12 cannot differentiate
    ``ragged_dot`` itself (its transpose infers no sharding): the drop-in can, on each device's rows."""
    rng = _rng(16)
    params = {f"e{i}": (rng.normal(size=(D, H)) / 3).astype(np.float32) for i in range(E)}
    params["router"] = (rng.normal(size=(D, E)) / 3).astype(np.float32)
    params["head"] = (rng.normal(size=(H, C)) / 4).astype(np.float32)
    layouts = {
        "replicated": {name: P() for name in params},
        "TP": {**{name: P() for name in params}, **{f"e{i}": P(None, "model") for i in range(E)}},
        "FSDP": {**{name: P() for name in params}, **{f"e{i}": P("data", None) for i in range(E)}},
    }

    def apply(p, x, y):
        gathered = (lambda w: put(w, P(None, col_of(w)))) if explicit else (lambda w: w)  # FSDP: the Explicit way
        experts = jnp.stack([gathered(p[f"e{i}"]) for i in range(E)])
        h = _ragged_experts(x, experts, p["router"], explicit and on_mesh())
        return mm("bh,hc->bc", h, p["head"], P("data", None) if explicit else None)

    def head(out, p, x, y):
        return _xent(out, y)

    def copies(stack, x, y):  # each shard's rows through its own copy (JAX cannot vmap ragged_dot's group sizes)
        n = jax.tree.leaves(stack)[0].shape[0]
        rows = x.shape[0] // n
        outs = [apply({k: v[i] for k, v in stack.items()}, x[i * rows : (i + 1) * rows], None) for i in range(n)]
        return head(jnp.concatenate(outs), None, x, y)

    return Pattern(params, layouts, _classify(16), apply, head, copies=copies)
