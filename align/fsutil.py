"""Crash-safe writes: a file or directory appears complete under its final name, or not at all; a write that
fails (a full disk, a read-only filesystem) leaves the previous file or directory and no temp file behind.

`ALIGN_INJECT_OSERROR=CODE:SUBSTRING` (e.g. `ENOSPC:/model`) is a fault-injection switch for tests, like
`ALIGN_INJECT_NAN_AT_STEP`: every write below to a path containing SUBSTRING fails with that errno, at the
point a real full disk would make it fail (after the temp file or staging directory exists).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any


def inject_fault(path: str | Path) -> None:
    """Raise the OSError that ALIGN_INJECT_OSERROR asks for when `path` matches (tests only)."""
    spec = os.environ.get("ALIGN_INJECT_OSERROR")
    if not spec:
        return
    code, _, pattern = spec.partition(":")
    if pattern in os.path.abspath(path):
        number = getattr(errno, code, errno.EIO)
        raise OSError(number, os.strerror(number), str(path))


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
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            inject_fault(path)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    _fsync_dir(path.parent)


def _remove(path: Path) -> None:
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


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


def staging_path(final: str | Path) -> Path:
    """Where `final` is built before `publish_dir` renames it into place: a hidden sibling."""
    final = Path(final)
    return final.with_name(f".{final.name}.staging")


def staging_dir(final: str | Path) -> Path:
    """A fresh, empty sibling directory to build `final` in (leftovers of a killed attempt are removed)."""
    tmp = staging_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        inject_fault(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Make the fully written `tmp` visible as `final` (replacing an older `final`) by renames only.

    A kill at any point leaves either the old complete `final`, no `final`, or the new complete one;
    never a partial directory under the final name.
    """
    tmp, final = Path(tmp), Path(final)
    try:
        fsync_tree(tmp)
        inject_fault(final)
    except BaseException:
        _remove(tmp)
        raise
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)  # put the previous output back
        _remove(tmp)
        raise
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def output_digest(root: str | Path) -> dict[str, str]:
    """Identity of one publication of a stage output (model/, data/, report/), recorded in its manifest and,
    through the spec, in the manifests of the stages that consume it.

    `content`: sha256 over every file's relative name and size, the full bytes of files up to 16 MiB
    (configs, tokenizers, pair files, the tiny models) and the first 1 MiB of larger ones (a safetensors
    header lists every tensor's name, dtype, shape and offset), so it stays cheap for multi-GB weights.
    `publication`: a random id drawn at publication. Downstream stages compare both, so a retrained stage
    reruns its dependants even when its new weights happen to be bit-identical or differ only inside a large
    file (conservative: a rerun, never a stale skip)."""
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        size = path.stat().st_size
        h.update(f"{path.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(path, "rb") as fh:
            h.update(fh.read() if size <= 16 << 20 else fh.read(1 << 20))
    return {"content": h.hexdigest()[:20], "publication": secrets.token_hex(8)}
