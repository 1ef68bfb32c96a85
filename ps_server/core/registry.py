"""Plain-dict serialisation and a type registry for small frozen config objects.

Optimizer rules, initializers and entry policies are frozen dataclasses that travel as JSON (in
the gRPC ``CreateTable`` request and in the checkpoint manifest) as
``{"type": "<name>", **fields}``.
Each family (``OptimizerRule``, ``Initializer``, ``EntryPolicy``) subclasses :class:`Registered`
and owns its registry; a concrete class joins it with the family's ``register`` decorator::

    @OptimizerRule.register
    @dataclass(frozen=True)
    class Momentum(OptimizerRule):
        TYPE: ClassVar[str] = "momentum"
        lr: float
        ...

    OptimizerRule.from_dict({"type": "momentum", "lr": 0.1})  # -> Momentum(lr=0.1)

Field values are converted and checked by :func:`collective.typed_config.from_dict`, so a wrong
type or an unknown field is a :class:`~collective.errors.ConfigError` naming the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from typing_extensions import Self

from collective.errors import ConfigError
from collective.typed_config import from_dict, to_dict

R = TypeVar("R", bound="Registered")


class Registered:
    """Base of a family of registered, dict-serialisable frozen dataclasses.

    A family base sets ``FAMILY`` (used in messages) and ``_REGISTRY = {}``; concrete classes set
    ``TYPE`` (the ``"type"`` value in their dict) and are decorated with ``Family.register``.
    """

    FAMILY: ClassVar[str] = "object"
    """Human name of the family, used in error messages (``"optimizer"``)."""
    TYPE: ClassVar[str] = ""
    """The ``"type"`` value of a concrete class."""
    _REGISTRY: ClassVar[dict[str, type]] = {}

    @classmethod
    def register(cls, sub: type[R]) -> type[R]:
        """Class decorator: add ``sub`` to this family's registry under ``sub.TYPE``."""
        if not sub.TYPE:
            raise TypeError(f"{sub.__name__} must set TYPE before it is registered")
        if not dataclasses.is_dataclass(sub):
            raise TypeError(f"{sub.__name__} must be a (frozen) dataclass")
        existing = cls._REGISTRY.get(sub.TYPE)
        if existing is not None and existing is not sub:
            raise TypeError(
                f"{cls.FAMILY} type {sub.TYPE!r} is already registered by {existing.__name__}"
            )
        cls._REGISTRY[sub.TYPE] = sub
        return sub

    @classmethod
    def registered_types(cls) -> list[str]:
        """The ``"type"`` names this family knows, sorted."""
        return sorted(cls._REGISTRY)

    def to_dict(self) -> dict[str, Any]:
        """``{"type": TYPE, **fields}`` as plain JSON-ready data (tuples become lists)."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = to_dict(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "") -> Self:
        """Build the registered class named by ``data["type"]`` from the other keys.

        Raises ConfigError naming ``path`` for a missing/unknown type, an unknown field, a wrong
        type or an impossible value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"expected a mapping with a 'type' key ({', '.join(cls.registered_types())}), "
                f"got {data!r}",
                key=path or None,
            )
        type_path = f"{path}.type" if path else "type"
        kind = data.get("type")
        if kind is None:
            raise ConfigError(f"missing; one of {', '.join(cls.registered_types())}", key=type_path)
        sub = cls._REGISTRY.get(str(kind).lower())
        if sub is None:
            close = difflib.get_close_matches(str(kind).lower(), cls.registered_types(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown {cls.FAMILY} type {kind!r}{hint}; registered: "
                f"{', '.join(cls.registered_types())}",
                key=type_path,
            )
        rest = {k: v for k, v in data.items() if k != "type"}
        missing = [
            f.name
            for f in dataclasses.fields(sub)  # type: ignore[arg-type]
            if f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in rest
        ]
        if missing:
            raise ConfigError(
                f"{cls.FAMILY} {sub.TYPE!r} needs {', '.join(missing)}",
                key=f"{path}.{missing[0]}" if path else missing[0],
            )
        return from_dict(sub, rest, path)  # type: ignore[return-value]

    @classmethod
    def parse(cls, value: Any, path: str) -> Self:
        """An instance of this family, or its dict form (for ``field(metadata={"parse": ...})``)."""
        if isinstance(value, cls):
            return value
        return cls.from_dict(value, path)


__all__ = ["Registered"]
