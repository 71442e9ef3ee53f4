"""How the drop-in calls the user's function: ``jax.value_and_grad``'s ``argnums``, state threaded, static arguments.

Trainers call ``jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, custom, rest, config, data)``: several
differentiated arguments, a Python object among the others (MaxText's ``config``), and state the function
advances and returns in its aux (NNX's ``rest``: RNG counters). :class:`Call` turns such a call into the one the
drop-in's machinery takes, ``inner(params, state, *arrays)``: ``params`` the differentiated arguments (one, or a
tuple for a tuple ``argnums``, as ``jax.value_and_grad`` returns their gradients), ``state`` the argument named by
``state_argnum`` (``None`` without), ``arrays`` every array leaf of the other arguments; the non-array leaves are
passed to the function as they are (closed over), as ``jax.value_and_grad`` passes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from optax_adascale.gspmd._specs import broadcast_prefix


def is_array(x: Any) -> bool:
    """An array leaf (traced or not); anything else in an argument is passed to the function as it is."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class Call:
    """``argnums`` and ``state_argnum`` checked, and how a call's arguments map to the inner function's."""

    argnums: tuple[int, ...]
    single: bool
    state_argnum: int | None

    @classmethod
    def of(cls, argnums: Any, state_argnum: Any, has_aux: bool) -> Call:
        single = isinstance(argnums, int) and not isinstance(argnums, bool)
        nums = (argnums,) if single else tuple(argnums) if isinstance(argnums, (tuple, list)) else None
        if not nums or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
            raise TypeError(
                f"argnums must be a non-negative int or a tuple of them, as jax.value_and_grad takes it, got "
                f"argnums={argnums!r}"
            )
        if len(set(nums)) != len(nums):
            raise ValueError(f"argnums names an argument twice: argnums={argnums!r}")
        if state_argnum is not None:
            if not isinstance(state_argnum, int) or isinstance(state_argnum, bool) or state_argnum < 0:
                raise TypeError(f"state_argnum must be a non-negative int or None, got state_argnum={state_argnum!r}")
            if state_argnum in nums:
                raise ValueError(
                    f"state_argnum={state_argnum} is also in argnums={argnums!r}: the state the function advances "
                    "is not differentiated."
                )
            if not has_aux:
                raise ValueError(
                    f"state_argnum={state_argnum} needs has_aux=True: the function returns (value, (aux, new_state)), "
                    "new_state shaped like argument state_argnum."
                )
        return cls(nums, single, state_argnum)

    def unpack(self, loss_fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], Any, Any, list]:
        """``(inner, params, state, arrays)`` for this call: ``inner(params, state, *arrays)`` calls ``loss_fn`` with
        the arguments rebuilt."""
        for i in (*self.argnums, *(() if self.state_argnum is None else (self.state_argnum,))):
            if i >= len(args):
                raise ValueError(
                    f"argnums/state_argnum name argument {i}, but the function was called with {len(args)} positional "
                    "arguments."
                )
        params = args[self.argnums[0]] if self.single else tuple(args[i] for i in self.argnums)
        state = None if self.state_argnum is None else args[self.state_argnum]
        skip = {*self.argnums, self.state_argnum}
        others = tuple(a for i, a in enumerate(args) if i not in skip)
        leaves, tree = jax.tree.flatten(others)
        where = [i for i, x in enumerate(leaves) if is_array(x)]
        arrays = [leaves[i] for i in where]
        positions = [i for i in range(len(args)) if i not in skip]

        def inner(params, state, *arrays):
            full = list(leaves)
            for i, x in zip(where, arrays, strict=True):
                full[i] = x
            call = [None] * len(args)
            for i, a in zip(positions, tree.unflatten(full), strict=True):
                call[i] = a
            if self.single:
                call[self.argnums[0]] = params
            else:
                for i, p in zip(self.argnums, params, strict=True):
                    call[i] = p
            if self.state_argnum is not None:
                call[self.state_argnum] = state
            return loss_fn(*call)

        return inner, params, state, arrays

    def array_names(self, loss_fn: Callable[..., Any], args: tuple[Any, ...]) -> list[str]:
        """A name for each of :meth:`unpack`'s ``arrays``, for messages: the parameter's name in ``loss_fn``'s
        signature where it has one (else ``argument i``), and the key path inside the argument."""
        try:
            import inspect

            names = [p.name for p in inspect.signature(loss_fn).parameters.values()]
        except (TypeError, ValueError):
            names = []
        out = []
        for i, a in enumerate(args):
            if i in (*self.argnums, self.state_argnum):
                continue
            base = names[i] if i < len(names) and not names[i].startswith("*") else f"argument {i}"
            for path, leaf in jax.tree_util.tree_leaves_with_path(a):
                if is_array(leaf):
                    out.append(base + jax.tree_util.keystr(path))
        return out

    def arg_specs(self, given: Any, args: tuple[Any, ...]) -> tuple[Any, list] | None:
        """``arg_specs`` as ``(the state's, one per array leaf of the other arguments)``; ``None`` if not given.

        ``arg_specs``: one entry per argument that is not differentiated, in order (a ``PartitionSpec`` or a
        pytree prefix of that argument), or one ``PartitionSpec`` for all of them, as ``shard_map``'s
        ``in_specs``."""
        if given is None:
            return None
        positions = [i for i in range(len(args)) if i not in self.argnums]
        if _is_spec(given):
            given = (given,) * len(positions)
        if not isinstance(given, (tuple, list)) or len(given) != len(positions):
            raise ValueError(
                f"arg_specs must give one entry per argument that is not differentiated ({len(positions)} here: "
                f"positions {positions}), or one PartitionSpec for all of them, got arg_specs={given!r}"
            )
        state_spec, array_specs = None, []
        for i, prefix in zip(positions, given, strict=True):
            if i == self.state_argnum:
                state_spec = prefix
                continue
            specs = broadcast(prefix, args[i])
            array_specs += [spec for spec, x in zip(specs, jax.tree.leaves(args[i]), strict=True) if is_array(x)]
        return state_spec, array_specs


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, (jax.sharding.PartitionSpec, jax.sharding.NamedSharding))


def broadcast(prefix: Any, tree: Any) -> list[Any]:
    """One entry of ``prefix`` (a pytree prefix of ``tree`` with specs at its leaves) per leaf of ``tree``."""
    try:
        return broadcast_prefix(prefix, tree, _is_spec)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"arg_specs: {prefix!r} is not a pytree prefix of an argument structured {jax.tree.structure(tree)}."
        ) from err
