"""Typed dataclasses from plain data (YAML, ``--set KEY=VALUE``), with errors that name the key.

Generic machinery under ``config.py``: every value is checked against its field's annotation (ints
are accepted where floats are, literals list their choices), and an unknown key is an error that
lists the keys that exist, never a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import yaml

from p2p_spes.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp)) if origin is None else str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{where}: must be one of {', '.join(repr(a) for a in args)}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise ConfigError(f"{where}: unsupported type {tp}")
    raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key {', '.join(f'{where}.{k}' if where else k for k in unknown)}; "
            f"valid keys{' of ' + where if where else ''}: {', '.join(names)}"
        )
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        key = f"{where}.{name}" if where else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, data[name] or {}, key)
        else:
            kwargs[name] = coerce(data[name], tp, key)
    return cls(**kwargs)


def set_nested(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value`` with the value read as YAML (so ``4`` is an int, ``[1,2]`` a list)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, for example --set model.num_layers=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or key.startswith(".") or key.endswith("."):
        raise ConfigError(f"--set {text!r}: malformed key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML ({exc})") from None
    return key, value
