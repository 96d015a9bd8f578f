"""Per-stage, per-GPU memory estimates, before anything is launched (`align estimate`, and `align run`'s preflight).

For every stage: the models it holds (policy, reference, reward, value), their parameter counts (the models are
built on the meta device from their configs: nothing is downloaded or allocated), and the memory one GPU needs
under each parallelism mode. The parts, all per GPU, with N = GPUs in the job:

* trained models' states (16-bit weights, gradients, fp32 master weights and Adam moments). ZeRO-2 and ZeRO-3
  use DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`):
  ZeRO-2 2P + 18P/N, ZeRO-3 4L + 18P/N, ZeRO-3 with optimizer and parameter offload 4L (L = the largest layer's
  parameters, gathered whole). DeepSpeed has none for plain data parallel and ZeRO-1; those follow the ZeRO paper
  (Rajbhandari et al. 2020, section 3.1, K = 12) with what it leaves out: DDP 20P (its gradient buckets, a second
  fp32 copy of the gradients; 16P on one GPU, where nothing wraps the model), ZeRO-1 4P + 16P/N (the fp32 gradient partition, as DeepSpeed counts it for ZeRO-2).
* frozen models (reference, reward model) in the pipeline dtype: whole on every GPU, except under ZeRO-3 where
  those DeepSpeed prepares are sharded like the trained ones (bytes x P / N plus one gathered layer), or offloaded
  (one layer); a stage type says which it holds whole (`HeldModel.sharded`: e.g. GRPO's reward model, called from a
  Python reward function, and every model of a stage that trains nothing).
* activations of one micro-batch: what one decoder layer of the family keeps for backward, measured by the helper
  on narrowed copies of the model (align/modeling/activations.py), per token and per query-key pair (SDPA: the mask
  it is handed, one per sequence; eager: the scores), for the way the stage trains (`training_variant`: bf16
  weights, fp32 weights under bf16 autocast plus autocast's 16-bit weight copies, fp32, and with LoRA the stage's
  own adapters: a Llama-3 layer ~52h bytes per token in bf16); unmeasured, a conservative 96h per token (where
  Korthikanti et al. 2022's GPT-3 figure is 34h), said below the table; plus the logits and their gradient in fp32
  (8*s*b*V bytes), except where a fused head never holds them: PPO's (one chunk's, `logit_tokens`) and TRL's in
  every TRL trainer (tiles and the head's fp32 gradient, align/orchestrator/memory.py `trl_fused_head_bytes`); and
  the logits a stage that scores its samples without a fused head holds (`scoring_bytes`, at most 2 GiB a call);
* the KV cache of generation (PPO rollouts, preference sampling, evaluation): 2 * layers * b * s * kv_heads *
  head_dim * bytes (grouped-query attention keeps kv_heads < heads: Llama-3-8B 8 of 32, a quarter of 2 * h); with
  `generation.engine: vllm` the engine's own copy of the policy plus its KV cache, or the `gpu_memory_utilization`
  share of the GPU that vLLM takes, whichever is larger (`engine_bytes`); one that sleeps while the policy trains
  (`generation.sleep`) counts only what it holds beyond the activations, at least `ASLEEP_BYTES` (memory.py) or all
  of it when less (the peak is the larger of sampling and training).
* the rollout gather: under ZeRO-3 a stage that samples from its sharded policy gathers it whole on every GPU for the
  duration (PPO's hf engine with `generation.zero3_gather: whole`, TRL's own generate in GRPO/RLOO; an engine with its
  own copy, vllm, is synced a layer at a time and gathers none): one whole copy of the policy in the pipeline dtype
  (`StageBase.gathers_policy_for_generation`); and a fixed allowance
  for the CUDA context and allocator fragmentation.

With `lora.enabled` a trained model is a frozen base (a frozen model as above, in the pipeline dtype) plus adapters,
and only the adapters have trained states: r * (in + out) parameters per targeted linear layer (Hu et al. 2021), plus
a scalar model's head, which peft trains as a copy (memory.py `lora_layers`), and, where a stage installs a chat
template that adds tokens, their embedding rows and a copy of the untied head. With `lora.quantize: 4bit` (QLoRA) the
base is whole on every GPU at ~0.52 bytes per linear weight, fp32 elsewhere (`qlora_base_bytes`). A stage that serves
a frozen model from a trained one's base (PPO's reference, DPO's) says so in `held_models`. Activations are measured
with the stage's adapters (their dropout and fp32 copies can keep more than full fine-tuning: 2.2x for a Llama layer
with fp32 adapters on every linear layer); a 4-bit base as a bf16 one. Estimates for a go/no-go decision, not promises.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.engines import holds_own_copy, kind as engine_kind
from align.orchestrator import helper
from align.core.builtin import is_builtin
from align.config import PipelineConfig, StageBase
from align.orchestrator.hardware import Hardware
from align.orchestrator.inputs import resolve_model_paths, tokenizer_to_check
from align.orchestrator.launch import accelerate_config, accelerate_mode, is_distributed, processes_per_node
from align.orchestrator.memory import (FALLBACK_TOKEN_H, LORA_UNMEASURED, EstimateError, ModelShape, activation_bytes,
                                      enabled_lora, host_notes, sampling_parts, frozen_bytes, host_state_bytes, kv_cache_bytes,
                                      lora_key, lora_layers, lora_spec, model_state_bytes, qlora_base_bytes,
                                      training_variant, trl_fused_head_bytes, variant_class)
from align.orchestrator.plan import StagePlan, build_plan

GB, GIB = 1e9, 2 ** 30
OVERHEAD_BYTES = 1 * GIB  # CUDA context, allocator slack, DeepSpeed's buckets (h^2: 34 MB at h 4096; runtime/zero_buffers.py)
REPORTED_MODES = ("zero2", "zero3", "zero3_offload")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Held:
    role: str  # policy, reference, reward, value, judge
    shape: ModelShape
    trained: bool
    sharded: bool = True  # a frozen model under ZeRO-3: partitioned (True) or whole on every GPU


@dataclass
class StageEstimate:
    name: str
    type: str
    mode: str  # the stage's own accelerate config, as a mode
    gpus: int
    held: list[Held]
    bytes_by_mode: dict[str, int] = field(default_factory=dict)
    parts: dict[str, dict[str, int]] = field(default_factory=dict)
    checkpointing: bool = False  # the stage's gradient_checkpointing setting
    lora: str = ""  # "LoRA" or "QLoRA" when the stage trains adapters
    trained_params: dict[str, int] = field(default_factory=dict)  # role -> parameters with optimizer states
    with_checkpointing: int | None = None  # chosen mode's bytes if checkpointing were on (when it is off)
    notes: set[str] = field(default_factory=set)  # what was not measured, and what was counted instead

    @property
    def chosen_bytes(self) -> int:
        return self.bytes_by_mode[self.mode]


def engine_bytes(gen: Any, policy: ModelShape, batch: int, seq: int, dtype_bytes: int, gpu_memory: int | None) -> int:
    """What sampling holds per GPU: the KV cache of one generation batch for an engine that samples with the stage's
    own model (counted above), more for one with its own copy of the policy (its EngineKind.memory)."""
    kv = kv_cache_bytes(policy, batch, seq, dtype_bytes)
    if gen is None:
        return kv
    return engine_kind(gen.engine).sampling_bytes(gen, policy.params * dtype_bytes, kv, gpu_memory)


# --------------------------------------------------------------------------------------------- shapes
def model_sources(cfg: PipelineConfig, source: str | Path) -> dict[str, Any]:
    """Where the base model's config comes from, as the helper's shape builder takes it (align/modeling/shapes.py):
    paths resolved here, so the helper needs no pipeline file."""
    paths = resolve_model_paths(cfg, source)
    declared = None
    if cfg.base_model_config and not is_builtin(cfg.base_model):
        local = Path(source).resolve().parent / cfg.base_model_config
        if not local.exists():
            raise EstimateError(f"{source}: base_model_config: '{cfg.base_model_config}' not found (looked for {local})")
        declared = str(local.parent if local.is_file() else local)
    return {"base_model": str(paths["base_model"]), "base_model_config": declared, "tokenizer": paths["tokenizer"],
            "builtin": dataclasses.asdict(cfg.builtin), "trust_remote_code": cfg.trust_remote_code,
            "source": str(source)}


def model_shapes(cfg: PipelineConfig, source: str | Path, needed: tuple[list[str], dict[str, set[str]]] | None = None,
                 plans: list[StagePlan] = ()) -> dict[str, ModelShape]:
    """Shapes of the causal LM and of the scalar (reward / value) model on the same backbone, built on the meta
    device in a helper process (torch; align/modeling/shapes.py), with what a layer keeps for backward: the
    variants `needed` names (`probe_plan`), else every variant and each LoRA setting's every variant; and the tokens
    the chat template adds where a LoRA stage of `plans` installs it (`installs_template`)."""
    loras = [lora_spec(st.lora, st.DROPOUT) for st in cfg.stages.values() if enabled_lora(st) is not None]
    loras = list({json.dumps(x, sort_keys=True): x for x in loras}.values())
    variants = None
    if needed is not None:
        variants, classes = needed[0], needed[1]
        loras = [{**x, "variants": sorted(classes.get(json.dumps(x, sort_keys=True), ()))} for x in loras]
    adds = [p for p in plans if enabled_lora(p.cfg) is not None and p.installs_template(cfg.chat_template is not None)]
    template = {"template": adds[0].chat_template.as_dict(), "template_tokenizer": tokenizer_to_check(cfg, source)} \
        if adds and not is_builtin(cfg.base_model) else {}
    answer = helper.call("align.modeling.shapes:shapes", **model_sources(cfg, source), loras=loras,
                         variants=variants, **template)
    if "error" in answer:
        raise EstimateError(answer["error"])
    out = {}
    for kind, d in answer["shapes"].items():
        adapted = {lora_key(spec, variant): measure for spec, found in zip(loras, d.pop("lora_activations", []))
                   for variant, measure in found.items()}
        out[kind] = ModelShape(**{**d, "linears": {k: tuple(v) for k, v in d["linears"].items()},
                                  "activations": {**d.get("activations", {}), **adapted}})
    return out


# --------------------------------------------------------------------------------------------- stages
def dtype_bytes(dtype: str, on_gpu: bool, precision: str = "auto") -> int:
    """Bytes per weight of the pipeline's `dtype`; `auto` is bfloat16 where the stage computes in bf16 on a GPU
    (`precision` auto or bfloat16), float32 otherwise: `precision: float32` or float16, and CPUs (the stage process's
    rule, align/runtime/context.py `weights_dtype`: models trained whole outside DeepSpeed keep fp32 weights, which
    the state formulas below count anyway)."""
    if dtype != "auto":
        return _DTYPE_BYTES[dtype]
    return _DTYPE_BYTES["bfloat16" if on_gpu and precision in ("auto", "bfloat16") else "float32"]


def runs_eager(stage, attention: str, packs: bool = True) -> bool:
    """Whether the stage's trained models keep eager attention's scores: `attn_implementation: eager`, or a
    left-padded stage (PPO, GRPO, RLOO) run padded (`padding_free: false`, or a family that cannot pack: `packs`),
    which leaves SDPA for eager on a GPU (modeling.compute); else SDPA or flash (auto: transformers picks SDPA),
    which never keep them."""
    padded = not getattr(stage, "padding_free", True) or not packs
    return attention == "eager" or (stage.LEFT_PADDED and padded and attention in ("auto", "sdpa"))


def _frozen(h: Held, lora, mode: str, gpus: int, dbytes: int) -> int:
    """A frozen model's weights, or a LoRA base's, loaded as a frozen one is (the stage process's weights_dtype:
    `dtype: auto` is bf16 for both on a bf16 GPU, in or outside DeepSpeed); QLoRA's in 4 bits."""
    if h.trained and lora.quantize == "4bit":
        return qlora_base_bytes(h.shape)
    return frozen_bytes(mode if h.sharded or h.trained else "ddp", h.shape.params, h.shape.largest_layer, gpus, dbytes)


