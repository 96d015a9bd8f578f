"""The `pretrained` stage type: the pipeline's base model published as a stage's model/, untrained, so that PPO, DPO,
KTO, GRPO, RLOO, preferences and evaluate start from an instruction-tuned base without an SFT stage
(align/stages/pretrained.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config.contract import POLICY, CheckContext, StageBase
from align.core.builtin import is_builtin


@dataclass
class PretrainedStage(StageBase):
    """The base model (a hub id, a local directory, a .gguf file or packaged:smollm2) as a policy other stages name:
    its weights in their own dtype, its tokenizer with the planned chat template installed as an sft stage from the
    base installs it (the pipeline's `chat_template`, else the tokenizer's own, its end-of-turn token made EOS).
    Nothing trains: a chat template whose special tokens the tokenizer lacks is refused (their embedding rows would
    be random), since only an `sft` stage trains them. Runs one process on the host (accelerate: cpu)."""

    TYPE: ClassVar[str] = "pretrained"
    PRODUCES: ClassVar[str] = POLICY
    HEADLINE: ClassVar[tuple[str, ...]] = ("pretrained/parameters", "pretrained/bytes")
    WORK: ClassVar[str] = "pretrained/parameters"
    ONE_PROCESS: ClassVar[bool] = True
    """It runs one process whatever the accelerate settings say: `align validate` refuses num_processes above 1
    (align/orchestrator/launch.py) with that fix alone, not a distributed config, which check() refuses."""
    REPUBLISHES_BASE: ClassVar[bool] = True
    """Its model/ is base_model's weights unchanged: LoRA adapters trained on it are adapters of base_model, which a
    push names as their base (align/stages/push.py hub_folder)."""

    def check(self, ctx: CheckContext) -> None:
        if is_builtin(ctx.pipeline.base_model):
            raise ValueError(f"type: pretrained publishes a pretrained base model, but base_model "
                             f"{ctx.pipeline.base_model!r} is built here from fresh weights; start from it with an "
                             "sft stage (model: base), or set base_model to a hub id, a local directory or a .gguf file")
        if self.accelerate != "cpu":
            raise ValueError(f"accelerate: {self.accelerate}, but a pretrained stage trains nothing to distribute or "
                             "shard: one process loads the base on the host and writes it; leave accelerate unset (cpu)")

    def starts_from_base(self) -> bool:
        return True

    def installs_chat_template(self, card_forms: dict[str, str], template_named: bool) -> bool:
        """Always: the named template, or the tokenizer's own (its end-of-turn token made EOS) or align's default."""
        return True

    def unread_settings(self) -> dict[str, str]:
        """Also the pipeline's settings it does not read (left out of its fingerprint: changing one re-copies
        nothing): it computes nothing, and writes the weights in their own dtype."""
        computes = "a pretrained stage computes nothing: it writes the weights in their own dtype"
        return {"seed": "a pretrained stage draws nothing at random: every seed publishes the same copy",
                **dict.fromkeys(("dtype", "precision", "attn_implementation"), computes)}
