"""The run directory's lock (align/orchestrator/runlock.py) on a filesystem without flock (some NFS mounts), where
the holder's record alone decides."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from align.orchestrator import runlock
from align.orchestrator.runlock import RunLock, RunLockedError
from conftest import REPO


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


def test_without_flock_two_runners_that_take_the_directory_at_once_leave_one_holding(tmp_path, no_flock, monkeypatch):
    """Without flock the record was read, checked and written with nothing in between making it atomic: two runners
    started together both found no holder and both ran, training into the same stage directories. Each now reads its
    record back after a moment; the one whose record the other overwrote gives way, naming it."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def another_runner_writes(seconds):  # during the settle: the other runner's record lands over this one's
            _record(tmp_path, other.pid, socket.gethostname())

        monkeypatch.setattr(runlock.time, "sleep", another_runner_writes)
        with pytest.raises(RunLockedError, match=f"PID {other.pid} on host .*took the run directory as this runner"):
            RunLock(tmp_path).__enter__()
        monkeypatch.setattr(runlock.time, "sleep", lambda seconds: None)
        (tmp_path / runlock.LOCK_FILE).write_text("")
        with RunLock(tmp_path):  # alone, it holds
            assert json.loads((tmp_path / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        other.kill()
        other.wait()


def test_a_stage_is_not_started_again_while_a_process_of_an_earlier_attempt_lives(tmp_path):
    """A runner killed with SIGKILL frees the run's lock at once, while its stage's processes still record their
    interruption (or a launcher's workers, in sessions of their own, still train): the next runner started the stage
    again beside them, and the two attempts removed each other's checkpoints. Each stage process now holds the
    stage's lock while it lives, and the runner waits for it (here: not at all) before refusing."""
    from align.core.rundir import STAGE_LOCK, stage_in_use

    assert stage_in_use(tmp_path, wait_s=0) is False  # never started
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from align.core.rundir import hold_stage; "
            f"hold_stage({str(tmp_path)!r}); print('held', flush=True); time.sleep(30)")
    stage = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    holder = stage
    try:
        assert stage.stdout.readline().strip() == "held"
        assert stage_in_use(tmp_path, wait_s=0) is True and (tmp_path / STAGE_LOCK).is_file()
        holder = subprocess.Popen([sys.executable, "-c", code.replace("held", "also")], stdout=subprocess.PIPE,
                                  text=True)  # another process of the same attempt (a second rank) shares it
        assert holder.stdout.readline().strip() == "also"
        stage.kill()
        stage.wait()
        assert stage_in_use(tmp_path, wait_s=0) is True  # the second still lives
        holder.kill()
        holder.wait()
        assert stage_in_use(tmp_path, wait_s=5) is False  # the kernel dropped the locks with the processes
    finally:
        for p in (stage, holder):
            p.kill()
            p.wait()


def test_a_stage_started_fresh_is_held_from_its_first_instant_not_once_its_imports_are_done(tmp_path):
    """A fresh stage process took the stage's lock only after its imports (torch, transformers: seconds; through
    `accelerate launch` on a GPU node, tens of seconds): a runner started meanwhile saw the stage free and started
    it again. The runner now hands the process a shared hold as it starts it, and keeps none itself."""
    from align.core.rundir import stage_in_use
    from align.orchestrator import warm

    importing = "import sys, time; sys.stdout.write('importing\\n'); sys.stdout.flush(); time.sleep(30)"
    proc = warm.start_stage([sys.executable, "-c", importing], dict(os.environ), warm_start=False,
                            stage_dir=str(tmp_path))
    try:
        assert proc.stdout.readline().strip() == b"importing"  # it never called hold_stage
        assert stage_in_use(tmp_path, wait_s=0) is True
        proc.kill()
        proc.wait()
        assert stage_in_use(tmp_path, wait_s=5) is False  # the runner itself held nothing
    finally:
        proc.kill()
        proc.wait()


def _beating(run, host, age):
    """A holder record of `host` whose last heartbeat was `age` seconds ago."""
    import time

    (run / runlock.LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": host, "since": "2026-12-02T06:00:00+0000",
                                                     "beat": int(time.time() - age)}))


def test_a_runner_on_another_node_holds_by_its_heartbeat_where_flock_does_not_reach_across_nodes(tmp_path):
    """Lustre mounted localflock, or BeeGFS without global locks: flock succeeds on every node, so a second runner on
    another node took the lock over from a live one ("no longer running") and both trained into one run directory.
    A record of another host whose heartbeat is recent now holds; one whose heartbeat stopped is taken over."""
    _beating(tmp_path, "node-b", 20)
    with pytest.raises(RunLockedError, match=r"PID 4242 on host node-b.*Its heartbeat is 2\d s old: this filesystem's "
                                             r"locks do not reach across nodes.*run again in 180 s or delete the lock"):
        RunLock(tmp_path).__enter__()
    assert json.loads((tmp_path / runlock.LOCK_FILE).read_text())["host"] == "node-b"  # the holder's record kept
    assert runlock.runner_state(tmp_path) is None  # `align status`: running, on node-b
    _beating(tmp_path, "node-b", 600)
    assert re.fullmatch(r"its heartbeat stopped 60\d s ago", runlock.runner_state(tmp_path))
    with RunLock(tmp_path) as lock:
        assert "PID 4242 on host node-b" in lock.note and "no longer running" in lock.note
    _record(tmp_path, 4242, "node-b")  # an older align's record (no beat): taken over where flock holds, as before
    with RunLock(tmp_path) as lock:
        assert "PID 4242" in lock.note


