"""Padding-free forward passes: the real tokens of a padded batch, packed into as few rows as fit, each sequence with
its own positions (restarting at 0), and no attention mask, so transformers builds a block-diagonal causal mask from
the positions (`masking_utils.find_packed_sequence_indices`: SDPA and eager attention) or, for flash-attention,
cu_seqlens from the same positions (varlen kernels).

Why, beyond the compute: a padded PPO batch (prompts left-padded, responses right-padded) has query rows that are
padding at the start of a row, which attend to nothing (every key before them is padding). PyTorch's math and CPU
kernels return 0 for such rows; CUDA's memory-efficient SDPA kernel gives NaN gradients for them (pytorch#103749,
#110213; transformers#38690), which is what PPO's one H100 run met in bf16 (every optimiser step of iteration 7
non-finite, the loss finite). Packed rows have no such query: each packed sequence starts with a real token
attending to itself, and the filler at a row's end is its own short sequence, attending to itself.

Rows are `capacity` tokens wide (the padded batch's own width by default): with SDPA or eager attention the mask is
dense per row, so a row never costs more attention than one padded row did, and the rows needed are ceil(real
tokens / width) or a few more (first-fit decreasing). Flash-attention needs one row (its varlen path reads the
sequence boundaries from the positions of a single row; several rows would be read as one causal sequence each).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of sequence indices, each bin's lengths summing to at most `capacity`: longest first, each into the
    first bin it fits (a sequence longer than `capacity` gets a bin of its own). Deterministic: ties keep index
    order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


@dataclass(frozen=True)
class Packed:
    """A padded (B, T) batch's real tokens in (R, W) rows. `rows`/`cols` give, for each real token in packed order
    (row-major over the packed rows), where it sits in the padded batch; `where` where it sits in the packed rows."""

    ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W): 0.. per sequence; the filler at a row's end is one more sequence
    rows: torch.Tensor  # (N,) padded-batch row of each real token
    cols: torch.Tensor  # (N,) padded-batch column of each real token
    where: tuple[torch.Tensor, torch.Tensor]  # (N,), (N,): its (row, column) in the packed rows
    shape: tuple[int, int]  # (B, T)

    @property
    def padding_fraction(self) -> float:
        """Tokens computed that were padding (the filler at rows' ends)."""
        return 1.0 - self.rows.numel() / self.ids.numel()

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(R, W, ...) values at packed positions -> (B, T, ...) at the padded batch's positions, `fill` at its
        padding."""
        out = packed.new_full((*self.shape, *packed.shape[2:]), fill)
        out[self.rows, self.cols] = packed[self.where]
        return out


def pack(ids: torch.Tensor, mask: torch.Tensor, pad_id: int = 0, capacity: int | None = None) -> Packed:
    """Pack the real tokens (mask 1) of a padded (B, T) batch into rows of `capacity` tokens (default T). Each
    sequence must be contiguous (left and/or right padding, as every batch align builds is)."""
    b, t = ids.shape
    capacity = t if capacity is None else capacity
    keep = mask.bool()
    lengths = keep.sum(1).tolist()
    bins = first_fit_decreasing(lengths, capacity)
    width = max(capacity, max(lengths, default=0))
    out_ids = ids.new_full((len(bins), width), pad_id)
    out_pos = torch.zeros((len(bins), width), dtype=torch.long, device=ids.device)
    rows, cols, where_r, where_c = [], [], [], []
    positions = torch.arange(width, device=ids.device)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            n = lengths[i]
            c = keep[i].nonzero().squeeze(1)
            out_ids[r, at:at + n] = ids[i, c]
            out_pos[r, at:at + n] = positions[:n]
            rows.append(torch.full((n,), i, dtype=torch.long, device=ids.device))
            cols.append(c)
            where_r.append(torch.full((n,), r, dtype=torch.long, device=ids.device))
            where_c.append(positions[at:at + n])
            at += n
        out_pos[r, at:] = positions[:width - at]  # the filler: a sequence of its own, attending to itself
    cat = (lambda xs: torch.cat(xs)) if rows else (lambda xs: torch.zeros(0, dtype=torch.long, device=ids.device))
    return Packed(out_ids, out_pos, cat(rows), cat(cols), (cat(where_r), cat(where_c)), (b, t))


def padding_fraction(mask: torch.Tensor) -> float:
    """Tokens a padded (B, T) batch computes that are padding."""
    return 1.0 - float(mask.sum()) / max(1, mask.numel())


class RowPackingCollator:
    """A causal-LM collator's batch (input_ids, attention_mask, labels; right-padded) packed into rows of its own
    width: the same examples per step, no pad rows (SFT's `padding_free`). Labels are -100 at the filler and at each
    sequence's first token (which, packed, would be predicted from the previous sequence's last token; padded, it is
    never predicted): the loss, its token count and so the gradients equal the padded batch's. `batches` holds, per
    batch handed out, its (real, computed, padded) token counts: real tokens, tokens computed, and what the padded
    batch held (perf/padding_fraction, and the trained-token count, which TRL reads from a packed batch's width
    alone). The trainer's data loader fetches one batch ahead: count_first(n) sums the batches trained on."""

    def __init__(self, inner, pad_id: int, one_row: bool = False):
        self.inner, self.pad_id, self.one_row = inner, pad_id, one_row  # one_row: flash-attention's varlen path
        self.batches: list[tuple[int, int, int]] = []

    def count_first(self, n: int) -> tuple[int, int, int]:
        """(real, computed, padded) tokens of the first `n` batches handed out."""
        first = self.batches[:n]
        return tuple(sum(b[i] for b in first) for i in range(3))  # type: ignore[return-value]

    def __call__(self, examples):
        out = self.inner(examples)
        mask = out.get("attention_mask")
        if mask is None:
            return out
        if "position_ids" in out:  # rows TRL already packed (SFT's `packing`): keep them, drop the mask
            return self._packed_rows(examples, out)
        p = pack(out["input_ids"], mask, self.pad_id, capacity=int(mask.sum()) if self.one_row else None)
        labels = torch.full_like(p.ids, -100)
        labels[p.where] = out["labels"][p.rows, p.cols]
        labels[p.position_ids == 0] = -100
        self.batches.append((p.rows.numel(), p.ids.numel(), mask.numel()))
        return {"input_ids": p.ids, "position_ids": p.position_ids, "labels": labels}

    def _packed_rows(self, examples, out):
        """Rows of several examples each (TRL's best-fit-decreasing packing, `seq_lengths` per row; positions from
        them): the right-padded tail of a row becomes one filler sequence of its own, labels -100 there and at each
        example's first token. `padded` counts the same examples padded to the longest of them."""
        mask, pos = out["attention_mask"], out["position_ids"].clone()
        filler = mask == 0
        tail = torch.arange(mask.size(1), device=mask.device)[None] - mask.sum(1, keepdim=True)
        pos[filler] = tail.expand_as(pos)[filler]
        labels = out["labels"].clone()
        labels[(pos == 0) | filler] = -100
        lengths = [int(n) for e in examples for n in e["seq_lengths"]]
        self.batches.append((int(mask.sum()), mask.numel(), len(lengths) * max(lengths)))
        return {"input_ids": out["input_ids"], "position_ids": pos, "labels": labels}


# ----------------------------------------------------------------------------------------- models
def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of a padded batch's tokens: 0.. per row from its first real token (left padding does not shift them)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


_mask_positions = position_ids  # install_padding_free's forward takes an argument of that name


def packs(model, mask: torch.Tensor) -> bool:
    """Whether a forward of `model` over this batch runs padding-free: the batch has padding, and the family reads
    sequence boundaries from restarting positions (packing_works)."""
    return _PADDING_FREE[0] and bool((mask == 0).any()) and packing_works(model)


_PADDING_FREE = [True]


def set_padding_free(enabled: bool) -> None:
    """Padding-free forwards on or off for this process (a stage's `padding_free` setting: PPO's, and the TRL
    stages' through runtime/trl.padding_free)."""
    _PADDING_FREE[0] = enabled


@contextmanager
def padded_forwards():
    """Within it, forwards take the padded path (the equality tests and the benchmark's side-by-side runs)."""
    before, _PADDING_FREE[0] = _PADDING_FREE[0], False
    try:
        yield
    finally:
        _PADDING_FREE[0] = before  # a stage's padding_free: false stays off


def packing_works(model) -> bool:
    """Whether this model family, with its attention kernel, keeps packed sequences apart: transformers builds the
    block-diagonal mask from positions only where the family's forward passes them to its mask builder (OPT's does
    not), and flex attention reads the attention mask alone. Found once per (family, kernel) by a probe on a
    one-layer copy of the backbone built from the model's config (random weights, so it works the same whatever
    state the model is in: ZeRO-3 partitions, 4-bit, adapters): the second of two packed sequences must read like
    itself alone, and unlike the two read as one sequence."""
    base, backbone = base_and_backbone(model)
    backbone = base if backbone is None else backbone
    config = getattr(backbone, "config", None)
    if config is None:
        return False
    attn = attention_kernel(backbone)
    key = (type(backbone), attn)
    if key not in _PACKING_WORKS:
        _PACKING_WORKS[key] = _probe_packing(type(backbone), config, attn)
    return _PACKING_WORKS[key]


def _probe_packing(cls, config, attn: str) -> bool:
    import copy

    try:
        composite = config.get_text_config() is not config
    except ValueError:  # several text configs
        composite = True
    if composite:  # a vision tower beside the text model (Gemma 3): a copy would be full-size (the shrink below
        return False  # reaches only top-level fields): padded, as before
    flash = is_flash(attn)
    device = torch.device("cuda") if flash and torch.cuda.is_available() else torch.device("cpu")
    try:  # the shrink too: a config (remote code) may refuse a field's new value
        small = copy.deepcopy(config)  # one layer, a 64-token vocabulary, a narrow MLP: what masks is left as it is
        small.num_hidden_layers = 1
        if getattr(small, "layer_types", None):
            small.layer_types = small.layer_types[:1]
        if getattr(small, "vocab_size", None):
            small.vocab_size, small.pad_token_id = 64, None
        for field in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(small, field, None):  # a mixture of experts' too: 128 full-width experts are GBs per process
                setattr(small, field, 64)
        for field in ("num_local_experts", "num_experts", "n_routed_experts"):
            if isinstance(getattr(small, field, None), int) and getattr(small, field) > 4:
                setattr(small, field, 4)
                if isinstance(getattr(small, "num_experts_per_tok", None), int):
                    small.num_experts_per_tok = min(small.num_experts_per_tok, 4)
                if getattr(small, "n_group", None):  # DeepSeek's grouped routing: the groups must divide the experts
                    small.n_group = small.topk_group = 1
        with torch.device(device):
            probe = cls(small).to(torch.bfloat16 if flash else torch.float32).eval()
        probe.config._attn_implementation = attn
        first, second = torch.tensor([[1, 2, 3]], device=device), torch.tensor([[4, 5]], device=device)
        both = torch.cat([first, second], 1)
        with torch.no_grad():
            def run(ids, pos):
                return probe(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0, -2:].float()
            alone = run(second, torch.tensor([[0, 1]], device=device))
            packed = run(both, torch.tensor([[0, 1, 2, 0, 1]], device=device))
            joined = run(both, torch.arange(5, device=device)[None])
            if hasattr(small, "output_router_logits"):  # a mixture of experts: its router logits must unpack too, or
                routed = probe(input_ids=both, position_ids=torch.tensor([[0, 1, 2, 0, 1]], device=device),  # TRL's
                               use_cache=False, output_router_logits=True)  # auxiliary loss would run it padded
                if not _router_layout_known(getattr(routed, "router_logits", None) or (), both.numel()):
                    return False
    except Exception as exc:  # a family the probe cannot build or run: padded, as before
        import logging

        logging.getLogger(__name__).info("padding-free forwards off for %s (%s): the probe failed: %s",
                                         cls.__name__, attn, exc)
        return False
    apart, together = (packed - alone).abs().max().item(), (packed - joined).abs().max().item()
    return apart * 10 < together


_PACKING_WORKS: dict[tuple[type, str], bool] = {}


def computed_padding_fraction(model, mask: torch.Tensor, rows: int | None = None) -> float:
    """Of the tokens forwards of `model` over this (B, T) batch compute, `rows` sequences a forward (PPO's mini-batches;
    default all), the fraction that is padding: the filler at packed rows' ends where a forward runs padding-free,
    else every pad of the padded batch (`perf/padding_fraction`)."""
    real = computed = 0
    for chunk in mask.split(rows or mask.size(0)):
        lengths, capacity = chunk.sum(1).tolist(), pack_capacity(model, chunk) or chunk.size(1)
        real += sum(lengths)
        computed += (len(first_fit_decreasing(lengths, capacity)) * max(capacity, max(lengths)) if packs(model, chunk)
                     else chunk.numel())
    return 1.0 - real / max(1, computed)


def pack_capacity(model, mask: torch.Tensor) -> int | None:
    """Packed rows' width: the padded width for dense-mask attention (sdpa, eager: a packed row then costs no more
    attention than a padded one), one row of every real token for flash-attention (its varlen path reads sequence
    boundaries from one row's positions)."""
    return int(mask.sum()) if attention_kernel(model) not in ("sdpa", "eager") else None


def unwrapped_model(model):
    """The transformers model behind a DeepSpeed engine or DDP (TRL wraps GRPO's and RLOO's reference in a
    DeepSpeed engine of its own, whose `config` is DeepSpeed's), PPO's FrozenView (peft_model) and peft's wrapper
    (get_output_embeddings and config pass through peft's)."""
    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
        if inner is None and hasattr(model, "module") and _is_engine(model):
            inner = model.module
        if inner is None:
            return getattr(model, "peft_model", model)
        model = inner


def _is_engine(model) -> bool:
    """A DDP or DeepSpeed engine (any of DeepSpeed's engine classes) around a model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    deepspeed = sys.modules.get("deepspeed")  # imported where it is used: never imported here
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def base_and_backbone(model):
    """The transformers model behind any wrapper (FrozenView, peft) and its backbone (None where it has none)."""
    inner = unwrapped_model(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return base, getattr(base, getattr(base, "base_model_prefix", ""), None)


def attention_kernel(model) -> str:
    """The attention implementation `model` runs with (transformers' `_attn_implementation`; eager when unset)."""
    return getattr(getattr(unwrapped_model(model), "config", None), "_attn_implementation", None) or "eager"


def is_flash(attn: str) -> bool:
    """Whether `attn` is a flash-attention kernel (varlen: a packed batch is one row, boundaries from positions)."""
    return attn.startswith("flash") or "flash_attn" in attn


def install_padding_free(model) -> bool:
    """Make every forward of `model`'s backbone over a padded batch run padding-free, whoever calls it (TRL's DPO,
    KTO and reward trainers, their fused LM head included): the backbone's `forward` is wrapped on the instance, so
    DDP, DeepSpeed (ZeRO-3's hooks sit on the layers), peft and checkpoints see the same module. A call with an
    attention mask that has padding, no cache and nothing asked beyond the last hidden state and a mixture of experts'
    router logits (TRL's auxiliary loss) is packed (align/modeling/packing.py), run with restarting positions and no
    mask, and its last hidden state and router logits unpacked to the padded layout (0 at padding), which the
    caller's head reads as before: a classifier's last-non-pad pooling, a fused LM head's label mask, the auxiliary
    loss's attention mask. Anything else (generation with a cache, hidden states asked for) takes the original
    forward. Returns whether it was installed (False for a family that cannot read packed positions)."""
    base, backbone = base_and_backbone(model)
    if backbone is None or backbone is base or getattr(backbone.forward, "_align_padding_free", False):
        return bool(backbone is not None and getattr(backbone.forward, "_align_padding_free", False))
    if not packing_works(base):
        return False
    original = backbone.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        plain = (input_ids is None or attention_mask is None or attention_mask.dim() != 2
                 or not _PADDING_FREE[0] or bool((attention_mask != 0).all())
                 or kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
                 or kwargs.get("use_cache") or kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
                 or kwargs.get("inputs_embeds") is not None or kwargs.get("return_dict") is False)
        if not plain and position_ids is not None:  # the caller's positions must be the ones packing restarts
            plain = not torch.equal(position_ids.expand_as(attention_mask)[attention_mask.bool()],
                                                    _mask_positions(attention_mask)[attention_mask.bool()])
        if plain:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        kwargs["use_cache"] = False
        p = pack(input_ids, attention_mask, capacity=pack_capacity(base, attention_mask))
        out = original(input_ids=p.ids, position_ids=p.position_ids, **kwargs)
        if _asks_router_logits(kwargs, base) and not _unpack_router_logits(out, p):  # a layout not known: padded
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        out.last_hidden_state = p.unpack(out.last_hidden_state)
        counts[0] += p.rows.numel()
        counts[1] += p.ids.numel()
        counts[2] += attention_mask.numel()
        return out

    counts = [0, 0, 0]  # real tokens, tokens computed, tokens the padded batches held: backbone_counts
    forward._align_padding_free = True  # type: ignore[attr-defined]
    forward.counts = counts  # type: ignore[attr-defined]
    backbone.forward = forward
    return True


def _unpack_router_logits(out, p: Packed) -> bool:
    """A mixture of experts' router logits from a packed forward, one (rows x width, experts) tensor per layer (as
    transformers' Mixtral, Qwen2/3-MoE and OLMoE give them), put back in the padded batch's layout (batch x length,
    experts), 0 at its padding, which the auxiliary loss leaves out by the attention mask (TRL's, through the
    CausalLM's `load_balancing_loss_func`). False, nothing changed, where a layer's logits have another shape."""
    logits = getattr(out, "router_logits", None)
    if not logits:
        return True
    if not _router_layout_known(logits, p.ids.numel()):
        return False
    out.router_logits = tuple(p.unpack(r.view(*p.ids.shape, -1)).flatten(0, 1) for r in logits)
    return True


def _router_layout_known(logits, tokens: int) -> bool:
    """Whether every layer's router logits are (tokens, experts), the layout `_unpack_router_logits` unpacks."""
    return all(r.dim() == 2 and r.size(0) == tokens for r in logits)


def _asks_router_logits(kwargs: dict, base) -> bool:
    """Whether a call wants a mixture of experts' router logits: its own argument, or (absent or None, as some
    families pass it on unresolved) the model's config."""
    asked = kwargs.get("output_router_logits")
    return bool(asked if asked is not None else getattr(base.config, "output_router_logits", False))


def backbone_counts(model) -> tuple[int, int, int] | None:
    """(real, computed, padded) tokens of the packed forwards of `model`'s backbone so far (install_padding_free),
    or None where it is not installed."""
    counts = getattr(getattr(base_and_backbone(model)[1], "forward", None), "counts", None)
    return tuple(counts) if counts is not None else None  # type: ignore[return-value]
