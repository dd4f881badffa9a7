"""Nested frozen-dataclass configs from YAML files plus ``section.key=value`` overrides.

The one config mechanism: field types (``int``, ``bool``, ``Literal[...]``, tuples, nested
dataclasses, optionals) are the schema. :func:`from_dict` loads a mapping and rejects unknown keys;
:func:`check_fields`, called from a config's ``__post_init__``, applies the same type check to
direct construction. Unknown keys, wrong types and bad values are errors that name the full dotted key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: the plain
    loader keeps the last one, so a second ``train:`` block silently dropped the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)  # resolve ``<<`` merges: an explicit key may override those
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                    seen[key] = seen.get(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first given on line {first})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str):
    """``yaml.safe_load`` that rejects duplicate keys (no arbitrary objects, as safe_load)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if _is_dataclass_type(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and hasattr(tp, "from_string"):  # e.g. mesh: "data=2,tensor=4"
            try:
                return tp.from_string(value)
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where)
    if origin in (tuple, list):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is typing.Literal:
        if isinstance(value, bool) or value not in args:
            raise ConfigError(f"{where}: unknown {value!r}; must be one of {list(args)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 6e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # nan passes every `<`/`>` bound check a section makes
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def check_fields(obj) -> None:
    """Type-check (and normalise: lists -> tuples, ints -> floats) every field of dataclass ``obj``
    in place; errors name ``ClassName.field``."""
    cls = type(obj)
    for name, tp in _field_types(cls).items():
        value = _coerce(getattr(obj, name), tp, f"{cls.__name__}.{name}")
        object.__setattr__(obj, name, value)


def from_dict(cls, data: typing.Mapping, where: str = ""):
    """Build dataclass ``cls`` from a (nested) mapping, rejecting unknown keys."""
    hints = _field_types(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown keys {[prefix + k for k in unknown]} in {where or cls.__name__}; "
            f"valid keys: {', '.join(sorted(hints))}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def to_dict(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: cannot parse value ({one_line_yaml(e)})") from e
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def _deepcopy(d):
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def one_line_yaml(e: yaml.YAMLError) -> str:
    """A YAML error as one line: its problem and where (PyYAML prints a multi-line excerpt)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({one_line_yaml(e)})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data
