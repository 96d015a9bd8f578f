"""One optimiser step of PPO, the same on every backend: backward, then the policy's and the value model's
gradients clipped each to `max_grad_norm` separately, then the step.

Why separately: clipped jointly, a large value gradient shrinks the policy's step (and `vf_coef` barely
matters). DeepSpeed can clip only the joint norm, so under DeepSpeed its own clipping is turned off
(`gradient_clipping: 0` in the stage's DeepSpeed config) and align clips between DeepSpeed's backward and
step with DeepSpeed's public gradient accessors (`safe_get_full_grad` / `safe_set_full_grad`, ZeRO-1/2/3;
one all-reduce per parameter, so about twice the gradient communication of a step without clipping).
"""

from __future__ import annotations

import math

import torch


def _is_deepspeed(accelerator) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def _clip_local(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
    if max_norm is not None and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _clip_deepspeed(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad  # heavy: only under DeepSpeed

    grads = [(p, safe_get_full_grad(p)) for p in params]
    grads = [(p, g) for p, g in grads if g is not None]
    if not grads:
        return 0.0
    norm = math.sqrt(sum(g.float().pow(2).sum().item() for _, g in grads))
    if max_norm is not None and norm > max_norm:
        for p, g in grads:
            safe_set_full_grad(p, g * (max_norm / (norm + 1e-6)))
    return norm


def backward_and_step(accelerator, model, optimizer, loss: torch.Tensor,
                      groups: dict[str, list[torch.nn.Parameter]], max_norm: float | None) -> dict[str, float]:
    """Backward; at an accumulation boundary clip each parameter group separately and step.
    Returns each group's gradient norm before clipping ({} between boundaries)."""
    if _is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(accelerator.sync_gradients)
        model.backward(loss)
        if not accelerator.sync_gradients:
            return {}
        norms = {name: _clip_deepspeed(ps, max_norm) for name, ps in groups.items()}
        model.step()  # DeepSpeed's step also zeroes the gradients
        return norms
    accelerator.backward(loss)
    if not accelerator.sync_gradients:
        return {}
    norms = {name: _clip_local(ps, max_norm) for name, ps in groups.items()}
    if all(math.isfinite(n) for n in norms.values()):
        optimizer.step()
    else:  # a non-finite gradient (seen under bf16 autocast on an H100) would turn every weight into NaN: skip
        norms["skipped"] = 1.0
    optimizer.zero_grad()
    return norms


def disable_deepspeed_clipping(accelerator) -> None:
    """Before `prepare`: DeepSpeed clips the joint norm; align clips per model instead (see module doc)."""
    if _is_deepspeed(accelerator):
        accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] = 0.0
