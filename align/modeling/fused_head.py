"""Log-probs and entropies of sampled tokens straight from the last hidden state, a chunk of tokens at a time, so
the (tokens x vocabulary) logits of a whole batch are never held: PPO's scoring and training passes.

For response token y_t with hidden state h_t (the LM head's input), head weight W and sampling temperature T:

    z_t = W h_t / T                          logits of the sampling policy
    log pi(y_t) = z_t[y_t] - logsumexp(z_t)  (the log-softmax PPO's ratio and KL read)
    H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t[v]   (entropy, -sum p log p rewritten)

Each chunk's logits are made, reduced to the two numbers per token and dropped; in the backward pass the chunk is
recomputed (activation checkpointing) and its gradient flows to h_t and W. Peak memory of this step is one chunk's
fp32 logits and their gradient (chunk x V x 4 bytes a copy) instead of the batch's (an 8B Llama-3 with a 128k
vocabulary: 0.5 GB a copy per 1,024 tokens, against 4 GB for 8,192 response tokens, held from the forward to the
backward with the copies log-softmax and the entropy make). The same idea as veRL's fused linear for PPO and Liger's
fused linear cross-entropy; written here because PPO needs per-token log-probs and entropies, not a loss.

Exact only where the family's forward applies nothing after its LM head: `fused_head_blocker` names what stops it
(logit soft-capping or scaling, a head that is not a plain Linear, such as peft's LoRA layer, or one ZeRO-3 has
partitioned), and the stage then computes logits as before. PPO's `fused_head` setting: auto = on a GPU where exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from align.config.ppo import FUSED_HEAD_CHUNK

CHUNK_TOKENS = FUSED_HEAD_CHUNK
"""Tokens per chunk (the estimate reads the same number): 1,024 x a 128k vocabulary is 0.5 GB of fp32 logits."""

POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap", "output_logit_soft_cap",
             "lm_head_multiplier", "output_multiplier", "output_multiplier_scale")
"""Config fields of families whose forward changes the logits after the LM head (Gemma 2/3/3n soft-capping,
RecurrentGemma's and xLSTM's caps, Cohere's scale, Granite's divisor, Falcon-H1's and MuseSpark's multipliers): with
any of them set, the fused head would compute other log-probs than the model. Read from the config, its text config
and its decoder's; what this list misses, the stage's probe (`fused_head_gap`) catches."""

FUSED_TOLERANCE = 1e-3
"""The largest |fused - model's own| log-prob (nats) on the stage's probe before the fused head is refused for a
model: both compute the same head matmul in the same dtype, so an exact family differs by rounding (~1e-6)."""
HALF_TOLERANCE = 0.5
"""The same under bf16 autocast (the probe of a policy with flash attention, which runs in half precision only): two
head matmuls whose fp32 sums differ in the last bits can round a logit of 32-64 to neighbouring bf16 values (0.25
apart); what the probe exists to catch in a trained model (a soft-cap, a logit scale or divisor) moves log-probs by
nats. Looser, it lets through smaller changes: halving a tiny random model's logits moves its log-probs 0.12."""

_MODE = ["off"]
_EXCLUDED: set[int] = set()  # models (id) whose probe showed the fused head is not exact: the logits path for them


def set_fused_head(mode: str) -> None:
    """The fused head for this process (a PPO stage's `fused_head` setting: auto | on | off)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fused_head: {mode!r}; use auto, on or off")
    _MODE[0] = mode


def fused_head_blocker(model, head) -> str | None:
    """Why the fused head cannot stand in for `model`'s own head (None: it can)."""
    if type(head) is not torch.nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain Linear (a LoRA-adapted or quantized head)"
    if hasattr(head.weight, "ds_id"):
        return "the output head is partitioned by DeepSpeed ZeRO-3 (its weight is gathered only inside its forward)"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    configs = [c for c in (config, text, getattr(config, "decoder", None)) if c is not None]
    for cfg in [c for i, c in enumerate(configs) if all(c is not d for d in configs[:i])]:  # each once
        for name in POST_HEAD:
            value = getattr(cfg, name, None)
            if value not in (None, 1, 1.0):
                return f"the model's config sets {name}: {value} (its forward changes the logits after the head)"
        unpadded = getattr(cfg, "unpadded_vocab_size", None)
        if unpadded is not None and unpadded < head.out_features:
            return (f"the model's config sets unpadded_vocab_size: {unpadded} below the head's {head.out_features} "
                    "rows (its forward drops the padding rows after the head)")
    return None


def exclude(model) -> None:
    """The logits path for `model` from now on in this process (its probe found the fused head not exact)."""
    _EXCLUDED.add(id(model))


def use_fused_head(model, head) -> bool:
    """Whether this process computes `model`'s response log-probs with the fused head: `auto` on a GPU where it is
    exact (on a CPU the recomputed chunks cost more time than the memory is worth: docs/benchmarks.md), `on` wherever
    it is exact (a clear error naming the setting where it is not), `off` never."""
    if _MODE[0] == "off" or head is None or id(model) in _EXCLUDED:
        return False
    why = fused_head_blocker(model, head)
    if why is not None and _MODE[0] == "on":
        raise ValueError(f"fused_head: on, but {why}; set fused_head: auto (fused where it is exact) or off")
    return why is None and (_MODE[0] == "on" or on_gpu(head.weight))


def on_gpu(weight: torch.Tensor) -> bool:
    return weight.device.type == "cuda"


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  temperature: float = 1.0, with_entropy: bool = False,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target) and (if asked) the entropy at each of N tokens, in fp32, from their hidden states (N, H), the
    head's weight (V, H) and bias, and the targets (N,): -> (N,), (N,) or None. Differentiable in hidden and weight;
    chunks (of `chunk` tokens, CHUNK_TOKENS by default) are recomputed in the backward pass when a gradient is
    wanted."""
    chunk = chunk or CHUNK_TOKENS
    if hidden.size(0) == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    lps, ents = [], []
    for h, t in zip(hidden.split(chunk), targets.split(chunk)):
        if grad:
            lp, ent = checkpoint(_chunk, h, weight, bias, t, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(h, weight, bias, t, temperature, with_entropy)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _chunk(h, weight, bias, targets, temperature, with_entropy):
    """One chunk of head_logprobs (the equations in the module's docstring)."""
    z = F.linear(h, weight, bias).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lp, None
    return lp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)
