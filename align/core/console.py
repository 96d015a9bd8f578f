"""What a person sees while a pipeline runs, and what goes to each stage's `stage.log`.

A stage process prints whatever its libraries print; the runner reads it line by line:

- progress events (lines that start with PROGRESS, written by `emit_progress` in the stage's main process)
  drive one progress bar per stage on the console, with the stage's key metrics (loss / reward / KL / eta),
  and are written to stage.log as plain periodic lines;
- every other line goes to stage.log only, as plain text: carriage-return bar frames are reduced to their
  last frame, and a line seen before is counted instead of written again (the counts close the log);
- `--verbose` (ALIGN_VERBOSE=1) streams everything to the console as it comes, as before.

This module imports no torch: the runner uses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

from tqdm.auto import tqdm

from align.core.errors import Terminated
from align.core.fsutil import free_space_note


class StageProcess(Protocol):
    """A started stage as the runner waits for it: `subprocess.Popen`, or align/orchestrator/warm.py's WarmStage."""

    stdout: BinaryIO | None

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


PROGRESS = "\x1e[align-progress] "
LOG_EVERY_S = 30.0  # a progress line in stage.log at most this often (and at 0%, every 10% and 100%)


def emit_progress(n: int, total: int, **metrics: float) -> None:
    """Stage side: report `n` of `total` units done, with a few metrics for the bar (main process only)."""
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items() if v is not None}
    sys.stdout.write(PROGRESS + json.dumps({"n": int(n), "total": int(total), "metrics": shown}) + "\n")
    sys.stdout.flush()


def verbose() -> bool:
    return os.environ.get("ALIGN_VERBOSE") == "1"


class StageConsole:
    """Runner side: one stage's output, split between the console bar and stage.log."""

    def __init__(self, name: str, log: BinaryIO, stream_all: bool):
        self.name, self.log, self.stream_all = name, log, stream_all
        self.seen: Counter[str] = Counter()
        self.bar = None
        self.last_logged = (-1.0, -1)  # (time, decile)
        self.pending = b""

    def feed(self, chunk: bytes) -> None:
        if self.stream_all:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for raw in lines:
            self._line(raw)

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = b""
        if self.bar is not None:
            self.bar.close()
        repeated = [(text, n) for text, n in self.seen.items() if n > 1]
        if repeated:
            self._write(REPEATED)
            for text, n in sorted(repeated, key=lambda t: -t[1]):
                self._write(f"  x{n}: {text[:300]}")
        self.log.flush()

    # ------------------------------------------------------------------ internals
    def _write(self, text: str) -> None:
        """One line into stage.log, flushed at once: `tail -f stage.log` follows the stage, and a full disk shows at
        the first line that does not fit, not at the end of the stage."""
        self.log.write(text.encode("utf-8", "replace") + b"\n")
        self.log.flush()

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").split("\r")
        text = next((t for t in reversed(text) if t.strip()), "").rstrip()  # last frame of a \r-redrawn bar
        if text.lstrip("\x1e").startswith(PROGRESS.lstrip("\x1e")):
            self._progress(text.split("] ", 1)[1])
            return
        if not text:
            return
        self.seen[text] += 1
        if self.seen[text] == 1:
            self._write(text)

    def _progress(self, payload: str) -> None:
        try:
            event: dict[str, Any] = json.loads(payload)
        except json.JSONDecodeError:
            return
        n, total, metrics = event["n"], max(1, event["total"]), event.get("metrics", {})
        if not self.stream_all:
            if self.bar is None:
                # On a terminal the bar redraws in place; into a file or pipe (CI, nohup) every redraw is a
                # new frame, so it redraws at most once a minute there, and once at the end.
                tty = sys.stderr.isatty()
                # A resumed stage's first event is past its checkpoint: the bar starts there (initial), so its
                # rate and time left count this attempt's steps only.
                self.bar = tqdm(total=total, desc=f"  {self.name}", dynamic_ncols=True, leave=True,
                                initial=max(0, n - 1), mininterval=0.5 if tty else 60.0, maxinterval=1e9,
                                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                           "[{elapsed}<{remaining}{postfix}]")
            self.bar.total = total
            self.bar.set_postfix(metrics, refresh=False)
            self.bar.update(n - self.bar.n)  # draws only when mininterval has passed
        now, decile = time.time(), int(10 * n / total)
        if now - self.last_logged[0] >= LOG_EVERY_S or decile != self.last_logged[1] or n >= total:
            shown = ", ".join(f"{k}={v}" for k, v in metrics.items())
            self._write(f"[align] progress {n}/{total}" + (f" ({shown})" if shown else ""))
            self.last_logged = (now, decile)


