"""What an engine declares about itself (EngineKind) and the error every engine ends a stage with: torch-free, read
by `align validate` and `align estimate` through the registry (align/engines/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class EngineError(RuntimeError):
    """The rollout engine failed, did not start, or did not answer in time; the stage ends with this."""


def _no_problem(where: str, head_dim: Callable[[], int | None]) -> str | None:
    return None


@dataclass(frozen=True)
class EngineKind:
    """What the rest of align knows of an engine without importing it."""

    name: str
    """What `generation.engine` says to select it."""
    module: str
    """Import name of the module whose `make(gen, **kwargs)` builds it (make_engine's keywords)."""
    own_copy: bool = False
    """Runs apart from training with its own copy of the policy: started from a model directory (whole weights, not a
    LoRA adapter), synced after every update, its memory counted apart by `align estimate`. False: it samples with the
    stage's own model."""
    token_ids: bool = False
    """Samples prompts given as token ids (`generate_ids(query_ids, query_mask, gen, seed, greedy)`), as TRL's GRPO
    and RLOO hold them, and returns its own log-probs of its samples (`engine_logprobs`, which TRL's rollout_func
    requires): what those stage types need of an engine with its own copy (align/stages/online_rl.py)."""
    adapters: bool = False
    """Applies a LoRA policy's adapters itself (`generation.lora_sync: adapter`: started with `lora_rank`, synced
    with the adapters alone)."""
    sleeps: bool = False
    """Frees its memory while the policy trains (`generation.sleep`: `sleep()`, woken by its next sync or sample)."""
    sleep_needs_gpu: bool = False
    """Its sleep works on a GPU only (vLLM's sleep mode): refused before launch on a machine without one."""
    problems: Callable[[str, Callable[[], int | None]], str | None] = _no_problem
    """Why it cannot run on this machine (not installed, a model it cannot serve here), or None; `head_dim` gives the
    model's attention head size (None when unknown), asked only when needed. `where` names the setting."""
    memory: Callable[[Any, int, int, int | None], int] | None = None
    """Bytes it holds per GPU while sampling, from (generation settings, the policy's weights in bytes, the KV cache of
    one generation batch, the GPU's memory or None on a CPU); None: the KV cache, and the weights too when it holds
    its own copy (`sampling_bytes`)."""

    def sampling_bytes(self, gen: Any, weights_bytes: int, kv_bytes: int, gpu_memory: int | None) -> int:
        if self.memory is not None:
            return self.memory(gen, weights_bytes, kv_bytes, gpu_memory)
        return kv_bytes + (weights_bytes if self.own_copy else 0)


class OnDevice:
    """The seam between an engine and the training device: every rollout an engine returns is moved to `device` here,
    once, whatever the engine (vLLM's process returns CPU tensors; the hf engine samples on the device already, and
    the move is then free). Everything else is the engine's own (`make_engine` wraps every engine it makes)."""

    def __init__(self, engine, device):
        self.engine, self.device = engine, device

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs).to(self.device)

    def generate_ids(self, *args, **kwargs):
        return self.engine.generate_ids(*args, **kwargs).to(self.device)
