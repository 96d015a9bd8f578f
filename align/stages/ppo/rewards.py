"""Frozen models PPO serves from a trained model's base (LoRA): the reference, and with value_init: reward the
reward model. PPO's scores come from the one judge builder (align/judges/pointwise.py): a reward model reads the
sampled token ids at the last real token, a Python judge the decoded text; the score is then normalised
(`reward_normalization`) and the missing-EOS penalty subtracted, both reported apart from the score.
"""

from __future__ import annotations

import torch

from align.modeling.generation import scalar_outputs
from align.modeling.lora import without_peft


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
