"""Batched sampling and the forward passes that score what was sampled.

Prompts are left-padded (so every response starts at the same column), responses are right-padded, and
every token after a response's first EOS is masked out. Positions are computed from the attention mask so
left padding does not shift them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from align.modeling.compute import FAST_PAD_MULTIPLE
from align.modeling.fused_head import head_logprobs, use_fused_head
from align.modeling.losses import logprobs_and_entropy, logprobs_from_logits, response_mask_after_eos
from align.modeling.packing import base_and_backbone, pack, pack_capacity, packs, position_ids, unwrapped_model

if TYPE_CHECKING:  # annotations only
    from align.config import Generation


@dataclass
class Rollout:
    """Sampled responses. query_* (B, Lq) left-padded; response_* (B, Lr) right-padded."""

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    eos_found: torch.Tensor  # (B,) bool: the response emitted EOS
    engine_logprobs: torch.Tensor | None = None  # (B, Lr): the sampling engine's log-probs of them (vllm), else None

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.query_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask, self.response_mask], dim=1)

    def to(self, device) -> Rollout:
        """The same rollout with every tensor on `device` (a no-op for tensors already there)."""
        fields = (self.query_ids, self.query_mask, self.response_ids, self.response_mask, self.eos_found,
                  self.engine_logprobs)
        return Rollout(*(None if t is None else t.to(device) for t in fields))

    def texts(self, tokenizer) -> list[str]:
        """The response texts: tokens up to the first EOS, special tokens (EOS, padding) removed."""
        return [tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                for ids, m in zip(self.response_ids, self.response_mask)]


def tokenize_prompts(tokenizer, prompts: list[str], max_length: int | None = None, pad_to_multiple_of: int | None = None):
    """Left-padded prompt ids and mask (B, Lq); Lq a multiple of `pad_to_multiple_of` when given."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=True,
                        truncation=max_length is not None, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
    finally:
        tokenizer.padding_side = side
    return enc["input_ids"], enc["attention_mask"]


def static_cache_safe(model, device: torch.device) -> bool:
    """A static KV cache takes its dtype from the first key it stores and then refuses values of another dtype.
    Under autocast with weights in another dtype some families (GPT-NeoX: rotary embeddings promote keys to
    float32 while values stay bfloat16) store keys and values in different dtypes, and generation fails
    (measured on an H100, transformers 5.23). So the static cache is used only when weights and autocast agree."""
    if not torch.is_autocast_enabled(device.type):
        return True
    return next(model.parameters()).dtype == torch.get_autocast_dtype(device.type)


# Settings a checkpoint's generation_config.json may carry that change what `generate` samples (or how it decodes),
# each at a value under which it changes nothing; None where only None is neutral.
_NEUTRAL = {"num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "dola_layers": None, "repetition_penalty": 1.0,
            "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
            "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": 0.0, "top_h": None, "min_length": 0,
            "min_new_tokens": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
            "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
            "exponential_decay_length_penalty": None, "guidance_scale": None, "watermarking_config": None,
            "diversity_penalty": 0.0, "prompt_lookup_num_tokens": None, "assistant_early_exit": None}


_WARPERS = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")  # sampling alone reads them


