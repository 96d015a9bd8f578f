"""SFT stage: TRL's SFTTrainer on prompt/completion (completion-only loss) or messages data.

With `model: base` and `base_model: builtin:tiny-llama`, the tokenizer is trained on this stage's corpus and
the model is built from the pipeline's `builtin` size: the demo starts from scratch, no downloads.
"""

from __future__ import annotations

from typing import Any

from align.builtin import is_builtin
from align.config.sft import SFTStage
from align.data.cards import load_split
from align.models import build_builtin, load_causal_lm, load_tokenizer, peft_config, train_tokenizer
from align.stages.context import StageContext
from align.stages.trl import check_lengths, metrics_callback, train_with_resume, trainer_kwargs

OUTPUTS = ["model"]


def _corpus(rows: list[dict[str, Any]]) -> list[str]:
    if "messages" in rows[0]:
        return [m["content"] for r in rows for m in r["messages"]]
    return [r["prompt"] + r["completion"] for r in rows]


def load_start(ctx: StageContext, cfg: SFTStage, rows: list[dict[str, Any]], chat: bool):
    """The starting model and tokenizer: an upstream stage, the pipeline's base model, or a builtin."""
    p = ctx.pipeline
    if cfg.model != "base":
        path = ctx.input_model(cfg.model)
        tok = load_tokenizer(path, needs_chat_template=chat)
        return load_causal_lm(path, p.dtype, quantize=cfg.lora.quantize), tok
    if is_builtin(p.base_model):
        if p.tokenizer:  # a real tokenizer (e.g. GPT-2) for the fresh model: fix what it lacks
            tok = load_tokenizer(p.tokenizer, p.trust_remote_code, needs_chat_template=chat)
        else:
            tok = train_tokenizer(_corpus(rows), p.builtin.vocab_size, p.builtin.max_position_embeddings)
        return build_builtin(p.builtin, tok, ctx.seed), tok
    tok = load_tokenizer(p.tokenizer or p.base_model, p.trust_remote_code, needs_chat_template=chat)
    return load_causal_lm(p.base_model, p.dtype, p.trust_remote_code, cfg.lora.quantize), tok


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import SFTConfig, SFTTrainer

    cfg: SFTStage = ctx.cfg  # type: ignore[assignment]
    data = load_split(cfg.data, cfg.split)
    rows = data.rows[: cfg.max_train_examples] if cfg.max_train_examples else data.rows
    chat = data.card.produces == "messages"
    model, tokenizer = load_start(ctx, cfg, rows, chat)
    check_lengths(ctx, rows, tokenizer)
    columns = ["messages"] if chat else ["prompt", "completion"]
    train = Dataset.from_list([{c: r[c] for c in columns} for r in rows])
    eval_ds = None
    if cfg.eval_split:
        eval_rows = load_split(cfg.data, cfg.eval_split).rows[: cfg.eval_max_examples]
        eval_ds = Dataset.from_list([{c: r[c] for c in columns} for r in eval_rows])
    args = SFTConfig(**trainer_kwargs(cfg, ctx), completion_only_loss=cfg.completion_only_loss and not chat,
                     assistant_only_loss=False, eval_strategy="no", packing=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=eval_ds,
                         processing_class=tokenizer, callbacks=[metrics_callback(ctx)],
                         peft_config=peft_config(cfg.lora, "CAUSAL_LM"))
    final = train_with_resume(ctx, trainer)
    if eval_ds is not None:
        ev = trainer.evaluate()
        final["eval/loss"] = ev["eval_loss"]
        ctx.log({"eval/loss": ev["eval_loss"]}, step=trainer.state.global_step)
    final["train/examples"] = len(train)
    ctx.save_trainer_model(trainer, tokenizer)
    return final
