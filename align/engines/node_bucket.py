"""The weight sync under ZeRO-3 when the processes' partitions lie in host memory (a CPU run; ZeRO-3 with
`offload_param` on GPUs, never run there) and every process of the job runs on one node: the all-gather done in
shared memory.

One bucket in /dev/shm that every process of the node maps (NodeBucket). For each chunk of the sync, every process
copies its own partition of each weight into the bucket's place for that weight; once all have (a barrier) each
engine loads the chunk as it loads any bucket's (align/engines/buckets.py, the same messages); the bucket's two
halves take turns, the next chunk written while the engines load the last, and a half is written again only once
every engine has loaded it (the next barrier: one a chunk, and one at the end). No process gathers a weight: each
copies 1/world of the policy per sync, where the gathers of weight_sync.engine_entries (a collective per layer) make
every process receive the other (world-1)/world and copy all of it out. Where this cannot be used (`problem`:
partitions on a GPU, where the gather is NCCL's all-gather; over a subgroup, as hpZ and MiCS partition; processes on
several nodes; a LoRA policy, whose merged layers are computed from gathered weights) the sync gathers as before.
All processes use it or none (`for_model`). The bucket lies in process 0's engine's directory and goes with it
(`forget`).

DeepSpeed's layout (deepspeed/runtime/zero/partition_parameters.py, `_partition_param`): a weight's flattened
elements, padded to a multiple of the group's size, in equal consecutive parts, part r on the group's rank r as
`ds_tensor` (`ds_tensor.ds_numel` elements). The padding is at the end, so the parts side by side are the weight and
then the padding, which no piece covers.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import shutil
import socket
import tempfile
import weakref
from typing import Iterator

import torch

from align.engines.base import all_gather_objects as _all_gather
from align.engines.buckets import Bucket, unmap
from align.engines.weight_sync import converts_weights, dtype_name, groups, shm_room_problem

SYNCS = ("host", "shared")  # the generation.weight_sync values whose ZeRO-3 syncs may take the node's bucket
NODE_MIN_BYTES = 512 * 2 ** 20
"""The node's bucket at least (one per node, in host memory, which ZeRO-3's offload has in plenty): each chunk costs
about 3 ms beyond its bytes on a 2-core CPU (a barrier, a message, the engine's load call), so at 8B in bf16 halves of
256 MiB make 64 chunks a sync, halves of 32 MiB 500; benchmarks/zero3_sync.py."""
SWEEP_AFTER_S = 60.0  # a node bucket's folder younger than this is never swept (its maker may not hold the lock yet)
_OPEN: dict = {}  # this process's node bucket ("bucket") and the gloo group of its barriers ("group")
_DECIDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None (its syncs use the bucket) or why not
QUIET = ("one process", "its weights are not partitioned (ZeRO-3)")  # nothing to say: no ZeRO-3 run gathers for these


def problem(model) -> str | None:
    """Why `model`'s weights cannot be synced through a node bucket (None: they can). The same on every process of a
    job (it reads the launch and how DeepSpeed partitioned, which are), so a process that finds a reason gathers
    without asking the others (`for_model`). Partitions mostly in host memory are what it is for; a few on a GPU
    (ZeRO-3's persistent small parameters beside offloaded ones) are copied from there."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return "one process"
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return "its weights are not partitioned (ZeRO-3)"
    if hasattr(model, "peft_config"):
        return "a LoRA policy's merged layers are computed from gathered weights"
    if converts_weights(model):  # the partitions hold memory's layout, the engine loads the checkpoint's
        return "transformers converts its weights (fused experts) between the checkpoint and memory"
    world = dist.get_world_size()
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
        return "the job's processes are on more than one node"
    where: dict[str, int] = {}
    for name, p in model.named_parameters():
        if not hasattr(p, "ds_id"):  # left whole by ZeRO-3: process 0 sends it
            continue
        t = p.ds_tensor
        if t is None or getattr(p, "ds_secondary_tensor", None) is not None or dist.get_world_size(
                p.ds_process_group) != world:
            return f"{name} is partitioned over a subgroup of the processes (hpZ or MiCS)"
        location = getattr(t, "final_location", None)
        if getattr(location, "value", location) == "nvme":
            return f"{name}'s partition is offloaded to NVMe"
        if t.dtype != p.dtype or t.ds_numel * world < p.ds_numel:
            return f"{name}'s partition is not a {p.dtype} part of {t.ds_numel} elements (quantised?)"
        where[t.device.type] = where.get(t.device.type, 0) + t.numel() * t.element_size()
    if where.get("cpu", 0) * 2 < sum(where.values()):
        return (f"the partitions are on {', '.join(k for k in where if k != 'cpu')}, where the gather (NCCL's "
                "all-gather) is the faster way")
    return None


def shares(model, changed_only: bool = False) -> Iterator[tuple]:
    """What this process puts in the node bucket, in weight_sync.engine_entries' order and under its names: per weight
    (name, dtype, shape, its bytes, this process's share of them as bytes or None, the share's first byte). A
    partitioned weight's share is its partition; any other weight is process 0's alone. `changed_only`: the weights
    that train."""
    import torch.distributed as dist

    rank = dist.get_rank()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    state = model.state_dict(keep_vars=True)
    for keys in groups(model):
        for key in keys:
            t = state[key]
            if (tied and key == "lm_head.weight") or (changed_only and not getattr(t, "requires_grad", False)):
                continue
            if hasattr(t, "ds_id"):
                shape, part = list(t.ds_shape), t.ds_tensor.detach()
                start = part.numel() * dist.get_rank(group=t.ds_process_group) * part.element_size()
                share = part.reshape(-1).view(torch.uint8)
            else:
                shape, start = list(t.shape), 0
                share = t.detach().contiguous().reshape(-1).view(torch.uint8) if rank == 0 else None
            yield key, dtype_name(t.dtype), shape, math.prod(shape) * t.element_size(), share, start


class NodeBucket(Bucket):
    """The bucket every process of the node maps: a file of `size` bytes at `path` (in /dev/shm) that process 0 made
    (holding `lock` while it lives) and removes at `close`, used as two halves in turn. `pieces(shares)` writes this
    process's shares of a chunk into one half and yields the chunk (Bucket.pieces' form) once every process has
    written its own (a barrier); resumed, it writes the next chunk into the other half while this process's engine
    loads the first, then waits until its engine has loaded it (`loaded`: set by the process that syncs an engine,
    None for one that only joins) and in the next barrier until every engine has: a half is written again only after
    every engine has read it. One barrier per chunk and one at the end. When `loaded` fails, the rest is written and
    every barrier joined all the same (the other processes are not left waiting), and the failure is raised at the
    end."""

    kind = "node_shared_memory"

    def __init__(self, path: str, size: int, group, lock: int | None = None):
        self.path, self.size, self.group, self.lock = path, size, group, lock  # lock: process 0's (the maker's)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.sent_bytes = self.copied_bytes = 0
        self.loaded = None
        self._streaming = self._close_pending = False  # `close` during `pieces` waits for its end

    def where(self) -> dict:
        return {"path": self.path}

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def pieces(self, entries) -> Iterator[tuple[list[tuple], bool]]:
        self._streaming = True
        try:
            yield from self._pieces(entries)
        finally:
            self._streaming = False
            if self._close_pending:
                self.close()

    def _pieces(self, entries) -> Iterator[tuple[list[tuple], bool]]:
        half = max(1, self.size // 2)
        pending: list[tuple] = []
        used, base, state = 0, 0, {"out": False, "failure": None}
        for name, dtype, shape, total, share, start in entries:
            done = 0
            while True:
                take = min(total - done, half - used)
                lo, hi = max(done, start), min(done + take, start + (share.numel() if share is not None else 0))
                if lo < hi:  # this process's bytes of the piece [done, done + take) of the weight
                    at = base + used - done
                    self.buffer[at + lo:at + hi].copy_(share[lo - start:hi - start])
                    self.copied_bytes += hi - lo
                pending.append((name, dtype, shape, total, done, base + used, take))
                used, done, self.sent_bytes = used + take, done + take, self.sent_bytes + take
                if used == half:
                    yield from self._hand_out(pending, False, state)
                    pending, used, base = [], 0, half - base
                if done == total:
                    break
        yield from self._hand_out(pending, True, state)
        self._settle(state)
        if state["failure"] is not None:
            raise state["failure"]

    def _settle(self, state: dict) -> None:
        """The chunk handed out before (if any) loaded by this process's engine, then every process's barrier."""
        if state["out"] and self.loaded is not None and state["failure"] is None:
            try:
                self.loaded()
            except Exception as exc:  # raised once every process is through
                state["failure"] = exc
        self.barrier()

    def _hand_out(self, pending: list[tuple], last: bool, state: dict):
        self._settle(state)
        if state["failure"] is None:
            state["out"] = True
            yield pending, last

    def close(self) -> None:
        """Unmapped (and removed by process 0). Asked during `pieces` (this process's engine timed out in `loaded` and
        was closed), it waits for the stream's end: the rest is still written and every barrier joined, so the other
        processes are not left waiting and the engine's timeout is what this process raises."""
        if self._streaming:
            self._close_pending = True
            return
        self._close_pending = False
        if self.buffer is None:
            return
        self.buffer = None
        unmap(self._map)
        if self.lock is not None:
            _remove(os.path.dirname(self.path), self.lock)
            self.lock = None


def _sweep(directory: str) -> None:
    """Remove the node buckets in `directory` and in its siblings (other engines' directories) whose maker is gone
    (a killed process whose engine was killed too: an engine removes its directory when its trainer dies): each maker
    holds an exclusive lock on its bucket's `lock` file while it lives (released by the kernel however it ends); one
    that can be locked here, and is older than SWEEP_AFTER_S, is left over. A lock, not a process id: containers sharing
    /dev/shm do not share process ids."""
    import fcntl
    import glob
    import time

    parent = os.path.dirname(os.path.abspath(directory))
    for folder in {*glob.glob(os.path.join(directory, "align-node-*")), *glob.glob(os.path.join(parent, "*",
                                                                                              "align-node-*"))}:
        try:
            if time.time() - os.stat(folder).st_mtime < SWEEP_AFTER_S:  # being made: its lock may not be taken yet
                continue
        except OSError:
            continue
        try:
            fd = os.open(os.path.join(folder, "lock"), os.O_RDWR)
        except OSError:  # being made, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its maker lives
            continue
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


def _make(sizes: tuple[int, ...], directory: str) -> tuple[str, int, int]:
    """Process 0: the bucket's file, of the first of `sizes` that `directory` has room for (once buckets left by
    killed runs are swept), its pages taken now (a full /dev/shm is an error here, not a SIGBUS later), and the
    descriptor of its lock, held while the bucket lives (`_sweep`)."""
    import fcntl

    _sweep(directory)
    size = next((n for n in sizes if shm_room_problem(n, directory) is None), None)
    if size is None:
        raise OSError(shm_room_problem(sizes[-1], directory))
    folder = tempfile.mkdtemp(prefix="align-node-", dir=directory)
    lock = os.open(os.path.join(folder, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    path, fd = os.path.join(folder, "bucket"), None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError:
        _remove(folder, lock)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return path, size, lock


def _remove(folder: str, lock: int) -> None:
    """Process 0's bucket folder removed, then its lock let go (a sweep never takes a folder still being removed)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock)


def _open(sizes: tuple[int, ...], directory: str) -> NodeBucket | str:
    """Collective: the node bucket (of the first of `sizes` there is room for), made by process 0 and mapped by every
    process, or why not."""
    import torch.distributed as dist

    group, rank = _OPEN["group"], dist.get_rank()
    made, error = None, None
    if rank == 0:
        try:
            made = _make(sizes, directory)
        except OSError as exc:
            error = f"the node's weight bucket could not be made in {directory} ({exc})"
    lock = made[2] if made else None
    try:
        made, error = _all_gather((made[:2] if made else None, error), group)[0]
    except BaseException:  # the collective itself failed: process 0's bucket goes now, not at the sweep
        if lock is not None:
            _remove(os.path.dirname(made[0]), lock)
        raise
    bucket = None
    if made is not None:
        try:
            bucket = NodeBucket(made[0], made[1], group, lock=lock)
        except OSError as exc:
            error = f"process {rank} could not map the node's weight bucket {made[0]} ({exc})"
            if lock is not None:  # process 0's: its folder goes now
                _remove(os.path.dirname(made[0]), lock)
    try:
        errors = [e for e in _all_gather(error, group) if e]
    except BaseException:  # as above: this process's mapping (and process 0's folder) go now
        if bucket is not None:
            bucket.close()
        raise
    if errors:
        if bucket is not None:
            bucket.close()
        return errors[0]
    if not _OPEN.get("atexit"):  # process 0 removes the file however the stage ends, short of a kill
        _OPEN["atexit"] = atexit.register(forget)
    return bucket


def for_model(model, size: int, timeout_s: float, directory: str) -> NodeBucket | None:
    """The node bucket `model`'s syncs go through, or None (they gather). Where `problem` finds a reason, at once (it
    is the same on every process); else a collective at a process's first sync of `model`, which every process makes
    at the same point (the host names, and the bucket process 0 makes in `directory` and every process maps): all use
    the bucket or none. Why none, when the weights are partitioned, is printed once. `size`: this process's bucket
    size (generation.sync_bucket_mib; 0 for a process that syncs no engine itself); the node's bucket (two halves used
    in turn) is the largest times the number of processes, and at least NODE_MIN_BYTES where there is room for it."""
    import datetime

    import torch.distributed as dist

    why, said = problem(model), None
    if why is None and model in _DECIDED:
        why = _DECIDED[model]
    elif why is None:
        if "group" not in _OPEN:
            _OPEN["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * timeout_s + 240))
        everyone = _all_gather((socket.gethostname(), size), _OPEN["group"])
        why = "the job's processes are on more than one node" if len({h for h, _ in everyone}) > 1 else None
        asked = max(s for _, s in everyone) * len(everyone)  # what the processes' own buckets would take together
        sizes = (max(asked, NODE_MIN_BYTES), asked)
        if why is None and (_OPEN.get("bucket") is None or _OPEN["bucket"].size not in sizes):
            forget()
            opened = _open(sizes, directory)
            why = opened if isinstance(opened, str) else None
            _OPEN["bucket"] = None if why else opened
        _DECIDED[model] = said = why
    elif model not in _DECIDED and why not in QUIET:
        _DECIDED[model] = said = why
    if said and dist.get_rank() == 0:
        print(f"vLLM weight sync under ZeRO-3: gathering each layer ({said})", flush=True)
    return _OPEN.get("bucket") if why is None else None


def forget() -> None:
    """This process's node bucket closed (process 0's removed) and every decision dropped: at an engine's close, which
    every process makes at the same point (the bucket lies in process 0's engine's directory and goes with it), so
    the next sync decides again, together."""
    bucket = _OPEN.pop("bucket", None)
    if bucket is not None:
        bucket.close()
    _DECIDED.clear()


def opened_path() -> str | None:
    """Where this process's node bucket lies (None: none open)."""
    return _OPEN["bucket"].path if _OPEN.get("bucket") is not None else None


def join(bucket: NodeBucket, model, changed_only: bool) -> None:
    """A process whose engine another process syncs (or that has none): its shares written and every barrier joined."""
    bucket.loaded = None
    for _ in bucket.pieces(shares(model, changed_only)):
        pass


def drain(chunks) -> None:
    """After this process's sync failed part-way: the rest of its chunks written and their barriers joined, so the other
    processes finish theirs instead of waiting in a barrier (a failure inside a barrier ends the generator)."""
    try:
        for _ in chunks:
            pass
    except Exception:
        pass
