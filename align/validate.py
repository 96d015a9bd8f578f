"""`align validate`: everything that can be checked before anything is launched or trained.

The graph and fingerprints (align/plan.py), every data card and the rows of the split each stage reads, each
stage type's own settings checks (`check` on its config class), checks between stages, the accelerate configs,
the base model and tokenizer (align/inputs.py), and over-long examples when the tokenizer can be loaded here.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from align import templates
from align.builtin import is_builtin
from align.compute import flash_attention_problem
from align.config import CheckContext, ConfigError, PipelineConfig, TrainedStage
from align.data.cards import DataCardError, DataUnavailableError, LoadedSplit, hub_reachable, load_card, load_split
from align.data.chat import as_text
from align.data.formats import FormatError, prompt_key, row_prompt_key
from align.estimate import EstimateError, missing_lora_targets, model_shapes
from align.inputs import check_model_inputs, resolve_model_paths
from align.launch import check_accelerate
from align.lengths import LengthError, enforce, measure
from align.plan import PipelineError, StagePlan, build_plan
from align.sweeps import by_stage


def validate(cfg: PipelineConfig, source: str | Path, plans: list[StagePlan] | None = None,
             verbose: bool = True) -> list[StagePlan]:
    """Everything that can be checked without training: graph, cards and their data, stage settings."""
    plans = plans or build_plan(cfg, source)
    cache: dict[tuple[str, str], LoadedSplit] = {}

    def split_of(card: Path, split: str) -> LoadedSplit:
        key = (str(card), split)
        if key not in cache:
            try:
                loaded = load_card(card)
                if loaded.format == "hub" and not hub_reachable():
                    raise DataUnavailableError(str(card))
                cache[key] = load_split(loaded, split)
            except DataUnavailableError:
                # A hub dataset this machine cannot reach (e.g. an offline login node): the card is checked,
                # its rows are checked when the stage starts on a machine that can fetch them.
                cache[key] = LoadedSplit(loaded, split, [], Counter(), 0, available=False)
            except DataCardError as exc:
                raise PipelineError(str(exc)) from None
        return cache[key]

    problem = flash_attention_problem(cfg.attn_implementation)
    if problem:
        raise PipelineError(f"{source}: attn_implementation: {cfg.attn_implementation!r}: {problem}")
    for note in check_model_inputs(cfg, source):
        if verbose:
            print(f"  warning: {note}")
    for plan in plans:
        check_accelerate(plan, source)
        for fld, card in plan.cards.items():
            data = split_of(card, getattr(plan.cfg, "split", "train"))
            _check_card_rows(plan, fld, card, data, str(source))
            if verbose and not data.available:
                print(f"  {plan.name}.{fld}: {card.name}: warning: hub dataset {data.card.source.get('hub')} not "
                      "reachable from here; its rows are checked when the stage starts")
            elif verbose:
                dropped = ", ".join(f"{n} {why}" for why, n in data.dropped.items()) or "none dropped"
                print(f"  {plan.name}.{fld}: {card.name} split '{data.split}': {len(data.rows)} rows ({dropped})")
        try:
            plan.cfg.check(CheckContext(plan.name, cfg, plan.cards, split_of))
        except (ConfigError, ValueError) as exc:
            raise PipelineError(f"{source}: stages.{plan.name}: {exc}") from None
    _check_eval_overlap(plans, split_of, str(source))
    mismatches = [line for name, st in cfg.stages.items() for line in st.pipeline_problems(name, cfg.stages)]
    if mismatches:
        raise PipelineError(f"{source}: " + "\n".join(mismatches))
    _check_lora_targets(cfg, plans, str(source), verbose)
    _check_lengths(cfg, plans, split_of, str(source), verbose)
    return plans


def _check_lora_targets(cfg: PipelineConfig, plans: list[StagePlan], source: str, verbose: bool) -> None:
    """Every LoRA target names a linear layer of each model the stage trains, checked on the meta device (the
    config and module names only; no weights are read)."""
    lora_plans = [p for p in plans if getattr(p.cfg, "lora", None) is not None and p.cfg.lora.enabled]
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


def stage_lines(cfg: PipelineConfig, plans: list[StagePlan]) -> list[str]:
    """`align validate`'s listing: one line per stage in run order, each sweep variant with its values."""
    width = max(12, *(len(p.name) for p in plans))
    lines = []
    for plan in plans:
        line = (f"  {plan.name:{width}s} {plan.cfg.type:12s} <- {', '.join(plan.deps) or '-':24s} "
                f"fingerprint {plan.fingerprint}")
        variant = cfg.variants.get(plan.name)
        if variant:
            values = " ".join(f"{k}={v}" for k, v in variant["values"].items())
            line += f"  (sweep of {variant['stage']}: {values})"
        lines.append(line)
    for stage, variants in sorted(by_stage(cfg.variants).items()):
        lines.append(f"  sweep {stage}: {len(variants)} variants")
    return lines


def _check_card_rows(plan: StagePlan, fld: str, card: Path, data: LoadedSplit, source: str) -> None:
    """Prompt cards need prompts that are not all empty (what a stage type needs of its cards beyond that is
    its own `check`)."""
    if not data.available:
        return
    where = f"{source}: stages.{plan.name}.{fld}"
    if fld == "prompts" and not any(str(r.get("prompt", "")).strip() for r in data.rows):
        raise PipelineError(f"{where}: every one of the {len(data.rows)} prompts of {card.name} split "
                            f"'{data.split}' is empty; a policy would be sampled from nothing")


