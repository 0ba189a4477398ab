"""One way to declare, load and override settings: dataclasses whose fields carry their help text.

    @dataclass
    class RecordConfig:
        every: int = setting(1, "record θ − θ₀ every N optimizer steps")
        keep: list[str] = setting(help="module types to keep", factory=list)

        def __post_init__(self):      # cross-field rules live here, with messages that say how to fix the input
            ...

    load(RecordConfig, {"every": 2}, "record")     # a mapping (e.g. a YAML section) -> RecordConfig
    load(RecordConfig, {"evry": 2}, "record")      # RelexError: record: unknown key 'evry'; valid keys: every, keep
    add_arguments(parser, RecordConfig, only=["every"])   # --every N, its help taken from the field
    overrides(parser.parse_args(), RecordConfig)          # {"every": 2} for the flags that were given

`load` is the one loader: it refuses unknown keys naming the valid ones, reports a missing required key with its
help, checks plain scalar types (int, float, str, bool, optionally None), and loads a field whose type is itself a
dataclass from its nested mapping (its errors say `where.field`). A field's `parse` function, when it has one,
first turns a shorthand into what the field holds (a task name into a TaskSpec, `warning: false` into a mapping).
Flags override a file by merging mappings before `load`, so every rule is checked once, on the final values.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from relex.errors import RelexError
from relex.util import comma_list, is_int

T = TypeVar("T")


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            parse: Callable[[Any], Any] | None = None) -> Any:
    """A dataclass field with help text; `factory` for mutable defaults; `parse(raw)` turns what a mapping gives
    (a shorthand such as a task name) into the field's value, or raises RelexError."""
    metadata = {"help": help, "parse": parse}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_text(cls: type, name: str) -> str:
    """The help text of field `name` of settings class `cls` ("" when it has none)."""
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def field_names(cls: type) -> list[str]:
    """The keys a mapping may hold for `cls`, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


def check_keys(data: Iterable[str], valid: Iterable[str], where: str) -> None:
    """Refuse the first key of `data` that is not in `valid`, naming the valid ones."""
    valid = list(valid)
    for key in data:
        if key not in valid:
            raise RelexError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid) or 'none'}")


# ---- loading ------------------------------------------------------------------------------------------------------
def load(cls: type[T], data: Mapping[str, Any] | None, where: str) -> T:
    """A `cls` from a mapping of its fields (None: all defaults), every key and nested section checked."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise RelexError(f"{where}: expected a mapping of {', '.join(field_names(cls))}, got {data!r}")
    check_keys(data, field_names(cls), where)
    hints = type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in data:
            values[f.name] = _field_value(f, hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.init and _required(f):
            raise RelexError(f"{where}: missing key {f.name!r}{_hint(f)}")
    return cls(**values)


def _field_value(f: dataclasses.Field, hint: Any, value: Any, where: str) -> Any:
    parse = f.metadata.get("parse")
    if parse is not None:
        value = parse(value)
    nested = settings_class(hint)
    if nested is not None and not isinstance(value, nested):
        return load(nested, value, where)
    check_type(value, hint, where)
    return value


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _hint(f: dataclasses.Field) -> str:
    return f" ({f.metadata['help']})" if f.metadata.get("help") else ""


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of `cls` (modules use `from __future__ import annotations`: they are strings)."""
    return typing.get_type_hints(cls)


def settings_class(hint: Any) -> type | None:
    """The dataclass a field of type `hint` holds (a nested section), or None."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def scalar_types(hint: Any) -> tuple[type, ...] | None:
    """The plain classes a value of type `hint` may be (`int | None` -> (int, NoneType)); None when `hint` is a
    generic or anything else that only the class's own `__post_init__` can check."""
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    if not all(isinstance(m, type) and m is not Any and not typing.get_args(m) for m in members):
        return None
    return members


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def check_type(value: Any, hint: Any, where: str) -> None:
    """Refuse a value that is not of a plain field type (a YAML `n: ten` or `every: true` where a number was meant)."""
    allowed = scalar_types(hint)
    if allowed is None or any(_is_a(value, kind) for kind in allowed):
        return
    names = " or ".join(_TYPE_WORDS.get(kind, kind.__name__) for kind in allowed)
    raise RelexError(f"{where}: expected {names}, got {value!r}")


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null",
               dict: "a mapping", list: "a list"}


def _is_a(value: Any, kind: type) -> bool:
    if kind is int:
        return is_int(value)
    if kind is float:
        return is_int(value) or isinstance(value, float)
    return isinstance(value, kind)


def read_yaml_mapping(path: str | Path) -> dict:
    """The mapping at the top of a YAML file, refused in one line when the file is missing or not such a mapping."""
    path = Path(path)
    if not path.is_file():
        raise RelexError(f"{path}: no such file")
    try:
        mapping = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RelexError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(mapping, dict):
        raise RelexError(f"{path}: expected a mapping of settings at the top level")
    return mapping


# ---- command-line flags -------------------------------------------------------------------------------------------
def add_arguments(parser: Any, cls: type, only: Iterable[str] | None = None) -> None:
    """One `--field-name` flag per field of `cls` (or the fields named in `only`) on `parser` (an ArgumentParser
    or one of its argument groups), its help from the field.

    Every flag defaults to None, so that `overrides` returns only what was given; booleans get `--x` and `--no-x`,
    lists take comma-separated values. A field that holds a mapping or a nested section has no flag."""
    names = field_names(cls) if only is None else list(only)
    check_keys(names, field_names(cls), f"flags of {cls.__name__}")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        parser.add_argument(flag_name(name), dest=name, default=None, **_flag_options(fields[name], hints[name]))


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_options(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    kind, is_list = _flag_kind(f, hint)
    default = f.default if f.default is not dataclasses.MISSING else None
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    shown = ",".join(map(str, default)) if is_list else default
    help = f.metadata.get("help", "") + (f" (default {shown})" if shown not in (None, "", []) else "")
    help = help.replace("%", "%%")  # argparse formats help with %
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction, "help": help}
    if is_list:
        return {"type": comma_separated(kind), "metavar": "A,B", "help": help}
    return {"type": kind, "help": help}


def _flag_kind(f: dataclasses.Field, hint: Any) -> tuple[type, bool]:
    """The element type a flag reads, and whether it reads a comma-separated list of them."""
    members = [m for m in (typing.get_args(hint) if _is_union(hint) else (hint,)) if m is not type(None)]
    if len(members) == 1 and typing.get_origin(members[0]) is list and len(typing.get_args(members[0])) == 1:
        return typing.get_args(members[0])[0], True
    if len(members) == 1 and members[0] in (int, float, str, bool):
        return members[0], False
    raise TypeError(f"field {f.name!r} of type {hint} has no command-line flag; set it in the config file")


def comma_separated(cast: type) -> Callable[[str], list]:
    """An argparse `type` reading `1.5,2,3` as a non-empty list of `cast` values."""

    def read(text: str) -> list:
        try:
            values = [cast(part) for part in comma_list(text)]
        except ValueError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated {cast.__name__} values, e.g. 1,2; got {text!r}")
        return values

    return read


def overrides(args: argparse.Namespace, cls: type, only: Iterable[str] | None = None) -> dict[str, Any]:
    """The flags `add_arguments(parser, cls, only)` added that were given on the command line, as field values."""
    names = field_names(cls) if only is None else list(only)
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
