"""DPO stage: TRL's DPOTrainer; the starting policy is also the frozen reference (Rafailov et al. 2023)."""

from __future__ import annotations

from typing import Any

from align.config.dpo import DPOStage
from align.data.lengths import pairs_within
from align.runtime.rows import load_rows
from align.runtime.context import StageContext
from align.runtime.trl import (check_lengths, eval_metrics, metrics_callback, policy_and_reference, train_with_resume,
                               training_args)

OUTPUTS = ["model"]


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import DPOConfig, DPOTrainer

    cfg: DPOStage = ctx.cfg  # type: ignore[assignment]
    columns = ("prompt", "chosen", "rejected")
    path = ctx.input_model(cfg.policy)
    tokenizer = ctx.load_tokenizer(path)
    train = [{c: r[c] for c in columns} for r in load_rows(ctx, cfg.data, "train", cfg.max_train_examples, tokenizer)]
    test = [{c: r[c] for c in columns} for r in load_rows(ctx, cfg.data, "test", tokenizer=tokenizer)]
    check_lengths(ctx, train, tokenizer)
    kept = pairs_within(test, tokenizer, cfg.max_length)  # TRL drops or cuts a longer one (a cut pair whose two
    long_test, test = len(test) - len(kept), kept  # sides then agree scores as a wrong one): the accuracy is on these
    args = training_args(DPOConfig, cfg, ctx, beta=cfg.beta, loss_type=[cfg.loss_type],
                         label_smoothing=cfg.label_smoothing, eval_strategy="no")
    model, ref, lora = policy_and_reference(ctx, path, cfg.lora)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(test) if test else None,
                         callbacks=[metrics_callback(ctx)], peft_config=lora)
    final = train_with_resume(ctx, trainer)
    if test:
        ev = trainer.evaluate()
        final.update(eval_metrics(ev))  # logged as they came (metrics_callback): not a second row
    final["train/pairs"], final["eval/pairs_over_max_length"] = len(train), long_test
    ctx.save_trainer_model(trainer, tokenizer)
    return final
