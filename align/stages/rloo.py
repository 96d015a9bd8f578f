"""RLOO stage: TRL's RLOOTrainer from the SFT policy, against a reward stage or Python judges; the baseline of
each completion is the mean score of its prompt's other completions, and the KL to the reference is subtracted
from the score (Ahmadian et al. 2024). The shared run is align/stages/online_rl.py."""

from __future__ import annotations

from typing import Any

from align.config.rloo import RLOOStage
from align.stages import online_rl
from align.runtime.context import StageContext

OUTPUTS = ["model"]


def run(ctx: StageContext) -> dict[str, Any]:
    from trl import RLOOConfig, RLOOTrainer  # heavy: stage processes only

    cfg: RLOOStage = ctx.cfg  # type: ignore[assignment]
    return online_rl.run(ctx, RLOOTrainer, RLOOConfig, normalize_advantages=cfg.normalize_advantages)