def probe_plan(cfg: PipelineConfig, plans: list[StagePlan], source: str | Path,
               hw: Hardware) -> tuple[list[str], dict[str, set[str]]]:
    """The layer-probe variants the estimate of `plans` reads (every reported mode and each stage's own): base
    variants, and per LoRA setting (its JSON) the LoRA variants; the probe measures those alone."""
    bases: set[str] = set()
    classes: dict[str, set[str]] = {}
    for plan in plans:
        if not any(h.trained for h in plan.cfg.held_models(cfg.stages)):
            continue  # nothing trains: no activations are counted
        lora = enabled_lora(plan.cfg)
        mode, _ = accelerate_mode(accelerate_config(plan.cfg.accelerate, source))
        for m in {*REPORTED_MODES, mode}:
            cls, base = variant_class(lora, m, cfg.dtype, cfg.precision, hw.gpu_memory is not None)
            bases.add(base)
            if cls is not None:
                classes.setdefault(json.dumps(lora_spec(lora, plan.cfg.DROPOUT), sort_keys=True), set()).add(cls)
    return sorted(bases), classes


def _activations(est: StageEstimate, h: Held, variant: tuple[str, str], batch: int, seq: int, unfused: bool,
                 recompute: bool, chunk: int | None, eager: bool, held: tuple[int, int] | None) -> int:
    """One trained model's activations as `variant` (wanted, base) says it trains, noting in `est` what was not
    measured and what was counted instead."""
    wanted, base = variant
    chosen = wanted if wanted in h.shape.activations else base
    if base not in h.shape.activations:
        wide = 2 if chosen == "fp32" or chosen.endswith(" fp32") else 1  # activation_bytes' fallback, in fp32
        est.notes.add(f"activations: not measured ({h.shape.probe_note}); counted {wide * FALLBACK_TOKEN_H}h bytes "
                      "per token per layer")
    if chosen != wanted:
        est.notes.add(f"activations of stage '{est.name}': its LoRA setting was not measured"
                      + (f" ({h.shape.probe_note})" if h.shape.probe_note else "")
                      + f"; counted {LORA_UNMEASURED}x training without adapters")
    return activation_bytes(h.shape, batch, seq, h.role == "policy" and unfused, recompute, chunk, eager, chosen,
                            lora_unmeasured=chosen != wanted, held_logits=held)


