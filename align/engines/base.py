"""The rollout engine's interface, and the engine-vs-trainer check every caller runs on what an engine returns.

An engine declares what its callers need, so no stage tests an engine's class or name: `holds_own_weights` (a copy to
sync after every update), `describe()` (what the manifest records of it; None for nothing worth recording),
`log_path` (where its own log is, None when it has none) and `sync_seconds` (one entry per sync). Training code
recomputes log-probs with the training model whatever the engine, and `check_rollout` compares them with the
engine's own: the gap is logged, and a gap past `generation.max_logprob_gap` (or not finite) stops the stage.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from align.config import Generation
    from align.modeling.generation import Rollout

from align.engines import EngineError


class RolloutEngine(Protocol):
    name: str
    holds_own_weights: bool
    log_path: object
    sync_seconds: list[float]

    def describe(self) -> dict | None: ...

    def generate(self, prompts: list[str], gen: Generation, seed: int, max_prompt_length: int | None = None,
                 greedy: bool = False) -> Rollout: ...

    def sync_weights(self, model) -> float: ...

    # an engine that can free its memory while the policy trains (generation.sleep) has sleep() (see `rest`), one
    # that maps the caller's weights where they lie has release() (see `release`), one that prepares the caller's
    # model for each generate has holding() (see `holding`)
    # engines that hold their own weights also sample prompts already tokenised (TRL's GRPO and RLOO hold ids):
    # generate_ids(query_ids, query_mask, gen, seed, greedy=False) -> Rollout (align/stages/online_rl.py)

    def close(self) -> None: ...


def rest(engine) -> None:
    """The policy is about to train: an engine that can free its memory meanwhile (generation.sleep) does; it wakes
    when next asked to sync or sample. Every process calls it at the same point (a shared engine's is a collective)."""
    sleep = getattr(engine, "sleep", None)
    if callable(sleep):
        sleep()


def holding(engine):
    """Several generates in a row (PPO's rollout in chunks): an engine that prepares the caller's model for each (the
    hf engine under ZeRO-3 gathers the policy whole) prepares it once for all of them; for the others nothing."""
    from contextlib import nullcontext

    hold = getattr(engine, "holding", None)
    return hold() if callable(hold) else nullcontext()


def release(engine) -> None:
    """The caller drops the policy it synced last: an engine that maps that policy's weights where they lie (vLLM's
    with weight_sync: shared, on a CPU) lets them go now, not at its next sync (which comes after the next policy has
    loaded: two policies in host memory and /dev/shm at once)."""
    let_go = getattr(engine, "release", None)
    if callable(let_go):
        let_go()


def free_cached_memory() -> None:
    """The GPU memory this process's caching allocator holds unused goes back to the device (after a gc: tensors kept
    alive only by reference cycles go first): before a sleeping engine on the same GPU wakes, as vLLM maps its memory
    anew then (TRL does the same before waking vLLM). Nothing without CUDA."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def all_gather_objects(obj, group=None) -> list:
    """Every process's `obj`, in rank order (a collective: torch.distributed's all_gather_object over `group`)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def logprob_gap(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |engine - trainer| log-prob over the response tokens (mask 1): how far the engine's sampling
    distribution is from the one the trainer optimises (a drift here biases every importance ratio)."""
    m = mask.bool()
    if not m.any():
        return {"mean": 0.0, "max": 0.0}
    d = (engine_logprobs.float() - trainer_logprobs.float()).abs()[m]
    return {"mean": d.mean().item(), "max": d.max().item()}


def nan_max(values) -> float:
    """The largest of `values`, NaN when any is NaN (Python's max skips NaN depending on where it falls: a summary
    must never report a clean maximum over a broken one)."""
    values = [float(v) for v in values]
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def check_gap(gap: float, bound: float, where: str, log_path) -> None:
    """Stop when the engine's log-probs of its own samples stray from the trainer's: non-finite (a weight sync that
    loaded wrongly), or above `bound` nats on some token (a sync that did not reach it, a dtype or kernel mismatch)."""
    if math.isfinite(gap) and gap <= bound:
        return
    raise EngineError(f"{where}: the rollout engine's log-probs differ from the trained model's by {gap} on a sampled "
                      f"token (more than generation.max_logprob_gap={bound:g}): the engine is not sampling from the "
                      f"weights being trained (a failed or partial weight sync); its log: {log_path}")


def across_processes(accelerator) -> Callable[[float], float]:
    """check_rollout's `reduce` in a stage of several processes: the largest gap of any of them (NaN when any is NaN:
    torch's max propagates it), so that all stop together or none does. A collective: every process checks."""
    return lambda gap: accelerator.gather(torch.tensor([gap], device=accelerator.device)).max().item()


def check_rollout(engine: RolloutEngine, rollout: Rollout, trainer_logprobs: torch.Tensor, bound: float,
                  where: str, reduce: Callable[[float], float] | None = None) -> dict[str, float] | None:
    """The gap (mean, max) between the engine's log-probs of its own samples and the trainer's, checked against
    `bound` (check_gap); None when the engine returns no log-probs of its own (it samples with the trained model).
    `reduce`, when given, turns this process's max into the one every process checks (the max over processes: all
    stop together, or none)."""
    if rollout.engine_logprobs is None:
        return None
    gap = logprob_gap(rollout.engine_logprobs, trainer_logprobs, rollout.response_mask)
    if reduce is not None:
        gap["max"] = reduce(gap["max"])
    check_gap(gap["max"], bound, where, engine.log_path)
    return gap
