"""PPO's resumable state: accelerate's save_state (models, optimizer, RNG) plus the small state objects (KL
controller, reward statistics and gain/bias, data position, iteration), written to a hidden directory and
renamed into place with a COMPLETE marker, so a kill mid-save never leaves a checkpoint that looks whole.

With LoRA (`trainable_only`) a checkpoint holds only the trained weights (adapters, the value head) and their
optimizer state: the frozen base is reloaded from the starting models on resume, and is never written again.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from align.core.fsutil import atomic_write_text, fsync_dir, fsync_tree
from align.core.checkpoints import step_checkpoints
from align.core.tracking import keep_metrics_until, table_file
from align.runtime.context import StageContext


def _trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _keep_trainable(models, weights, output_dir) -> None:
    """accelerate's save hook (no DeepSpeed): write only the trained parameters of each model."""
    for i, model in enumerate(models):
        names = _trainable(model)
        weights[i] = {k: v for k, v in weights[i].items() if k in names}


def _check_trainable(models, input_dir) -> None:
    """accelerate's load hook (no DeepSpeed): the models load non-strictly (the base is not in the checkpoint),
    so check here that every trained parameter is."""
    from pathlib import Path

    from safetensors import safe_open  # heavy: loaded on use

    for i, model in enumerate(models):
        path = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
        with safe_open(str(path), framework="pt") as f:
            missing = _trainable(model) - set(f.keys())
        if missing:
            raise RuntimeError(f"{path}: {len(missing)} trained parameters are missing (first: {sorted(missing)[0]}); "
                               "the checkpoint was written with other adapter settings")


def _is_deepspeed(accelerator) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def _model_kwargs(accelerator, trainable_only: bool, saving: bool) -> dict[str, Any]:
    if not trainable_only:
        return {}
    if _is_deepspeed(accelerator):
        return {"exclude_frozen_parameters": True} if saving else {"load_module_strict": False}
    return {} if saving else {"strict": False}


def _register(accelerator, *objs, trainable_only: bool = False) -> None:
    if not getattr(accelerator, "_align_registered", False):
        for o in objs:
            accelerator.register_for_checkpointing(o)
        if trainable_only and not _is_deepspeed(accelerator):
            accelerator.register_save_state_pre_hook(_keep_trainable)
            accelerator.register_load_state_pre_hook(_check_trainable)
        accelerator._align_registered = True


def resume(ctx: StageContext, accelerator, kl_ctl, moments, scale, stream, progress, trainable_only: bool = False) -> int:
    """Restore the newest complete checkpoint of this fingerprint (models, optimizer, RNG, KL controller, reward
    statistics and gain/bias, data position); return the iteration to continue from."""

    class Progress:
        def state_dict(self):
            return dict(progress)

        def load_state_dict(self, s):
            progress.update(s)

    _register(accelerator, kl_ctl, moments, scale, stream, Progress(), trainable_only=trainable_only)
    ckpts = ctx.checkpoints
    ctx.prepare_checkpoints()
    if accelerator.is_main_process:
        for partial in ckpts.glob(".iter-*"):  # a save that was killed mid-write
            shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    def newest():  # the main process's listing (another node's may lag), given to every process
        done = [p for p in step_checkpoints(ckpts, "iter-") if (p / "COMPLETE").is_file()]  # `iter-40.bak`: not one
        return str(done[-1]) if done else None

    chosen = ctx.main_decides(newest)
    if chosen is None:
        ctx.extra_manifest["resumed_from_iteration"] = 0
        return 0
    accelerator.load_state(chosen, **_model_kwargs(accelerator, trainable_only, saving=False))
    if accelerator.is_main_process:
        print(f"[align] {ctx.name}: resuming from {chosen} (iteration {progress['iteration']}, "
              f"beta {kl_ctl.value:.4f}, reward gain {scale.gain:.4f} bias {scale.bias:.4f})", flush=True)
    ctx.extra_manifest["resumed_from_iteration"] = progress["iteration"]
    return int(progress["iteration"])


def restore_history(ctx: StageContext, start: int) -> list[dict[str, Any]]:
    """The per-iteration metrics of iterations 1..start from metrics.jsonl (a resumed run summarises the whole
    run); rows a killed attempt logged after its last checkpoint are dropped, as they are logged again (its sample
    table's too)."""
    path = ctx.dir / "metrics.jsonl"
    if ctx.is_main:
        keep_metrics_until(path, start)
        keep_metrics_until(ctx.dir / table_file("samples"), start)
    ctx.state.wait_for_everyone()
    if not start or not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "objective/scores" in r]


def save_checkpoint(ctx: StageContext, accelerator, iteration: int, trainable_only: bool = False,
                    keep: int = 2) -> None:
    """accelerator.save_state into a hidden dir, then a rename + COMPLETE marker; keep the last `keep`. Its files
    reach the disk (fsync, by each node's first process) before the marker, and the rename before the older
    checkpoints go: after a power loss or a kernel crash the newest marked checkpoint is whole, or an older one is
    still there."""
    final = ctx.checkpoints / f"iter-{iteration}"
    tmp = ctx.checkpoints / f".iter-{iteration}"
    accelerator.save_state(str(tmp), **_model_kwargs(accelerator, trainable_only, saving=True))
    accelerator.wait_for_everyone()  # every process's files written (its RNG state last, with no barrier after it)
    if accelerator.is_local_main_process:
        fsync_tree(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        atomic_write_text(tmp / "COMPLETE", json.dumps({"iteration": iteration}))
        tmp.rename(final)
        fsync_dir(ctx.checkpoints)
        for old in step_checkpoints(ctx.checkpoints, "iter-")[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
