"""PPO's resumable state: accelerate's save_state (models, optimizer, RNG) plus the small state objects (KL
controller, reward statistics and gain/bias, data position, iteration), written to a hidden directory and
renamed into place with a COMPLETE marker, so a kill mid-save never leaves a checkpoint that looks whole."""

from __future__ import annotations

import json
import shutil
from typing import Any

from align.stages.context import StageContext, keep_metrics_until


def _register(accelerator, *objs) -> None:
    if not getattr(accelerator, "_align_registered", False):
        for o in objs:
            accelerator.register_for_checkpointing(o)
        accelerator._align_registered = True


def resume(ctx: StageContext, accelerator, kl_ctl, moments, scale, stream, progress) -> int:
    """Restore the newest complete checkpoint of this fingerprint (models, optimizer, RNG, KL controller, reward
    statistics and gain/bias, data position); return the iteration to continue from."""

    class Progress:
        def state_dict(self):
            return dict(progress)

        def load_state_dict(self, s):
            progress.update(s)

    _register(accelerator, kl_ctl, moments, scale, stream, Progress())
    ckpts = ctx.checkpoints
    ctx.prepare_checkpoints()
    if accelerator.is_main_process:
        for partial in ckpts.glob(".iter-*"):  # a save that was killed mid-write
            shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    done = sorted((p for p in ckpts.glob("iter-*") if (p / "COMPLETE").is_file()), key=lambda p: int(p.name[5:]))
    if not done:
        ctx.extra_manifest["resumed_from_iteration"] = 0
        return 0
    accelerator.load_state(str(done[-1]))
    if accelerator.is_main_process:
        print(f"[align] {ctx.name}: resuming from {done[-1]} (iteration {progress['iteration']}, "
              f"beta {kl_ctl.value:.4f}, reward gain {scale.gain:.4f} bias {scale.bias:.4f})", flush=True)
    ctx.extra_manifest["resumed_from_iteration"] = progress["iteration"]
    return int(progress["iteration"])


def restore_history(ctx: StageContext, start: int) -> list[dict[str, Any]]:
    """The per-iteration metrics of iterations 1..start from metrics.jsonl (a resumed run summarises the whole
    run); rows a killed attempt logged after its last checkpoint are dropped, as they are logged again."""
    path = ctx.dir / "metrics.jsonl"
    if ctx.is_main:
        keep_metrics_until(path, start)
    ctx.state.wait_for_everyone()
    if not start or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "objective/scores" in r]


def save_checkpoint(ctx: StageContext, accelerator, iteration: int) -> None:
    """accelerator.save_state into a hidden dir, then a rename + COMPLETE marker; keep the last two."""
    final = ctx.checkpoints / f"iter-{iteration}"
    tmp = ctx.checkpoints / f".iter-{iteration}"
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "COMPLETE").write_text(json.dumps({"iteration": iteration}))
        tmp.rename(final)
        for old in sorted(ctx.checkpoints.glob("iter-*"), key=lambda p: int(p.name[5:]))[:-2]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
