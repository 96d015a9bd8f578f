"""PPO's KL budget (`kl.max`): the KL to the reference measured after every update on prompts PPO never trains on,
and the policy's weights of the last update inside the budget, restored when an update leaves it.

Why held-out and after the update: the KL in PPO's reward (`objective/kl`) is measured on each iteration's rollout,
sampled *before* that iteration's update, so it trails the policy by one update, on prompts the update then trains
on. The evaluation measures the published policy, after its last update, on prompts it never saw. `heldout/kl` is
that measurement, made every iteration, so the number a user watches is the one the report shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# one-sided 95% normal quantile: the budget holds the mean's upper confidence bound, so a fresh sample of prompts
# (the evaluation's) lands inside it too, not only the held-out slice that was measured
Z95 = 1.645


def split_heldout(stage: str, prompts: list[str], n: int, seed: int, required: bool) -> tuple[list[str], list[str]]:
    """(train, held-out): `n` prompts drawn by a seeded permutation, never trained on; the rest trains. When fewer
    prompts would be left to train on than are held out: refused if the held-out KL is `required` (kl.max reads it),
    else nothing is held out (the caller says so)."""
    if n == 0:
        return prompts, []
    if len(prompts) < 2 * n:
        if not required:
            return prompts, []
        raise ValueError(f"stage '{stage}': kl.heldout_prompts: {n} of {len(prompts)} usable prompts would leave "
                         f"{len(prompts) - n} to train on; set kl.heldout_prompts to at most {len(prompts) // 2}, "
                         "or give more prompts")
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n])
    return [p for i, p in enumerate(prompts) if i not in held], [prompts[i] for i in sorted(held)]


@dataclass(frozen=True)
class HeldoutKL:
    """Sequence KL (nats per response) of one policy on the held-out prompts: mean, sample std, count."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, kls: torch.Tensor) -> "HeldoutKL":
        xs = kls.detach().double().flatten()
        std = xs.std(unbiased=True).item() if xs.numel() > 1 else 0.0
        return cls(xs.mean().item(), std, int(xs.numel()))

    @property
    def upper(self) -> float:
        """The mean's one-sided 95% upper confidence bound: mean + 1.645 x std / sqrt(n)."""
        return self.mean + Z95 * self.std / math.sqrt(max(1, self.n))

    def within(self, budget: float | None) -> bool:
        """True when there is no budget, or the upper bound is inside it (a NaN KL is never inside)."""
        return budget is None or self.upper <= budget

    def metrics(self) -> dict[str, float]:
        return {"heldout/kl": self.mean, "heldout/kl_std": self.std, "heldout/kl_upper": self.upper,
                "heldout/prompts": self.n}

    @classmethod
    def from_metrics(cls, row: dict) -> "HeldoutKL | None":
        """The measurement an iteration's metrics row holds (a resumed run's last one), None when it has none."""
        if "heldout/kl" not in row:
            return None
        return cls(row["heldout/kl"], row["heldout/kl_std"], int(row["heldout/prompts"]))


def _local(p: torch.nn.Parameter) -> torch.Tensor:
    """The part of a parameter this process holds: under ZeRO-3 its partition (`ds_tensor`; `data` is empty between
    gathers), else the whole tensor."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p.data


class PolicySnapshot:
    """A copy, in host memory, of the policy's trained parameters as this process holds them (LoRA: the adapters;
    full fine-tuning: the weights, under ZeRO-3 this process's partition). `restore` puts them back into the model;
    the optimizer's state is not restored, since training stops after a restore and only the published weights
    count. Cost: one host copy of the trained parameters per process, refreshed after every update inside the
    budget (for an 8B model trained in full, use ZeRO-3 or LoRA, so the copy is a partition or adapters)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.saved: list[torch.Tensor] = []
        self.iteration = -1
        self.kl: HeldoutKL | None = None

    @torch.no_grad()
    def take(self, iteration: int, kl: HeldoutKL | None) -> None:
        self.saved = [_local(p).detach().to("cpu", copy=True) for p in self.params]
        self.iteration, self.kl = iteration, kl

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self.params, self.saved):
            _local(p).copy_(saved.to(_local(p).device))
