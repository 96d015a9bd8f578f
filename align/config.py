"""Typed pipeline and stage configuration.

A pipeline YAML is parsed into these dataclasses strictly: a key that is not a field is an error that names
the file, the key's path and the closest valid key. Dotted CLI overrides (``dpo.beta=0.2``,
``ppo.kl.target=6``) are applied to the raw YAML before parsing, so they get the same checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from align.schema import (ConfigError, check_plain_name, closest, from_dict, name_field, one_of, ranged,
                          strict_yaml)

__all__ = ["ConfigError", "from_dict"]  # re-exported: callers parse through align.config

DTYPES = ("float32", "bfloat16", "float16")
# transformers SchedulerType values that need no extra scheduler kwargs (tests check they still exist).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
# TRL DPOConfig.loss_type values for paired data (tests check they still exist in the installed TRL).
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "apo_zero", "apo_down", "discopop", "sigmoid_norm")


# --------------------------------------------------------------------------------------------- models
@dataclass
class BuiltinModel:
    """Size of the tiny Llama-style model that `base_model: builtin:tiny-llama` builds from scratch."""

    vocab_size: int = ranged(4096, ge=16)
    """BPE vocabulary size of the tokenizer trained on the first stage's corpus."""
    hidden_size: int = ranged(128, ge=1)
    """Width of the residual stream."""
    num_layers: int = ranged(4, ge=1)
    """Number of transformer blocks."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads per block."""
    intermediate_size: int = ranged(384, ge=1)
    """Width of the MLP."""
    max_position_embeddings: int = ranged(256, ge=2)
    """Longest sequence the model accepts (prompt + response)."""


