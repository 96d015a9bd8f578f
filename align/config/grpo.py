"""The `grpo` stage type: Group Relative Policy Optimization with TRL's GRPOTrainer (align/stages/grpo.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config.online_rl import OnlineRLStage
from align.core.schema import one_of, ranged

# TRL GRPOConfig.loss_type values align passes (tests check they still exist in the installed TRL); cispo reads
# epsilon_high as its cap on the importance weights, set for it below.
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo")
CISPO_EPSILON_MAX = 5.0  # ScaleRL's (Khatri et al. 2025) and TRL's recommended epsilon_max for cispo


@dataclass
class GRPOStage(OnlineRLStage):
    """GRPO (Shao et al. 2024, DeepSeekMath): advantage = (score - group mean) / group std, clipped ratio, KL
    to the reference in the loss."""

    TYPE: ClassVar[str] = "grpo"
    ALGORITHM: ClassVar[str] = "GRPO"
    CLIPS: ClassVar[tuple[str, ...]] = ("epsilon", "epsilon_high")

    beta: float = ranged(0.04, ge=0, fix="a negative coefficient rewards moving away from the reference")
    """KL coefficient to the reference in the loss (0.04 in Shao et al. 2024; 0 = no reference is held)."""
    loss_type: str = one_of("dapo", *GRPO_LOSSES)
    """How token losses are averaged (TRL): grpo (per sequence, then over sequences), dapo (over all tokens of
    the accumulated batch), dr_grpo (by a constant), bnpo, cispo, sapo."""
    scale_rewards: str = one_of("group", "group", "batch", "none")
    """Divide advantages by the group's score std (group, as in the paper), the batch's (batch), or not at all
    (none, as Dr. GRPO recommends)."""
    epsilon_high: float | None = ranged(None, gt=0, fix="use null for TRL's default")
    """The ratio's upper clip, 1 + epsilon_high (DAPO's clip-higher recommends 0.28; null: epsilon). For
    `loss_type: cispo` it is the cap on the importance weights themselves (ScaleRL's epsilon_max; null: 5.0, the
    value TRL recommends: epsilon's 0.2 would cap every weight at 0.2). `sapo` reads neither."""

    def check(self, ctx) -> None:
        super().check(ctx)
        if self.loss_type == "cispo" and self.epsilon_high is not None and self.epsilon_high <= 1:
            raise ValueError(f"epsilon_high: {self.epsilon_high:g} under loss_type: cispo caps the importance weights "
                             f"themselves (1 on policy), not the ratio's distance from 1 as DAPO's clip-higher does: "
                             f"every token's gradient would be scaled by about {self.epsilon_high:g}; use null "
                             f"(ScaleRL's {CISPO_EPSILON_MAX:g}) or a cap above 1")

    def unread_settings(self) -> dict[str, str]:
        """TRL 1.16's GRPO loss: cispo caps the weights at epsilon_high alone; sapo's soft gate reads neither."""
        clip = {"cispo": ("epsilon",), "sapo": ("epsilon", "epsilon_high")}.get(self.loss_type, ())
        return {**super().unread_settings(), **dict.fromkeys(clip, f"loss_type {self.loss_type} does not read it")}

    def trl_epsilon_high(self) -> float | None:
        """What TRL's GRPOConfig takes as epsilon_high (None: its default, epsilon)."""
        return self.epsilon_high if self.epsilon_high is not None else \
            (CISPO_EPSILON_MAX if self.loss_type == "cispo" else None)
