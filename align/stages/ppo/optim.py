"""One optimiser step of PPO, the same on every backend: backward, then the policy's and the value model's
gradients clipped each to `max_grad_norm` separately, then the step.

Why separately: clipped jointly, a large value gradient shrinks the policy's step (and `vf_coef` barely
matters). DeepSpeed can clip only the joint norm, so under DeepSpeed its own clipping is turned off
(`gradient_clipping: 0` in the stage's DeepSpeed config) and align clips between DeepSpeed's backward and step, on
the gradient partitions each process already holds (ZeRO-1/2: the fragment its optimiser owns; ZeRO-3: its
partition): each process sums its partitions' squares per group, one all-reduce of that short vector gives every
group's norm (one host sync per step under ZeRO-1/2; under ZeRO-3 DeepSpeed's local-gradient accessor also waits on
its reduce stream per parameter, and copies where the partition is bf16 or offloaded: a local cost, no collective),
and each process scales its own partitions. No parameter's gradient is gathered (`safe_get_full_grad` all-reduced a
zero-padded full gradient per parameter: 582 collectives per step for an 8B policy and value). A non-finite gradient norm skips the step on every backend: DeepSpeed detects it in its
own step (its overflow check clears the gradients and applies nothing) and `was_step_applied` says so.
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


def _local_partitions(p: torch.nn.Parameter) -> tuple[torch.Tensor | None, bool]:
    """This process's share of `p`'s (averaged) gradient under DeepSpeed, and whether other processes hold other
    shares (partitioned) or the same whole gradient (replicated)."""
    if hasattr(p, "ds_id"):  # ZeRO-3: this process's partition, fp32
        from deepspeed.utils import safe_get_local_grad  # heavy: only under DeepSpeed

        return safe_get_local_grad(p), True
    if hasattr(p, "_hp_mapping") and p._hp_mapping is None:  # linked to another process's optimiser partition: its
        return None, True  # gradient, even where this process still holds it whole (ZeRO-1), is that process's to count
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:  # ZeRO-1/2: the fragment this process's optimiser owns
        fragment = mapping.get_lp_grad_fragment(p._index_in_param_group)
        if fragment.numel() == p.numel() and fragment.numel() != mapping.lp_fragment_address.numel:
            # bf16 keeps a whole accumulation buffer on every process: its own fragment is a slice of it
            fragment = fragment.flatten().narrow(0, mapping.lp_fragment_address.start,
                                                 mapping.lp_fragment_address.numel)
        return fragment, True
    if getattr(p, "_hp_grad", None) is None and p.grad is not None:
        return p.grad, False
    return None, True  # this process owns no part of it


def _scale_local(p: torch.nn.Parameter, g: torch.Tensor, coef: float) -> None:
    if hasattr(p, "ds_id"):  # ZeRO-3's getter may return a copy (fp32, on the device): write it back
        from deepspeed.utils import safe_set_local_grad  # heavy: only under DeepSpeed

        safe_set_local_grad(p, g * coef)
    else:
        g.mul_(coef)


def _clip_deepspeed(groups: dict[str, list[torch.nn.Parameter]], max_norm: float | None,
                    device: torch.device) -> dict[str, float]:
    """Per-group gradient norms from the partitions each process holds (one all-reduce for all groups), and each
    group scaled to `max_norm` where it is over. Returns {group: norm before clipping}."""
    local = {name: [(p, *_local_partitions(p)) for p in ps] for name, ps in groups.items()}
    partitioned = torch.zeros(len(groups), dtype=torch.float64, device=device)
    replicated = torch.zeros(len(groups), dtype=torch.float64, device=device)
    for i, parts in enumerate(local.values()):
        for _, g, shared in parts:
            if g is not None:
                (partitioned if shared else replicated)[i] += g.float().pow(2).sum()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(partitioned)
    norms = dict(zip(groups, (partitioned + replicated).sqrt().tolist()))
    for name, parts in local.items():
        norm = norms[name]
        if max_norm is not None and math.isfinite(norm) and norm > max_norm:
            for p, g, _ in parts:
                if g is not None:
                    _scale_local(p, g, max_norm / (norm + 1e-6))
    return norms


def backward_and_step(accelerator, model, optimizer, loss: torch.Tensor,
                      groups: dict[str, list[torch.nn.Parameter]], max_norm: float | None) -> dict[str, float]:
    """Backward; at an accumulation boundary clip each parameter group separately and step.
    Returns each group's gradient norm before clipping ({} between boundaries)."""
    if _is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(accelerator.sync_gradients)
        model.backward(loss)
        if not accelerator.sync_gradients:
            return {}
        landed = getattr(getattr(model, "optimizer", None), "_wait_for_offload_copies", None)
        if callable(landed):  # ZeRO-1/2 offload: the gradients' copies into host memory are asynchronous; DeepSpeed
            landed()  # waits for them in its step, and the norms below are read before it
        norms = _clip_deepspeed(groups, max_norm, accelerator.device)
        model.step()  # DeepSpeed's step also zeroes the gradients, and applies nothing on a non-finite norm
        if not model.was_step_applied():
            norms["skipped"] = 1.0
        elif not all(math.isfinite(n) for n in norms.values()):  # its overflow check was off (see below)
            from align.runtime.context import NonFiniteLossError

            raise NonFiniteLossError(f"PPO: DeepSpeed applied an optimiser step whose gradient norms are {norms}; the "
                                     "weights are no longer finite: stopping (its bf16.check_grad_overflow or "
                                     "zero_optimization.compute_grad_norm was off)")
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
    """Before `prepare`: DeepSpeed clips the joint norm; align clips per model instead (see module doc). DeepSpeed's
    own non-finite check stays on whatever the config says (bf16.check_grad_overflow, zero_optimization's
    compute_grad_norm): the skip relies on it."""
    if _is_deepspeed(accelerator):
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        config["gradient_clipping"] = 0.0
        for key in ("bf16", "bfloat16"):  # DeepSpeed reads either (its legacy name)
            if isinstance(config.get(key), dict):
                config[key]["check_grad_overflow"] = True
        if isinstance(config.get("zero_optimization"), dict):
            config["zero_optimization"].pop("compute_grad_norm", None)  # DeepSpeed's default: on
