"""What a model's size is, read from its architecture on the meta device (nothing downloaded or allocated): run in
the orchestrator's helper process (align/orchestrator/helper.py) for `align estimate`, the memory preflight and
validation's LoRA-target check, which do their arithmetic without torch (align/orchestrator/estimate.py).

The answer is plain JSON: per model kind (`lm`, the causal LM; `scalar`, a reward / value model on the same
backbone) its parameter count, largest layer, width, depth, heads, vocabulary, every linear layer by name with
(in, out) features, the output head's name, whether it is a scalar model, and whether it runs padding-free with SDPA
(a probe on a one-layer copy, align/modeling/packing.py), and what one decoder layer keeps for backward
(`layer_probe`: measured on a narrowed two-layer copy, not taken from a formula).
"""

from __future__ import annotations

from typing import Any

from align.core import gguf


def shape_of(model) -> dict[str, Any]:
    cfg = model.config
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    linears = {n: (m.in_features, m.out_features) if hasattr(m, "in_features") else tuple(m.weight.shape)
               for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}  # Conv1D: (in, out)
    head_module = getattr(model, "score", None) or model.get_output_embeddings()
    head = next((n for n, m in model.named_modules() if m is head_module), "")
    heads = cfg.num_attention_heads
    return {"params": sum(p.numel() for p in model.parameters()), "largest_layer": largest,
            "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": heads,
            # grouped-query attention: the KV cache holds num_key_value_heads heads of head_dim each
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            "vocab": cfg.vocab_size, "linears": linears, "head": head, "scalar": hasattr(model, "score")}


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
           trust_remote_code: bool, source: str) -> dict[str, Any]:
    """The helper's entry point: {"shapes": {"lm": ..., "scalar": ...}}, or {"error": why} when the config
    cannot be read here (the caller decides whether that stops it)."""
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
    from align.modeling.packing import packing_works

    lm.config._attn_implementation = scalar.config._attn_implementation = "sdpa"  # what `auto` trains with
    kept = layer_probe(config, trust_remote_code)  # the same decoder layers under either head
    return {"shapes": {"lm": {**shape_of(lm), "packs": packing_works(lm), **kept},
                       "scalar": {**shape_of(scalar), "packs": packing_works(scalar), **kept}}}


# --------------------------------------------------------------------------------------------- activations
WIDTHS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size",
          "shared_expert_intermediate_size", "word_embed_proj_dim")
"""Config fields that are widths of a decoder layer besides hidden_size (MLP, experts, OPT's embedding projection):
narrowed with it."""
PROBE_TOKENS = (16, 32)


def layer_probe(config, trust_remote_code: bool = False) -> dict[str, float]:
    """What one decoder layer of this family keeps for backward, in bf16, as the family's transformers code does it
    (RMSNorm's fp32 upcast, a gated MLP's four intermediates, dropout masks, grouped-query K/V): `layer_bytes` per
    token with SDPA (q, k, v, its output and log-sum-exp; flash keeps the same), `score_bytes` more per layer per
    (query, key) pair with eager attention (the softmax's scores), with the linear part taken as SDPA's. Measured,
    since Korthikanti et al. 2022's 34h per token is GPT-3's layer (a 4h GELU MLP): a Llama-3 layer keeps ~49h.

    The bytes are the storages autograd saves in one forward (torch.autograd.graph.saved_tensors_hooks, each
    storage once, the weights left out), two layers less one. The probe runs on a copy narrowed by k (`narrowing`):
    every width and head count divided by k, head_dim kept, so each saved tensor is 1/k of the full model's and the figure is k times the copy's (a per-token scalar,
    such as RMSNorm's rsqrt, is overcounted k times: 4k bytes). Zeros (the estimate then uses Korthikanti's
    formula) when the copy cannot be built or run here: a composite config (a vision tower beside the text model),
    or an architecture whose config refuses the narrowing."""
    unknown = {"layer_bytes": 0.0, "score_bytes": 0.0}
    try:
        composite = config.get_text_config() is not config
    except ValueError:
        composite = True
    if composite:
        return unknown
    try:  # a config (remote code) may refuse a field's new value
        k = narrowing(config)
        small = scaled(config, 1, k)
        small.vocab_size, small.pad_token_id = 64, None
        sdpa = _per_layer(small, "sdpa", PROBE_TOKENS[0], trust_remote_code)
        short, long = (_per_layer(small, "eager", s, trust_remote_code) for s in PROBE_TOKENS)
    except (RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError, NotImplementedError):
        return unknown
    s1, s2 = PROBE_TOKENS  # eager's bytes per layer: a*s + b*s^2
    pairs = (long / s2 - short / s1) / (s2 - s1)
    return {"layer_bytes": k * sdpa / s1, "score_bytes": k * max(pairs, 0.0)}


def narrowing(config) -> int:
    """The probe's k: the largest common divisor of the heads, key/value heads and every width that leaves at least
    2 heads and 2 key/value heads (a single head makes a transposed copy a view: layers would keep less than
    the model's)."""
    import math

    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    widths = [getattr(config, f) for f in WIDTHS if isinstance(getattr(config, f, None), int)]
    common = math.gcd(heads, kv, config.hidden_size, *widths)
    return max(k for k in range(1, common + 1) if common % k == 0 and heads // k >= 2 and (kv == 1 or kv // k >= 2))


def scaled(config, num: int, den: int):
    """A copy of `config` with its width, heads, key/value heads and every width of WIDTHS times num / den (head_dim
    stays: declared, or hidden / heads)."""
    import copy

    small = copy.deepcopy(config)
    small.hidden_size = small.hidden_size * num // den
    small.num_attention_heads = small.num_attention_heads * num // den
    if getattr(small, "num_key_value_heads", None):
        small.num_key_value_heads = small.num_key_value_heads * num // den
    for f in WIDTHS:
        if isinstance(getattr(small, f, None), int):
            setattr(small, f, getattr(small, f) * num // den)
    return small


def _per_layer(config, attention: str, tokens: int, trust_remote_code: bool) -> int:
    """Bytes autograd saves for one more decoder layer, one sequence of `tokens` tokens, in bf16."""
    return _saved(config, 2, attention, tokens, trust_remote_code) - _saved(config, 1, attention, tokens,
                                                                            trust_remote_code)


def _saved(config, layers: int, attention: str, tokens: int, trust_remote_code: bool) -> int:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attention,
                                             trust_remote_code=trust_remote_code).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=torch.zeros(1, tokens, dtype=torch.long))
    return sum(kept.values())

