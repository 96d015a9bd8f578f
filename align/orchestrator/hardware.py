"""The GPUs an estimate compares with (`align estimate`, `align run`'s preflight), asked without torch.

Precedence, per value: a command-line flag (`--gpus`, `--gpu-memory-gb`, `--nodes`), then the GPUs this process can
see (nvidia-smi), then the pipeline's `hardware:` section. So on a GPU machine the GPUs present win over
`hardware:` (which describes the cluster a pipeline is planned for, read where no GPU is visible: a login node), a
flag wins over both, and the table says so: `Hardware.detected` when the memory came from the GPUs present,
`Hardware.overrides` naming each `hardware:` value the GPUs present replaced.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from align.config import PipelineConfig

GB = 1e9
IN_USE = 2 ** 30
"""Memory processes hold on a GPU (nvidia-smi's memory.used) above which the preflight compares with what is left:
a leftover process of an earlier run, another tenant's job. Less is the driver's own."""


@dataclass
class Hardware:
    gpus_per_node: int | None
    gpu_memory: int | None  # bytes
    nodes: int
    detected: bool
    overrides: str = ""
    """The pipeline's `hardware:` values the GPUs present replaced, as the table prints them ("" when none)."""
    flag: bool = False
    """The memory came from `--gpu-memory-gb`."""
    free: int | None = None
    """Where other processes hold memory on a GPU here (over IN_USE): the least any GPU has left, what a stage gets
    (`capacity`); a vLLM engine still sizes its share from the whole memory, `gpu_memory`."""

    @property
    def capacity(self) -> int | None:
        """What a stage may use of a GPU: its memory, or what other processes leave of it."""
        return self.free if self.free is not None and self.gpu_memory else self.gpu_memory

    def describe(self) -> str:
        """The GPUs compared with and where their memory came from, as the estimate table's header says it."""
        origin = " (detected)" if self.detected else " (--gpu-memory-gb)" if self.flag else " (declared)"
        where = (f"{self.nodes} node(s) x {self.gpus_per_node or '?'} GPU(s), {self.gpu_memory / GB:.3g} GB each{origin}"
                 if self.gpu_memory else f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s) of unknown memory (give "
                 "--gpu-memory-gb)" if self.gpus_per_node else "no GPU present or declared")
        return where + (f"; {self.overrides}" if self.overrides else "")


def hardware(cfg: PipelineConfig, gpus_per_node: int | None = None, gpu_memory_gb: float | None = None,
             nodes: int | None = None) -> Hardware:
    """The GPUs to compare with: CLI flags first, then the GPUs present, then the pipeline's `hardware:`."""
    n, mem, detected = gpus_per_node, gpu_memory_gb, False
    declared = cfg.hardware
    replaced = []
    in_use = gpu_memory_in_use()  # a leftover process, another tenant: what they leave is what a stage gets
    present = [total for total, _ in in_use]
    free = min(t - h for t, h in in_use) if gpu_memory_gb is None and any(h for _, h in in_use) else None
    if present:
        if n is None:
            n = len(present)
            if declared.gpus_per_node not in (None, n):
                replaced.append(f"gpus_per_node {declared.gpus_per_node}")
        if mem is None:
            mem = min(present) / GB
            detected = True
            if declared.gpu_memory_gb not in (None, mem) and round(declared.gpu_memory_gb) != round(mem):
                replaced.append(f"gpu_memory_gb {declared.gpu_memory_gb:g}")
    n = n or declared.gpus_per_node
    mem = mem or declared.gpu_memory_gb
    overrides = "; ".join(filter(None, (
        f"the GPUs present replace the pipeline's hardware: {', '.join(replaced)}" if replaced else "",
        f"other processes hold memory on a GPU here: {free / 2 ** 30:.1f} GiB is left on the fullest, what a stage is "
        "compared with" if free is not None else "")))
    return Hardware(n, int(mem * GB) if mem else None, nodes or declared.nodes, detected, overrides,
                    flag=gpu_memory_gb is not None, free=free)


def gpu_memory_in_use() -> list[tuple[int, int]]:
    """(memory, memory other processes hold where over IN_USE, else 0) in bytes of each NVIDIA GPU this process may
    use, from one call of `nvidia-smi` (no torch: the orchestrator never imports it), restricted to
    CUDA_VISIBLE_DEVICES as CUDA reads it: indices or GPU UUIDs (a unique prefix names one), up to the first entry
    that names no GPU. MIG slices are not sized (nvidia-smi's memory.total is the whole GPU's): none is reported, and
    the pipeline's `hardware` or --gpus / --gpu-memory-gb decide. Empty without nvidia-smi or a GPU."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid,memory.total,memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus: dict[str, tuple[str, tuple[int, int]]] = {}  # index -> (uuid, (bytes, held))
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, uuid, mib, used = ([x.strip() for x in line.split(",")] + ["", "", ""])[:4]
        if index.isdigit() and mib.isdigit():
            held = int(used) * 2 ** 20 if used.isdigit() and int(used) * 2 ** 20 > IN_USE else 0
            gpus[index] = (uuid, (int(mib) * 2 ** 20, held))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [mem for _, mem in gpus.values()]
    kept: list[str] = []
    for v in (v.strip() for v in visible.split(",")):  # "-1" hides every GPU
        if v.startswith("MIG-"):
            return []
        match = [i for i, (uuid, _) in gpus.items() if uuid.startswith(v)] if v.startswith("GPU-") else \
            ([v] if v in gpus else [])
        if len(match) != 1 or match[0] in kept:
            break
        kept.append(match[0])
    return [gpus[i][1] for i in kept]
