"""Where the time goes: a ``jax.profiler`` trace of a callable, summarised per compiled op.

``profile(fn)`` runs ``fn`` under ``jax.profiler.trace`` (perfetto JSON on), then adds up the
durations of the XLA runtime's per-op events (``args.hlo_op``, on CPU the thunk executor's) by
jitted module and op. With the module's optimized HLO text at hand, each op is named by what it
computes (its output shape and the jax ops in it, from the HLO metadata), so a summary reads
"41% fusion f32[1024,49152]: dot_general, exp", not "41% fusion.17".
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[^ ]+)\s+(?P<kind>[\w\-]+)\(")
_COMPUTATION = re.compile(r"^%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="(?P<op>[^"]*)"')
_CALLS = re.compile(r"calls=%?(?P<callee>[\w.\-]+)")


def _jax_op(line: str) -> str | None:
    m = _OP_NAME.search(line)
    return m["op"].split("/")[-1] if m and "/" in m["op"] else None


def hlo_op_index(hlo_text: str) -> dict[str, str]:
    """op name -> "kind shape: the jax ops it computes" from optimized HLO text (a fusion is
    described by the jax ops inside its fused computation, matmuls first)."""
    inner: dict[str, list[str]] = collections.defaultdict(list)
    lines, current = [], None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            c = _COMPUTATION.match(line)
            current = c["name"] if c else None
            continue
        m = _OP_LINE.match(line)
        if m and current:
            lines.append((m, line))
            op = _jax_op(line)
            if op and op not in inner[current]:
                inner[current].append(op)
    out = {}
    for m, line in lines:
        callee = _CALLS.search(line)
        ops = inner.get(callee["callee"], []) if callee else [_jax_op(line) or ""]
        ops = sorted(ops, key=lambda o: not o.startswith(("dot", "conv")))
        out[m["name"]] = f"{m['kind']} {m['shape']}: {', '.join(o for o in ops[:4] if o)}".rstrip(": ")
    return out


def profile(fn: Callable[[], object], *, hlo_texts: list[str] = (), top: int = 8) -> dict:
    """Trace one call of ``fn`` (it must block until its results are ready) and summarise it.

    hlo_texts: optimized HLO texts (``jax.jit(f).lower(...).compile().as_text()``) of the modules
    the call runs, to describe their ops.
    Returns {"wall_ms", "op_ms" (sum of op events: several threads may overlap), "top": [...]}.
    """
    index = {}
    for text in hlo_texts:
        module = text.split(None, 2)[1].rstrip(",")  # "HloModule jit_step, ..."
        index.update({(module, k): v for k, v in hlo_op_index(text).items()})
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            fn()
        (path,) = Path(d).rglob("*.trace.json.gz")
        trace = json.loads(gzip.open(path).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    per_op: collections.Counter = collections.Counter()
    start, end = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X":
            continue
        start, end = min(start, e["ts"]), max(end, e["ts"] + e.get("dur", 0))
        op = (e.get("args") or {}).get("hlo_op")
        if op:
            per_op[(e["args"].get("hlo_module", "?"), op)] += e.get("dur", 0)
    total = sum(per_op.values())
    rows = [
        {
            "module": module,
            "op": op,
            "what": index.get((module, op), ""),
            "ms": us / 1e3,
            "share": us / total if total else 0.0,
        }
        for (module, op), us in per_op.most_common(top)
    ]
    return {"wall_ms": (end - start) / 1e3 if end > start else 0.0, "op_ms": total / 1e3, "top": rows}


def markdown_lines(summary: dict, title: str) -> list[str]:
    lines = [
        f"Profile ({title}; `jax.profiler`, one call, {summary['op_ms']:.0f} ms in compiled ops): "
        + "; ".join(f"{r['share'] * 100:.0f}% {r['what'] or r['op']} [{r['module']}]" for r in summary["top"])
    ]
    return lines
