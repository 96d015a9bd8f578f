"""The `kto` stage type: Kahneman-Tversky Optimization on unpaired preferences (align/stages/kto.py).

KTO (Ethayarajh et al. 2024) learns from single responses marked desirable or not (thumbs up / down), not from
pairs. Its data form, `unpaired_preference` (prompt, completion, label), is declared here; a card may produce it
directly, and preference pairs (a preferences stage, or a card of pairs) are unpaired into one desirable row (the
chosen reply) and one undesirable row (the rejected one); every row is shuffled with the stage's seed: TRL's
KTOTrainer reads its batches in order and estimates the KL term from each batch's mismatched prompt/completion pairs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from align.config.contract import HeldModel, DATA, EXAMPLES, POLICY, CheckContext, StageBase, TrainedStage
from align.data.formats import DataForm, Rows, register_form, text_of
from align.data.lengths import TRUNCATES_COMPLETIONS
from align.core.schema import one_of, ranged, step_size

PAIRS, UNPAIRED = "preference", "unpaired_preference"
BOTH = "whose prompt and completion appear labelled both desirable and undesirable"


def _unusable_unpaired(rows: Rows) -> dict[str, list[int]]:
    """Rows KTO cannot learn from: an empty completion; the same (prompt, completion) labelled both desirable and
    undesirable (each says the other is wrong); and every row, when the data holds one label only (KTO weighs
    desirable against undesirable examples: with one kind the loss falls to a constant and nothing is learned)."""
    labels: dict[tuple[str, str], set[bool]] = {}
    keys = [(text_of(r["prompt"]), text_of(r["completion"])) for r in rows]
    for key, r in zip(keys, rows):
        labels.setdefault(key, set()).add(bool(r["label"]))
    kinds = {bool(r["label"]) for r in rows}
    missing = "undesirable (label: false)" if kinds == {True} else "desirable (label: true)"
    return {"with no visible text in 'completion'": [i for i, (_, c) in enumerate(keys) if not c],
            BOTH: [i for i, k in enumerate(keys) if len(labels[k]) > 1],
            f"in data with no {missing} row at all (KTO needs both kinds)": list(range(len(rows))) if len(kinds) == 1 else []}


register_form(DataForm(UNPAIRED, ("prompt", "completion", "label"), replies=("completion",), flags=("label",),
                       conversational=True, contents=_unusable_unpaired))


def unpaired(rows: Rows, seed: int, limit: int | None = None) -> Rows:
    """Rows in the unpaired form, in an order shuffled with `seed`, at most `limit` of them: preference pairs become a
    desirable row (chosen) and an undesirable row (rejected) each, less those of a reply labelled both ways by two
    pairs (each would cancel the other's gradient, as a card's such rows are dropped); unpaired rows are shuffled too (a card that lists
    its desirable rows first would give TRL, which reads its batches in order, batches of one label)."""
    if rows and "chosen" in rows[0]:
        rows = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                for r in rows for side in ("chosen", "rejected")]
        both = set(_unusable_unpaired(rows)[BOTH])  # A > B and B > C label B both ways: dropped, as a card's rows are
        rows = [r for i, r in enumerate(rows) if i not in both]
    out = list(rows)
    random.Random(seed).shuffle(out)
    return out[:limit] if limit else out


def weighted_ratio(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> float:
    """lambda_D n_D / (lambda_U n_U) of eq. 8's weights, which KTO's paper (Ethayarajh et al. 2024) recommends keeping
    in [1, 4/3]: a card of unpaired rows may hold many more of one label than the other (pairs give 1)."""
    return desirable_weight * desirable / (undesirable_weight * undesirable) if undesirable else float("inf")


def one_label_problem(rows: Rows, where: str, limit: int | None) -> str | None:
    """Why KTO cannot learn from these training rows (None: it can): they hold one label only."""
    kinds = {bool(r["label"]) for r in rows}
    if len(kinds) != 1:
        return None
    held = "desirable" if kinds == {True} else "undesirable"
    cut = (f" (max_train_examples: {limit} keeps {len(rows)} of them; raise it or use null)" if limit else
           "; give it rows of both labels")
    return f"{where}: every training example is {held}: KTO weighs desirable against undesirable examples{cut}"


@dataclass
class KTOStage(TrainedStage):
    """Kahneman-Tversky Optimization with TRL's KTOTrainer; reference = the starting policy."""

    TYPE: ClassVar[str] = "kto"
    LENGTH_RULE = TRUNCATES_COMPLETIONS  # KTOTrainer truncates prompt + completion, drops prompts that fill the window
    HEADLINE: ClassVar[tuple[str, ...]] = ("eval/rewards/margin", "eval/loss")
    PROMPTS: ClassVar[str] = "train"
    PRODUCES: ClassVar[str] = POLICY
    INPUTS: ClassVar[dict[str, tuple[str, bool]]] = {"policy": (POLICY, True), "data": (DATA, False)}
    CARDS: ClassVar[dict[str, str]] = {"data": EXAMPLES}

    learning_rate: float = step_size(5e-7)
    """Peak learning rate: 5e-7, as DPO's (both fine-tune against the same frozen reference); a small model
    trained from scratch needs ~1e-4."""
    policy: str = "sft"
    """Stage whose model/ is both the starting policy and the frozen reference."""
    data: str = "preferences"
    """A preferences stage or a preference card (each pair unpaired into a desirable and an undesirable row), or a
    card that produces unpaired_preference rows (prompt, completion, label: true = desirable)."""
    beta: float = ranged(0.1, gt=0, fix="beta <= 0 removes the KL-regularised value function's scale")
    """KL strength beta of the KTO value function (Ethayarajh et al. 2024, eq. 8)."""
    desirable_weight: float = ranged(1.0, gt=0)
    """lambda_D: weight of desirable examples' losses."""
    undesirable_weight: float = ranged(1.0, gt=0)
    """lambda_U: weight of undesirable examples' losses (KTO's paper keeps lambda_D n_D / lambda_U n_U in [1, 4/3])."""
    loss_type: str = one_of("kto", "kto", "apo_zero_unpaired")
    """TRL KTO loss: kto, or apo_zero_unpaired (APO-zero's unpaired variant, no KL term)."""

    def check(self, ctx: CheckContext) -> None:
        super().check(ctx)
        form = ctx.card_produces("data", "train")
        if form not in (None, PAIRS, UNPAIRED):
            raise ValueError(f"data: card produces '{form}'; kto needs preference pairs or unpaired_preference rows")
        if "data" in ctx.cards:
            held_out = ctx.split_of(ctx.cards["data"], "test")
            if held_out.available and not held_out.rows:
                raise ValueError(f"data: {ctx.cards['data'].name} has no held-out rows (split 'test')")
        if ctx.card_produces("data", "train") is not None:
            seed = ctx.pipeline.seed if self.seed is None else self.seed  # the stage's, as it runs (runtime/context.py)
            rows = unpaired(ctx.split_of(ctx.cards["data"], "train").rows, seed, self.max_train_examples)
            problem = rows and one_label_problem(rows, f"data: {ctx.cards['data'].name}", self.max_train_examples)
            if problem:
                raise ValueError(problem)
        if self.loss_type == "kto" and self.per_device_batch_size < 2:
            raise ValueError(f"per_device_batch_size: {self.per_device_batch_size}; the kto loss estimates its KL "
                             "term from the other examples of each batch: use 2 or more (or loss_type: "
                             "apo_zero_unpaired)")

    def length_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return unpaired(rows, 0, self.max_train_examples)  # as many as the stage reads (which ones: its seed's)

    def held_models(self, stages: dict[str, StageBase]) -> list[HeldModel]:
        if self.lora.enabled:  # TRL's reference is then the policy's base with its adapters disabled
            return [HeldModel("policy", "lm", True)]
        return [HeldModel("policy", "lm", True), HeldModel("reference", "lm", False)]  # TRL shards it under ZeRO-3

    def workload(self) -> tuple[int, int, int, int]:
        # the examples alone: TRL runs each one's KL completion under no_grad (kto_trainer `_compute_kl_logps`), and
        # with its fused head, so nothing of that pass is kept for the backward
        return self.per_device_batch_size, self.max_length, 0, 0