def plain_sampling(own) -> dict:
    """Every setting of a model's own generation config `own` (its checkpoint's generation_config.json: Qwen2.5's
    repetition_penalty 1.05, say; None: none) that would change what `generate` samples, set back to its neutral
    value. transformers fills each setting a call leaves unset from that config, while align's log-probs, KL and PPO
    ratios are those of the plain distribution at the stage's own temperature, top_k and top_p; the caller's
    settings go after these. A setting whose only neutral value is None is undone in a call's arguments, not in a
    GenerationConfig object (transformers fills its None fields from the model's config)."""
    if own is None:
        return {}
    return {k: neutral for k, neutral in _NEUTRAL.items() if getattr(own, k, None) not in (None, neutral)}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], gen: Generation, seed: int, max_prompt_length: int | None = None,
             synced_gpus: bool = False, logits_processor=None, fast: bool = False,
             greedy: bool = False) -> Rollout:
    """Sample one response per prompt (duplicate prompts for several). Deterministic given `seed`. `greedy`:
    argmax decoding instead (tests compare engines with it). `logits_processor`: one more processor of the logits
    (the tests' fault injection, align/core/faults.py).

    `fast` (align/modeling/compute.py): a static KV cache, which transformers compiles on a GPU, and prompts padded to a
    multiple of FAST_PAD_MULTIPLE tokens so that few distinct shapes are compiled."""
    device = next(model.parameters()).device
    fast = fast and static_cache_safe(model, device)
    q_ids, q_mask = tokenize_prompts(tokenizer, prompts, max_prompt_length, FAST_PAD_MULTIPLE if fast else None)
    q_ids, q_mask = q_ids.to(device), q_mask.to(device)
    torch.manual_seed(seed)
    extra = {}
    if logits_processor is not None:
        from transformers import LogitsProcessorList

        extra["logits_processor"] = LogitsProcessorList([logits_processor])
    if fast:
        extra["cache_implementation"] = "static"
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": gen.temperature,
                                                      "top_k": gen.top_k or None, "top_p": gen.top_p}
    undo = plain_sampling(getattr(model, "generation_config", None))  # ours, not the checkpoint's
    if greedy:  # argmax reads no warper (and transformers warns of one that is set)
        undo = {k: v for k, v in undo.items() if k not in _WARPERS}
    sampling = {**undo, **sampling}
    out = model.generate(
        input_ids=q_ids, attention_mask=q_mask, **sampling,
        max_new_tokens=gen.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        synced_gpus=synced_gpus, **extra,
    )
    return finish_rollout(q_ids, q_mask, out[:, q_ids.size(1):], tokenizer.eos_token_id, tokenizer.pad_token_id)


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout of several (consecutive chunks of one batch of prompts): queries left-padded and responses
    right-padded with `pad_id` (mask 0) to the widest, so each row reads as it did alone."""
    if len(parts) == 1:
        return parts[0]
    lq, lr = max(p.query_ids.size(1) for p in parts), max(p.response_ids.size(1) for p in parts)

    def cat(ts, width, left, fill):
        pad = torch.nn.functional.pad
        return torch.cat([pad(t, (width - t.size(1), 0) if left else (0, width - t.size(1)), value=fill) for t in ts])

    engine = None if any(p.engine_logprobs is None for p in parts) else cat([p.engine_logprobs for p in parts], lr,
                                                                               False, 0.0)
    return Rollout(cat([p.query_ids for p in parts], lq, True, pad_id), cat([p.query_mask for p in parts], lq, True, 0),
                   cat([p.response_ids for p in parts], lr, False, pad_id),
                   cat([p.response_mask for p in parts], lr, False, 0), torch.cat([p.eos_found for p in parts]), engine)


def finish_rollout(q_ids: torch.Tensor, q_mask: torch.Tensor, resp: torch.Tensor, eos_token_id: int, pad_token_id: int,
                   lengths: torch.Tensor | None = None) -> Rollout:
    """The Rollout every engine returns from its raw responses (B, Lr): every token after the first EOS masked and
    set to padding, and `eos_found` per row. `lengths` (B,), where the engine says how many tokens each row really
    has (vLLM), masks the columns beyond them too; a row of length 0 is EOS alone, unmasked, as when every row
    stopped at once (masked, its score and missing-EOS penalty landed on no token: GAE dropped both)."""
    if resp.size(1) == 0:  # every sequence stopped at once: keep one column so shapes stay valid
        resp = torch.full((resp.size(0), 1), eos_token_id, device=resp.device, dtype=resp.dtype)
    mask = response_mask_after_eos(resp, eos_token_id)
    if lengths is not None:
        mask = mask * (torch.arange(resp.size(1), device=resp.device)[None, :] < lengths[:, None].clamp(min=1))
        resp = resp.clone()  # (column 0 is always kept by the EOS rule: a row of length 0 keeps it, as EOS)
        resp[lengths == 0, 0] = eos_token_id
    resp = torch.where(mask.bool(), resp, torch.full_like(resp, pad_token_id))
    eos_found = ((resp == eos_token_id) & mask.bool()).any(dim=1)
    return Rollout(q_ids, q_mask, resp, mask, eos_found)


def longest_prompt(tokenizer, prompts: list[str]) -> int:
    """The longest prompt in tokens (a separate engine's context length is this plus the response length)."""
    return max(len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"])


def by_length(tokenizer, prompts: list[str]) -> list[int]:
    """Prompt indices, longest first: batches of similar lengths waste little compute on padding."""
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    return sorted(range(len(prompts)), key=lambda i: (-lengths[i], i))


def sample_texts(engine, tokenizer, prompts: list[str], gen: Generation, seed: int,
                 counts: dict[str, int] | None = None,
                 score: Callable[[Rollout, list[str]], torch.Tensor] | None = None,
                 ended: list[bool] | None = None) -> tuple[list[str], list[float]]:
    """Sampled response texts (EOS and padding removed) from a rollout engine (align/engines/), in
    length-sorted batches of gen.batch_size, returned
    in the order of `prompts`, with each one's score by `score(rollout, prompts)` when given (a judge reads the
    sampled ids, not a re-tokenised text; [] without). `counts["generated_tokens"]` is increased by the response
    tokens sampled and `counts["generation_seconds"]` by the time the engine took to sample them (scoring not in it).
    `ended`, when given, is filled with whether each response ended with EOS (else it was cut at max_new_tokens)."""
    order = by_length(tokenizer, prompts)
    texts: list[str] = [""] * len(prompts)
    scores: list[float] = [0.0] * len(prompts) if score is not None else []
    if ended is not None:
        ended[:] = [False] * len(prompts)
    for start in range(0, len(prompts), gen.batch_size):
        idx = order[start:start + gen.batch_size]
        batch = [prompts[i] for i in idx]
        t0 = time.perf_counter()
        r = engine.generate(batch, gen, seed=seed + start)
        sampled = time.perf_counter() - t0
        batch_scores = score(r, batch).tolist() if score is not None else []
        for j, (i, text) in enumerate(zip(idx, r.texts(tokenizer))):
            texts[i] = text
            if score is not None:
                scores[i] = batch_scores[j]
            if ended is not None:
                ended[i] = bool(r.eos_found[j])
        if counts is not None:
            counts["generated_tokens"] = counts.get("generated_tokens", 0) + int(r.response_mask.sum())
            counts["generation_seconds"] = counts.get("generation_seconds", 0.0) + sampled
    return texts, scores


def response_logprobs(model, rollout: Rollout, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs (B, Lr) of the sampled responses under `model` (and entropies if asked)."""
    return sequence_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.query_ids.size(1),
                             temperature, with_entropy)


def sequence_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float = 1.0,
                      with_entropy: bool = False):
    """Log-probs (B, Lr) of the response part `ids[:, query_len:]` of (B, Lq + Lr) sequences, and their
    entropies if asked (from response_scores)."""
    logprobs, entropy, _ = response_scores(model, ids, mask, query_len, temperature, with_entropy)
    return (logprobs, entropy) if with_entropy else logprobs


def response_scores(model, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float = 1.0,
                    with_entropy: bool = False, with_hidden: bool = False, entropy_grad: bool = True):
    """Per-token log-probs (B, Lr) of the response part `ids[:, query_len:]` of (B, Lq + Lr) sequences under the
    sampling temperature, their entropies (None unless asked) and the LM head's input at those positions (None unless
    asked: PPO's shared value head reads it; `entropy_grad` False: the entropies without a graph, a metric only). With
    the fused head on for this process and exact for this model
    (align/modeling/fused_head.py) the log-probs come from the hidden states a chunk of tokens at a time, and
    positions whose token is padding get 0; otherwise from response_logits. Every caller masks padding."""
    head = unwrapped_model(model).get_output_embeddings()
    if not use_fused_head(base_and_backbone(model)[0], head):
        logits, hidden = response_logits(model, ids, mask, query_len, temperature, with_hidden=with_hidden)
        targets = ids[:, query_len:]
        if with_entropy:
            return (*logprobs_and_entropy(logits, targets, entropy_grad), hidden)
        return logprobs_from_logits(logits, targets), None, hidden
    _, hidden = response_logits(model, ids, mask, query_len, head_inputs=True)
    real = mask[:, query_len:].bool()
    logprobs, entropy = head_logprobs(hidden[real], head.weight, head.bias, ids[:, query_len:][real], temperature,
                                      with_entropy)

    def spread(values):  # (N,) at the real positions -> (B, Lr), 0 at padding; differentiable
        return values.new_zeros(real.shape).index_put((real,), values)

    return spread(logprobs), (spread(entropy) if with_entropy else None), (hidden if with_hidden else None)


@torch.no_grad()
def fused_head_gap(model, length: int = 24) -> float:
    """The largest |fused head - the model's own logits| log-prob (nats) of a fixed token sequence under `model`
    (temperature 1): ~1e-6 where the fused head is exact; more where the family changes its logits after the head in
    a way fused_head_blocker does not know."""
    head = unwrapped_model(model).get_output_embeddings()
    vocab = head.weight.size(0)
    device = head.weight.device
    ids = (torch.arange(length, device=device) * 7919 % vocab)[None]
    mask = torch.ones_like(ids)
    logits, _ = response_logits(model, ids, mask, 1)
    own = logprobs_from_logits(logits, ids[:, 1:])[0]
    _, hidden = response_logits(model, ids, mask, 1, head_inputs=True)
    fused, _ = head_logprobs(hidden[0], head.weight, head.bias, ids[0, 1:])
    return float((own - fused).abs().max())


def response_logits(model, ids: torch.Tensor, mask: torch.Tensor, query_len: int, temperature: float = 1.0,
                    with_hidden: bool = False, head_inputs: bool = False):
    """Logits (B, Lr, V) that predict the response tokens `ids[:, query_len:]` of (B, Lq + Lr) sequences, divided by
    the sampling temperature (so the log-probs are those of the sampling policy), and with `with_hidden` the last
    hidden state (B, Lr, H) at the same positions (the state before each response token: PPO's shared value head
    reads it). The causal LM's own forward makes the logits, so whatever a family does after its LM head
    (soft-capping, logit scaling) is kept. Only the positions that predict response tokens go through the LM head:
    the prompt's logits would be computed and thrown away (the head of a 49k-token vocabulary is a fifth of
    SmolLM2's forward). A padded batch runs padding-free (align/modeling/packing.py); positions whose next token is
    padding get logits 0 (and hidden states 0): every caller masks them. With `head_inputs` the head computes
    nothing: (None, the head's input (B, Lr, H) at those positions), for the fused head."""
    if packs(model, mask):
        return _packed_response_logits(model, ids, mask, query_len, temperature, with_hidden, head_inputs)
    keep = ids.size(1) - query_len + 1  # the logit at t predicts token t + 1: positions query_len - 1 .. T - 1
    extra = {"output_hidden_states": True} if with_hidden else {}
    grabbed: list[torch.Tensor] = []
    head = unwrapped_model(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(_grab(grabbed, lambda h: h[:, -keep:])) if head_inputs else None
    try:
        if takes_logits_to_keep(model):
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=keep,
                        **extra)
        else:
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), **extra)
    finally:
        if handle is not None:
            handle.remove()
    if head_inputs:
        return None, grabbed[0][:, :-1]
    hidden = out.hidden_states[-1][:, query_len - 1:-1] if with_hidden else None  # the final (normed) layer's
    return tempered(out.logits[:, -keep:][:, :-1], temperature), hidden


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in fp32, as the sampler and the fused head divide (a bf16 logit divided in bf16 is rounded
    twice, ~1e-2 nats at T 0.7): a bf16 tensor's fp32 copy is divided in place (less memory than before: no bf16
    quotient), an fp32 one (the model's own output, which autograd may hold) out of place."""
    x = logits.float()
    return x / temperature if x is logits else x.div_(temperature)


def _grab(store: list, pick):
    """A forward pre-hook for the LM head that keeps pick(its input) in `store` and lets the head compute nothing
    (a zero-length slice of its input), so the family's forward still runs to the end."""
    def hook(_module, args):
        store.append(pick(args[0]))
        return (args[0][..., :0, :], *args[1:])
    return hook


def _packed_response_logits(model, ids, mask, query_len, temperature, with_hidden, head_inputs=False):
    """response_logits of a padded batch, computed padding-free. The LM head sees only the packed positions whose
    next token is a response token (a pre-hook on the output embeddings picks them from the (R, W, H) hidden
    states, so the family's own forward still applies what follows its head)."""
    p = pack(ids, mask, capacity=pack_capacity(model, mask))
    nxt = torch.zeros_like(mask, dtype=torch.bool)
    nxt[:, :-1] = mask[:, 1:].bool()
    wanted = nxt[p.rows, p.cols] & (p.cols >= query_len - 1)  # (N,): predicts a real response token
    at = (p.where[0][wanted], p.where[1][wanted])
    rows, cols = p.rows[wanted], p.cols[wanted] - (query_len - 1)
    head = unwrapped_model(model).get_output_embeddings()
    grabbed: list[torch.Tensor] = []
    hook = _grab(grabbed, lambda h: h[at]) if head_inputs else (lambda _m, args: (args[0][at][None], *args[1:]))
    handle = head.register_forward_pre_hook(hook)
    try:
        # use_cache=False: transformers reads packed sequences from positions only without a cache
        out = model(input_ids=p.ids, position_ids=p.position_ids, output_hidden_states=with_hidden, use_cache=False,
                    **({"logits_to_keep": 0} if takes_logits_to_keep(model) else {}))
    finally:
        handle.remove()
    b, lr = ids.size(0), ids.size(1) - query_len
    if head_inputs:
        hidden = grabbed[0].new_zeros((b, lr, grabbed[0].size(-1)))
        hidden[rows, cols] = grabbed[0]
        return None, hidden
    logits = out.logits[0].new_zeros((b, lr, out.logits.size(-1)))
    logits[rows, cols] = out.logits[0]
    hidden = None
    if with_hidden:
        h = out.hidden_states[-1]
        hidden = h.new_zeros((b, lr, h.size(-1)))
        hidden[rows, cols] = h[at]
    return tempered(logits, temperature), hidden


def takes_logits_to_keep(model) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (most transformers families do; peft passes it on)."""
    import inspect

    base = base_and_backbone(model)[0]  # through PPO's FrozenView and peft
    kind = type(base)
    if kind not in _KEEPS:
        _KEEPS[kind] = "logits_to_keep" in inspect.signature(base.forward).parameters
    return _KEEPS[kind]


_KEEPS: dict[type, bool] = {}


def scalar_outputs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token scalar head outputs (B, T) of a *ForSequenceClassification model (reward or value)."""
    backbone = getattr(model, model.base_model_prefix)
    if packs(model, mask):  # padding-free (align/modeling/packing.py); 0 at padding
        p = pack(ids, mask, capacity=pack_capacity(model, mask))
        hidden = backbone(input_ids=p.ids, position_ids=p.position_ids, use_cache=False).last_hidden_state
        return p.unpack(model.score(hidden).squeeze(-1).float())
    hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).last_hidden_state
    return model.score(hidden).squeeze(-1).float()
