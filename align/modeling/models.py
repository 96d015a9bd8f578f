"""Loading models and tokenizers: local paths, hub ids, and `builtin:` tiny models built from a config.

Everything here is explicit about two things users trip over: tokenizers without a pad token or chat template (fixed
and logged, never silently), and repositories that ship their own Python code (refused unless `trust_remote_code`).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from align.core import gguf
from align.core.errors import ModelError
from align.data.chat import encoding_problem
from align.templates import hub_file

if TYPE_CHECKING:  # annotations only
    from align.config import BuiltinModel

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def check_remote_code(path_or_id: str, trust_remote_code: bool) -> None:
    """Refuse a model or tokenizer whose config asks for custom code (config.json's or tokenizer_config.json's
    `auto_map`) unless the user opted in: transformers would load a generic class in its place without a word."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        try:
            raw = json.loads(_model_file(path_or_id, name).read_text())
        except (OSError, ValueError, AttributeError):  # (None: neither here nor on the hub)
            continue
        code = raw.get("auto_map") if isinstance(raw, dict) else None
        if code and (name == "config.json" or not isinstance(code, dict) or "AutoTokenizer" in code):
            raise ModelError(f"{path_or_id}: this model ships its own Python code ({name} auto_map); align does "
                             "not run remote code by default. Read the code, then set `trust_remote_code: true` "
                             "in the pipeline YAML to allow it.")


def _model_file(path_or_id: str, name: str) -> Path | None:
    """A model's small file: in its directory, else a hub id's from the hub cache or the hub, as its load fetches it
    first (a hub id's auto_map was never read: its model loaded as transformers' generic class)."""
    if Path(path_or_id).exists() or path_or_id.startswith((".", "/", "~")):
        return Path(path_or_id) / name
    try:  # (light: huggingface_hub)
        from huggingface_hub import hf_hub_download
        return Path(hub_file(path_or_id, name) or hf_hub_download(path_or_id, name))
    except Exception:  # not a repo id, offline, no such file: the load says what is wrong
        return None


# --------------------------------------------------------------------------------------------- tokenizers
def train_tokenizer(texts: Iterable[str], vocab_size: int, max_length: int, special_tokens: Iterable[str] = ()):
    """Train a byte-level BPE tokenizer on `texts` (deterministic: BPE merges are ranked by count, ties by
    byte order) with EOS, PAD and `special_tokens` (e.g. a chat template's) as special tokens and a default chat
    template."""
    # heavy: tokenizers and transformers load on use
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(dict.fromkeys([EOS_TOKEN, PAD_TOKEN, *special_tokens])),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=max_length)
    fast.chat_template = default_chat_template()
    return fast


def default_chat_template() -> str:
    """align's role-tagged template (align/templates/default.jinja), for tokenizers that ship none."""
    from align.templates import TEMPLATE_DIR

    return (TEMPLATE_DIR / "default.jinja").read_text(encoding="utf-8")


# Tokens a vocabulary holds for padding though its tokenizer names no pad token: Llama 3.1+'s reserved
# <|finetune_right_pad_id|> (id 128004), Pythia's <|padding|>, and the usual spellings.
PAD_NAMES = ("<|finetune_right_pad_id|>", "<|padding|>", "<|pad|>", "<pad>", "[PAD]")


def prepare_tokenizer(tok):
    """Give a tokenizer what training needs, and say what was changed. No pad token: a padding token its
    vocabulary already holds (`PAD_NAMES`), else EOS. A pad distinct from EOS matters to a reward model: a
    sequence classifier reads its score at the last token that is not the pad, so with pad = EOS every score is
    read before the final EOS and a reply cut at max_new_tokens scores as one that ended. (Labels are masked by
    the attention mask, so EOS as pad still gets a loss. A chat template is the plan's: align/templates/.)"""
    if tok.eos_token is None:
        raise ModelError("tokenizer has no EOS token: responses could never end and every response would get "
                         "the missing-EOS penalty; set `eos_token` in its tokenizer_config.json (or "
                         "special_tokens_map.json) and save it again")
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        held = next((t for t in PAD_NAMES if t in vocab and vocab[t] != tok.eos_token_id), None)
        tok.pad_token = held or tok.eos_token
        (log.info if held else log.warning)("tokenizer has no pad token: using %r as pad%s", tok.pad_token, "" if held
                                            else " (EOS: a reward model reads its score before the final EOS)")
    words = tok("The movie was great.", add_special_tokens=False)["input_ids"]
    if not words or all(i == tok.unk_token_id for i in words):
        raise ModelError(f"the tokenizer encodes ordinary text ('The movie was great.') as {words}, with {len(tok)} "
                         "tokens in all: it has no vocabulary to speak of, and every example would train on nothing. "
                         "Its vocabulary file (tokenizer.json, tokenizer.model, vocab.json + merges.txt) is missing "
                         "or damaged: copy the tokenizer again")
    problem = encoding_problem(tok)
    if problem:
        raise ModelError(f"the tokenizer {problem}")
    return tok


