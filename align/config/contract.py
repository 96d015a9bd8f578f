"""The stage-type contract (`StageBase`, `TrainedStage`) and its registry. The settings several stage types share
(LoRA, decoding, pairwise judges, ...) are in align/config/settings.py.

A stage type is one config class (a module in this package, or one named in ALIGN_STAGE_MODULES) plus one
stage module with `run(ctx)` and `OUTPUTS`. Subclassing `StageBase` with a `TYPE` registers the class;
everything else (the runner, the validator, the estimator, `align status`) asks the class. No torch here.
"""

from __future__ import annotations

import importlib
from importlib.util import find_spec
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

from align.config.settings import LR_SCHEDULER_FIX, LR_SCHEDULERS, Generation, LoraSettings, warmup_steps
from align.judges import JudgeError, check_judges
from align.data.lengths import LengthRule
from align.engines import DEFAULT as DEFAULT_ENGINE
from align.core.schema import ConfigError, one_of, ranged, step_size


class PipelineView(Protocol):
    """The part of align.config.PipelineConfig that stage checks read (a protocol: this module is imported by
    align/config/__init__.py, which defines PipelineConfig)."""

    base_model: str
    seed: int
    stages: dict[str, StageBase]

# What a stage publishes (`StageBase.PRODUCES`), which is also the role an input reference needs (`INPUTS`).
POLICY, REWARD_MODEL, DATA, REPORT = "policy", "reward_model", "data", "report"
MODEL = "model"
"""An input role (not something a stage produces): a policy or a reward model (the push stage uploads either)."""
ROLES = {POLICY: "a policy", REWARD_MODEL: "a reward model", DATA: "preference pairs", REPORT: "a report",
         "receipt": "a receipt (nothing other stages read)", MODEL: "a policy or a reward model"}
EXAMPLES, PROMPTS_ONLY = "examples", "prompts"  # how a stage reads a card named in one of its fields (`CARDS`)
STAGE_MODULES_ENV = "ALIGN_STAGE_MODULES"  # extra modules (comma-separated) defining stage types outside align/


def refs(value: Any) -> list[str]:
    """The names a reference field holds: a name, a list of names, or a weighted judge mapping's keys."""
    return list(value) if isinstance(value, (dict, list)) else [value] if isinstance(value, str) else []


# --------------------------------------------------------------------------------------------- contract
class HeldModel(NamedTuple):
    """A model a stage holds on a GPU, as `align estimate` counts it."""

    role: str  # policy, value, reference, reward, judge
    kind: str
    """`lm` (a causal LM) or `scalar` (a reward / value model on the same backbone)."""
    trained: bool
    sharded: bool = True
    """A frozen model under ZeRO-3: partitioned by DeepSpeed like the trained ones (True), or whole on every GPU
    (False: e.g. a reward model GRPO calls from a Python function, every model of a stage that does not train)."""


@dataclass
class CheckContext:
    """What a stage type's `check` may look at; built by align/orchestrator/validate.py for each stage."""

    name: str
    """The stage's name in the pipeline."""
    pipeline: PipelineView
    """The whole parsed pipeline (other stages included): an align.config.PipelineConfig."""
    cards: dict[str, Path]
    """Card field -> the data card file it names (fields that name a stage are absent)."""
    split_of: Callable[[Path, str], Any]
    """(card, split) -> its loaded rows (align/data/cards.py LoadedSplit), cached across stages."""
    base_dir: Path = Path(".")
    """The pipeline file's directory: relative paths in settings are relative to it."""

    def card_produces(self, fld: str, split: str) -> str | None:
        """The canonical form the card in `fld` produces, or None when `fld` names a stage."""
        return self.split_of(self.cards[fld], split).card.produces if fld in self.cards else None

    def check_judge(self, fld: str, spec: str | dict[str, float]) -> None:
        """Every name in a judge setting is a reward stage of this pipeline or a Python judge."""
        try:
            check_judges(spec, {n for n, st in self.pipeline.stages.items() if st.PRODUCES == REWARD_MODEL},
                         {n: st.type for n, st in self.pipeline.stages.items()})
        except JudgeError as exc:
            raise ValueError(f"{fld}: {exc}") from None


