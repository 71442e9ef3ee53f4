"""The MaxText helper (``integrations/maxtext/adascale_maxtext.py``) without MaxText: what it does to MaxText's loss
under each of MaxText's accumulations, and that a patched step left off says so (issue 40 item 6).

MaxText itself (Python 3.12, JAX ≥ 0.11) runs in ``integrations/maxtext`` (``run.sh``, ``cases.py``); these tests
hold the helper to the arithmetic of MaxText 0.2.5's ``gradient_accumulation_loss_and_grad`` on a stand-in loss with
MaxText's signature, so they run on every CI JAX.
"""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_adascale
from integrations.maxtext import adascale_maxtext

K, ROWS, LENGTH, DIM = 2, 16, 8, 4


def maxtext_loss(tunix, k):
    """MaxText 0.2.5's ``loss_fn`` through ``diff_wrapper``: ``(loss, (aux, rest))``; the loss is the micro-batch's
    ``xent_sum`` under its manual accumulation (``k > 1``), else (``k = 1``, or tunix) ``xent_sum / W``."""

    def diff_wrapper(params, rest, config, data):
        pred = data["inputs"] @ params["w"]
        weights = (data["targets_segmentation"] != 0).astype(jnp.float32)
        xent_sum = jnp.sum(weights * (pred - data["targets"]) ** 2)
        total_weights = jnp.sum(weights)
        loss = xent_sum if (k > 1 and not tunix) else xent_sum / (total_weights + 1e-8)
        return loss, ({"xent_sum": xent_sum, "total_weights": total_weights.astype(jnp.int32)}, rest)

    return diff_wrapper


def batch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, LENGTH + 1, size=ROWS)  # unequal real tokens per row (padding after them)
    seg = (np.arange(LENGTH)[None, :] < lengths[:, None]).astype(np.int32)
    return {
        "inputs": rng.normal(size=(ROWS, LENGTH, DIM)).astype(np.float32),
        "targets": rng.normal(size=(ROWS, LENGTH)).astype(np.float32),
        "targets_segmentation": seg,
    }


def maxtext_gradient(diff_wrapper, params, data, tunix):
    """MaxText's own accumulation (``gradient_accumulation_loss_and_grad``): micro-batch ``j`` is rows ``j, j + k, …``;
    the summed gradient divided by ``k`` (tunix) or by the global batch's real tokens ``W``."""
    grad = jax.grad(lambda p, d: diff_wrapper(p, None, None, d)[0])
    parts = [jax.tree.map(lambda x, j=j: x[j::K], data) for j in range(K)]
    total = sum(grad(params, part)["w"] for part in parts)
    divisor = K if tunix else np.sum(data["targets_segmentation"] != 0)
    return total / divisor


@pytest.mark.parametrize("tunix", [False, True], ids=["MaxText's accumulation", "use_tunix_gradient_accumulation"])
def test_per_token_gives_maxtexts_gradient_and_logged_sum_under_each_accumulation(tunix):
    """Under tunix MaxText's loss is already a per-micro-batch mean: the helper weighted it by k / W all the same, so
    gradient and logged loss came out k / W too small (0.0057 against lm_loss 5.83 in MaxText, k / W = 2 / 2048)."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    config = types.SimpleNamespace(gradient_accumulation_steps=K, use_tunix_gradient_accumulation=tunix)
    diff_wrapper = maxtext_loss(tunix, K)
    params = {"w": np.linspace(-1, 1, DIM).astype(np.float32)}
    data = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in batch().items()}

    @jax.jit
    def step(params, data):
        loss = adascale_maxtext.per_token(diff_wrapper, config, data)
        fn = optax_adascale.value_and_grad(loss, data_axes="data", num_microbatches=K, has_aux=True, state_argnum=1)
        (value, (aux, _)), grads, _ = fn(params, None, config, data)
        return value, aux, grads

    with jax.set_mesh(mesh):
        value, aux, grads = step(params, data)
    host = batch()
    # The drop-in's micro-batch j is the j-th block of every shard's rows, MaxText's rows j, j + k, …: the same
    # gradient where each micro-batch's weight does not depend on its rows (manual: 1 / W), the grouping's own
    # otherwise (tunix: 1 / (k W_j)); the drop-in's grouping, reordered as MaxText's, gives the truth for both.
    order = np.arange(ROWS).reshape(4, K, ROWS // (4 * K)).transpose(1, 0, 2).reshape(K, -1).T.ravel()
    regrouped = jax.tree.map(lambda x: x[order], host)
    np.testing.assert_allclose(grads["w"], maxtext_gradient(diff_wrapper, params, regrouped, tunix), rtol=1e-5)
    total = float(jnp.sum(host["targets_segmentation"] != 0))
    xent = float(maxtext_loss(False, 1)(params, None, config, host)[1][0]["xent_sum"])
    np.testing.assert_allclose(aux["xent_sum"], xent, rtol=1e-5)  # the logged sum: lm_loss = xent_sum / W
    assert int(aux["total_weights"]) == total
    if not tunix:
        np.testing.assert_allclose(value, xent / total, rtol=1e-5)  # learning/loss = lm_loss
    else:  # the mean of the micro-batches' own means, what tunix's gradient is of (lm_loss where they are equal)
        parts = [jax.tree.map(lambda x, j=j: x[j::K], regrouped) for j in range(K)]
        means = [float(diff_wrapper(params, None, config, part)[0]) for part in parts]
        np.testing.assert_allclose(value, np.mean(means), rtol=1e-5)


def test_a_patched_step_without_use_adascale_says_it_is_maxtexts_own(monkeypatch):
    """Without ``use_adascale()`` the patched step silently stayed MaxText's: now the step's trace warns, once."""
    monkeypatch.setattr(adascale_maxtext, "ON", False)
    monkeypatch.setattr(adascale_maxtext, "_said_off", False)
    with pytest.warns(UserWarning, match=r"use_adascale\(\) was not called.*MaxText's own step.*train.main"):
        assert adascale_maxtext.extra([]) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adascale_maxtext.extra([])  # said once
    monkeypatch.setattr(adascale_maxtext, "ON", True)
    monkeypatch.setattr(adascale_maxtext, "_said_off", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adascale_maxtext.extra([]) == {}