@dataclass
class LoraSettings:
    """Optional LoRA adapters (peft). Merged into the weights when the stage saves `model/`."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    r: int = ranged(16, ge=1)
    """Adapter rank."""
    alpha: int = ranged(32, ge=1)
    """Scaling numerator (effective scale alpha / r)."""
    dropout: float = ranged(0.05, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""


@dataclass
class Generation:
    """Decoding settings for sampling (rollouts, preference labelling, evaluation)."""

    max_new_tokens: int = ranged(24, ge=1, fix="a response needs at least one token")
    """Longest response in tokens; responses stop earlier at EOS."""
    temperature: float = ranged(1.0, gt=0, fix="sampling divides logits by it; greedy decoding is not offered")
    """Softmax temperature."""
    top_k: int | None = ranged(None, ge=1, fix="use null to keep every token")
    """Keep only the k most likely tokens (None = off)."""
    top_p: float = ranged(1.0, gt=0, le=1, fix="1.0 turns nucleus sampling off")
    """Nucleus sampling mass (1.0 = off)."""
    batch_size: int = ranged(64, ge=1)
    """Prompts per generate call."""


# --------------------------------------------------------------------------------------------- stages
@dataclass
class StageBase:
    """Fields every stage has."""

    PRODUCES: ClassVar[str] = ""
    """What the stage publishes: policy (a causal LM in model/), reward (a scalar model in model/), data
    (preference pairs in data/) or report."""
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {}
    """Fields that may name another stage -> (role the stage must produce, whether the field must name a
    stage). Role `judge`: a reward stage or a Python judge (align/judges.py); `data`: a data stage or a card."""

    type: str = ""
    """Stage kind: sft | preferences | reward | dpo | ppo | evaluate (defaults to the stage's name)."""
    accelerate: str = "cpu"
    """Accelerate config: a name under pipelines/accelerate/ (cpu, ddp, zero2, zero3, ...) or a path."""
    num_processes: int | None = ranged(None, ge=1, fix="use null for the accelerate config's own value")
    """Processes for `accelerate launch` (default: the accelerate config's own value)."""
    seed: int | None = ranged(None, ge=0)
    """Seed for this stage (default: the pipeline seed)."""


@dataclass
class TrainedStage(StageBase):
    """Optimisation settings shared by the stages that train with a TRL trainer."""

    learning_rate: float = ranged(5e-4, gt=0)
    """Peak learning rate."""
    lr_scheduler: str = one_of("cosine", *LR_SCHEDULERS)
    """transformers scheduler name (linear, cosine, constant, ...)."""
    warmup_ratio: float = ranged(0.05, ge=0, lt=1)
    """Fraction of steps spent warming up."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    epochs: float = ranged(1.0, gt=0, fix="zero or negative epochs train nothing; use max_steps for a step count")
    """Passes over the training data (ignored when max_steps is set)."""
    max_steps: int | None = ranged(None, ge=1, fix="use null to let `epochs` decide the length")
    """Stop after this many optimiser steps (None = use epochs)."""
    per_device_batch_size: int = ranged(16, ge=1)
    """Micro-batch size per process."""
    gradient_accumulation_steps: int = ranged(1, ge=1)
    """Micro-batches per optimiser step."""
    max_length: int = ranged(128, ge=2)
    """Longest tokenised example (after the chat template); longer ones are truncated or dropped by the trainer."""
    max_truncated_fraction: float = ranged(0.05, ge=0, le=1)
    """Refuse to train when more than this fraction of examples exceed max_length (counted before training)."""
    logging_steps: int = ranged(10, ge=1)
    """Log metrics every N optimiser steps."""
    save_steps: int = ranged(50, ge=1)
    """Write a resumable checkpoint every N optimiser steps."""
    max_train_examples: int | None = ranged(None, ge=1, fix="use null for all examples")
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
    PRODUCES: ClassVar[str] = "policy"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"model": ("policy", False)}

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
    eval_max_examples: int = ranged(256, ge=1, fix="set eval_split: null to skip the evaluation")
    """Evaluate on at most this many examples."""


@dataclass
class PreferencesStage(StageBase):
    """Sample several completions per prompt from a policy and keep judged (chosen, rejected) pairs."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("preferences/pairs_train", "preferences/mean_margin")
    """Final metrics in the one-line result on the console and in `align status`."""
    PRODUCES: ClassVar[str] = "data"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": ("policy", True), "judge": ("judge", False)}

    policy: str = "sft"
    """Stage whose model/ samples the completions."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    max_prompts: int | None = ranged(2048, ge=1, fix="use null for all prompts")
    """Use at most this many prompts (None = all)."""
    samples_per_prompt: int = ranged(4, ge=2, fix="a pair needs two completions")
    """Completions per prompt (>= 2); the best and worst by the judge form the pair."""
    judge: str | dict[str, float] = "vader"
    """A reward stage, a Python judge (vader, or your own module:function), or a weighted sum of them as a
    mapping (see align/judges.py)."""
    min_margin: float = ranged(0.05, ge=0)
    """Pairs whose judge scores differ by less than this are ties: dropped and counted."""
    test_fraction: float = ranged(0.1, gt=0, lt=1, fix="the reward and evaluate stages need held-out pairs")
    """Fraction of prompts whose pairs go to the held-out `test` split."""
    generation: Generation = field(default_factory=Generation)
    """Decoding settings."""


@dataclass
class RewardStage(TrainedStage):
    """Pairwise (Bradley-Terry) reward model with TRL's RewardTrainer."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy",)
    """Final metrics in the one-line result on the console and in `align status`."""
    PRODUCES: ClassVar[str] = "reward"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"init": ("policy", True), "data": ("data", False)}

    init: str = "sft"
    """Stage whose model/ initialises the reward model (a scalar head is added)."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    center_rewards_coefficient: float | None = ranged(None, ge=0)
    """Optional penalty keeping rewards centred at zero (TRL)."""


@dataclass
class DPOStage(TrainedStage):
    """Direct preference optimisation with TRL's DPOTrainer; reference = the starting policy."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy", "eval/rewards/margin")
    """Final metrics in the one-line result on the console and in `align status`."""
    PRODUCES: ClassVar[str] = "policy"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": ("policy", True), "data": ("data", False)}

    policy: str = "sft"
    """Stage whose model/ is both the starting policy and the frozen reference."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    beta: float = ranged(0.1, gt=0, fix="beta <= 0 trains the reversed (or no) KL-regularised objective")
    """KL strength beta of the DPO objective."""
    loss_type: str = one_of("sigmoid", *DPO_LOSSES)
    """TRL DPO loss variant: sigmoid (DPO), ipo, hinge, robust, ..."""
    label_smoothing: float = ranged(0.0, ge=0, lt=0.5, fix="0.5 or more flips which response is preferred")
    """Conservative-DPO label smoothing."""


@dataclass
class KLSettings:
    """KL penalty to the reference policy (Ziegler et al. 2019)."""

    coef: float = ranged(0.05, ge=0, fix="a negative coefficient rewards moving away from the reference")
    """Initial beta of the per-token penalty -beta * KL."""
    adaptive: bool = True
    """Adapt beta towards `target` with Ziegler et al.'s proportional controller."""
    target: float = ranged(4.0, gt=0)
    """Target KL (nats per response) for the adaptive controller."""
    horizon: int = ranged(10000, ge=1)
    """Controller horizon in episodes: beta moves by at most 20% x episodes-per-iteration / horizon per
    iteration (Ziegler et al. used 10000 with 512 episodes per update over thousands of updates; a short run
    needs a short horizon for beta to move at all)."""
    estimator: str = one_of("k1", "k1", "k2", "k3")
    """Per-token KL estimator in the reward: k1 (log-ratio), k2 or k3 (Schulman 2020)."""


