"""Crash-safe writes: a file or directory appears complete under its final name, or not at all."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write to a temp file beside `path`, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def staging_dir(final: str | Path) -> Path:
    """A fresh, empty sibling directory to build `final` in (leftovers of a killed attempt are removed)."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.staging")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Make the fully written `tmp` visible as `final` (replacing an older `final`) by renames only.

    A kill at any point leaves either the old complete `final`, no `final`, or the new complete one;
    never a partial directory under the final name.
    """
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)
