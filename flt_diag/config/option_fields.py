"""How an option is declared (`opt`: a pydantic Field of an `Options` model, its help the description, its
flag its name as users type it: `depth` is `--depth`; a name files wrote before is read through the field's
validation alias, `AliasChoices("depth", "n_layer")`), validated (strict: no "3" for 3, no 1 for True;
finite; no unknown field), and what a bad value says: one line naming the flag ("--loops must be in 1..1024,
got 0": `one_line`). `form` reads a field's type as the command line and the error lines need it. Torch-free.
"""
from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, Callable, Literal, NamedTuple, TypeVar

import annotated_types as at
from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticUndefined

MAX_ITEMS = 10_000  # entries of one list in any option or file flt-diag writes (a sweep's cells, a grid, ...)
MAX_TEXT = 4096  # characters of one text value (a path, a name): more is not something flt-diag wrote
# Every number an option takes is at most 2**53 unless its field says less: exact in float64 (steps are read
# back into float64 columns), a C long where torch takes one, and any product of a few options stays finite
# (lr x lr scale x a map's grid value; warm-down share x steps), so no quantity derived from two options overflows.
MAX_NUMBER = 2**53
T = TypeVar("T")


class ConfigError(ValueError):
    """Options that do not validate: one line naming the flag or the field."""


def distinct(items: list) -> list:
    if len(set(map(repr, items))) != len(items):
        raise ValueError(f"has duplicates: {' '.join(map(str, items))[:80]}")
    return items


def ascending(items: list) -> list:
    if items != sorted(items):
        raise ValueError("must be ascending")
    return items


Distinct, Ascending = AfterValidator(distinct), AfterValidator(ascending)
Items = Annotated[list[T], Field(min_length=1, max_length=MAX_ITEMS), Distinct]  # one or more distinct Ts


class Choices(NamedTuple):
    """A str field's choices, read when asked (Annotated metadata: a table that grows, as the variants do when a
    stabiliser joins); its validator refuses the others."""

    values: Callable[[], Any]


def opt(default, help: str, *, settled: bool = False, grid: tuple[str, ...] = (), volatile: bool = False,
        **field) -> Any:
    """A field that is also an option (`field`: pydantic's alias, validation_alias, ge, le, gt, lt; a name files
    wrote before is a validation alias, AliasChoices(name, old name): every reader takes both). The facts other
    layers read: `settled`, set by settling (the tokenizer's vocabulary), never an option; `grid`, the grids
    ("sweep", "map") that take a list of it instead and set it per cell; `volatile`, may change when a
    run folder is resumed (it changes nothing a run computes). Which commands take it is the CLI's."""
    facts: dict[str, Any] = {k: v for k, v in dict(settled=settled, grid=list(grid), volatile=volatile).items() if v}
    given = dict(default_factory=lambda: list(default)) if isinstance(default, list) else dict(default=default)
    if isinstance(default, (int, float)) and not isinstance(default, bool) and not {"le", "lt"} & set(field):
        field["le"] = MAX_NUMBER  # (a None default or a list: its field or item type bounds it)
    return Field(**given, description=help, json_schema_extra=facts or None, **field)


def arg(help: str, many: bool = False) -> Any:
    """A positional argument of a command (a required field; `many`: one or more)."""
    return Field(description=help, min_length=1 if many else None, json_schema_extra=dict(positional=True))


def fact(info: FieldInfo, key: str):
    return info.json_schema_extra.get(key) if isinstance(info.json_schema_extra, dict) else None


def with_fact(cls, key: str, value=True) -> tuple[str, ...]:
    """The fields of model `cls` whose fact `key` is (or, for a list, holds) `value`."""
    return tuple(n for n, f in cls.model_fields.items()
                 if (value in fact(f, key) if isinstance(fact(f, key), list) else fact(f, key) == value))


STRICT = ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True, str_max_length=MAX_TEXT)


@functools.cache
def _adapter(hint) -> TypeAdapter:
    return TypeAdapter(hint, config=STRICT)


def check(hint, value, where: str, info: FieldInfo | None = None):
    """`value` validated as a `hint` (strict, as every option), or one ConfigError line "<where> <problem>" (the
    bounds and choices of field `info`). A field alone: check(info.rebuild_annotation(), value, where, info) (its
    type and bounds; no check across fields, which need the whole section)."""
    try:
        return _adapter(hint).validate_python(value)
    except ValidationError as e:
        raise ConfigError(f"{where} {_problem(e.errors(include_url=False)[0], info)}") from None


class Options(BaseModel):
    """A group of options (a config section, a grid, a command's): pydantic-validated when built."""

    model_config = ConfigDict(**STRICT, extra="forbid", validate_by_name=True, validate_by_alias=True)

    @classmethod
    def of(cls, **values):
        """A model of `values` (by field name or alias); a bad one raises one ConfigError line naming the flag."""
        try:
            return cls(**values)
        except ValidationError as e:
            raise ConfigError(one_line(e, by_flag(cls), cls)) from None

    def to_dict(self) -> dict:
        return self.model_dump()


# --------------------------------------------------------------------------- a field's type, read

def _bare(hint) -> tuple[Any, list, bool]:
    """(the type, its Annotated metadata, whether None is a value) of `hint`, Optional and Annotated removed."""
    metadata: list[Any] = []
    optional = False
    while True:
        if typing.get_origin(hint) is Annotated:
            metadata += typing.get_args(hint)[1:]
            hint = typing.get_args(hint)[0]
        elif type(None) in typing.get_args(hint):
            hint, optional = next(a for a in typing.get_args(hint) if a is not type(None)), True
        else:
            return hint, metadata, optional


