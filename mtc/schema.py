"""Typed dataclass fields: one checker for every config value, whatever it came from.

A field's type annotation says what a value must be (``int``, ``float``, ``bool``, ``str``,
``X | None``, ``dict[str, Any]``, a nested dataclass) and its `Rule` (in the field's metadata, see
`field`) adds ranges, a fixed set of choices, or a syntax check. `check_value` enforces both for a
value from TOML, JSON or Python; `parse_text` first turns a command-line string into the field's
type, so a flag and a config file are judged by the same rule. Errors are `ConfigError`s that name
the field, the value and its type, and what was expected.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from mtc.errors import ConfigError

__all__ = ["Rule", "check_dataclass", "check_value", "describe", "field", "field_types", "parse_text", "unwrap_optional"]

_INT_TEXT = re.compile(r"[+-]?\d+")
_NONE_TEXT = ("none", "null")
_BOOL_TEXT = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Constraints beyond the type: numeric bounds, allowed strings, a syntax check, help text.

    ``syntax`` receives a string that is not one of ``choices`` and raises ValueError with the
    reason when it is malformed; ``syntax_doc`` says in a few words what it accepts.
    ``default_doc`` says what the default is where the field's own default is not what a run gets
    (a command fills the field in when it is not given).
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    syntax: Callable[[str], object] | None = None
    syntax_doc: str = ""
    help: str = ""
    default_doc: str = ""


_NO_RULE = Rule()


def field(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, help: str = "",
          rule: Rule | None = None, **bounds: Any) -> Any:
    """A dataclass field carrying its help text and a `Rule`: ``rule`` (shared with other code), or
    one built from ``bounds`` (ge, gt, le, lt, choices, syntax, syntax_doc, default_doc)."""
    r = dataclasses.replace(rule, help=help) if rule is not None else Rule(help=help, **bounds)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"rule": r})


def field_types(cls: type) -> dict[str, tuple[Any, Rule]]:
    """``{name: (resolved type, Rule)}`` for every field of dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.metadata.get("rule", _NO_RULE)) for f in dataclasses.fields(cls)}


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for ``X | None``; (tp, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # internal invariant: the schema only uses X | None unions
            raise TypeError(f"unsupported union {tp}")
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # an int bound in full: 18446744073709551615, not 1.84467e+19


def _bounds(rule: Rule) -> str:
    parts = [f"{op} {_number(x)}" for op, x in ((">=", rule.ge), (">", rule.gt), ("<=", rule.le), ("<", rule.lt)) if x is not None]
    return " and ".join(parts)


def describe(tp: Any, rule: Rule = _NO_RULE) -> str:
    """What a field accepts, in words: 'an integer >= 1', 'a finite number > 0 or none', ..."""
    inner, nullable = unwrap_optional(tp)
    if inner is bool:
        text = "true or false"
    elif inner is int:
        text = f"an integer {_bounds(rule)}".rstrip()
    elif inner is float:
        text = f"a finite number {_bounds(rule)}".rstrip()
    elif inner is str:
        opts = [repr(c) for c in rule.choices] + ([rule.syntax_doc] if rule.syntax_doc else [])
        if not opts:
            text = "a string"
        elif len(opts) == 1:
            text = opts[0]
        else:
            text = "one of " + ", ".join(opts)
    elif typing.get_origin(inner) is dict:
        text = "a table of names to values"
    elif dataclasses.is_dataclass(inner):
        text = f"a table of {inner.__name__} fields"
    else:  # internal invariant: a schema only uses the types above
        raise TypeError(f"unsupported field type {inner}")
    return text + (" or none" if nullable else "")


def _fail(label: str, tp: Any, rule: Rule, value: Any, why: str = "") -> ConfigError:
    got = f"{value!r} ({type(value).__name__})"
    return ConfigError(f"config field {label}: expected {describe(tp, rule)}, got {got}{'; ' + why if why else ''}")


def check_value(label: str, value: Any, tp: Any, rule: Rule = _NO_RULE) -> Any:
    """``value`` checked against type ``tp`` and ``rule``; returned normalised (an int for a float field becomes a float).

    Raises ConfigError naming ``label`` (the dotted field name), the value, its type and what was expected.
    """
    inner, nullable = unwrap_optional(tp)
    if nullable and isinstance(value, str) and value.strip().lower() in _NONE_TEXT:
        value = None  # TOML has no null: a config file writes none as the flags do, a string
    if value is None:
        if nullable:
            return None
        raise _fail(label, tp, rule, value)
    if inner is bool:
        if not isinstance(value, bool):
            raise _fail(label, tp, rule, value)
        return value
    if inner in (int, float):
        # bool is an int in Python, but `steps = true` is a mistake, not 1; a float field takes an int.
        ok = isinstance(value, int) if inner is int else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise _fail(label, tp, rule, value)
        if inner is float:
            value = float(value)
            if not math.isfinite(value):
                raise _fail(label, tp, rule, value)
        if ((rule.ge is not None and value < rule.ge) or (rule.gt is not None and value <= rule.gt)
                or (rule.le is not None and value > rule.le) or (rule.lt is not None and value >= rule.lt)):
            raise _fail(label, tp, rule, value)
        return value
    if inner is str:
        if not isinstance(value, str):
            raise _fail(label, tp, rule, value)
        if value in rule.choices or (not rule.choices and rule.syntax is None):
            return value
        if rule.syntax is None:
            raise _fail(label, tp, rule, value)
        try:
            rule.syntax(value)
        except ValueError as e:
            raise _fail(label, tp, rule, value, str(e)) from None
        return value
    if typing.get_origin(inner) is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _fail(label, tp, rule, value)
        return dict(value)
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, inner):
            raise _fail(label, tp, rule, value)
        # A nested config's own validate() adds its cross-field checks (e.g. min_lr <= lr).
        if hasattr(value, "validate"):
            value.validate()
        else:
            check_dataclass(value, prefix=label + ".")
        return value
    raise TypeError(f"unsupported field type {inner}")  # internal invariant


def check_dataclass(obj: Any, *, prefix: str = "") -> None:
    """Check every field of dataclass instance ``obj`` in declaration order, storing the normalised values."""
    for name, (tp, rule) in field_types(type(obj)).items():
        value = check_value(prefix + name, getattr(obj, name), tp, rule)
        if value is not getattr(obj, name):
            setattr(obj, name, value)


def parse_text(label: str, text: str, tp: Any, rule: Rule = _NO_RULE) -> Any:
    """Turn a command-line string into a value of type ``tp`` and check it like `check_value`."""
    inner, nullable = unwrap_optional(tp)
    s = text.strip()
    if nullable and s.lower() in _NONE_TEXT:
        return None
    if inner is int:
        if not _INT_TEXT.fullmatch(s):
            raise _fail(label, tp, rule, text)
        return check_value(label, int(s), tp, rule)
    if inner is float:
        try:
            value = float(s)
        except ValueError:
            raise _fail(label, tp, rule, text) from None
        return check_value(label, value, tp, rule)
    if inner is bool:
        if s.lower() not in _BOOL_TEXT:
            raise _fail(label, tp, rule, text)
        return _BOOL_TEXT[s.lower()]
    if inner is str:
        return check_value(label, text, tp, rule)
    raise TypeError(f"field {label} of type {inner} has no text form")  # internal invariant
