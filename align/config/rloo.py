"""The `rloo` stage type: REINFORCE Leave-One-Out with TRL's RLOOTrainer (align/stages/rloo.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config.online_rl import OnlineRLStage
from align.core.schema import ranged


@dataclass
class RLOOStage(OnlineRLStage):
    """RLOO (Ahmadian et al. 2024): each completion's baseline is the mean score of the other completions of its
    prompt; the KL to the reference is subtracted from the score, as in PPO's reward."""

    TYPE: ClassVar[str] = "rloo"
    ALGORITHM: ClassVar[str] = "RLOO"

    beta: float = ranged(0.05, ge=0, fix="a negative coefficient rewards moving away from the reference")
    """KL coefficient: score - beta * KL(policy || reference) per completion (0 = no reference is held)."""
    normalize_advantages: bool = False
    """Scale advantages to mean 0, std 1 over each generation round."""
