"""The memory arithmetic of `align estimate` (align/orchestrator/estimate.py, whose module doc lists the parts): bytes
per GPU for a model's training states, a frozen model, one micro-batch's activations, a KV cache, a fused LM head's
buffers, and what LoRA and QLoRA change, as pure functions of a model's shape. torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MODES = ("ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_optimizer")


class EstimateError(ValueError):
    """A model's size cannot be determined here; the message says what to provide."""


@dataclass
class ModelShape:
    """What the estimate needs to know about one architecture."""

    params: int
    largest_layer: int
    hidden: int
    layers: int
    heads: int
    vocab: int
    kv_heads: int = 0
    """Key/value heads (grouped-query attention; 0: as many as `heads`)."""
    head_dim: int = 0
    """Width of one head (0: hidden / heads)."""
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Every linear layer (nn.Linear, GPT-2's Conv1D) by module name -> (in features, out features)."""
    head: str = ""
    """The output head's module name (lm_head, embed_out, score): never quantized; a scalar model trains a copy."""
    scalar: bool = False
    """A reward / value model (with LoRA its head is trained whole)."""
    tied: bool = False
    """The output head is the input embeddings' weight (tie_word_embeddings)."""
    packs: bool = True
    """Whether the family's forwards can run padding-free with SDPA (align/modeling/packing.py packing_works)."""
    new_tokens: int = 0
    """Tokens the planned chat template adds to the tokenizer: a LoRA stage that installs it trains their embedding
    rows and a copy of the untied head (align/modeling/lora.py new_token_rows; 0: none, or not known here)."""
    activations: dict[str, dict[str, float]] = field(default_factory=dict)
    """What one decoder layer keeps for backward, measured by the helper (align/modeling/activations.py) per way of
    training (`bf16`, `autocast`, `fp32`, and each LoRA setting's): bytes per token (`token`) and per query-key pair
    (`sdpa_pair`: the mask SDPA is handed; `eager_pair`: eager's scores). Empty: unmeasured (`probe_note` says why),
    and a conservative figure is counted instead (`activation_bytes`)."""
    probe_note: str = ""


ASLEEP_BYTES = 2 ** 30
"""What a sleeping engine (generation.sleep) still holds on the GPU: its process's CUDA context and what vLLM keeps
outside its sleeping pools. An allowance, not measured (vLLM's sleep mode has not run in this project)."""


def asleep_engine(awake: int, activations: int) -> int:
    """What an engine of `awake` bytes that sleeps while the policy trains (generation.sleep: the stages put it to
    sleep before any model computes) adds to a GPU's peak, the larger of sampling (the engine awake) and training
    (the activations): its bytes beyond the activations, at least ASLEEP_BYTES (or all of them, when fewer)."""
    return max(awake - activations, min(awake, ASLEEP_BYTES))


def sampling_parts(awake: int, gather: int, activations: int, phased: bool, sleeps: bool,
                   change: int | None) -> tuple[int, int, int]:
    """What sampling adds to a GPU's peak, the larger of sampling and training, as (generation, rollout gather, how
    their sum moves when the activations move by `change`, e.g. with gradient checkpointing): `phased`, an engine
    that samples with the trained policy itself holds its KV cache (`awake`) and the policy gathered whole under
    ZeRO-3 (`gather`) only while it samples, none of it during the update: what lies beyond the activations; a
    sleeping one (`sleeps`) its bytes beyond them (asleep_engine); any other (an awake engine with its own copy of
    the policy, or a stage that trains nothing) all of it."""
    if phased:
        def beyond(a: int) -> int:
            return max(0, awake + gather - a)
        generation = min(awake, beyond(activations))
        return generation, beyond(activations) - generation, 0 if change is None else \
            beyond(activations + change) - beyond(activations)
    if sleeps:
        generation = asleep_engine(awake, activations)
        return generation, gather, 0 if change is None else asleep_engine(awake, activations + change) - generation
    return awake, gather, 0


def lora_key(lora: dict[str, Any], variant: str) -> str:
    """The name in ModelShape.activations of a LoRA setting's measure ({"r", "dropout", "targets"}) computed as
    `variant` (align/modeling/activations.py LORA_VARIANTS)."""
    return f"lora r={lora['r']} dropout={lora['dropout']} targets={','.join(sorted(lora['targets']))} {variant}"


def enabled_lora(stage: Any) -> Any:
    """A stage's LoRA settings when it trains adapters (every stage type that trains has the settings), else None."""
    lora = getattr(stage, "lora", None)
    return lora if lora is not None and lora.enabled else None


def qlora_base_problems(stages: dict[str, Any]) -> list[str]:
    """A QLoRA stage loads its input models 4-bit (align/modeling/models.py `published_adapter`; PPO's value model
    from the reward stage too, with value_init: reward): an input stage that publishes LoRA adapters alone cannot be
    that base (merging needs full weights). The stage found it when it loaded, after the stages before it trained;
    one line each."""
    out = []
    for name, stage in stages.items():
        lora = enabled_lora(stage)
        value_base = stage.references("judge") if getattr(stage, "value_init", None) == "reward" else []  # PPO's
        for ref in stage.references("policy") + stage.references("reward_model") + stage.references("model") \
                + value_base if lora is not None and lora.quantize != "none" else []:
            upstream = enabled_lora(stages.get(ref))
            if upstream is not None and not upstream.merge:
                out.append(f"stages.{name}: lora.quantize: {lora.quantize} loads stage '{ref}''s model as its 4-bit "
                           f"base, and '{ref}' publishes LoRA adapters alone (merging needs full weights); set "
                           f"stages.{ref}.lora.merge: true")
    return out


def lora_spec(lora, dropout_runs: bool) -> dict[str, Any]:
    """A stage's LoRA setting as the helper's layer probe measures it (align/modeling/activations.py); its dropout
    0 where the stage's type trains with dropout off (`DROPOUT`: TRL's preference and RL trainers and PPO turn off
    every dropout module, LoRA's too, and a dropout of 0 keeps nothing)."""
    return {"r": lora.r, "dropout": lora.dropout if dropout_runs else 0.0, "targets": sorted(lora.target_modules)}


def training_variant(lora, mode: str, dtype: str, precision: str, on_gpu: bool,
                     dropout_runs: bool = True) -> tuple[str, str]:
    """How a stage's trained layers compute, as (the layer probe's variant, the base variant without LoRA): fp32
    where the stage computes in fp32 (`precision: float32`, or `auto` off a GPU); else, outside DeepSpeed, fp32
    weights under bf16 autocast where they are fp32 (`dtype: float32`, or `auto`: the stage process's
    weights_dtype), and bf16 under DeepSpeed (its bf16 engine casts the model, whatever `dtype` loaded it as, and
    accelerate leaves autocast off) or with `dtype: bfloat16`. LoRA: under DeepSpeed base and adapters in bf16
    (ZeRO-1/2 casts every parameter; under ZeRO-3 the adapters keep the base's dtype), outside it a 16-bit base
    (`dtype: auto` loads a LoRA base in bf16: weights_dtype) with fp32 adapters under autocast (peft's
    autocast_adapter_dtype), fp32 under autocast with `dtype: float32`, QLoRA measured as a 16-bit base (its 4-bit
    base's other parameters are fp32), fp32 in fp32. `dropout_runs`: see lora_spec."""
    cls, base = variant_class(lora, mode, dtype, precision, on_gpu)
    return (lora_key(lora_spec(lora, dropout_runs), cls) if lora is not None else base), base


def variant_class(lora, mode: str, dtype: str, precision: str, on_gpu: bool) -> tuple[str | None, str]:
    """`training_variant`'s parts: (the LoRA variant, None without LoRA; the base variant)."""
    if (not on_gpu and precision == "auto") or precision == "float32":
        return ("fp32" if lora is not None else None), "fp32"
    fp32_weights = mode == "ddp" and dtype in ("float32", "auto")
    base = "autocast" if fp32_weights else "bf16"
    if lora is None:
        return None, base
    base_16bit = dtype in ("bfloat16", "float16") or (dtype == "auto" and precision in ("auto", "bfloat16"))
    if lora.quantize == "4bit" or (mode == "ddp" and base_16bit):
        return "bf16+fp32 adapters", "bf16"
    return ("bf16" if mode != "ddp" else base), base


def model_state_bytes(mode: str, params: int, largest_layer: int, gpus: int) -> int:
    """Bytes per GPU for a trained model's weights, gradients and Adam states (mixed precision). ZeRO-2 and ZeRO-3
    are DeepSpeed's own estimators' GPU figures (deepspeed.runtime.zero.stage_1_and_2.
    estimate_zero2_model_states_mem_needs, stage3.estimate_zero3_model_states_mem_needs: 2 bytes of 16-bit
    parameters, 18 of 16-bit and 32-bit gradients, 32-bit master weights and Adam moments), written out here
    because importing DeepSpeed imports torch, which the orchestrator never does; tests/test_estimate.py holds
    them equal to DeepSpeed's functions. DDP: the ZeRO paper's 16 bytes (K = 12) plus DDP's gradient buckets, a
    second fp32 copy of the gradients (accelerate's default gradient_as_bucket_view=False): 20; on one GPU nothing
    wraps the model in DDP (accelerate's DistributedType.NO): 16. ZeRO-1 by the same accounting as DeepSpeed's ZeRO-2
    (its fp32 gradient partition included): 4P + 16P/N."""
    if mode == "ddp":
        return (20 if gpus > 1 else 16) * params
    if mode == "zero1":
        return 4 * params + int(16 * params / gpus)
    if mode == "zero2":
        return 2 * params + int(18 * params / gpus)
    if mode == "zero2_offload":
        return 2 * params
    if mode == "zero3":
        return 4 * largest_layer + int(18 * params / gpus)
    if mode == "zero3_offload":
        return 4 * largest_layer
    if mode == "zero3_offload_optimizer":  # parameters stay on the GPUs, partitioned: their 16-bit shard
        return 4 * largest_layer + int(2 * params / gpus)
    raise ValueError(f"unknown mode '{mode}' (one of {MODES})")


def host_state_bytes(mode: str, params: int, gpus: int, nodes: int) -> int:
    """Host memory per node that an offload mode keeps for a trained model's states (0 for the other modes): the CPU
    figures of DeepSpeed's estimators, as `model_state_bytes` writes their GPU figures out, with their default buffer
    factor 1.5 and zero_init (align builds ZeRO-3 models under zero.Init): ZeRO-3 18 bytes a parameter over the nodes
    (16 with the parameters on the GPUs), ZeRO-2 max(4 x GPUs, 16)."""
    if mode == "zero2_offload":
        return int(params * max(4 * gpus, 16) * 1.5)
    if mode in ("zero3_offload", "zero3_offload_optimizer"):
        return int(params * (18 if mode == "zero3_offload" else 16) / nodes * 1.5)
    return 0


def frozen_bytes(mode: str, params: int, largest_layer: int, gpus: int, dtype_bytes: int) -> int:
    """Bytes per GPU for a model that is only run forward (reference, reward model)."""
    if mode in ("zero3", "zero3_offload_optimizer"):
        return int(dtype_bytes * params / gpus) + dtype_bytes * largest_layer
    if mode == "zero3_offload":
        return dtype_bytes * largest_layer
    return dtype_bytes * params


FALLBACK_TOKEN_H = 96
"""Bytes per token per unit of width per layer counted for a layer the probe could not measure (16-bit; twice in
fp32): above every family measured here (a Llama-3 layer 52, Gemma 3's ~72, GPT-2's ~91 with its tanh GELU), where
Korthikanti et al.'s GPT-3 figure is 34."""
LORA_UNMEASURED = 2.2
"""A LoRA setting the probe could not measure counts its base's figure this many times: the most measured here
(fp32 adapters on every linear layer of a Llama, with dropout: 114h against 52h)."""


def activation_bytes(shape: ModelShape, batch: int, seq: int, logits: bool = True, checkpointing: bool = False,
                     logit_tokens: int | None = None, eager: bool = False, variant: str = "bf16",
                     lora_unmeasured: bool = False, held_logits: tuple[int, int] | None = None) -> int:
    """One micro-batch's activations kept for backward, for a model trained as `variant` (a key of
    `shape.activations`: `bf16`, `autocast`, `fp32` or a LoRA setting's), plus, for a language model, the fp32
    logits and their gradient (a scalar head's output is negligible) of every token, or with `logit_tokens` (PPO's
    fused head) one chunk's recomputed logits and what its backward makes of them (~6 fp32 copies).
    Per layer: the measured bytes per token times s*b, and per query-key pair times s*s*b (SDPA: its mask; eager:
    the scores); unmeasured, FALLBACK_TOKEN_H * h per token, 6a per pair with eager, one 16-bit mask with SDPA (twice
    as many bytes in fp32); `lora_unmeasured`: a LoRA setting measured only without its adapters, LORA_UNMEASURED
    times. Under autocast, the 16-bit copies it makes of every weight, kept for backward: 2 bytes a weight of the
    layers' linear layers, and of the LM head where `logits` are computed whole (MoE experts held as 3-D parameters
    are not linear layers: not counted). With gradient checkpointing (full recomputation, Korthikanti et al. 2022 sec. 4) only
    each layer's input is kept (2 bytes per element, 4 where the residual stream is fp32: autocast, fp32, fp32
    adapters and QLoRA's fp32 norms), plus one layer's activations while it is recomputed."""
    s, b, h, a = seq, batch, shape.hidden, shape.heads
    wide = variant == "fp32" or variant.endswith((" fp32", "autocast", "fp32 adapters"))  # fp32 residual stream
    measured = shape.activations.get(variant)
    if measured:
        token, pair = measured["token"], measured["eager_pair" if eager else "sdpa_pair"]
    else:
        fp32 = 1 + (variant == "fp32" or variant.endswith(" fp32"))
        token, pair = FALLBACK_TOKEN_H * h * fp32, (6 * a if eager else 2) * fp32
    token *= LORA_UNMEASURED if lora_unmeasured else 1
    per_layer = s * b * token + pair * s * s * b
    kept = shape.layers * (2 + 2 * wide) * s * b * h + per_layer if checkpointing else shape.layers * per_layer
    if variant.endswith("autocast"):  # the head's copy too where it runs as a plain layer (not TRL's tiles)
        kept += 2 * sum(i * o for name, (i, o) in shape.linears.items() if name != shape.head or logits)
    if not logits:
        return int(kept)
    # the fused head's chunk in its backward: its fp32 logits, softmax, their product and gradients, ~6 copies;
    # else the whole logits: `held_logits` (positions a sequence, bytes an entry) where the stage says, 8 bytes each
    positions, per = held_logits or (s, 8)
    return int(kept) + (24 * min(s * b, logit_tokens) if logit_tokens else per * positions * b) * shape.vocab


def kv_cache_bytes(shape: ModelShape, batch: int, seq: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for `batch` sequences of length `seq` (grouped-query attention: kv_heads heads
    of head_dim each, not the model's width), plus one step of fp32 logits."""
    kv_width = (shape.kv_heads or shape.heads) * (shape.head_dim or shape.hidden // shape.heads)
    return 2 * shape.layers * batch * seq * kv_width * dtype_bytes + 4 * batch * shape.vocab


TRL_TILE_TOKENS, TRL_TILE_VOCAB = 4_096, 32_768  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, trl.trainer.utils


def trl_fused_head_bytes(shape: ModelShape, tokens: int, compute_bytes: int, head_trains: bool = True) -> int:
    """TRL's fused LM head (`add_fused_lm_head`, in every TRL trainer align uses since TRL 1.15: SFT, DPO, KTO, GRPO,
    RLOO), for `tokens` tokens of one micro-batch: the logits never exist whole. Its backward recomputes tiles of up to
    TRL_TILE_TOKENS tokens x TRL_TILE_VOCAB vocabulary entries in the compute dtype (one tile buffer and one slice of
    the head's weight cast to it) and accumulates in fp32 the gradient of the tokens' hidden states and, where the
    head trains (not under LoRA), of the head's weight (vocab x hidden), cast to the weight's dtype at the end."""
    vocab = min(shape.vocab, TRL_TILE_VOCAB)
    tile = (min(tokens, TRL_TILE_TOKENS) * vocab + vocab * shape.hidden) * compute_bytes
    return tile + 4 * tokens * shape.hidden + (4 + compute_bytes) * shape.vocab * shape.hidden * head_trains


def lora_layers(shape: ModelShape, lora: Any, new_tokens: int = 0) -> list[int]:
    """Parameters LoRA trains on a model of this shape, per layer (Hu et al. 2021, sec. 4.1): A (r x in) and B
    (out x r) for every linear layer that `lora.target_modules` names (peft's rule: the module's name is a target
    or ends with "." + target), plus the whole head of a scalar model (peft's modules_to_save), and where a chat
    template adds `new_tokens` (a causal LM with an untied head), their embedding rows and the whole head."""
    targets = set(lora.target_modules)
    hit = [dims for name, dims in shape.linears.items() if targeted(name, targets)]
    if not hit:
        raise EstimateError(f"lora.target_modules {sorted(targets)} match no linear layer of this model; its layers "
                            f"are named {sorted({n.rsplit('.', 1)[-1] for n in shape.linears})}")
    whole_head = shape.scalar or (new_tokens > 0 and not shape.tied)
    head = [shape.linears[shape.head][0] * shape.linears[shape.head][1]] if whole_head else []
    rows = [new_tokens * shape.hidden] if new_tokens > 0 and not shape.scalar else []
    return [lora.r * (i + o) for i, o in hit] + head + rows


def targeted(name: str, targets: set[str]) -> bool:
    """peft's rule for a list of target_modules: the module's name is a target or ends with "." + target."""
    return name in targets or any(name.endswith("." + t) for t in targets)


def missing_lora_targets(shape: ModelShape, lora: Any) -> list[str]:
    """The names in `lora.target_modules` that match no linear layer of this model (peft only fails when none
    matches; a misspelt one among good ones would silently train fewer layers than asked)."""
    return [t for t in lora.target_modules if not any(targeted(name, {t}) for name in shape.linears)]


def lora_params(shape: ModelShape, lora: Any, new_tokens: int = 0) -> int:
    return sum(lora_layers(shape, lora, new_tokens))


QLORA_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
"""NF4 with double quantization (Dettmers et al. 2023, sec. 3): 4 bits per weight, one 8-bit constant per block of
64 weights and one fp32 constant per 256 blocks."""


def qlora_base_bytes(shape: ModelShape) -> int:
    """QLoRA's frozen base: the weights of every linear layer but the head in 4-bit NF4 (QLORA_BYTES_PER_WEIGHT),
    every other parameter (embeddings, norms, biases, the head) in fp32, as peft's prepare_model_for_kbit_training
    leaves them. Not sharded by ZeRO: whole on every GPU."""
    quantized = sum(i * o for name, (i, o) in shape.linears.items() if name != shape.head)
    return int(quantized * QLORA_BYTES_PER_WEIGHT) + 4 * (shape.params - quantized)


def host_notes(name: str, mode: str, gpus: int, trained_params: dict[str, int], nodes: int, budget: bool,
               lora: bool) -> list[str]:
    """What an offload mode moves off the GPUs lands in the node's memory, and so does a stage's copy of its policy
    (`budget`: StageBase.keeps_policy_snapshot): how much, one line each."""
    notes, trained, gib = [], sum(trained_params.values()), 2 ** 30
    if budget and (policy := trained_params.get("policy")):  # as each process holds them: 16-bit under DeepSpeed
        zero3, width = mode.startswith("zero3"), 4 if mode == "ddp" or lora else 2
        copy = policy * width / (gpus if zero3 else 1) * gpus / nodes
        notes.append(f"stage '{name}': kl.max keeps a host copy of the trained policy on every process (to undo an "
                     f"update past the budget): ~{copy / gib:,.1f} GiB of host memory per node under {mode}"
                     + ("" if zero3 or lora else "; under ZeRO-3 or LoRA it is a partition or the adapters"))
    if host := host_state_bytes(mode, trained, gpus, nodes):
        notes.append(f"stage '{name}' under {mode} keeps ~{host / gib:,.0f} GiB of trained states in host memory per "
                     "node (DeepSpeed's estimator, 1.5 buffer factor): the node needs that much RAM free")
    return notes
