"""Crash-safe writes: a file or directory appears complete under its final name, or not at all; a write that
fails (a full disk, a read-only filesystem) leaves the previous file or directory and no temp file behind.

Every write below asks align/core/faults.py `oserror(path)` first, at the point a real full disk would make it fail
(after the temp file or staging directory exists): the tests' ALIGN_INJECT_OSERROR switch.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from align.core.faults import oserror


def fsync_dir(path: Path) -> None:
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
            oserror(path)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(path.parent)


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
        fsync_dir(Path(dirpath))


def _umask() -> int:
    try:  # Linux: read it without setting it (os.umask sets it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(root: Path) -> None:
    """Give every file under `root` the read/write bits the umask allows (0644 under the usual 022).
    transformers writes model.safetensors through a private temporary file, 0600 whatever the umask: a
    published model on a shared cluster filesystem was unreadable to the user's own group."""
    allowed = 0o666 & ~_umask()
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode) and (mode | allowed) != mode:
                os.chmod(path, stat.S_IMODE(mode) | allowed)


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
        oserror(tmp)
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def publish_dir(tmp: str | Path, final: str | Path) -> None:
    """Make the fully written `tmp` visible as `final` (replacing an older `final`) by renames only.

    A kill at any point leaves either the old complete `final`, no `final` (SIGKILL between the renames: the old one
    is `.<name>.old`, put back by the next publication before anything else), or the new complete one; never a
    partial directory under the final name.
    """
    tmp, final = Path(tmp), Path(final)
    try:
        umask_modes(tmp)
        fsync_tree(tmp)
        oserror(final)
    except BaseException:
        _remove(tmp)
        raise
    old = final.with_name(f".{final.name}.old")
    if old.exists() and not final.exists():  # a SIGKILL between an earlier publication's renames: put it back first
        os.replace(old, final)
    if old.exists():
        shutil.rmtree(old)
    try:  # a signal right after the first rename (SIGTERM is raised as an exception) puts the old output back too
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            os.replace(old, final)  # put the previous output back
        _remove(tmp)
        raise
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


_HASHED: dict[tuple, str] = {}  # (path, *file_stamp) -> sha256, within one process


def tree_bytes(root: str | Path) -> int:
    """Bytes of the files under `root` (0 when it is missing)."""
    root = Path(root)
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0


def disk_full(exc: OSError, target: str | Path, written: int) -> OSError:
    """A full disk while writing output `target`, restated with what it needed and what is free: the bytes
    written before it filled (a lower bound), the size of the output it replaces (its likely size) and the
    free space on that filesystem, and the fix."""
    target = Path(target)
    previous = tree_bytes(target)
    try:
        free = shutil.disk_usage(target.parent).free
    except OSError:
        free = None
    need = max(written, previous)
    text = (f"{os.strerror(errno.ENOSPC)}: writing {target.name}/ needs more than {size_text(written)} (written before "
            "the disk filled)" + (f", likely about {size_text(previous)} (the output it replaces)" if previous else "")
            + (f"; {size_text(free)} free there" if free is not None else "")
            + f". Free {'at least ' + size_text(need - free) + ' more ' if free is not None and need > free else ''}"
              "space (or move the run directory), then run again: what was published before is unchanged")
    return OSError(errno.ENOSPC, text, exc.filename or str(target))


def size_text(n: float) -> str:
    """Bytes as a reader takes them in: GiB from 1 GiB up, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def file_sha256(path: str | Path) -> str:
    """sha256 of a whole file, read in 4 MiB blocks; remembered for this process while its `file_stamp` stays the
    same (one `align run` verifies an input once however many stages consume it). Not by size and mtime alone: a
    file rewritten in place at its size with its mtime put back (`touch -r`) kept its old digest, which the verified
    cache then recorded under its new stamp."""
    key = (str(path), *file_stamp(path))
    if key not in _HASHED:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(4 << 20), b""):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def file_stamp(path: str | Path) -> list[int]:
    """What identifies a file's current bytes without reading them: size, mtime, ctime and inode. Any write to the
    file changes mtime and ctime; resetting mtime by hand (`touch -d`) still changes ctime, which nothing but the
    kernel sets; a replaced or copied file has a new inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def stamp(path: str | Path) -> str | None:
    """What identifies a file or directory named in a setting, for a fingerprint: a small file's sha256, a large
    one's (a .gguf checkpoint) and a directory's `tree_stamp`; None when nothing is there."""
    path = Path(path)
    if path.is_dir():
        return tree_stamp(path)
    if not path.is_file():
        return None
    if path.stat().st_size <= 8 << 20:
        return file_sha256(path)
    h = hashlib.sha256()
    _sample(path, "", h)
    return h.hexdigest()[:20]


SAMPLES = 64
"""Blocks of 64 KiB read at even steps between a file's first and last MiB (4 MiB in all, whatever its size)."""


