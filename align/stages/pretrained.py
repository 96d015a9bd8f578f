"""Pretrained stage: the pipeline's base model written as this stage's model/ (align/config/pretrained.py), so that a
stage that needs a policy stage (dpo, ppo, kto, grpo, rloo, preferences, evaluate) starts from an instruction-tuned
base without an SFT stage. Nothing trains. The main process loads the base on the host in its own dtype (a .gguf
file dequantised), installs the planned chat template, sets the EOS / PAD / BOS ids as the tokenizer says, and
writes weights and tokenizer atomically; any other process only waits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align import templates
from align.core import gguf
from align.core.fsutil import tree_bytes
from align.data.hub import hub_revision
from align.modeling.models import fit_model_to_tokenizer, load_causal_lm
from align.runtime.context import StageContext, StageError, startup_done

OUTPUTS = ["model"]


def prepared_tokenizer(ctx: StageContext):
    """The base's tokenizer with the planned chat template installed as an SFT stage from the base installs it: the
    pipeline's named one, else the tokenizer's own (align's default where it ships none), its end-of-turn token made
    EOS (a Gemma-style tokenizer whose EOS is not the token that ends a reply: generation would not stop there). A
    template whose special tokens the tokenizer lacks is refused before any weight loads: their embedding rows would
    start random, and only an sft stage trains them."""
    p = ctx.pipeline
    tok = ctx.load_tokenizer(p.tokenizer or p.base_model)
    if ctx.chat_template is not None:
        added = templates.install(tok, ctx.chat_template)
        if added:
            raise StageError(f"stage '{ctx.name}': chat_template {ctx.chat_template.source} adds the special tokens "
                             f"{added}, which the tokenizer of {p.base_model} lacks: their embedding rows would be "
                             "random and nothing in this stage trains them; use the model's own template "
                             "(chat_template: null), a template built on its tokens, or an sft stage (model: base), "
                             "which trains them")
    return tok


def run(ctx: StageContext) -> dict[str, Any]:
    p = ctx.pipeline
    tokenizer = prepared_tokenizer(ctx)
    model = load_causal_lm(p.base_model, "auto", p.trust_remote_code) if ctx.is_main else None
    startup_done()
    if model is not None:
        fit_model_to_tokenizer(model, tokenizer)  # EOS (the template's end of turn), PAD, BOS; no new rows
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        ctx.extra_manifest["published"] = f"the base model's weights, untrained ({dtype})"
        if revision := hub_revision(p.base_model):  # a push of adapters trained on the copy pins it
            ctx.extra_manifest["base_model_revision"] = revision
        if gguf.is_gguf(p.base_model):
            ctx.extra_manifest["base_model_format"] = gguf.describe(p.base_model) + f" into {dtype}"

    def write(path: Path) -> None:
        if model is not None:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)

    ctx.publish("model", write)
    if model is None:  # another process: it loaded and wrote nothing, so it has nothing to report
        return {}
    return {"pretrained/parameters": sum(t.numel() for t in model.parameters()),
            "pretrained/bytes": tree_bytes(ctx.dir / "model")}
