"""How a config field declares its valid values, and the strict parser that enforces them.

A field states its range or choices where it is declared, next to its docstring:

    beta: float = ranged(0.1, gt=0, fix="a negative beta trains the reversed objective")
    \"\"\"KL strength beta of the DPO objective.\"\"\"

`from_dict` checks every value it parses against its field's rule, so `align validate` and the stage
process (which re-parses its spec.json through the same code) refuse the same values with the same message:
the field's dotted path, the value, the valid range and the fix. `None` is never range-checked: where a
field allows it, its docstring says what it means (usually "all" or "off"); 0 and negatives never mean "all".
"""

from __future__ import annotations

import math
import dataclasses
import datetime
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml


MAX_INT = 2 ** 53  # the largest integer every setting keeps exactly (as a float too); anything larger is a typo


class ConfigError(ValueError):
    """A pipeline or stage configuration problem, with the file and key that caused it."""


# --------------------------------------------------------------------------------------------- rules
def _num(x: float) -> str:
    """A bound as written: integers exactly (2147483647, not 2.14748e+09), other numbers in %g."""
    return str(int(x)) if float(x).is_integer() and abs(x) < MAX_INT else f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """Valid values of one field: numeric bounds, a set of choices, or a plain name."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    plain_name: bool = False
    fix: str = ""

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.plain_name:
            return "a plain name (letters, digits, '.', '_', '-'; 1 to 100 characters; not '.' or '..')"
        lo = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else "(-inf"
        hi = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else "inf)"
        if hi == "inf)":
            return f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        return f"in {lo}, {hi}"

    def accepts(self, value: Any) -> bool:
        if self.choices:
            return value in self.choices
        if self.plain_name:
            return is_plain_name(value)
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
                and value == value)  # NaN is in no range


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, fix: str = "") -> Any:
    """A numeric field with bounds (None, where the type allows it, is not checked)."""
    return field(default=default, metadata={"rule": Rule(ge=ge, gt=gt, le=le, lt=lt, fix=fix)})


def step_size(default: float) -> Any:
    """A learning rate: above 0, and at most 1 (AdamW's are 1e-7..1e-3: `1e5` is a lost minus sign)."""
    return ranged(default, gt=0, le=1, fix="a learning rate is around 1e-7 to 1e-3 for AdamW; 1e5 is 100000 (did you "
                                          "mean 1e-5?)")


def one_of(default: Any, *choices: str, fix: str = "") -> Any:
    """A field whose value must be one of `choices`."""
    return field(default=default, metadata={"rule": Rule(choices=tuple(choices), fix=fix)})


def name_field(default: str, fix: str = "") -> Any:
    """A field that becomes a directory name: a plain name, never a path."""
    return field(default=default, metadata={"rule": Rule(plain_name=True, fix=fix)})


_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,100}")


def is_plain_name(value: Any) -> bool:
    return isinstance(value, str) and bool(_PLAIN.fullmatch(value)) and value not in (".", "..")


def check_plain_name(value: Any, where: str) -> None:
    if not is_plain_name(value):
        raise ConfigError(f"{where}: {str(value)[:120]!r} is not {Rule(plain_name=True).describe()}; it becomes a "
                          "directory name under runs/, so it must not be a path")


def check_rule(f: dataclasses.Field, value: Any, where: str) -> None:
    rule: Rule | None = f.metadata.get("rule")
    if rule is None or value is None or rule.accepts(value):
        return
    shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:120] + "..."
    raise ConfigError(f"{where}: {shown} is not allowed: must be {rule.describe()}"
                      + (f"; {rule.fix}" if rule.fix else ""))


# --------------------------------------------------------------------------------------------- parsing
def closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _yaml_hint(value: Any) -> str:
    """Why YAML gave a non-string where a string was meant: an unquoted yes/no/on/off, a number or a date."""
    if isinstance(value, bool):
        return "; YAML reads yes/no/on/off/true/false as a boolean: quote the word"
    if isinstance(value, (int, float, datetime.date)):
        return "; YAML read it as a number or a date: quote it"
    return ""  # a list, a mapping, null: no quoting makes it a string


_KINDS = ((str, "a string", str), (bool, "true or false", bool), (int, "an integer", int), (float, "a number", (int, float)),
          (list, "a list", list), (dict, "a mapping", dict))


def _kind(tp: Any) -> tuple[str, Any]:
    """How an error names annotation `tp`, and the Python types of values of its shape."""
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields", dict
    origin = typing.get_origin(tp) or tp
    return next(((name, shape) for t, name, shape in _KINDS if origin is t), (str(tp), object))


def _coerce_union(value: Any, args: tuple, where: str) -> Any:
    """`value` as the first alternative of a union it fits; else the error of the alternative of its own shape,
    or one naming every alternative."""
    if value is None and type(None) in args:
        return None
    errors, kinds = [], []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, where)
        except ConfigError as exc:
            name, shape = _kind(arg)
            if isinstance(value, shape) and (arg is bool or not isinstance(value, bool)):
                raise  # the alternative of the value's own shape says what is wrong inside it
            errors.append(str(exc))
            kinds.append(name)
    if len(kinds) > 1:  # `judge: [vader]` where a name or a weighted mapping is meant
        null = ", or null" if type(None) in args else ""
        raise ConfigError(f"{where}: expected {' or '.join(kinds)}{null}, got {value!r}{_yaml_hint(value)}")
    raise ConfigError(errors[0] if errors else f"{where}: got {value!r}")


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` (after `from __future__` evaluation)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(tp), where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        return {coerce(k, key_tp, f"{where} (a key)"): coerce(v, value_tp, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ConfigError(f"{where}: {value} is out of range: numbers are at most {MAX_INT:.0e} in size")
        if not math.isfinite(value):  # NaN, inf, and YAML's 1e400 (read as inf)
            raise ConfigError(f"{where}: {value!r} is not a finite number; give a finite value")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if abs(value) > MAX_INT:
            raise ConfigError(f"{where}: {value} is out of range: integer settings are at most {MAX_INT:,} "
                              "(2**53) in size")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}{_yaml_hint(value)}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{where}: unsupported type {getattr(tp, '__name__', str(tp))}")


def from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from `data`: unknown keys name the closest valid one, every value is checked
    against its type and its field's declared rule."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    top = where.endswith(":")  # the pipeline file itself: "file.yaml: key", nested: "file.yaml: a.b"
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{where.rstrip(':')}: unknown key '{key}'{closest(str(key), list(fields))}")
        path = f"{where} {key}" if top else f"{where}.{key}"
        rule = fields[key].metadata.get("rule")
        if isinstance(value, bool) and rule is not None and {"on", "off"} <= set(rule.choices or ()):
            value = "on" if value else "off"  # YAML 1.1 reads an unquoted on/off as true/false
        kwargs[key] = coerce(value, hints[key], path)
        check_rule(fields[key], kwargs[key], path)
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------- YAML
class StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML would silently keep the last); merge keys
    (`<<: *anchor`) work as in YAML 1.1."""


def _no_duplicates(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged by construct_mapping, and the
            continue                                   # mapping's own keys override the merged ones (YAML 1.1)
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"line {line}: key '{key}' is given twice (first on line {seen[key]}); YAML would "
                              "silently keep the last value. Remove one of them")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def strict_yaml(text: str) -> Any:
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
