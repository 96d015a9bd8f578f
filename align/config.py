"""Typed pipeline and stage configuration.

A pipeline YAML is parsed into these dataclasses strictly: a key that is not a field is an error that names
the file, the key's path and the closest valid key. Dotted CLI overrides (``dpo.beta=0.2``,
``ppo.kl.target=6``) are applied to the raw YAML before parsing, so they get the same checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml


class ConfigError(ValueError):
    """A pipeline or stage configuration problem, with the file and key that caused it."""


# --------------------------------------------------------------------------------------------- models
@dataclass
class BuiltinModel:
    """Size of the tiny Llama-style model that `base_model: builtin:tiny-llama` builds from scratch."""

    vocab_size: int = 4096
    """BPE vocabulary size of the tokenizer trained on the first stage's corpus."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block."""
    intermediate_size: int = 384
    """Width of the MLP."""
    max_position_embeddings: int = 256
    """Longest sequence the model accepts (prompt + response)."""


@dataclass
class LoraSettings:
    """Optional LoRA adapters (peft). Merged into the weights when the stage saves `model/`."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator (effective scale alpha / r)."""
    dropout: float = 0.05
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""


@dataclass
class Generation:
    """Decoding settings for sampling (rollouts, preference labelling, evaluation)."""

    max_new_tokens: int = 24
    """Longest response in tokens; responses stop earlier at EOS."""
    temperature: float = 1.0
    """Softmax temperature."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    batch_size: int = 64
    """Prompts per generate call."""


# --------------------------------------------------------------------------------------------- stages
@dataclass
class StageBase:
    """Fields every stage has."""

    type: str = ""
    """Stage kind: sft | preferences | reward | dpo | ppo | evaluate (defaults to the stage's name)."""
    accelerate: str = "cpu"
    """Accelerate config: a name under pipelines/accelerate/ (cpu, ddp, zero2, zero3, ...) or a path."""
    num_processes: int | None = None
    """Processes for `accelerate launch` (default: the accelerate config's own value)."""
    seed: int | None = None
    """Seed for this stage (default: the pipeline seed)."""


@dataclass
class TrainedStage(StageBase):
    """Optimisation settings shared by the stages that train with a TRL trainer."""

    learning_rate: float = 5e-4
    """Peak learning rate."""
    lr_scheduler: str = "cosine"
    """transformers scheduler name (linear, cosine, constant, ...)."""
    warmup_ratio: float = 0.05
    """Fraction of steps spent warming up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    epochs: float = 1.0
    """Passes over the training data (ignored when max_steps > 0)."""
    max_steps: int = -1
    """Stop after this many optimiser steps (-1 = use epochs)."""
    per_device_batch_size: int = 16
    """Micro-batch size per process."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimiser step."""
    max_length: int = 128
    """Longest tokenised example (after the chat template); longer ones are truncated or dropped by the trainer."""
    max_truncated_fraction: float = 0.05
    """Refuse to train when more than this fraction of examples exceed max_length (counted before training)."""
    logging_steps: int = 10
    """Log metrics every N optimiser steps."""
    save_steps: int = 50
    """Write a resumable checkpoint every N optimiser steps."""
    max_train_examples: int | None = None
    """Use at most this many training examples (None = all)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute. Off by default
    (TRL turns it on); `align estimate` and the memory preflight say when a stage needs it to fit."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters instead of full fine-tuning."""


@dataclass
class SFTStage(TrainedStage):
    """Supervised fine-tuning with TRL's SFTTrainer."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("train/loss_final_avg", "eval/loss")
    """Final metrics in the one-line result on the console and in `align status`."""

    model: str = "base"
    """Starting model: `base` (the pipeline's base_model) or the name of an earlier stage."""
    data: str = ""
    """Data card path (prompt_completion or messages form)."""
    split: str = "train"
    """Which split of the card to train on."""
    completion_only_loss: bool = True
    """Compute the loss on completion tokens only (prompt tokens masked)."""
    eval_split: str | None = "test"
    """Split whose loss is reported after training (None = skip)."""
    eval_max_examples: int = 256
    """Evaluate on at most this many examples."""


@dataclass
class PreferencesStage(StageBase):
    """Sample several completions per prompt from a policy and keep judged (chosen, rejected) pairs."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("preferences/pairs_train", "preferences/mean_margin")
    """Final metrics in the one-line result on the console and in `align status`."""

    policy: str = "sft"
    """Stage whose model/ samples the completions."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    max_prompts: int | None = 2048
    """Use at most this many prompts."""
    samples_per_prompt: int = 4
    """Completions per prompt (>= 2); the best and worst by the judge form the pair."""
    judge: str | dict[str, float] = "vader"
    """A reward stage, a Python judge (vader, or your own module:function), or a weighted sum of them as a
    mapping (see align/judges.py)."""
    min_margin: float = 0.05
    """Pairs whose judge scores differ by less than this are ties: dropped and counted."""
    test_fraction: float = 0.1
    """Fraction of prompts whose pairs go to the held-out `test` split."""
    generation: Generation = field(default_factory=Generation)
    """Decoding settings."""


@dataclass
class RewardStage(TrainedStage):
    """Pairwise (Bradley-Terry) reward model with TRL's RewardTrainer."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy",)
    """Final metrics in the one-line result on the console and in `align status`."""

    init: str = "sft"
    """Stage whose model/ initialises the reward model (a scalar head is added)."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    center_rewards_coefficient: float | None = None
    """Optional penalty keeping rewards centred at zero (TRL)."""


@dataclass
class DPOStage(TrainedStage):
    """Direct preference optimisation with TRL's DPOTrainer; reference = the starting policy."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy", "eval/rewards/margin")
    """Final metrics in the one-line result on the console and in `align status`."""

    policy: str = "sft"
    """Stage whose model/ is both the starting policy and the frozen reference."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    beta: float = 0.1
    """KL strength beta of the DPO objective."""
    loss_type: str = "sigmoid"
    """TRL DPO loss variant: sigmoid (DPO), ipo, hinge, robust, ..."""
    label_smoothing: float = 0.0
    """Conservative-DPO label smoothing."""


@dataclass
class KLSettings:
    """KL penalty to the reference policy (Ziegler et al. 2019)."""

    coef: float = 0.05
    """Initial beta of the per-token penalty -beta * KL."""
    adaptive: bool = True
    """Adapt beta towards `target` with Ziegler et al.'s proportional controller."""
    target: float = 4.0
    """Target KL (nats per response) for the adaptive controller."""
    horizon: int = 10000
    """Controller horizon in episodes: beta moves by at most 20% x episodes-per-iteration / horizon per
    iteration (Ziegler et al. used 10000 with 512 episodes per update over thousands of updates; a short run
    needs a short horizon for beta to move at all)."""
    estimator: str = "k1"
    """Per-token KL estimator in the reward: k1 (log-ratio), k2 or k3 (Schulman 2020)."""


@dataclass
class PPOStage(StageBase):
    """PPO against a frozen reward model or Python judges, with a KL penalty to the reference (align's own)."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("objective/scores_last", "objective/kl_last")
    """Final metrics in the one-line result on the console and in `align status`."""

    policy: str = "sft"
    """Stage whose model/ is the starting policy and the frozen reference."""
    reward: str | dict[str, float] = "reward"
    """What PPO maximises: a reward stage (frozen reward model), a Python judge (`vader`, or a user's
    `module:function` taking (prompts, responses) and returning floats), or a weighted sum of these as a
    mapping, e.g. {reward: 1.0, vader: 0.5}."""
    value_init: str = "reward"
    """Initialise the value model from `reward` (the reward model with its head; needs a reward stage) or
    `policy` (the policy's transformer with a fresh scalar head)."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    iterations: int = 40
    """PPO iterations (rollout + update)."""
    rollout_batch_size: int = 64
    """Prompts per iteration per process."""
    mini_batch_size: int = 16
    """Episodes per optimiser step (before accumulation)."""
    gradient_accumulation_steps: int = 1
    """Mini-batches per optimiser step."""
    ppo_epochs: int = 4
    """Passes over each rollout."""
    learning_rate: float = 1e-5
    """Policy learning rate."""
    value_learning_rate: float = 1e-5
    """Value model learning rate."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    clip_range: float = 0.2
    """Policy ratio clip epsilon."""
    clip_range_value: float = 0.2
    """Value clip range."""
    vf_coef: float = 0.1
    """Value loss weight."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    max_approx_kl: float | None = None
    """Stop the epoch loop early when approximate KL exceeds this."""
    max_grad_norm: float | None = 1.0
    """Clip the policy's and the value model's gradient norms to this, each separately, on every backend
    (None = no clipping)."""
    missing_eos_penalty: float | None = 1.0
    """Subtracted from the (normalised) score of responses that never emit EOS (None = off)."""
    reward_normalization: str = "initial"
    """initial: a fixed gain and bias from rollouts of the initial policy, so its scores have mean 0 and
    std 1 (Ziegler et al. 2019, sec. 2.2); the value model is read in the same units. running: running
    mean/std of every score seen (drifts during training). none: raw scores."""
    reward_normalization_samples: int = 256
    """Initial-policy rollouts (over all processes) that fix the gain and bias of `initial` normalisation."""
    max_prompt_length: int = 32
    """Prompts longer than this (tokens) are an error at validation time."""
    save_every: int = 10
    """Checkpoint every N iterations."""
    sample_every: int = 10
    """Log a table of sample responses every N iterations."""
    kl: KLSettings = field(default_factory=KLSettings)
    """KL penalty settings."""
    generation: Generation = field(default_factory=Generation)
    """Rollout decoding settings."""


@dataclass
class EvaluateStage(StageBase):
    """Sample held-out prompts from each policy and compare them with judges, KL and win rates."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/prompts",)
    """Final metrics in the one-line result on the console and in `align status`."""

    policies: list[str] = field(default_factory=lambda: ["sft"])
    """Stages whose model/ to evaluate."""
    baseline: str = "sft"
    """Policy that win rates are measured against."""
    reference: str = "sft"
    """Policy that KL is measured against."""
    reward: str | None = "reward"
    """Reward stage used as a judge and for reward-model accuracy (None = skip)."""
    preferences: str | None = "preferences"
    """Preferences stage whose held-out pairs measure reward-model accuracy (None = skip)."""
    judges: list[str] = field(default_factory=lambda: ["vader"])
    """Python judges (vader, or your own module:function), gold scorers reported beside the reward model."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "test"
    """Held-out split of the card."""
    max_prompts: int | None = 512
    """Evaluate on at most this many prompts."""
    bootstrap_samples: int = 2000
    """Bootstrap resamples for confidence intervals."""
    generation: Generation = field(default_factory=Generation)
    """Decoding settings (identical for every policy)."""


STAGE_TYPES: dict[str, type[StageBase]] = {
    "sft": SFTStage,
    "preferences": PreferencesStage,
    "reward": RewardStage,
    "dpo": DPOStage,
    "ppo": PPOStage,
    "evaluate": EvaluateStage,
}

# Fields whose value may name another stage; `required` ones must.
STAGE_REFERENCE_FIELDS: dict[str, dict[str, bool]] = {
    "sft": {"model": False},
    "preferences": {"policy": True, "judge": False},
    "reward": {"init": True, "data": False},
    "dpo": {"policy": True, "data": False},
    "ppo": {"policy": True, "reward": False},
    "evaluate": {"policies": True, "baseline": True, "reference": True, "reward": True, "preferences": True},
}


@dataclass
class Tracking:
    """Experiment tracking."""

    wandb: str = "auto"
    """auto (online with an API key, offline without) | online | offline | disabled."""
    project: str = "align"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


@dataclass
class Hardware:
    """The GPUs a pipeline is sized for. `align estimate` and `align run` compare per-GPU memory estimates with
    it; unset fields are detected from the GPUs present (none on a CPU machine: nothing to compare)."""

    nodes: int = 1
    """Machines in the job."""
    gpus_per_node: int | None = None
    """GPUs (processes) per machine for distributed stages (None = torch.cuda.device_count())."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU in GB (1e9 bytes; None = detected)."""


@dataclass
class PipelineConfig:
    """A whole pipeline: base model, stages in any order (the graph comes from their inputs)."""

    name: str = ""
    """Pipeline name: runs go to runs/<name>/<run_id>/."""
    base_model: str = "builtin:tiny-llama"
    """Local path, hub id, or builtin:tiny-llama (built from `builtin` with a BPE tokenizer trained on the
    first stage's corpus)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id (default: the base model's own)."""
    base_model_config: str | None = None
    """A copy of the base model's config.json (path relative to the pipeline file), so `align estimate` can size
    a hub model on a machine that cannot reach the hub. The model itself is still loaded from base_model."""
    hardware: Hardware = field(default_factory=Hardware)
    """GPUs the pipeline is sized for (memory preflight)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code. Off unless you set it."""
    builtin: BuiltinModel = field(default_factory=BuiltinModel)
    """Size of the builtin model."""
    dtype: str = "float32"
    """Weights dtype for loading (float32 | bfloat16 | float16)."""
    seed: int = 17
    """Default seed of every stage."""
    run_id: str = "main"
    """Run directory name; re-running with the same id skips completed stages by fingerprint."""
    runs_dir: str = "runs"
    """Root of run directories."""
    tracking: Tracking = field(default_factory=Tracking)
    """W&B settings."""
    stages: dict[str, StageBase] = field(default_factory=dict)
    """Stage name -> stage config."""


# --------------------------------------------------------------------------------------------- parsing
def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` (after `from __future__` evaluation)."""
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
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass `cls` from `data`, rejecting unknown keys with the closest valid one."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key '{key}'{_closest(str(key), names)}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; a first segment naming a stage addresses `stages.<name>`."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected dotted.key=value, e.g. dpo.beta=0.2")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if parts[0] in (raw.get("stages") or {}):
            parts = ["stages", *parts]
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a mapping")
        node[parts[-1]] = yaml.safe_load(text)
    return raw


def parse_pipeline(raw: dict[str, Any], source: str) -> PipelineConfig:
    """Strictly parse a raw pipeline mapping (already overridden)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the file must hold a mapping with `name` and `stages`")
    raw = dict(raw)
    stages_raw = raw.pop("stages", None) or {}
    if not isinstance(stages_raw, dict) or not stages_raw:
        raise ConfigError(f"{source}: `stages` must map stage names to their settings (none given)")
    cfg: PipelineConfig = from_dict(PipelineConfig, raw, source)
    if not cfg.name:
        cfg.name = Path(source).stem
    for name, body in stages_raw.items():
        body = dict(body or {})
        kind = body.get("type") or name
        if kind not in STAGE_TYPES:
            raise ConfigError(
                f"{source}: stages.{name}: unknown stage type '{kind}'{_closest(kind, list(STAGE_TYPES))}"
                " (set `type:` when the stage's name is not its type)"
            )
        body["type"] = kind
        cfg.stages[name] = from_dict(STAGE_TYPES[kind], body, f"{source}: stages.{name}")
    return cfg


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a pipeline YAML, apply dotted overrides, parse strictly."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: pipeline file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    raw = apply_overrides(raw or {}, overrides or [])
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


def stage_from_dict(data: dict[str, Any]) -> StageBase:
    """Rebuild a stage config from `to_dict` output (used by the stage subprocess)."""
    return from_dict(STAGE_TYPES[data["type"]], data, f"stage spec ({data['type']})")
