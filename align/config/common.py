"""What every stage type shares: the stage-type contract (`StageBase`), its registry, and the settings several
stage types use (the builtin model's size, LoRA, decoding, TRL optimisation).

A stage type is one config class (a module in this package, or one named in ALIGN_STAGE_MODULES) plus one
stage module with `run(ctx)` and `OUTPUTS`. Subclassing `StageBase` with a `TYPE` registers the class;
everything else (the runner, the validator, the estimator, `align status`) asks the class. No torch here.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, NamedTuple, Protocol

from align.core.engine_env import ENGINES, has_gpu
from align.core.judges import JudgeError, check_judges, judge_weights
from align.data.lengths import LengthRule
from align.core.schema import ConfigError, name_field, one_of, ranged



class PipelineView(Protocol):
    """The part of align.config.PipelineConfig that stage checks read (a protocol: this module is imported by
    align/config/__init__.py, which defines PipelineConfig)."""

    base_model: str
    stages: dict[str, StageBase]

DTYPES = ("float32", "bfloat16", "float16")
# What a stage publishes (`StageBase.PRODUCES`), which is also the role an input reference needs (`INPUTS`).
POLICY, REWARD_MODEL, DATA, REPORT = "policy", "reward_model", "data", "report"
MODEL = "model"
"""An input role (not something a stage produces): a policy or a reward model (the push stage uploads either)."""
ROLES = {POLICY: "a policy", REWARD_MODEL: "a reward model", DATA: "preference pairs", REPORT: "a report",
         "receipt": "a receipt (nothing other stages read)", MODEL: "a policy or a reward model"}
# How a stage reads a data card named in one of its fields (`StageBase.CARDS`).
EXAMPLES, PROMPTS_ONLY = "examples", "prompts"
# transformers SchedulerType values that need no extra scheduler kwargs (tests check they still exist).
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")
# Pipeline-level compute settings, resolved in each stage process by align/modeling/compute.py.
PRECISIONS = ("auto", "float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def flash_attention_problem(attn: str) -> str | None:
    """Why `attn` cannot be used here (None when it can): checked by `align validate` before launching."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return ("flash_attention_2 needs the flash-attn package (pip install flash-attn --no-build-isolation, "
                "on a CUDA machine); use `attn_implementation: sdpa` otherwise")
    if attn == "flash_attention_3" and importlib.util.find_spec("flash_attn_interface") is None:
        return ("flash_attention_3 needs FlashAttention-3 (flash_attn_interface, Hopper GPUs); use "
                "`attn_implementation: sdpa` otherwise")
    return None


# Extra modules that define stage types (comma-separated import names), for types that live outside align/.
STAGE_MODULES_ENV = "ALIGN_STAGE_MODULES"


