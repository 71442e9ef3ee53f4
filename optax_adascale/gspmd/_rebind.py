"""An equation of the loss bound again, to the interpreter's values (``_compat.bind``: its parameters, context and name
stack as traced). A loss traced on an Auto mesh and run on the Explicit one (:attr:`Layout.convert`) is bound under
the Explicit context instead of its own, without the shardings that name the Auto mesh."""

from __future__ import annotations

from typing import Any

import jax

from optax_adascale import _compat
from optax_adascale.gspmd._layout import Layout
from optax_adascale.gspmd._mesh import auto_axes


def auto_sharding(v: Any) -> bool:
    """A sharding parameter naming a mesh with Auto axes (a loss traced on such a mesh): dropped when re-bound."""
    mesh = getattr(v, "mesh", None)
    return isinstance(v, jax.sharding.NamedSharding) and mesh is not None and bool(auto_axes(mesh))


def rebind(layout: Layout, eqn: Any, invals: list[Any], params: dict[str, Any] | None = None) -> Any:
    """``eqn`` bound to ``invals`` as traced (``params`` in place of its own where given)."""
    if layout.convert:
        return _compat.bind(eqn, invals, params, context=False, drop=auto_sharding)
    return _compat.bind(eqn, invals, params)
