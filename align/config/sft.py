"""The `sft` stage type: supervised fine-tuning (align/stages/sft.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from align.core.builtin import is_builtin
from align.config.contract import HeldModel, EXAMPLES, POLICY, CheckContext, StageBase, TrainedStage
from align.data.lengths import LAST_REPLY, TRUNCATES_COMPLETIONS
from align.core.schema import one_of, ranged, step_size


@dataclass
class SFTStage(TrainedStage):
    """Supervised fine-tuning with TRL's SFTTrainer."""

    TYPE: ClassVar[str] = "sft"
    PROMPTS: ClassVar[str] = "train"
    LENGTH_RULE = TRUNCATES_COMPLETIONS
    HEADLINE: ClassVar[tuple[str, ...]] = ("train/loss_final_avg", "eval/loss")
    DROPOUT: ClassVar[bool] = True  # TRL's SFTTrainer leaves the model's dropout as it is
    PRODUCES: ClassVar[str] = POLICY
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"model": (POLICY, False)}
    CARDS: ClassVar[dict[str, str]] = {"data": EXAMPLES}

    learning_rate: float = step_size(2e-5)
    """Peak learning rate: 2e-5, the published recipe for full fine-tuning of 7-8B models (Tunstall et al. 2023,
    Zephyr; Ivison et al. 2023, Tulu 2); with LoRA ~1e-4; a small model trained from scratch needs ~1e-3."""
    model: str = "base"
    """Starting model: `base` (the pipeline's base_model) or the name of an earlier stage."""
    data: str = ""
    """Data card path (prompt_completion or messages form)."""
    split: str = "train"
    """Which split of the card to train on."""
    completion_only_loss: bool = True
    """Compute the loss on completion tokens only (prompt tokens masked); for messages data, on the assistant
    turns only (their content and end-of-turn token), masked by align (align/data/chat.py `sft_example`) as the
    planned template's `masking` says: its `{% generation %}` markers, TRL's patched copy, or prefix rendering."""
    train_turns: str = one_of("all", "all", "last")
    """Messages data with the assistant-only loss: which replies train. `all`: every assistant turn. `last`: the
    final reply alone, the earlier turns context only: for transcripts whose earlier replies are not ones to imitate
    (HH-RLHF's red-team transcripts continued along the reply the worker rated more harmful, Bai et al. 2022 sec.
    2.2; only the final reply was compared, and `chosen` is the better one)."""
    packing: bool = False
    """Pack examples into rows of `max_length` tokens (TRL's best-fit-decreasing packing; an example longer than
    `max_length` is truncated as it would be unpacked), positions restarting per example: almost no padding, but more
    examples per step than `per_device_batch_size` (so fewer steps per epoch; scale the learning rate or
    `max_steps` to suit). Under SDPA or eager attention each row keeps its own block-diagonal mask; under
    flash-attention a batch is one row (TRL's varlen path)."""
    eval_split: str | None = "test"
    """Split whose loss is reported after training (None = skip)."""
    eval_max_examples: int = ranged(256, ge=1, fix="set eval_split: null to skip the evaluation")
    """Evaluate on at most this many examples: a seeded sample of the eval split (the stage's seed), not its head."""

    def check(self, ctx: CheckContext) -> None:
        super().check(ctx)
        if self.lora.quantize != "none" and self.model == "base" and is_builtin(ctx.pipeline.base_model):
            raise ValueError(f"lora.quantize: '{self.lora.quantize}' quantizes a pretrained base, but the builtin "
                             "model starts from fresh weights; set lora.quantize: none")
        if self.model != "base" and self.model not in ctx.pipeline.stages:
            raise ValueError(f"model: '{self.model}' is neither `base` nor a stage of this pipeline")
        produces = ctx.card_produces("data", self.split)
        if produces not in (None, "prompt_completion", "messages"):
            raise ValueError(f"data: card produces '{produces}'; sft needs prompt_completion or messages")
        if self.train_turns == "last" and (produces not in (None, "messages") or not self.completion_only_loss):
            raise ValueError("train_turns: 'last' picks the assistant turns a conversation trains on; it needs "
                             f"messages data (the card produces '{produces}') and completion_only_loss: true")
        if self.eval_split and self.eval_split == self.split:
            raise ValueError(f"eval_split: '{self.eval_split}' is the split SFT trains on (split: {self.split}), so "
                             "its loss would not be held out; name another split of the card, or set eval_split: "
                             "null to skip the evaluation")
        if self.eval_split and "data" in ctx.cards:  # a missing eval split is found here, not after training
            try:
                ctx.card_produces("data", self.eval_split)
            except ValueError as exc:  # the card's error: names the card and the splits it defines
                raise ValueError(f"eval_split: '{self.eval_split}': {exc}; name one of those splits, or set "
                                 "eval_split: null to skip the evaluation") from None

    def card_split(self, fld: str) -> str:
        return self.split

    def length_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Conversations that train their final reply alone are dropped when the turns before it fill the window."""
        return [dict(r, trains_from=LAST_REPLY) for r in rows] if self.train_turns == "last" else rows

    def starts_from_base(self) -> bool:
        return self.model == "base"

    def installs_chat_template(self, card_forms: dict[str, str], template_named: bool) -> bool:
        """From the base model, on conversations or when the pipeline names a template (align/stages/sft.py)."""
        return self.starts_from_base() and (card_forms.get("data") == "messages" or template_named)

    def trains_on_assistant_turns(self) -> bool:
        return self.completion_only_loss

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        return [HeldModel("policy", "lm", True)]

    def workload(self) -> tuple[int, int, int, int]:
        return self.per_device_batch_size, self.max_length, 0, 0
