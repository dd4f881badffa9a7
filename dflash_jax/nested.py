"""Nested dicts <-> dotted paths: the one flattening used by config comparisons (resume checks,
feature-cache identities) and by the parameter trees of the drafter formats."""

from __future__ import annotations


def flatten(tree: dict, prefix: str = "", *, empty_as_leaf: bool = False) -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``. ``empty_as_leaf``: an empty dict stays a value (an
    identity field that is ``{}`` is still compared) instead of vanishing."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and (v or not empty_as_leaf):
            out.update(flatten(v, path + ".", empty_as_leaf=empty_as_leaf))
        else:
            out[path] = v
    return out


def unflatten(flat: dict) -> dict:
    """Dotted paths -> nested dict; all-digit parts become ints (nnx.List indices)."""
    out: dict = {}
    for path, v in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out
