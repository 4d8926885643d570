"""How an option is declared, validated by pydantic, and what a bad value says (one line).

`opt(default, help, flag=, choices=, low=, high=, above=, below=)` declares a field of an `Options`
model: a pydantic Field whose description is the help, whose bounds are pydantic's ge/le/gt/lt (the
items' bounds, for a list), and whose flag and choices ride in json_schema_extra. `Options` is the
pydantic base of every config section, grid and command: strict types (no "3" for 3, no 1 for True),
finite floats, no unknown field; the one check pydantic has no keyword for (choices, and distinct,
bounded items of a list) is its field validator. Building one with bad values raises `ConfigError`,
one line naming the flag ("--loops must be in 1..1024, got 0"); `one_line` turns any pydantic
ValidationError into such a line, naming fields by flag or by dotted path ("model.loops").

`Option` is a field as the command line sees it (flag, kind, default, help, bounds), read from the
pydantic field by `options_of`. Torch-free.
"""
from __future__ import annotations

import copy
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticUndefined

MAX_ITEMS = 10_000  # entries of one list in any option or file flt-diag writes (a sweep's cells, a grid, ...)
MAX_TEXT = 4096  # characters of one text value (a path, a name): more is not something flt-diag wrote


class ConfigError(ValueError):
    """Options that do not validate: one line naming the flag or the field."""


def opt(default, help: str, *, flag: str | None = None, choices=None, low=None, high=None, above=None, below=None,
        many: bool = False):
    """A field that is also an option. `low`/`high` bound it inclusively, `above`/`below` exclusively
    (each item, for a list: a list default, or `many`); floats must be finite. Which commands take it is
    the CLI's business."""
    extra = dict(flag=flag, choices=list(choices) if choices else None)
    bounds = dict(ge=low, le=high, gt=above, lt=below)
    if isinstance(default, list) or many:  # a list: at least one item, distinct, each bounded (the validator below)
        kind = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
        return Field(**kind, description=help, min_length=1, max_length=MAX_ITEMS,
                     json_schema_extra=extra | dict(items=bounds, distinct=True))
    return Field(default, description=help, json_schema_extra=extra, **bounds)


def _extra(cls, name: str) -> dict:
    extra = cls.model_fields[name].json_schema_extra
    return extra if isinstance(extra, dict) else {}


def _range(b: dict) -> str | None:
    """Why nothing in a range is wrong, as text ("in 1..1024", ">= 0", ...) for the bounds that are set."""
    if b.get("ge") is not None and b.get("le") is not None:
        return f"in {b['ge']}..{b['le']}"
    return next((f"{op} {b[k]}" for k, op in (("ge", ">="), ("le", "<="), ("gt", ">"), ("lt", "<"))
                 if b.get(k) is not None), None)


def _outside(x, b: dict) -> bool:
    return (b.get("ge") is not None and x < b["ge"] or b.get("le") is not None and x > b["le"] or
            b.get("gt") is not None and not x > b["gt"] or b.get("lt") is not None and not x < b["lt"])


class Options(BaseModel):
    """A group of options (a config section, a grid, a command's): pydantic-validated when built."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", arbitrary_types_allowed=True,
                              str_max_length=MAX_TEXT)

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(one_line(e, by_flag(type(self)), type(self))) from None
    # Only a model built by a call comes through here: one nested in a validated file stays in pydantic-core,
    # so that its errors keep their path ("model.loops") (pydantic calls an __init__ it takes for custom).
    __init__.__pydantic_base_init__ = True

    @field_validator("*")
    @classmethod
    def _choices_and_items(cls, value, info):
        """The checks pydantic has no keyword for: choices, a list's items' bounds, and (where the field's
        json_schema_extra asks) distinct or ascending items."""
        extra = _extra(cls, info.field_name)
        items = value if isinstance(value, list) else [value]
        bounds, choices = extra.get("items"), extra.get("choices")
        for x in (x for x in items if x is not None):
            if choices and x not in choices:
                raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {x!r}")
            if bounds and _outside(x, bounds):
                raise ValueError(f"must be {_range(bounds)}, got {x}")
        if extra.get("distinct") and isinstance(value, list) and len(set(map(repr, value))) != len(value):
            raise ValueError(f"has duplicates: {' '.join(map(str, value))[:80]}")
        if extra.get("ascending") and isinstance(value, list) and value != sorted(value):
            raise ValueError("must be ascending")
        return value

    def to_dict(self) -> dict:
        return self.model_dump()


# --------------------------------------------------------------------------- one line per error

def _shown(x) -> str:
    text = type(x).__name__ if isinstance(x, (dict, list, tuple)) else repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _field_at(cls, loc: tuple):
    """The pydantic field that `loc` names in model `cls` (through nested models), or None."""
    info = None
    for part in loc:
        fields = getattr(cls, "model_fields", None)
        if isinstance(part, int) or not fields:
            continue
        info = fields.get(part)
        if info is None:
            return None
        cls = next((a for a in (info.annotation, *typing.get_args(info.annotation)) if isinstance(a, type)
                    and issubclass(a, BaseModel)), None)
    return info


def _problem(err: dict, info=None) -> str:
    """What is wrong, from one pydantic error ({"type", "msg", "ctx", "input"}) about field `info`."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, _shown(err.get("input"))
    bound = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
    both = _range(_bounds(info)) if info is not None else None
    if kind in ("greater_than_equal", "less_than_equal") and both and both.startswith("in "):
        return f"must be {both}, got {got}"
    typed = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
             "bool_type": "true or false", "string_type": "text", "list_type": "a list",
             "model_type": "a table of named entries", "dict_type": "a table", "finite_number": "finite"}
    if kind in bound:  # the bound as the field declares it (pydantic's ctx holds it as the field's type: 0.0)
        key = next(iter(ctx))
        return f"must be {bound[kind]} {_bounds(info).get(key, ctx[key]) if info is not None else ctx[key]}, got {got}"
    if kind in typed:
        return f"must be {typed[kind]}, got {got}"
    if kind == "missing":
        return "is missing"
    if kind == "extra_forbidden":
        return "is not a field flt-diag writes here"
    if kind in ("too_short", "too_long"):
        least, most = ctx.get("min_length", 0), ctx.get("max_length")
        return f"has {ctx.get('actual_length', 0):,} items; it needs " + \
            (f"{least} to {most:,}" if most is not None else f"at least {least}")
    if kind == "string_too_long":
        return f"is {len(err.get('input') or ''):,} characters of text; at most {ctx.get('max_length'):,}"
    return err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")


