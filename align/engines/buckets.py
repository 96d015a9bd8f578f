"""How synced weights travel to the engine (the entries themselves: weight_sync.py): a fixed bucket the trainer
fills and the engine copies out of, chunk by chunk, acknowledging each before it is filled again. Where it lives:
host shared memory both processes map (SharedBucket, /dev/shm), the trainer's GPU shared by CUDA IPC (CudaBucket,
the engine on that GPU), or the trainer's own memory sent by a broadcast to the engine (BroadcastBucket: NCCL
between GPUs, gloo on a CPU). `chunk_messages` turns a sync's entries into the messages the engine reads
(align/engines/vllm_side/align_vllm_worker.py)."""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Iterator

import torch

from align.engines.weight_sync import HostTensors, dtype_name


def bucket_kind(device: torch.device, engine_devices: tuple[int, ...], setting: str = "shared") -> str:
    """Where the sync bucket lives: "cuda_ipc" when the trained weights are on a GPU the engine also runs on (and
    `generation.weight_sync` is `shared`), "broadcast" (in the trainer's memory, sent by a broadcast: BroadcastBucket)
    when asked, else "shared_memory" (host /dev/shm; `host` asks for it on GPUs too)."""
    if setting == "broadcast":  # an engine on the trainer's own GPU: CUDA IPC (NCCL refuses two ranks on one GPU)
        return "cuda_ipc" if device.type == "cuda" and device.index in engine_devices else "broadcast"
    if setting == "shared" and device.type == "cuda" and device.index in engine_devices:
        return "cuda_ipc"
    return "shared_memory"


def same_minor(trainer_torch: str, engine_torch: str | None) -> bool:
    """Whether two torch versions are one minor release (2.13.0+cu128 and 2.13.1: yes; the engine's unknown: no)."""
    def minor(version: str) -> str:
        return ".".join(version.split("+")[0].split(".")[:2])

    return engine_torch is not None and minor(engine_torch) == minor(trainer_torch)


def sync_transport(device: torch.device, engine_devices: tuple[int, ...], setting: str, trainer_torch: str,
                   engine_torch: str | None, ipc_problem: str | None) -> tuple[str, str | None]:
    """bucket_kind, then /dev/shm ("shared_memory") where the GPU transport cannot work here, with why (None when
    it can): CUDA IPC under `ipc_problem` (torch versions, the allocator, a failed handle), and a broadcast over NCCL
    between two torch versions (each wheel brings its own NCCL, which refuses to mix ranks: the broadcast would hang
    until the sync's deadline)."""
    kind = bucket_kind(device, engine_devices, setting)
    if kind == "cuda_ipc" and ipc_problem:
        return "shared_memory", ipc_problem
    if kind == "broadcast" and device.type == "cuda" and not same_minor(trainer_torch, engine_torch):
        return "shared_memory", (f"weight_sync: broadcast needs the engine's torch ({engine_torch}) to be the "
                                 f"trainer's ({trainer_torch}): their NCCL libraries differ")
    return kind, None


def cuda_ipc_problem(trainer_torch: str, engine_torch: str | None, alloc_conf: str) -> str | None:
    """Why the engine could not open a CUDA IPC handle of this trainer's (None: it can): torch's handle format changes
    between minor versions (2.13 writes a version byte older ones refuse), and with the allocator's expandable segments
    the handle needs pidfd_getfd, which containers often forbid (pytorch#165685). The sync then goes through /dev/shm."""
    if not same_minor(trainer_torch, engine_torch):
        return f"the engine's torch {engine_torch} is not the trainer's {trainer_torch} (CUDA IPC handles differ)"
    if "expandable_segments:true" in alloc_conf.replace(" ", "").lower():
        return "the trainer's CUDA allocator uses expandable segments (their IPC handles need pidfd_getfd)"
    return None


def chunk_messages(bucket: Bucket, model, entries, host: HostTensors | None):
    """The chunk messages of one streamed sync, in order, each as (message, file descriptors to pass after it, tensors
    it completes): the entries through `bucket`, those `host` keeps named in the last (weight_sync: shared), or with
    `host` None every entry through the bucket (weight_sync: host). The caller sends each and waits for the engine to
    acknowledge it before asking for the next (the bucket is filled again then)."""
    for pieces, last in bucket.pieces(host.split(model, entries) if host else entries):
        tail, fds = host.message(last) if host else ({}, [])
        done = sum(1 for p in pieces if p[4] + p[6] == p[3]) + (len(host.refs) if host and last else 0)
        if bucket.kind == "broadcast":  # the bytes of the bucket the caller broadcasts after sending the message
            tail["broadcast"] = max((p[5] + p[6] for p in pieces), default=0)
        yield {"op": "chunk", "pieces": pieces, "last": last, **tail}, fds, done