def from_pretrained_args(path_or_id: str) -> tuple[str, dict[str, Any]]:
    """(path, kwargs) for from_pretrained: a `.gguf` file read from its folder with `gguf_file`; the rest as it is."""
    if gguf.is_gguf(path_or_id) and Path(path_or_id).is_file():
        folder, name = gguf.folder_and_file(path_or_id)
        return folder, {"gguf_file": name}
    return path_or_id, {}


def load_tokenizer(path_or_id: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer  # heavy: loaded on use

    check_remote_code(path_or_id, trust_remote_code)
    path, extra = from_pretrained_args(path_or_id)
    if "gguf_file" in extra:
        from align.modeling.gguf_tokenizer import gguf_tokenizer_dir

        try:
            return prepare_tokenizer(AutoTokenizer.from_pretrained(gguf_tokenizer_dir(path_or_id)))
        except Exception:  # noqa: BLE001 - a damaged cached conversion (any reader's error): converted again once
            return prepare_tokenizer(AutoTokenizer.from_pretrained(gguf_tokenizer_dir(path_or_id, rebuild=True)))
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
    return prepare_tokenizer(tok)


# --------------------------------------------------------------------------------------------- models
def llama_config(size: Any, vocab_size: int, **token_ids: Any):
    """The LlamaConfig of the builtin model of `size` (align.config.BuiltinModel; tied embeddings, one key/value
    head per attention head)."""
    from transformers import LlamaConfig  # heavy: only the SFT stage and the helper's shapes build one

    return LlamaConfig(vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                       num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
                       num_key_value_heads=size.num_heads, max_position_embeddings=size.max_position_embeddings,
                       tie_word_embeddings=True, **token_ids)


def build_builtin(size: BuiltinModel, tokenizer, seed: int, attn_implementation: str | None = None):
    """A tiny Llama-style causal LM with fresh weights (deterministic given `seed`)."""
    from transformers import LlamaForCausalLM  # heavy: loaded on use

    cfg = llama_config(size, len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)
    if attn_implementation:
        cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def fit_model_to_tokenizer(model, tokenizer):
    """After special tokens were added or EOS changed (a chat template, align/templates/): grow the embeddings
    to the tokenizer's length (new rows drawn like the model's own init) and tell the model and its generation
    config which ids are EOS, PAD and BOS."""
    if len(tokenizer) > model.get_input_embeddings().weight.size(0):
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    for cfg in (model.config.get_text_config(), model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        if tokenizer.bos_token_id is not None:
            cfg.bos_token_id = tokenizer.bos_token_id
    return model


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "auto": "auto"}  # the checkpoint's own (its config's dtype): a pretrained stage republishes it as it is


ADAPTER_BASE = "align_adapter.json"
"""Beside a published LoRA adapter (adapter_config.json + weights): the model it was trained on, as the stage loaded
it, and its task; every align stage loads such a directory as that base with the adapter merged in."""


def adapter_base(path: str | Path) -> dict[str, str] | None:
    """What a published adapter directory was trained on ({base_model, task}), or None for a plain model."""
    file = Path(path) / ADAPTER_BASE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def merged_adapter(path: str, base, trust_remote_code: bool = False):
    """A published LoRA adapter merged into `base` (a fresh, whole load of what it was trained on): a plain model,
    with the token ids its stage set (`ADAPTER_BASE`'s `config` and `generation`)."""
    from peft import PeftModel  # heavy: loaded on use

    model = PeftModel.from_pretrained(base, path, is_trainable=False).merge_and_unload()
    model.requires_grad_(True)  # as from_pretrained leaves a plain model (peft froze the base's weights: a stage that
    # trained it whole, GRPO from an SFT adapter, had no gradient at all); who holds it frozen runs it without
    record = adapter_base(path) or {}
    for key, value in (record.get("config") or {}).items():
        setattr(model.config, key, value)
    if getattr(model, "generation_config", None) is not None:
        for key, value in (record.get("generation") or {}).items():
            setattr(model.generation_config, key, value)
    return model


def published_adapter(path_or_id: str, quantize: str) -> dict | None:
    """`adapter_base` of a published LoRA adapter directory (None for anything else), refused as QLoRA's base. Any
    other PEFT adapter (a hub repo or folder with adapter_config.json) is refused: transformers would load its base
    with the adapter attached, unmerged, and a stage would train or save the adapter alone (`pretrained`: a model/
    of adapter weights). Asked of the folder, or of the hub cache for an id: no request (one per load stalled an
    offline cluster for minutes); a hub adapter not cached is refused once transformers has loaded it (`whole`)."""
    base = adapter_base(path_or_id) if Path(path_or_id).is_dir() else None
    if base is None and _adapter_config(path_or_id):
        raise _adapter_refused(path_or_id)
    if base is not None and quantize != "none":
        raise ModelError(f"{path_or_id}: a LoRA adapter cannot be the 4-bit base of QLoRA (merging needs full "
                         "weights); publish it merged (lora.merge: true on the stage that trained it)")
    return base


def _adapter_config(path_or_id: str) -> bool:
    """Whether a folder, or the hub cache's copy of an id (no request), holds adapter_config.json."""
    if Path(path_or_id).is_dir():
        return (Path(path_or_id) / "adapter_config.json").is_file()
    return hub_file(path_or_id, "adapter_config.json") is not None


def _adapter_refused(path_or_id: str) -> ModelError:
    return ModelError(f"{path_or_id} is a PEFT adapter (adapter_config.json), not a whole model. Merge it into its "
                      "base (peft: AutoPeftModelForCausalLM.from_pretrained(...).merge_and_unload(), then "
                      "save_pretrained(DIR)) and name DIR, or name its base and train adapters of your own")


def whole(model, path_or_id: str):
    """`model` unless transformers attached a PEFT adapter to it as it loaded (`path_or_id` named one): refused."""
    if getattr(model, "_hf_peft_config_loaded", False):
        raise _adapter_refused(path_or_id)
    return model


def load_causal_lm(path_or_id: str, dtype: str = "float32", trust_remote_code: bool = False, quantize: str = "none",
                   **kwargs: Any):
    """A causal LM; `quantize: 4bit` loads it as QLoRA's frozen 4-bit base (see `quantization_kwargs`);
    `kwargs`: further from_pretrained arguments (align/modeling/compute.py: the attention kernel). A published LoRA
    adapter (`ADAPTER_BASE` beside it) loads as its base with the adapter merged in, whole (merging needs every
    weight: under ZeRO-3, DeepSpeed partitions it afterwards)."""
    from transformers import AutoModelForCausalLM  # heavy: loaded on use

    base = published_adapter(path_or_id, quantize)
    if base is not None:
        with unsharded_loading():
            plain = load_causal_lm(base["base_model"], dtype, trust_remote_code, **kwargs)
            return merged_adapter(path_or_id, plain, trust_remote_code)
    check_remote_code(path_or_id, trust_remote_code)
    path, extra = from_pretrained_args(path_or_id)
    if extra and quantize != "none":
        raise ModelError(f"{path_or_id}: a .gguf base model cannot be loaded in 4-bit for QLoRA (transformers "
                         "refuses both at once): convert it with `align model` or save_pretrained first, or set "
                         "lora.quantize: none")
    return for_kbit_training(dequantised(whole(AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code, **quantization_kwargs(quantize),
        **extra, **kwargs), path_or_id)))


