"""LoRA (Hu et al. 2021) and QLoRA (Dettmers et al. 2023) through peft: the adapter config a stage trains with,
adapters added to a model, and merging trained adapters into the plain model that a stage's model/ holds.
QLoRA's 4-bit loading itself is part of loading a model (align/modeling/models.py `quantization_kwargs`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from align.core.errors import ModelError
from align.modeling.models import load_causal_lm, load_scalar_model, unsharded_loading

if TYPE_CHECKING:
    from align.config import LoraSettings


def peft_config(lora: LoraSettings, task_type: str, new_tokens: NewTokens | None = None) -> Any:
    """A peft LoraConfig when LoRA is enabled, else None (full fine-tuning). For SEQ_CLS peft also trains a copy
    of the scalar head (`modules_to_save`: `score`), keeping the original for when adapters are disabled.
    `new_tokens` (`new_token_rows`): embedding rows and the head peft trains beside the adapters."""
    if not lora.enabled:
        return None
    from peft import LoraConfig  # heavy: loaded on use

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), task_type=task_type,
                      trainable_token_indices={new_tokens.embeddings: new_tokens.ids} if new_tokens else None,
                      modules_to_save=[new_tokens.head] if new_tokens else None)


@dataclass(frozen=True)
class NewTokens:
    """The embedding rows a chat template's new tokens added to a loaded model, and what LoRA trains for them."""

    embeddings: str
    """The input embeddings' module name: peft trains these rows of it alone (its trainable tokens)."""
    ids: list[int]
    head: str
    """The output head's module name: peft trains a copy of it whole (`modules_to_save`), as TRL's SFTTrainer does
    for a template it installs: TRL's fused LM head reads the head's weight, which only a copy of the whole head
    gives it (525M parameters at Llama-3.1-8B)."""


def new_token_rows(model, ids: list[int]) -> NewTokens | None:
    """What LoRA trains for the tokens a chat template added (`ids`, from `fit_model_to_tokenizer`'s growth or rows
    past the tokenizer a padded vocabulary never used, as Qwen2.5's): LoRA freezes the embeddings and the head, so
    those tokens (the end-of-turn token among them, the one every response must end with) would keep rows that were
    never trained. TRL's SFTTrainer does the same for a template it installs. None without ids. A head tied to the
    embeddings is refused (ModelError): TRL's fused head would read the frozen rows."""
    if not ids:
        return None
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        raise ModelError(f"the chat template added {len(ids)} tokens to a model whose output head is tied to its "
                         "embeddings: LoRA cannot train their rows there (TRL's fused head reads the head's frozen "
                         "weight); use a template whose tokens the model has, or train this stage without LoRA "
                         "(lora.enabled: false)")
    return NewTokens(names[id(model.get_input_embeddings())], list(ids), names[id(head)])


def add_adapters(model, lora: LoraSettings, task_type: str, zero3: bool = False, autocast: bool = False):
    """`model` wrapped in trainable LoRA adapters, its own weights frozen (a peft PeftModel); with `autocast`
    (`upcasts_trainables`) every parameter it trains in fp32 (`fp32_trainables`)."""
    from peft import get_peft_model  # heavy: loaded on use

    # Under ZeRO-3 adapters keep the base's dtype: DeepSpeed gathers parameters in one dtype (TRL issue 6089).
    peft_model = get_peft_model(model, peft_config(lora, task_type), autocast_adapter_dtype=not zero3)
    return fp32_trainables(peft_model) if autocast else peft_model


def upcasts_trainables(compute_dtype, deepspeed_plugin, quantized: bool = False) -> bool:
    """Whether a LoRA stage trains its adapters and head copies in fp32 (`fp32_trainables`): where it computes under
    autocast (`compute_dtype`, modeling.compute) outside DeepSpeed, and a QLoRA model's head copies and token rows
    (`quantized`) in fp32 compute too: TRL casts them to bf16 whatever the precision, and the fp32 hidden states
    met a bf16 scalar head. Under DeepSpeed its engine sets every parameter's dtype itself (ZeRO-1/2's bf16 engine
    casts them all and keeps fp32 master weights; ZeRO-3 gathers one dtype). The one rule for PPO's adapters and
    the TRL stages'."""
    return deepspeed_plugin is None and (compute_dtype is not None or quantized)


