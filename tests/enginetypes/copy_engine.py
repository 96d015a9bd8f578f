"""A rollout engine defined outside align: `copy`, the worked example of adding an engine (docs/ARCHITECTURE.md).

It holds its own copy of the policy, in this process: loaded with transformers from the model directory the stage
names, synced by copying the training model's state after every update, sampling with transformers.generate and
returning its own log-probs of what it sampled (as vLLM does), so the stages check it against the trainer like any
engine that is not the training model. This file is the whole engine: its kind registers it when a process imports
it (ALIGN_ENGINE_MODULES=copy_engine), and align's stages, `align validate` and `align estimate` take it from the
registry; nothing under align/ names it.
"""

from __future__ import annotations

import time
from pathlib import Path

from align.engines import EngineKind, register

KIND = register(EngineKind("copy", __name__, own_copy=True, sleeps=True))


class CopyEngine:
    name = "copy"
    holds_own_weights = True

    def __init__(self, model_dir: str, tokenizer, log_path=None, sleeps: bool = False):
        from align.modeling.models import load_causal_lm

        self.model = load_causal_lm(model_dir).eval()
        self.tokenizer, self.log_path = tokenizer, Path(log_path) if log_path else None
        self.sync_seconds: list[float] = []
        self.sleeps, self._stash = sleeps, None  # generation.sleep: the copy's weights, put away while asleep
        self._log(f"start {model_dir}")

    def sleep(self) -> None:
        """generation.sleep, as vLLM's level 1 does it: the copy is put away (vLLM moves it to host memory) and the
        engine has no model until `_wake` gives it back, so sampling while asleep cannot silently work."""
        if not self.sleeps or self._stash is not None:
            return
        self._stash, self.model = self.model, None
        self._log("sleep")

    def _wake(self) -> None:
        if self._stash is not None:
            self.model, self._stash = self._stash, None
            self._log("wake")

    def _log(self, line: str) -> None:
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def describe(self) -> dict:
        return {"kind": self.name, "parameters": sum(p.numel() for p in self.model.parameters())}

    def generate(self, prompts, gen, seed, max_prompt_length=None, greedy=False):
        import torch

        from align.modeling.generation import generate, response_logprobs

        self._wake()
        r = generate(self.model, self.tokenizer, prompts, gen, seed=seed, max_prompt_length=max_prompt_length,
                     greedy=greedy)
        with torch.no_grad():
            r.engine_logprobs = response_logprobs(self.model, r, gen.temperature)
        self._log(f"generate {len(prompts)}")
        return r

    def sync_weights(self, model) -> float:
        t0 = time.perf_counter()
        self._wake()
        self.model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        self.sync_seconds.append(time.perf_counter() - t0)
        self._log("sync")
        return self.sync_seconds[-1]

    def close(self) -> None:
        self._log("close")


def make(gen, *, tokenizer, model_dir, log_path=None, **_) -> CopyEngine:
    return CopyEngine(model_dir, tokenizer, log_path, sleeps=gen.sleep)
