"""SFT stage: TRL's SFTTrainer on prompt/completion (completion-only loss) or messages data (assistant-only loss:
the assistant turns' content and end-of-turn tokens are trained, nothing else).

With `model: base` and `base_model: builtin:tiny-llama`, the tokenizer is trained on this stage's corpus and
the model is built from the pipeline's `builtin` size: the demo starts from scratch, no downloads.
"""

from __future__ import annotations

from typing import Any

from align import templates
from align.builtin import is_builtin
from align.config.sft import SFTStage
from align.data.cards import load_split
from align.models import (build_builtin, fit_model_to_tokenizer, load_tokenizer, peft_config,
                          train_tokenizer)
from align.stages.context import StageContext, StageError
from align.stages.trl import check_lengths, metrics_callback, train_with_resume, trainer_kwargs

OUTPUTS = ["model"]


def _corpus(rows: list[dict[str, Any]]) -> list[str]:
    if "messages" in rows[0]:
        return [m["content"] for r in rows for m in r["messages"]]
    return [r["prompt"] + r["completion"] for r in rows]


def load_start(ctx: StageContext, cfg: SFTStage, rows: list[dict[str, Any]], chat: bool):
    """The starting model and tokenizer: an upstream stage, the pipeline's base model, or a builtin. From the base
    model, the pipeline's chat template is installed (align/templates/): its special tokens added, its
    end-of-turn token made EOS, the model's embeddings and token ids fitted to the tokenizer."""
    p = ctx.pipeline
    if cfg.model != "base":
        path = ctx.input_model(cfg.model)
        return ctx.load_lm(path, quantize=cfg.lora.quantize), load_tokenizer(path, needs_chat_template=chat)
    template = templates.template_text(p.chat_template) if p.chat_template else None
    if is_builtin(p.base_model):
        if p.tokenizer:  # a real tokenizer (e.g. GPT-2) for the fresh model: fix what it lacks
            tok = load_tokenizer(p.tokenizer, p.trust_remote_code, needs_chat_template=chat)
        else:  # the template's tokens are special tokens of the trained vocabulary from the start
            tok = train_tokenizer(_corpus(rows), p.builtin.vocab_size, p.builtin.max_position_embeddings,
                                  templates.special_literals(template or ""))
        if template or chat:
            templates.install(tok, template)
        return build_builtin(p.builtin, tok, ctx.seed, ctx.compute.attn_implementation), tok
    tok = load_tokenizer(p.tokenizer or p.base_model, p.trust_remote_code, needs_chat_template=chat)
    model = ctx.load_lm(p.base_model, quantize=cfg.lora.quantize)
    if template or chat:
        templates.install(tok, template)
        fit_model_to_tokenizer(model, tok)
    return model, tok


def check_assistant_masks(ctx: StageContext, tokenizer) -> None:
    """Assistant-only loss needs `{% generation %}` markers in the template (or a template TRL knows how to
    patch); say so before TRL does, with the fix."""
    template = tokenizer.chat_template or ""
    if templates.has_generation_markers(template if isinstance(template, str) else template.get("default", "")):
        return
    from trl.chat_template_utils import get_training_chat_template  # heavy: stage processes only

    try:
        get_training_chat_template(tokenizer)
    except ValueError:
        raise StageError(f"stage '{ctx.name}': the chat template has no {{% generation %}} markers, so TRL cannot "
                         "tell assistant tokens from the rest: set the pipeline's chat_template to chatml or llama3 "
                         "(or a .jinja file with the markers, see align/templates/chatml.jinja), or set "
                         f"stages.{ctx.name}.completion_only_loss: false to train on every token") from None


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
    assistant_only = cfg.completion_only_loss and chat
    if assistant_only:
        check_assistant_masks(ctx, tokenizer)
    ctx.extra_manifest["loss_on"] = ("assistant turns" if assistant_only else "completions"
                                     if cfg.completion_only_loss and not chat else "every token")
    args = SFTConfig(**trainer_kwargs(cfg, ctx), completion_only_loss=cfg.completion_only_loss and not chat,
                     assistant_only_loss=assistant_only, eval_strategy="no", packing=False)
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
