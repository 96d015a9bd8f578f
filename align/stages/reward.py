"""Reward stage: a Bradley-Terry reward model (TRL's RewardTrainer), initialised from a policy checkpoint.

Held-out pairwise accuracy is measured after training on pairs from prompts the model never trained on,
with the same scoring rule the PPO and evaluate stages use (prompt + response + EOS, last real token).
"""

from __future__ import annotations

from typing import Any

from align.config.reward import RewardStage

from align.data.lengths import pairs_within
from align.runtime.rows import load_rows
from align.judges.pointwise import RewardModelJudge, pairwise_accuracy
from align.modeling.models import unsharded_loading
from align.modeling.lora import peft_config
from align.runtime.context import StageContext, StageError
from align.runtime.trl import (check_lengths, metrics_callback, train_with_resume, training_args,
                               padding_free)

OUTPUTS = ["model"]
# Liger on a scalar (sequence-classification) model: the layer kernels, not the LM-head losses it has no head for.
SCALAR_LIGER = {"fused_linear_cross_entropy": False, "cross_entropy": False}


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import RewardConfig, RewardTrainer

    cfg: RewardStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.init)
    tokenizer = ctx.load_tokenizer(path)
    train = load_rows(ctx, cfg.data, cfg.split, cfg.max_train_examples, tokenizer)
    test = load_rows(ctx, cfg.data, "test", tokenizer=tokenizer)
    check_lengths(ctx, train, tokenizer)
    kept = pairs_within(test, tokenizer, cfg.max_length)  # scored as trained: a longer one ran past the positions
    long_test, test = len(test) - len(kept), kept
    if not test:  # the held-out accuracy is the stage's result: refused before training, not published without it
        raise StageError(f"stage '{ctx.name}': {cfg.data}'s test split holds no pair to measure the reward model's "
                         f"accuracy on" + (f" ({long_test} longer than max_length {cfg.max_length}: raise it)"
                                           if long_test else "; give it held-out pairs (a preferences stage: raise "
                                           "test_fraction or max_prompts)"))
    # Liger's fused linear cross-entropy replaces a causal LM's forward; a scalar model has no LM head, so only the
    # layer kernels (RMSNorm, RoPE, SwiGLU) apply (the first H100 proof, 2026-11-27: "no attribute 'lm_head'").
    args = training_args(RewardConfig, cfg, ctx, center_rewards_coefficient=cfg.center_rewards_coefficient,
                         eval_strategy="no", liger_kernel_config=SCALAR_LIGER)
    # after the config: partitioned as it loads under ZeRO-3
    model = ctx.load_scalar(path, tokenizer.pad_token_id, quantize=cfg.lora.quantize, lora=cfg.lora.enabled)
    padding_free(ctx, model)
    columns = ("prompt", "chosen", "rejected")
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer, callbacks=[metrics_callback(ctx)],
                            train_dataset=Dataset.from_list([{c: r[c] for c in columns} for r in train]),
                            peft_config=peft_config(cfg.lora, "SEQ_CLS"))
    final = train_with_resume(ctx, trainer)
    ctx.save_trainer_model(trainer, tokenizer)
    if test:  # held-out accuracy of the saved model/: every process loads it whole and scores a share of the pairs
        with unsharded_loading():
            judge = RewardModelJudge.load(ctx.name, str(ctx.dir / "model"), autocast=ctx.compute.autocast,
                                          load=lambda p, pad: ctx.load_scalar(p, pad, device=True, frozen=True),
                                          trust_remote_code=ctx.pipeline.trust_remote_code)
        held_out = pairwise_accuracy(judge, test, ctx.state.process_index, ctx.state.num_processes)
        metrics = {"eval/rewards/accuracy": held_out["accuracy"], "eval/rewards/ties": held_out["ties"],
                   "eval/rewards/margin": held_out["margin"],
                   "eval/rewards/chosen": held_out["chosen"], "eval/rewards/rejected": held_out["rejected"],
                   "eval/pairs": len(test)}
        ctx.log(metrics, step=trainer.state.global_step)
        final.update(metrics)
    final["train/pairs"], final["eval/pairs_over_max_length"] = len(train), long_test
    return final
