"""The stage process itself: `align stage SPEC` (what `accelerate launch` starts, or the warm server forks) reads the
spec, builds the StageContext (align/runtime/context.py), runs the stage type's `run(ctx)`, checks that it produced
what it declares, and records the outcome in the manifest: completed, failed (with the error and traceback) or
interrupted. Expected failures are one line on the console, never a traceback.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from align.core.tracking import TABLES, table_file
from align.engines import EngineError
from align.core.errors import (FAILED_RANK, Terminated, describe, die_with_parent, interrupt_cause, recorded_failure,
                               terminate_as_interrupt)
from align.core.console import verbose
from align.core.fsutil import atomic_write_json, write_failure
from align.core.rundir import MANIFEST, StageSpec, hold_stage, read_manifest, write_manifest
from align.data.hub import pin_to_run
from align.runtime.context import COLLECTIVE_TIMEOUT, NonFiniteLossError, StageContext, StageError, startup_done

log = logging.getLogger("align")

def long_group_timeouts() -> None:
    """Every process group made in this process without a timeout of its own waits COLLECTIVE_TIMEOUT, as the
    default group does: torch gives such a group its backend's default instead (10 minutes under NCCL), and
    DeepSpeed makes ZeRO-3's (its clone of the world group, every gather and reduce-scatter) so. A main process
    removing an old checkpoint from a slow shared filesystem for longer than that while the others wait in a
    ZeRO-3 gather would otherwise stop the job."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = COLLECTIVE_TIMEOUT
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), datetime.timedelta):  # None without NCCL
        c10d.default_pg_nccl_timeout = COLLECTIVE_TIMEOUT


