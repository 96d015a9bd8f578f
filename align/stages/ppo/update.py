"""PPO's update (step 6 of align/stages/ppo): the clipped policy loss and the clipped value loss [PPO eq. 7; losses in
align/modeling/losses.py] over shuffled mini-batches of one iteration's rollouts, for `ppo_epochs` passes."""

from __future__ import annotations

import torch

from align.config.ppo import PPOStage
from align.modeling.losses import masked_mean, ppo_policy_loss, ppo_value_loss
from align.runtime.context import NonFiniteLossError
from align.stages.ppo.optim import backward_and_step


def finite_everywhere(accelerator, loss: torch.Tensor) -> bool:
    """Whether `loss` is finite on every process (one gather of a flag: a process that stopped alone would leave the
    others waiting in the backward's collectives for the launcher to kill them, its error unseen)."""
    finite = torch.isfinite(loss.detach()).float().reshape(1)
    if accelerator.num_processes > 1:
        finite = accelerator.gather(finite).min()
    return bool(finite.item())


def ppo_update(cfg: PPOStage, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs, old_values,
               advantages, returns) -> dict[str, float]:
    """Step 6: clipped policy + value losses over shuffled mini-batches; after an epoch whose mean approximate
    KL exceeds `max_approx_kl`, stop. `policy/ratio_first` is the mean ratio on the first mini-batch of the
    first epoch: exactly 1 when rollout and update compute the same log-probs (no dropout)."""
    # transformers recomputes activations only in training mode (dropout is 0, so train() changes nothing else)
    unwrapped = accelerator.unwrap_model(model)
    mode = unwrapped.training
    if cfg.gradient_checkpointing:
        unwrapped.train()
    try:
        return _ppo_epochs(cfg, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs, old_values,
                           advantages, returns)
    finally:
        unwrapped.train(mode)


def _ppo_epochs(cfg: PPOStage, accelerator, model, optimizer, groups, ids, mask, rmask, lq, old_logprobs,
                old_values, advantages, returns) -> dict[str, float]:
    b = ids.size(0)
    sums: dict[str, float] = {}  # per mini-batch
    step_sums: dict[str, float] = {}  # per optimiser step (accumulation boundary): gradient norms, skips
    count = steps = 0
    stop = False
    first_ratio = None
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(b)
        epoch_kl, epoch_n = 0.0, 0
        for start in range(0, b, cfg.mini_batch_size):
            mb = order[start:start + cfg.mini_batch_size]
            with accelerator.accumulate(model), accelerator.autocast():
                logprobs, entropy, values = model(ids[mb], mask[mb], lq, cfg.generation.temperature,  # entropy: a
                                                  entropy_grad=cfg.entropy_coef > 0)  # metric unless it is trained
                pg_loss, pm = ppo_policy_loss(logprobs, old_logprobs[mb], advantages[mb], rmask[mb], cfg.clip_range)
                vf_loss, vm = ppo_value_loss(values, old_values[mb], returns[mb], rmask[mb], cfg.clip_range_value)
                ent = masked_mean(entropy, rmask[mb])
                loss = pg_loss + cfg.vf_coef * vf_loss - cfg.entropy_coef * ent
                if not finite_everywhere(accelerator, loss):  # every process stops together, none in a collective
                    parts = {"policy loss": pg_loss, "value loss": vf_loss, "entropy": ent, "log-probs": logprobs,
                             "rollout log-probs": old_logprobs[mb], "values": values, "advantages": advantages[mb],
                             "returns": returns[mb]}
                    bad = ", ".join(k for k, v in parts.items() if not torch.isfinite(v).all()) or "none"
                    raise NonFiniteLossError(f"PPO loss is {loss.item()} on process {accelerator.process_index} "
                                             f"(non-finite parts here: {bad}; a loss is non-finite on some process); "
                                             "stopping (lower the learning rate, or try precision: float32)")
                if first_ratio is None:
                    first_ratio = masked_mean(torch.exp(logprobs - old_logprobs[mb]), rmask[mb]).item()
                norms = backward_and_step(accelerator, model, optimizer, loss, groups, cfg.max_grad_norm)
            step = {"train/loss": loss.item(), "policy/loss": pg_loss.item(), "value/loss": vf_loss.item(),
                    "policy/entropy": ent.item(), **{k: v.item() for k, v in {**pm, **vm}.items()}}
            if count == 0:
                step_first = {"policy/approx_kl_first": pm["policy/approx_kl"].item()}
            for k, v in step.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
            if norms:  # an optimiser step ({} between accumulation boundaries)
                stepped = {"train/skipped_step_fraction": norms.pop("skipped", 0.0),
                           **{f"{k}/grad_norm": v for k, v in norms.items()}}
                for k, v in stepped.items():
                    step_sums[k] = step_sums.get(k, 0.0) + v
                steps += 1
            epoch_kl, epoch_n = epoch_kl + pm["policy/approx_kl"].item(), epoch_n + 1
        # early stopping looks at this epoch alone (its mean over mini-batches, averaged over processes)
        approx_kl = accelerator.reduce(torch.tensor(epoch_kl / epoch_n, device=ids.device), "mean")
        if cfg.max_approx_kl is not None and approx_kl.item() > cfg.max_approx_kl:
            stop = True
            break
    out = {k: accelerator.reduce(torch.tensor(v / n, device=ids.device), "mean").item()
           for part, n in ((sums, count), (step_sums, steps)) for k, v in part.items()}
    out["policy/early_stopped"] = float(stop)
    if out["train/skipped_step_fraction"] > 0.5:
        raise NonFiniteLossError(f"PPO: {out['train/skipped_step_fraction']:.0%} of this iteration's optimiser steps had "
                                 "non-finite gradients and were skipped; stopping (lower the learning rate, or try "
                                 "precision: float32)")
    out["policy/ratio_first"] = accelerator.reduce(torch.tensor(first_ratio, device=ids.device), "mean").item()
    out.update({k: accelerator.reduce(torch.tensor(v, device=ids.device), "mean").item() for k, v in step_first.items()})
    return out