def load_scalar_model(path_or_id: str, pad_token_id: int | None, dtype: str = "float32",
                      trust_remote_code: bool = False, quantize: str = "none", **kwargs: Any):
    """A sequence-classification model with one output: a reward or value model.

    Loading a causal-LM checkpoint this way keeps its transformer and adds a freshly initialised scalar
    head; loading a reward checkpoint keeps its trained head.
    """
    from transformers import AutoModelForSequenceClassification  # heavy: loaded on use

    base = published_adapter(path_or_id, quantize)
    if base is not None:
        with unsharded_loading():
            if base.get("task") == "SEQ_CLS":  # a reward model's adapter: its trained head comes with it
                plain = load_scalar_model(base["base_model"], pad_token_id, dtype, trust_remote_code, **kwargs)
                return merged_adapter(path_or_id, plain, trust_remote_code)
            return _scalar_from_lm(load_causal_lm(path_or_id, dtype, trust_remote_code, **kwargs), pad_token_id)
    check_remote_code(path_or_id, trust_remote_code)
    path, extra = from_pretrained_args(path_or_id)
    model = dequantised(whole(AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code,
        **quantization_kwargs(quantize), **extra, **kwargs), path_or_id))
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return for_kbit_training(model)


def _scalar_from_lm(lm, pad_token_id: int | None):
    """A scalar model on a causal LM's transformer (a policy published as an adapter, merged into its base): the
    backbone's weights as they are, a freshly initialised head (what from_pretrained of a causal-LM checkpoint
    gives a sequence-classification class)."""
    from transformers import AutoModelForSequenceClassification  # heavy: loaded on use

    config = lm.config
    config.num_labels = 1
    scalar = AutoModelForSequenceClassification.from_config(config, dtype=next(lm.parameters()).dtype)
    missing, _ = scalar.load_state_dict(lm.state_dict(), strict=False)
    head = {n for n, _ in scalar.named_parameters() if n.startswith("score")}
    if set(missing) - head:
        raise ModelError(f"a scalar model cannot be built on this causal LM: its weights {sorted(set(missing) - head)[:3]} "
                         "have no counterpart; publish the policy merged (lora.merge: true)")
    if pad_token_id is not None:
        scalar.config.pad_token_id = pad_token_id
    return scalar


