"""Facts read off compiled HLO text, shared by the tests and the benchmarks.

The parser understands just enough of XLA's text format to
tell which computations run unconditionally (reachable from ``ENTRY`` without
entering a ``conditional`` branch), to count collectives and host callbacks, and
to size what the entry computation's instructions read and write.
"""

from __future__ import annotations

import math
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


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f16": 2,
    "bf16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in an HLO type (``"(f32[2,3]{1,0}, s32[])"`` → two arrays)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(type_str)]


def type_bytes(type_str: str) -> int:
    """Bytes of all the arrays in an HLO type."""
    return sum(_DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(type_str))


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_WORKLESS = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}
_FREE = _WORKLESS | {"copy-start", "copy-done"}


def _entry_instructions(text: str) -> list[tuple[str, str, str, list[str], str]]:
    """``(name, result type, op, operand names, line)`` of every instruction of the entry computation."""
    comps, entry = _split(text)
    out = []
    for line in comps.get(entry, []):
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, op, rest = m.groups()
        operands = re.findall(r"%([\w.\-]+)", rest.split("),", 1)[0] if ")," in rest else rest)
        out.append((name, result, op, operands, line))
    return out


def _slices(op: str, line: str, comps: dict[str, list[str]]) -> bool:
    """Whether an instruction is a slice, or a fusion whose computation slices: it reads the part it keeps."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    return op == "slice" or bool(called and any(" slice(" in x for x in comps.get(called.group(1), [])))


def passes_over(text: str, shape: str) -> dict[str, int]:
    """Memory passes over arrays of ``shape`` (e.g. ``"f32[1024,1024]"``) in the entry computation.

    Counts, for every instruction that does work (fusions, collectives, dots, copies; not
    parameters, tuples or bitcasts), how many of its operands have that shape (``reads``) and
    how many of its results do (``writes``). Collectives count once per tuple element. A slice
    of such an array (a ``slice`` or a fusion whose computation slices, with a result of at most
    1/8 of the array: the stability guard's strided samples) reads part of it, not a pass.
    """
    parsed = _entry_instructions(text)
    comps, _ = _split(text)
    types = {name: result for name, result, *_ in parsed}
    target = shape.replace(" ", "")
    whole = math.prod(int(d) for d in re.findall(r"\d+", target.split("[", 1)[1].split("]")[0]) or ["1"])
    reads = writes = 0
    for _name, result, op, operands, line in parsed:
        if op in _FREE:
            continue
        if _slices(op, line, comps) and sum(math.prod(dims) for _, dims in arrays(result)) * 8 <= whole:
            continue
        writes += len(re.findall(re.escape(target) + r"(?:\{|\b)", result.replace(" ", "")))
        for operand in operands:
            if types.get(operand, "").replace(" ", "").startswith(target):
                reads += 1
    return {"reads": reads, "writes": writes}


def instruction_bytes(text: str, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """What each instruction of the entry computation that does work reads and writes, in bytes.

    Skips parameters, tuples, ``get-tuple-element``, bitcasts, constants and the ops in ``skip``
    (e.g. ``("while",)`` to leave out a loop's body). One dict per instruction: ``name``, ``op``,
    ``kind`` (a fusion's kind, else ``""``), ``result`` (its type), ``op_name`` (the JAX
    source path from the metadata, with ``jax.named_scope`` scopes; ``""`` if none),
    ``bytes_read`` (the sizes of its operands; a slice, or a fusion that slices with a result of at most 1/8 of its
    operands, reads what it keeps: its result's size), ``bytes_written`` (of its result) and ``bytes``.
    """
    parsed = _entry_instructions(text)
    comps, _ = _split(text)
    types = {name: result for name, result, *_ in parsed}
    rows = []
    for name, result, op, operands, line in parsed:
        if op in _WORKLESS or op in skip:
            continue
        read = sum(type_bytes(types.get(o, "")) for o in operands)
        if _slices(op, line, comps) and 8 * type_bytes(result) <= read:  # reads what it keeps, not its operand
            read = type_bytes(result)
        written = type_bytes(result)
        op_name = re.search(r'op_name="([^"]*)"', line)
        kind = re.search(r"kind=(\w+)", line)
        rows.append(
            dict(
                name=name,
                op=op,
                kind=kind.group(1) if kind else "",
                result=result,
                op_name=op_name.group(1) if op_name else "",
                bytes_read=read,
                bytes_written=written,
                bytes=read + written,
            )
        )
    return rows


_COLLECTIVE_LINE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


def collective_bytes(text: str, min_elements: int = 64) -> dict[str, int]:
    """Bytes moved by collectives, split into gradient-sized and scalar-sized traffic.

    For every collective instruction (async ``-start`` halves counted once) the
    arrays of its result are sized: those with at least ``min_elements``
    elements add to ``large_bytes``; an all-reduce all of whose arrays are
    smaller counts in ``small_all_reduces``; ``small_bytes`` sums the rest.
    """
    large = small = small_all_reduces = 0
    for line in text.splitlines():
        m = _COLLECTIVE_LINE.match(line)
        if not m:
            continue
        result, op = m.groups()
        sizes = [(math.prod(dims), _DTYPE_BYTES[dtype] * math.prod(dims)) for dtype, dims in arrays(result)]
        big = [b for c, b in sizes if c >= min_elements]
        large += sum(big)
        small += sum(b for c, b in sizes if c < min_elements)
        if op == "all-reduce" and not big:
            small_all_reduces += 1
    return {"large_bytes": large, "small_bytes": small, "small_all_reduces": small_all_reduces}


# --------------------------------------------------------------------------- executions and device groups

_TRIP = re.compile(r'known_trip_count":\{"n":"(\d+)"')


def multiplicity(text: str) -> dict[str, int]:
    """How often each computation runs per call: 1 for ``ENTRY``; a ``while`` loop's body and condition its
    known trip count times its own (an unknown count reads 1); any other callee as often as its caller (a
    conditional's branches: an upper bound)."""
    comps, entry = _split(text)
    runs: dict[str, int] = {entry: 1}
    order = [entry]
    for name in order:
        for line in comps.get(name, []):
            trip = 1
            if " while(" in line:
                m = _TRIP.search(line)
                trip = int(m.group(1)) if m else 1
            for key, target in _CALLEE.findall(line):
                for callee in (t.strip().lstrip("%") for t in target.strip("{}").split(",")):
                    times = runs[name] * (trip if key in ("body", "condition") else 1)
                    if callee not in runs:
                        order.append(callee)
                    runs[callee] = max(runs.get(callee, 0), times)
    return runs


def executed_collective_bytes(text: str, min_elements: int = 64) -> dict[str, int]:
    """:func:`collective_bytes` with every instruction counted as often as it runs (loops by their trip count)."""
    comps, _ = _split(text)
    runs = multiplicity(text)
    large = small = 0
    for name, lines in comps.items():
        for line in lines:
            m = _COLLECTIVE_LINE.match(line)
            if not m:
                continue
            sizes = [(math.prod(dims), _DTYPE_BYTES[dtype] * math.prod(dims)) for dtype, dims in arrays(m.group(1))]
            large += runs.get(name, 1) * sum(b for c, b in sizes if c >= min_elements)
            small += runs.get(name, 1) * sum(b for c, b in sizes if c < min_elements)
    return {"large_bytes": large, "small_bytes": small}


def replica_groups(line: str, num_devices: int) -> list[set[int]]:
    """The device groups of one collective instruction, in any of XLA's three text formats."""
    import numpy as np

    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", line)
    if m:
        return [{int(v) for v in g.split(",") if v.strip()} for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        ids = np.arange(num_devices).reshape([int(v) for v in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(v) for v in m.group(4).split(",")])
        return [set(row) for row in ids.reshape(int(m.group(1)), int(m.group(2))).tolist()]
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", line
    )
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        ids = np.arange(num_devices)
        if m.group(2):
            ids = ids.reshape([int(v) for v in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        ids = ids.reshape([int(size) for _, size in axes])
        names = [name for name, _ in axes]
        reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        kept = [i for i in range(len(names)) if i not in reduced]
        ids = ids.transpose(kept + reduced).reshape(-1, int(np.prod([ids.shape[i] for i in reduced] or [1])))
        return [set(row) for row in ids.tolist()]
    return [set(range(num_devices))]  # no groups: all devices


def data_reductions_in_loops(text: str, data_of: dict[int, int], min_elements: int = 64) -> int:
    """Gradient-sized reductions (all-reduce, reduce-scatter) across the data axes inside ``while`` loops.

    ``data_of`` maps a device id to its data coordinate: a group spanning two coordinates reduces over data.
    """
    comps, _ = _split(text)
    runs = multiplicity(text)
    total = 0
    for name, lines in comps.items():
        if runs.get(name, 1) <= 1 and not _in_loop(name, text):
            continue
        for line in lines:
            m = _COLLECTIVE_LINE.match(line)
            if not m or m.group(2) not in ("all-reduce", "reduce-scatter"):
                continue
            if not any(math.prod(dims) >= min_elements for _, dims in arrays(m.group(1))):
                continue
            total += any(len({data_of[d] for d in g}) > 1 for g in replica_groups(line, len(data_of)))
    return total


def _in_loop(name: str, text: str) -> bool:
    """Whether computation ``name`` runs inside a ``while`` loop (even one of unknown or unit trip count)."""
    comps, _ = _split(text)
    bodies = set()
    for lines in comps.values():
        for line in lines:
            if " while(" in line:
                bodies.update(t.lstrip("%") for key, t in _CALLEE.findall(line) if key in ("body", "condition"))
    seen, stack = set(), list(bodies)
    while stack:
        c = stack.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            for _, target in _CALLEE.findall(line):
                stack.extend(t.strip().lstrip("%") for t in target.strip("{}").split(","))
    return name in seen
