"""Whether an equation where a parameter's copy meets the batch's rows is local to them, by class of primitive.

The per-copy rule (``_local``) runs such an equation's VJP on each data shard's rows alone. That is the equation's
own VJP only where no output row reads another shard's rows. :func:`mixes` answers for one equation from its class
(``_table``) and the dimensions of each operand that index rows; it names what mixes them, or gives ``None``. Only
equations with two operands or more get here (a copy and the rows); a class without a rule is taken to mix them.
"""

from __future__ import annotations

from optax_adascale import _compat
from optax_adascale.gspmd._table import Kind


def mixes(kind: Kind, eqn, rows: list[frozenset[int]]) -> str | None:
    """What in ``eqn`` (of class ``kind``) mixes the rows, or ``None``. ``rows[i]``: the dimensions of operand ``i``
    that index rows of the batch."""
    name = _compat.primitive_name(eqn)
    every = frozenset().union(*rows)
    if kind is Kind.ELEMENTWISE:  # element i reads element i of each (broadcast) operand
        return None
    if kind is Kind.ALONG and name == "stack":  # a copy stacked with the rows has their size: not per shard
        return f"{name} of a parameter's copy with the rows" if every else None
    if kind is Kind.ALONG:  # concatenate, a multi-operand sort
        rank = len(getattr(_compat.traced_type(_compat.inputs(eqn)[0]), "shape", ()))
        return f"{name} along the rows" if set(_compat.along_dims(eqn, rank)) & every else None
    if kind is Kind.WINDOW and name == "conv_general_dilated":
        lhs_batch, _, groups = _compat.conv_batch(eqn)
        if rows[1] or rows[0] - {lhs_batch}:
            return f"{name} over the rows"
        return f"{name} grouping the rows" if groups != 1 else None
    if kind is Kind.INDEXING and name == "gather":  # rows in the indices are rows of the output; in the operand not
        return "gather from the rows" if rows[0] else None
    if kind is Kind.INDEXING and name == "pad":  # the operand's rows, padded with a copy along other dimensions
        return f"{name} along the rows" if set(_compat.padded_dims(eqn)) & rows[0] else None
    if kind is Kind.LINALG and name == "triangular_solve":  # a x = b: each column of b its own solve (x a = b: row)
        rank = len(getattr(_compat.traced_type(_compat.inputs(eqn)[1]), "shape", ()))
        free = rank - 1 if _compat.solves_left(eqn) else rank - 2
        across = rows[0] or rows[1] - {free}
        return f"{name} with the rows in its matrix or across its right-hand side" if across else None
    return f"{name} applied to the rows"
