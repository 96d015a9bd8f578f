"""Resumable TRL training: checkpoints made durable before older ones go, a resume that trains no step past
max_steps, and the whole run's loss across a resume (align/runtime/trl.py `train_with_resume`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align.config.settings import warmup_steps
from align.core.fsutil import fsync_dir, fsync_tree
from align.core.checkpoints import mark_durable, rotate_checkpoints
from align.core.tracking import metrics_rows
from align.runtime.context import StageContext, StageError


def durable_checkpoints(ctx: StageContext, keep: int):
    """A TrainerCallback that, after each checkpoint save, waits for every process's files, has each node's first
    process fsync the new checkpoint, and only then has the main process mark it DURABLE (with the metrics rows
    logged by then) and remove all but the newest `keep` (the stage's save_total_limit). transformers rotated right
    after its own writes: a process still writing its optimizer shard or RNG state, or a power loss before the page
    cache reached the disk, left the newest torn and the whole one before it gone (align/core/checkpoints.py
    `choose_checkpoint` resumes from what is left)."""
    from transformers import TrainerCallback  # heavy: stage processes only

    class DurableCheckpoints(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            newest = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            ctx.state.wait_for_everyone()
            if ctx.state.is_local_main_process and newest.is_dir():
                fsync_tree(newest)
                fsync_dir(newest.parent)  # its name too, before any older one goes
            ctx.state.wait_for_everyone()
            if ctx.state.is_main_process:
                if newest.is_dir():
                    mark_durable(newest, metrics_rows(ctx.dir / "metrics.jsonl"))
                rotate_checkpoints(Path(args.output_dir), keep)

    return DurableCheckpoints()


class AlreadyTrained(Exception):
    """Raised before a step past max_steps: the resumed checkpoint already holds every step."""


def stop_at_max_steps(stage: str):
    """transformers' loop trains a step before it first asks whether max_steps is reached: resumed from a
    checkpoint at max_steps (a stage killed after its last save, before it published), it trained one step more
    than asked. This callback stops it before that step's forward; and logs the last step's loss window, which the
    final checkpoint (always saved) then holds, so that run_loss covers a run resumed from it. Before the first
    step it refuses a warmup as long as the run (the steps its epochs give: `align validate` checks max_steps)."""
    from transformers import TrainerCallback  # heavy: stage processes only

    class StopAtMaxSteps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            steps, ratio = state.max_steps, args.warmup_steps
            if 0 < steps <= warmup_steps(steps, ratio, str(getattr(args.lr_scheduler_type, "value", ""))):
                raise StageError(f"stage '{stage}': warmup_ratio {ratio:g} of its {steps} optimiser steps warms up "
                                 "for every step (the first at learning rate 0: one step trains nothing); lower "
                                 "warmup_ratio, or train more steps (epochs, max_steps)")

        def on_step_begin(self, args, state, control, **kwargs):
            if 0 < state.max_steps <= state.global_step:
                raise AlreadyTrained

        def on_step_end(self, args, state, control, **kwargs):
            if 0 < state.max_steps <= state.global_step:
                control.should_log = True

    return StopAtMaxSteps()


def run_loss(log_history: list[dict[str, Any]], resumed_from: int, loss_since: float, steps: int) -> float | None:
    """The mean training loss per optimiser step over the whole run. transformers' `training_loss` covers only
    this train() call: after a resume, the steps since `resumed_from`. The steps before are read from the logged
    losses the checkpoint kept (each the mean over its logging window; save_steps is a multiple of
    logging_steps, so they tile steps 1..resumed_from). None when they do not, or no step was trained."""
    if steps <= 0:
        return None
    before, last = 0.0, 0
    for row in log_history:
        if "loss" in row and last < row.get("step", 0) <= resumed_from:
            before, last = before + float(row["loss"]) * (row["step"] - last), row["step"]
    if last != resumed_from:
        return None
    return (before + loss_since * (steps - resumed_from)) / steps
