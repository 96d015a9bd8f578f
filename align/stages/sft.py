"""SFT stage: TRL's SFTTrainer on prompt/completion (completion-only loss) or messages data (assistant-only loss:
the assistant turns' content and end-of-turn tokens are trained, nothing else).

With `model: base` and `base_model: builtin:tiny-llama`, the tokenizer is trained on this stage's corpus and
the model is built from the pipeline's `builtin` size: the demo starts from scratch, no downloads.
"""

from __future__ import annotations

from typing import Any

import logging

from align import templates

from align.core import gguf
from align.core.builtin import is_builtin
from align.config.sft import SFTStage
from align.data.chat import TemplateError, last_reply_only, sft_every_token, sft_example
from align.modeling.models import build_builtin, fit_model_to_tokenizer, train_tokenizer
from align.core.errors import ModelError
from align.modeling.lora import NewTokens, new_token_rows, peft_config
from align.runtime.context import StageContext, StageError
from align.runtime.rows import card_split, drop_special_text, seeded_sample
from align.runtime.trl import check_lengths, metrics_callback, train_with_resume, training_args

OUTPUTS = ["model"]
log = logging.getLogger(__name__)


def _corpus(rows: list[dict[str, Any]]) -> list[str]:
    if "messages" in rows[0]:
        return [m["content"] for r in rows for m in r["messages"]]
    return [r["prompt"] + r["completion"] for r in rows]


