"""The `dpo` stage type: direct preference optimisation (align/stages/dpo.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config.contract import HeldModel, DATA, EXAMPLES, POLICY, CheckContext, StageBase, TrainedStage
from align.data.lengths import TRUNCATES_PAIRS
from align.core.schema import one_of, ranged, step_size

# TRL DPOConfig.loss_type values for paired data (tests check they still exist in the installed TRL).
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "apo_zero", "apo_down", "discopop", "sigmoid_norm")


@dataclass
class DPOStage(TrainedStage):
    """Direct preference optimisation with TRL's DPOTrainer; reference = the starting policy."""

    TYPE: ClassVar[str] = "dpo"
    LENGTH_RULE = TRUNCATES_PAIRS
    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/accuracy", "eval/rewards/margin")
    PROMPTS: ClassVar[str] = "train"
    PRODUCES: ClassVar[str] = POLICY
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": (POLICY, True), "data": (DATA, False)}
    CARDS: ClassVar[dict[str, str]] = {"data": EXAMPLES}

    learning_rate: float = step_size(5e-7)
    """Peak learning rate. 5e-7 is the published recipe for DPO on 7B chat models (Tunstall et al. 2023, Zephyr);
    a small model trained from scratch (the demo) needs ~1e-4."""
    policy: str = "sft"
    """Stage whose model/ is both the starting policy and the frozen reference."""
    data: str = "preferences"
    """Preference pairs: a preferences stage or a data card path (preference form)."""
    beta: float = ranged(0.1, gt=0, fix="beta <= 0 trains the reversed (or no) KL-regularised objective")
    """KL strength beta of the DPO objective."""
    loss_type: str = one_of("sigmoid", *DPO_LOSSES)
    """TRL DPO loss variant: sigmoid (DPO), ipo, hinge, robust, ..."""
    label_smoothing: float = ranged(0.0, ge=0, lt=0.5, fix="0.5 or more flips which response is preferred")
    """Label smoothing epsilon (the chance a pair is flipped), for the losses that read it in TRL: robust
    (Chowdhury et al.), exo_pair (its epsilon, > 0), aot; the others ignore it, so it is refused there."""

    def check(self, ctx: CheckContext) -> None:
        super().check(ctx)
        reads = [t for t in ("robust", "exo_pair", "aot", "aot_unpaired") if t in DPO_LOSSES]
        if self.label_smoothing > 0 and self.loss_type not in reads:
            raise ValueError(f"label_smoothing: {self.label_smoothing} with loss_type: {self.loss_type}: TRL reads "
                             f"label_smoothing only for {', '.join(reads)} (the others train as if it were 0); set "
                             "loss_type: robust for noise-robust DPO, or label_smoothing: 0")
        if self.loss_type == "exo_pair" and self.label_smoothing == 0:
            raise ValueError("loss_type: exo_pair with label_smoothing: 0: EXO's epsilon must be above 0 (TRL refuses "
                             "0 once the models are loaded); set label_smoothing, e.g. 1.0e-3")
        if self.loss_type == "robust" and self.label_smoothing == 0:
            raise ValueError("loss_type: robust with label_smoothing: 0 is the sigmoid (DPO) loss, gradient for "
                             "gradient: robust DPO corrects for a flip rate epsilon; set label_smoothing to it (e.g. "
                             "0.1), or loss_type: sigmoid")
        self.check_preference_card(ctx)

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        if self.lora.enabled:  # TRL's reference is then the policy's base with its adapters disabled
            return [HeldModel("policy", "lm", True)]
        return [HeldModel("policy", "lm", True), HeldModel("reference", "lm", False)]  # TRL shards it under ZeRO-3

    def workload(self) -> tuple[int, int, int, int]:
        return 2 * self.per_device_batch_size, self.max_length, 0, 0  # chosen and rejected go through together