def no_cpu_shm_op() -> None:
    """Under DeepSpeed on a machine without CUDA (the CPU twin of a GPU job, over gloo), DeepSpeed's first collective
    compiles a C++ shared-memory op (deepspeed_shm_comm: about 60 s of both cores on a 2-core machine, and a C++
    compiler required) that only its inference all-reduce calls; training never does. It is marked unavailable, which
    also skips DeepSpeed's probe of every op (compiler subprocesses); comm/torch.py is the only reader of the list.
    Where CUDA is present nothing changes (DeepSpeed's CUDA accelerator has no such op)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        return
    import torch  # the stage process imports it anyway

    if not torch.cuda.is_available():
        import deepspeed.ops

        vars(deepspeed.ops)["__compatible_ops__"] = {}


def main(spec_path: str) -> int:
    """Run one stage in this process (called under `accelerate launch`). Returns the exit code: 0; 2 for a refused
    input or an I/O failure (one paragraph on stderr, the traceback only in the manifest); 130 / 143 when Ctrl-C /
    SIGTERM stopped it (recorded `interrupted`, resumable)."""
    logging.basicConfig(level=logging.INFO if verbose() else logging.WARNING,
                        format="[align] %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    quiet_libraries()
    terminate_as_interrupt()  # SIGTERM (a scheduler, the launcher stopping its workers) recorded as Ctrl-C
    die_with_parent()  # and SIGTERM when the launcher dies (a SIGKILLed run): no stage outlives its run
    long_group_timeouts()
    no_cpu_shm_op()
    pin_to_run()  # hub datasets: the commits the run's plan resolved, not what a branch names by now
    ctx: StageContext | None = None
    spec: dict[str, Any] = {}
    gc.disable()  # until the libraries are imported and the first model is loaded: see startup_done()
    try:
        raw = json.loads(Path(spec_path).read_text(encoding="utf-8"))
        spec = raw if isinstance(raw, dict) else {}  # enough to record a failure in the manifest
        hold_stage(Path(spec_path).parent)  # until this process ends: no runner starts the stage again meanwhile
        ctx = StageContext(StageSpec.parse(raw, spec_path))
        _run(ctx)
        return leave_process_group(0)
    except EXPECTED as exc:
        if isinstance(exc, BrokenPipeError) and output_gone(sys.stdout):  # the runner is gone (SIGKILL, SIGHUP)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to say to anyone
            os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
            _record_failure(ctx, spec, "the run's runner is gone (its output pipe closed)", status="interrupted")
            return 143
        message = describe(exc)
        recorded = _record_failure(ctx, spec, message)
        print(f"align: error: stage '{spec.get('stage_name', spec_path)}': {message}" + recorded, file=sys.stderr,
              flush=True)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, or the runner passing one on: resumable, no traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the record short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        terminated = isinstance(exc, Terminated)
        if terminated and (other := rank_failure(ctx)):  # the launcher stopped us because another process failed
            print(f"align: error: stage '{spec.get('stage_name', spec_path)}': {other}"
                  + _record_failure(ctx, spec, other), file=sys.stderr, flush=True)
            return 2
        recorded = _record_failure(ctx, spec, interrupt_cause(exc), status="interrupted")
        print(f"align: stage '{spec.get('stage_name', spec_path)}' {'stopped by SIGTERM' if terminated else 'interrupted'}"
              + _after_stop(ctx, recorded), file=sys.stderr, flush=True)
        return 143 if terminated else 130
    except Exception as exc:
        message = write_failure(exc, ctx.dir if ctx else Path(spec_path).parent)
        if message is None and (other := rank_failure(ctx)):  # a collective failed under us: the cause is theirs
            message = f"{other} (then this process: {type(exc).__name__}: {str(exc).strip()[:200]})"
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




def _after_stop(ctx: StageContext | None, recorded: str) -> str:
    """The end of a stopped stage's last line: it had completed (`recorded` says the manifest stays so), or it
    resumes."""
    if getattr(ctx, "completed", False):
        return recorded
    return "; its last checkpoint is kept and the next `align run` resumes from it"


def output_gone(stream) -> bool:
    """Whether nobody reads `stream` any more: a pipe whose reading end closed (the runner that started this stage
    was SIGKILLed or lost its terminal; a warm-started stage then fails its next print with EPIPE before the
    death signal arrives). Resumable, as a SIGTERM is, not a failure."""
    import select

    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # closed, or not a real file
        return False


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


def drop_checkpoints(ctx: StageContext) -> None:
    """A completed stage's training checkpoints removed (by each node's first process; the run directory is on a
    filesystem every node sees, README) unless the pipeline keeps them (`keep_checkpoints`): only an interrupted attempt
    resumes from them. Once every process is past the main process's writing the stage completed: another node's
    first process must not remove what a completion that fails or is interrupted (W&B's finish, a full disk, the
    job's time limit) would resume from."""
    if ctx.pipeline.keep_checkpoints:
        return
    ctx.state.wait_for_everyone()
    if ctx.state.is_local_main_process:
        shutil.rmtree(ctx.checkpoints, ignore_errors=True)


def resumes(old: dict | None, fingerprint: str, input_digests: dict) -> bool:
    """Whether this attempt resumes the stage's checkpoints: only an interrupted attempt of this very fingerprint
    whose inputs were the same published outputs (an upstream stage retrained with the same settings since, e.g.
    `--only <it> --force`, made checkpoints of a policy trained from the old model: they start clean)."""
    return (bool(old) and old.get("fingerprint") == fingerprint and old.get("status") != "completed"
            and (old.get("input_digests") or {}) == (input_digests or {}))


def _run(ctx: StageContext) -> None:
    resumable = resumes(read_manifest(ctx.dir), ctx.fingerprint, ctx.spec.input_digests)
    if ctx.is_main:  # an earlier attempt's (before the barrier: this attempt's processes record theirs after it)
        for path in ctx.dir.glob(FAILED_RANK.format("*")):
            path.unlink(missing_ok=True)
    if ctx.is_main and not resumable:
        shutil.rmtree(ctx.checkpoints, ignore_errors=True)
        for name in ("metrics.jsonl", *map(table_file, TABLES)):
            if (ctx.dir / name).exists():
                os.replace(ctx.dir / name, ctx.dir / f"{name}.prev")
    ctx.state.wait_for_everyone()
    if resumable:
        ctx.check_checkpoint_layout()
    ctx.write_manifest("running")
    module = importlib.import_module(type(ctx.cfg).stage_module())
    ctx.start_tracking(resume=resumable)
    t0 = time.perf_counter()
    final = {**module.run(ctx), **ctx.compute.resource_metrics(time.perf_counter() - t0)}
    startup_done()  # a stage that never loaded a model through the context
    ctx.state.wait_for_everyone()
    check_produced(ctx, module.OUTPUTS, final)
    if ctx.tracker:
        ctx.tracker.summary(final)
    wandb_info = ctx.tracker.finish() if ctx.tracker else {}
    ctx.write_manifest("completed", final_metrics=final, outputs=module.OUTPUTS, wandb=wandb_info)
    ctx.completed = True
    drop_checkpoints(ctx)
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
           and any(w in k for w in type(ctx.cfg).DIVERGED)]
    if bad:  # the training-loss guard watches each step; a diverged model can still end with a NaN eval
        raise StageError(f"stage '{ctx.name}': {', '.join(f'{k} = {final[k]}' for k in bad)}: the model diverged "
                         f"(non-finite numbers); lower stages.{ctx.name}.learning_rate (or the stage's beta / "
                         "scale settings) and rerun it")
    for out in outputs if ctx.is_main else ():  # the main process published them (another node's view may lag)
        path = ctx.dir / out
        if not path.exists() or (path.is_dir() and not any(path.iterdir())):
            raise StageError(f"stage '{ctx.name}' produced nothing: {path.resolve()} is missing or empty")