STAGE_TYPES: dict[str, type[StageBase]] = {}
"""Stage type name -> config class; filled by `StageBase.__init_subclass__`, completed by `stage_types()`."""


def import_builtin_types() -> None:
    """Import every module of this package: each stage type's module registers its class (no list to edit)."""
    for mod in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"align.config.{mod.name}")


def stage_types() -> dict[str, type[StageBase]]:
    """Every stage type: the modules of this package, then those named in ALIGN_STAGE_MODULES (importing a
    module registers the StageBase subclasses it defines)."""
    import_builtin_types()
    for name in filter(None, (n.strip() for n in os.environ.get(STAGE_MODULES_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{STAGE_MODULES_ENV}: cannot import stage-type module '{name}' ({exc})") from None
    return STAGE_TYPES


@dataclass
class StageBase:
    """Fields every stage has, and what a stage type declares about itself (class attributes and methods)."""

    TYPE: ClassVar[str] = ""
    """The type name a pipeline's `type:` selects; setting it registers the class."""
    MODULE: ClassVar[str] = ""
    """Import name of the stage module with `run(ctx)` and `OUTPUTS` (default align.stages.<TYPE>)."""
    HEADLINE: ClassVar[tuple[str, ...]] = ()
    """Final metrics in the one-line result on the console and in `align status`."""
    PROMPTS: ClassVar[str] = ""
    """How the stage uses the prompts of its cards: `train` (learns from them), `held_out` (evaluates on them;
    they must not occur in any `train` stage's cards) or "" (neither)."""
    TRL_FUSED_HEAD: ClassVar[bool] = False
    """Its trained policy's log-probs come from TRL's fused LM head (tiles, never the whole logits: `align estimate`)."""
    LEFT_PADDED: ClassVar[bool] = False
    """Trains on left-padded prompts (PPO, GRPO, RLOO): run padded on a GPU, eager attention (modeling.compute)."""
    PRODUCES: ClassVar[str] = ""
    """What it publishes: `policy` (a causal LM in model/), `reward_model` (scalar), `data` (pairs) or `report`."""
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {}
    """Fields that may name another stage -> (role the stage must produce, whether the field must name a
    stage). Role `judge`: a reward-model stage or a Python judge (align/judges/__init__.py); `data`: a data stage or a card."""
    CARDS: ClassVar[dict[str, str]] = {}
    """Fields that hold a data card path (relative to the pipeline file) unless they name a stage -> how the stage
    reads the card: `examples` (it trains on, or learns from, the rows) or `prompts` (it samples from their
    prompts only). The planner resolves them, `align validate` loads and checks each one's rows."""
    ENGINES: ClassVar[tuple[str, ...]] = (DEFAULT_ENGINE,)
    """The rollout engines (`generation.engine`) the stage can sample with (align/engines/); by default the default
    one alone (a stage that samples through a library's own generate, as TRL's GRPO and RLOO do, has no other)."""
    ENGINE_MODEL: ClassVar[str] = "policy"
    """The field naming the stage whose model/ a separate engine (vllm) starts from (other weights reach it by
    sync): it must be whole weights, not LoRA adapters alone."""
    ENGINE_NOTE: ClassVar[str] = ""
    """Why the stage type lacks an engine, said when a pipeline asks for it."""
    WORK: ClassVar[str] = ""
    """The final metric counting the work the stage did (steps, iterations, prompts): at 0 the stage has failed."""
    DIVERGED: ClassVar[tuple[str, ...]] = ("loss", "margin", "accuracy", "rewards/")
    """A final metric named with one of these that is not finite: the model diverged, the stage fails."""
    DROPOUT: ClassVar[bool] = False
    """Its trained models' dropout (LoRA's too) runs while it trains (`align estimate` measures it)."""

    type: str = ""
    """Stage kind, a registered stage type: sft, preferences, reward, dpo, ppo, evaluate, ... (default: the name)."""
    accelerate: str = "cpu"
    """Accelerate config: a name under pipelines/accelerate/ (cpu, ddp, zero2, zero3, ...) or a path (from the pipeline)."""
    num_processes: int | None = ranged(None, ge=1, fix="use null for the accelerate config's own value")
    """Processes for `accelerate launch` (default: the accelerate config's own value)."""
    seed: int | None = ranged(None, ge=0, le=2 ** 31 - 1, fix="a seed below 2**31 (stages add ranks and batch "
                              "offsets; numpy and vLLM take 32-bit seeds), or null for the pipeline's")
    """Seed for this stage (default: the pipeline seed)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("TYPE")
        if not kind:
            return  # a shared base such as TrainedStage
        old = STAGE_TYPES.get(kind)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"stage type '{kind}' is defined twice: {old.__module__}.{old.__qualname__} and "
                            f"{cls.__module__}.{cls.__qualname__}")
        STAGE_TYPES[kind] = cls

    @classmethod
    def stage_module(cls) -> str:
        return cls.MODULE or f"align.stages.{cls.TYPE}"

    def check(self, ctx: CheckContext) -> None:
        """Settings checks run by `align validate` before anything launches (cheap: no model is loaded).
        Raise ValueError starting with the field name; ranges on single fields are declared on the fields."""

    def pipeline_problems(self, name: str, stages: dict[str, StageBase]) -> list[str]:
        """Problems between this stage and others, reported after every stage's own check (one line each)."""
        return []

    def environment_problem(self) -> str | None:
        """What this process's environment lacks for the stage to run (a push's hub token), or None: checked by
        `align validate`, and by `align run` for the stages it runs, before anything launches."""
        return None

    # ------------------------------------------------------------------ what the orchestrator asks
    def mode_problem(self, mode: str) -> str | None:
        """Why this stage cannot run under accelerate mode `mode` (zero2, zero3, ...; None: it can), at validate."""
        return None

    def unread_settings(self) -> dict[str, str]:
        """Settings this stage leaves unread as it is set (dotted key -> why): a sweep over only these trains twins."""
        return {}

    def references(self, role: str) -> list[str]:
        """The names this stage's reference fields of `role` hold (stages, cards or judges)."""
        return [r for fld, (want, _) in self.INPUTS.items() if want == role for r in refs(getattr(self, fld))]

    def card_split(self, fld: str) -> str:
        """The split of the card in field `fld` that the stage reads (validation loads and checks it)."""
        return "train"

    def relative_files(self) -> dict[str, str]:
        """Settings besides data cards naming a file relative to the pipeline (dotted key, list items by index ->
        value): written absolute into the spec, their content fingerprinted. `local_models`: settings naming another
        model (a judge's) by path or hub id; one found beside the pipeline likewise, by its files' stamps."""
        return {}

    def local_models(self) -> dict[str, str]:
        return {}

    def starts_from_base(self) -> bool:
        """Whether it starts from the base model (its fingerprint then covers model, tokenizer and chat template)."""
        return False

    def installs_chat_template(self, card_forms: dict[str, str], template_named: bool) -> bool:
        """Whether the stage installs the planned chat template on the base tokenizer (its special tokens, its
        end-of-turn token as EOS); `card_forms`: field -> the canonical form its card produces; `template_named`:
        the pipeline sets `chat_template` (not null). Validation installs it the same way before counting lengths."""
        return False

    def trains_on_assistant_turns(self) -> bool:
        """Whether its cards' conversations split into trained (assistant) and untrained tokens: validation renders
        them so, refusing a template that cannot be split."""
        return False

    def response_tokens(self) -> int | None:
        """The length of the responses the stage samples (None: it samples none)."""
        gen = self.generation_settings()
        return gen.max_new_tokens if gen is not None else None

    def generation_settings(self) -> Generation | None:
        """The stage's decoding settings, when it samples."""
        return None

    def check_positions(self, limit: int, fix: str) -> None:
        """The longest sequence the stage trains on or generates must fit the model's `limit` positions."""
        gen = self.generation_settings()
        if gen is not None and gen.max_new_tokens >= limit:
            raise ValueError(f"generation.max_new_tokens: {gen.max_new_tokens} leaves no room for a prompt: {fix}")

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        """Models the stage holds on a GPU (align/orchestrator/estimate.py; the first one generates)."""
        return []

    def gathers_policy_for_generation(self) -> bool:
        """Under ZeRO-3, whether it gathers its whole policy on every GPU to sample (the estimate counts a copy)."""
        return False

    def keeps_policy_snapshot(self) -> bool:
        """Whether every process keeps a host copy of its trained policy (to undo an update; the estimate says so)."""
        return False

    def logit_tokens(self, mode: str, on_gpu: bool) -> int | None:
        """Tokens whose logits the trained policy holds at once under DeepSpeed `mode` (None: the micro-batch's)."""
        return None

    def length_check(self, fld: str, stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
        """How over-long rows of the card in `fld` are treated (`stages`: the pipeline's): (rule, the length bound, the
        largest fraction that may be affected), counted by `align validate` and at the stage's start; None: none."""
        return None

    def length_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A card's rows as the stage's length rule counts them (conversations rendered with the chat template)."""
        return rows

    def deepspeed_settings(self) -> dict[str, Any]:
        """The DeepSpeed settings this stage decides itself (accelerate config `deepspeed_config` key -> the stage's
        value; None: no clipping). The shipped accelerate configs leave them out (DeepSpeed's `auto`: filled from
        the stage at launch); `align validate` refuses a config that sets one to another value."""
        return {}

    def workload(self) -> tuple[int, int, int, int]:
        """(training micro-batch sequences, training length, generation batch, generation length) per GPU."""
        gen = self.generation_settings()
        if gen is not None:
            return 0, 0, gen.batch_size, 256 + gen.max_new_tokens  # prompts are not bounded here: assume 256
        return 0, 0, 0, 0


@dataclass
class TrainedStage(StageBase):
    """Optimisation settings shared by the stages that train with a TRL trainer."""

    LENGTH_RULE: ClassVar[LengthRule | None] = None
    TRL_FUSED_HEAD: ClassVar[bool] = True  # every TRL trainer since 1.15 (trl.trainer.utils.add_fused_lm_head)
    """How the stage's trainer treats examples longer than max_length (align/data/lengths.py); counted before
    training, at `align validate` and again at the stage's start."""
    WORK: ClassVar[str] = "train/global_step"

    learning_rate: float = step_size(5e-4)
    """Peak learning rate."""
    lr_scheduler: str = one_of("cosine", *LR_SCHEDULERS, fix=LR_SCHEDULER_FIX)
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
    max_grad_norm: float | None = ranged(1.0, gt=0, fix="use null for no clipping")
    """Clip the gradient's global norm to this before each optimiser step (None: no clipping; DeepSpeed's clipping)."""
    max_length: int = ranged(128, ge=2)
    """Longest tokenised example (after the chat template); longer ones are truncated or dropped by the trainer."""
    max_truncated_fraction: float = ranged(0.05, ge=0, le=1)
    """Refuse to train when more than this fraction of examples exceed max_length (counted before training)."""
    logging_steps: int = ranged(10, ge=1)
    """Log metrics every N optimiser steps."""
    save_steps: int = ranged(50, ge=1)
    """Write a resumable checkpoint every N optimiser steps."""
    save_total_limit: int = ranged(2, ge=1)
    """Keep this many resumable checkpoints, the newest (older ones go once a newer one is complete). A ZeRO
    checkpoint of an 8B model holds weights and optimiser states, ~100 GB: 1 keeps one on disk at a time."""
    max_train_examples: int | None = ranged(None, ge=1, fix="use null for all examples")
    """Use at most this many training examples: the split's first, in file order, after the drops (None = all)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute. Off by default
    (TRL turns it on); `align estimate` and the memory preflight say when a stage needs it to fit."""
    padding_free: bool = True
    """Compute no pad tokens: each batch's sequences packed into rows of the batch's width (one row under
    flash-attention), positions restarting per sequence, so losses and gradients equal the padded batch's with fewer
    tokens computed (align/modeling/packing.py; tests/test_packing.py). SFT packs in its collator
    (`perf/padding_fraction` beside `perf/padding_fraction_unpacked`); reward, DPO, KTO, GRPO and RLOO pack inside
    the backbone's forward. A family whose forward cannot read packed positions (OPT) runs padded whatever this says."""
    liger: str = one_of("auto", "auto", "on", "off")
    """Liger kernels (the liger-kernel package's Triton kernels: fused RMSNorm, RoPE, SwiGLU; not its linear
    cross-entropy, which TRL 1.16 turns off for its fused LM head), applied to the trained model by transformers'
    `use_liger_kernel`: auto = on on a CUDA GPU when liger-kernel is installed, off elsewhere (Triton does not run on
    CPUs); on = required (refused without the package, and by the stage on a machine without CUDA). On in one H200
    run (2026-11-27); its effect is not measured (no on/off comparison has run)."""
    torch_compile: bool = False
    """Compile the trained model with torch.compile (transformers' `torch_compile`). Off by default: on the 2-core
    CPU it made SFT slower (docs/benchmarks.md); not measured on a GPU by this project yet."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters instead of full fine-tuning."""

    def check(self, ctx: CheckContext) -> None:
        self.check_steps()
        self.lora.check()
        if self.liger == "on" and find_spec("liger_kernel") is None:
            raise ValueError("liger: on, but the liger-kernel package is not installed: pip install liger-kernel "
                             "(CUDA machines only), or set liger: auto")

    def deepspeed_settings(self) -> dict[str, Any]:
        return {"gradient_accumulation_steps": self.gradient_accumulation_steps, "gradient_clipping": self.max_grad_norm}

    def check_steps(self) -> None:
        """Cross-field settings every TRL-trained stage needs; also checked by the stage process itself."""
        if self.save_steps % self.logging_steps:
            raise ValueError(f"save_steps ({self.save_steps}) must be a multiple of logging_steps "
                             f"({self.logging_steps}) so a NaN loss is caught before a checkpoint is written")
        if self.lr_scheduler == "polynomial" and self.learning_rate <= 1e-7:
            raise ValueError(f"learning_rate: {self.learning_rate:g} with lr_scheduler: polynomial, which decays to "
                             "transformers' fixed end rate 1e-07: raise learning_rate, or use linear or cosine")
        if (steps := self.max_steps) is not None and warmup_steps(steps, self.warmup_ratio, self.lr_scheduler) >= steps:
            raise ValueError(f"warmup_ratio: {self.warmup_ratio:g} of max_steps {steps} warms up for every step (the "
                             "first at learning rate 0: one step trains nothing); lower warmup_ratio or raise max_steps")

    def unread_settings(self) -> dict[str, str]:
        unread = self.lora.unread()
        if self.lr_scheduler == "constant":  # transformers' has no warmup (constant_with_warmup has)
            unread["warmup_ratio"] = "lr_scheduler is constant"
        if self.max_steps is not None:  # the Trainer's max_steps wins over num_train_epochs
            unread["epochs"] = "max_steps is set"
        if not self.DROPOUT and self.lora.enabled:
            unread["lora.dropout"] = f"a {self.TYPE} stage trains with dropout off"
        return unread

    def check_positions(self, limit: int, fix: str) -> None:
        if self.max_length > limit:
            raise ValueError(f"max_length: {self.max_length} is longer than the model accepts: {fix}; lower "
                             f"max_length to at most {limit}")
        super().check_positions(limit, fix)

    def length_check(self, fld: str, stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
        """The trainer's rule for the cards the stage learns from (`examples` fields)."""
        if self.LENGTH_RULE is None or type(self).CARDS.get(fld) != EXAMPLES:
            return None
        return self.LENGTH_RULE, self.max_length, self.max_truncated_fraction

    def check_preference_card(self, ctx: CheckContext) -> None:
        """A card in `data` must hold preference pairs, with held-out ones (split `test`)."""
        if ctx.card_produces("data", "train") not in (None, "preference"):
            raise ValueError(f"data: card produces '{ctx.card_produces('data', 'train')}'; {self.type} needs "
                             "preference pairs")
        if "data" in ctx.cards:
            held_out = ctx.split_of(ctx.cards["data"], "test")
            if held_out.available and not held_out.rows:
                raise ValueError(f"data: {ctx.cards['data'].name} has no held-out pairs (split 'test')")
