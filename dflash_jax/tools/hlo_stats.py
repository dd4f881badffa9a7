"""What a compiled (SPMD-partitioned, per-device) HLO module does per step: the collectives it runs
(kind, count, bytes) and its matmul FLOPs, with loop bodies counted as often as they run.

XLA's own ``cost_analysis()`` counts a ``while`` body once, so a model whose layers run under
``lax.scan`` shows ~1/L of its FLOPs there. Here every computation gets a multiplicity: the entry
runs once, a ``while`` body runs ``known_trip_count`` times its caller (XLA writes that into the
loop's backend_config when it can prove it), fusions and calls run as often as their caller.
A loop whose trip count is data-dependent (e.g. attention that stops at a causal bound) is counted
once and reported in ``unknown_trip_loops``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE_RE = re.compile(r"\b(pred|[su]\d+|bf16|f\d+|f8e\w+|c\d+)\[([\d,]*)\]")
_HEADER_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_PARAM_RE = re.compile(r"([\w.\-]+):\s*((?:pred|[su]\d+|bf16|f\d+|f8e\w+|c\d+)\[[\d,]*\])")
_CALL_RE = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(type_text: str) -> int:
    """Bytes of every array shape in an HLO type (a tuple type sums its elements)."""
    total = 0.0
    for dtype, dims in _SHAPE_RE.findall(type_text):
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return int(total)


def _dims(type_text: str) -> list[int]:
    m = _SHAPE_RE.search(type_text)
    if not m:
        return []
    return [int(d) for d in m.group(2).split(",") if d]


def _split_type(rest: str) -> tuple[str, str]:
    """'(s32[], f32[2]{0}) while(%t), ...' -> (type, 'while(%t), ...')."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    head, _, tail = rest.partition(" ")
    return head, tail.strip()


@dataclass
class _Instr:
    name: str
    type_text: str
    op: str
    body: str


@dataclass
class _Computation:
    name: str
    shapes: dict[str, str] = field(default_factory=dict)
    instrs: list[_Instr] = field(default_factory=list)


def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str | None]:
    comps: dict[str, _Computation] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER_RE.match(line)
            if m:
                current = _Computation(m.group(1))
                for pname, ptype in _PARAM_RE.findall(m.group(2)):
                    current.shapes[pname] = ptype
                comps[current.name] = current
                if line.startswith("ENTRY"):
                    entry = current.name
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        type_text, rest = _split_type(m.group(2))
        op = rest.split("(", 1)[0].strip()
        current.shapes[m.group(1)] = type_text
        current.instrs.append(_Instr(m.group(1), type_text, op, rest))
    return comps, entry


def _multiplicities(comps: dict[str, _Computation], entry: str) -> tuple[dict[str, int], int]:
    mult: dict[str, int] = defaultdict(int)
    unknown = 0
    # Computations are printed callees first, so walk from the entry down by repeated passes.
    order = [entry]
    mult[entry] = 1
    seen = {entry}
    i = 0
    while i < len(order):
        comp = comps[order[i]]
        i += 1
        for ins in comp.instrs:
            callees = [c for _, c in _CALL_RE.findall(ins.body)]
            for group in _BRANCHES_RE.findall(ins.body):
                callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            if not callees:
                continue
            factor = 1
            if ins.op == "while":
                trip = _TRIP_RE.search(ins.body)
                if trip:
                    factor = int(trip.group(1))
                else:
                    unknown += 1
            for callee in callees:
                if callee not in comps:
                    continue
                mult[callee] += mult[comp.name] * factor
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    return dict(mult), unknown


@dataclass(frozen=True)
class HloStats:
    matmul_flops: float  # per device, loops multiplied out
    collectives: dict[str, tuple[int, int]]  # kind -> (count per step, bytes per step)
    unknown_trip_loops: int
    # (kind, result array type such as "f32[64,1536]") of every distinct collective: a
    # vocabulary-sized one shows V (or V / tensor) among its dims
    collective_shapes: tuple[tuple[str, str], ...] = ()

    @property
    def collective_bytes(self) -> int:
        return sum(b for _, b in self.collectives.values())

    def collectives_summary(self) -> str:
        if not self.collectives:
            return "none"
        largest = {}
        for kind, array in self.collective_shapes:
            if shape_bytes(array) > shape_bytes(largest.get(kind, "")):
                largest[kind] = array
        return "; ".join(
            f"{kind} x{count} {_human(nbytes)}" + (f" (largest {largest[kind]})" if kind in largest else "")
            for kind, (count, nbytes) in sorted(self.collectives.items())
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def analyze(hlo_text: str) -> HloStats:
    """Collectives and matmul FLOPs of one device's compiled HLO (``compiled.as_text()``)."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    mult, unknown = _multiplicities(comps, entry)
    flops = 0.0
    coll: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    shapes: set[tuple[str, str]] = set()
    for name, comp in comps.items():
        m = mult.get(name, 0)
        if not m:
            continue
        for ins in comp.instrs:
            if ins.op == "dot":
                operands = re.match(r"dot\(\s*%([\w.\-]+)", ins.body)
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.body)
                lhs = _dims(comp.shapes.get(operands.group(1), "")) if operands else []
                k = 1
                if contracting and lhs:
                    k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d)
                flops += m * 2.0 * math.prod(_dims(ins.type_text) or [1]) * k
                continue
            kind = ins.op.removesuffix("-start")
            if kind in COLLECTIVE_KINDS and not ins.op.endswith("-done"):
                arrays = _SHAPE_RE.findall(ins.type_text)
                nbytes = shape_bytes(ins.type_text)
                if ins.op.endswith("-start") and ins.type_text.startswith("("):
                    # async start: (operand(s), result[, scratch]) -> count the largest buffer
                    nbytes = max(shape_bytes(f"{d}[{s}]") for d, s in arrays)
                    arrays = [max(arrays, key=lambda a: shape_bytes(f"{a[0]}[{a[1]}]"))]
                shapes.update((kind, f"{dtype}[{dims}]") for dtype, dims in arrays)
                coll[kind][0] += m
                coll[kind][1] += m * nbytes
    return HloStats(
        matmul_flops=flops,
        collectives={k: (v[0], v[1]) for k, v in coll.items()},
        unknown_trip_loops=unknown,
        collective_shapes=tuple(sorted(shapes)),
    )
