"""Build frozen config dataclasses from plain dicts (YAML), with errors that name the key path.

One converter for every typed config of the project (the launcher's job spec, fleet's
DistributedStrategy): nested dataclasses, ``int``/``float``/``str``/``bool``, ``X | None``,
``StrEnum`` subclasses, ``tuple[T, ...]``, ``list[T]`` and ``dict[str, T]``. A field may carry
``metadata={"parse": fn}`` to accept extra spellings (``fn(value, path) -> value``).

Unknown keys, wrong types and impossible values raise :class:`ConfigError` with the dotted key
path, the value seen and what is allowed. Standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from collective.errors import ConfigError

T = TypeVar("T")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return " | ".join(repr(m.value) for m in tp)
        return {
            "int": "an integer",
            "float": "a number",
            "str": "a string",
            "bool": "true/false",
        }.get(tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")


def unknown_key_error(key: str, allowed: list[str], path: str) -> ConfigError:
    """The error for a key that the section does not have, with a did-you-mean hint."""
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown key{hint}; allowed keys: {', '.join(allowed)}", key=_join(path, key)
    )


def convert(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(
            f"expected {' or '.join(_type_name(a) for a in args if a is not type(None))}, "
            f"got {value!r}",
            key=path,
        )
    if origin in (tuple, list):
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {value!r}", key=path)
        items = [convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        args = typing.get_args(tp)
        val_tp = args[1] if len(args) == 2 else Any
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {value!r}", key=path)
        return {str(k): convert(v, val_tp, _join(path, str(k))) for k, v in value.items()}
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping of {tp.__name__} keys, got {value!r}", key=path)
        return from_dict(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        raw = value.value if isinstance(value, enum.Enum) else value
        for member in tp:
            if raw == member.value or (
                isinstance(raw, str) and raw.lower() == str(member.value).lower()
            ):
                return member
        raise ConfigError(f"got {value!r}; allowed: {_type_name(tp)}", key=path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"expected true/false, got {value!r}", key=path)
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"expected an integer, got {value!r}", key=path)
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"expected an integer, got {value!r}", key=path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"expected a number, got {value!r}", key=path)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"expected a string, got {value!r}", key=path)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"cannot read {value!r} as {_type_name(tp)}", key=path)


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; missing keys keep their defaults.

    A ``ValueError`` raised by ``cls.__post_init__`` is re-raised as ConfigError with the path.
    """
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping, got {data!r}", key=path or None)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        f = fields.get(str(key))
        if f is None:
            raise unknown_key_error(str(key), list(fields), path)
        sub = _join(path, f.name)
        parse = f.metadata.get("parse")
        kwargs[f.name] = parse(value, sub) if parse else convert(value, hints[f.name], sub)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        if err.key and path and not err.key.startswith(path):
            raise ConfigError(err.message, key=_join(path, err.key)) from None
        raise
    except ValueError as err:
        raise ConfigError(str(err), key=path or None) from None


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config dataclass (enums as values, tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def require(cond: bool, key: str, message: str) -> None:
    """Raise ConfigError(message, key) unless ``cond`` — for ``__post_init__`` checks."""
    if not cond:
        raise ConfigError(message, key=key)


__all__ = ["convert", "from_dict", "require", "to_dict", "unknown_key_error"]