def _workload(stage: StageBase, stages: dict[str, StageBase]) -> tuple[int, int, int, int]:
    """The stage's workload; a sampling stage whose prompts a reward model bounds (they leave a reply room within its
    max_length) samples at most that bound plus max_new_tokens, not StageBase.workload's 256-token prompts."""
    train_b, train_s, gen_b, gen_s = stage.workload()
    check = stage.length_check("prompts", stages) if type(stage).workload is StageBase.workload and gen_b else None
    return train_b, train_s, gen_b, check[1] + stage.generation_settings().max_new_tokens if check else gen_s


def estimate_stage(name: str, stage: StageBase, stages: dict[str, StageBase], shapes: dict[str, ModelShape],
                   mode: str, gpus: int, dtype: str, gpu_memory: int | None = None, attention: str = "auto",
                   precision: str = "auto", nodes: int = 1, installs_template: bool = False) -> StageEstimate:
    held = [Held(h.role, shapes[h.kind], h.trained, h.sharded) for h in stage.held_models(stages)]
    ckpt = bool(getattr(stage, "gradient_checkpointing", False))
    est = StageEstimate(name, stage.type, mode, gpus, held, checkpointing=ckpt)
    dbytes = dtype_bytes(dtype, on_gpu=gpu_memory is not None, precision=precision)
    train_b, train_s, gen_b, gen_s = _workload(stage, stages)
    trained, lora = [h for h in held if h.trained], enabled_lora(stage)
    # With LoRA the trained states are the adapters' (and a head where peft trains one); without, the whole model's.
    try:
        layers = {h.role: lora_layers(h.shape, lora, h.shape.new_tokens if installs_template and not h.shape.scalar
                                      else 0) for h in trained} if lora else {}
    except EstimateError as exc:
        raise EstimateError(f"stages.{name}.{exc}; name some of these in stages.{name}.lora.target_modules") from None
    est.trained_params = trained_params = {h.role: sum(layers[h.role]) if lora else h.shape.params for h in trained}
    largest = max((max(layers[h.role]) if lora else h.shape.largest_layer for h in trained), default=0)
    frozen = [h for h in held if not h.trained or lora]
    est.lora = ("QLoRA" if lora.quantize == "4bit" else "LoRA") if lora else ""
    eager = runs_eager(stage, attention, packs=all(h.shape.packs for h in trained))

    def fused(h: Held) -> bool:  # a TRL trainer's policy: TRL's fused head holds tiles, never the whole logits
        return stage.TRL_FUSED_HEAD and h.role == "policy"

    def acts(recompute: bool, chunk: int | None, variant: tuple[str, str]) -> int:
        return sum(_activations(est, h, variant, train_b, train_s, not fused(h), recompute, chunk, eager,
                                getattr(stage, "held_logits", lambda: None)()) for h in trained)

    for m in dict.fromkeys((*REPORTED_MODES, mode)):
        parts = {"trained_states": 0, "frozen_weights": 0, "activations": 0, "generation": 0, "rollout_gather": 0,
                 "overhead": OVERHEAD_BYTES}
        if trained:  # trained models share one engine (PPO: policy + value)
            chunk = stage.logit_tokens(m, gpu_memory is not None)
            parts["trained_states"] = model_state_bytes(m, sum(trained_params.values()), largest, gpus)
            variant = training_variant(lora, m, dtype, precision, gpu_memory is not None, stage.DROPOUT)
            kept = acts(ckpt, chunk, variant)
            computes = 2 if variant[1] == "bf16" else dbytes
            parts["activations"] = kept + sum(  # in bf16 where DeepSpeed cast it; LoRA: a copy of the head for new tokens
                trl_fused_head_bytes(h.shape, train_b * train_s, computes, not lora or bool(
                    installs_template and h.shape.new_tokens and not h.shape.tied)) for h in trained if fused(h))
            if m == mode and not ckpt and hasattr(stage, "gradient_checkpointing"):
                est.with_checkpointing = acts(True, chunk, variant) - kept  # plus the total, filled in below
        parts["frozen_weights"] = sum(_frozen(h, lora, m, gpus, dbytes) for h in frozen)
        if gen_b:
            gen, change = stage.generation_settings(), est.with_checkpointing if m == mode else None
            awake = engine_bytes(gen, held[0].shape, gen_b, gen_s, dbytes, gpu_memory) + getattr(
                stage, "scoring_bytes", lambda vocab: 0)(held[0].shape.vocab)  # the logits of scoring samples at once
            gather = computes * held[0].shape.params if m.startswith("zero3") and trained and \
                stage.gathers_policy_for_generation() else 0  # the whole policy (as DeepSpeed holds it)
            parts["generation"], parts["rollout_gather"], more = sampling_parts(  # an engine sampling with the
                awake, gather, parts["activations"], bool(trained) and not holds_own_copy(gen.engine),  # trained
                bool(trained) and gen.sleep, change)  # policy itself: its KV cache and gather end before the update
            est.with_checkpointing = change + more if change is not None else est.with_checkpointing
        est.parts[m] = parts
        est.bytes_by_mode[m] = sum(parts.values())
    if est.with_checkpointing is not None:
        est.with_checkpointing += est.bytes_by_mode[mode]
    est.notes.update(host_notes(name, mode, gpus, trained_params, nodes, stage.keeps_policy_snapshot(), bool(lora)))
    return est


