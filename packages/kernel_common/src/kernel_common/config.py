"""Measured configuration tables: the tiling/backend choice for a kernel, keyed by named fields."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

C = TypeVar("C")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def heads_bucket(heads: int) -> int:
    """TP-local head counts share a row per power of two, clamped to [8, 64]."""
    return min(max(next_pow2(heads), 8), 64)


@dataclass(frozen=True)
class KeyField:
    """One key field of a :class:`ConfigTable`; ``bucket`` maps a raw value to its row value."""

    name: str
    bucket: Callable[[Any], Any] | None = None

    def apply(self, value: Any) -> Any:
        return self.bucket(value) if self.bucket is not None else value


@dataclass(frozen=True)
class Row(Generic[C]):
    key: tuple
    config: C
    note: str = "measured"


@dataclass(frozen=True)
class Lookup(Generic[C]):
    """What :meth:`ConfigTable.lookup` chose: the config, its source and the bucketed key."""

    config: C
    source: str
    key: tuple

    def describe(self) -> str:
        return f"{self.source} {dict(self.key) if self.key else ''}".strip()


class ConfigTable(Generic[C]):
    """Rows of measured configs (instances of one frozen dataclass) keyed by named fields.

    ``rows`` maps a key (a dict over every field, given raw or already bucketed) to a config, or to
    a ``(config, note)`` pair where the note says how the row was obtained ("measured H200",
    "unmeasured default"). Construction rejects configs of the wrong type, unknown or missing key
    fields and two rows that bucket to the same key.
    """

    def __init__(
        self,
        name: str,
        config_type: type[C],
        fields: Iterable[KeyField],
        rows: Iterable[tuple[Mapping[str, Any], C] | tuple[Mapping[str, Any], C, str]],
        default: C,
    ) -> None:
        if not (dataclasses.is_dataclass(config_type) and config_type.__dataclass_params__.frozen):
            raise TypeError(f"ConfigTable {name!r}: config_type must be a frozen dataclass")
        self.name = name
        self.config_type = config_type
        self.fields = tuple(fields)
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"ConfigTable {name!r}: duplicate key field in {names}")
        self._check_config(default, "default")
        self.default = default
        self._rows: dict[tuple, Row[C]] = {}
        for entry in rows:
            raw, config, note = (*entry, "measured") if len(entry) == 2 else entry
            key = self.key(**raw)
            self._check_config(config, f"row {dict(key)}")
            if key in self._rows:
                raise ValueError(f"ConfigTable {name!r}: duplicate row for key {dict(key)}")
            self._rows[key] = Row(key, config, note)

    def _check_config(self, config: Any, where: str) -> None:
        if type(config) is not self.config_type:
            raise TypeError(
                f"ConfigTable {self.name!r}: {where} must be a {self.config_type.__name__}, "
                f"got {type(config).__name__}"
            )

    def key(self, **values: Any) -> tuple:
        """The bucketed key for raw field values, as ``((name, value), ...)`` in field order."""
        names = {f.name for f in self.fields}
        unknown = sorted(set(values) - names)
        missing = sorted(names - set(values))
        if unknown or missing:
            raise ValueError(
                f"ConfigTable {self.name!r}: key fields are {[f.name for f in self.fields]}; "
                f"unknown {unknown}, missing {missing}"
            )
        return tuple((f.name, f.apply(values[f.name])) for f in self.fields)

    def lookup(self, config: C | None = None, **values: Any) -> Lookup[C]:
        """The config for these field values: ``config`` if given, else the row, else default."""
        key = self.key(**values)
        if config is not None:
            self._check_config(config, "the caller's config")
            return Lookup(config, "caller", key)
        row = self._rows.get(key)
        if row is not None:
            return Lookup(row.config, f"row ({row.note})", key)
        return Lookup(self.default, "default", key)

    def rows(self) -> Iterator[Row[C]]:
        return iter(self._rows.values())

    def configs(self) -> list[C]:
        """Every distinct config the table can pick (rows and default), in a stable order."""
        seen: list[C] = []
        for config in [*(r.config for r in self._rows.values()), self.default]:
            if config not in seen:
                seen.append(config)
        return seen

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "fields": [f.name for f in self.fields],
                "default": dataclasses.asdict(self.default),
                "rows": [
                    {"key": dict(r.key), "config": dataclasses.asdict(r.config), "note": r.note}
                    for r in self._rows.values()
                ],
            },
            indent=1,
        )

    def from_json(self, text: str) -> ConfigTable[C]:
        """A table with this one's config type and fields and the rows of ``text`` (autotuning)."""
        data = json.loads(text)
        if data.get("fields") != [f.name for f in self.fields]:
            raise ValueError(
                f"ConfigTable {self.name!r}: JSON fields {data.get('fields')} do not match "
                f"{[f.name for f in self.fields]}"
            )

        def make(values: Mapping[str, Any]) -> C:
            try:
                return self.config_type(**values)
            except TypeError as e:
                raise ValueError(f"ConfigTable {self.name!r}: bad config {values}: {e}") from e

        rows = [(r["key"], make(r["config"]), r.get("note", "measured")) for r in data["rows"]]
        return ConfigTable(data["name"], self.config_type, self.fields, rows, make(data["default"]))

    def __repr__(self) -> str:
        return f"ConfigTable({self.name!r}, {len(self._rows)} rows)"


# Custom ops take no dataclasses: a resolved config crosses one as its fields, typed, in
# declaration order. These two functions are that conversion, for every op of every package.
_SCHEMA_TYPES = {"str": "str", "int": "int", "bool": "bool", "float": "float"}


def config_schema(config_type: type) -> str:
    """The fields of a config dataclass as custom-op schema arguments, in declaration order
    (``"str backend, int block, ..."``), for ``torch.library.define``."""
    args = []
    for f in dataclasses.fields(config_type):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind not in _SCHEMA_TYPES:
            raise TypeError(f"{config_type.__name__}.{f.name}: a custom op cannot take {kind}")
        args.append(f"{_SCHEMA_TYPES[kind]} {f.name}")
    return ", ".join(args)


def config_fields(config: Any) -> tuple:
    """The values of ``config``'s fields in declaration order (the op arguments of
    :func:`config_schema`); the op rebuilds the config with ``type(config)(*fields)``."""
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


def define_config_op(
    qualname: str, args: str, returns: str, config_type: type, impl: Callable
) -> torch._ops.OpOverloadPacket:
    """Define the custom op ``qualname`` (``"ns::name"``) taking ``args`` (schema text) and then
    ``config_type``'s fields (:func:`config_schema`), with ``impl`` as its implementation on every
    device; returns the op (``torch.ops.ns.name``). Register its fake and autograd with
    ``torch.library.register_fake`` / ``register_autograd`` on ``qualname``."""
    torch.library.define(qualname, f"({args}, {config_schema(config_type)}) -> {returns}")
    torch.library.impl(qualname, "default", impl)
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name)