# --------------------------------------------------------------------------------------------- shared settings
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
    """Optional LoRA adapters (peft). `model/` holds the adapters alone (or merged, with `merge`)."""

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
    merge: bool = False
    """Publish model/ as the base with the adapters merged in (a plain checkpoint as large as the base) instead of
    the adapters alone (adapter_config.json and their weights, beside the name of the base they were trained on,
    which every later stage loads and merges in memory). A vllm engine needs merged weights to start from: `align
    validate` says which stage must set this."""
    quantize: str = one_of("none", "none", "4bit")
    """`4bit`: QLoRA (Dettmers et al. 2023): the frozen base is loaded in 4-bit NormalFloat with double
    quantization and bf16 compute (bitsandbytes), the adapters train on top. Needs a CUDA GPU and
    `pip install 'align[qlora]'`; `model/` is still the merged 16/32-bit model."""

    def check(self) -> None:
        """`align validate`: QLoRA only with LoRA on, bitsandbytes installed and a CUDA GPU present."""
        if self.quantize == "none":
            return
        if not self.enabled:
            raise ValueError(f"lora.quantize: '{self.quantize}' quantizes the frozen base under LoRA adapters; set "
                             "lora.enabled: true, or lora.quantize: none")
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"lora.quantize: '{self.quantize}' needs the bitsandbytes package, which is not "
                             "installed; `pip install 'align[qlora]'` on a CUDA machine, or set lora.quantize: none")
        if not has_gpu():  # torch-free (this layer is the orchestrator's too): the NVIDIA driver's device nodes
            raise ValueError(f"lora.quantize: '{self.quantize}' runs only on a CUDA GPU (bitsandbytes 4-bit kernels) "
                             "and none is present here; run on a GPU machine, or set lora.quantize: none")


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
    fast: str = one_of("auto", "auto", "on", "off")
    """Static KV cache (compiled with torch.compile by transformers on a GPU) and prompts padded to a multiple of
    32 tokens: auto = on on a GPU outside ZeRO-3, off on CPU (align/modeling/compute.py). hf engine only."""
    engine: str = one_of("hf", *ENGINES)
    """What samples: hf (transformers.generate with the stage's own model) or vllm (vLLM in its own process and
    environment, weights synced after every PPO update; align/modeling/vllm_engine.py). vllm needs
    ALIGN_VLLM_PYTHON (./launch.sh --vllm sets up .venv-vllm); `align validate` says so when it is missing."""
    zero3_gather: str = one_of("whole", "whole", "layers")
    """Under ZeRO-3, how the hf engine reaches the sharded policy's weights to sample (PPO): `whole` gathers the
    whole policy once per rollout batch (fast; `align estimate` counts its full 16-bit copy on every GPU), `layers`
    leaves DeepSpeed's hooks on, so every decoding step gathers one layer at a time and every process steps until
    all are done (memory of one layer; a collective per layer and step: much slower)."""
    engine_timeout_s: float = ranged(600.0, gt=0, fix="seconds the vllm engine may take for one call (start, a batch, a sync)")
    """vllm: the longest one engine call may take (start-up, one generate batch, one weight sync) before the stage
    ends with an error naming it, instead of waiting forever."""
    max_logprob_gap: float = ranged(10.0, gt=0)
    """vllm: the largest |engine - trainer| log-prob of a sampled token (nats) before the stage stops, naming the
    weight sync and the engine's log; a non-finite gap always stops it. fp32 engines agree within ~1e-3 nats; bf16
    engines on GPU can differ by a few nats on rare tokens (kernel and precision mismatch), so the default only
    catches weights that loaded wrongly (tens of nats)."""
    kv_cache_gib: float = ranged(1.0, gt=0)
    """vllm on CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, rounded to whole GiB); align estimate counts it."""
    gpu_memory_utilization: float = ranged(0.3, gt=0, le=1, fix="a fraction of the GPU's memory, e.g. 0.3")
    """vllm on a GPU: the fraction of the GPU's memory vLLM takes (weights + KV cache), beside the trainer."""



def refs(value: Any) -> list[str]:
    """The names a reference field holds: a name, a list of names, or a weighted judge mapping's keys."""
    if isinstance(value, dict):  # a weighted judge mapping: its keys
        return list(value)
    return value if isinstance(value, list) else [value] if isinstance(value, str) else []


