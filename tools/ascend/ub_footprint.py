"""Unified-Buffer footprint of a kernel's inner loops, read from triton-ascend's lowered IR.

triton-ascend 3.2 lowers a kernel in two steps before its BiSheng compiler: Triton IR (``*.ttir``)
and, through ``triton-adapter-opt``, Linalg on tensors with explicit ``memref.alloc`` for loaded
tiles (``*.ttadapter``). In that IR every buffer a vector core works on is either one of those
allocations or a statically shaped tensor value; BiSheng places both in the UB. This module
estimates, for each ``scf.for`` loop whose body holds such values, the largest number of bytes
live at once in the body:

* a value is live from the operation that defines it to the last top-level operation of the body
  that uses it (uses inside nested regions count at their parent); both ends inclusive, so an
  operation's operands and result are counted together (no in-place reuse is assumed);
* tensors defined before the loop and used inside it (broadcast scalars, column indices hoisted
  out of the loop by the adapter) are live for the whole body;
* views (``bufferization.to_tensor``, ``tensor.extract_slice``, ``memref.subview``,
  ``memref.reinterpret_cast``) take no storage of their own: their uses extend their source's life;
  ``tensor.empty`` takes none until an operation writes it, whose result is counted instead;
* tiles copied in from global memory (``memref.alloc``) and tiles stored to it (the source of
  ``bufferization.materialize_in_destination``) count twice and for the whole body: triton-ascend
  asks BiSheng to double-buffer them (``multibuffer``, on by default for 910B / 910_93) so the next
  block's copy overlaps this block's compute, which keeps both copies allocated throughout.

What it cannot see is what BiSheng does after this IR: fusing a broadcast scalar into a
vector-scalar instruction or computing in place (both shrink the footprint), and its scratch for
reductions and type conversions, alignment of each buffer to 32 bytes, and any buffers its own
tiling adds (which grow it). The estimate is therefore a reading of the IR, not BiSheng's figure;
with CANN, ``ENABLE_PRINT_UB_BITS=1`` makes triton-ascend print BiSheng's (``UB size = N bits``).

Standard library only: it runs in the triton-ascend virtual environment and in the tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Bytes per element of the element types the kernels use.
ELEMENT_BYTES = {"i1": 1, "i8": 1, "bf16": 2, "f16": 2, "i16": 2, "f32": 4, "i32": 4, "i64": 8, "f64": 8, "index": 8}

_VALUE = re.compile(r"%[A-Za-z0-9_]+")
_DEFINITION = re.compile(r"^\s*(%[A-Za-z0-9_]+)(?::(\d+))?\s*=\s*([a-z_]+\.[a-z_]+)")
_DEFINITION_ANYWHERE = re.compile(r"^\s*(%[A-Za-z0-9_]+)(?::\d+)?\s*=", re.MULTILINE)
_SHAPED = re.compile(r"(?:tensor|memref)<((?:[0-9?]+x)*)([a-z]+[0-9]*)")
# Operations whose result is a view of an operand (its first %value), not a new buffer.
_VIEWS = ("bufferization.to_tensor", "tensor.extract_slice", "memref.subview", "memref.reinterpret_cast",
          "memref.cast", "tensor.cast", "tensor.expand_shape", "tensor.collapse_shape", "memref.expand_shape",
          "memref.collapse_shape")
_NO_STORAGE = ("tensor.empty",)


@dataclass
class _Op:
    """One operation: its first line, its nested operations, and the text of its nested lines."""

    line: int  # 0-based line of the operation in the IR
    text: str
    name: str
    results: list[str]
    children: list[_Op] = field(default_factory=list)  # top-level operations of its regions
    nested_text: str = ""
    closing: str = ""  # the line closing its regions (linalg.generic prints its result type there)


@dataclass(frozen=True)
class Buffer:
    """A value that takes UB storage: its IR name, bytes (doubled when double-buffered) and why."""

    value: str
    bytes: int
    kind: str  # "loaded tile", "stored tile", "temporary", "loop invariant"


@dataclass(frozen=True)
class LoopFootprint:
    """The peak of one loop body, and the buffers live at that peak."""

    loop_line: int  # 1-based line of the scf.for in the IR
    peak_bytes: int
    live_at_peak: tuple[Buffer, ...]


def shaped_bytes(type_text: str) -> int | None:
    """Bytes of a statically shaped tensor/memref type such as ``tensor<4096xf32>``; None if it is
    dynamic or not a shaped type. A 0-d ``tensor<f32>`` is one element."""
    match = _SHAPED.search(type_text)
    if match is None:
        return None
    dims = [d for d in match.group(1).split("x") if d]
    element = match.group(2)
    if element not in ELEMENT_BYTES or any(not d.isdigit() for d in dims):
        return None
    count = 1
    for d in dims:
        count *= int(d)
    return count * ELEMENT_BYTES[element]


def _result_type(op: _Op) -> str:
    """The result type of a single-result operation, from MLIR's printed forms."""
    if "->" in op.closing:  # linalg.generic: `} -> tensor<...>`
        return op.closing.rsplit("->", 1)[1]
    header = op.text
    if "->" in header:
        return header.rsplit("->", 1)[1]
    if op.name in ("arith.cmpi", "arith.cmpf"):  # printed with the operand type; the result is i1
        operand = header.rsplit(":", 1)[1]
        return re.sub(r"x(bf16|f16|f32|f64|i8|i16|i32|i64)>", "xi1>", operand)
    outs = re.search(r"outs\([^:]*:\s*([^)]*)\)", header)
    if outs:  # linalg.reduce and other structured operations without `->`
        return outs.group(1)
    if " : " not in header:
        return ""
    types = header.rsplit(" : ", 1)[1]
    if " to " in types:  # casts: `a : T1 to T2`
        return types.rsplit(" to ", 1)[1]
    return types.rsplit(",", 1)[-1]


