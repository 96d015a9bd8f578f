"""Stage sweeps: one stage of a pipeline fanned out over values of its settings, expanded at parse time.

```yaml
dpo:
  policy: sft
  sweep: {beta: [0.05, 0.1, 0.3]}                                   # one variant per value
ppo:
  sweep: {mode: zip, kl.coef: [0.05, 0.2], learning_rate: [1.0e-4, 5.0e-5]}   # dotted keys; cartesian or zip
```

Every variant is an ordinary stage: the stage's body with `sweep` removed and one combination of values set
(dotted keys address nested settings), parsed as strictly as any stage. Its name is the stage's name followed
by `-<key>_<value>` per swept key (`dpo-beta_0.05`, `ppo-kl.coef_0.05-learning_rate_0.0001`), so it is a plain
name (its run directory) that shows its values. `mode: cartesian` (the default) takes every combination, the
first key varying slowest; `mode: zip` takes the i-th value of every list. A sweep of more than 64 variants is
refused before expansion unless it says `max_variants: N`.

References: a field that takes a list of stages (evaluate's `policies`) lists every variant of a swept stage
named in it, in sweep order; any other field that names a swept stage is an error naming its variants, since
it must say which one it means.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

from align.core.schema import ConfigError, check_rule, closest, coerce, is_plain_name

SWEEP = "sweep"
MODES = ("cartesian", "zip")
MAX_VARIANTS = 64
"""The most variants one sweep expands to unless its `max_variants` says more (a typo'd list of 10,000 values
would otherwise plan 10,000 stages)."""


@dataclass
class Variant:
    """One expanded variant of a swept stage."""

    name: str
    """The variant's stage name (and run directory): `<stage>-<key>_<value>...`."""
    body: dict[str, Any]
    """The stage's raw settings with `sweep` removed and this variant's values set."""
    values: dict[str, Any]
    """Dotted key -> the value this variant takes, as written in the sweep."""


# --------------------------------------------------------------------------------------------- expansion
def expand(name: str, body: dict[str, Any], cls: type, where: str) -> list[Variant]:
    """The variants of stage `name` (settings `body`, config class `cls`); `where` is `<file>: stages.<name>`."""
    sweep = body[SWEEP]
    if getattr(cls, "PRODUCES", "") == "report":
        raise ConfigError(f"{where}.{SWEEP}: a stage of type {cls.TYPE} writes the run's one report/, so its "
                          "variants would overwrite each other; sweep the stages it evaluates instead (all variants "
                          "in one report)")
    if not isinstance(sweep, dict) or not sweep:
        raise ConfigError(f"{where}.{SWEEP}: expected a mapping of settings to lists of values, e.g. "
                          f"`{SWEEP}: {{beta: [0.05, 0.1]}}`, got {str(sweep)[:80]!r}")
    lists = dict(sweep)
    named_mode = "mode" in lists and not isinstance(lists["mode"], list)  # a list: a setting named mode
    mode = lists.pop("mode") if named_mode else "cartesian"
    if mode not in MODES:
        raise ConfigError(f"{where}.{SWEEP}.mode: {mode!r} is not one of {', '.join(MODES)}")
    bound = lists.pop("max_variants", MAX_VARIANTS)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise ConfigError(f"{where}.{SWEEP}.max_variants: {bound!r} is not a positive whole number (the most "
                          f"variants this sweep may expand to; {MAX_VARIANTS} when not given)")
    if not lists:
        raise ConfigError(f"{where}.{SWEEP}: no setting to sweep (only `mode` / `max_variants`)")
    for key, values in lists.items():
        _check_key(str(key), values, cls, f"{where}.{SWEEP}.{key}")
    lengths = {k: len(v) for k, v in lists.items()}
    if mode == "zip" and len(set(lengths.values())) > 1:  # before the bound, whose count reads the first list
        raise ConfigError(f"{where}.{SWEEP}: mode zip pairs the i-th values of every list, but the lists differ in "
                          f"length ({', '.join(f'{k}: {n}' for k, n in lengths.items())}); give them equal "
                          "lengths, or use mode: cartesian for every combination")
    count = len(next(iter(lists.values()))) if mode == "zip" else math.prod(len(v) for v in lists.values())
    if count > bound:  # refused before anything is expanded: each variant is a stage to plan and train
        shape = " x ".join(str(len(v)) for v in lists.values()) if mode != "zip" else f"zip of {count}"
        raise ConfigError(f"{where}.{SWEEP}: {count} variants ({shape} values) exceed the bound of {bound}; sweep fewer values, or raise it with "
                          f"`max_variants: {count}` in the sweep if you mean it")
    combos = list(zip(*lists.values())) if mode == "zip" else list(itertools.product(*lists.values()))
    base = {k: v for k, v in body.items() if k != SWEEP}
    variants: list[Variant] = []
    for combo in combos:
        values = dict(zip(lists, combo))
        vname = variant_name(name, values)
        if not is_plain_name(vname):
            raise ConfigError(f"{where}.{SWEEP}: the variant name {vname[:120]!r} is longer than 100 characters "
                              "(it becomes a directory name); sweep fewer keys, or give the stage a shorter name")
        same = next((v for v in variants if v.name == vname), None)
        if same is not None:
            raise ConfigError(f"{where}.{SWEEP}: two variants are both named '{vname}' ({same.values} and {values}): "
                              + ("every value of a sweep must be distinct" if same.values == values else
                                 "a variant's name keeps letters, digits, '.', '-' and '_' of its values, and these "
                                 "differ only elsewhere; give values that differ in those characters"))
        variant_body = copy.deepcopy(base)
        for key, value in values.items():
            _set(variant_body, key.split("."), copy.deepcopy(value), f"{where}.{key}")
        variants.append(Variant(vname, variant_body, values))
    return variants


