"""``benchmarks.hlo``'s byte accounting of compiled HLO, against sizes derived by hand."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from benchmarks import hlo as _hlo


@pytest.mark.parametrize(
    ("type_str", "expected"),
    [
        ("f32[256,4]{1,0}", 256 * 4 * 4),
        ("(f32[2,3]{1,0}, bf16[4]{0}, s32[])", 2 * 3 * 4 + 4 * 2 + 4),
        ("pred[7]", 7),
        ("token[]", 0),
    ],
)
def test_type_bytes_sums_every_array_of_the_type(type_str, expected):
    assert _hlo.type_bytes(type_str) == expected


def test_instruction_bytes_of_an_add_reads_both_operands_and_writes_the_result():
    x = jnp.ones((256, 4), jnp.float32)
    rows = _hlo.instruction_bytes(_hlo.compiled_text(lambda a, b: a + b, x, x))
    assert len(rows) == 1  # parameters do no work
    (row,) = rows
    assert row["bytes_read"] == 2 * x.size * 4 and row["bytes_written"] == x.size * 4
    assert row["bytes"] == 3 * x.size * 4
    assert "add" in row["op_name"]


def test_instruction_bytes_reads_bf16_at_two_bytes_and_writes_the_f32_cast():
    x = jnp.ones((128, 8), jnp.bfloat16)
    (row,) = _hlo.instruction_bytes(_hlo.compiled_text(lambda a: a.astype(jnp.float32) * 3.0, x))
    assert row["bytes_read"] == x.size * 2 and row["bytes_written"] == x.size * 4


def test_instruction_bytes_carries_named_scopes_and_skips_the_ops_asked():
    def fn(x):
        with jax.named_scope("adascale/outer"):
            y = x * x.sum()
        trips = (x[0, 0] * 3).astype(jnp.int32)  # a trip count XLA cannot see, so it cannot unroll the loop
        return lax.fori_loop(0, trips, lambda i, v: jnp.sin(v), y)

    text = _hlo.compiled_text(fn, jnp.ones((64, 64), jnp.float32))
    rows = _hlo.instruction_bytes(text)
    assert any("adascale/outer" in r["op_name"] for r in rows)
    # the loop: a `while` in the entry, or (XLA:CPU of JAX 0.12) a `call` of the computation that holds it
    (loop,) = {r["op"] for r in rows if r["op_name"].endswith("/while")}
    assert loop in ("while", "call")
    kept = _hlo.instruction_bytes(text, skip=(loop,))
    assert [r for r in rows if r["op"] != loop] == kept and len(kept) < len(rows)