# --------------------------------------------------------------------------------------------- pipeline
def estimate_pipeline(cfg: PipelineConfig, source: str | Path, hw: Hardware, num_processes: int | None = None,
                      plans: list[StagePlan] | None = None, shapes: dict[str, ModelShape] | None = None,
                      launched: bool = False) -> list[StageEstimate]:
    """Every stage's estimate (model shapes from a helper process unless given), on processes per node as `launched`
    stages start (their own count, --num-processes, else their accelerate config's), else one per GPU as planned."""
    plans = plans or build_plan(cfg, source)
    shapes = shapes or model_shapes(cfg, source, probe_plan(cfg, plans, source, hw), plans)
    out = []
    for plan in plans:
        mode, cfg_n = accelerate_mode(accelerate_config(plan.cfg.accelerate, source))
        distributed = is_distributed(plan.cfg, source)
        per_node = processes_per_node(plan.cfg, num_processes if launched else num_processes or hw.gpus_per_node,
                                      source) or (cfg_n if distributed else 1) or 1
        gpus = per_node * (hw.nodes if distributed else 1)
        out.append(estimate_stage(plan.name, plan.cfg, cfg.stages, shapes, mode, gpus, cfg.dtype, hw.gpu_memory,
                                  cfg.attn_implementation, cfg.precision, hw.nodes if distributed else 1,
                                  plan.installs_template(cfg.chat_template is not None)))
    return out


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