BOUND_KINDS = {at.Ge: "ge", at.Le: "le", at.Gt: "gt", at.Lt: "lt"}


class Form(NamedTuple):
    """A field's type as the command line and the error lines read it (`form`)."""

    kind: type  # int, float, str, bool or Path (of each item, for a list)
    many: bool  # a list of values
    optional: bool  # None is a value (decided elsewhere)
    choices: tuple | None  # a Literal's values
    bounds: dict  # {"ge": 1, "le": 1024} (each item's, for a list)

    low, high, above, below = (property(lambda self, k=k: self.bounds.get(k))  # type: ignore[misc]  # (properties)
                               for k in ("ge", "le", "gt", "lt"))


def form(x) -> Form:
    """The Form of a pydantic field or of a type (Annotated constraints read too)."""
    hint, found, optional = _bare(x.rebuild_annotation() if isinstance(x, FieldInfo) else x)
    many = typing.get_origin(hint) is list
    hint, found, _ = _bare(typing.get_args(hint)[0]) if many else (hint, found, optional)
    found = [m for x in found for m in (x.metadata if isinstance(x, FieldInfo) else [x])]
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else \
        next((tuple(m.values()) for m in found if isinstance(m, Choices)), None)
    bounds = {BOUND_KINDS[type(m)]: getattr(m, BOUND_KINDS[type(m)]) for m in found if type(m) in BOUND_KINDS}
    return Form(type(choices[0]) if choices else hint, many, optional, choices, bounds)


def dest(name: str, info: FieldInfo) -> str:
    """The name users type: the field's name, or its alias where Python forbids that name (list_cells is list)."""
    return info.alias or name


def flag(name: str, info: FieldInfo) -> str:
    """The field's flag: --seq-len for seq_len; "" for a positional argument."""
    return "" if fact(info, "positional") else "--" + dest(name, info).replace("_", "-")


def default(info: FieldInfo):
    """The field's default (None where it has none)."""
    value = info.get_default(call_default_factory=True)
    return None if value is PydanticUndefined else value


# --------------------------------------------------------------------------- one line per error

def _shown(x) -> str:
    text = type(x).__name__ if isinstance(x, (dict, list, tuple)) else repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def named(cls, part) -> tuple[str, FieldInfo] | None:
    """(name, field) of model `cls` that a key of its input names (the field's name, its alias or an old name)."""
    return next(((n, f) for n, f in getattr(cls, "model_fields", {}).items()
                 if part in (n, f.alias) or isinstance(f.validation_alias, AliasChoices)
                 and part in f.validation_alias.choices), None)


def _field_at(cls, loc: tuple) -> tuple[str, FieldInfo] | None:
    """The field that `loc` names in model `cls` (through nested models), or None."""
    found = None
    for part in loc:
        if isinstance(part, int) or not hasattr(cls, "model_fields"):
            continue
        found = named(cls, part)
        if found is None:
            return None
        cls = next((a for a in (found[1].annotation, *typing.get_args(found[1].annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return found


def _range(b: dict) -> str | None:
    """Why nothing in a range is wrong, as text ("in 1..1024", ">= 0", ...) for the bounds that are set."""
    if b.get("ge") is not None and b.get("le") is not None:
        return f"in {b['ge']}..{b['le']}"
    return next((f"{op} {b[k]}" for k, op in (("ge", ">="), ("le", "<="), ("gt", ">"), ("lt", "<")) if k in b), None)


TYPED = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number", "bool_type": "true or false",
         "string_type": "text", "list_type": "a list", "model_type": "a table of named entries", "dict_type": "a table",
         "finite_number": "finite"}
BOUNDS = {"greater_than_equal": "ge", "less_than_equal": "le", "greater_than": "gt", "less_than": "lt"}


def _problem(err: ErrorDetails, info: FieldInfo | None) -> str:
    """What is wrong, from one pydantic error ({"type", "msg", "ctx", "input"}) about field `info`."""
    kind, ctx, got = err["type"], err.get("ctx") or {}, _shown(err.get("input"))
    o = form(info) if info is not None else None
    if kind in BOUNDS:  # the bounds as the field declares them (pydantic's ctx holds one, as the field's type: 0.0)
        b, key = (o.bounds if o is not None else {}), BOUNDS[kind]
        both = key in ("ge", "le") and "ge" in b and "le" in b
        return f"must be {_range(b if both else {key: b.get(key, next(iter(ctx.values())))})}, got {got}"
    if kind == "literal_error":
        choices = o.choices if o is not None and o.choices else ctx.get("expected", "").replace("'", "").split(" or ")
        return f"must be one of {', '.join(map(str, choices))}, got {got}"
    if kind in TYPED:
        return f"must be {TYPED[kind]}, got {got}"
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
    """The first error of `e` as one line: "<name(loc)> <problem>" (`cls`, the model validated, gives the
    field's bounds and choices)."""
    err = e.errors(include_url=False)[0]
    found = _field_at(cls, tuple(err["loc"])) if cls else None
    where, problem = name(tuple(err["loc"])), _problem(err, found[1] if found else None)
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
    """Names a field of `cls` (or of a section in it) by its flag, an item of a list by the list's."""
    def name(loc: tuple) -> str:
        found = _field_at(cls, loc)
        return flag(*found) if found is not None else dotted(loc)
    return name


__all__ = ["MAX_ITEMS", "Ascending", "Choices", "ConfigError", "Distinct", "Form", "Items", "Options", "arg", "by_flag", "default",
           "check", "dest", "dotted", "flag", "form", "named", "one_line", "opt", "with_fact"]
