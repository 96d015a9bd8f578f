"""The vLLM engine's streamed weight sync, trainer side (`BucketSync`, a part of vllm.VLLMEngine): which bucket the
weights travel through (buckets.py: CUDA IPC on the engine's GPU, /dev/shm, a broadcast to an engine on other GPUs,
the node's bucket under ZeRO-3: node_bucket.py), and the stream of chunks through it, the whole sync within one
deadline. A CUDA IPC handle the engine cannot open falls back to /dev/shm; any other failure part-way leaves the
engine marked broken (it holds a mix of old and new weights)."""

from __future__ import annotations

import os
import time

import torch

from align.engines import EngineError, node_bucket
from align.engines.buckets import (BroadcastBucket, Bucket, CudaBucket, SharedBucket, chunk_messages, sync_transport)
from align.engines.vllm_client import BucketUnopened
from align.engines.vllm_env import sync_space_problem
from align.engines.weight_sync import HostTensors, engine_entries, finish_gathers, partitioned


class BucketSync:
    """VLLMEngine's bucket transports; it owns the connection (`_send`, `_reply`: vllm_client.EngineClient), the
    engine's directory, `bucket_bytes`, `weight_sync`, `devices` and the sync's state (`_bucket`, `_held`,
    `ipc_problem`, `last_sync`)."""

    node_sync = True  # ZeRO-3 partitions in host memory, one node: through the node's bucket (False: gather)

    def _open_bucket(self, model) -> Bucket:
        """The sync bucket for `model`'s weights (align/engines/weight_sync.py `bucket_kind`): on its GPU when the
        engine runs there (CUDA IPC), else in /dev/shm; reopened when the size or the place changes."""
        device = next(model.parameters()).device
        kind = self._transport(device)
        if self._bucket is not None and (self._bucket.size, self._bucket.kind) != (self.bucket_bytes, kind):
            self._bucket.close()
            self._bucket = None
        if self._bucket is None and kind == "broadcast":
            self._bucket = self._join_broadcast(device)
        if self._bucket is None and kind == "cuda_ipc":
            try:
                self._bucket = CudaBucket(self.bucket_bytes, device)
            except RuntimeError as exc:  # CUDA IPC not allowed here (WSL, some containers): /dev/shm instead
                self.ipc_problem = f"CUDA IPC failed on this machine ({str(exc).splitlines()[0][:200]})"
                print(f"vLLM weight sync: {self.ipc_problem}; syncing through /dev/shm", flush=True)
                kind = "shared_memory"
        if self._bucket is None:
            problem = sync_space_problem(self._dir, self.bucket_bytes)
            if problem:
                raise EngineError(f"vLLM engine: {problem}, or a smaller generation.sync_bucket_mib")
            self._bucket = SharedBucket(self.bucket_path, self.bucket_bytes)
        return self._bucket

    def _join_broadcast(self, device: torch.device) -> BroadcastBucket:
        """A bucket sent by broadcast (weight_sync: broadcast): the engine is asked to join a process group of two with
        this process, through a file store in this engine's private directory; the bucket's group is made in a thread
        while the engine's answer is awaited, so a failure on either side is raised at once, not after the timeout."""
        import threading

        made: dict = {}
        path = os.path.join(self._dir, f"group{len(os.listdir(self._dir))}")

        def make():
            try:
                made["bucket"] = BroadcastBucket(self.bucket_bytes, device, path, self.timeout_s)
            except Exception as exc:
                made["error"] = exc

        self._send({"op": "join", "path": path, "backend": "nccl" if device.type == "cuda" else "gloo",
                    "timeout_s": self.timeout_s}, "sync_weights")
        maker = threading.Thread(target=make, daemon=True)
        maker.start()
        try:
            self._reply("join", "sync_weights", time.monotonic() + self.timeout_s, failed=lambda: made.get("error"))
        except BaseException:
            self.broken = self.broken or "its process group for weight_sync: broadcast could not be made"
            raise
        maker.join(self.timeout_s)
        if "bucket" not in made:
            raise made.get("error") or EngineError(f"vLLM engine: the process group did not form in {self.timeout_s} s")
        return made["bucket"]

    def _sync_bucketed(self, model, changed_only: bool) -> int:
        """_sync_shared; where the engine cannot open the CUDA IPC handle of the bucket (a container without
        --ipc=host, a GPU it does not see), it loaded nothing: the sync goes again through /dev/shm, said once, and
        so do the later ones. Not under ZeRO-3 without the node's bucket: the other processes gathered each layer
        once with this one, and a second pass would wait for them."""
        held = dict(self._held)
        try:
            return self._sync_shared(model, changed_only)
        except BucketUnopened as exc:
            if self._bucket is None or self._bucket.kind != "cuda_ipc":
                raise
            self._bucket.close()
            self._bucket = None
            self._held.clear()  # storages this attempt shared went with the last chunk, which the engine dropped
            self._held.update(held)
            if partitioned(model):
                raise EngineError(f"{exc}; the bucket is on the GPU, shared by CUDA IPC: generation.weight_sync: "
                                  "host syncs through /dev/shm instead") from None
            self.ipc_problem = f"the engine could not open the trainer's CUDA IPC handle ({exc.args[0].split(': ', 1)[-1]})"
            print(f"vLLM weight sync: {self.ipc_problem}; syncing through /dev/shm", flush=True)
            return self._sync_shared(model, changed_only)

    def _sync_shared(self, model, changed_only: bool) -> int:
        """Stream the entries through the bucket: fill it, tell the engine what is where, wait until it has copied
        them out, fill it again; with `shared`, the weights that lie in host memory are not copied into it but named
        in the last message, read by the engine where they lie (HostTensors). The whole sync within one deadline."""
        node = (node_bucket.for_model(model, self.bucket_bytes, self.timeout_s, self._dir)  # made in process 0's
                if partitioned(model) and self.node_sync and self.weight_sync in node_bucket.SYNCS else None)
        entries = node_bucket.shares(model, changed_only) if node else engine_entries(model, changed_only=changed_only)
        names = 0
        host = HostTensors(self._held)  # not used by weight_sync: host, nor through the node's bucket
        chunks = chunk_messages(node, model, entries, None) if node else iter(())  # lazy: run below, or drained
        try:
            bucket = node or self._open_bucket(model)
            deadline = time.monotonic() + self.timeout_s
            before = bucket.sent_bytes
            self._send({"op": "stream", **bucket.where(), "size": bucket.size, "partial": changed_only},
                       "sync_weights", deadline=deadline)
            if not node:
                chunks = chunk_messages(bucket, model, entries, host if self.weight_sync == "shared" else None)
            else:  # the node's bucket waits for each chunk's acknowledgement itself, after writing the next chunk
                node.loaded = lambda: self._reply("chunk", "sync_weights", deadline)
            for msg, fds, done in chunks:
                names += done
                self._send(msg, "sync_weights", fds=fds, deadline=deadline)
                if msg.get("broadcast"):  # once the engine waits in it (a broadcast it never joins would never end)
                    self._reply("ready", "sync_weights", deadline)
                    bucket.send(msg).wait()
                if not node:
                    self._reply("chunk", "sync_weights", deadline)
            reply = self._reply("stream", "sync_weights", deadline)
        except BaseException as exc:  # stopped halfway (here or there): the engine holds a mix of old and new weights
            if not isinstance(exc, BucketUnopened):  # (unless it never opened the bucket: then it loaded nothing)
                self.broken = self.broken or f"interrupted by {type(exc).__name__}"
            if self._bucket is not None and self._bucket.kind == "broadcast":  # its group may be half-way: not reused
                self._bucket.abort()
                self._bucket = None
            if isinstance(exc, Exception) and node:  # the other processes are still writing the node's bucket
                node.loaded = None
                node_bucket.drain(chunks)
            elif isinstance(exc, Exception):  # under ZeRO-3 the other processes are still gathering, layer by layer
                finish_gathers(entries, model)
            raise
        finally:
            if node:
                node.loaded = None  # no acknowledgement awaited after this (and no reference to this engine kept)
        if reply["tensors"] != names:  # the engine holds a mix of old and new weights: it must not sample again
            self.broken = f"sync_weights loaded {reply['tensors']} of {names} tensors"
            raise EngineError(f"vLLM engine: {self.broken}")
        if host.problem and host.problem != self.last_sync.get("host_problem"):
            print(f"vLLM weight sync: {host.problem}; the rest goes through the bucket", flush=True)
        self.last_sync = {**reply, "host_tensors": len(host.refs), "host_new": len(host.new),
                          "host_problem": host.problem, "node_bucket": node.size if node else 0}
        return bucket.sent_bytes - before + host.nbytes()  # bytes the engine loaded

    def _transport(self, device: torch.device) -> str:
        """The sync's transport for weights on `device`: buckets.sync_transport (said once when not the asked one)."""
        kind, problem = sync_transport(device, self.devices, self.weight_sync, torch.__version__, self.engine_torch,
                                       self.ipc_problem)
        if problem and not self.ipc_problem:
            self.ipc_problem = problem
            print(f"vLLM weight sync: {problem}; syncing through /dev/shm", flush=True)
        return kind

    def _bucket_plan(self) -> dict:
        """The bucket a sync will use (for the manifest, before the first sync): the trainer's current device."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.devices else torch.device("cpu")
        kind = self._transport(device)
        if self.last_sync.get("node_bucket"):  # ZeRO-3's partitions through the node's bucket (node_bucket.py)
            return {"sync_transport": "node_shared_memory", "sync_bucket_bytes": self.last_sync["node_bucket"],
                    "sync_path": node_bucket.opened_path()}
        return {"sync_bucket_bytes": self.bucket_bytes, "sync_transport": kind,
                **({"sync_path": self.bucket_path} if kind == "shared_memory" else {}),
                **({"cuda_ipc_not_used": self.ipc_problem} if self.ipc_problem else {})}

