"""What a model's size is, read from its architecture on the meta device (nothing downloaded or allocated): run in
the orchestrator's helper process (align/orchestrator/helper.py) for `align estimate`, the memory preflight and
validation's LoRA-target check, which do their arithmetic without torch (align/orchestrator/estimate.py).

The answer is plain JSON: per model kind (`lm`, the causal LM; `scalar`, a reward / value model on the same
backbone) its parameter count, largest layer, width, depth, heads, vocabulary, every linear layer by name with
(in, out) features, the output head's name, whether it is a scalar model, and whether it runs padding-free with SDPA
(a probe on a one-layer copy, align/modeling/packing.py), and what one decoder layer keeps for backward
(align/modeling/activations.py: measured on narrowed copies, not taken from a formula).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from align.core import gguf
from align.modeling.activations import KV_HEADS


def shape_of(model) -> dict[str, Any]:
    cfg = model.config.get_text_config()  # a vision-language model (Gemma 3 4B+) keeps its decoder's under text_config
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    linears = {n: (m.in_features, m.out_features) if hasattr(m, "in_features") else tuple(m.weight.shape)
               for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}  # Conv1D: (in, out)
    head_module = getattr(model, "score", None) or model.get_output_embeddings()
    head = next((n for n, m in model.named_modules() if m is head_module), "")
    heads = cfg.num_attention_heads
    return {"params": sum(p.numel() for p in model.parameters()), "largest_layer": largest,
            "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": heads,
            # grouped-query attention: the KV cache holds num_key_value_heads heads of head_dim each (Falcon's
            # num_kv_heads; its multi_query attention outside the new decoder architecture, one)
            "kv_heads": 1 if getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", True)
            else next((getattr(cfg, f) for f in KV_HEADS if getattr(cfg, f, None)), heads),
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            "vocab": cfg.vocab_size, "linears": linears, "head": head, "scalar": hasattr(model, "score"),
            "tied": head_module is not None and head_module.weight is model.get_input_embeddings().weight}


def template_tokens(tokenizer: str, template: dict[str, Any], trust_remote_code: bool) -> int:
    """How many tokens installing the planned chat template adds to the tokenizer (0 where it does not load here:
    validation names why)."""
    from align import templates
    from align.modeling.models import load_tokenizer

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its notes are validation's to print, not the estimate's
            tok = load_tokenizer(tokenizer, trust_remote_code)
            before = len(tok)
            templates.install(tok, templates.ChatTemplate.from_dict(template))
    except (OSError, ValueError, TypeError, KeyError):  # ModelError, FormatError: ValueErrors
        return 0
    return len(tok) - before


def base_config(base_model: str, base_model_config: str | None, tokenizer: str | None, builtin: dict[str, Any],
                trust_remote_code: bool, source: str):
    """The base model's transformers config without downloading weights (builtin, a declared copy, a GGUF file's
    metadata, a local directory, or the hub / local HF cache)."""
    from transformers import AutoConfig  # heavy: this is the helper process

    from align.config import BuiltinModel
    from align.core.builtin import is_builtin
    from align.modeling.models import llama_config, load_tokenizer

    if is_builtin(base_model):
        size = BuiltinModel(**builtin)
        vocab = len(load_tokenizer(tokenizer, trust_remote_code)) if tokenizer else size.vocab_size
        return llama_config(size, vocab)
    if base_model_config:
        return AutoConfig.from_pretrained(base_model_config)
    try:
        if gguf.is_gguf(base_model):  # the config is in the file's metadata
            folder, name = gguf.folder_and_file(base_model)
            return AutoConfig.from_pretrained(folder, gguf_file=name)
        return AutoConfig.from_pretrained(base_model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise LookupError(
            f"{source}: base_model '{base_model}': cannot read its config here ({type(exc).__name__}). Put a "
            "copy of its config.json beside the pipeline and name it in `base_model_config:`.") from None


def shapes(base_model: str, base_model_config: str | None, tokenizer: str | None, builtin: dict[str, Any],
           trust_remote_code: bool, source: str, loras: list[dict[str, Any]] = (), probe: bool = True,
           variants: list[str] | None = None, template: dict[str, Any] | None = None,
           template_tokenizer: str | None = None) -> dict[str, Any]:
    """The helper's entry point: {"shapes": {"lm": ..., "scalar": ...}}, or {"error": why} when the config
    cannot be read here (the caller decides whether that stops it). With `probe`, what a layer keeps for backward
    (align/modeling/activations.py), for full training (`variants`: which ways; all when None) and for each LoRA
    setting of `loras`. With `template`, the tokens it adds to `template_tokenizer` (the lm's `new_tokens`)."""
    import torch  # heavy: this is the helper process
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = base_config(base_model, base_model_config, tokenizer, builtin, trust_remote_code, source)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            config.num_labels = 1
            scalar = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    except LookupError as exc:
        return {"error": str(exc)}
    except (ValueError, ImportError, KeyError, TypeError, OSError) as exc:  # e.g. an architecture transformers
        return {"error": f"{source}: base_model '{base_model}': its shapes cannot be built here "  # builds no
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}  # scalar head for
    from align.modeling.activations import layer_probe
    from align.modeling.packing import packing_works

    lm.config._attn_implementation = scalar.config._attn_implementation = "sdpa"  # what `auto` trains with
    kept = layer_probe(config, loras, trust_remote_code, variants) if probe else {}  # the same decoder layers under either head
    added = template_tokens(template_tokenizer, template, trust_remote_code) if template and template_tokenizer else 0
    return {"shapes": {"lm": {**shape_of(lm), "packs": packing_works(lm), "new_tokens": added, **kept},
                       "scalar": {**shape_of(scalar), "packs": packing_works(scalar), **kept}}}
