"""Where and in what precision a stage computes: one object, resolved once per stage process from the
pipeline's `precision` and `attn_implementation` settings, used by every stage for every model it loads,
every training step, every rollout and every score (so samples are scored by the numerics that produced them).

- device: the process's accelerator device (cuda:<local rank> on a GPU machine, else cpu).
- precision: `auto` is bfloat16 autocast on a GPU that supports it and float32 elsewhere (CPUs without bf16
  units run bf16 autocast several times slower: measured 3.4 s vs 0.53 s per SFT step of the default model).
  Weights stay in the pipeline's `dtype`; autocast is mixed precision (fp32 master weights for training).
- attn_implementation: `auto` leaves it to transformers (SDPA where the family supports it).
- fast generation (`generation.fast`): a static KV cache, which transformers compiles with torch.compile on a
  GPU, and prompts padded to a multiple of FAST_PAD_MULTIPLE so a few shapes cover every batch. `auto` turns it
  on on a GPU outside ZeRO-3 (where generation runs with hooks removed and shapes vary per rank), off on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


FAST_PAD_MULTIPLE = 32


@dataclass(frozen=True)
class Compute:
    """Device, autocast dtype and attention kernel of one stage process."""

    device: Any  # torch.device
    dtype: Any  # torch dtype of autocast, or None for float32
    attn_implementation: str | None
    distributed_zero3: bool = False

    @property
    def mixed_precision(self) -> str:
        """accelerate / Trainer spelling: no | bf16 | fp16."""
        import torch

        return {None: "no", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self):
        """Autocast in the stage's precision (a no-op context in float32)."""
        import torch

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def engine_dtype(self) -> str:
        """The dtype a separate rollout engine (vllm) holds the weights in: the stage's autocast dtype, else float32."""
        return {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.mixed_precision]

    def fast_generation(self, setting: str) -> bool:
        """Whether `generation.fast` (auto | on | off) is on for this process."""
        if setting == "auto":
            return self.device.type == "cuda" and not self.distributed_zero3
        return setting == "on"

    def resource_metrics(self, seconds: float) -> dict[str, float]:
        """A stage's wall time in `run`, the peak resident host memory of any of its processes, and on a GPU the
        peak memory allocated by PyTorch on any of them (what `align estimate` predicts, less the CUDA context and
        allocator slack). Collective when distributed."""
        import torch

        import resource

        out = {"perf/stage_seconds": seconds}
        # host memory: the largest resident set of any of the stage's processes (Linux reports KiB)
        rss = torch.tensor(float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, device=self.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
        out["perf/peak_host_rss_gb"] = rss.item() / 1e9
        if self.device.type == "cuda":
            peak = torch.tensor(float(torch.cuda.max_memory_allocated(self.device)), device=self.device)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
            out["perf/peak_memory_gb"] = peak.item() / 1e9
            out["perf/peak_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 1e9
        return out

    def model_kwargs(self) -> dict[str, Any]:
        """Extra from_pretrained / config arguments (the attention kernel when one is asked for)."""
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}


def resolve(precision: str = "auto", attn_implementation: str = "auto", device: Any = None,
            zero3: bool = False) -> Compute:
    """The Compute of this process. `device` defaults to cuda (when present) or cpu."""
    import torch

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    on_gpu = device.type == "cuda"
    if precision == "auto":
        dtype = torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else None
    else:
        dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    attn = None if attn_implementation == "auto" else attn_implementation
    return Compute(device, dtype, attn, zero3)


def padded_attention_problem(device_type: str, kernel: str, packs: bool) -> str | None:
    """Why a stage's trained models must leave SDPA for eager attention (None: they need not). On a GPU, a batch with
    left padding has query rows that attend to nothing (the prompts' padding in PPO's, GRPO's and RLOO's batches;
    TRL's DPO and KTO flush their rows left and SFT and reward pad on the right, so each of their rows attends to
    something), and CUDA's SDPA kernels give NaN gradients for such rows (PPO's H100 run in bf16; reproduced on CPU
    with a stand-in kernel in tests/test_packing.py). Padding-free forwards have no such rows, so only a stage whose
    trained forwards run padded (`padding_free: false`, or a family that cannot pack) leaves SDPA."""
    if device_type != "cuda" or kernel != "sdpa" or packs:
        return None
    return ("its forwards run padded (padding_free is off, or the family cannot pack), and SDPA's CUDA kernels give "
            "NaN gradients for left padding's query rows: eager attention instead")


def leave_sdpa_if_padded(model, device_type: str, packs: bool, stage: str) -> str | None:
    """Switch a left-padded stage's trained model to eager attention where `padded_attention_problem` says so
    (`packs`: whether this model's forwards run padding-free); returns the reason (None: left as it is)."""
    from align.core.errors import ModelError
    from align.modeling.packing import attention_kernel, base_and_backbone

    if (why := padded_attention_problem(device_type, attention_kernel(model), packs)) is None:
        return None
    base = base_and_backbone(model)[0]  # peft's wrapper: the model within
    base.set_attn_implementation("eager")
    if attention_kernel(base) != "eager":  # transformers only warns for a family it cannot switch
        raise ModelError(f"{stage}: {why}, but {type(base).__name__} cannot switch its attention: set padding_free: "
                         "true, or attn_implementation: eager")
    return why
