"""Step 2 of PPO: the score of each sampled response, from reward models and/or Python judges.

A reward model reads the sampled token ids directly, at the last real token (no detokenise/retokenise
round trip; the policy and reward tokenizers must agree). A Python judge (`vader`, `module:function`) reads
the decoded prompt and response text. Several are summed with their weights. The score is then normalised
(`reward_normalization`) and the missing-EOS penalty subtracted; both are reported apart from the score.
"""

from __future__ import annotations

from typing import Callable

import torch

from align.modeling.generation import Rollout, scalar_outputs
from align.core.judges import judge_weights, python_judge
from align.modeling.losses import last_token_index
from align.modeling.models import without_peft

ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, mask) (B, T) -> per-token scores (B, T)


class FrozenView:
    """A frozen model served by a LoRA-adapted model's base weights: every call runs inside peft's
    `disable_adapter()`, so PPO's reference (the policy's base) and, with value_init: reward, the reward model
    (the value model's base, whose original scalar head peft keeps beside the trained copy) cost no second copy
    of the weights."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, **inputs):
        """The causal LM's forward pass with the adapters off (reference log-probs)."""
        with self.peft_model.disable_adapter():
            return self.peft_model(**inputs)

    def scalar_outputs(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token scalar-head outputs (B, T) with the adapters off (reward-model scores)."""
        with self.peft_model.disable_adapter():
            return scalar_outputs(without_peft(self.peft_model), ids, mask)

    def parameters(self):
        return self.peft_model.parameters()


class Scorer:
    """sum_i w_i * score_i(prompt, response) over reward models (token ids) and Python judges (text)."""

    def __init__(self, reward_models: dict[str, tuple[float, ScoreFn]], judges: dict[str, tuple[float, object]],
                 tokenizer):
        self.reward_models, self.judges, self.tokenizer = reward_models, judges, tokenizer

    @classmethod
    def build(cls, spec, reward_model_of, tokenizer) -> "Scorer":
        """`reward_model_of(name)` gives a reward stage's scoring function (ids, mask) -> (B, T) (a model prepared
        for this backend, or a FrozenView's `scalar_outputs`), or None for a Python judge."""
        models, judges = {}, {}
        for name, weight in judge_weights(spec).items():
            model = reward_model_of(name)
            if model is not None:
                models[name] = (weight, model)
            else:
                judges[name] = (weight, python_judge(name))
        return cls(models, judges, tokenizer)

    @torch.no_grad()
    def __call__(self, r: Rollout, prompts: list[str]) -> torch.Tensor:
        ids, mask = r.input_ids, r.attention_mask
        total = torch.zeros(ids.size(0), device=ids.device)
        if self.reward_models:
            last = last_token_index(ids, mask, self.tokenizer.pad_token_id)
            for weight, score_fn in self.reward_models.values():
                total += weight * score_fn(ids, mask)[torch.arange(ids.size(0)), last]
        if self.judges:
            texts = r.texts(self.tokenizer)
            for weight, judge in self.judges.values():
                total += weight * torch.tensor(judge(prompts, texts), dtype=torch.float32, device=ids.device)
        return total
