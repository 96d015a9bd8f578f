"""What PPO logs: each iteration's row of metrics.jsonl (`iteration_metrics`, names shared with the other online
stages: docs/ARCHITECTURE.md) and the run's summary for the manifest (`summarise`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from align.config.ppo import PPOStage
from align.modeling.packing import computed_padding_fraction, padding_fraction
from align.stages.ppo.budget import HeldoutKL


def iteration_metrics(s, b, kl: torch.Tensor, beta: float, stats: dict[str, float],
                      measured: HeldoutKL | None, t0: float, t_sync: float, split: dict[str, float]) -> dict[str, float]:
    """One iteration's row of metrics.jsonl (names shared with the other online stages: docs/ARCHITECTURE.md), from
    the run `s` (a PPORun) and the iteration's batch `b` (a Batch). `split`: this process's seconds per phase (NeMo-RL's split of an RL step): weight_sync (before the rollout and
    before the held-out samples), generation, scoring, training (advantages and the PPO epochs), heldout (its
    sampling and scoring)."""
    gather = s.accelerator.gather
    r, rmask = b.rollout, b.rmask

    def mean(x: float) -> float:  # over processes, reduced on the accelerator's device (NCCL takes no CPU tensor)
        return s.accelerator.reduce(torch.tensor(x, device=s.accelerator.device), "mean").item()

    elapsed = time.time() - t0
    # the sequence KL in nats (k1 summed, as the held-out KL and the evaluation measure it), whatever estimator the
    # penalty takes (`kl`: k2 is biased; the controller without held-out prompts steers this)
    seq_kl = gather(((b.logprobs - b.ref_logprobs) * rmask).sum(1)).mean().item()
    non_score = gather((-beta * kl).sum(1)).mean().item()
    used = gather(b.scores_used).mean().item()
    scores = gather(b.scores)
    metrics = {
        "objective/scores": scores.mean().item(), "objective/scores_std": scores.std().item() if scores.numel() > 1 else 0.0,  # n - 1: NaN for one
        "objective/normalized_scores": gather(b.scores_used + b.penalties).mean().item(),
        "objective/penalties": gather(b.penalties).mean().item(),
        "objective/kl": seq_kl, "objective/kl_coef": beta, "objective/non_score_reward": non_score,
        "objective/rlhf_reward": used + non_score,
        "rollout/response_length": gather(rmask.sum(1)).mean().item(),
        "rollout/eos_fraction": gather(r.eos_found.float()).mean().item(),
        "perf/episodes_per_s": s.cfg.rollout_batch_size * s.world / elapsed,
        "perf/tokens_per_s": gather(rmask.sum()).sum().item() / elapsed,
        "perf/generation_fraction": b.t_gen / elapsed,
        **{f"perf/{phase}_seconds": mean(seconds) for phase, seconds in split.items()},
        "perf/tokens_per_s_per_process": gather(rmask.sum()).sum().item() / elapsed / s.world,
        "perf/sequence_tokens": gather(r.attention_mask.sum()).sum().item(),  # prompt + response, no padding
        # of the tokens the rollout batch's scoring passes compute, padding: as run (packed), and as a padded batch
        "perf/padding_fraction": mean(computed_padding_fraction(s.accelerator.unwrap_model(s.model).policy,
                                                                r.attention_mask, s.cfg.mini_batch_size)),
        "perf/padding_fraction_unpacked": mean(padding_fraction(r.attention_mask)),
        "train/learning_rate": s.optimizer.param_groups[0]["lr"], **stats,
        **(measured.metrics() if measured else {}),
    }
    if b.gap is not None:
        metrics["rollout/logprob_gap_mean"] = mean(b.gap["mean"])
        metrics["rollout/logprob_gap_max"] = s.accelerator.reduce(
            torch.tensor(b.gap["max"], device=s.accelerator.device), "max").item()
        metrics["perf/sync_seconds"] = t_sync
    return metrics


def summarise(cfg: PPOStage, history: list[dict[str, float]], kl_ctl, start: int) -> dict[str, Any]:
    """Final figures for the manifest: score at the start and end of training (over the whole run, also after a
    resume: history is restored from metrics.jsonl), KL and beta."""
    if not history:
        raise RuntimeError(f"PPO ran no iteration (iterations={cfg.iterations}, resumed at {start})")
    k = max(1, len(history) // 5)
    first, last = history[:k], history[-k:]

    def avg(rows, key):
        rows = [r for r in rows if key in r]
        return sum(r[key] for r in rows) / len(rows) if rows else None

    return {"ppo/iterations_run": len(history), "ppo/resumed_from_iteration": start,
            "objective/scores_first": avg(first, "objective/scores"),
            "objective/scores_last": avg(last, "objective/scores"),
            "objective/kl_last": avg(last, "objective/kl"), "objective/kl_coef_final": kl_ctl.value,
            "heldout/kl_last": history[-1].get("heldout/kl"),
            "objective/kl_target": cfg.kl.target if cfg.kl.adaptive else None,
            "rollout/eos_fraction_last": avg(last, "rollout/eos_fraction"),
            "perf/episodes_per_s": avg(history, "perf/episodes_per_s"),
            "perf/generation_fraction": avg(history, "perf/generation_fraction"),
            "perf/tokens_per_s": avg(history, "perf/tokens_per_s"),
            "perf/tokens_per_s_per_process": avg(history, "perf/tokens_per_s_per_process"),
            **{f"perf/{phase}_seconds": avg(history, f"perf/{phase}_seconds")
               for phase in ("weight_sync", "generation", "scoring", "training", "heldout")},
            "perf/padding_fraction": avg(history, "perf/padding_fraction"),
            "train/skipped_step_fraction": avg(history, "train/skipped_step_fraction")}
