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
from typing import Any

import torch

from align.config.ppo import PPOStage
from align.engines.base import RolloutEngine, across_processes, check_rollout, rest
from align.modeling.losses import sequence_kl
from align.runtime.context import StageContext, StageError
from align.stages.ppo.rollouts import rollouts_in_chunks, scored

# one-sided 95% quantiles of Student's t by degrees of freedom 1..30 (a few held-out prompts: the normal's 1.645
# would claim a bound the data do not give); the budget holds the mean's upper confidence bound: the policy's KL over
# the prompts' distribution is under it with 95% confidence, not only the held-out slice's (a fresh sample of m
# prompts, the evaluation's, scatters around that mean by a further ~t x std / sqrt(m))
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
Z95 = 1.6448536269514722


def t95(df: int) -> float:
    """Student's t one-sided 95% quantile: the table up to 30 degrees of freedom, beyond it the Cornish-Fisher
    expansion z + (z^3 + z) / 4v + (5z^5 + 16z^3 + 3z) / 96v^2 (Abramowitz and Stegun 26.7.5; 1.671 at v = 60)."""
    if df <= len(T95):
        return T95[df - 1]
    z = Z95
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


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
    def of(cls, kls: torch.Tensor, prompts: list | None = None) -> "HeldoutKL":
        """From the KLs of one response each; `prompts`: the prompt each answers (fewer held-out prompts than
        processes repeat some): a prompt's responses are averaged into one value first, so the std and the count
        are the prompts' (the spread of all the rows over the distinct prompts' count made the bound too tight)."""
        xs = kls.detach().double().flatten()
        if prompts is not None:
            groups: dict = {}
            for x, prompt in zip(xs.tolist(), prompts):
                groups.setdefault(prompt, []).append(x)
            xs = torch.tensor([sum(g) / len(g) for g in groups.values()], dtype=torch.float64)
        std = xs.std(unbiased=True).item() if xs.numel() > 1 else 0.0
        return cls(xs.mean().item(), std, int(xs.numel()))

    @property
    def upper(self) -> float:
        """The mean's one-sided 95% upper confidence bound: mean + t95(n - 1) x std / sqrt(n); none (inf) from one
        prompt, whose spread is unknown."""
        if self.n < 2:
            return math.inf
        return self.mean + t95(self.n - 1) * self.std / math.sqrt(self.n)

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
        self.saved = []  # the last copy released first: one host copy at a time, not two while the new one is made
        self.saved = [_local(p).detach().to("cpu", copy=True) for p in self.params]
        self.iteration, self.kl = iteration, kl

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self.params, self.saved):
            _local(p).copy_(saved.to(_local(p).device))


def heldout_shares(count: int, world: int) -> list[list[int]]:
    """Each process's held-out prompts (indices into `count` of them), an equal share each so the collectives of
    ZeRO-3 generation line up: every prompt once when `count` divides evenly (the remainder left out), repeated
    when there are fewer prompts than processes. Gathered in process order, they say which prompt each KL answers."""
    n = max(world, count // world * world)
    return [[i % count for i in range(n)[r::world]] for r in range(world)]


def heldout_kl(cfg: PPOStage, accelerator, engine: RolloutEngine, model, reference, heldout: list[str],
               seed: int, where: str) -> HeldoutKL:
    """Sequence KL(policy || reference) = sum over the response of log pi - log ref (k1, at the sampling temperature,
    as the evaluation measures it) of one response per held-out prompt, sampled with the same seeds every iteration
    (the iterations differ by the policy, not by the draw) by engines that take a seed per request (hf; vLLM is
    seeded once, so its held-out draws are fresh each iteration: the bound's t x std/sqrt(n) covers that noise,
    which then moves the KL from one iteration to the next as well). Every process measures an equal share (so the
    collectives of ZeRO-3 generation line up) and the shares are gathered. These are the first samples after a
    weight sync: an engine that reports its own log-probs is checked against the policy here (`where` names the
    iteration), so a broken sync stops the stage before its KL can steer the controller or the budget."""
    world, rank = accelerator.num_processes, accelerator.process_index
    shares = heldout_shares(len(heldout), world)
    mine = [heldout[i] for i in shares[rank]]
    kls = []
    rollouts = rollouts_in_chunks(cfg, accelerator, engine, mine, seed, world, rank)
    rest(engine)  # generation.sleep: asleep before any model computes (align estimate counts it so)
    for r in rollouts:  # a mini-batch of rows at a time, as PPO scores its rollouts (their logits: align estimate)
        logprobs, _, ref_logprobs = scored(model, reference, r, cfg.generation.temperature, cfg.mini_batch_size,
                                           accelerator, with_values=False)
        check_rollout(engine, r, logprobs, cfg.generation.max_logprob_gap, where, reduce=across_processes(accelerator))
        kls.append(sequence_kl(logprobs, ref_logprobs, r.response_mask))
    return HeldoutKL.of(accelerator.gather(torch.cat(kls)).cpu(), prompts=[heldout[i] for s in shares for i in s])


def stop_inside_budget(ctx: StageContext, cfg: PPOStage, snapshot: PolicySnapshot, iteration: int,
                       measured: HeldoutKL) -> None:
    """An update left kl.max: undo it (the weights of the last update inside the budget go back into the model, to
    be published) and say so. When no update of this run stayed inside, there is nothing to publish: refuse."""
    if snapshot.iteration == 0:
        raise StageError(f"stage '{ctx.name}': the first update already took the held-out KL to {measured.mean:.2f} "
                         f"nats (95% upper bound {measured.upper:.2f}), past kl.max: {cfg.kl.max:g}; nothing was learned "
                         "inside the budget. Lower learning_rate, raise kl.coef, or raise kl.max")
    snapshot.restore()
    kept = (f"held-out KL {snapshot.kl.mean:.2f}, bound {snapshot.kl.upper:.2f}" if snapshot.kl
            else "the checkpoint this run resumed from")
    if ctx.is_main:
        print(f"[align] {ctx.name}: iteration {iteration}'s update took the held-out KL to {measured.mean:.2f} nats "
              f"(95% upper bound {measured.upper:.2f}), past kl.max {cfg.kl.max:g}: undone, and training stops here. "
              f"Publishing the policy after iteration {snapshot.iteration} ({kept})", flush=True)


def budget_summary(cfg: PPOStage, snapshot: PolicySnapshot, over: tuple[int, HeldoutKL] | None) -> dict[str, Any]:
    """The manifest's account of kl.max: which iteration's policy is published and why."""
    out: dict[str, Any] = {"kl_budget/max": cfg.kl.max, "kl_budget/published_iteration": snapshot.iteration,
                           "kl_budget/stopped": over is not None}
    if snapshot.kl is not None:
        out.update({"kl_budget/heldout_kl": snapshot.kl.mean, "kl_budget/heldout_kl_upper": snapshot.kl.upper})
    if over is not None:
        out.update({"kl_budget/undone_iteration": over[0], "kl_budget/undone_heldout_kl": over[1].mean,
                    "kl_budget/undone_heldout_kl_upper": over[1].upper})
    return out
