"""GRPO stage: TRL's GRPOTrainer from the SFT policy, against a reward stage or Python judges, with a KL to
the reference in the loss (Shao et al. 2024). The shared run is align/stages/online_rl.py."""

from __future__ import annotations

from typing import Any

from align.config.grpo import GRPOStage
from align.stages import online_rl
from align.runtime.context import StageContext

OUTPUTS = ["model"]


def run(ctx: StageContext) -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer  # heavy: stage processes only

    cfg: GRPOStage = ctx.cfg  # type: ignore[assignment]
    return online_rl.run(ctx, GRPOTrainer, GRPOConfig, loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards,
                         epsilon_high=cfg.trl_epsilon_high())