class Bucket:
    """A fixed buffer that weights travel through: `pieces(entries)` copies (name, tensor) entries into it and
    yields, each time it is full (and once at the end), the list of pieces now in it, each (name, dtype, shape, tensor
    bytes, offset in the tensor, offset in the bucket, bytes); the caller hands them to the reader and waits for it to
    copy them out before the next is filled. `sent_bytes` counts what was copied. Subclasses own `buffer` (a uint8
    tensor of `size` bytes) and say how the reader finds it (`where`)."""

    kind = ""
    buffer: torch.Tensor | None
    size: int
    sent_bytes: int = 0

    def where(self) -> dict:
        raise NotImplementedError

    def ready(self) -> None:
        """Wait until the copies into the buffer have landed (a GPU copies asynchronously)."""
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def send(self, msg: dict):
        """After the chunk message `msg` went to the engine: start handing it the bucket's bytes where they do not reach
        it by themselves (BroadcastBucket: returns the work in flight); None for a bucket both processes map."""
        return None

    def pieces(self, entries) -> Iterator[tuple[list[tuple], bool]]:
        """(pieces, last) per filled bucket; `last` is True for the final one (which may be empty)."""
        pending: list[tuple] = []
        used = 0
        for name, tensor in entries:
            t = tensor.detach().contiguous()
            raw = t.reshape(-1).view(torch.uint8)
            total = raw.numel()
            meta = (name, dtype_name(t.dtype), list(t.shape), total)
            done = 0
            while True:
                take = min(total - done, self.size - used)
                if take:
                    self.buffer[used:used + take].copy_(raw[done:done + take])
                pending.append((*meta, done, used, take))
                used += take
                done += take
                self.sent_bytes += take
                if used == self.size:
                    self.ready()
                    yield pending, False
                    pending, used = [], 0
                if done == total:
                    break
        self.ready()
        yield pending, True

    def close(self) -> None:
        self.buffer = None


class SharedBucket(Bucket):
    """The bucket in host shared memory: a file of `size` bytes at `path` (in /dev/shm) that both processes map."""

    kind = "shared_memory"

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # its pages taken now: a full /dev/shm is an error here, not a SIGBUS later
            self._map = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.sent_bytes = 0

    def where(self) -> dict:
        return {"path": self.path}

    def close(self) -> None:
        self.buffer = None
        unmap(self._map)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def unmap(mapping: mmap.mmap) -> None:
    """A bucket's mapping closed, unless a view of it is still alive somewhere (it then goes with the last view)."""
    try:
        mapping.close()
    except BufferError:
        pass


class CudaBucket(Bucket):
    """GPU only (no CPU twin can run it; SharedBucket is the tested stand-in): the bucket in the trainer's GPU memory,
    handed to the engine once as a CUDA IPC handle (torch's own `reduce_tensor`, as torch.multiprocessing and vLLM's
    IPC weight transfer use it) with the GPU's UUID, which the engine maps to its own device index (its
    CUDA_VISIBLE_DEVICES numbers GPUs differently)."""

    kind = "cuda_ipc"

    def __init__(self, size: int, device: torch.device):
        from torch.multiprocessing.reductions import reduce_tensor

        self.size, self.sent_bytes = size, 0
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(self.buffer)  # once: the handle stays valid while the buffer lives
        self._handle = {"uuid": str(torch.cuda.get_device_properties(device).uuid), "args": list(args)}

    def where(self) -> dict:
        return {"cuda": self._handle}

    def close(self) -> None:
        self.buffer = None
        torch.cuda.ipc_collect()  # the memory returns to the allocator once the engine has let go of it


class BroadcastBucket(Bucket):
    """The bucket in the trainer's own memory, sent to the engine by a broadcast in a process group of two (the
    trainer, rank 0, and the engine, rank 1; apart from training's, which it never touches): NCCL from the trainer's
    GPU to the engine's (separate GPUs, no host copy; never run in this project: vLLM's CUDA build cannot be carried
    to the lent GPU), gloo on a CPU (the tested twin). `store_path`: the group's rendezvous, a file store in the engine's
    private directory that the engine joins too (VLLMEngine._join_broadcast); the constructor waits for it."""

    kind = "broadcast"

    def __init__(self, size: int, device: torch.device, store_path: str, timeout_s: float):
        import datetime

        import torch.distributed as dist

        store = dist.FileStore(store_path, 2)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.size, self.sent_bytes, self.store = size, 0, store
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, 0, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(store, 0, 2, timeout)

    def where(self) -> dict:
        return {"broadcast": True}

    def send(self, msg: dict):
        """Start broadcasting the bucket's first msg["broadcast"] bytes (the caller does once the engine has said it
        waits in the broadcast: gloo cannot drop a broadcast its peer never joins); returns the work to wait on."""
        n = msg.get("broadcast", 0)
        return self.group.broadcast(self.buffer[:n], 0) if n else None

    def abort(self) -> None:
        """After a failed sync: the group aborted (under NCCL a broadcast left half-way would hold the GPU stream that
        every later collective queues behind), the bucket unusable."""
        with contextlib.suppress(Exception):
            self.group.abort()
        self.buffer = self.group = self.store = None

    def close(self) -> None:
        self.buffer = None
        with contextlib.suppress(Exception):  # an engine already gone: nothing left to tell it
            self.group.shutdown()
        self.group = self.store = None