def fp32_trainables(model):
    """`model` (a PeftModel on a 16-bit base) with every parameter it trains in fp32: peft's autocast_adapter_dtype
    upcasts LoRA's A and B and trainable token rows, but not a `modules_to_save` copy (a reward or value model's
    scalar head, the head a chat template's new tokens train), which outside DeepSpeed (no fp32 master weights)
    would take Adam's updates in bf16, most of them rounded away. Only under autocast, where they compute in bf16 as
    the rest (without it the copy's fp32 weight would meet its base's 16-bit inputs), and not under ZeRO-3 (it
    gathers one dtype; ZeRO-1/2's bf16 engine casts every parameter itself). QLoRA's adapters stay as TRL casts them
    (bf16, after the QLoRA paper), its head copies and token rows too are fp32. Anything but a PeftModel (a model
    trained whole) is left as it is."""
    if not hasattr(model, "peft_config"):
        return model
    quantized = getattr(model, "is_loaded_in_4bit", False)
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16) and \
                (not quantized or "modules_to_save" in name or "trainable_tokens" in name):
            param.data = param.data.float()
    return model


def merged_lora_model(base, lora: LoraSettings, task_type: str, trained_state: dict[str, torch.Tensor],
                      config: Any = None):
    """A plain transformers model: `base` (a fresh, unquantized load of the weights the adapters were trained on)
    with the trained adapter weights from `trained_state` (a PeftModel's state_dict) merged in. Merging into a
    fresh load rather than in place also serves QLoRA, whose training copy of the base is 4-bit. `config`: the
    trained model's own peft config (its trainable token rows too), else the settings' one."""
    import copy

    from peft import get_peft_model  # heavy: loaded on use

    model = get_peft_model(base, copy.deepcopy(config) if config is not None else peft_config(lora, task_type))
    wanted = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in wanted if n not in trained_state]
    if missing:
        raise ModelError(f"cannot merge LoRA adapters: {len(missing)} adapter weights are missing from the trained "
                         f"state (first: {missing[0]}); the adapter settings changed between training and saving")
    model.load_state_dict({n: trained_state[n] for n in wanted}, strict=False)
    return model.merge_and_unload()


def merged_for_saving(peft_model, lora: LoraSettings, dtype: str, gathered: dict[str, torch.Tensor] | None = None,
                      trust_remote_code: bool = False):
    """A trained PeftModel as the plain model that `model/` holds: merged in place, or, for QLoRA (a 4-bit training
    copy, which merging in place would re-quantize), merged into a fresh unquantized load of the same weights, or,
    under ZeRO-3 (`gathered`: every parameter's 16-bit whole, on the main process), merged from that."""
    if gathered is not None:
        return merged_from_gathered(peft_model, gathered)
    if not getattr(peft_model, "is_loaded_in_4bit", False):
        return in_one_dtype(peft_model.merge_and_unload())
    config = peft_model.peft_config[peft_model.active_adapter]
    path, task = config.base_model_name_or_path, getattr(config.task_type, "value", config.task_type)
    with unsharded_loading():
        base = load_scalar_model(path, None, dtype, trust_remote_code) if task == "SEQ_CLS" else \
            load_causal_lm(path, dtype, trust_remote_code)
    _as_trained(base, peft_model.get_base_model())
    return merged_lora_model(base, lora, task, peft_model.state_dict(), config)