@dataclass
class PPOStage(StageBase):
    """PPO against a frozen reward model or Python judges, with a KL penalty to the reference (align's own)."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("objective/scores_last", "objective/kl_last")
    """Final metrics in the one-line result on the console and in `align status`."""

    PRODUCES: ClassVar[str] = "policy"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": ("policy", True), "reward": ("judge", False)}

    policy: str = "sft"
    """Stage whose model/ is the starting policy and the frozen reference."""
    reward: str | dict[str, float] = "reward"
    """What PPO maximises: a reward stage (frozen reward model), a Python judge (`vader`, or a user's
    `module:function` taking (prompts, responses) and returning floats), or a weighted sum of these as a
    mapping, e.g. {reward: 1.0, vader: 0.5}."""
    value_init: str = one_of("reward", "reward", "policy")
    """Initialise the value model from `reward` (the reward model with its head; needs a reward stage) or
    `policy` (the policy's transformer with a fresh scalar head)."""
    prompts: str = ""
    """Data card path; its `prompt` column is used."""
    split: str = "train"
    """Split of the card to take prompts from."""
    iterations: int = ranged(40, ge=1)
    """PPO iterations (rollout + update)."""
    rollout_batch_size: int = ranged(64, ge=1)
    """Prompts per iteration per process."""
    mini_batch_size: int = ranged(16, ge=1)
    """Episodes per optimiser step (before accumulation)."""
    gradient_accumulation_steps: int = ranged(1, ge=1)
    """Mini-batches per optimiser step."""
    ppo_epochs: int = ranged(4, ge=1)
    """Passes over each rollout."""
    learning_rate: float = ranged(1e-5, gt=0)
    """Policy learning rate."""
    value_learning_rate: float = ranged(1e-5, gt=0)
    """Value model learning rate."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount."""
    lam: float = ranged(0.95, ge=0, le=1)
    """GAE lambda."""
    clip_range: float = ranged(0.2, gt=0)
    """Policy ratio clip epsilon."""
    clip_range_value: float = ranged(0.2, gt=0)
    """Value clip range."""
    vf_coef: float = ranged(0.1, ge=0)
    """Value loss weight."""
    entropy_coef: float = ranged(0.0, ge=0)
    """Entropy bonus weight."""
    max_approx_kl: float | None = ranged(None, gt=0, fix="use null for no early stop")
    """Stop the epoch loop early when approximate KL exceeds this."""
    max_grad_norm: float | None = ranged(1.0, gt=0, fix="use null for no clipping")
    """Clip the policy's and the value model's gradient norms to this, each separately, on every backend
    (None = no clipping)."""
    missing_eos_penalty: float | None = ranged(1.0, ge=0, fix="use null to turn the penalty off")
    """Subtracted from the (normalised) score of responses that never emit EOS (None = off)."""
    reward_normalization: str = one_of("initial", "initial", "running", "none")
    """initial: a fixed gain and bias from rollouts of the initial policy, so its scores have mean 0 and
    std 1 (Ziegler et al. 2019, sec. 2.2); the value model is read in the same units. running: running
    mean/std of every score seen (drifts during training). none: raw scores."""
    reward_normalization_samples: int = ranged(256, ge=2)
    """Initial-policy rollouts (over all processes) that fix the gain and bias of `initial` normalisation."""
    max_prompt_length: int = ranged(32, ge=1)
    """Prompts longer than this (tokens) are an error at validation time."""
    save_every: int = ranged(10, ge=1)
    """Checkpoint every N iterations."""
    sample_every: int = ranged(10, ge=1)
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
    PRODUCES: ClassVar[str] = "report"
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {
        "policies": ("policy", True), "baseline": ("policy", True), "reference": ("policy", True),
        "reward": ("reward", True), "preferences": ("data", True)}

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
    max_prompts: int | None = ranged(512, ge=1, fix="use null for all prompts")
    """Evaluate on at most this many prompts (None = all)."""
    bootstrap_samples: int = ranged(2000, ge=100, fix="fewer resamples give confidence intervals that are noise")
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

@dataclass
class Tracking:
    """Experiment tracking."""

    wandb: str = one_of("auto", "auto", "online", "offline", "disabled")
    """auto (online with an API key, offline without) | online | offline | disabled."""
    project: str = "align"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


@dataclass
class Hardware:
    """The GPUs a pipeline is sized for. `align estimate` and `align run` compare per-GPU memory estimates with
    it; unset fields are detected from the GPUs present (none on a CPU machine: nothing to compare)."""

    nodes: int = ranged(1, ge=1)
    """Machines in the job."""
    gpus_per_node: int | None = ranged(None, ge=1)
    """GPUs (processes) per machine for distributed stages (None = torch.cuda.device_count())."""
    gpu_memory_gb: float | None = ranged(None, gt=0)
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
    dtype: str = one_of("float32", *DTYPES)
    """Weights dtype for loading (float32 | bfloat16 | float16)."""
    seed: int = ranged(17, ge=0)
    """Default seed of every stage."""
    run_id: str = name_field("main")
    """Run directory name; re-running with the same id skips completed stages by fingerprint."""
    runs_dir: str = "runs"
    """Root of run directories."""
    tracking: Tracking = field(default_factory=Tracking)
    """W&B settings."""
    stages: dict[str, StageBase] = field(default_factory=dict)
    """Stage name -> stage config."""


# --------------------------------------------------------------------------------------------- parsing
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
        try:
            node[parts[-1]] = strict_yaml(text)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"override '{item}': the value {text!r} is not valid YAML ({problem}); quote it or "
                              "close its brackets, e.g. sft.epochs=1 or judges=[vader]") from None
    return raw


