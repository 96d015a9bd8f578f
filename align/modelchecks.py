"""What `align validate` checks with a loaded tokenizer and the model classes, in a helper process (align/helper.py):
the orchestrator never imports torch, this module may. `run` is the entry point: the pipeline is parsed and planned
again from its resolved config (the same plan: overrides and sweeps are already in it), then

- the tokenizer loads (a local one that does not is refused, naming the file and the fix; a hub one that cannot be
  fetched from here is a note) and fits the base model's vocabulary;
- every LoRA target names a linear layer of each model a stage trains (meta device: no weights are read);
- with the planned chat template installed as the stage that starts from the base model will install it, every
  conversation a stage trains on turn by turn is split into trained and untrained tokens (a template whose prefix
  rendering is inconsistent is refused, naming the turn), one example per stage is printed as the stage will see
  it, and over-long examples are counted per trained stage by its trainer's rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align import templates
from align.config import PipelineConfig, TrainedStage, parse_pipeline
from align.config.common import EXAMPLES
from align.data.chat import as_text
from align.data.formats import FormatError
from align.errors import ModelError
from align.estimate import EstimateError, missing_lora_targets, model_shapes
from align.inputs import SAVE_FIX, base_model_config, resolve_model_paths, tokenizer_name
from align.lengths import LengthError, enforce
from align.plan import PipelineError, StagePlan, build_plan
from align.schema import ConfigError
from align.validate import card_loader


def run(config: dict[str, Any], source: str, verbose: bool = True) -> None:
    """The helper's entry point (`align.modelchecks:run`): every check of this module, in order."""
    cfg = parse_pipeline(config, source)
    plans = build_plan(cfg, source)
    tokenizer = load_tokenizer_checked(cfg, source, verbose)
    check_lora_targets(cfg, plans, source, verbose)
    if tokenizer is not None:
        check_lengths(cfg, plans, card_loader(), tokenizer, source, verbose)


def load_tokenizer_checked(cfg: PipelineConfig, source: str, verbose: bool):
    """The pipeline's tokenizer, loaded as a stage will load it; its ids must fit the base model's embeddings.
    None when it cannot be loaded from here (a hub tokenizer offline: the first stage checks it)."""
    from align.models import load_tokenizer  # heavy (torch): this is the helper process

    paths = resolve_model_paths(cfg, source)
    name, key = tokenizer_name(cfg, paths)
    if name is None:
        return None
    local = Path(name).exists()
    try:
        tok = load_tokenizer(name, cfg.trust_remote_code)
    except ModelError as exc:
        raise ConfigError(f"{source}: {key}: {exc}") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        if not local and isinstance(exc, OSError):  # partly cached hub tokenizer, hub unreachable from here
            if verbose:
                print(f"  warning: tokenizer '{name}' cannot be loaded from here ({type(exc).__name__}: {first}); "
                      "it is checked, and lengths are counted, when the first stage starts")
            return None
        raise ConfigError(f"{source}: {key}: the tokenizer in '{name}' does not load ({type(exc).__name__}: "
                          f"{first}); {SAVE_FIX}") from None
    vocab = (base_model_config(cfg, source, paths) or {}).get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ConfigError(f"{source}: {key}: the tokenizer in '{name}' has {len(tok)} tokens but the base model's "
                          f"embeddings hold {vocab} (config.json vocab_size); ids past {vocab - 1} would index out "
                          "of range. Use the tokenizer the model was trained with (or resize the embeddings and "
                          "save the model again)")
    return tok


def check_lora_targets(cfg: PipelineConfig, plans: list[StagePlan], source: str, verbose: bool) -> None:
    """Every LoRA target names a linear layer of each model the stage trains, checked on the meta device (the
    config and module names only; no weights are read)."""
    lora_plans = [p for p in plans if isinstance(p.cfg, TrainedStage) and p.cfg.lora.enabled]
    if not lora_plans:
        return
    try:
        shapes = model_shapes(cfg, source)
    except (EstimateError, ValueError, ImportError, OSError, KeyError, TypeError) as exc:
        # e.g. no config here, or an architecture transformers builds no scalar head for: the stage says so
        if verbose:
            print(f"  warning: LoRA target_modules not checked here ({type(exc).__name__}: {exc})")
        return
    for plan in lora_plans:
        for role, kind, trained in plan.cfg.held_models(cfg.stages):
            missing = missing_lora_targets(shapes[kind], plan.cfg.lora) if trained else []
            if missing:
                names = sorted({n.rsplit(".", 1)[-1] for n in shapes[kind].linears})
                raise PipelineError(f"{source}: stages.{plan.name}.lora.target_modules: {missing} name no linear "
                                    f"layer of the {role} model ({cfg.base_model}); its linear layers are named "
                                    f"{names}: name some of those")