INTERRUPT_GRACE_S = 60
"""How long a stage has, after Ctrl-C, to record itself as interrupted before it is killed."""


def stream_stage(start: Callable[[], StageProcess], log_path: Path, name: str) -> int:
    """Start a stage process (`start`: e.g. `warm.start_stage`, its stdout and stderr on one pipe) once its log is
    open, and wait for it; its output goes through a StageConsole into `log_path`.

    The output is read and drawn on a helper thread while the main thread waits for the stage: Python delivers
    Ctrl-C to the main thread only, so the KeyboardInterrupt never lands inside the console's drawing (tqdm
    holds locks there; one left held would hang the runner's final `close`)."""
    log = open(log_path, "ab")
    try:
        rc = _follow(start, log, log_path, name)
    except BaseException:
        with contextlib.suppress(OSError):  # the error on its way out says more than a log that cannot be closed
            log.close()
        raise
    try:
        log.close()  # flushes what is left: on a full disk the first write to fail may be this one
    except OSError as exc:
        raise _log_failure(exc, log_path) from None
    return rc


def _follow(start: Callable[[], StageProcess], log: BinaryIO, log_path: Path, name: str) -> int:
    console = StageConsole(name, log, stream_all=verbose())
    proc = start()
    assert proc.stdout is not None
    errors: list[BaseException] = []
    reader = threading.Thread(target=_pump, args=(proc.stdout, console, errors), name=f"align-{name}-output",
                              daemon=True)
    reader.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt as exc:
        _stop_interrupted(proc, signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
        raise
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(timeout=10)  # the pipe ends when the stage (and whatever it started) does
        if not reader.is_alive():  # else a process the stage started still writes: leave the console to it
            try:
                console.close()
            except OSError as exc:  # its last flush into the log: e.g. the disk filled
                errors.append(exc)
    if errors:  # e.g. the log's disk filled: the stage ran to its end (its output drained), the log did not
        raise _log_failure(errors[0], log_path)
    return rc


def _log_failure(exc: BaseException, log_path: Path) -> BaseException:
    """A failed write to the stage's log as an error naming the log and its filesystem's free space (the OSError of
    a write to an open file carries no file name: a full disk read "No space left on device" and nothing else)."""
    if not isinstance(exc, OSError) or exc.filename:
        return exc
    return OSError(exc.errno, f"{exc.strerror or exc} while writing the stage's log ({free_space_note(log_path)}); "
                   "free space on that filesystem, then rerun the same command: completed stages are kept",
                   str(log_path))


def _pump(stream: BinaryIO, console: StageConsole, errors: list[BaseException]) -> None:
    """Feed the console until the pipe ends; if the console fails, keep draining (a stage blocked on a full pipe
    would never end) and hand the error to the main thread."""
    for chunk in iter(lambda: stream.read1(4096), b""):  # type: ignore[attr-defined]
        if errors:
            continue
        try:
            console.feed(chunk)
        except Exception as exc:  # re-raised by stream_stage once the stage has ended
            errors.append(exc)


def _stop_interrupted(proc: StageProcess, sig: int = signal.SIGINT) -> None:
    """After Ctrl-C (or SIGTERM): a terminal's Ctrl-C, or a scheduler's SIGTERM to the whole job, reached the stage
    too and it is recording itself as interrupted; a signal sent to the runner alone is passed on. The stage gets
    INTERRUPT_GRACE_S to finish; a second one, or the grace running out, kills it."""
    try:
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
        proc.wait(timeout=INTERRUPT_GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        proc.wait()


REPEATED = "[align] lines repeated in this stage's output (written once above):"


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a stage log, for the console when a stage fails: those before the summary of repeated lines
    the log closes with (the error comes before it; the summary alone said nothing of the failure)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    text = text[:max((i for i, line in enumerate(text) if line == REPEATED), default=len(text))]
    return "\n".join(f"    {line}" for line in text[-lines:])
