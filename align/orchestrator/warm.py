"""Warm starts: a one-process stage is forked from a server that has already imported its libraries.

A stage process spends most of its start importing torch, transformers, peft, datasets and TRL: 8-10 s on the
2-core CPU machine (AVX2, measured 2026-11-25 with `python -X importtime -m align.cli stage <spec>`), against
about 1 s of training in each stage of the default pipeline's tiny CPU run. `align run` therefore starts
Python's forkserver (`multiprocessing`) once, with those imports preloaded (align/runtime/preload.py), and forks
each one-process stage from it. The forked process runs the same entry point as a fresh one
(`align.cli stage <spec.json>`), with the runner's stage environment, working directory, stdout and stderr;
the runner sees an object with the parts of `subprocess.Popen` it uses.

Where a stage starts as a fresh process instead (`subprocess.Popen`, as before):
- stages launched through `accelerate launch` (several processes, DeepSpeed, multi-node): the launcher starts
  its own processes;
- machines with a GPU (a `/dev/nvidia*` or `/dev/kfd` device): a process that has initialised CUDA cannot
  fork safely, and there a stage's imports are a small share of its time;
- `ALIGN_WARM_START=0` in the environment (to compare, or to rule the fork out while debugging).

The server is started with the stage environment (`launch.stage_env()`), because some libraries read their
settings from the environment at import time (tqdm's TQDM_DISABLE, for one); each forked stage sets the same
environment again before it runs. This module imports no torch: the runner uses it.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

from align.core.errors import dies_with_this_process
from align.core.rundir import stage_lock_fd
from align.core.machine import has_gpu

PRELOAD = "align.runtime.preload"

_context: multiprocessing.context.ForkServerContext | None = None


def enabled() -> bool:
    """Whether one-process stages start warm on this machine (see the module docstring)."""
    if os.environ.get("ALIGN_WARM_START", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    return not has_gpu()


def start_stage(cmd: list[str], env: dict[str, str], warm_start: bool,
                stage_dir: str | None = None) -> subprocess.Popen | WarmStage:
    """Start a stage's command: forked from the warm server when asked and the command is the plain one-process
    entry point (`python -m align.cli stage <spec>`), else a fresh process; stdout and stderr on one pipe. A fresh
    process inherits a shared hold on `stage_dir`'s lock (`rundir.stage_lock_fd`) from its first instant: its
    imports take seconds before it holds its own (a forked one has done them)."""
    if warm_start and cmd[1:4] == ["-m", "align.cli", "stage"] and len(cmd) == 5:
        return WarmStage(cmd[4], env)
    held = stage_lock_fd(stage_dir) if stage_dir else None
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                pass_fds=() if held is None else (held,),
                                preexec_fn=dies_with_this_process())  # a SIGKILLed runner takes its stage along
    finally:
        if held is not None:
            os.close(held)  # the process holds its own copy; the runner none


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start(env: dict[str, str]) -> None:
    """Start the server (if it is not running): it imports the stage libraries in the background."""
    _server(env)


def _server(env: dict[str, str]) -> multiprocessing.context.ForkServerContext:
    """The forkserver, started on first use with `env` and the stage libraries imported."""
    global _context
    if _context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([PRELOAD])
        with _environment(env):  # the server process inherits os.environ as it is now
            forkserver.ensure_running()
        _context = ctx
    return _context


class WarmStage:
    """A stage process forked from the warm server, seen through the subset of `subprocess.Popen` that
    `console.stream_stage` uses: `stdout` (its stdout and stderr, one binary stream), `wait`, `send_signal`,
    `kill`, `pid`, `returncode`."""

    def __init__(self, spec: str, env: dict[str, str]):
        ctx = _server(env)
        read_fd, write_fd = os.pipe()
        out = multiprocessing.connection.Connection(write_fd, readable=False)  # passed to the child as an fd
        try:
            self._process = ctx.Process(target=_stage_main, args=(spec, env, os.getcwd(), out),
                                        name=f"align-stage-{os.path.basename(os.path.dirname(spec))}")
            self._process.start()
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            out.close()  # the child holds its own copy: the pipe ends when the stage (and its children) do
        self.stdout = open(read_fd, "rb")
        self.pid = self._process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"stage process {self.pid}", timeout or 0)
        self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stage_main(spec: str, env: dict[str, str], cwd: str, out: multiprocessing.connection.Connection) -> None:
    """In the forked process: the runner's pipe as stdout and stderr, the stage environment, then the same
    entry point as `python -m align.cli stage <spec>` (align.runtime.process.main)."""
    fd = out.fileno()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    out.close()
    # unbuffered, as PYTHONUNBUFFERED=1 makes a fresh stage process
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(env, ALIGN_WARM_STAGE="1")  # recorded in the manifest (process.start)
    os.chdir(cwd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C reaches the stage as in a fresh process
    # Exit handlers registered by the server's imports belong to the server: run in here, they would delete
    # what it shares with every stage (wandb's media directory, made at import, for one).
    atexit._clear()
    from align.runtime.process import main  # what `align.cli stage <spec>` calls

    try:
        code = main(spec)
    finally:
        atexit._run_exitfuncs()  # this stage's own; a forked process leaves through os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