def _sample(p: Path, name: str, h) -> None:
    """A file's name, size, first and last MiB, and SAMPLES blocks between them into `h`. The ends alone missed new
    weights at the same path whose ends were the old ones: safetensors stores tensors in name order, so a file's
    first MiB is its header and embeddings and its last the last layer's attention, which a merged MLP-only LoRA, or a
    fine-tune with frozen embeddings and attention, leaves as they were."""
    size = p.stat().st_size
    h.update(f"{name}\0{size}\0".encode())
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        inner = size - (2 << 20)
        for i in range(SAMPLES if inner > 0 else 0):
            fh.seek((1 << 20) + inner * i // SAMPLES)
            h.update(fh.read(64 << 10))
        if size > 1 << 20:
            fh.seek(max(1 << 20, size - (1 << 20)))
            h.update(fh.read(1 << 20))


def tree_stamp(root: str | Path) -> str:
    """What identifies a directory's files without reading all of them (a local model named in a setting, e.g. a
    pairwise judge's): a hash over every file's relative name, size, first and last MiB and blocks sampled between
    (`_sample`). The same on every node that holds a copy (no inode or time in it: a multi-node stage's fingerprint
    must agree), and new weights at the same path change it."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        _sample(p, p.relative_to(root).as_posix(), h)
    return h.hexdigest()[:20]


def output_digest(root: str | Path) -> dict[str, Any]:
    """Identity of one publication of a stage output (model/, data/, report/), recorded in its manifest and,
    through the spec, in the manifests of the stages that consume it.

    `files`: every file's relative name -> [size, sha256 of the whole file]; `content`: a hash over that list.
    `publication`: a random id drawn at publication. `stamps`: each file's stamp (`file_stamp`) when it was
    published. Downstream stages compare both ids, so a retrained stage reruns its dependants even when its new
    weights happen to be bit-identical. Every consumer checks the files on disk against them before it loads or
    skips (`output_problem`): a file whose stamp is unchanged is taken as verified without reading it (an 8B
    pipeline publishes ~60 GB: re-hashing it on every `align run` and `align status` took a minute); a changed
    stamp, or `align verify`, reads and hashes the whole file, so one flipped byte anywhere is found."""
    root = Path(root)
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    files = {p.relative_to(root).as_posix(): [p.stat().st_size, file_sha256(p)] for p in paths}
    content = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:20]
    return {"content": content, "publication": secrets.token_hex(8), "files": files,
            "stamps": {p.relative_to(root).as_posix(): file_stamp(p) for p in paths}}


def _stamp_cache(root: Path) -> Path:
    """Where the stamps of files verified after publication are kept: align's cache, one file per output directory
    (a check never writes into a run directory)."""
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24]
    return cache_root() / "verified" / f"{key}.json"


def output_problem(root: str | Path, recorded: dict[str, Any] | None, full: bool = False) -> str | None:
    """What differs between a published output on disk and the digest its manifest recorded (None: nothing):
    a missing output or file, a truncated or grown file, changed bytes, a file that was added. A file whose stamp
    equals the one recorded at publication (or at its last full verification) is not read; `full` reads every
    file (`align verify`). Outputs recorded before whole-file digests existed (no `files`) are checked for
    existence only."""
    root = Path(root)
    if not root.is_dir():
        return f"{root} is missing"
    files = (recorded or {}).get("files")
    if not isinstance(files, dict):
        return None
    known = dict((recorded or {}).get("stamps") or {})
    cache = _stamp_cache(root)
    try:
        known.update(json.loads(cache.read_text(encoding="utf-8")).get(recorded.get("publication", ""), {}))
    except (OSError, ValueError, AttributeError):
        pass
    verified: dict[str, list[int]] = {}
    for rel, (size, digest) in sorted(files.items()):
        path = root / rel
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} has {actual:,} bytes, {size:,} when it was published ({'truncated' if actual < size else 'grown'})"
        stamp = file_stamp(path)
        if not full and known.get(rel) == stamp:
            continue
        if file_sha256(path) != digest:
            return f"{path} changed after it was published (sha256 {file_sha256(path)[:12]}..., recorded {digest[:12]}...)"
        verified[rel] = stamp
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
                   and p.relative_to(root).as_posix() not in files)
    if extra:
        return f"{root / extra[0]} was added after the output was published"
    if verified and any(known.get(rel) != stamp for rel, stamp in verified.items()):
        try:  # remember what was read and found intact (a copied run directory is then read once, not every time)
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache, {recorded.get("publication", ""): {**known, **verified}})
        except OSError:
            pass  # a read-only run directory: verified again next time
    return None


def cache_root() -> Path:
    """align's cache: `$ALIGN_CACHE`, else ~/.cache/align (packaged models, converted GGUF tokenizers)."""
    return Path(os.environ.get("ALIGN_CACHE") or Path.home() / ".cache" / "align")


# What a library's writer says when the disk fills under it without raising an OSError (torch.save's zip writer:
# "PytorchStreamWriter failed writing file ...: file write failed"; torch's C++ stream writer: "basic_ios::clear:
# iostream error", measured on a full tmpfs; safetensors: "No space left on device").
_WRITE_FAILED = ("file write failed", "No space left on device", "Disk quota exceeded", "failed writing file",
                 "iostream error")


def free_space_note(where: Path) -> str:
    """E.g. '3.20 GiB free there now': the free space on the filesystem of `where` (or of its parent, when `where`
    was not created yet), for a message about a write that failed there."""
    try:
        return f"{shutil.disk_usage(where if where.exists() else where.parent).free / 2 ** 30:.2f} GiB free there now"
    except OSError:
        return "its free space unknown"


def write_failure(exc: BaseException, where: Path) -> str | None:
    """One line for a write a library failed (a checkpoint or model save on a full disk), naming the directory,
    its free space and the fix; None for anything else."""
    text = str(exc)
    if isinstance(exc, OSError) or not any(s in text for s in _WRITE_FAILED):
        return None
    free = free_space_note(where)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (f"{where}: a save failed ({type(exc).__name__}: {first[:200]}); {free}. Free space on that filesystem "
            "(or set runs_dir to one with room, and save_total_limit to keep fewer checkpoints), then run again: "
            "a stage resumes from its last complete checkpoint")


def runs_dir_problem(runs_dir: str) -> str | None:
    """Why run directories cannot be made under `runs_dir` (a file on its path, an unwritable directory), or None."""
    path = Path(runs_dir).expanduser()
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                return f"{part} is a file, not a directory; point runs_dir at a directory"
            if not os.access(part, os.W_OK | os.X_OK):
                return f"{part} is not writable here; point runs_dir at a directory you can write"
            return None
    return None
