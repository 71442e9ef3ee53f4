"""The models the accelerator suite times: a GPT-like decoder and a ResNet-18-like CNN in plain JAX, and the
same decoder in torch for the FairScale peer. JAX and torch come in as arguments (imported lazily by the cases).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def lm_init(jax, jnp, cfg: dict, seed: int = 0) -> dict:
    d, L, V, T = cfg["d_model"], cfg["layers"], cfg["vocab"], cfg["seq"]
    rng = np.random.default_rng(seed)  # numpy: no per-shape compilation of jax.random ops
    normal = lambda shape, std: rng.standard_normal(shape, np.float32) * np.float32(std)  # noqa: E731
    resid = 0.02 / math.sqrt(2 * L)
    params = {
        "wte": normal((V, d), 0.02),
        "wpe": normal((T, d), 0.01),
        "blocks": {
            "ln1_g": jnp.ones((L, d)),
            "ln1_b": jnp.zeros((L, d)),
            "w_qkv": normal((L, d, 3 * d), 0.02),
            "b_qkv": jnp.zeros((L, 3 * d)),
            "w_o": normal((L, d, d), resid),
            "b_o": jnp.zeros((L, d)),
            "ln2_g": jnp.ones((L, d)),
            "ln2_b": jnp.zeros((L, d)),
            "w_fc": normal((L, d, 4 * d), 0.02),
            "b_fc": jnp.zeros((L, 4 * d)),
            "w_proj": normal((L, 4 * d, d), resid),
            "b_proj": jnp.zeros((L, d)),
        },
        "ln_f_g": jnp.ones((d,)),
        "ln_f_b": jnp.zeros((d,)),
    }
    return jax.tree.map(jnp.asarray, params)


def make_lm_loss(jax, jnp, cfg: dict, remat: bool) -> Callable:
    """Mean next-token cross-entropy of a pre-LN GPT (tied embeddings), bf16 compute, f32 statistics."""
    import optax

    H = cfg["heads"]
    bf16 = jnp.bfloat16

    def layer_norm(x, g, b):
        x32 = x.astype(jnp.float32)
        mu = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
        return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(bf16)

    def block(x, p):
        B, T, D = x.shape
        h = layer_norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = jnp.split(h @ p["w_qkv"] + p["b_qkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, T, H, D // H) for t in (q, k, v))
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, D)
        x = x + att @ p["w_o"] + p["b_o"]
        h = layer_norm(x, p["ln2_g"], p["ln2_b"])
        x = x + jax.nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]
        return x, None

    body = jax.checkpoint(block) if remat else block

    def loss_fn(params, tokens, targets):
        p = jax.tree.map(lambda a: a.astype(bf16), params)
        x = p["wte"][tokens] + p["wpe"][: tokens.shape[-1]]
        x, _ = jax.lax.scan(body, x, p["blocks"])
        x = layer_norm(x, params["ln_f_g"], params["ln_f_b"])
        logits = (x @ p["wte"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


def cnn_init(jax, jnp, cfg: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def conv(k, cin, cout):
        w = rng.standard_normal((k, k, cin, cout), np.float32) * np.float32(math.sqrt(2.0 / (k * k * cin)))
        return {"w": jnp.asarray(w), "g": jnp.ones((cout,)), "b": jnp.zeros((cout,))}

    widths = cfg["widths"]
    params = {"stem": conv(3, 3, widths[0]), "stages": []}
    cin = widths[0]
    for i, w in enumerate(widths):
        stage = []
        for j in range(cfg["blocks"]):
            blk = {"c1": conv(3, cin, w), "c2": conv(3, w, w)}
            if j == 0 and (i > 0 or cin != w):
                blk["sc"] = conv(1, cin, w)  # a projection shortcut: this block downsamples
            stage.append(blk)
            cin = w
        params["stages"].append(stage)
    head = rng.standard_normal((cin, cfg["classes"]), np.float32) / np.float32(math.sqrt(cin))
    params["head"] = {"w": jnp.asarray(head), "b": jnp.zeros((cfg["classes"],))}
    return params


def make_cnn_loss(jax, jnp, compute_dtype=None) -> Callable:
    """ResNet-18-like (BasicBlocks), NHWC, bf16 convolutions (or ``compute_dtype``'s), batch-statistics
    normalisation in f32."""
    import optax

    dtype = jnp.bfloat16 if compute_dtype is None else compute_dtype

    def conv_bn(x, p, stride, relu=True):
        y = jax.lax.conv_general_dilated(
            x, p["w"].astype(dtype), (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        y32 = y.astype(jnp.float32)
        mu = jnp.mean(y32, (0, 1, 2))
        var = jnp.mean(jnp.square(y32 - mu), (0, 1, 2))
        y32 = (y32 - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
        return (jax.nn.relu(y32) if relu else y32).astype(dtype)

    def loss_fn(params, x, y):
        h = conv_bn(x.astype(dtype), params["stem"], 1)
        for stage in params["stages"]:
            for blk in stage:
                stride = 2 if "sc" in blk else 1
                out = conv_bn(conv_bn(h, blk["c1"], stride), blk["c2"], 1, relu=False)
                short = conv_bn(h, blk["sc"], stride, relu=False) if "sc" in blk else h
                h = jax.nn.relu(out + short)
        feat = jnp.mean(h.astype(jnp.float32), (1, 2))
        logits = feat @ params["head"]["w"] + params["head"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def TorchGPT(torch, cfg: dict):  # noqa: N802 - a class factory: torch is imported lazily
    nn, F = torch.nn, torch.nn.functional
    d, H, T = cfg["d_model"], cfg["heads"], cfg["seq"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, S, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.view(B, S, H, d // H).transpose(1, 2) for t in (q, k, v))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, d)
            x = x + self.o(att)
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg["vocab"], d)
            self.wpe = nn.Parameter(torch.randn(T, d) * 0.01)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln_f = nn.LayerNorm(d)
            nn.init.normal_(self.wte.weight, std=0.02)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe[: idx.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.ln_f(x) @ self.wte.weight.T  # tied head

    return GPT()