def _depth_change(line: str) -> int:
    return line.count("{") - line.count("}")


def _parse(lines: list[str], start: int, end: int) -> list[_Op]:
    """The operations of lines[start:end] at the outermost nesting level, each with its regions."""
    ops: list[_Op] = []
    index = start
    while index < end:
        line = lines[index]
        stripped = line.strip()
        if not stripped or stripped.startswith(("}", "^", "#", "//")):
            index += 1
            continue
        definition = _DEFINITION.match(line)
        if definition:
            name, count, op_name = definition.groups()
            results = [f"{name}#{i}" for i in range(int(count))] if count else [name]
        else:
            op_name, results = stripped.split()[0].split("(")[0], []
        op = _Op(line=index, text=line, name=op_name, results=results)
        if _depth_change(line) > 0:
            depth, close = 0, index
            for close in range(index, len(lines)):
                depth += _depth_change(lines[close])
                if depth == 0:
                    break
            op.children = _parse(lines, index + 1, close)
            op.nested_text = "\n".join(lines[index + 1:close + 1])
            op.closing = lines[close]
            index = close
        ops.append(op)
        index += 1
    return ops


def _uses(op: _Op) -> set[str]:
    """Values an operation reads, in its own line and its regions, less what its regions define
    (MLIR reuses names across sibling regions, never between a region and its ancestors)."""
    text = op.text.split("=", 1)[1] if op.results else op.text
    own = set(_VALUE.findall(text + "\n" + op.nested_text))
    return own - set(_DEFINITION_ANYWHERE.findall(op.nested_text))


def loop_footprints(ir_text: str, double_buffer: bool = True) -> list[LoopFootprint]:
    """The UB footprint of every scf.for body that holds statically shaped buffers, by the rules
    in the module docstring. ``double_buffer`` doubles loaded and stored tiles."""
    lines = ir_text.splitlines()
    footprints: list[LoopFootprint] = []
    _walk(_parse(lines, 0, len(lines)), {}, double_buffer, footprints)
    return sorted(footprints, key=lambda f: f.loop_line)


def _walk(ops: list[_Op], outer: dict[str, _Op], double_buffer: bool, out: list[LoopFootprint]) -> None:
    """Visits a region in order, with the values its ancestors define before it in scope."""
    scope = dict(outer)
    for op in ops:
        if op.name == "scf.for":
            footprint = _loop_footprint(op, scope, double_buffer)
            if footprint is not None:
                out.append(footprint)
        _walk(op.children, scope, double_buffer, out)
        for result in op.results:
            scope[result] = op


def _loop_footprint(loop: _Op, outer: dict[str, _Op], double_buffer: bool) -> LoopFootprint | None:
    body = loop.children
    scope = dict(outer)
    position: dict[str, int] = {}
    for index, op in enumerate(body):
        for result in op.results:
            scope[result] = op
            position[result] = index
    view_source = {}
    for value, op in scope.items():
        if op.name in _VIEWS and len(op.results) == 1:
            operands = _VALUE.findall(op.text.split("=", 1)[1])
            if operands:
                view_source[value] = operands[0]

    def root(value: str) -> str:
        while value in view_source:
            value = view_source[value]
        return value

    last_use: dict[str, int] = {}
    stored: set[str] = set()
    for index, op in enumerate(body):
        for value in _uses(op):
            last_use[root(value)] = index
        if op.name == "bufferization.materialize_in_destination":
            stored.add(root(_VALUE.findall(op.text)[0]))

    buffers: list[tuple[Buffer, int, int]] = []  # buffer, first and last body index where live
    for value in set(position) | set(last_use):
        op = scope.get(value)
        # Function arguments (global memory) have no defining operation.
        if op is None or value in view_source or op.name in _NO_STORAGE:
            continue
        size = shaped_bytes(_result_type(op))
        if size is None:
            continue
        inside = value in position
        kind = ("loaded tile" if op.name == "memref.alloc" else "stored tile" if value in stored
                else "temporary" if inside else "loop invariant")
        buffered = double_buffer and kind in ("loaded tile", "stored tile")
        if inside and not buffered:
            first, last = position[value], max(last_use.get(value, position[value]), position[value])
        else:  # the second copy of a double-buffered tile is in flight for the whole body
            first, last = 0, len(body) - 1
        buffers.append((Buffer(value, size * (2 if buffered else 1), kind), first, last))
    peak, live_at_peak = 0, ()
    for index in range(len(body)):
        live = tuple(sorted((b for b, first, last in buffers if first <= index <= last), key=lambda b: -b.bytes))
        total = sum(b.bytes for b in live)
        if total > peak:
            peak, live_at_peak = total, live
    if peak == 0:
        return None
    return LoopFootprint(loop_line=loop.line + 1, peak_bytes=peak, live_at_peak=live_at_peak)
