"""The interpreter's one dispatch table: every primitive it knows, by class.

A class says what the interpreter does with an equation of that primitive (``_interpreter.RULES``) and, for the
array primitives, when a parameter's copy meeting the rows stays local to them (``_rows``). A primitive's class is
looked up here, never found by trying JAX and catching its error. An equation of a primitive missing here is bound
as traced while no parameter's copy flows through it (nothing then depends on the class); with one, it is refused
with our error: for a primitive refused on purpose (:data:`REFUSED`) the reason and the way out, else its name and
the nearest class. ``tests/gspmd/test_table.py`` checks every name against each CI JAX and that the losses of the
test zoo bind no primitive missing here; ``tests/gspmd/test_sweep.py`` that every primitive the differentiable
public functions of ``jax.numpy`` (``linalg``, ``fft``), ``jax.nn`` and ``jax.lax`` (``linalg``) bind, forward and
backward, is here or refused.
"""

from __future__ import annotations

import difflib
import enum


class Kind(enum.Enum):
    """The classes of primitive. Array classes first: how a parameter's copy (``reduced``) goes through them."""

    VIEW = "the same elements moved or cast (reshape, transpose, casts): JAX's types carry a copy through it"
    BROADCAST = "broadcast_in_dim: JAX's types carry a copy through it"
    SUM = "a sum along some dimensions: JAX's types carry a copy through it; over the rows, a contraction"
    ELEMENTWISE = "elementwise: with the rows, each shard's copy put along them; of the copies alone, per copy"
    CONTRACTION = (
        "a contraction: with the rows JAX's own rule (their sum is the partial); of the copies alone, per copy"
    )
    REDUCTION = "a reduction along some dimensions: per copy"
    ALONG = (
        "an operation along some dimensions (cumulative, sort, top_k, rev, concatenate, split, stack, fft): per copy"
    )
    WINDOW = "a convolution or window: per copy, local to the rows along its batch dimension"
    INDEXING = "a gather, scatter, slice, pad or tile: per copy"
    LINALG = (
        "a matrix decomposition or solve (cholesky, triangular_solve, eigh, qr, svd, lu): per copy; with the rows, "
        "only a triangular solve whose right-hand side holds them in its independent columns"
    )
    GROUPED = (
        "a grouped contraction (ragged_dot_general: the lhs's rows in groups, one matrix of the rhs each): per copy; "
        "with the rows, on each device's rows with its own groups' sizes"
    )
    OPAQUE = "no gradient reaches a parameter through it, or it runs inside a shard_map's body: bound as traced"
    # the interpreter's structural rules
    GATHER = "reshard: an FSDP gather returns a probed copy; a copy stays a copy"
    HINT = "a sharding hint: on a converted Auto mesh it loses the converted axes"
    CALL = "a call: inlined"
    REMAT = "jax.checkpoint: re-made around the re-evaluated body"
    SCAN = "lax.scan: re-made around the re-evaluated body"
    WHILE = "lax.while_loop: re-made around the re-evaluated cond and body"
    COND = "lax.cond/switch: branches re-evaluated, agreeing on copies"
    SHARD_MAP = "shard_map: manual over the data axes, a copy per device"
    CUSTOM = "custom_jvp/custom_vjp: its rule re-evaluated; on a copy, its backward pass per copy"
    CAST = "pvary: the identity on a copy already varying"


# The array classes: their rule is the interpreter's ``array``, by class; the others have a structural rule each.
ARRAY = frozenset(
    {
        Kind.VIEW,
        Kind.BROADCAST,
        Kind.SUM,
        Kind.ELEMENTWISE,
        Kind.CONTRACTION,
        Kind.REDUCTION,
        Kind.ALONG,
        Kind.WINDOW,
        Kind.INDEXING,
        Kind.LINALG,
        Kind.GROUPED,
    }
)

_NAMES = {
    Kind.VIEW: "reshape squeeze transpose convert_element_type copy",
    Kind.BROADCAST: "broadcast_in_dim",
    Kind.SUM: "reduce_sum",
    Kind.ELEMENTWISE: (
        "abs acos acospi acosh add add_any and asin asinpi asinh atan atan2 atan2pi atanpi atanh bessel_i0e "
        "bessel_i1e bitcast_convert_type cbrt ceil clamp clz complex conj cos cospi cosh digamma div eq erf erf_inv "
        "erfc exp exp2 exp2m1 expm1 floor fma fmuladd ge gt igamma igamma_grad_a igammac imag integer_pow is_finite "
        "le le_to lgamma log log1p log2 log2p1 logistic lt lt_to max min mul ne neg nextafter not one_minus_square or "
        "polygamma polynomial population_count pow real reduce_precision regularized_incomplete_beta rem round rsqrt "
        "select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinpi sinh sqrt square sub tan "
        "tanpi tanh xor zeta"
    ),
    Kind.CONTRACTION: "dot_general",
    Kind.REDUCTION: "reduce reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin",
    Kind.ALONG: (
        "cumsum cumprod cummax cummin cumlogsumexp sort top_k approx_top_k rev concatenate split stack unstack fft"
    ),
    Kind.WINDOW: "conv_general_dilated reduce_window_sum reduce_window_max reduce_window_min",
    Kind.INDEXING: "gather scatter scatter-add scatter-sub scatter-mul scatter-min scatter-max slice dynamic_slice "
    "dynamic_update_slice pad tile",
    Kind.LINALG: (
        "cholesky cholesky_update eig eigh geqp3 geqrf hessenberg householder_product lu ormqr qr schur svd "
        "symmetric_product triangular_solve tridiagonal tridiagonal_solve custom_linear_solve"
    ),
    Kind.GROUPED: "ragged_dot_general",
    Kind.OPAQUE: (
        "stop_gradient iota empty empty2 create_token dce_sink lu_pivots_to_permutation random_bits random_seed "
        "random_wrap random_unwrap random_fold_in random_split "
        "threefry2x32 rng_bit_generator platform_index device_put optimization_barrier name psum psum_invariant "
        "pmax pmin ppermute all_gather all_to_all reduce_scatter axis_index"
    ),
    Kind.GATHER: "reshard",
    Kind.HINT: "sharding_constraint",
    Kind.CALL: "jit closed_call eval_jaxpr",
    Kind.REMAT: "remat2",
    Kind.SCAN: "scan",
    Kind.WHILE: "while",
    Kind.COND: "cond",
    Kind.SHARD_MAP: "shard_map",
    Kind.CUSTOM: "custom_jvp_call custom_vjp_call",
    Kind.CAST: "pvary",
}