def dequantised(model):
    """A model loaded from a GGUF file as the plain model it is: transformers dequantised every tensor but
    keeps marking it as GGUF-quantized, which makes it unsaveable ("not serializable"). Others as they are."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and type(quantizer).__name__ == "GgufHfQuantizer":
        packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
        if packed:  # transformers keeps some architectures' weights packed (with the `kernels` package)
            raise ModelError(f"transformers kept this GGUF model's layers quantized ({', '.join(packed)}); align "
                             "trains dequantised weights only: convert the file to a Hugging Face directory "
                             "first, or uninstall the `kernels` package")
        model.hf_quantizer = None
        for attr in ("is_quantized", "quantization_method"):
            if attr in model.__dict__:
                del model.__dict__[attr]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model


@contextmanager
def unsharded_loading():
    """Inside, from_pretrained loads whole weights even in a DeepSpeed ZeRO-3 process (for evaluation in the
    main process after training). transformers decides ZeRO-3 init from the HfDeepSpeedConfig that the
    Trainer registered; it is set aside here and restored after."""
    from transformers.integrations import deepspeed as hf_ds  # heavy: loaded on use

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


# --------------------------------------------------------------------------------------------- QLoRA loading
def quantization_kwargs(quantize: str) -> dict[str, Any]:
    """from_pretrained arguments for QLoRA's frozen base (Dettmers et al. 2023): 4-bit NormalFloat weights with
    double quantization, bf16 compute, on this process's GPU. {} for `none`."""
    if quantize == "none":
        return {}

    from transformers import BitsAndBytesConfig  # heavy: loaded on use

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    return {"quantization_config": config, "device_map": {"": int(os.environ.get("LOCAL_RANK", "0"))}}


def for_kbit_training(model):
    """A 4-bit model prepared as QLoRA prescribes (peft's prepare_model_for_kbit_training: every weight frozen, the
    non-quantized ones upcast to fp32; gradient checkpointing is left to the stage's own setting). Others as they are."""
    if not getattr(model, "is_loaded_in_4bit", False):
        return model
    from peft import prepare_model_for_kbit_training  # heavy: loaded on use

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability to 0 (modules and the attention-dropout settings some families read
    from their config in the forward pass), so the same input gives the same log-probs in the rollout and in
    the update (PPO's ratio is exactly 1 at the first step), whatever the model's train/eval mode."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    cfg = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout",
                "attention_probs_dropout_prob", "hidden_dropout_prob", "activation_dropout", "summary_first_dropout"):
        if cfg is not None and isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
    return model


def save_dequantised(gguf_path: str, target: str) -> None:
    """A GGUF file's model, every tensor dequantised to float32 by transformers' GGUF loader, and its tokenizer,
    saved as a Hugging Face directory in `target` (run by `align model`'s helper process)."""
    model = load_causal_lm(gguf_path, "float32")
    model.save_pretrained(target)
    load_tokenizer(gguf_path).save_pretrained(target)
