"""What one decoder layer of a model keeps for backward, measured: the activation part of `align estimate` (run in
the orchestrator's helper process, align/modeling/shapes.py; the arithmetic that uses it is torch-free,
align/orchestrator/memory.py `activation_bytes`).

Korthikanti et al. 2022's 34h bytes per token per layer is GPT-3's layer (a 4h GELU MLP, 16-bit). transformers'
layers keep more and differ by family and by how a stage trains: a Llama-3 layer keeps ~52h in bf16 (RMSNorm's fp32
upcast, a gated MLP's four intermediates, K/V repeated to every head when a mask is given), ~62h with fp32 weights
under bf16 autocast, and with LoRA adapters on every linear layer and their dropout up to 2.2x full fine-tuning (fp32
adapters each keep an fp32 copy of their input, a dropout mask and fp32 outputs downstream). So the probe measures
each way a stage may train (`VARIANTS`, and LoRA as each LoRA stage sets it) instead of taking a constant.

How: a copy of the config narrowed by k (`narrowing`: every width and head count divided by k, head_dim kept, a
64-token vocabulary), built with one and with two layers; one forward of each, in train mode, with a padding mask
(the worst case: transformers then hands SDPA a mask and repeats K/V per head), under
torch.autograd.graph.saved_tensors_hooks, counting each saved storage once and leaving the weights out. The
two-layer model less the one-layer model is one layer. Three sequence lengths separate, per layer, bytes per token
(times k), bytes per query-key pair (eager: the scores, per head, times k; SDPA: the masks it is handed, (b, 1, s, s)
tensors told by their shape, one per sequence, not times k) and a constant (autocast's 16-bit copies of the weights: the estimate counts those from the
shapes, 2 bytes a weight). A per-token scalar (RMSNorm's rsqrt) is counted k times: a few bytes per token more.
Each kind of layer a stack holds is measured (`_stacks`) and the largest figure of each term kept. Measures are kept in
align's cache (`layer-probe/`), keyed by the config, what was asked, this file and the versions of torch,
transformers and peft: a Llama-3-8B config takes ~5 s a variant on a 2-core CPU, once; `align estimate` asks only for
the variants its stages read (bf16 alone for the shipped 8B pipelines).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

from align.core.fsutil import atomic_write_json, cache_root

WIDTHS = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size",
          "shared_expert_intermediate_size", "word_embed_proj_dim")
"""Config fields that are widths of a decoder layer besides hidden_size (MLP, experts, OPT's embedding projection):
narrowed with it."""
KV_HEADS = ("num_key_value_heads", "num_kv_heads")  # Falcon names them num_kv_heads
MAX_NARROWING = 8  # widths a config has that WIDTHS does not name (MLA ranks, Mamba's) stay: k stays small
MAX_LAYER_PARAMS = 150_000_000
"""The largest narrowed layer the probe builds (in CPU memory, fp32 for some variants): Llama-3-70B's narrows to
~54M parameters; Llama-3.1-405B's (~199M) is not probed here."""
PROBE_TOKENS = (16, 32, 64)
VARIANTS = {"bf16": ("bfloat16", False), "autocast": ("float32", True), "fp32": ("float32", False)}
"""How a trained model's layers may compute: 16-bit weights (DeepSpeed's bf16, or `dtype: bfloat16`), fp32 weights
under bf16 autocast (outside DeepSpeed with `dtype: auto` on a GPU), fp32 throughout (`precision: float32`, CPUs)."""
LORA_VARIANTS = {"bf16": ("bfloat16", False, False), "autocast": ("float32", True, True),
                 "bf16+fp32 adapters": ("bfloat16", True, True), "fp32": ("float32", False, True)}
"""LoRA's: base and adapters in bf16 (DeepSpeed ZeRO-1/2 casts every parameter; under ZeRO-3 the adapters keep the
base's dtype, align/modeling/lora.py), fp32 base and adapters under autocast (outside DeepSpeed with `dtype:
float32`), a 16-bit base with fp32 adapters under autocast (outside DeepSpeed otherwise: peft's
autocast_adapter_dtype, where accelerate's bf16 autocast is on; QLoRA's 4-bit base, whose other parameters peft keeps
in fp32, is measured as this), and fp32 throughout."""


def layer_probe(config, loras: list[dict[str, Any]] = (), trust_remote_code: bool = False,
                variants: list[str] | None = None) -> dict[str, Any]:
    """{"activations": {variant: {"token": bytes per token, "sdpa_pair": bytes per query-key pair with SDPA,
    "eager_pair": with eager attention}}, "lora_activations": [{variant: ...}], "probe_note": ""}: the VARIANTS
    named in `variants` (all when None), and for each LoRA setting of `loras` ({"r", "dropout", "targets"} and
    optionally "variants", the LORA_VARIANTS to measure; in that order) each of its variants (empty for a setting
    that could not be measured: the note says why); or no measures and a note saying why (the estimate then counts
    a conservative figure and says so). Each variant builds two models: asking for fewer is faster."""
    try:
        cached = cache_root() / "layer-probe" / f"{_cache_key(config, [loras, variants], trust_remote_code)}.json"
        text = config.get_text_config()  # a composite (vision beside text): its decoder
        k = narrowing(text)
        small = scaled(text, 1, k)
        small.vocab_size, small.pad_token_id = 64, None
    except Exception as exc:  # noqa: BLE001 -- a model's own config code may raise anything: said, never a traceback
        return _unmeasured(f"the layer probe could not run ({_why(exc)})")
    found = _read_cached(cached)
    if found is not None:
        return found
    try:
        stacks = _stacks(small)
        params = max(_layer_params(c, trust_remote_code) for c in stacks)
        if params > MAX_LAYER_PARAMS:
            return _unmeasured(f"the layer probe was not run: a layer narrowed by {k} still has {params:,} "
                               f"parameters (more than {MAX_LAYER_PARAMS:,})")
        out = {name: _measure(stacks, k, dtype, autocast, None, trust_remote_code)
               for name, (dtype, autocast) in VARIANTS.items() if variants is None or name in variants}
    except Exception as exc:  # noqa: BLE001 -- a model's own code may raise anything; the estimate says so, and why
        return _unmeasured(f"the layer probe could not run ({_why(exc)})")
    adapted, notes = [], []
    for lora in loras:
        try:
            adapted.append({name: _measure(stacks, k, dtype, autocast, {**lora, "fp32": fp32}, trust_remote_code)
                            for name, (dtype, autocast, fp32) in LORA_VARIANTS.items()
                            if name in lora.get("variants", LORA_VARIANTS)})
        except Exception as exc:  # noqa: BLE001 -- e.g. peft refusing a target: this setting alone is unmeasured
            adapted.append({})
            notes.append(f"LoRA r={lora['r']} targets={lora['targets']} could not be probed ({_why(exc)})")
    found = {"activations": out, "lora_activations": adapted, "probe_note": "; ".join(notes)}
    try:
        atomic_write_json(cached, found)
    except OSError:  # a read-only or full cache: measured again next time
        pass
    return found


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _unmeasured(note: str) -> dict[str, Any]:
    return {"activations": {}, "lora_activations": [], "probe_note": note}


def _read_cached(path: Path) -> dict[str, Any] | None:
    """A cached answer of the right shape, else None (absent, torn, or written by something else: measured again)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    measures = [found.get("activations")] + list(found.get("lora_activations") or []) if isinstance(found, dict) \
        else [None]
    ok = isinstance(found, dict) and isinstance(found.get("probe_note"), str) and isinstance(
        found.get("lora_activations"), list) and all(
        isinstance(m, dict) and all(isinstance(v, dict) and all(isinstance(v.get(t), (int, float)) for t in
                                                                 ("token", "sdpa_pair", "eager_pair"))
                                    for v in m.values()) for m in measures)
    return found if ok else None


def _cache_key(config, loras, trust_remote_code: bool) -> str:
    from importlib.metadata import version

    parts = [config.to_json_string(use_diff=False), list(loras), trust_remote_code, Path(__file__).read_text(),
             *(version(p) for p in ("torch", "transformers", "peft"))]  # this file: a changed probe measures again
    if trust_remote_code:  # a model's own code: the folder transformers put it in (named by its commit), its text
        path = getattr(sys.modules.get(type(config).__module__), "__file__", None)
        parts += [type(config).__module__, *(f.read_text(errors="replace") for f in
                                             (sorted(Path(path).parent.glob("*.py")) if path else []))]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def narrowing(config) -> int:
    """The probe's k: the largest common divisor of the heads, key/value heads and every width, at most
    MAX_NARROWING, that leaves at least 2 heads and 2 key/value heads where there were (a single head makes a
    transposed copy a view: a layer would keep less than the model's); 1 when none does."""
    heads = config.num_attention_heads
    kv = next((getattr(config, f) for f in KV_HEADS if getattr(config, f, None)), heads)
    widths = [getattr(config, f) for f in WIDTHS if isinstance(getattr(config, f, None), int)]
    common = math.gcd(heads, kv, config.hidden_size, *widths)
    return max((k for k in range(1, min(common, MAX_NARROWING) + 1)
                if common % k == 0 and heads // k >= 2 and (kv < 2 or kv // k >= 2)), default=1)


def scaled(config, num: int, den: int):
    """A copy of `config` with its width, heads, key/value heads and every width of WIDTHS times num / den (head_dim
    stays: declared, or hidden / heads)."""
    small = copy.deepcopy(config)
    small.hidden_size = small.hidden_size * num // den
    small.num_attention_heads = small.num_attention_heads * num // den
    alias = getattr(small, "attribute_map", None) or {}  # e.g. intermediate_size read from moe_intermediate_size
    done = {alias.get(f, f) for f in ("hidden_size", "num_attention_heads")}
    for f in dict.fromkeys(alias.get(f, f) for f in (*KV_HEADS, *WIDTHS)):  # each field once, under its own name
        if f not in done and isinstance(getattr(small, f, None), int):
            setattr(small, f, getattr(small, f) * num // den)
    return small


def _stacks(config) -> list:
    """Copies of `config` whose second layer (the one measured) is each kind of layer its stack holds: each distinct
    entry of `layer_types` / `mlp_layer_types` (sliding or full attention, linear attention), and where some layers
    are dense and others a mixture of experts (DeepSeek's first_k_dense_replace, Qwen-MoE's mlp_only_layers and
    decoder_sparse_step), an expert layer too. The largest figure of each term counts."""
    out = [config]
    for f in ("layer_types", "mlp_layer_types"):
        kinds = getattr(config, f, None)
        if isinstance(kinds, list) and len(kinds) > 1:
            out += [_edited(config, **{f: [kinds[0], kind, *kinds[2:]]}) for kind in dict.fromkeys(kinds)
                    if kind != kinds[1]]
    if isinstance(getattr(config, "first_k_dense_replace", None), int):  # layers before it dense, after it experts
        out += [_edited(config, first_k_dense_replace=n) for n in (1, 2) if n != config.first_k_dense_replace]
    if getattr(config, "mlp_only_layers", None):  # these layers dense, the others experts
        out += [_edited(config, mlp_only_layers=[]), _edited(config, mlp_only_layers=[1])]
    if isinstance(getattr(config, "decoder_sparse_step", None), int) and config.decoder_sparse_step > 1:
        out.append(_edited(config, decoder_sparse_step=1))
    return out


def _edited(config, **fields):
    cfg = copy.deepcopy(config)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def _layers(config, layers: int):
    """A copy of `config` with `layers` decoder layers (and its per-layer type lists cut to them)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    for f in ("layer_types", "mlp_layer_types"):
        if isinstance(getattr(cfg, f, None), list):
            setattr(cfg, f, getattr(cfg, f)[:layers])
    return cfg


def _layer_params(config, trust_remote_code: bool) -> int:
    """Parameters of the second decoder layer of `config`, built on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    counts = []
    for layers in (1, 2):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_layers(config, layers), trust_remote_code=trust_remote_code)
        counts.append(sum(p.numel() for p in model.parameters()))
    return counts[1] - counts[0]


def _measure(stacks: list, k: int, dtype: str, autocast: bool, lora: dict[str, Any] | None,
             trust_remote_code: bool) -> dict[str, float]:
    """The largest of each term over `stacks` (the kinds of layer), per the full model: bytes per token and the
    scores' bytes per pair times k (they narrow with the width and the heads), a mask's bytes per pair as found
    (one per sequence, broadcast over the heads: the narrowing leaves it whole)."""
    found = {"token": 0.0, "sdpa_pair": 0.0, "eager_pair": 0.0}
    for config in stacks:
        one, two = (_build(config, n, dtype, lora, trust_remote_code) for n in (1, 2))
        for attention in ("sdpa", "eager"):
            rest, masks = zip(*[(a - c, b - d) for (a, b), (c, d) in
                                ((_saved(two, attention, s, autocast), _saved(one, attention, s, autocast))
                                 for s in PROBE_TOKENS)])
            (_, token, pair), (_, _, mask) = fit(PROBE_TOKENS, list(rest)), fit(PROBE_TOKENS, list(masks))
            if attention == "sdpa":
                found["token"] = max(found["token"], k * token)
            found[f"{attention}_pair"] = max(found[f"{attention}_pair"], max(mask, 0.0) + k * max(pair, 0.0))
    return found


def fit(tokens: tuple[int, int, int], found: list[int]) -> tuple[float, float, float]:
    """(c, a, b) with c + a*s + b*s^2 through the three points: Newton's divided differences."""
    (s1, s2, s3), (f1, f2, f3) = tokens, found
    d1, d2 = (f2 - f1) / (s2 - s1), (f3 - f2) / (s3 - s2)
    b = (d2 - d1) / (s3 - s1)
    a = d1 - b * (s1 + s2)
    return f1 - a * s1 - b * s1 * s1, a, b


def _build(config, layers: int, dtype: str, lora: dict[str, Any] | None, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_layers(config, layers), dtype=getattr(torch, dtype),
                                             trust_remote_code=trust_remote_code)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=2 * lora["r"], lora_dropout=lora["dropout"],
                                                 target_modules=list(lora["targets"])),
                               autocast_adapter_dtype=lora["fp32"])
    return model.train()


def _saved(model, attention: str, tokens: int, autocast: bool) -> tuple[int, int]:
    """Bytes of the storages autograd saves in one forward of `tokens` tokens (one sequence, its first position
    padding), the model's weights left out: (everything else, attention masks: (1, 1, s, s) tensors)."""
    import torch

    model.set_attn_implementation(attention)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            is_mask = t.dim() == 4 and t.shape[1] == 1 and t.shape[-1] == t.shape[-2] == tokens
            kept[storage.data_ptr()] = (storage.nbytes(), is_mask)
        return t

    mask = torch.ones(1, tokens, dtype=torch.long)
    mask[0, 0] = 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(input_ids=torch.zeros(1, tokens, dtype=torch.long), attention_mask=mask)
    return (sum(n for n, is_mask in kept.values() if not is_mask), sum(n for n, is_mask in kept.values() if is_mask))
