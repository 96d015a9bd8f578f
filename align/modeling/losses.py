"""The math of alignment as small pure functions (torch only).

Shapes: B = batch, T = response length. `mask` is 1 for real response tokens and 0 for padding and for
everything after the first EOS. Every loss returns `(loss, metrics)` where metrics are detached scalars.

References
- [PPO]   Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7 (clipped surrogate).
- [GAE]   Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE", eq. 16.
- [KL]    Schulman 2020, "Approximating KL Divergence" (k1, k2, k3 estimators).
- [Z19]   Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", sec. 2.2 (adaptive KL).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Metrics = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------- helpers
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is 1 (over all dims, or along `dim`)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries of `x` (Bessel-corrected by default)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * n / (n - 1).clamp(min=1.0)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(x - mean) / std over masked entries; with shift_mean=False the mean is added back (used for rewards).
    `total`: a sum over every process's tensor (all-reduce), so that the mean and the (Bessel-corrected) variance are
    the whole batch's, as on one process, not each process's slice."""
    if total is not None:
        m = mask.to(x.dtype)
        n = total(m.sum())
        mean = total((x * m).sum()) / n.clamp(min=1.0)
        var = total(((x - mean) ** 2 * m).sum()) / (n - 1).clamp(min=1.0)
    else:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row of a (B, T) bool tensor; T where a row has none."""
    t = bools.size(-1)
    idx = torch.arange(t, device=bools.device).expand_as(bools)
    return torch.where(bools, idx, torch.full_like(idx, t)).min(dim=-1).values


def response_mask_after_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) mask that keeps every token up to and including the first EOS and drops everything after."""
    first_eos = first_true_indices(response_ids == eos_token_id)  # (B,)
    positions = torch.arange(response_ids.size(1), device=response_ids.device)
    return (positions[None, :] <= first_eos[:, None]).long()


def last_token_index(ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Rightmost position that is real (mask 1) and not the pad id: where a sequence classifier reads its
    score. This is the rule transformers' *ForSequenceClassification uses, so a reward model trained by TRL
    is read at the same token here, with left or right padding alike."""
    real = mask.bool() & (ids != pad_token_id)
    positions = torch.arange(ids.size(1), device=ids.device).expand_as(ids)
    return (positions * real).argmax(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position. logits (B, T, V), labels (B, T) -> (B, T)."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, labels.unsqueeze(-1)).squeeze(-1)


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                         grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy at each position from one log-softmax. (B, T, V), (B, T) -> (B, T), (B, T).
    `grad` False: the entropy is a metric only, computed without a graph (with one, autograd keeps p = exp(log p),
    another 4 bytes per token per vocabulary entry: 26 bytes an entry at the peak of the backward instead of ~16)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return torch.gather(logp, 2, labels.unsqueeze(-1)).squeeze(-1), entropy


# --------------------------------------------------------------------------------------------- RL
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi [KL]. With log r = ref - pi:
    k1 = -log r (unbiased, can be negative); k2 = (log r)^2 / 2; k3 = (r - 1) - log r (unbiased, >= 0)."""
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi || ref) of whole responses sampled from pi [KL k1, summed]: sum_t (log pi(y_t) - log ref(y_t)) over
    each response's real tokens, in nats per response. The number PPO's held-out budget and the evaluation report
    both show. (B, T), (B, T), (B, T) -> (B,)."""
    return ((logprobs.float() - ref_logprobs.float()) * mask.float()).sum(1)


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                  score_index: torch.Tensor) -> torch.Tensor:
    """RLHF reward per token [Z19]: r_t = -beta * KL_t, plus the sequence score on its last real token.
    scores (B,), kl (B, T), mask (B, T), score_index (B,) -> (B, T)."""
    rewards = -kl_coef * kl * mask
    rewards[torch.arange(rewards.size(0), device=rewards.device), score_index] += scores
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation [GAE eq. 16], vectorised over the batch:
    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    The value after the last real token is 0 (the episode ends). Inputs (B, T) -> (advantages, returns)."""
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * mask[:, t]
        next_value = values[:, t]
        advantages[:, t] = next_adv
    return advantages, (advantages + values) * mask


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate [PPO eq. 7], as a loss to minimise:
    max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)), ratio = exp(logp - logp_old), averaged over the mini-batch's
    tokens (an optimiser step over several mini-batches, accumulated or on several processes, averages their means:
    a short mini-batch's tokens weigh more than a long one's, as in TRL)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.max(pg_loss1, pg_loss2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((pg_loss2 > pg_loss1).float(), mask)
        approx_kl = 0.5 * masked_mean(log_ratio**2, mask)  # k2 estimator of KL(old || new)
    return loss, {"policy/clipfrac": clipfrac, "policy/approx_kl": approx_kl}


def ppo_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   clip_range: float) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss (as in OpenAI's baselines PPO2 and Ziegler et al.'s lm-human-preferences):
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), averaged over the mini-batch's tokens (as
    `ppo_policy_loss`)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    loss1 = (values - returns) ** 2
    loss2 = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(loss1, loss2), mask)
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).float(), mask)
    return loss, {"value/clipfrac": clipfrac}
