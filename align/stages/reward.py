"""Reward stage: a Bradley-Terry reward model (TRL's RewardTrainer), initialised from a policy checkpoint.

Held-out pairwise accuracy is measured after training on pairs from prompts the model never trained on,
with the same scoring rule the PPO and evaluate stages use (prompt + response + EOS, last real token).
"""

from __future__ import annotations

from typing import Any

from align.config.reward import RewardStage
from align.runtime.rows import load_rows
from align.judges.pointwise import RewardModelJudge
from align.modeling.models import load_tokenizer, unsharded_loading
from align.modeling.lora import peft_config
from align.runtime.context import StageContext
from align.runtime.trl import check_lengths, metrics_callback, train_with_resume, training_args

OUTPUTS = ["model"]


def pairwise_accuracy(judge: RewardModelJudge, pairs: list[dict[str, Any]]) -> dict[str, float]:
    """Fraction of pairs whose chosen response scores above the rejected one, and the mean margin (each text
    scored by the one rule, as the model was trained on it: align/judges/pointwise.py)."""
    prompts = [p["prompt"] for p in pairs]
    chosen = judge(prompts, [p["chosen"] for p in pairs])
    rejected = judge(prompts, [p["rejected"] for p in pairs])
    margins = [c - r for c, r in zip(chosen, rejected)]
    return {"accuracy": sum(m > 0 for m in margins) / len(margins), "margin": sum(margins) / len(margins),
            "chosen": sum(chosen) / len(chosen), "rejected": sum(rejected) / len(rejected),
            "margins": margins, "chosen_scores": chosen, "rejected_scores": rejected}


def calibration_buckets(margins: list[float], n_buckets: int = 4) -> list[dict[str, float]]:
    """Accuracy by |margin| quantile bucket: a calibrated reward model is more often right when it is surer."""
    ordered = sorted(margins, key=abs)
    size = max(1, len(ordered) // n_buckets)
    out = []
    for i in range(0, len(ordered), size):
        chunk = ordered[i:i + size]
        if len(chunk) < size and out:  # fold a short tail into the last bucket
            prev = out.pop()
            chunk = prev["_items"] + chunk
        out.append({"lo": abs(chunk[0]), "hi": abs(chunk[-1]), "n": len(chunk),
                    "accuracy": sum(m > 0 for m in chunk) / len(chunk), "_items": chunk})
    return [{k: v for k, v in b.items() if k != "_items"} for b in out]


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import RewardConfig, RewardTrainer

    cfg: RewardStage = ctx.cfg  # type: ignore[assignment]
    path = ctx.input_model(cfg.init)
    tokenizer = load_tokenizer(path)
    train = load_rows(ctx, cfg.data, cfg.split, cfg.max_train_examples, tokenizer)
    test = load_rows(ctx, cfg.data, "test", tokenizer=tokenizer)
    check_lengths(ctx, train, tokenizer)
    args = training_args(RewardConfig, cfg, ctx, center_rewards_coefficient=cfg.center_rewards_coefficient,
                         eval_strategy="no")
    # after the config: partitioned as it loads under ZeRO-3
    model = ctx.load_scalar(path, tokenizer.pad_token_id, quantize=cfg.lora.quantize)
    columns = ("prompt", "chosen", "rejected")
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer, callbacks=[metrics_callback(ctx)],
                            train_dataset=Dataset.from_list([{c: r[c] for c in columns} for r in train]),
                            peft_config=peft_config(cfg.lora, "SEQ_CLS"))
    final = train_with_resume(ctx, trainer)
    ctx.save_trainer_model(trainer, tokenizer)
    if test and ctx.is_main:  # held-out accuracy of the saved model/, in the main process only
        with unsharded_loading():
            judge = RewardModelJudge.load(ctx.name, str(ctx.dir / "model"), autocast=ctx.compute.autocast,
                                          load=lambda p, pad: ctx.load_scalar(p, pad, device=True, frozen=True))
        held_out = pairwise_accuracy(judge, test)
        metrics = {"eval/rewards/accuracy": held_out["accuracy"], "eval/rewards/margin": held_out["margin"],
                   "eval/rewards/chosen": held_out["chosen"], "eval/rewards/rejected": held_out["rejected"],
                   "eval/pairs": len(test)}
        ctx.log(metrics, step=trainer.state.global_step)
        final.update(metrics)
    final["train/pairs"] = len(train)
    return final
