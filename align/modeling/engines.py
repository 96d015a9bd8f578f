"""Rollout engines: one seam between the stages that sample (PPO, preferences, evaluate) and what samples.

    engine.generate(prompts, gen, seed)  -> Rollout (token ids, masks; `engine_logprobs` where the engine has them)
    engine.sync_weights(model)           after optimiser steps: the engine samples from `model`'s weights from then on
    engine.close()

and declares what its callers need, so no stage tests an engine's class or name: `holds_own_weights` (a copy to sync
after every update), `describe()` (what the manifest records of it; None for nothing worth recording), `log_path`
(where its own log is, None when it has none) and `sync_seconds` (one entry per sync).

`hf` samples with the training model itself through `transformers.generate` (align/modeling/generation.py): there is
nothing to sync. `vllm` runs vLLM in its own process and environment (align/modeling/vllm_engine.py). Training code
recomputes log-probs with the training model either way and logs the engine-vs-trainer gap (`logprob_gap`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, ContextManager, Protocol

import torch

if TYPE_CHECKING:
    from align.config import Generation
    from align.modeling.generation import Rollout

from align.core.engine_env import ENGINES, EngineError, VLLM_INSTALL, vllm_python  # noqa: F401  (re-exported)


class RolloutEngine(Protocol):
    name: str
    holds_own_weights: bool
    log_path: object
    sync_seconds: list[float]

    def describe(self) -> dict | None: ...

    def generate(self, prompts: list[str], gen: Generation, seed: int, max_prompt_length: int | None = None,
                 greedy: bool = False) -> Rollout: ...

    def sync_weights(self, model) -> float: ...

    def close(self) -> None: ...


class HFEngine:
    """`transformers.generate` with the stage's own model: nothing to sync. `context`, when given, is called for each
    batch and returns a context manager that yields the model to generate with (PPO under ZeRO-3 gathers the
    policy's parameters for the duration: align/stages/ppo/models.py policy_for_generation)."""

    name = "hf"
    holds_own_weights = False
    log_path = None

    def __init__(self, model, tokenizer, fast: bool = False, synced_gpus: bool = False,
                 context: Callable[[], ContextManager] | None = None, eos_override: str | None = None):
        self.model, self.tokenizer, self.fast, self.synced_gpus = model, tokenizer, fast, synced_gpus
        self.context = context
        self.eos_override = eos_override  # fault injection (tests): align/modeling/generation.py EOSOverride
        self.sync_seconds: list[float] = []

    def describe(self) -> dict | None:
        return None

    def generate(self, prompts, gen, seed, max_prompt_length=None, greedy=False):
        from align.modeling.generation import generate

        with (self.context() if self.context else nullcontext(self.model)) as model:
            return generate(model, self.tokenizer, prompts, gen, seed=seed, max_prompt_length=max_prompt_length,
                            synced_gpus=self.synced_gpus, eos_override=self.eos_override, fast=self.fast,
                            greedy=greedy)

    def sync_weights(self, model) -> float:
        if self.context is None:
            self.model = model
        return 0.0

    def close(self) -> None:
        pass


def logprob_gap(engine_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |engine - trainer| log-prob over the response tokens (mask 1): how far the engine's sampling
    distribution is from the one the trainer optimises (a drift here biases every importance ratio)."""
    m = mask.bool()
    if not m.any():
        return {"mean": 0.0, "max": 0.0}
    d = (engine_logprobs.float() - trainer_logprobs.float()).abs()[m]
    return {"mean": d.mean().item(), "max": d.max().item()}


def nan_max(values) -> float:
    """The largest of `values`, NaN when any is NaN (Python's max skips NaN depending on where it falls: a summary
    must never report a clean maximum over a broken one)."""
    values = [float(v) for v in values]
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def check_gap(gap: float, bound: float, where: str, log_path) -> None:
    """Stop when the engine's log-probs of its own samples stray from the trainer's: non-finite (a weight sync that
    loaded wrongly), or above `bound` nats on some token (a sync that did not reach it, a dtype or kernel mismatch)."""
    if math.isfinite(gap) and gap <= bound:
        return
    raise EngineError(f"{where}: the rollout engine's log-probs differ from the trained model's by {gap} on a sampled "
                      f"token (more than generation.max_logprob_gap={bound:g}): the engine is not sampling from the "
                      f"weights being trained (a failed or partial weight sync); its log: {log_path}")


def test_eos_override(rank: int) -> str | None:
    """Fault injection for the distributed tests (tests/test_distributed.py): the ranks listed in
    ALIGN_TEST_EOS_FIRST_RANKS end every response at once, those in ALIGN_TEST_EOS_NEVER_RANKS run to the length
    limit. Unset (always, outside the tests): None."""
    import os

    for mode in ("first", "never"):
        if str(rank) in os.environ.get(f"ALIGN_TEST_EOS_{mode.upper()}_RANKS", "").split(","):
            return mode
    return None


def make_engine(gen: Generation, *, model, tokenizer, model_dir: str, fast: bool = False, synced_gpus: bool = False,
                context: Callable[[], ContextManager] | None = None, seed: int = 0, dtype: str = "float32",
                max_model_len: int = 512, log_path=None, rank: int = 0) -> RolloutEngine:
    """The engine `gen.engine` names. `model`: what the hf engine samples with; `model_dir`: the Hugging Face
    directory vLLM starts from (the training model's own weights reach it by `sync_weights`)."""
    if gen.engine == "hf":
        return HFEngine(model, tokenizer, fast=fast, synced_gpus=synced_gpus, context=context,
                        eos_override=test_eos_override(rank))
    if gen.engine == "vllm":
        from align.modeling.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, tokenizer, seed=seed, dtype=dtype, max_model_len=max_model_len,
                          kv_cache_gib=gen.kv_cache_gib, gpu_memory_utilization=gen.gpu_memory_utilization,
                          log_path=log_path, timeout_s=gen.engine_timeout_s)
    raise ValueError(f"generation.engine: unknown engine {gen.engine!r}; choose one of {', '.join(ENGINES)}")