def collator(ctx: StageContext, cfg: SFTStage, args, model, tokenizer):
    """With `padding_free` or `packing` (and a family that reads packed positions): align's row collator around
    TRL's (align/modeling/packing.py); under flash-attention with `packing`, TRL's own one-row collator (None here).
    Sets `args.packing`. None: TRL's own collator, padded."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from align.modeling.packing import RowPackingCollator, attention_kernel, is_flash, packing_works

    if not (cfg.padding_free or cfg.packing):
        ctx.extra_manifest["padding_free"] = "off (padding_free: false)"
        return None
    def padded(why: str, said: str):  # None: TRL's own collator; the manifest says `why`, the console `said`
        ctx.extra_manifest["padding_free"] = f"off ({why})"
        if ctx.is_main:
            print(f"[align] {ctx.name}: {said}" + (", packing: true ignored" if cfg.packing else ""), flush=True)

    if not packing_works(model):
        return padded(f"{type(model).__name__} does not read packed positions", f"{type(model).__name__} does not "
                      "keep packed sequences apart (its mask ignores positions): training padded")
    one_row = is_flash(attention_kernel(model))
    if getattr(model.config, "output_router_logits", False) and not one_row:  # TRL adds the MoE auxiliary loss
        why = "a mixture of experts' load-balancing loss would count the filler of packed rows (only one row has none)"
        return padded(why, f"training padded: {why}")
    args.packing = cfg.packing
    if cfg.packing:
        ctx.extra_manifest["padding_free"] = ("packed rows of max_length, one row per batch (flash-attention)" if one_row
                                              else "packed rows of max_length")
        if one_row:
            return None  # TRL's packing: its padding-free collator, cu_seqlens for the varlen kernels
    else:
        ctx.extra_manifest["padding_free"] = "one row per batch (flash-attention)" if one_row else "rows of the batch width"
    inner = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, return_position_ids=cfg.packing)
    return RowPackingCollator(inner, tokenizer.pad_token_id, one_row=one_row)


def load_start(ctx: StageContext, cfg: SFTStage, rows: list[dict[str, Any]], chat: bool):
    """The starting model and tokenizer: an upstream stage, the pipeline's base model (a directory, hub id or
    .gguf file), or a builtin. From the base model, the planned chat template (`ctx.chat_template`) is installed
    when the data is conversational or the pipeline names a template (align/templates/): its special tokens
    added, its end-of-turn token made EOS, the model's embeddings and token ids fitted to the tokenizer. Returns the
    model, the tokenizer and the ids of the tokens the template added to a loaded model's (their rows untrained:
    grown, or rows past its tokenizer that were never used)."""
    p = ctx.pipeline
    template = ctx.chat_template
    if cfg.model != "base":
        path = ctx.input_model(cfg.model)
        tok = ctx.load_tokenizer(path)
        model = ctx.load_lm(path, quantize=cfg.lora.quantize, lora=cfg.lora.enabled)
        before = len(tok)
        if chat and not tok.chat_template and template is not None:  # an upstream stage trained on plain text
            templates.install(tok, template)
            seeded_fit(model, tok, ctx.seed)
        return model, tok, list(range(before, len(tok)))
    install = template is not None and (chat or p.chat_template is not None)
    if is_builtin(p.base_model):
        if p.tokenizer:  # a real tokenizer (e.g. GPT-2) for the fresh model: fix what it lacks
            tok = ctx.load_tokenizer(p.tokenizer)
        else:  # the template's tokens are special tokens of the trained vocabulary from the start
            tok = train_tokenizer(_corpus(rows), p.builtin.vocab_size, p.builtin.max_position_embeddings,
                                  template.special_tokens if install else ())
        if install:
            templates.install(tok, template)
        return build_builtin(p.builtin, tok, ctx.seed, ctx.compute.attn_implementation), tok, []
    tok = ctx.load_tokenizer(p.tokenizer or p.base_model)
    model = ctx.load_lm(p.base_model, quantize=cfg.lora.quantize, lora=cfg.lora.enabled)
    if gguf.is_gguf(p.base_model):
        ctx.extra_manifest["base_model_format"] = gguf.describe(p.base_model) + f" into {ctx.weights_dtype(False, cfg.lora.enabled)}"
    before = len(tok)
    if install:
        templates.install(tok, template)
        seeded_fit(model, tok, ctx.seed)
    return model, tok, list(range(before, len(tok)))


def seeded_fit(model, tok, seed: int) -> None:
    """fit_model_to_tokenizer with the embedding rows (and an untied head's) a template adds drawn by the stage's
    seed, not the process's: a seed sweep left them alike."""
    import torch  # heavy: stage processes only

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fit_model_to_tokenizer(model, tok)


def tokenized(ctx: StageContext, rows: list[dict[str, Any]], tokenizer, split: str, every_token: bool = False):
    """Conversations as the token ids and assistant masks SFT trains on (align/data/chat.py `sft_example`,
    masking as planned; `every_token`: `sft_every_token`, all of it); a conversation the template cannot split names
    its row."""
    from datasets import Dataset  # heavy: stage processes only

    out = []
    last = not every_token and ctx.cfg.train_turns == "last"  # the final reply alone trains
    for i, row in enumerate(rows):
        try:
            out.append(sft_every_token(tokenizer, row["messages"]) if every_token else
                       sft_example(tokenizer, ctx.chat_template, row["messages"]))
        except TemplateError as exc:
            raise StageError(f"stage '{ctx.name}': split '{split}' row {i}: {exc}") from None
        if last:
            out[-1]["assistant_masks"] = last_reply_only(out[-1]["assistant_masks"])
    blank = next((i for i, ex in enumerate(out) if 1 not in ex["assistant_masks"]), None)
    if blank is not None:  # every assistant turn trains its end-of-turn token at least: the masking never fired
        raise StageError(f"stage '{ctx.name}': split '{split}' row {blank}: no assistant token to train on (chat "
                         f"template {ctx.chat_template.source}: its {{% generation %}} markers never enclose this "
                         "conversation's replies); fix the template's markers")
    return Dataset.from_list(out)


def _new_tokens(ctx: StageContext, cfg: SFTStage, model, added: list[int]) -> NewTokens | None:
    """Under LoRA, the rows of the tokens the chat template added to a loaded model (`added`) and the head, which
    peft trains (`lora.new_token_rows`), noted in the manifest; refused under ZeRO-3, whose partitions peft cannot
    index."""
    try:
        new = new_token_rows(model, added) if cfg.lora.enabled and ctx.trained_from else None
    except ModelError as exc:
        raise StageError(f"stage '{ctx.name}': {exc}") from None
    if new is None:
        return None
    if ctx.compute.distributed_zero3:
        raise StageError(f"stage '{ctx.name}': the chat template added {len(new.ids)} tokens to {ctx.trained_from}, "
                         "whose new embedding rows LoRA must train whole (peft's trainable tokens), which it cannot "
                         f"do on ZeRO-3's partitions; run this stage under ZeRO-2 (stages.{ctx.name}.accelerate: "
                         "zero2), without LoRA, or with a template whose tokens the model has")
    ctx.extra_manifest["lora_new_tokens"] = {"rows": [new.ids[0], new.ids[-1]], "embeddings": new.embeddings,
                                             "head_trained_whole": new.head}
    return new


def run(ctx: StageContext) -> dict[str, Any]:
    from datasets import Dataset  # heavy: trl and datasets load only when the stage runs
    from trl import SFTConfig, SFTTrainer

    cfg: SFTStage = ctx.cfg  # type: ignore[assignment]
    data = card_split(ctx, cfg.data, cfg.split)
    chat = data.card.produces == "messages"
    args = training_args(SFTConfig, cfg, ctx, completion_only_loss=cfg.completion_only_loss and not chat,
                         assistant_only_loss=False, eval_strategy="no", packing=False)
    model, tokenizer, added = load_start(ctx, cfg, data.rows[: cfg.max_train_examples or None], chat)  # after the
    # config: partitioned under ZeRO-3
    rows = drop_special_text(ctx, data.rows, tokenizer, f"{cfg.data} split '{cfg.split}'")
    rows = rows[: cfg.max_train_examples] if cfg.max_train_examples else rows  # after the drops, as load_rows
    check_lengths(ctx, rows, tokenizer)
    columns = ["messages"] if chat else ["prompt", "completion"]
    train = Dataset.from_list([{c: r[c] for c in columns} for r in rows])
    eval_ds, eval_rows = None, []
    if cfg.eval_split:
        eval_rows = seeded_sample(drop_special_text(ctx, card_split(ctx, cfg.data, cfg.eval_split).rows, tokenizer,
                                                    f"{cfg.data} split '{cfg.eval_split}'"), cfg.eval_max_examples, ctx.seed)
        eval_ds = Dataset.from_list([{c: r[c] for c in columns} for r in eval_rows])
    if chat:  # tokenised here: assistant turns only (masks as the plan decided), or every token; BOS as later stages
        every = not cfg.completion_only_loss
        train = tokenized(ctx, rows, tokenizer, cfg.split, every)
        if cfg.packing:  # TRL drops an example its truncation leaves untrained only when it does not pack: here
            train = train.filter(lambda ex: 1 in ex["assistant_masks"][:cfg.max_length])  # (the length check counted)
        if eval_ds is not None:
            eval_ds = tokenized(ctx, eval_rows, tokenizer, cfg.eval_split, every)
    if cfg.completion_only_loss and chat:
        ctx.extra_manifest["chat_template"] = {"source": ctx.chat_template.source, "digest": ctx.chat_template.digest,
                                               "masking": ctx.chat_template.masking,
                                               "trl_template": ctx.chat_template.trl_name}
        log.info("assistant-only loss: chat template %s", ctx.chat_template.describe())
    ctx.extra_manifest["loss_on"] = ("assistant turns" if cfg.completion_only_loss and chat else "completions"
                                     if cfg.completion_only_loss else "every token")
    rows_collator = collator(ctx, cfg, args, model, tokenizer)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=eval_ds,
                         processing_class=tokenizer, callbacks=[metrics_callback(ctx)],
                         peft_config=peft_config(cfg.lora, "CAUSAL_LM", _new_tokens(ctx, cfg, model, added)),
                         data_collator=None if args.packing else rows_collator)
    if args.packing and rows_collator is not None:  # TRL refuses a collator of ours with its packing: set it after
        trainer.data_collator = rows_collator
    final = train_with_resume(ctx, trainer)
    if eval_ds is not None:
        final["eval/loss"] = trainer.evaluate()["eval_loss"]  # logged as it came (metrics_callback): not twice
    # what trained: TRL drops rows its truncation left without a trained token (the length check counted them)
    final["train/examples"] = len(train) if args.packing else len(trainer.train_dataset)
    ctx.save_trainer_model(trainer, tokenizer)
    return final
