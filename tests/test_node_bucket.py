"""The weight sync's all-gather in shared memory (align/engines/node_bucket.py) under 2-process ZeRO-3 on a CPU:
each process writes its own partitions into the node's bucket and the engines read whole weights from it, bit for
bit the gathered ones, with no gather; see tests/probes/node_bucket_probe.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from align.orchestrator.launch import free_port
from conftest import REPO

pytestmark = pytest.mark.distributed


def test_each_process_writes_its_partitions_and_every_engine_reads_the_gathered_weights(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    out = tmp_path / "probe"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(REPO / "pipelines" / "accelerate" / "zero3.yaml"), "--num_processes", "2",
                           "--main_process_port", str(free_port()),
                           str(REPO / "tests" / "probes" / "node_bucket_probe.py"), str(shm), str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = [json.loads((tmp_path / f"probe.{rank}").read_text()) for rank in (0, 1)]
    print(f"seed {r[0]['seed']}", {k: v for k, v in r[0].items() if k.endswith("_copied")},
          {k: v for k, v in r[1].items() if k.endswith("_copied")})
    for x in r:
        assert x["problem"] is None and x["plain_problem"] == "its weights are not partitioned (ZeRO-3)"
        assert x["bucket"] == 2000  # process 0's size times 2 processes (process 1 asks 0): halves of 1000
        assert x["path"] == r[0]["path"] and x["path"].startswith(str(shm))
    for i in range(3):
        total = r[0][f"sync{i}_copied"][1]
        assert total == r[1][f"sync{i}_copied"][1] > 0
        copied = [x[f"sync{i}_copied"][0] for x in r]
        assert sum(copied) == total and max(copied) < 0.6 * total, (i, copied, total)  # each its own part, no more
        assert r[0][f"sync{i}_moved"] and r[1][f"sync{i}_moved"]  # every weight changed since the sync before
    for key in ("sync0", "sync1", "after_failure"):
        for x in r:
            assert x[key] == {"names": True, "equal": True, "errors": []}, (key, x["rank"], x[key])
    assert r[0]["sync2"] == {"names": True, "equal": True, "errors": []} and r[1]["sync2"] is None  # 1 only joined
    assert r[0]["failed_errors"] and r[1]["failed_errors"] == []  # 0 stopped part-way; 1 finished, not left waiting
    assert any("raised: the engine failed" in e for e in r[0]["refused_errors"])  # raised once all were through
    assert r[1]["refused_errors"] == []
    # 0's engine timed out part-way and was closed, its node bucket with it: 0 raises the timeout (not an error of
    # writing into a bucket closed under it) once every process is through, and 1 is not left waiting
    assert any("raised: the engine did not finish" in e for e in r[0]["timed_out_errors"]), r[0]["timed_out_errors"]
    assert r[1]["timed_out_errors"] == [] and r[0]["closed_after_timeout"] and not r[1]["closed_after_timeout"]
    assert not r[0]["one_unable"] and not r[1]["one_unable"]  # one process unable: none uses the bucket
    assert r[0]["left_after_refusal"] == []  # and process 0 removed the one it had made
    assert not list(shm.iterdir())  # process 0 removed the bucket at exit


def test_one_process_or_weights_not_partitioned_decide_alone_and_gather(tmp_path):
    """No collective where `problem` finds a reason (the same on every process): here one process (no process group)
    and weights without ZeRO-3's partitions: no bucket, nothing made, `problem` says why."""
    import torch

    from align.engines import node_bucket

    model = torch.nn.Linear(3, 3)
    assert node_bucket.for_model(model, 1000, 60.0, str(tmp_path)) is None
    assert node_bucket.problem(model) == "one process" and not list(tmp_path.iterdir())


def test_the_nodes_bucket_is_the_first_size_there_is_room_for(tmp_path, monkeypatch):
    """Process 0 makes the node's bucket at least NODE_MIN_BYTES, or as large as the processes' own buckets together
    where /dev/shm (here a stand-in: room for 4,096 bytes) has no room for that; with room for neither, an OSError
    that says how much room there is, and nothing is left behind."""
    from align.engines import node_bucket

    def room(needed, directory):
        return None if needed <= 4096 else f"{directory} has room for 4096 bytes, not {needed}"

    monkeypatch.setattr(node_bucket, "shm_room_problem", room)
    path, size, lock = node_bucket._make((8192, 2048), str(tmp_path))
    assert size == 2048 and os.path.getsize(path) == 2048 and os.path.basename(os.path.dirname(path)).startswith(
        "align-node-")
    with pytest.raises(OSError, match="room for 4096 bytes, not 9000"):
        node_bucket._make((16384, 9000), str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(os.path.dirname(path))]
    os.close(lock)


def test_a_bucket_file_that_cannot_be_made_leaves_no_folder_and_no_lock_behind(tmp_path, monkeypatch):
    """Process 0 holds its bucket folder's lock from the moment it makes it: a bucket file it then cannot create (out
    of descriptors or inodes) must remove the folder and let the lock go, or the folder outlives the error (no sweep
    takes a folder whose lock its living maker holds)."""
    import errno

    from align.engines import node_bucket

    monkeypatch.setattr(node_bucket, "shm_room_problem", lambda needed, directory: None)
    opened, real_open = [], os.open

    def open_(path, flags, *args, **kwargs):  # os.open of the whole process: count only this test's folder
        mine = str(path).startswith(str(tmp_path))  # (another test's thread may open a lock of its own meanwhile)
        if mine and os.path.basename(path) == "bucket":
            raise OSError(errno.EMFILE, "Too many open files")
        fd = real_open(path, flags, *args, **kwargs)
        if mine and os.path.basename(path) == "lock":
            opened.append(fd)
        return fd

    monkeypatch.setattr(node_bucket.os, "open", open_)
    with pytest.raises(OSError, match="Too many open files"):
        node_bucket._make((4096,), str(tmp_path))
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [] and len(opened) == 1
    with pytest.raises(OSError):  # the lock's descriptor was closed
        os.fstat(opened[0])


def test_a_bucket_left_by_a_killed_run_is_swept_and_a_live_ones_is_kept(tmp_path, monkeypatch):
    """Each node bucket's maker holds a lock on it while it lives: a bucket whose maker was SIGKILLed (here: a child
    process that made one and was killed) is removed when the next is made; a live one (made here) is kept."""
    import signal
    import subprocess
    import sys

    from align.engines import node_bucket

    monkeypatch.setattr(node_bucket, "SWEEP_AFTER_S", 0.0)  # the child's bucket is seconds old
    code = ("import sys, time; from align.engines import node_bucket as n; "
            "n._make((4096,), sys.argv[1]); print('made', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "made"
    (stale,) = list(tmp_path.iterdir())
    sibling = tmp_path.parent / f"{tmp_path.name}-engine"  # another engine's directory beside this one
    sibling.mkdir()
    other_path, _, other_lock = node_bucket._make((4096,), str(sibling))
    live_path, _, lock = node_bucket._make((4096,), str(tmp_path))  # the child lives: its bucket stays
    assert stale.exists() and (stale / "bucket").exists()
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    os.close(other_lock)  # the sibling's maker gone too
    again, _, lock2 = node_bucket._make((4096,), str(tmp_path))  # the child is gone: its bucket too, ours stays
    assert not stale.exists() and not os.path.exists(other_path) and os.path.exists(live_path)
    assert os.path.exists(again)
    for held in (lock, lock2):
        os.close(held)
