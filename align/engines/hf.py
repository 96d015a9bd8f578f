"""The `hf` engine: `transformers.generate` with the stage's own model (align/modeling/generation.py), nothing to
sync. The default engine (align/engines/__init__.py DEFAULT)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager

from align.core import faults


class HFEngine:
    """Samples with the stage's own model. `context`, when given, is called for each batch and returns a context
    manager that yields the model to generate with (PPO under ZeRO-3 gathers the policy's parameters for the
    duration: align/stages/ppo/models.py policy_for_generation)."""

    name = "hf"
    holds_own_weights = False
    log_path = None

    def __init__(self, model, tokenizer, fast: bool = False, synced_gpus: bool = False,
                 context: Callable[[], ContextManager] | None = None, rank: int = 0):
        self.model, self.tokenizer, self.fast, self.synced_gpus = model, tokenizer, fast, synced_gpus
        self.context = context
        self._held = None  # the context's model while `holding` (several generates under one context)
        self.processor = faults.eos_processor(rank, getattr(tokenizer, "eos_token_id", None))  # None outside tests
        self.sync_seconds: list[float] = []

    def describe(self) -> dict | None:
        return None

    def generate(self, prompts, gen, seed, max_prompt_length=None, greedy=False):
        from align.modeling.generation import generate

        with (nullcontext(self._held) if self._held is not None else self.context() if self.context
              else nullcontext(self.model)) as model:
            return generate(model, self.tokenizer, prompts, gen, seed=seed, max_prompt_length=max_prompt_length,
                            synced_gpus=self.synced_gpus, logits_processor=self.processor, fast=self.fast,
                            greedy=greedy)

    @contextmanager
    def holding(self):
        """The generates within it share one `context` (base.holding: PPO's rollout in chunks, whose policy ZeRO-3
        gathers whole once for all of them, not once a chunk)."""
        if self.context is None or self._held is not None:
            yield
            return
        with self.context() as model:
            self._held = model
            try:
                yield
            finally:
                self._held = None

    def sync_weights(self, model) -> float:
        """Sample from `model` from now on (None: hold none, so a caller's last reference to it frees it)."""
        if self.context is None:
            self.model = model
        return 0.0

    def close(self) -> None:
        pass


def make(gen, *, model, tokenizer, fast=False, synced_gpus=False, context=None, rank=0, **_) -> HFEngine:
    """align/engines/__init__.py make_engine: the hf engine needs the stage's model, nothing of a model directory."""
    return HFEngine(model, tokenizer, fast=fast, synced_gpus=synced_gpus, context=context, rank=rank)