def parse_pipeline(raw: dict[str, Any], source: str) -> PipelineConfig:
    """Strictly parse a raw pipeline mapping (already overridden)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the file must hold a mapping with `name` and `stages`")
    raw = dict(raw)
    stages_raw = raw.pop("stages", None) or {}
    if not isinstance(stages_raw, dict) or not stages_raw:
        raise ConfigError(f"{source}: `stages` must map stage names to their settings (none given)")
    cfg: PipelineConfig = from_dict(PipelineConfig, raw, f"{source}:")
    if not cfg.name:
        cfg.name = Path(source).stem
    check_plain_name(cfg.name, f"{source}: name" + ("" if raw.get("name") else " (from the file name; set `name:`)"))
    for name, body in stages_raw.items():
        check_plain_name(name, f"{source}: stages.{name}")
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{source}: stages.{name}: expected a mapping of stage settings (e.g. `policy: sft`), "
                              f"got a {type(body).__name__}: {str(body)[:80]!r}")
        body = dict(body or {})
        kind = body.get("type") or name
        if kind not in STAGE_TYPES:
            raise ConfigError(
                f"{source}: stages.{name}: unknown stage type '{kind}'{closest(str(kind), list(STAGE_TYPES))}"
                " (set `type:` when the stage's name is not its type)"
            )
        body["type"] = kind
        cfg.stages[name] = from_dict(STAGE_TYPES[kind], body, f"{source}: stages.{name}")
    return cfg


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a pipeline YAML (a key given twice is an error), apply dotted overrides, parse strictly."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: pipeline file not found")
    try:
        raw = strict_yaml(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the pipeline file ({exc.strerror or exc})") from None
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


def stage_from_dict(data: dict[str, Any], name: str = "") -> StageBase:
    """Rebuild a stage config from `to_dict` output (the stage subprocess): the same type and range checks as
    `align validate`, with the same dotted path in the message."""
    if not isinstance(data, dict) or data.get("type") not in STAGE_TYPES:
        raise ConfigError(f"stage spec: not a stage config (type {str(data.get('type') if isinstance(data, dict) else data)[:40]!r})")
    return from_dict(STAGE_TYPES[data["type"]], data, f"stages.{name or data['type']}")