def by_stage(variants: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """Swept stage -> its variants in sweep order, from pipeline `variants` (variant -> {stage, values})."""
    out: dict[str, list[str]] = {}
    for variant, v in variants.items():
        out.setdefault(v["stage"], []).append(variant)
    return out


def variant_name(stage: str, values: dict[str, Any]) -> str:
    """`dpo` with {beta: 0.05} -> `dpo-beta_0.05`; characters a directory name cannot hold become `_`."""
    return "-".join([stage, *(f"{key}_{_label(v)}" for key, v in values.items())])


def _label(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, list):
        text = "_".join(_label(v) for v in value)
    elif isinstance(value, dict):
        text = "_".join(f"{k}{_label(v)}" for k, v in value.items())
    else:
        text = str(value)  # floats as Python writes them: 0.05, 0.0001, 5e-05
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "_"


def _check_key(key: str, values: Any, cls: type, at: str) -> None:
    """`key` is a (dotted) setting of `cls`; `values` a non-empty list of values it accepts (the same type and
    range checks as a value written in the stage itself)."""
    if key == "type":
        raise ConfigError(f"{at}: the stage type cannot be swept (every variant is a stage of the same type); "
                          "write one stage per type")
    tp, fld = cls, None
    for i, part in enumerate(key.split(".")):
        tp = dataclass_of(tp)
        if tp is None:
            raise ConfigError(f"{at}: '{'.'.join(key.split('.')[:i])}' is not a group of settings, so it has no "
                              f"'{part}'")
        fields = {f.name: f for f in dataclasses.fields(tp)}
        if part not in fields:
            kind = getattr(cls, "TYPE", cls.__name__)
            group = f"'{'.'.join(key.split('.')[:i])}' in " if i else ""
            raise ConfigError(f"{at}: '{part}' is not a setting of {group}a {kind} stage{closest(part, list(fields))}")
        fld, tp = fields[part], typing.get_type_hints(tp)[part]
    if dataclass_of(tp) is not None:  # a whole group: each variant would reset the group's other settings
        raise ConfigError(f"{at}: '{key}' is a group of settings; sweep one setting in it with a dotted key, e.g. "
                          f"`{key}.{dataclasses.fields(dataclass_of(tp))[0].name}: [...]`")
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{at}: expected a non-empty list of values, e.g. `{key}: [0.05, 0.1]`, got "
                          f"{str(values)[:80]!r}" + ("; for a nested setting use a dotted key such as kl.coef"
                                                    if isinstance(values, dict) else ""))
    for i, value in enumerate(values):
        checked = coerce(value, tp, f"{at}[{i}]")
        check_rule(fld, checked, f"{at}[{i}]")


def dataclass_of(tp: Any) -> type | None:
    """The dataclass an annotation holds (`Generation`, `KLSettings | None`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _set(body: dict[str, Any], parts: list[str], value: Any, at: str) -> None:
    """Set a dotted key in a raw stage body (replacing the stage's own value: the sweep gives every value)."""
    node = body
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{at}: '{part}' is a group of settings; write it as a mapping, got {node!r}")
    node[parts[-1]] = value


def override_conflicts(raw: dict[str, Any], paths: list[tuple[str, list[str], str]]) -> None:
    """An override (`dpo.beta=0.3`) of a key that its stage sweeps would replace every variant's value: refused,
    with the fix (edit the sweep's list). `paths`: (stage, key path inside the stage, the override as given)."""
    for stage, parts, item in paths:
        body = (raw.get("stages") or {}).get(stage)
        sweep = body.get(SWEEP) if isinstance(body, dict) else None  # not a mapping: parsing says so, by name
        if not isinstance(sweep, dict) or parts[:1] == [SWEEP]:
            continue
        for key in sweep:
            swept = str(key).split(".")
            n = min(len(swept), len(parts))
            if key != "mode" and swept[:n] == parts[:n]:
                whole = ", ".join(f"{k}: {json.dumps(v)}" for k, v in sweep.items())  # the sweep replaces whole
                example = f"'{stage}.{SWEEP}={{{whole}}}' with {key}'s list edited" if "." in str(key) else \
                    f"{stage}.{SWEEP}.{key}=[0.1,0.3]"  # a dotted key would be read as a group of the sweep
                raise ConfigError(f"override '{item}': stages.{stage} sweeps {key} ({sweep[key]}); an override "
                                  f"cannot set one value for all of its variants. Override the list instead, e.g. "
                                  f"{example}, or remove {key} from the sweep")


# --------------------------------------------------------------------------------------------- references
def resolve_references(stages: dict[str, Any], swept: dict[str, list[str]], source: str) -> None:
    """Point references to swept stages at their variants: a list field (evaluate's `policies`) gets every
    variant in sweep order; a field that names one stage must name one variant (an error says which)."""
    if not swept:
        return
    for name, st in stages.items():
        for fld in type(st).INPUTS:
            value = getattr(st, fld)
            if isinstance(value, list):
                setattr(st, fld, list(dict.fromkeys(v for ref in value for v in swept.get(ref, [ref]))))
                continue
            named = list(value) if isinstance(value, dict) else [value]
            for ref in named:
                if ref in swept:
                    raise ConfigError(
                        f"{source}: stages.{name}.{fld}: '{ref}' is swept into {len(swept[ref])} stages "
                        f"({', '.join(swept[ref])}); {fld} takes one stage, so name the variant it means, e.g. "
                        f"`{fld}: {swept[ref][0]}` (only a field that takes a list, such as evaluate's policies, "
                        "may name the swept stage to mean all of its variants)")
