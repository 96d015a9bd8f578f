"""What every stage process shares: its spec, run directory, manifest, tracker and checkpoint hygiene.

The runner writes `<stage>/spec.json` (align/core/rundir.py) and starts `accelerate launch -m align.cli stage
<spec>`; `main()` below runs in every process of that launch. Only the main process writes files; all
processes take part in saving (ZeRO-3 gathers the weights for the consolidated checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from align.core.engine_env import EngineError
from align.core.errors import Terminated, describe, interrupt_cause, terminate_as_interrupt
from align.modeling.compute import resolve as resolve_compute
from align.config import PipelineConfig, StageBase, from_dict, stage_from_dict
from align.core.console import emit_progress, verbose
from align.core.fsutil import (write_failure, atomic_write_text, disk_full, output_digest, publish_dir, staging_dir, staging_path,
                          tree_bytes)
from align.core.rundir import MANIFEST, Manifest, StageSpec, read_manifest, write_manifest
from align.templates import ChatTemplate
from align.core.tracking import Tracker, sweep_config

log = logging.getLogger("align")


LAYOUT = "LAYOUT.json"  # in checkpoints/: the process layout that wrote them (StageContext.layout)


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


class StageError(RuntimeError):
    """A stage cannot give a meaningful result (it would train zero steps, has nothing to measure, or
    produced nothing); it is recorded as failed, never as completed."""


class StageContext:
    """Everything a stage's `run()` needs, built from spec.json."""

    def __init__(self, spec: StageSpec):
        import torch  # heavy: only stage processes build a context
        from accelerate import PartialState  # heavy: stage processes only

        self.spec = spec
        self.cfg: StageBase = stage_from_dict(spec.stage, spec.stage_name)
        self.pipeline: PipelineConfig = from_dict(
            PipelineConfig, {k: v for k, v in spec.pipeline.items() if k != "stages"}, "pipeline:")
        self.name = spec.stage_name
        self.dir = Path(spec.stage_dir)
        self.run_dir = self.dir.parent
        self.fingerprint = spec.fingerprint
        self.inputs: dict[str, str] = spec.inputs
        self.seed: int = self.cfg.seed if self.cfg.seed is not None else self.pipeline.seed
        # On CPU, PartialState must be told so: without `cpu=True` it reports 1 process on every rank under
        # the DeepSpeed launcher (measured with accelerate 1.15), and every rank would think it is the main one.
        self.state = PartialState(cpu=not torch.cuda.is_available())
        self.is_main = self.state.is_main_process
        self.compute = resolve_compute(self.pipeline.precision, self.pipeline.attn_implementation, self.state.device,
                                       zero3=os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3")
        self.checkpoints = self.dir / "checkpoints"
        # The pipeline's chat template as planned (align/templates/): read here, never resolved again.
        self.chat_template: ChatTemplate | None = (ChatTemplate.from_dict(spec.chat_template)
                                                   if spec.chat_template else None)
        self.tracker: Tracker | None = None
        self.extra_manifest: dict[str, Any] = {}
        self.trained_from: str | None = None  # what the stage's trained model was loaded from (a LoRA adapter's base)
        self.trained_vocab = 0  # its embedding rows when loaded (a template that adds tokens grows them)

    # ------------------------------------------------------------------ inputs
    def input_dir(self, stage_name: str) -> Path:
        if stage_name not in self.inputs:
            raise KeyError(f"stage '{self.name}' has no input '{stage_name}' (inputs: {sorted(self.inputs)})")
        return Path(self.inputs[stage_name])

    def input_model(self, stage_name: str) -> str:
        return str(self.input_dir(stage_name) / "model")

    # ------------------------------------------------------------------ models
    def weights_dtype(self, frozen: bool) -> str:
        """The pipeline's `dtype`, with `auto` resolved for this process: bfloat16 where the stage computes in bf16
        on a GPU, for a frozen model (run forward only), and for a trained one under DeepSpeed, whose optimiser keeps
        fp32 master weights; float32 for a trained model outside DeepSpeed (fp32 weights under bf16 autocast: mixed
        precision) and everywhere on a CPU."""
        if self.pipeline.dtype != "auto":
            return self.pipeline.dtype
        bf16 = self.compute.device.type == "cuda" and self.compute.mixed_precision == "bf16"
        deepspeed = str(self.state.distributed_type).endswith("DEEPSPEED")
        return "bfloat16" if bf16 and (frozen or deepspeed) else "float32"

    def load_lm(self, path: str, device: bool = False, quantize: str = "none", frozen: bool = False):
        """A causal LM in the pipeline's dtype (`frozen`: only run forward; see `weights_dtype`) and attention kernel
        (moved to this process's device if asked: stages that do not hand the model to accelerate or a Trainer);
        `quantize: 4bit` for a QLoRA base."""
        from align.modeling.models import load_causal_lm  # heavy: stage processes only

        model = load_causal_lm(path, self.weights_dtype(frozen), self.pipeline.trust_remote_code, quantize,
                               **self.compute.model_kwargs())
        startup_done()
        self._record_load(path, model)
        if not frozen:
            self.trained_from, self.trained_vocab = path, model.get_input_embeddings().num_embeddings
        return model.to(self.compute.device) if device else model

    def _record_load(self, path: str, model) -> None:
        """Under ZeRO-3, note in the manifest whether the model arrived partitioned (deepspeed.zero.Init: this rank
        holds only its share of the weights) or whole."""
        if self.compute.distributed_zero3:
            partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
            self.extra_manifest.setdefault("models_loaded", []).append({"path": path, "zero3_partitioned": partitioned})

    def load_scalar(self, path: str, pad_token_id: int | None, device: bool = False, quantize: str = "none",
                    frozen: bool = False):
        """A scalar model (sequence classification, one output), like `load_lm`. A scalar head that the
        checkpoint does not hold (a scalar model started from a language model) is initialised
        from the stage's seed alone, on a forked RNG: the same seed gives the same head in every run, and the
        global random stream of the stage is left as it was."""
        import torch  # heavy: stage processes only

        from align.modeling.models import load_scalar_model  # heavy: stage processes only

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = load_scalar_model(path, pad_token_id, self.weights_dtype(frozen), self.pipeline.trust_remote_code,
                                      quantize, **self.compute.model_kwargs())
        startup_done()
        self._record_load(path, model)
        if not frozen:
            self.trained_from, self.trained_vocab = path, model.get_input_embeddings().num_embeddings
        return model.to(self.compute.device) if device else model

    # ------------------------------------------------------------------ tracking
    def start_tracking(self) -> Tracker:
        tr, p = self.pipeline.tracking, self.pipeline
        self.tracker = Tracker(
            self.dir, main_process=self.is_main, wandb_setting=tr.wandb, project=tr.project,
            entity=tr.entity, group=f"{p.name}/{p.run_id}", name=self.name, job_type=self.cfg.type,
            config={"stage": self.spec.stage, "fingerprint": self.fingerprint,
                    "input_fingerprints": self.spec.input_fingerprints, "data_cards": self.spec.data_cards,
                    "pipeline": self.spec.pipeline, **sweep_config(self.name, p.variants)})  # spec: no stages
        return self.tracker

    def log(self, metrics: dict[str, Any], step: int) -> None:
        assert self.tracker is not None
        self.tracker.log(metrics, step)

    def progress(self, n: int, total: int, **metrics: float) -> None:
        """Advance this stage's one console progress bar (align/core/console.py); main process only."""
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
            atomic_write_text(self.checkpoints / LAYOUT, json.dumps(self.layout()))
        self.state.wait_for_everyone()

    def layout(self) -> dict[str, Any]:
        """How this stage's processes are laid out: what a ZeRO checkpoint's per-rank states depend on."""
        zero = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return {"world_size": self.state.num_processes, "zero_stage": int(zero) if zero else None}

    def check_checkpoint_layout(self) -> None:
        """Before anything loads: checkpoints of this fingerprint written under another number of processes or
        another ZeRO stage cannot be resumed (DeepSpeed partitions optimiser states per rank); refuse with the fix
        instead of failing inside DeepSpeed after the models are loaded."""
        stamp = self.checkpoints / LAYOUT
        if not stamp.is_file() or (self.checkpoints / "FINGERPRINT").read_text() != self.fingerprint or not any(
                self.checkpoints.glob("checkpoint-*")) and not any(self.checkpoints.glob("iter-*")):
            return
        try:
            old = json.loads(stamp.read_text())
        except ValueError:
            return
        now = self.layout()
        if old == now or not (old.get("zero_stage") or now["zero_stage"]):
            return
        raise StageError(
            f"stage '{self.name}': its checkpoints in {self.checkpoints} were written by {old.get('world_size')} "
            f"process(es) under ZeRO-{old.get('zero_stage') or 0}, and this run has {now['world_size']} under "
            f"ZeRO-{now['zero_stage'] or 0}: DeepSpeed's per-rank states do not load under another layout. Rerun "
            f"with the same layout (stages.{self.name}.num_processes={old.get('world_size')}, or --num-processes / "
            f"the number of GPUs and nodes it had), or delete {self.checkpoints} to start the stage over")

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
        tmp = staging_path(final)
        try:
            if self.is_main:
                staging_dir(final)
            self.state.wait_for_everyone()
            write(tmp)
            self.state.wait_for_everyone()
            if self.is_main:
                publish_dir(tmp, final)
        except BaseException as exc:
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            written = 0
            if full and self.is_main:
                with contextlib.suppress(OSError):
                    written = tree_bytes(tmp)
            if self.is_main:  # no half-written staging directory is left behind (e.g. a full disk)
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise disk_full(exc, final, written) from exc
            raise
        self.state.wait_for_everyone()
        if self.is_main:
            self.extra_manifest.setdefault("output_digests", {})[name] = output_digest(final)

    def save_trainer_model(self, trainer, tokenizer) -> None:
        """Consolidated HF checkpoint (ZeRO-3 gathered) + tokenizer, atomically as model/; with LoRA the adapters and
        the name of their base (`models.ADAPTER_BASE`), or with `lora.merge` (or a base built here, which no later
        stage could load) the adapters merged in."""

        def write(path: Path) -> None:
            model = trainer.model
            lora = getattr(self.cfg, "lora", None)
            adapters = hasattr(model, "merge_and_unload") and lora is not None and lora.enabled
            alone = adapters and not lora.merge and self.adapter_alone_suffices(model)
            if adapters:
                self.extra_manifest["lora_published"] = "adapter" if alone else "merged" if lora.merge else \
                    "merged: no loadable base, or the stage grew the embeddings (a template's new tokens)"
            if alone:
                trainer.save_model(str(path))  # peft: adapter_config.json and the adapter weights only
                if self.is_main:
                    self.write_adapter_base(path, model)
            elif adapters:
                from align.modeling.models import merged_for_saving  # heavy (torch): stage processes only

                # LoRA: save full merged weights so the next stage loads a plain model with from_pretrained.
                merged = merged_for_saving(trainer.accelerator.unwrap_model(model), self.cfg.lora,
                                          self.weights_dtype(frozen=True))
                if self.is_main:
                    merged.save_pretrained(path)
            else:
                trainer.save_model(str(path))
            if self.is_main:
                tokenizer.save_pretrained(path)

        self.publish("model", write)

    def adapter_alone_suffices(self, peft_model) -> bool:
        """Whether the adapters alone, on the model the stage loaded, give the trained model back: not when there is
        no loadable base (a builtin model built here) or the stage grew the embeddings (a chat template's new
        tokens: those rows are trained but not part of an adapter)."""
        return self.trained_from is not None and \
            peft_model.get_base_model().get_input_embeddings().num_embeddings == self.trained_vocab

    def write_adapter_base(self, path: Path, peft_model) -> None:
        """Beside a saved adapter: the model it was trained on (as this stage loaded it), its task, and the token ids
        the stage set on the model's config (EOS / PAD / BOS: a chat template's end-of-turn token, a pad token)."""
        from align.modeling.models import ADAPTER_BASE  # heavy (torch): stage processes only

        config = peft_model.peft_config[peft_model.active_adapter]
        task = getattr(config.task_type, "value", config.task_type)
        base = peft_model.get_base_model()
        ids = ("eos_token_id", "pad_token_id", "bos_token_id")
        record = {"base_model": self.trained_from, "task": task,
                  "config": {k: getattr(base.config, k, None) for k in ids},
                  "generation": {k: getattr(getattr(base, "generation_config", None), k, None) for k in ids}}
        (path / ADAPTER_BASE).write_text(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ manifest
    def note(self, **values: Any) -> None:
        """Record values in the manifest now, while the stage runs (e.g. a score normalisation's gain and bias, so a
        killed attempt's manifest still says what it fixed)."""
        self.extra_manifest.update(values)
        self.write_manifest("running", new_attempt=False)

    def write_manifest(self, status: str, new_attempt: bool = True, **extra: Any) -> None:
        if not self.is_main:
            return
        old: Manifest = read_manifest(self.dir) or {}
        attempts = old.get("attempts", 0) + (1 if status == "running" and new_attempt else 0)
        spec = self.spec
        manifest: Manifest = {  # type: ignore[typeddict-item]  (stages add keys of their own)
            "stage": self.name, "type": self.cfg.type, "status": status, "fingerprint": self.fingerprint,
            "config": spec.stage, "inputs": {k: {"path": v, "fingerprint": spec.input_fingerprints[k]}
                                             for k, v in self.inputs.items()},
            "input_digests": spec.input_digests, "data_cards": spec.data_cards, "code_version": spec.code_version,
            "git_commit": spec.git_commit, "packages": package_versions(),
            "started_at": old.get("started_at") if status != "running" or not new_attempt
            else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "attempts": attempts, "world_size": self.state.num_processes,
            "distributed_type": str(self.state.distributed_type).split(".")[-1],
            "zero_stage": int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
            if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") else None,
            "process": {"pid": os.getpid(), "host": socket.gethostname(),
                        "start": "warm" if os.environ.get("ALIGN_WARM_STAGE") == "1" else "fresh"},
            **self.extra_manifest, **extra,
        }
        if status != "running":
            manifest["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_manifest(self.dir, manifest)


def package_versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "transformers", "trl", "accelerate", "deepspeed", "peft", "datasets", "wandb"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


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
    terminate_as_interrupt()  # SIGTERM (a scheduler, the launcher stopping its workers) recorded as Ctrl-C is
    ctx: StageContext | None = None
    spec: dict[str, Any] = {}
    gc.disable()  # until the libraries are imported and the first model is loaded: see startup_done()
    try:
        raw = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        spec = raw if isinstance(raw, dict) else {}  # enough to record a failure in the manifest
        ctx = StageContext(StageSpec.parse(raw, spec_path))
        _run(ctx)
        return leave_process_group(0)
    except EXPECTED as exc:
        message = describe(exc)
        recorded = _record_failure(ctx, spec, message)
        print(f"align: error: stage '{spec.get('stage_name', spec_path)}': {message}" + recorded, file=sys.stderr,
              flush=True)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, or the runner passing one on: resumable, no traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the record short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        terminated = isinstance(exc, Terminated)
        _record_failure(ctx, spec, interrupt_cause(exc), status="interrupted")
        print(f"align: stage '{spec.get('stage_name', spec_path)}' {'stopped by SIGTERM' if terminated else 'interrupted'}"
              "; its last checkpoint is kept and the next `align run` resumes from it", file=sys.stderr, flush=True)
        return 143 if terminated else 130
    except Exception as exc:
        message = write_failure(exc, ctx.dir if ctx else Path(spec_path).parent)
        if message is None:
            _record_failure(ctx, spec, f"{type(exc).__name__}: {exc}")
            raise
        recorded = _record_failure(ctx, spec, message)
        print(f"align: error: stage '{spec.get('stage_name', spec_path)}': {message}" + recorded, file=sys.stderr,
              flush=True)
        return 2
    except BaseException as exc:
        _record_failure(ctx, spec, f"{type(exc).__name__}: {exc}")
        raise




def startup_done() -> None:
    """End the stage process's start-up window: the cyclic garbage collector, off since main() began, is turned
    back on, and what was imported so far is frozen out of its generations (never scanned again). Called when
    a stage loads its first model and when a Trainer's arguments are built, i.e. after the heavy imports
    (torch, transformers, trl, peft) and before training. Importing them with the collector on costs ~0.7 s
    per stage process (measured: 4.1-4.3 s vs 3.4-3.5 s to import torch, transformers and TRL's SFTTrainer,
    three runs each), nearly all of it collector passes over objects that live as long as the process. Frozen
    objects are still freed by reference counting when dropped; only a reference cycle among them would outlive
    its use, and what exists at this point (the libraries, the stage's first model) lives as long as the stage."""
    if not gc.isenabled():
        gc.enable()
        gc.freeze()


def leave_process_group(code: int) -> int:
    """The end of a process of a (possibly) multi-process job.

    1. Leave together: every process waits for the others, then tears the process group down. Without it a
       process that leaves while another is still in its last collective can die with SIGABRT ("terminate
       called without an active exception") in the communication library's threads.
    2. Then exit here and now, skipping interpreter teardown: even after the process group is destroyed, a
       communication thread (gloo / DeepSpeed's CPU shared-memory ops) can abort a rank at exit (seen in CI
       under 2-process ZeRO-3 after the manifest said completed), and the launcher then reports the stage as
       failed. Everything is written and flushed first; a one-process job returns `code` normally."""
    import torch.distributed as dist  # the stage process already imported torch

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    if resumable:
        ctx.check_checkpoint_layout()
    ctx.write_manifest("running")
    module = importlib.import_module(type(ctx.cfg).stage_module())
    ctx.start_tracking()
    t0 = time.perf_counter()
    final = {**module.run(ctx), **ctx.compute.resource_metrics(time.perf_counter() - t0)}
    startup_done()  # a stage that never loaded a model through the context
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
    # `datasets` reads these when it is first imported, so stages that never use it (the samplers) do not pay
    # ~0.5 s to import it here (measured with python -X importtime).
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        from datasets.utils import logging as ds_logging

        ds_logging.set_verbosity_error()
        ds_logging.disable_progress_bar()
    from transformers.utils import logging as tf_logging  # heavy: stage processes only

    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    for name in ("deepspeed", "DeepSpeed", "accelerate", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)


def check_produced(ctx: StageContext, outputs: list[str], final: dict[str, Any]) -> None:
    """A stage whose work metric (declared by its config class: optimiser steps, iterations, prompts evaluated) is
    0, or that published nothing, has failed."""
    work = type(ctx.cfg).WORK
    if work and final.get(work) == 0:
        raise StageError(f"stage '{ctx.name}' did no work: {work} is 0")
    bad = [k for k, v in final.items() if isinstance(v, float) and not math.isfinite(v)
           and any(w in k for w in ("loss", "margin", "accuracy", "rewards/"))]
    if bad:  # the training-loss guard watches each step; a diverged model can still end with a NaN eval
        raise StageError(f"stage '{ctx.name}': {', '.join(f'{k} = {final[k]}' for k in bad)}: the model diverged "
                         f"(non-finite numbers); lower stages.{ctx.name}.learning_rate (or the stage's beta / "
                         "scale settings) and rerun it")
    for out in outputs:
        path = ctx.dir / out
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            raise StageError(f"stage '{ctx.name}' produced nothing: {path.resolve()} is missing or empty")


# Failures that are the input's or the machine's fault, not align's: one paragraph, exit code 2.
EXPECTED: tuple[type[BaseException], ...] = (OSError, ValueError, NonFiniteLossError, StageError, EngineError)


def _record_failure(ctx: StageContext | None, spec: dict[str, Any], message: str, status: str = "failed") -> str:
    """Write `failed` (or `interrupted`) with the error into the manifest; returns where it went (or why it
    could not). Either status resumes from the stage's last checkpoint on the next run of the same config."""
    trace = traceback.format_exc(limit=20)
    try:
        if ctx is not None:
            if ctx.tracker:
                ctx.tracker.finish()
            ctx.write_manifest(status, error=message, traceback=trace)
        elif spec.get("stage_dir") and os.environ.get("RANK", "0") == "0":
            write_manifest(spec["stage_dir"], {
                "stage": spec.get("stage_name"), "status": status, "fingerprint": spec.get("fingerprint"),
                "error": message, "traceback": trace, "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        else:
            return ""
    except Exception as second:  # e.g. the disk is still full: say so rather than hide the first error
        return f"\n  (could not record the failure in the manifest either: {describe(second)})"
    where = ctx.dir if ctx is not None else spec["stage_dir"]
    return f"\n  manifest: {Path(where) / MANIFEST} (status {status}, traceback inside)"


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)

