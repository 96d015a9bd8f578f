"""What every stage process shares: its spec, run directory, manifest, tracker and checkpoint hygiene.

The pipeline runner writes `<stage>/spec.json` and starts `accelerate launch -m align.cli stage <spec>`;
`main()` below runs in every process of that launch. Only the main process writes files; all processes
take part in saving (ZeRO-3 gathers the weights for the consolidated checkpoint).
"""

from __future__ import annotations

import errno
import importlib
import json
import logging
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from align.config import PipelineConfig, StageBase, TrainedStage, from_dict, stage_from_dict
from align.console import emit_progress, verbose
from align.fsutil import atomic_write_json, atomic_write_text, output_digest, publish_dir, staging_dir
from align.tracking import Tracker, scrub

log = logging.getLogger("align")

MANIFEST = "manifest.json"


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


class StageError(RuntimeError):
    """A stage cannot give a meaningful result (it would train zero steps, has nothing to evaluate, or
    produced nothing); it is recorded as failed, never as completed."""


class ManifestError(ValueError):
    """A manifest.json that cannot be read or is not a manifest; the message names it and the fix."""


def read_manifest(stage_dir: str | Path) -> dict[str, Any] | None:
    """The stage's manifest, or None when there is none. A manifest that exists but cannot be read or is not
    a JSON object is an error (not "missing": that would silently retrain over what it describes)."""
    path = Path(stage_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: cannot be read as JSON ({type(exc).__name__}: {exc}); delete it to rerun "
                            "the stage") from None
    if not isinstance(m, dict) or not isinstance(m.get("status", ""), str):
        raise ManifestError(f"{path}: not a stage manifest (a JSON {type(m).__name__}, not an object with a "
                            "status); delete it to rerun the stage")
    return m


def is_complete(stage_dir: str | Path, fingerprint: str | None = None) -> bool:
    """A stage is done when its manifest says completed (with this fingerprint) and its outputs exist."""
    m = read_manifest(stage_dir)
    if not m or m.get("status") != "completed" or (fingerprint and m.get("fingerprint") != fingerprint):
        return False
    return all((Path(stage_dir) / out).exists() for out in m.get("outputs", []))