def check_lengths(cfg: PipelineConfig, plans: list[StagePlan], split_of, tokenizer, source: str, verbose: bool) -> None:
    """With the tokenizer loaded here and the planned chat template installed as the stage that starts from the base
    model will install it: every conversation a stage trains on turn by turn is split into trained and untrained
    tokens (a template whose prefix rendering is inconsistent is refused, naming the turn), one example per stage
    is printed as the stage will see it, and over-long examples are counted per trained stage.

    Every stage repeats the length check at its start (the only place it can run when the tokenizer is trained
    by the first stage, or the hub is unreachable), so skipping it here never lets a bad run train."""
    first = {(p.name, fld): split_of(card, p.cfg.card_split(fld)) for p in plans for fld, card in p.cards.items()}
    first = {k: d for k, d in first.items() if d.available and d.rows}
    if not first:
        return
    template = plans[0].chat_template
    # Installed as the stage that installs it will (its class's rule: e.g. from the base model, on conversations).
    installs = template is not None and any(
        p.cfg.installs_chat_template({fld: d.card.produces for (name, fld), d in first.items() if name == p.name},
                                     cfg.chat_template is not None) for p in plans)
    if installs:  # as the stage that starts from the base model will
        try:
            templates.install(tokenizer, template)
        except ModelError as exc:
            raise PipelineError(f"{source}: tokenizer: {exc}") from None
        problem = templates.prompt_boundary_problem(tokenizer)
        if problem and verbose:
            print(f"  warning: chat template: {problem}")
    if installs:
        check_trl_agrees(tokenizer, template, source)  # outside the try: its PipelineError is a ValueError
        if verbose:
            print(f"  chat template: {template.describe()}")
    for plan in plans:
        for fld in plan.cards:
            if (plan.name, fld) in first:
                show_example(plan, fld, first[(plan.name, fld)].rows, tokenizer, template, source, verbose)
    for plan in plans:
        rule = plan.cfg.LENGTH_RULE if isinstance(plan.cfg, TrainedStage) else None
        fields = [f for f, use in type(plan.cfg).CARDS.items() if use == EXAMPLES and (plan.name, f) in first]
        if rule is None or not fields:
            continue
        rows = first[(plan.name, fields[0])].rows
        rows = rows[: plan.cfg.max_train_examples] if plan.cfg.max_train_examples else rows
        try:  # conversational prompts and replies as the stage will see them (data/chat.py); `messages` rows as-is
            rows = plan.cfg.length_rows(as_text(rows, tokenizer))
        except FormatError as exc:
            raise PipelineError(f"{source}: stages.{plan.name}.{fields[0]}: {exc}") from None
        report = rule.measure(plan.name, rows, tokenizer, plan.cfg.max_length)
        if verbose:
            print(f"  length check {report.summary()}")
        try:
            enforce(report, plan.cfg.max_truncated_fraction)
        except LengthError as exc:
            raise PipelineError(f"{source}: {exc}") from None


def check_trl_agrees(tokenizer, template, source: str) -> None:
    """The plan chose TRL's patched template by reading TRL's files; TRL's own function must agree (a TRL
    upgrade that changed its table would otherwise go unnoticed)."""
    if template.masking not in ("trl", "prefix"):
        return
    from trl.chat_template_utils import get_training_chat_template  # heavy: validation only

    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:
        patched = None
    if (patched or None) != (template.training_text if template.masking == "trl" else None):
        raise PipelineError(f"{source}: chat_template: align planned masking '{template.masking}' for "
                            f"{template.source}, but trl.chat_template_utils.get_training_chat_template "
                            f"{'returns a patched template' if patched else 'has no patched template'} for it: "
                            "the installed TRL is not the one align was written against; reinstall align's pinned "
                            "TRL range")


def show_example(plan: StagePlan, fld: str, rows, tokenizer, template, source: str, verbose: bool) -> None:
    """Render the stage's rows as it will, refusing what cannot be rendered; print the first one: for a stage that
    trains on the assistant turns of conversations, the trained (masked-in) spans; for pairs, the prompt's end and the chosen reply; for prompts,
    the prompt's end, where sampling starts."""
    from align.data.chat import TemplateError, sft_example, trained_text  # needs a loaded tokenizer

    row = rows[0]
    where = f"{source}: stages.{plan.name}.{fld}"
    shown = ""
    if "messages" in row and plan.cfg.trains_on_assistant_turns():
        limit = (plan.cfg.max_train_examples if isinstance(plan.cfg, TrainedStage) else None) or len(rows)
        try:
            for i, r in enumerate(rows[:limit]):
                example = sft_example(tokenizer, template, r["messages"])
                if i == 0:
                    spans = trained_text(tokenizer, example)
                    shown = (f"trains on {len(spans)} span(s), {sum(example['assistant_masks'])} of "
                             f"{len(example['input_ids'])} tokens: " + " | ".join(repr(s) for s in spans))
        except TemplateError as exc:
            raise PipelineError(f"{where}: row {i}: {exc}") from None
    elif isinstance(row.get("prompt"), list):
        try:
            rendered = as_text([row], tokenizer)[0]
        except ValueError as exc:  # FormatError, or a tokenizer without a chat template
            raise PipelineError(f"{where}: row 0: {exc}") from None
        shown = f"prompt ends {rendered['prompt'][-40:]!r}"
        if "chosen" in rendered and fld == "data":
            shown += f"; chosen reply {rendered['chosen'][:80]!r} + EOS {tokenizer.eos_token!r}"
        else:
            shown += f"; responses are sampled up to EOS {tokenizer.eos_token!r}"
    if shown and verbose:
        print(f"  {plan.name}.{fld} example 0: {shown}")


