"""Facts read off compiled HLO text, shared by the tests and the benchmarks.

Not public API. The parser understands just enough of XLA's text format to
tell which computations run unconditionally (reachable from ``ENTRY`` without
entering a ``conditional`` branch) and to count collectives and host callbacks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(
    r"(to_apply|calls|body|condition|branch_computations|true_computation|false_computation)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)
_BRANCH_KEYS = {"branch_computations", "true_computation", "false_computation"}
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def compiled_text(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Optimized HLO of ``jax.jit(fn)`` (or an already jitted/pmapped ``fn``) for these arguments."""
    lowered = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args, **kwargs)
    return lowered.compile().as_text()


def _split(text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in text.splitlines():
        m = _COMPUTATION.match(line.strip()) if current is None else None
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps, entry


def _op_count(lines: list[str], op: str) -> int:
    pattern = re.compile(r"\s" + re.escape(op) + r"(?:-start)?\(")
    return sum(len(pattern.findall(line)) for line in lines)


def count(text: str, op: str) -> int:
    """Instructions of kind ``op`` (``all-reduce`` also counts ``all-reduce-start``) anywhere in the module."""
    comps, _ = _split(text)
    return sum(_op_count(lines, op) for lines in comps.values())


def count_unconditional(text: str, op: str) -> int:
    """Instructions of kind ``op`` that run on every call: outside any ``conditional`` branch."""
    comps, entry = _split(text)
    seen, stack = set(), [entry]
    while stack:
        name = stack.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for key, target in _CALLEE.findall(line):
                if key in _BRANCH_KEYS:
                    continue
                stack.extend(t.strip().lstrip("%") for t in target.strip("{}").split(","))
    return sum(_op_count(comps[c], op) for c in seen)


def count_collectives(text: str) -> dict[str, int]:
    """Counts of every collective kind in the module."""
    return {op: count(text, op) for op in COLLECTIVES}


def count_host_callbacks(text: str) -> int:
    """Custom calls into Python (``jax.debug``, ``pure_callback``, ``io_callback``)."""
    return len(re.findall(r"custom_call_target=\"[^\"]*callback[^\"]*\"", text))


def count_large_copies(text: str, min_elements: int = 1024) -> int:
    """``copy`` instructions of arrays with at least ``min_elements`` elements (extra memory passes)."""
    total = 0
    for dims in re.findall(r"=\s*\w+\[([\d,]*)\][^=]*?\scopy\(", text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size >= min_elements
    return total
