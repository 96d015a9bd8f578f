"""Fault injection for the test suite: the one place production code asks whether a test wants a failure.

Each switch is an environment variable the tests set (never a pipeline setting); unset, every hook answers "no
fault" and costs one dictionary lookup. The hooks and their callers:

    ALIGN_INJECT_OSERROR=CODE:SUBSTRING   oserror(path)             align/core/fsutil.py (every crash-safe write),
                                                                    align/orchestrator/runlock.py (the run's lock)
    ALIGN_INJECT_NAN_AT_STEP=N            nan_loss(step)            align/runtime/trl.py (TRL stages' loss log)
    ALIGN_TEST_EOS_FIRST_RANKS=0,1        eos_processor(rank, eos)  align/engines/hf.py (the hf engine's sampling)
    ALIGN_TEST_EOS_NEVER_RANKS=1

Torch-free (fsutil is the orchestrator's too).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

OSERROR_ENV = "ALIGN_INJECT_OSERROR"
NAN_STEP_ENV = "ALIGN_INJECT_NAN_AT_STEP"
EOS_RANKS_ENV = "ALIGN_TEST_EOS_{mode}_RANKS"


def oserror(path: str | Path) -> None:
    """Raise the OSError that ALIGN_INJECT_OSERROR=CODE:SUBSTRING asks for when `path` contains SUBSTRING (e.g.
    `ENOSPC:/model`), at the point a real full disk would make the write fail."""
    spec = os.environ.get(OSERROR_ENV)
    if not spec:
        return
    code, _, pattern = spec.partition(":")
    if pattern in os.path.abspath(path):
        number = getattr(errno, code, errno.EIO)
        raise OSError(number, os.strerror(number), str(path))


def nan_loss(step: int) -> bool:
    """Whether the loss logged at `step` is to read NaN (ALIGN_INJECT_NAN_AT_STEP=N: from step N on)."""
    at = os.environ.get(NAN_STEP_ENV)
    return bool(at) and step >= int(at)


def eos_mode(rank: int) -> str | None:
    """"first" for the ranks in ALIGN_TEST_EOS_FIRST_RANKS (every response ends at once), "never" for those in
    ALIGN_TEST_EOS_NEVER_RANKS (every response runs to the length limit), else None: uneven generation lengths
    across ranks, which must not hang a collective (tests/test_distributed.py)."""
    for mode in ("first", "never"):
        if str(rank) in os.environ.get(EOS_RANKS_ENV.format(mode=mode.upper()), "").split(","):
            return mode
    return None


def eos_processor(rank: int, eos_token_id: int):
    """A logits processor that forces eos_mode(rank) on sampling, or None (no fault asked for)."""
    mode = eos_mode(rank)
    return None if mode is None else EOSOverride(eos_token_id, mode)


class EOSOverride:
    """`first` makes every response end at its first token; `never` forbids EOS, so every response runs to
    max_new_tokens."""

    def __init__(self, eos_token_id: int, mode: str):
        self.eos, self.mode = eos_token_id, mode

    def __call__(self, input_ids, scores):  # tensors' own methods: this module imports no torch
        if self.mode == "first":
            out = scores.new_full(scores.shape, float("-inf"))
            out[:, self.eos] = 0.0
            return out
        scores = scores.clone()
        scores[:, self.eos] = float("-inf")
        return scores
