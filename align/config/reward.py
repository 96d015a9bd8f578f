"""The `reward` stage type: a Bradley-Terry reward model (align/stages/reward.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config.contract import HeldModel, DATA, EXAMPLES, POLICY, REWARD_MODEL, CheckContext, StageBase, TrainedStage
from align.data.lengths import DROPS_LONG_PAIRS
from align.core.schema import ranged, step_size


@dataclass
class RewardStage(TrainedStage):
    """Pairwise (Bradley-Terry) reward model with TRL's RewardTrainer."""

    TYPE: ClassVar[str] = "reward"
    LENGTH_RULE = DROPS_LONG_PAIRS
    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy",)
    PROMPTS: ClassVar[str] = "train"
    PRODUCES: ClassVar[str] = REWARD_MODEL
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"init": (POLICY, True), "data": (DATA, False)}
    CARDS: ClassVar[dict[str, str]] = {"data": EXAMPLES}

    learning_rate: float = step_size(1e-5)
    """Peak learning rate: 1e-5, the order of InstructGPT's reward models (9e-6 for 6B; Ouyang et al. 2022,
    appendix C.2); a small model trained from scratch needs ~1e-4."""
    init: str = "sft"
    """Stage whose model/ initialises the reward model (a scalar head is added)."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    split: str = "train"
    """The split of `data` to train on (held-out accuracy is always measured on `test`). A preferences stage writes
    `train` (one best-vs-worst pair per prompt, what DPO reads) and `train_all_pairs` (every pair of a prompt's
    samples that is not a tie: about k(k-1)/2 per prompt from k samples, more comparisons at no extra sampling);
    for a card, one of its splits."""
    center_rewards_coefficient: float | None = ranged(None, gt=0, fix="0 adds nothing (TRL: 0 x the penalty); use null "
                                                      "for none")
    """Optional penalty keeping rewards centred at zero (TRL)."""

    def check(self, ctx: CheckContext) -> None:
        super().check(ctx)
        self.check_preference_card(ctx)
        if self.split == "test":
            raise ValueError("split: 'test' holds the held-out pairs the accuracy is measured on; train on 'train'")

    def card_split(self, fld: str) -> str:
        return self.split if fld == "data" else "train"

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        return [HeldModel("reward", "scalar", True)]

    def workload(self) -> tuple[int, int, int, int]:
        return 2 * self.per_device_batch_size, self.max_length, 0, 0  # chosen and rejected go through together
