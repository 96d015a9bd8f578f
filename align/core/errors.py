"""Errors that both the orchestrator and the stage processes raise, in a module that imports nothing of align (so
that torch-free code, e.g. align/templates, can raise them without importing align/modeling/models.py)."""

import errno
import os


class PipelineError(ValueError):
    """The pipeline cannot run as configured, or a stage failed: the orchestrator's refusal (exit code 2)."""


class ModelError(ValueError):
    """A model or tokenizer cannot be used as configured; the message says how to fix it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit or preemption, `systemctl stop`, `kill`), handled as Ctrl-C is: the stage
    records itself `interrupted` (resumable) and the resume command is printed; the CLI exits with 143."""


INTERRUPTED = "interrupted (Ctrl-C or SIGINT)"
TERMINATED = "interrupted (SIGTERM: stopped from outside, e.g. a scheduler's time limit or preemption)"


def interrupt_cause(exc: BaseException) -> str:
    """What a manifest records of an interrupted stage: Ctrl-C / SIGINT, or SIGTERM (`Terminated`)."""
    return TERMINATED if isinstance(exc, Terminated) else INTERRUPTED


def terminate_as_interrupt() -> None:
    """From now on SIGTERM raises Terminated in the main thread, as Ctrl-C raises KeyboardInterrupt."""
    import signal

    def handler(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> bool:
    """Linux: have the kernel send this process SIGTERM when the process that started it dies (prctl
    PR_SET_PDEATHSIG). A stage's processes must not outlive the run: torchrun (accelerate launch) starts its workers
    in sessions of their own, so a SIGKILL of `align run`'s process group left 2-process stages training (and their
    vLLM engines sampling) until they next wrote to their dead pipe, over 30 s later in 2-process ZeRO-3 PPO. With
    terminate_as_interrupt the stage records `interrupted` and the next run resumes. Returns whether it is set."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM)) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:  # the parent died before the call: nobody will signal
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def dies_with_this_process():
    """For `subprocess.Popen(preexec_fn=...)`: the child is sent SIGTERM when this process dies (prctl
    PR_SET_PDEATHSIG, set in the child between fork and exec). `align run` starts each stage's launcher so: a SIGKILL
    of the runner alone (`kill -9 PID`, which signals no process group) releases the run's lock, and a launcher that
    lived on would keep training beside the next `align run` of the same stage. None off Linux. prctl is looked up
    here, before the fork; the child only calls it (the signal follows the forking thread: call Popen from the thread
    that waits for the child)."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)
    return lambda: prctl(1, term)  # 1 = PR_SET_PDEATHSIG


TOKENIZER_SAVE_FIX = "copy the tokenizer again, or save it with tokenizer.save_pretrained(<dir>)"
"""The fix for a tokenizer whose files are damaged, named where they are read (validation, the helper process)."""


def describe(exc: BaseException) -> str:
    """One line for an expected failure; an OSError names its path and the cause (e.g. a full disk)."""
    if isinstance(exc, OSError) and exc.strerror:
        code = errno.errorcode.get(exc.errno or 0, "")
        where = f"{os.path.abspath(exc.filename)}: " if exc.filename else ""
        return f"{where}{exc.strerror}" + (f" ({code})" if code else "")
    return f"{type(exc).__name__}: {exc}"


class Interrupted(PipelineError):
    """Ctrl-C (or SIGTERM) during a stage: the stage is recorded as interrupted (resumable); the CLI exits with 130
    (143 after SIGTERM)."""

    def __init__(self, message: str, terminated: bool = False):
        super().__init__(message)
        self.terminated = terminated


FAILED_RANK = "failed.rank{}.json"
"""A stage process other than the main one records its failure here, in the stage's directory: only the main process
writes the manifest, and the launcher then stops it with SIGTERM (or a collective fails under it, or it is
SIGKILLed mid-CUDA call), none of which says why (align/runtime/process.py; the runner reads it too)."""


def recorded_failure(stage_dir, since: float | None = None) -> str | None:
    """The failure a stage process other than the main one recorded (FAILED_RANK), as "process R: error", of those
    written at `since` (a time.time()) or later when given; None when none."""
    import json
    from pathlib import Path

    for path in sorted(Path(stage_dir).glob(FAILED_RANK.format("*"))):
        try:
            if since is not None and path.stat().st_mtime < since:
                continue
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("error"):
            return f"process {path.name.split('.')[1].removeprefix('rank')}: {rec['error']}"
    return None
