"""One runner per run directory: an advisory `fcntl.flock` on `<run>/.align.lock`, which holds the runner's
PID, host and start time.

The kernel drops a flock when its process dies, however it dies, so a runner killed with SIGKILL does not block
the next one on its host: the next runner gets the lock, finds the dead runner's record still in the file (a clean
exit empties it) and says it took over a stale lock. On another host the next runner waits out its heartbeat
(below): up to STALE_S after the kill. A second live runner fails at once, naming the holder.
On filesystems without flock (some NFS mounts) the PID record alone decides: a live PID on this host holds it, and
so does any record of another host (whose PIDs this host cannot see: the user deletes a stale one); a runner reads
its record back after SETTLE_S, and one whose record another runner has overwritten meanwhile gives way; so does
one on a filesystem not known to be local (LOCAL_FS), where its flock may not reach across nodes.
Multi-node workers (node rank > 0) take no lock: they write nothing under the run directory.

A flock does not always reach across nodes (Lustre mounted `localflock`, BeeGFS without global file locks): a runner
on another node can take it while the holder runs. So the holder also rewrites its record's `beat` (a Unix time)
every HEARTBEAT_S; a record of another host whose beat is younger than STALE_S is a live runner, whatever flock
said (where flock does reach across nodes, a runner killed on one node holds its lock against another node's for up
to STALE_S), and one whose beat is older is a dead one, with or without flock. A holder that finds another runner's
record in place of its own (it was stalled past STALE_S and taken over) stops. A record without a beat (an older
align) is judged as before.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from align.core.faults import oserror

LOCK_FILE = ".align.lock"
SETTLE_S = 0.5  # without flock, or off LOCAL_FS: how long a runner waits after writing its record to read it back
HEARTBEAT_S = 30.0  # how often the holder rewrites its record's beat
STALE_S = 180.0  # a beat older than this is a dead runner's (six beats missed; clocks of a cluster's nodes agree)


class RunLockedError(RuntimeError):
    """Another live runner holds the run directory."""


def _parsed(raw: str) -> dict:
    """A holder record as the runner writes it; a damaged one (edited, torn) has no holder: its `pid` is dropped
    unless it is a whole number a process can have."""
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        return {}
    if not isinstance(holder, dict):
        return {}
    pid = holder.get("pid")
    if type(pid) is not int or not 0 < pid < 2 ** 22:  # Linux's pid_max limit
        holder.pop("pid", None)
    return holder


LOCAL_FS = ("ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "ramfs", "overlay")
"""Filesystems of one machine, whose flock every runner sees: no read-back is needed (each other one, a network or
cluster filesystem, may keep a flock on one node: Lustre `localflock`, BeeGFS)."""


def local_fs(path: Path) -> bool:
    """Whether `path` lies on a filesystem of this machine (LOCAL_FS), by the longest mount point above it in
    /proc/mounts; not known: False."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines() if len(line.split()) > 2]
    except OSError:
        return False
    where, best, kind = str(Path(path).resolve()), "", ""
    for mount, fs in mounts:
        mount = mount.replace("\\040", " ")  # /proc/mounts writes a space so
        if (where == mount or where.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fs
    return kind in LOCAL_FS


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def beat_age(holder: dict) -> float | None:
    """Seconds since the holder's last beat (None: its record has none)."""
    beat = holder.get("beat")
    return time.time() - beat if type(beat) is int else None


def _other_host_alive(holder: dict) -> bool:
    """Whether a record of another host is a live runner's: its beat is recent (no beat: taken as alive)."""
    age = beat_age(holder)
    return age is None or age < STALE_S


def runner_state(run_dir: str | Path) -> str | None:
    """Whether a runner holds `run_dir`, read from the holder record without touching the lock (so `align status`
    never races a runner starting): None while a live runner on this host (or one on another host, which this
    host cannot see) holds it, else why nobody does: "has exited" (an empty record: the runner stopped on an error
    it could not write into the manifest, e.g. a full disk) or "PID N died" (SIGKILL, OOM killer, power)."""
    try:
        holder = _parsed((Path(run_dir) / LOCK_FILE).read_text(errors="replace"))
    except FileNotFoundError:
        return "never took the run directory's lock"
    except OSError:
        return None
    if not holder.get("pid"):
        return "has exited"
    if holder.get("host") != socket.gethostname():
        return None if _other_host_alive(holder) else f"its heartbeat stopped {beat_age(holder):.0f} s ago"
    return None if _alive(holder["pid"]) else f"PID {holder['pid']} died"


class RunLock:
    """`with RunLock(run_dir) as lock:` holds the run directory; `lock.note` says if a stale lock was taken over."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None
        self.note = ""
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def _holder(self, fd: int) -> dict:
        try:
            return _parsed(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
        except OSError:
            return {}

    def __enter__(self) -> RunLock:
        oserror(self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        unlocked = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RunLockedError(self._busy(self._live_holder(fd))) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                unlocked = True
                holder = self._holder(fd)
                if holder.get("pid") and holder.get("host") != socket.gethostname() and _other_host_alive(holder):
                    raise RunLockedError(self._busy(holder) + f". This filesystem has no locks (flock: {exc.strerror}),"
                                         " so a runner on another host is taken for ended only once its heartbeat "
                                         "stops: if it has ended, delete the lock file and run again") from None
                if holder.get("host") == socket.gethostname() and holder.get("pid") and _alive(holder["pid"]):
                    raise RunLockedError(self._busy(holder)) from None
            holder = self._holder(fd)
            if not unlocked and holder.get("pid") and holder.get("host") != socket.gethostname() and \
                    beat_age(holder) is not None and _other_host_alive(holder):  # a flock that is node-local
                raise RunLockedError(self._busy(holder) + f". Its heartbeat is {beat_age(holder):.0f} s old: this "
                                     "filesystem's locks do not reach across nodes (Lustre localflock, BeeGFS without "
                                     f"global locks); if it has ended, run again in {STALE_S:.0f} s or delete the lock "
                                     "file")
            if holder.get("pid"):
                state = "still running but not holding the lock" if holder.get("host") == socket.gethostname() \
                    and _alive(holder["pid"]) else "no longer running"
                self.note = (f"took over a stale lock on {self.path.parent}: PID {holder['pid']} on host "
                             f"{holder.get('host')} (since {holder.get('since')}) ended without releasing it ({state})")
            self.since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            os.ftruncate(fd, 0)
            self._write(fd)
            if unlocked or not local_fs(self.path):  # two runners that read the record at once (no flock, or one
                # that stays on each node) both wrote theirs: the last written holds
                time.sleep(SETTLE_S)
                holder = self._reread()
                if holder.get("pid") != os.getpid() or holder.get("host") != socket.gethostname():
                    raise RunLockedError(self._busy(holder) + " (it took the run directory as this runner did)")
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._beating = threading.Thread(target=self._beat, name="align-runlock-beat", daemon=True)
        self._beating.start()
        return self

    def _write(self, fd: int) -> None:
        """The holder record with a beat of now: the same length every time (a whole-second Unix time), written over
        the last in one write, so a reader sees one or the other."""
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": self.since,
                             "beat": int(time.time())})
        os.pwrite(fd, record.encode(), 0)
        os.fsync(fd)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = self._reread()
            if not self._mine(holder):
                return self._taken_over(holder)  # never written over: the other runner's record holds
            try:
                self._write(self.fd)
            except (OSError, TypeError):  # closed meanwhile (TypeError: fd None), or a passing I/O error
                if self.fd is None:
                    return

    @staticmethod
    def _mine(holder: dict) -> bool:
        """Whether a record is this runner's, or none (empty, or being rewritten)."""
        return not holder.get("pid") or (holder["pid"], holder.get("host")) == (os.getpid(), socket.gethostname())

    def _taken_over(self, holder: dict) -> None:
        """This runner was stalled (SIGSTOP, a suspended job, a hung mount) past STALE_S and another took the run
        directory over: it stops as a SIGTERM stops it (its stage recorded interrupted), saying why first."""
        print(f"[align] error: the runner PID {holder['pid']} on host {holder.get('host')} took this run directory "
              f"over (since {holder.get('since')}) while this one was stalled past {STALE_S:.0f} s without a "
              "heartbeat; this runner stops so that one runner holds it", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    def _reread(self) -> dict:
        """The record as the file holds it now, through a descriptor of its own: NFS shows another client's write to
        a file opened after it (close-to-open), not to one this process already has open and cached."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return {}
        try:
            return self._holder(fd)
        finally:
            os.close(fd)

    def _live_holder(self, fd: int) -> dict:
        """The record of the runner holding the lock. It writes the record just after taking the lock, so for
        up to 2 s the file may still be empty or hold a dead runner's record."""
        deadline = time.time() + 2.0
        while True:
            holder = self._holder(fd)
            pid = holder.get("pid")  # a whole number, or absent (`_parsed`)
            if pid and (holder.get("host") != socket.gethostname() or _alive(pid)) or time.time() > deadline:
                return holder
            time.sleep(0.05)

    def _busy(self, holder: dict) -> str:
        return (f"run directory {self.path.parent} is in use by another align runner: PID {holder.get('pid', '?')} "
                f"on host {holder.get('host', '?')} (since {holder.get('since', '?')}). Wait for it to finish, or "
                f"use another --run-id. (Lock file: {self.path})")

    def __exit__(self, *exc: object) -> None:
        if self.fd is None:
            return
        self._stop.set()
        if self._beating is not None:
            self._beating.join()  # no beat lands after the record is emptied
        try:
            if self._mine(self._reread()):
                os.ftruncate(self.fd, 0)  # a clean exit leaves no holder record: a record means a crash
        except OSError:
            pass
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