PARTS = (("trained_states", "trained states"), ("frozen_weights", "frozen weights"), ("activations", "activations"),
         ("generation", "generation"), ("rollout_gather", "rollout gather"), ("overhead", "overhead"))


def render(estimates: list[StageEstimate], hw: Hardware) -> str:
    cap = hw.capacity
    lines = [f"per-GPU memory estimate, GiB ({hw.describe()}); see align/orchestrator/estimate.py for the formulas", "",
             "| stage | type | models (parameters) | GPUs | " + " | ".join(REPORTED_MODES) + " | chosen | fits |",
             "|---|---|---|---|" + "---|" * len(REPORTED_MODES) + "---|---|"]
    for e in estimates:
        models = ", ".join(f"{h.role}{'*' if h.trained else ''} {h.shape.params / 1e6:,.1f}M"
                           + (f" ({e.lora} {e.trained_params[h.role] / 1e6:,.2f}M)" if h.trained and e.lora else "")
                           for h in e.held) or "-"
        fits = "-" if not cap else ("yes" if e.chosen_bytes <= cap else "NO")
        trains = any(h.trained for h in e.held)
        lines.append(f"| {e.name} | {e.type} | {models} | {e.gpus} | "
                     + " | ".join(_gib(e.bytes_by_mode[m]) if trains else "-" for m in REPORTED_MODES)
                     + f" | {e.mode}: {_gib(e.chosen_bytes)} | {fits} |")
    lines += ["", "* = trained. A stage that trains nothing holds each model whole whatever its accelerate config "
              "(its ZeRO columns: -).", "",
              "Breakdown of the chosen mode, GiB per GPU:", "",
              "| stage | mode | " + " | ".join(label for _, label in PARTS) + " | total |",
              "|---|---|" + "---|" * (len(PARTS) + 1)]
    for e in estimates:
        parts = e.parts[e.mode]
        lines.append(f"| {e.name} | {e.mode}{' + ckpt' if e.checkpointing else ''} | "
                     + " | ".join(_gib(parts.get(k, 0)) for k, _ in PARTS) + f" | {_gib(e.chosen_bytes)} |")
    lines += ["", "trained states: weights, gradients, master weights and Adam moments (ZeRO-sharded); frozen weights: "
              "reference and reward models; activations: one micro-batch (+ ckpt: gradient checkpointing), with a fused "
              "LM head's tiles instead of whole logits where the stage has one; generation: the KV cache (grouped-query "
              "attention) or a vllm engine; rollout gather: the whole policy gathered under ZeRO-3 to sample; overhead: "
              f"{OVERHEAD_BYTES / GIB:.0f} GiB CUDA context, allocator slack and DeepSpeed's buckets."]
    lines += sorted({note for e in estimates for note in e.notes})
    ckpt = [f"{e.name} {_gib(e.with_checkpointing)}" for e in estimates
            if e.with_checkpointing is not None and e.with_checkpointing < e.chosen_bytes]
    if ckpt:
        lines.append("With gradient_checkpointing: true (now off), the chosen mode would need: " + ", ".join(ckpt) + ".")
    return "\n".join(lines)


