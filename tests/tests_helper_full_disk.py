"""A helper-process target for tests/test_faults.py: a save that finds the disk full."""

import errno
import os


def save(target: str) -> None:
    os.makedirs(target, exist_ok=True)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(target, "model.safetensors"))
