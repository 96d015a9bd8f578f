"""Checks that need torch, run for the orchestrator in a short helper process.

`align validate`, `align run` and `align estimate` never import torch: they plan, read cards and files, and launch.
What only a loaded tokenizer or a model class can tell (over-long examples after the chat template, the rendered
example per stage, LoRA targets and parameter counts on the meta device) runs in a
fresh Python process: `python -m align.orchestrator.helper module:function`, its keyword arguments as JSON on stdin. What the
function prints reaches the console as it is printed; its return value comes back as JSON; a refusal it raises
(a ValueError such as PipelineError or ConfigError) comes back as a PipelineError with the same message; a crash
comes back as a HelperError with the last lines of its traceback.

Importing torch and transformers costs the helper what it cost the orchestrator before (a few seconds on a CPU
machine), once per command, and only for pipelines that need it (a builtin model's tokenizer is trained by its
first stage: nothing to load at validation).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from align.core.errors import PipelineError
from align.core.fsutil import free_space_note, write_failure

REFUSED = 2  # exit code of a refusal: the message is in the result file


class HelperError(RuntimeError):
    """The helper process crashed (not a refusal): the message holds the end of its traceback."""


def call(target: str, /, timeout: float | None = None, helper_stdout: int | None = None, **kwargs: Any) -> Any:
    """Run `target` ("module:function") in a helper process with `kwargs`; return its result (JSON types).
    `target` is positional-only, so the function's own keyword arguments may use that name too. The helper's prints
    share this process's stdout (validation's length checks are part of its output), or go to the file descriptor
    `helper_stdout` (2: stderr, where a command's stdout is a value a script reads)."""
    with tempfile.TemporaryDirectory(prefix="align-helper-") as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.Popen([sys.executable, "-m", "align.orchestrator.helper", target, str(result)], stdin=subprocess.PIPE,
                                stdout=helper_stdout, stderr=subprocess.PIPE, text=True, env={**os.environ})
        try:
            _, err = proc.communicate(json.dumps(kwargs), timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        answer = json.loads(result.read_text(encoding="utf-8")) if result.is_file() else None
    if proc.returncode == 0 and answer is not None:
        return answer["result"]
    if proc.returncode == REFUSED and answer is not None:
        raise PipelineError(answer["error"])
    tail = "\n".join((err or "").strip().splitlines()[-12:])
    raise HelperError(f"{target} failed in its helper process (exit code {proc.returncode}):\n{tail}")


def _problem_writing(exc: OSError, where: Path) -> str:
    path = os.path.abspath(exc.filename) if exc.filename else str(where)
    return (f"{path}: {exc.strerror} while writing ({free_space_note(where)}); free space on that filesystem or point ALIGN_CACHE "
            "at one with room, then run the command again")


def _write_problem(exc: BaseException, where: Path) -> str | None:
    """One line for a write that failed (the disk full, quota, read-only); None for any other error."""
    if isinstance(exc, OSError):
        return _problem_writing(exc, where) if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else None
    return write_failure(exc, where)


def _main(argv: list[str]) -> int:
    """In the helper process: import the target, call it with the JSON keyword arguments from stdin."""
    import importlib

    target, result = argv
    module, _, function = target.partition(":")
    kwargs = json.loads(sys.stdin.read() or "{}")
    out = Path(result)
    try:
        value = getattr(importlib.import_module(module), function)(**kwargs)
    except ValueError as exc:  # PipelineError, ConfigError, EstimateError, ...: a refusal with its message
        out.write_text(json.dumps({"error": str(exc), "type": type(exc).__name__}), encoding="utf-8")
        sys.stdout.flush()
        return REFUSED
    except (OSError, RuntimeError) as exc:  # a full disk or a read-only directory while writing: one line, its path
        message = _write_problem(exc, Path(kwargs.get("target") or os.getcwd()))
        if message is None:
            raise
        out.write_text(json.dumps({"error": message, "type": type(exc).__name__}), encoding="utf-8")
        return REFUSED
    sys.stdout.flush()
    out.write_text(json.dumps({"result": value}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
