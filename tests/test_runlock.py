"""The run directory's lock (align/orchestrator/runlock.py) on a filesystem without flock (some NFS mounts), where
the holder's record alone decides."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from align.orchestrator import runlock
from align.orchestrator.runlock import RunLock, RunLockedError


@pytest.fixture
def no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", flock)


def _record(run, pid, host):
    (run / runlock.LOCK_FILE).write_text(json.dumps({"pid": pid, "host": host, "since": "2026-11-29T09:00:00+0000"}))


def test_without_flock_a_runner_of_another_host_is_never_taken_over(tmp_path, no_flock):
    """A live runner on another node (a SLURM requeue while the old job still runs) cannot be seen from here: taking
    it over would put two runners on one run directory. Refused, naming the holder and the fix."""
    _record(tmp_path, 12345, "node-b")
    with pytest.raises(RunLockedError, match=r"PID 12345 on host node-b.*no locks \(flock: No locks available\).*"
                                             r"delete the lock file"):
        RunLock(tmp_path).__enter__()
    assert json.loads((tmp_path / runlock.LOCK_FILE).read_text())["host"] == "node-b"  # the holder's record kept


def test_without_flock_a_live_runner_here_holds_and_a_dead_one_is_taken_over(tmp_path, no_flock):
    _record(tmp_path, os.getpid(), socket.gethostname())
    with pytest.raises(RunLockedError, match=f"PID {os.getpid()} on host"):
        RunLock(tmp_path).__enter__()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    _record(tmp_path, dead, socket.gethostname())
    with RunLock(tmp_path) as lock:
        assert f"PID {dead}" in lock.note and "no longer running" in lock.note
        assert json.loads((tmp_path / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (tmp_path / runlock.LOCK_FILE).read_text() == ""  # a clean exit leaves no record