def in_one_dtype(model):
    """A merged model with every floating weight in the dtype most of its weights have: the fp32 copies LoRA trained
    beside a 16-bit base (a scalar or LM head: fp32_trainables) made model/ a mix, its config naming the first
    weight's dtype (~1 GB more at 8B for the head). Weights only: buffers (RoPE's) stay as the model keeps them, and
    so do the weights the model's class keeps in fp32 in that dtype (`kept_in_fp32`: a MoE router's gate)."""
    sizes: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    dtype = max(sizes, key=sizes.__getitem__, default=None)
    kept = kept_in_fp32(model, dtype)
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != dtype and not (param.dtype == torch.float32 and kept(name)):
            param.data = param.data.to(dtype)
    return model


def kept_in_fp32(model, dtype) -> Callable[[str], bool]:
    """Whether a parameter (by name) is one transformers keeps in fp32 when it loads the model in `dtype`: its class's
    `_keep_in_fp32_modules_strict` in bf16 and fp16, `_keep_in_fp32_modules` in fp16 (a MoE router's gate and
    score-correction bias: DeepSeek-V3, GLM-4-MoE). A module name matches whole dotted parts, `*` any one part."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.bfloat16,
                                                                                         torch.float16) else set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return lambda name: False
    pattern = re.compile("|".join(r"(?:^|\.)" + re.escape(n).replace(r"\*", r"[^.]+") + r"(?:$|\.)"
                                  for n in sorted(names)))
    return lambda name: pattern.search(name) is not None


def plain_embeddings(model):
    """The model's input embedding module itself, under peft's trainable-tokens wrapper when it wears one (which
    answers none of nn.Embedding's attributes but its weight)."""
    emb = model.get_input_embeddings()
    return getattr(getattr(emb, "token_adapter", None), "base_layer", emb)


def _as_trained(fresh, trained) -> None:
    """A fresh load of the base given what the stage changed before training (`fit_model_to_tokenizer`: embeddings
    grown for a chat template's new tokens, unquantized in a 4-bit model, and the token ids it set), so model/ holds
    every row its tokenizer can produce."""
    grown = plain_embeddings(trained).weight
    if fresh.get_input_embeddings().num_embeddings != grown.size(0):
        fresh.resize_token_embeddings(grown.size(0), mean_resizing=False)
        with torch.no_grad():
            fresh.get_input_embeddings().weight.copy_(grown)
            head, own = fresh.get_output_embeddings(), trained.get_output_embeddings()
            if head is not None and own is not None and head.weight is not fresh.get_input_embeddings().weight:
                head.weight.copy_(own.weight)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        for cfg, own in ((fresh.config, trained.config),
                         (getattr(fresh, "generation_config", None), getattr(trained, "generation_config", None))):
            if cfg is not None and own is not None:
                setattr(cfg, key, getattr(own, key, None))


def merged_from_gathered(peft_model, gathered: dict[str, torch.Tensor]):
    """Under ZeRO-3 a process holds a partition of each weight: merging in place adds B A to empty tensors (nothing,
    or a shape error). `gathered` (the wrapped PeftModel's whole 16-bit state, every key) is loaded into a PeftModel
    of the same structure built on the CPU (the embeddings as the stage grew them, the token ids it set), and merged
    there. Keys a tied weight shares are the only ones allowed to be absent."""
    import copy

    from peft import get_peft_model  # heavy: loaded on use

    base = peft_model.get_base_model()
    config = peft_model.peft_config[peft_model.active_adapter]
    with unsharded_loading():
        plain = type(base)._from_config(base.config, dtype=next(iter(gathered.values())).dtype)
    model = get_peft_model(plain, copy.deepcopy(config))  # the trained one's: its trainable token rows too
    missing, unexpected = model.load_state_dict(gathered, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {p.data_ptr() for n, p in params.items() if n in gathered}
    untied = [n for n in missing if n not in params or params[n].data_ptr() not in loaded]
    if untied or unexpected:
        raise ModelError(f"cannot merge the ZeRO-3 LoRA model: the gathered state lacks {untied[:3]} / has unknown "
                         f"{unexpected[:3]}")
    return model.merge_and_unload()


def without_peft(model) -> torch.nn.Module:
    """The transformers model inside a peft wrapper (its adapted layers still apply), or `model` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
