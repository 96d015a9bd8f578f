"""The engine's side of the sync bucket (align/engines/buckets.py is the trainer's): the bucket a `stream` request
names, opened once and kept while the trainer names the same one: a file in /dev/shm mapped, the trainer's GPU buffer
from its CUDA IPC handle, or this process's own buffer that the trainer's broadcasts fill. Runs in vLLM's environment
beside align_vllm_server.py and imports nothing of align."""

from __future__ import annotations

import os

_BUCKETS: dict = {}


def bucket(msg: dict):
    """The trainer's bucket as a uint8 tensor, opened once per bucket: the file at msg["path"] in /dev/shm mapped, or
    the trainer's GPU buffer opened from its CUDA IPC handle (msg["cuda"])."""
    size, path = msg["size"], msg.get("path")  # a file by its identity: one made again at the same path is another
    key = (path, os.stat(path)[1:3] if path else None, repr(msg["cuda"]["args"]) if msg.get("cuda") else None, size,
           bool(msg.get("broadcast")))
    if _BUCKETS.get("key") != key:
        import torch

        _BUCKETS.clear()  # the old bucket's mapping goes before the new one opens
        if msg.get("broadcast"):  # this process's own, filled by the trainer's broadcasts (receive)
            tensor = torch.empty(size, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
        elif msg.get("cuda"):
            tensor = cuda_bucket(msg["cuda"])
        else:
            import mmap

            with open(msg["path"], "r+b") as f:
                tensor = torch.frombuffer(mmap.mmap(f.fileno(), size), dtype=torch.uint8)
        if tensor.numel() != size:
            raise RuntimeError(f"weight bucket: {tensor.numel()} bytes opened, {size} announced")
        _BUCKETS.update(key=key, tensor=tensor)
    return _BUCKETS["tensor"]


def release_cached(msg: dict) -> None:
    """After a sync through a GPU bucket: the tensors copied out of it were handed to vLLM; what its allocator still
    caches goes back to the GPU the trainer shares (gpu_memory_utilization does not count it)."""
    if msg.get("cuda"):
        import torch

        torch.cuda.empty_cache()


def cuda_bucket(handle: dict):
    """GPU only: the trainer's bucket opened from its CUDA IPC handle (torch's `rebuild_cuda_tensor`, the inverse of
    the `reduce_tensor` that made it), on this process's index of the GPU with the handle's UUID."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    return rebuild_cuda_tensor(*on_device(handle["args"], local_gpu(handle["uuid"], uuids)))


def local_gpu(uuid: str, uuids: list[str]) -> int:
    """This process's index of the GPU `uuid` among the GPUs it sees (`uuids`, in index order)."""
    if uuid not in uuids:
        raise RuntimeError(f"weight bucket: the trainer's GPU {uuid} is not among the engine's "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); CUDA IPC needs the "
                           "engine on the trainer's GPU: set generation.weight_sync: host")
    return uuids.index(uuid)


STORAGE_DEVICE = 6
"""Where `reduce_tensor`'s arguments for `rebuild_cuda_tensor` hold the storage's device index (torch's
torch/multiprocessing/reductions.py; vLLM's IPC weight transfer rewrites the same place)."""


def on_device(args: list, index: int) -> list:
    """rebuild_cuda_tensor's arguments with the device index this process knows the GPU by."""
    out = list(args)
    out[STORAGE_DEVICE] = index
    return out


def forget() -> None:
    """Let go of the bucket opened last (the engine is closing: a GPU bucket's memory goes back to the trainer)."""
    _BUCKETS.clear()