def too_big(estimates: list[StageEstimate], hw: Hardware, names: set[str] | None = None) -> list[str]:
    """One line per selected stage whose chosen mode does not fit the GPU memory (empty when unknown), with the
    fixes that apply to its stage type: a stage that trains nothing is not helped by a ZeRO config."""
    if not hw.gpu_memory:
        return []
    out = []
    for e in estimates:
        if (names is None or e.name in names) and e.chosen_bytes > hw.capacity:
            detail = ", ".join(f"{k} {_gib(v)}" for k, v in e.parts[e.mode].items() if v)
            out.append(f"stage '{e.name}' ({e.mode}, {e.gpus} GPUs) needs ~{_gib(e.chosen_bytes)} GiB per GPU "
                       f"({detail}) but a GPU has {_gib(hw.capacity)} GiB free; " + "; ".join(_fixes(e, hw)))
    return out


def _fixes(e: StageEstimate, hw: Hardware) -> list[str]:
    """What would make a stage fit, by what it holds."""
    cap, fixes = hw.capacity or 0, []
    if not any(h.trained for h in e.held):  # nothing trains: ZeRO does not apply, every model is whole
        if e.parts[e.mode]["generation"]:
            fixes.append(f"lower stages.{e.name}.generation.batch_size (the KV cache is "
                         f"{_gib(e.parts[e.mode]['generation'])} GiB)")
        return fixes + ["or hold fewer or smaller models: ZeRO does not shard a stage that trains nothing"]
    if e.with_checkpointing is not None and e.with_checkpointing <= cap:
        fixes.append(f"gradient checkpointing would fit (~{_gib(e.with_checkpointing)} GiB; set "
                     f"stages.{e.name}.gradient_checkpointing: true)")
    gather = e.parts[e.mode]["rollout_gather"]
    if gather and e.type == "ppo" and e.chosen_bytes - gather <= cap:
        fixes.append(f"generation.zero3_gather: layers would fit (no whole-policy gather, {_gib(gather)} GiB less; "
                     "much slower sampling)")
    alts = [m for m in REPORTED_MODES if e.bytes_by_mode[m] <= cap]
    if alts:
        host = {m: host_state_bytes(m, sum(e.trained_params.values()), e.gpus, hw.nodes) for m in alts}
        fixes.append(" or ".join(m + (f" (with ~{host[m] / GIB:,.0f} GiB of host memory per node)" if host[m] else "")
                                 for m in alts) + f" would fit (set stages.{e.name}.accelerate)")
    return fixes or ["use more GPUs, smaller batches or a smaller model"]