def test_without_flock_a_runner_of_another_host_whose_heartbeat_stopped_is_taken_over(tmp_path, no_flock):
    _beating(tmp_path, "node-b", 30)
    with pytest.raises(RunLockedError, match=r"PID 4242 on host node-b.*taken for ended only once its heartbeat stops"):
        RunLock(tmp_path).__enter__()
    _beating(tmp_path, "node-b", 600)  # a node lost: SLURM requeued the job elsewhere
    with RunLock(tmp_path) as lock:
        assert "PID 4242 on host node-b" in lock.note


def test_the_holder_rewrites_its_heartbeat_while_it_holds_and_leaves_no_record(tmp_path, monkeypatch):
    import time

    real = time.time
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.01)
    with RunLock(tmp_path):
        first = json.loads((tmp_path / runlock.LOCK_FILE).read_text())
        assert first["pid"] == os.getpid() and abs(first["beat"] - real()) < 5
        monkeypatch.setattr(runlock.time, "time", lambda: real() + 1000)
        deadline = real() + 10
        while json.loads((tmp_path / runlock.LOCK_FILE).read_text())["beat"] < first["beat"] + 900 and real() < deadline:
            time.sleep(0.01)
        later = json.loads((tmp_path / runlock.LOCK_FILE).read_text())
        assert later["beat"] >= first["beat"] + 900 and later["since"] == first["since"]
    assert (tmp_path / runlock.LOCK_FILE).read_text() == ""  # no beat landed after the record was emptied


def test_a_holder_whose_record_another_runner_replaced_stops_instead_of_writing_over_it(tmp_path, monkeypatch, capsys):
    """A runner stalled past the heartbeat's limit (SIGSTOP, a suspended job, a hung mount) is taken over by another
    host's; resumed, it wrote its beat over the new holder's record every 30 s, and both trained into one run. Now it
    stops (as a SIGTERM stops it, its stage recorded interrupted) and leaves the other's record as it is."""
    import signal
    import time

    killed = []
    monkeypatch.setattr(runlock.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.01)
    with RunLock(tmp_path):
        _beating(tmp_path, "node-b", 0)  # node-b's runner took the directory over
        deadline = time.time() + 10
        while not killed and time.time() < deadline:
            time.sleep(0.01)
        assert killed == [(os.getpid(), signal.SIGTERM)]
    assert json.loads((tmp_path / runlock.LOCK_FILE).read_text())["host"] == "node-b"  # neither beaten over nor emptied
    assert "the runner PID 4242 on host node-b took this run directory over" in capsys.readouterr().err


def test_where_flock_may_stay_on_one_node_two_runners_taking_the_directory_at_once_leave_one_holding(
        tmp_path, monkeypatch):
    """flock succeeding on a cluster filesystem whose locks stay on each node (Lustre `localflock`, BeeGFS): two
    runners on two nodes that started at once both held the run directory (3 of 6 trials), as the read-back ran
    only where flock failed. Off a filesystem known to be local, the runner reads its record back too; /proc/mounts
    decides which is which."""
    monkeypatch.setattr(runlock.fcntl, "flock", lambda fd, op: None)  # granted on this node only
    monkeypatch.setattr(runlock, "local_fs", lambda path: False, raising=False)

    def another_node_writes(seconds):  # during the settle: the other node's runner's record lands over this one's
        (tmp_path / runlock.LOCK_FILE).write_text(json.dumps({"pid": 4321, "host": "node-b", "since": "now",
                                                              "beat": int(runlock.time.time())}))

    monkeypatch.setattr(runlock.time, "sleep", another_node_writes)
    with pytest.raises(RunLockedError, match=r"PID 4321 on host node-b .*took the run directory as this runner"):
        RunLock(tmp_path).__enter__()
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nhost:/exp /mnt/my\\040runs nfs4 rw 0 0\n/dev/sdb /mnt/fast xfs rw 0 0\n")
    monkeypatch.undo()
    real = runlock.Path
    monkeypatch.setattr(runlock, "Path", lambda p: real(mounts) if p == "/proc/mounts" else real(p))
    assert runlock.local_fs(real("/home/u/runs")) and runlock.local_fs(real("/mnt/fast/r"))
    assert not runlock.local_fs(real("/mnt/my runs/p/main")) and not runlock.local_fs(real("/mnt/my runs"))