class StageContext:
    """Everything a stage's `run()` needs, built from spec.json."""

    def __init__(self, spec: dict[str, Any]):
        import torch
        from accelerate import PartialState

        self.spec = spec
        self.cfg: StageBase = stage_from_dict(spec["stage"], spec["stage_name"])
        from_dict(PipelineConfig, {k: v for k, v in spec["pipeline"].items() if k != "stages"}, "pipeline:")
        self.pipeline: dict[str, Any] = spec["pipeline"]
        self.name: str = spec["stage_name"]
        self.dir = Path(spec["stage_dir"])
        self.run_dir = self.dir.parent
        self.fingerprint: str = spec["fingerprint"]
        self.inputs: dict[str, str] = spec["inputs"]
        self.seed: int = self.cfg.seed if self.cfg.seed is not None else int(self.pipeline["seed"])
        # On CPU, PartialState must be told so: without `cpu=True` it reports 1 process on every rank under
        # the DeepSpeed launcher (measured with accelerate 1.15), and every rank would think it is the main one.
        self.state = PartialState(cpu=not torch.cuda.is_available())
        self.is_main = self.state.is_main_process
        self.checkpoints = self.dir / "checkpoints"
        self.tracker: Tracker | None = None
        self.extra_manifest: dict[str, Any] = {}

    # ------------------------------------------------------------------ inputs
    def input_dir(self, stage_name: str) -> Path:
        if stage_name not in self.inputs:
            raise KeyError(f"stage '{self.name}' has no input '{stage_name}' (inputs: {sorted(self.inputs)})")
        return Path(self.inputs[stage_name])

    def input_model(self, stage_name: str) -> str:
        return str(self.input_dir(stage_name) / "model")

    # ------------------------------------------------------------------ tracking
    def start_tracking(self) -> Tracker:
        tr = self.pipeline["tracking"]
        self.tracker = Tracker(
            self.dir, main_process=self.is_main, wandb_setting=tr["wandb"], project=tr["project"],
            entity=tr.get("entity"), group=f"{self.pipeline['name']}/{self.pipeline['run_id']}", name=self.name,
            job_type=self.cfg.type,
            config={"stage": self.spec["stage"], "fingerprint": self.fingerprint,
                    "input_fingerprints": self.spec["input_fingerprints"], "data_cards": self.spec["data_cards"],
                    "pipeline": {k: v for k, v in self.pipeline.items() if k != "stages"}})
        return self.tracker

    def log(self, metrics: dict[str, Any], step: int) -> None:
        assert self.tracker is not None
        self.tracker.log(metrics, step)

    def progress(self, n: int, total: int, **metrics: float) -> None:
        """Advance this stage's one console progress bar (align/console.py); main process only."""
        if self.is_main:
            emit_progress(n, total, **metrics)

    # ------------------------------------------------------------------ checkpoints
    def prepare_checkpoints(self) -> None:
        """Main process: make checkpoints/ belong to this fingerprint (checkpoints of another config are not
        resumable and are removed). Every process then waits for it."""
        stamp = self.checkpoints / "FINGERPRINT"
        if self.is_main:
            if self.checkpoints.exists() and (not stamp.is_file() or stamp.read_text() != self.fingerprint):
                shutil.rmtree(self.checkpoints)
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            stamp.write_text(self.fingerprint)
        self.state.wait_for_everyone()

    def last_checkpoint(self) -> str | None:
        """The newest complete Trainer checkpoint of this fingerprint; stale or partial ones are removed.

        transformers writes trainer_state.json last, so a checkpoint whose trainer_state.json parses is
        complete; one killed mid-write is deleted rather than resumed from.
        """
        self.prepare_checkpoints()
        if self.is_main:
            for ckpt in self.checkpoints.glob("checkpoint-*"):
                try:
                    json.loads((ckpt / "trainer_state.json").read_text())
                except (OSError, json.JSONDecodeError):
                    log.warning("removing incomplete checkpoint %s", ckpt)
                    shutil.rmtree(ckpt)
        self.state.wait_for_everyone()
        ckpts = sorted(self.checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        return str(ckpts[-1]) if ckpts else None

    # ------------------------------------------------------------------ outputs
    def publish(self, name: str, write) -> None:
        """Build output `name` (e.g. model, data) in a staging dir with `write(path)` on every process (saving
        under ZeRO-3 is collective), then the main process renames it into place."""
        final = (self.dir / name).resolve()
        tmp = final.with_name(f".{final.name}.staging")
        try:
            if self.is_main:
                staging_dir(final)
            self.state.wait_for_everyone()
            write(tmp)
            self.state.wait_for_everyone()
            if self.is_main:
                publish_dir(tmp, final)
        except BaseException:
            if self.is_main:  # no half-written staging directory is left behind (e.g. a full disk)
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.state.wait_for_everyone()
        if self.is_main:
            self.extra_manifest.setdefault("output_digests", {})[name] = output_digest(final)

    def save_trainer_model(self, trainer, tokenizer) -> None:
        """Consolidated HF checkpoint (LoRA merged, ZeRO-3 gathered) + tokenizer, atomically as model/."""

        def write(path: Path) -> None:
            model = trainer.model
            if hasattr(model, "merge_and_unload") and getattr(self.cfg, "lora", None) and self.cfg.lora.enabled:
                # LoRA: save full merged weights so the next stage loads a plain model with from_pretrained.
                merged = trainer.accelerator.unwrap_model(model).merge_and_unload()
                if self.is_main:
                    merged.save_pretrained(path)
            else:
                trainer.save_model(str(path))
            if self.is_main:
                tokenizer.save_pretrained(path)

        self.publish("model", write)

    # ------------------------------------------------------------------ manifest
    def note(self, **values: Any) -> None:
        """Record values in the manifest now, while the stage runs (e.g. PPO's reward gain and bias, so a
        killed attempt's manifest still says what it fixed)."""
        self.extra_manifest.update(values)
        self.write_manifest("running", new_attempt=False)

    def write_manifest(self, status: str, new_attempt: bool = True, **extra: Any) -> None:
        if not self.is_main:
            return
        old = read_manifest(self.dir) or {}
        attempts = old.get("attempts", 0) + (1 if status == "running" and new_attempt else 0)
        manifest = {
            "stage": self.name, "type": self.cfg.type, "status": status, "fingerprint": self.fingerprint,
            "config": self.spec["stage"], "inputs": {k: {"path": v, "fingerprint": self.spec["input_fingerprints"][k]}
                                                     for k, v in self.inputs.items()},
            "input_digests": self.spec.get("input_digests", {}),
            "data_cards": self.spec["data_cards"], "code_version": self.spec["code_version"],
            "git_commit": self.spec.get("git_commit"), "packages": package_versions(),
            "started_at": old.get("started_at") if status != "running" or not new_attempt
            else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "attempts": attempts, "world_size": self.state.num_processes,
            "distributed_type": str(self.state.distributed_type).split(".")[-1],
            "zero_stage": int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
            if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") else None, **self.extra_manifest, **extra,
        }
        if status != "running":
            manifest["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        atomic_write_json(self.dir / MANIFEST, scrub(manifest))


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "trl", "accelerate", "deepspeed", "peft", "datasets", "wandb"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------------------------- TRL glue
_RENAME = {"loss": "train/loss", "learning_rate": "train/learning_rate", "grad_norm": "train/grad_norm",
           "epoch": "train/epoch", "rewards/margins": "rewards/margin",
           "rewards/accuracies": "rewards/accuracy"}


def metric_name(key: str) -> str:
    """Map TRL/transformers log keys to align's metric names (ARCHITECTURE.md)."""
    if key in _RENAME:
        return _RENAME[key]
    if key.startswith("eval_"):
        return "eval/" + key[5:]
    if key.startswith("train_"):
        return "perf/" + key[6:]
    return key if "/" in key else f"train/{key}"


def metrics_callback(ctx: StageContext):
    """A TrainerCallback that writes every log to metrics.jsonl/W&B and stops on a NaN/inf loss."""
    from transformers import TrainerCallback

    class AlignMetrics(TrainerCallback):
        loss: float | None = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                ctx.progress(state.global_step, state.max_steps, loss=self.loss)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            inject = os.environ.get("ALIGN_INJECT_NAN_AT_STEP")  # fault injection for crash-safety tests
            if inject and "loss" in logs and state.global_step >= int(inject):
                logs["loss"] = float("nan")
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                raise NonFiniteLossError(
                    f"stage '{ctx.name}': loss is {loss} at step {state.global_step}; stopping. The last good "
                    f"checkpoint is kept in {ctx.checkpoints} (lower the learning rate or check the data).")
            if loss is not None:
                self.loss = float(loss)
            if state.is_world_process_zero:
                ctx.log({metric_name(k): v for k, v in logs.items() if isinstance(v, (int, float))},
                        step=state.global_step)

    return AlignMetrics()


def trainer_kwargs(cfg: TrainedStage, ctx: StageContext) -> dict[str, Any]:
    """The TRL/transformers TrainingArguments that every trained stage shares."""
    import torch

    from align.stages.checks import check_trained

    check_trained(cfg)  # the same check `align validate` runs, in case the stage is started directly
    return dict(
        output_dir=str(ctx.checkpoints), learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay, num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1, per_device_train_batch_size=cfg.per_device_batch_size,
        per_device_eval_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, logging_steps=cfg.logging_steps,
        save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=2, report_to="none", seed=ctx.seed,
        data_seed=ctx.seed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        disable_tqdm=not verbose(),  # the runner draws one bar per stage from ctx.progress (align/console.py)
        # TRL defaults to bf16 autocast; on CPUs without bf16 units that is ~6x slower (measured: 3.4 s vs
        # 0.53 s per SFT step of the default model), so mixed precision is used only where it pays.
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(), fp16=False,
        max_length=cfg.max_length, logging_first_step=False,
        # TRL >= 1.16 turns gradient checkpointing on in every config; align leaves it to the stage setting
        # (off: the demo's SFT steps take about half the time without recomputation).
        activation_checkpointing=cfg.gradient_checkpointing,
    )


def check_lengths(ctx: StageContext, kind: str, rows: list[dict[str, Any]], tokenizer) -> None:
    """Count examples longer than max_length after templating (align/lengths.py), before any training step;
    record the counts in the manifest and stop when too many would be truncated or dropped."""
    from align.lengths import enforce, measure

    cfg: TrainedStage = ctx.cfg  # type: ignore[assignment]
    report = measure(ctx.name, kind, rows, tokenizer, cfg.max_length)
    ctx.extra_manifest["length_check"] = report.as_dict()
    if ctx.is_main:
        print(f"[align] length check {report.summary()}", flush=True)
    enforce(report, cfg.max_truncated_fraction)


def train_with_resume(ctx: StageContext, trainer) -> dict[str, Any]:
    """trainer.train(), resuming from the last complete checkpoint of this fingerprint if there is one."""
    ckpt = ctx.last_checkpoint()
    resumed_from = int(Path(ckpt).name.split("-")[-1]) if ckpt else 0
    if ckpt and ctx.is_main:
        print(f"[align] {ctx.name}: resuming from {ckpt} (step {resumed_from})", flush=True)
    ctx.extra_manifest["resumed_from_step"] = resumed_from
    if ctx.is_main:  # rows a killed attempt logged after its last checkpoint are logged again from there
        keep_metrics_until(ctx.dir / "metrics.jsonl", resumed_from)
    out = trainer.train(resume_from_checkpoint=ckpt)
    ctx.extra_manifest["global_step"] = trainer.state.global_step
    if trainer.state.global_step == 0:
        raise StageError(f"stage '{ctx.name}' trained 0 optimiser steps (no examples, or epochs/max_steps too "
                         "small for the batch size); nothing is published")
    return {"train/loss_final_avg": out.training_loss, "train/global_step": trainer.state.global_step}


def keep_metrics_until(path: Path, step: int) -> None:
    """Drop metrics rows after `step` (atomically), so a resumed stage never logs a step twice."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and _step(line) <= step]
    if len(kept) != len([line for line in lines if line.strip()]):
        atomic_write_text(path, "".join(line + "\n" for line in kept))


def _step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return float("inf")  # a torn last line of a killed attempt


# --------------------------------------------------------------------------------------------- entry point
def main(spec_path: str) -> int:
    """Run one stage in this process (called under `accelerate launch`). Returns the exit code: 0, or 2 for
    a refused input or an I/O failure (one paragraph on stderr, the traceback only in the manifest)."""
    logging.basicConfig(level=logging.INFO if verbose() else logging.WARNING,
                        format="[align] %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    quiet_libraries()
    ctx: StageContext | None = None
    spec: dict[str, Any] = {}
    try:
        spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        ctx = StageContext(spec)
        _run(ctx)
        return 0
    except EXPECTED as exc:
        message = describe(exc)
        recorded = _record_failure(ctx, spec, exc, message)
        print(f"align: error: stage '{spec.get('stage_name', spec_path)}': {message}" + recorded, file=sys.stderr,
              flush=True)
        return 2
    except BaseException as exc:
        _record_failure(ctx, spec, exc, f"{type(exc).__name__}: {exc}")
        raise


def _run(ctx: StageContext) -> None:
    old = read_manifest(ctx.dir)
    # Resume only an interrupted attempt of this very fingerprint; anything else starts clean.
    resumable = bool(old) and old.get("fingerprint") == ctx.fingerprint and old.get("status") != "completed"
    if ctx.is_main and not resumable:
        shutil.rmtree(ctx.checkpoints, ignore_errors=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            if (ctx.dir / name).exists():
                os.replace(ctx.dir / name, ctx.dir / f"{name}.prev")
    ctx.state.wait_for_everyone()
    ctx.write_manifest("running")
    module = importlib.import_module(f"align.stages.{ctx.cfg.type}")
    ctx.start_tracking()
    final = module.run(ctx)
    ctx.state.wait_for_everyone()
    check_produced(ctx, module.OUTPUTS, final)
    if ctx.tracker:
        ctx.tracker.summary(final)
    wandb_info = ctx.tracker.finish() if ctx.tracker else {}
    ctx.write_manifest("completed", final_metrics=final, outputs=module.OUTPUTS, wandb=wandb_info)
    if ctx.is_main:
        print(f"[align] {ctx.name}: completed " + ", ".join(f"{k}={_fmt(v)}" for k, v in final.items()
                                                            if isinstance(v, (int, float))), flush=True)


def quiet_libraries() -> None:
    """Unless --verbose: no library progress bars or INFO chatter (all of it would only fill stage.log)."""
    if verbose():
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    from datasets.utils import logging as ds_logging
    from transformers.utils import logging as tf_logging

    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    ds_logging.set_verbosity_error()
    ds_logging.disable_progress_bar()
    for name in ("deepspeed", "DeepSpeed", "accelerate", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def check_produced(ctx: StageContext, outputs: list[str], final: dict[str, Any]) -> None:
    """A stage that trained zero steps, evaluated zero prompts or published nothing has failed."""
    if ctx.extra_manifest.get("global_step") == 0 or final.get("ppo/iterations_run") == 0:
        raise StageError(f"stage '{ctx.name}' trained 0 steps")
    if final.get("eval/prompts") == 0:
        raise StageError(f"stage '{ctx.name}' evaluated 0 prompts")
    for out in outputs:
        path = ctx.dir / out
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            raise StageError(f"stage '{ctx.name}' produced nothing: {path.resolve()} is missing or empty")


# Failures that are the input's or the machine's fault, not align's: one paragraph, exit code 2.
EXPECTED: tuple[type[BaseException], ...] = (OSError, ValueError, NonFiniteLossError, StageError)


def describe(exc: BaseException) -> str:
    """One line for an expected failure; an OSError names its path and the cause (e.g. a full disk)."""
    if isinstance(exc, OSError) and exc.strerror:
        code = errno.errorcode.get(exc.errno or 0, "")
        where = f"{os.path.abspath(exc.filename)}: " if exc.filename else ""
        return f"{where}{exc.strerror}" + (f" ({code})" if code else "")
    return f"{type(exc).__name__}: {exc}"


def _record_failure(ctx: StageContext | None, spec: dict[str, Any], exc: BaseException, message: str) -> str:
    """Write `failed` with the error into the manifest; returns where it went (or why it could not)."""
    trace = traceback.format_exc(limit=20)
    try:
        if ctx is not None:
            if ctx.tracker:
                ctx.tracker.finish()
            ctx.write_manifest("failed", error=message, traceback=trace)
        elif spec.get("stage_dir") and os.environ.get("RANK", "0") == "0":
            atomic_write_json(Path(spec["stage_dir"]) / MANIFEST, {
                "stage": spec.get("stage_name"), "status": "failed", "fingerprint": spec.get("fingerprint"),
                "error": message, "traceback": trace, "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        else:
            return ""
    except Exception as second:  # e.g. the disk is still full: say so rather than hide the first error
        return f"\n  (could not record the failure in the manifest either: {describe(second)})"
    where = ctx.dir if ctx is not None else spec["stage_dir"]
    return f"\n  manifest: {Path(where) / MANIFEST} (status failed, traceback inside)"


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)




# --------------------------------------------------------------------------------------------- data
def load_rows(ctx: StageContext, ref: str, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows from a data reference: an upstream stage that wrote `data/<split>.jsonl`, or a data card path."""
    from align.data.cards import load_split, read_jsonl

    if ref in ctx.inputs:
        rows = read_jsonl(ctx.input_dir(ref) / "data" / f"{split}.jsonl")
    else:
        rows = load_split(ref, split).rows
    return rows[:limit] if limit else rows


def unique_prompts(rows: list[dict[str, Any]], limit: int | None = None) -> list[str]:
    """Distinct prompts in order of first appearance (so a prompt is never sampled twice by accident)."""
    seen = dict.fromkeys(r["prompt"] for r in rows)
    prompts = list(seen)
    return prompts[:limit] if limit else prompts