@dataclass
class PairwiseJudge:
    """A pairwise LLM judge: it reads a prompt and two responses and answers A, B or tie (align/stages/pairwise.py).
    Every pair is judged in both orders; a verdict that flips with the order is a tie. Backends: a local causal LM
    run in the stage process (`model` a directory, hub id or packaged:NAME; greedy, batched), or an OpenAI-compatible
    chat-completions endpoint (`base_url` + `model`, the key read from the environment variable `key_env`,
    never written anywhere). Answers are cached in the stage's directory (judge_cache/), keyed by judge, prompt and
    both responses: a rerun or a resumed evaluation does not ask twice."""

    name: str = name_field("llm_judge", fix="it names the judge's metrics: eval/<policy>/<name>/win_rate")
    """Names the judge's metrics (eval/<policy>/<name>/...) and its cache file."""
    model: str = ""
    """Local backend: a model directory, hub id or packaged:NAME (e.g. packaged:smollm2). Endpoint: the model's
    name at the endpoint."""
    base_url: str | None = None
    """An OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (null: the local backend)."""
    key_env: str | None = None
    """The environment variable that holds the endpoint's API key (its name only; the key is never written)."""
    template: str | None = None
    """A judging prompt file (relative to the pipeline) with {prompt}, {response_a} and {response_b}; null: the
    shipped one (align/templates/pairwise_judge.txt). The answer must be A, B or tie."""
    max_new_tokens: int = ranged(8, ge=1)
    """Longest answer; an answer that is not exactly A, B or tie is invalid (counted, never guessed)."""
    batch_size: int = ranged(16, ge=1)
    """Local backend: judging prompts per generate call."""
    max_concurrency: int = ranged(4, ge=1)
    """Endpoint: requests in flight at once."""
    timeout: float = ranged(60.0, gt=0)
    """Endpoint: seconds one request may take in all (connecting, waiting, reading the answer) before it is retried."""
    retries: int = ranged(3, ge=0)
    """Endpoint: retries of a failed request (timeouts, 429 and 5xx), with exponential backoff, or after the server's
    Retry-After (at most max_retry_wait seconds)."""
    max_retry_wait: float = ranged(60.0, gt=0)
    """Endpoint: the longest a Retry-After header may make a request wait before its retry."""
    deadline: float = ranged(3600.0, gt=0)
    """Endpoint: seconds the whole judging (every policy of the stage) may take; past it the stage stops, naming this
    setting (cached answers are kept: a rerun asks only what is left)."""
    max_prompts: int | None = ranged(None, ge=1, fix="use null to judge every prompt")
    """Judge at most this many prompts per policy (null: all of them)."""
    max_invalid_fraction: float = ranged(0.2, ge=0, le=1)
    """Fail the stage when more than this fraction of answers are invalid (with examples in the log)."""

    def check(self, where: str, base_dir: Path) -> None:
        """`align validate`: the model or endpoint is there, the key variable is set, the template exists; an
        endpoint is probed (one request naming the URL) so a wrong URL fails now, not after sampling."""
        if not self.model:
            raise ValueError(f"{where}.model: required (a local model, or the endpoint's model name)")
        if self.key_env and not self.base_url:
            raise ValueError(f"{where}.key_env: only an endpoint (base_url) takes a key")
        if self.template:
            path = (base_dir / self.template)
            if not path.is_file():
                raise ValueError(f"{where}.template: '{self.template}' not found (looked for {path.resolve()})")
            problem = template_problem(path.read_text(encoding="utf-8"))
            if problem:
                raise ValueError(f"{where}.template: {path.resolve()}: {problem}")
        if self.base_url:
            url = self.base_url.rstrip("/")
            suffix = next((s for s in ("/chat/completions", "/completions", "/models") if url.endswith(s)), None)
            if suffix:
                raise ValueError(f"{where}.base_url: {self.base_url} names an endpoint path; give the API's root "
                                 f"(align adds /chat/completions): base_url: {url[:-len(suffix)]}")
            if self.key_env and not os.environ.get(self.key_env):
                raise ValueError(f"{where}.key_env: the variable {self.key_env} is not set (or empty); export "
                                 f"it with the endpoint's key before running")
            problem = header_value_problem(self.key_env) if self.key_env else None
            if problem:
                raise ValueError(f"{where}.key_env: {problem}")
            problem = endpoint_problem(self.base_url, os.environ.get(self.key_env or "", ""), min(self.timeout, 10),
                                       self.model)
            if problem:
                raise ValueError(f"{where}.base_url: {self.base_url}: {problem}")
        elif self.model.startswith(PACKAGED):
            from align.core.packaged import PackagedError, resolve

            try:
                resolve(self.model)
            except PackagedError as exc:
                raise ValueError(f"{where}.model: {exc}") from None
        elif (self.model.startswith((".", "/")) or (base_dir / self.model).exists()) and \
                not (base_dir / self.model / "config.json").is_file():
            raise ValueError(f"{where}.model: '{self.model}' is not a model directory (no config.json in "
                             f"{(base_dir / self.model).resolve()})")


PACKAGED = "packaged:"
TEMPLATE_FIELDS = ("{prompt}", "{response_a}", "{response_b}")


def template_problem(text: str) -> str | None:
    """What a judging prompt template lacks (None when it is usable)."""
    missing = [f for f in TEMPLATE_FIELDS if f not in text]
    if missing:
        return f"it must contain {', '.join(TEMPLATE_FIELDS)}; missing {', '.join(missing)}"
    try:
        text.format(prompt="", response_a="", response_b="")
    except (KeyError, IndexError, ValueError) as exc:
        return f"it is not a template Python's str.format fills with prompt, response_a and response_b ({exc!r}); " \
               "write literal braces as {{ and }}"
    return None


def header_value_problem(variable: str) -> str | None:
    """Why the value of environment variable `variable` cannot go into an HTTP header (never the value itself)."""
    value = os.environ.get(variable, "")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in value):
        return (f"the value of {variable} holds whitespace or control characters (a key file saved with CRLF line "
                f"ends leaves a trailing \\r); export it again without them, e.g. export {variable}=$(tr -d '\\r\\n' < "
                "FILE)")
    return None


def without_key(text: str, key: str) -> str:
    """`text` with `key` replaced by <key>, also as the http library quotes it inside bytes (a key with a \r shows as
    b'Bearer sk-...\\r' in its errors)."""
    return text.replace(key, "<key>").replace(repr(key.encode())[2:-1], "<key>") if key else text