def _check_lengths(cfg: PipelineConfig, plans: list[StagePlan], split_of, source: str, verbose: bool) -> None:
    """With the tokenizer loaded here and the planned chat template installed as the first SFT stage will:
    every conversation SFT trains on is split into trained and untrained tokens (a template whose prefix
    rendering is inconsistent is refused, naming the turn), one example per stage is printed as the stage will
    see it, and over-long examples are counted per trained stage.

    Every stage repeats the length check at its start (the only place it can run when the tokenizer is trained
    by the first stage, or the hub is unreachable), so skipping it here never lets a bad run train."""
    from align.models import ModelError, load_tokenizer  # heavy (torch): only when a length check runs

    first = {(p.name, fld): split_of(card, getattr(p.cfg, "split", "train")) for p in plans
             for fld, card in p.cards.items()}
    first = {k: d for k, d in first.items() if d.available and d.rows}
    if not first:
        return
    paths = resolve_model_paths(cfg, source)
    name = paths["tokenizer"] or (None if is_builtin(str(paths["base_model"])) else paths["base_model"])
    if name is None:
        if verbose:
            print("  length check: at stage start (the builtin model's tokenizer is trained by the first stage)")
        return
    template = plans[0].chat_template
    # The rule of the stage that starts from the base model (align/stages/sft.py): it installs the template when
    # its data is conversational or the pipeline names a template.
    chat = any(getattr(p.cfg, "model", None) == "base" and (p.name, "data") in first
               and first[(p.name, "data")].card.produces == "messages" for p in plans)
    installs = template is not None and (chat or cfg.chat_template is not None)
    try:
        tokenizer = load_tokenizer(name, cfg.trust_remote_code)
        if installs:  # as the first SFT stage will
            templates.install(tokenizer, template)
            problem = templates.prompt_boundary_problem(tokenizer)
            if problem and verbose:
                print(f"  warning: chat template: {problem}")
    except ModelError as exc:
        raise PipelineError(f"{source}: tokenizer: {exc}") from None
    except (OSError, ValueError) as exc:  # a hub tokenizer offline (a local one failed check_model_inputs)
        if verbose:
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            print(f"  length check: at stage start (tokenizer '{name}' not loadable here: {type(exc).__name__}: "
                  f"{first_line})")
        return
    if installs:
        _check_trl_agrees(tokenizer, template, source)  # outside the try: its PipelineError is a ValueError
        if verbose:
            print(f"  chat template: {template.describe()}")
    for plan in plans:
        for fld in plan.cards:
            if (plan.name, fld) in first:
                _show_example(plan, fld, first[(plan.name, fld)].rows, tokenizer, template, source, verbose)
    for plan in plans:
        if not (isinstance(plan.cfg, TrainedStage) and plan.cfg.LENGTH_RULE and (plan.name, "data") in first):
            continue
        rows = first[(plan.name, "data")].rows
        rows = rows[: plan.cfg.max_train_examples] if plan.cfg.max_train_examples else rows
        if plan.cfg.LENGTH_RULE != "sft":  # conversational pairs: as the stage will see them (data/chat.py)
            try:
                rows = as_text(rows, tokenizer)
            except FormatError as exc:
                raise PipelineError(f"{source}: stages.{plan.name}.data: {exc}") from None
        report = measure(plan.name, plan.cfg.LENGTH_RULE, rows, tokenizer, plan.cfg.max_length)
        if verbose:
            print(f"  length check {report.summary()}")
        try:
            enforce(report, plan.cfg.max_truncated_fraction)
        except LengthError as exc:
            raise PipelineError(f"{source}: {exc}") from None


def _check_trl_agrees(tokenizer, template, source: str) -> None:
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


def _show_example(plan: StagePlan, fld: str, rows, tokenizer, template, source: str, verbose: bool) -> None:
    """Render the stage's rows as it will, refusing what cannot be rendered; print the first one: for SFT on
    conversations, the trained (masked-in) spans; for pairs, the prompt's end and the chosen reply; for prompts,
    the prompt's end, where sampling starts."""
    from align.data.chat import TemplateError, sft_example, trained_text  # needs a loaded tokenizer

    row = rows[0]
    where = f"{source}: stages.{plan.name}.{fld}"
    shown = ""
    if "messages" in row and getattr(plan.cfg, "completion_only_loss", False):
        limit = getattr(plan.cfg, "max_train_examples", None) or len(rows)
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


def _check_eval_overlap(plans: list[StagePlan], split_of, source: str) -> None:
    """Evaluation prompts must not appear among any stage's training prompts."""
    trained: dict[str, set[str]] = {}
    for plan in plans:
        if plan.cfg.PROMPTS == "train":
            for card in plan.cards.values():
                rows = split_of(card, plan.cfg.split).rows  # conversations: keyed by their turns (formats.py)
                trained[plan.name] = {k for k in map(row_prompt_key, rows) if k is not None}
    for plan in plans:
        if plan.cfg.PROMPTS != "held_out" or "prompts" not in plan.cards:
            continue
        held_out = {prompt_key(r["prompt"]) for r in split_of(plan.cards["prompts"], plan.cfg.split).rows}
        for name, prompts in trained.items():
            overlap = held_out & prompts
            if overlap:
                example = sorted(overlap)[0]
                raise PipelineError(
                    f"{source}: stages.{plan.name}: {len(overlap)} evaluation prompts (split '{plan.cfg.split}') "
                    f"also occur in the training prompts of stage '{name}', e.g. {example!r}. Evaluate on a "
                    "split no stage trains on.")
