"""The commands the runner's messages tell a user to type: the command line as typed resumes a run (its --run-id and
overrides kept, less --force and --from, which would restart what is done), and a damaged stage reruns with `--from`
added to it; what a killed stage's exit code means (`exit_meaning`)."""

from __future__ import annotations

import contextvars
import json
import resource
import shlex
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from align.core.rundir import PIPELINE

_RESUME: contextvars.ContextVar[str | None] = contextvars.ContextVar("resume", default=None)


@contextmanager
def resume_as(command: str) -> Iterator[None]:
    """Within it, the runner's messages tell the user to resume with `command` (the CLI passes the command line as
    it was typed: a run started with --run-id or overrides resumes only with them)."""
    token = _RESUME.set(command)
    try:
        yield
    finally:
        _RESUME.reset(token)


def resume_command(source: str | Path) -> str:
    """The command that resumes this run: the one typed (resume_as), else `align run SOURCE`."""
    return _RESUME.get() or f"align run {source}"


def run_command(run_dir: str | Path, source: str | Path, run_id: str) -> str:
    """The command pipeline.json records as the run's own (`align status` builds its resume and rerun hints on it):
    the one typed when it is an `align run`; else (`align report` rebuilt the report) the one recorded before, or
    `align run SOURCE --run-id ID` (a report's command recorded there sent later reruns to another run)."""
    typed = resume_command(source)
    if typed.startswith("align run "):
        return typed
    try:
        before = json.loads((Path(run_dir) / PIPELINE).read_text(encoding="utf-8")).get("resume")
    except (OSError, ValueError, AttributeError):
        before = None
    return recorded_run(before, source, run_id)


def other_source(run_dir: str | Path, source: str | Path) -> str | None:
    """A warning when the run directory was last run from another pipeline file with the same `name:` (a copy of
    a shipped pipeline, edited): its stages are taken over, those whose settings differ retrained in place."""
    try:
        before = json.loads((Path(run_dir) / PIPELINE).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    now = str(Path(source).resolve())
    if not isinstance(before, str) or before == now:
        return None
    return (f"warning: {run_dir} was last run from {before}; this run is from {now} (the same name: "
            f"{Path(run_dir).parent.name}): stages with the same settings are reused, the others are retrained in "
            "place. To keep both runs, give this pipeline its own `name:` or a --run-id")


def recorded_run(recorded: object, source: str | Path, run_id: object) -> str:
    """A run's own command from its pipeline.json `resume` when that is an `align run`, else `align run SOURCE
    --run-id ID` (a record from before align kept the command). Its --run-id is `run_id`: a run directory copied
    or renamed (`cp -a runs/p/r1 runs/p/r1copy`) keeps the command typed for the original, which would retrain that
    one (or, after a move, start an empty run) instead of this."""
    if not (isinstance(recorded, str) and recorded.startswith("align run ")):
        return shlex.join(["align", "run", str(source), "--run-id", str(run_id)])
    args = shlex.split(recorded)
    at = next((i for i, a in enumerate(args) if a == "--run-id" or a.startswith("--run-id=")), None)
    if at is None:
        return shlex.join([*args, "--run-id", str(run_id)])
    given = args[at].partition("=")[2] or (args[at + 1] if at + 1 < len(args) else "")
    if given == str(run_id):
        return recorded
    return shlex.join([*args[:at], "--run-id", str(run_id), *args[at + (1 if "=" in args[at] else 2):]])


def rerun_from(source: str | Path, name: str, typed_command: str | None = None) -> str:
    """The command that reruns stage `name` and what follows it in this run: the typed `align run` (its --run-id and
    overrides; `typed_command`, else resume_command) with --only dropped and `--from name` added."""
    typed = typed_command or resume_command(source)
    if not typed.startswith("align run "):  # `align report ...`: the run's pipeline file instead
        typed = shlex.join(["align", "run", str(source)])
    return shlex.join([*shlex.split(without_only(typed)), "--from", name])


def without_only(command: str, keep: str | None = None) -> str:
    """`command` less its --only (which names one stage: a resume or a rerun of another must not keep it), unless it
    names `keep`."""
    args = shlex.split(command)
    named = [a.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "") for i, a in enumerate(args)
             if a == "--only" or a.startswith("--only=")]
    if keep is not None and named == [keep]:
        return command
    return shlex.join([a for i, a in enumerate(args) if a != "--only" and (i == 0 or args[i - 1] != "--only")
                       and not a.startswith("--only=")])


def resume_args(argv: list[str]) -> list[str]:
    """The command line that resumes this run: without --force and --from, which restart what they name (a stage
    they forced is interrupted or completed by the time a message shows this, and an interrupted one resumes
    unasked; what ran after it is stale by its inputs' digests and reruns anyway). A forced stage stopped before it
    began still reads `completed`: the runner's message names it with `rerun_from` instead."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--from":
            skip = True
        elif a != "--force" and not a.startswith("--from="):
            out.append(a)
    return out


def children_peak_rss() -> int:
    """The largest peak resident memory (bytes) of any finished child process of the runner so far (Linux
    reports kilobytes); stage processes are waited for by their launcher, so they count."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def exit_meaning(rc: int, peak_before: int, source: str | Path) -> str:
    """What a stage's exit code says beyond "failed": a signal's name and its usual cause, and how to resume."""
    killed = -rc if rc < 0 else rc - 128 if rc > 128 else 0  # launchers report a child's signal as 128 + N
    if killed not in (signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS):
        return ""
    name = signal.Signals(killed).name
    peak = children_peak_rss()
    memory = (f"; the stage's processes peaked at {peak / 2**30:.1f} GiB resident" if peak > peak_before else "")
    cause = {signal.SIGKILL: "most often the kernel's out-of-memory killer (see `dmesg` or `journalctl -k`)"
                             f"{memory}: lower per_device_batch_size or max_length, enable "
                             "gradient_checkpointing or LoRA, or use a larger machine",
             signal.SIGTERM: "stopped from outside (a scheduler's time limit or preemption, or kill)"}.get(
        signal.Signals(killed), "the process crashed (a bug in a native library, or a damaged install)")
    return (f"\n  {name}: {cause}.\n  resume: {resume_command(source)} (the stage restarts from its last "
            "checkpoint, if it saved one)")