TABLE: dict[str, Kind] = {name: kind for kind, names in _NAMES.items() for name in names.split()}

# Names some supported JAX versions lack: (first version with it, first version without it), None for open ends.
# The test of the table checks both ends against each CI JAX.
ONLY_ON: dict[str, tuple[str | None, str | None]] = {
    "closed_call": (None, "0.11"),
    "log2": ("0.11", None),
    "one_minus_square": ("0.11", None),  # what tanh's derivative binds from 0.11
    "polynomial": ("0.12", None),  # erf's series from 0.12
    # JAX 0.12.1's new elementwise functions (jax.lax.*pi, exp2m1, log2p1; fma and fmuladd: a·b + c, one rounding
    # or the compiler's choice): element i of the output reads element i of each operand.
    **dict.fromkeys(
        "acospi asinpi atan2pi atanpi cospi exp2m1 fma fmuladd log2p1 sinpi tanpi".split(), ("0.12.1", None)
    ),  # noqa: E501
}


# JAX releases that changed a rule of a primitive this table knows (not its name), and what the drop-in does about it.
# Each fact is read through ``_compat`` (one function) and shown on both sides of its gate in plain JAX by a test.
#
# * JAX 0.12.1, ``gather``/``scatter-add`` and the cast into Auto axes (``reshard`` to an Auto mesh, the entry of
#   ``jax.sharding.auto_axes``): the gather's transpose now scatters with ``out_sharding=`` the operand's sharding
#   (replicated, on Auto axes), and the transpose of the cast turns that Auto value into ``unreduced`` by keeping it
#   on one device and zeros elsewhere (``_compat.auto_cast_keeps_partials``). The gradient is unchanged; every
#   per-device partial of a parameter's copy that passed through Auto axes is wrong. The Auto mesh's embedding lookup
#   (``_auto.gather_indexed``) therefore runs GSPMD's lookup forward and the gather's own VJP per data shard backward
#   (``_local``), on every JAX; a copy cast into ``auto_axes`` on an Explicit mesh is refused from 0.12.1
#   (``_local.copy_on_auto_axes``; exact before). ``gspmd/_selfcheck.py`` probes these rules at run time.
# * JAX 0.12.1, ``ragged_dot_general``: its transpose of a copy on Auto axes gives the right gradient (it did not on
#   0.10-0.12.0, where ``_local.grouped_on_auto_axes`` refuses it); from 0.12.1 the cast's rule above refuses it.
# * JAX 0.12.1, ``jax.lax``: eleven new elementwise functions (``ONLY_ON`` above).

# Primitives a public JAX function binds that the drop-in refuses on a parameter's copy: the reason and the way out.
# ``tests/gspmd/test_sweep.py`` checks that every primitive the public differentiable functions bind is in TABLE or
# here, and never in both.
REFUSED: dict[str, str] = {
    "scaled_dot": (
        "lax.scaled_dot (a block-scaled low-precision matmul) has no derivative rule in JAX, so jax.value_and_grad "
        "of a loss applying it to a parameter fails as well. Apply it to values that are not parameters (or "
        "quantize the parameter in a jax.custom_vjp with a straight-through backward pass, as AQT does)"
    ),
    "call_hi_primitive": (
        "JAX 0.12 binds jnp.searchsorted and jnp.digitize as a hijax primitive whose rule the table cannot see; "
        "they return indices, through which no gradient reaches a parameter. Compute those indices from a value "
        "that is not a parameter (the bins outside the loss, passed in as an argument), or from the batch alone"
    ),
}


def kind_of(name: str) -> Kind | None:
    """The class of the primitive named ``name``, or ``None`` if the table does not know it."""
    return TABLE.get(name)


def unknown(name: str, carries_jaxprs: bool) -> str:
    """Our error for a primitive the table does not know, applied to a parameter's copy: for one it refuses
    (:data:`REFUSED`), the reason and the way out; else its name and the nearest class (a call's, for a primitive
    that carries jaxprs; else that of the most similar name)."""
    if name in REFUSED:
        return f"value_and_grad(data_axes=...): loss_fn applies the primitive '{name}' to a parameter: {REFUSED[name]}."
    if carries_jaxprs:
        nearest = Kind.CALL
    else:
        close = difflib.get_close_matches(name, list(TABLE), n=1, cutoff=0.0)
        nearest = TABLE[close[0]] if close else Kind.ELEMENTWISE
    return (
        f"value_and_grad(data_axes=...): loss_fn applies the primitive '{name}' to a parameter, and optax_adascale's "
        f"table of primitives (optax_adascale/gspmd/_table.py) does not know it, so it cannot say how the per-copy "
        f"statistics go through it. The nearest class is {nearest.name} ({nearest.value}). Please report it with "
        "your JAX version; until then, apply that operation to values that are not parameters."
    )
