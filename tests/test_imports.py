"""Import direction of the source tree, read with ``ast`` (every import, including lazy ones inside
functions): model code sits below loading, checkpoints, converters, training, decoding, the tools
and the CLIs; no module imports an entry point (a ``__main__`` module); the library never imports
the tools (``dflash_jax.tools``: planner, benchmarks, profiling); the Pallas kernels depend on
jax/numpy only; no two modules import each other, directly or round a loop.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "convert", "pallas_kernels")

# Model code: the target and drafter networks and the layers / sharding rules they are built from.
MODEL_CODE = ("dflash_jax.target", "dflash_jax.drafter", "dflash_jax.layers", "dflash_jax.sharding")
# What sits above model code (besides entry points, found below): none of it may be imported by it.
ABOVE_MODEL = (
    "convert",
    "dflash_jax.training",
    "dflash_jax.decoding",
    "dflash_jax.tools",
    "dflash_jax.loading",
    "dflash_jax.checkpoint",
)
# On top of the library: planner, HLO statistics, mesh experiment, profiling, benchmarks.
TOOLS = ("dflash_jax.tools",)
KERNEL_DEPS = ("jax", "jaxlib", "numpy", "pallas_kernels")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[_module_name(path)] = (path, ast.parse(path.read_text(), filename=str(path)))
    return out


SOURCES = _sources()


def _imports(name: str, path: Path, tree: ast.Module) -> set[str]:
    """Absolute names of everything ``tree`` imports (``from a import b`` gives ``a.b`` when that
    is a module of ours, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in SOURCES else base)
    return found


IMPORTS = {name: _imports(name, path, tree) for name, (path, tree) in SOURCES.items()}


def _is_entry_point(name: str, tree: ast.Module) -> bool:
    """A CLI module: a package's ``__main__`` or a module with an ``if __name__ == "__main__":`` block."""
    if name.endswith(".__main__"):
        return True
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            left = node.test.left
            if isinstance(left, ast.Name) and left.id == "__name__":
                return True
    return False


ENTRY_POINTS = sorted(name for name, (_, tree) in SOURCES.items() if _is_entry_point(name, tree))


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_entry_points_are_found():
    # The walk must see the CLIs, or the model-code rule below would check nothing about them.
    assert {"dflash_jax.train", "dflash_jax.eval", "convert.drafter_to_hf"} <= set(ENTRY_POINTS)


def test_model_code_imports_no_loader_converter_training_or_cli():
    forbidden = ABOVE_MODEL + tuple(ENTRY_POINTS)
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in IMPORTS.items()
        if _within(name, MODEL_CODE)
        for dep in deps
        if _within(dep, forbidden)
    )
    assert not bad, "model code must not import these:\n" + "\n".join(bad)


def test_no_module_imports_an_entry_point():
    # A command line is a leaf: what others need from it belongs in a library module under it.
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in IMPORTS.items()
        for dep in deps
        if dep in ENTRY_POINTS and not name.endswith(".__main__")
    )
    assert not bad, "entry points (modules with a __main__ block) imported by other modules:\n" + "\n".join(
        bad
    )


def test_the_library_never_imports_the_tools():
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in IMPORTS.items()
        if not _within(name, TOOLS) and name not in ENTRY_POINTS
        for dep in deps
        if _within(dep, TOOLS)
    )
    assert not bad, "library modules must not import dflash_jax.tools:\n" + "\n".join(bad)


# The one optional backend of the kernels: imported inside its functions, only for
# attention_impl: tokamax (pallas_kernels itself imports without it).
OPTIONAL_KERNEL_DEPS = {"pallas_kernels.anchored_attention.tokamax_impl": ("tokamax", "absl")}


def test_pallas_kernels_import_only_jax_numpy_and_stdlib():
    stdlib = set(sys.stdlib_module_names)
    bad = sorted(
        f"{name} imports {dep}"
        for name, deps in IMPORTS.items()
        if _within(name, ("pallas_kernels",))
        for dep in deps
        if not _within(dep, KERNEL_DEPS)
        and dep.split(".")[0] not in stdlib
        and not _within(dep, OPTIONAL_KERNEL_DEPS.get(name, ()))
    )
    assert not bad, "pallas_kernels may import only jax, numpy and the standard library:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = {name: {d for d in deps if d in SOURCES and d != name} for name, deps in IMPORTS.items()}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (directly or round a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ],
)
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected
