"""KTO stage: TRL's KTOTrainer on unpaired preferences; the starting policy is also the frozen reference
(Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8).

Pairs (a preferences stage or a card of pairs) are unpaired into desirable and undesirable rows by the config class
(align/config/kto.py `unpaired`); every row is shuffled with the stage's seed (TRL reads KTO's batches in order).
"""

from __future__ import annotations

from typing import Any

from align.config.kto import KTOStage, one_label_problem, unpaired, weighted_ratio
from align.runtime.context import StageContext, StageError
from align.runtime.rows import load_rows
from align.runtime.trl import (check_lengths, eval_metrics, metrics_callback, policy_and_reference, train_with_resume,
                               training_args)

OUTPUTS = ["model"]
COLUMNS = ("prompt", "completion", "label")


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import KTOConfig, KTOTrainer

    cfg: KTOStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.policy)
    tokenizer = ctx.load_tokenizer(path)
    rows = load_rows(ctx, cfg.data, "train", tokenizer=tokenizer)
    paired = bool(rows) and "chosen" in rows[0]  # pairs, unpaired here (else a card of unpaired rows)
    train = [{c: r[c] for c in COLUMNS} for r in unpaired(rows, ctx.seed)]
    both = 2 * len(rows) - len(train) if paired else 0  # replies labelled both ways: dropped
    if both and ctx.is_main:
        print(f"[align] {ctx.name}: dropped {both} rows of replies that two pairs label both desirable and "
              "undesirable", flush=True)
    train = train[:cfg.max_train_examples] if cfg.max_train_examples else train  # examples, not pairs
    problem = one_label_problem(train, f"data: {cfg.data}", cfg.max_train_examples)
    if problem:  # data from a preferences stage has both labels; a card's is checked by `align validate` too
        raise StageError(f"stage '{ctx.name}': {problem}")
    desirable = sum(r["label"] for r in train)
    ratio = weighted_ratio(desirable, len(train) - desirable, cfg.desirable_weight, cfg.undesirable_weight)
    if not 1.0 <= ratio <= 4 / 3 and ctx.is_main and not paired:  # pairs: 1:1 but for the cut
        print(f"[align] {ctx.name}: warning: desirable_weight x desirable / (undesirable_weight x undesirable) is "
              f"{ratio:.2f}; KTO's paper keeps it in [1, 4/3]: desirable_weight between "
              f"{cfg.undesirable_weight * (len(train) - desirable) / desirable:.3g} and "
              f"{4 / 3 * cfg.undesirable_weight * (len(train) - desirable) / desirable:.3g}", flush=True)
    test = [{c: r[c] for c in COLUMNS} for r in unpaired(load_rows(ctx, cfg.data, "test", tokenizer=tokenizer), ctx.seed)]
    check_lengths(ctx, train, tokenizer)
    args = training_args(KTOConfig, cfg, ctx, beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                         undesirable_weight=cfg.undesirable_weight, loss_type=cfg.loss_type, eval_strategy="no")
    model, ref, lora = policy_and_reference(ctx, path, cfg.lora)
    trainer = KTOTrainer(model=model, ref_model=ref, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(test) if len(test) > 1 else None,
                         callbacks=[metrics_callback(ctx)], peft_config=lora)
    final = train_with_resume(ctx, trainer)
    if len(test) > 1:
        ev = trainer.evaluate()
        final.update(eval_metrics(ev))  # logged as they came (metrics_callback): not a second row
    final["train/examples"], final["train/conflicting_rows_dropped"] = len(train), both
    final["train/desirable_fraction"], final["train/weighted_desirable_ratio"] = desirable / len(train), ratio
    ctx.save_trainer_model(trainer, tokenizer)
    return final