# Failures that are the input's or the machine's fault, not align's: one paragraph, exit code 2.
EXPECTED: tuple[type[BaseException], ...] = (OSError, ValueError, NonFiniteLossError, StageError, EngineError)


def rank_failure(ctx: StageContext | None) -> str | None:
    """Main process: the failure another process of this attempt recorded (core/errors.py FAILED_RANK), as
    "process R: error"; None when none did (earlier attempts' are removed as an attempt starts: `_run`)."""
    return recorded_failure(ctx.dir) if ctx is not None and ctx.is_main else None


def _record_failure(ctx: StageContext | None, spec: dict[str, Any], message: str, status: str = "failed") -> str:
    """Write `failed` (or `interrupted`) with the error into the manifest; returns where it went (or why it
    could not). Either status resumes from the stage's last checkpoint on the next run of the same config. A
    process other than the main one records its failure for the main one (FAILED_RANK)."""
    if getattr(ctx, "completed", False):  # a teardown stopped or failing after completion (dropping checkpoints, the
        # process group's last barrier) must not turn the stage back into one to resume, its checkpoints maybe gone
        return "\n  (after the stage had completed: its manifest stays completed, and the next run skips it)"
    trace = traceback.format_exc(limit=20)
    if ctx is not None and not ctx.is_main and status == "failed":
        try:
            atomic_write_json(ctx.dir / FAILED_RANK.format(ctx.state.process_index), {"error": message})
        except (OSError, ValueError):
            pass
    try:
        if ctx is not None:  # the manifest first: a W&B that cannot close must not keep the failure unrecorded
            ctx.write_manifest(status, error=message, traceback=trace, wandb=ctx.tracker.info() if ctx.tracker else {})
            if ctx.tracker:
                ctx.tracker.finish(failed=True)
        elif spec.get("stage_dir") and os.environ.get("RANK", "0") == "0":
            write_manifest(spec["stage_dir"], {  # with the inputs it was to read: `resumes` compares them
                "stage": spec.get("stage_name"), "status": status, "fingerprint": spec.get("fingerprint"),
                "input_digests": spec.get("input_digests") or {},
                "error": message, "traceback": trace, "ended_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        else:
            return ""
    except Exception as second:  # e.g. the disk is still full: say so rather than hide the first error
        return f"\n  (could not record the failure in the manifest either: {describe(second)})"
    where = ctx.dir if ctx is not None else spec["stage_dir"]
    return f"\n  manifest: {Path(where) / MANIFEST} (status {status}, traceback inside)"


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