def one_line(e: ValidationError, name: Callable[[tuple], str], cls=None) -> str:
    """The first error of `e` as one line: "<name of the field> <problem>" (`name(loc)`; `cls`, the
    model validated, says a field's both bounds: "must be in 1..1024")."""
    err = e.errors(include_url=False)[0]
    where, problem = name(tuple(err["loc"])), _problem(err, _field_at(cls, tuple(err["loc"])) if cls else None)
    return f"{where} {problem}" if where else problem


def dotted(loc: tuple) -> str:
    """("model", "loops") -> "model.loops"; list indices as [i]."""
    out = ""
    for part in loc:
        if part == "[key]":  # (pydantic's mark of a table's key)
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def by_flag(cls) -> Callable[[tuple], str]:
    """Names a field of `cls` by its flag (--depth for n_layer), an item of a list by the list's."""
    def name(loc: tuple) -> str:
        if not loc or loc[0] not in cls.model_fields:
            return dotted(loc)
        return _extra(cls, loc[0]).get("flag") or "--" + str(loc[0]).replace("_", "-")
    return name


# --------------------------------------------------------------------------- fields as options

@dataclass(frozen=True)
class Option:
    """One field as the command line sees it (read from the pydantic field: see options_of)."""

    section: str  # "model", "train", "diagnostics", "verdict", "run", "sweep", "map" or "cli"
    name: str  # the field name
    flag: str  # "--batch-size"
    kind: type  # int, float, str, bool or Path
    optional: bool  # None is a value (= "decided elsewhere", e.g. by the device)
    many: bool  # a list of values (`--loops 3 6 9`)
    default: object
    help: str
    choices: tuple | None
    low: float | None
    high: float | None
    above: float | None
    below: float | None
    positional: bool = False
    info: Any = field(default=None, compare=False, repr=False)  # the pydantic field it is read from
    hint: Any = field(default=None, compare=False, repr=False)  # and its type

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_") if self.flag else self.name


def _bounds(info) -> dict:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if extra.get("items"):
        return extra["items"]
    kinds = {at.Ge: "ge", at.Le: "le", at.Gt: "gt", at.Lt: "lt"}
    return {kinds[type(m)]: getattr(m, kinds[type(m)]) for m in info.metadata if type(m) in kinds}


def option_of(section: str, name: str, info, hint) -> Option:
    many = typing.get_origin(hint) is list or list in map(typing.get_origin, typing.get_args(hint))
    args = typing.get_args(hint)
    inner = next((a for a in args if a is not type(None)), hint) if args else hint
    kind = typing.get_args(inner)[0] if typing.get_origin(inner) is list else inner
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    default = info.get_default(call_default_factory=True)
    b = _bounds(info)
    return Option(section, name, "" if extra.get("positional") else extra.get("flag") or "--" + name.replace("_", "-"),
                  kind, type(None) in args, many, None if default is PydanticUndefined else default,
                  info.description or "", tuple(extra["choices"]) if extra.get("choices") else None, b.get("ge"),
                  b.get("le"), b.get("gt"), b.get("lt"), bool(extra.get("positional")), info, hint)


def options_of(cls, section: str) -> list[Option]:
    """The Options of a model's fields declared with `opt` (those with help), in declaration order."""
    return list(_options_of(cls, section))


@functools.cache
def _options_of(cls, section: str) -> tuple[Option, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(option_of(section, name, info, hints[name]) for name, info in cls.model_fields.items()
                 if info.description)


def field_like(info, required: bool) -> Any:
    """A copy of a pydantic field (its help, bounds, choices), required or defaulting to None."""
    out = copy.copy(info)
    out.default, out.default_factory = PydanticUndefined if required else None, None
    out._attributes_set = {k: v for k, v in info._attributes_set.items() if k not in ("default", "default_factory")} \
        | ({} if required else {"default": None})
    return out


def arg(help: str, many: bool = False) -> Any:
    """A positional argument of a command (a required field; `many`: one or more)."""
    return Field(description=help, min_length=1 if many else None, json_schema_extra=dict(positional=True))


__all__ = ["MAX_ITEMS", "ConfigError", "Option", "Options", "arg", "by_flag", "dotted", "one_line", "opt",
           "options_of"]