def endpoint_problem(base_url: str, key: str, timeout: float, model: str | None = None) -> str | None:
    """One probe of an OpenAI-compatible endpoint (GET {base_url}/models): None when it answers (and, when it lists
    its models, lists `model`); else why not (never the key: any text that may carry it is scrubbed)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"}
                                 if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            listing = resp.read(1 << 20)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return f"the endpoint refused the key (HTTP {exc.code}); check the key in the named variable"
        if exc.code == 404:  # an endpoint without /models still answers chat completions
            return None
        return f"the endpoint answered HTTP {exc.code} to a probe of /models"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = without_key(str(getattr(exc, "reason", exc)), key)
        return f"not reachable ({reason}); check base_url, and that the server is running and reachable from here"
    try:
        ids = [m["id"] for m in json.loads(listing)["data"]]
    except (ValueError, KeyError, TypeError):
        return None  # not a listing we can read: the chat completions will tell
    if model and ids and model not in ids:
        return f"it serves no model {model!r} (its /models lists {', '.join(map(repr, ids[:8]))}); set model to one of them"
    return None


def response_length_problems(name: str, algorithm: str, max_new_tokens: int, reward: str | dict[str, float],
                             stages: dict[str, StageBase]) -> list[str]:
    """Online RL (PPO, GRPO, RLOO) optimises responses of `max_new_tokens`; its reward model learned from pairs
    sampled at the length of the data stage it was trained on, and a report stage samples at its own. One line when
    they differ. Stages are asked what they read (`references`) and how long they sample (`response_tokens`)."""
    own = f"stages.{name}.generation.max_new_tokens"
    lengths = {own: max_new_tokens}
    for rm in (n for n in judge_weights(reward) if n in stages and stages[n].PRODUCES == REWARD_MODEL):
        for data in stages[rm].references(DATA):
            tokens = stages[data].response_tokens() if data in stages and stages[data].PRODUCES == DATA else None
            if tokens is not None:
                lengths[f"stages.{data}.generation.max_new_tokens"] = tokens
    for other_name, other in stages.items():
        if other.PRODUCES == REPORT and name in other.references(POLICY) and other.response_tokens() is not None:
            lengths[f"stages.{other_name}.generation.max_new_tokens"] = other.response_tokens()
    if len(set(lengths.values())) == 1:
        return []
    return ["response lengths differ: " + ", ".join(f"{k}={v}" for k, v in lengths.items())
            + f"; {algorithm} would optimise {max_new_tokens}-token responses against a reward model trained on, "
            "and an evaluation run at, other lengths. Set them equal"]


# --------------------------------------------------------------------------------------------- contract
class HeldModel(NamedTuple):
    """A model a stage holds on a GPU, as `align estimate` counts it."""

    role: str
    """policy, value, reference, reward, judge."""
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
        stages = self.pipeline.stages
        try:
            check_judges(spec, {n for n, st in stages.items() if st.PRODUCES == REWARD_MODEL},
                         {n: st.type for n, st in stages.items()})
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
    PRODUCES: ClassVar[str] = ""
    """What the stage publishes: `policy` (a causal LM in model/), `reward_model` (a scalar model in model/),
    `data` (preference pairs in data/) or `report`."""
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {}
    """Fields that may name another stage -> (role the stage must produce, whether the field must name a
    stage). Role `judge`: a reward-model stage or a Python judge (align/core/judges.py); `data`: a data stage or a card."""
    CARDS: ClassVar[dict[str, str]] = {}
    """Fields that hold a data card path (relative to the pipeline file) unless they name a stage -> how the stage
    reads the card: `examples` (it trains on, or learns from, the rows) or `prompts` (it samples from their
    prompts only). The planner resolves them, `align validate` loads and checks each one's rows."""
    ENGINES: ClassVar[tuple[str, ...]] = ("hf",)
    """The rollout engines (`generation.engine`) the stage can sample with (align/modeling/engines.py)."""
    ENGINE_MODEL: ClassVar[str] = "policy"
    """The field naming the stage whose model/ a separate engine (vllm) starts from (other weights reach it by
    sync): it must be whole weights, not LoRA adapters alone."""
    ENGINE_NOTE: ClassVar[str] = ""
    """Why the stage type lacks an engine, said when a pipeline asks for it."""
    WORK: ClassVar[str] = ""
    """The final metric that counts the work the stage did (optimiser steps, iterations, prompts evaluated): a
    stage that ends with it at 0 has failed, whatever it published."""

    type: str = ""
    """Stage kind, a registered stage type: sft, preferences, reward, dpo, ppo, evaluate, ... (default: the name)."""
    accelerate: str = "cpu"
    """Accelerate config: a name under pipelines/accelerate/ (cpu, ddp, zero2, zero3, ...) or a path."""
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

    # ------------------------------------------------------------------ what the orchestrator asks
    def references(self, role: str) -> list[str]:
        """The names this stage's reference fields of `role` hold (stages, cards or judges)."""
        return [r for fld, (want, _) in self.INPUTS.items() if want == role for r in refs(getattr(self, fld))]

    def card_split(self, fld: str) -> str:
        """The split of the card in field `fld` that the stage reads (validation loads and checks it)."""
        return "train"

    def relative_files(self) -> dict[str, str]:
        """Settings other than data cards that name a file relative to the pipeline (dotted key, list items by
        index -> the value): the runner writes them absolute into the spec; their content is part of the stage's
        fingerprint (editing the file reruns the stage)."""
        return {}

    def starts_from_base(self) -> bool:
        """Whether the stage starts from the pipeline's base model: its fingerprint then covers the base model,
        the tokenizer and the chat template."""
        return False

    def installs_chat_template(self, card_forms: dict[str, str], template_named: bool) -> bool:
        """Whether the stage installs the planned chat template on the base tokenizer (its special tokens, its
        end-of-turn token as EOS); `card_forms`: field -> the canonical form its card produces; `template_named`:
        the pipeline sets `chat_template` (not null). Validation installs it the same way before counting lengths."""
        return False

    def trains_on_assistant_turns(self) -> bool:
        """Whether conversations in this stage's cards are split into trained (assistant) and untrained tokens:
        validation renders them all that way, refusing a template that cannot be split, and shows one."""
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
        """Whether, under ZeRO-3, the stage gathers its whole policy on every GPU to sample from it (the estimate
        then counts one whole 16-bit copy of it)."""
        return False

    def length_check(self, fld: str) -> tuple[LengthRule, int, float] | None:
        """How over-long rows of the card in `fld` are treated: (rule, the length bound, the largest fraction that may
        be affected), counted by `align validate` and again at the stage's start; None: not counted."""
        return None

    def length_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of a card as the stage's length rule counts them (text rows; conversational ones already
        rendered with the chat template)."""
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
    """How the stage's trainer treats examples longer than max_length (align/data/lengths.py); counted before
    training, at `align validate` and again at the stage's start."""
    WORK: ClassVar[str] = "train/global_step"

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
    max_grad_norm: float | None = ranged(1.0, gt=0, fix="use null for no clipping")
    """Clip the gradient's global norm to this before each optimiser step (None = no clipping); under DeepSpeed it
    is DeepSpeed's gradient_clipping."""
    max_length: int = ranged(128, ge=2)
    """Longest tokenised example (after the chat template); longer ones are truncated or dropped by the trainer."""
    max_truncated_fraction: float = ranged(0.05, ge=0, le=1)
    """Refuse to train when more than this fraction of examples exceed max_length (counted before training)."""
    logging_steps: int = ranged(10, ge=1)
    """Log metrics every N optimiser steps."""
    save_steps: int = ranged(50, ge=1)
    """Write a resumable checkpoint every N optimiser steps."""
    save_total_limit: int = ranged(2, ge=1)
    """Keep this many resumable checkpoints (the newest; older ones are deleted once a newer one is complete). A
    ZeRO checkpoint of an 8B model holds weights and optimiser states, ~100 GB: 1 keeps one on disk at a time."""
    max_train_examples: int | None = ranged(None, ge=1, fix="use null for all examples")
    """Use at most this many training examples (None = all)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute. Off by default
    (TRL turns it on); `align estimate` and the memory preflight say when a stage needs it to fit."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters instead of full fine-tuning."""

    def check(self, ctx: CheckContext) -> None:
        self.check_steps()
        self.lora.check()

    def deepspeed_settings(self) -> dict[str, Any]:
        return {"gradient_accumulation_steps": self.gradient_accumulation_steps, "gradient_clipping": self.max_grad_norm}

    def check_steps(self) -> None:
        """Cross-field settings every TRL-trained stage needs; also checked by the stage process itself."""
        if self.save_steps % self.logging_steps:
            raise ValueError(f"save_steps ({self.save_steps}) must be a multiple of logging_steps "
                             f"({self.logging_steps}) so a NaN loss is caught before a checkpoint is written")

    def check_positions(self, limit: int, fix: str) -> None:
        if self.max_length > limit:
            raise ValueError(f"max_length: {self.max_length} is longer than the model accepts: {fix}; lower "
                             f"max_length to at most {limit}")
        super().check_positions(limit, fix)

    def length_check(self, fld: str) -> tuple[LengthRule, int, float] | None:
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
