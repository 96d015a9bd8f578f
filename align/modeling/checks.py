"""What `align validate` checks with a loaded tokenizer, run in the orchestrator's helper process
(align/orchestrator/helper.py): the orchestrator decides what to check and sends it here as JSON (a job, built by
align/orchestrator/validate.py `model_job`); this module loads, renders and counts. In order:

- transformers here has the classes the stages load the base model with (`model_class_problem`);
- the tokenizer loads as a stage will load it (a local one that does not is refused, naming the file and the fix; a
  hub one that cannot be fetched from here is a warning: the first stage checks it) and fits the base model's
  vocabulary;
- with the planned chat template installed as the stage that installs it will (`install_template`): its tokens do
  not merge across the prompt/reply seam (a warning), and TRL's `get_training_chat_template` agrees with the
  masking the plan chose;
- one example per stage and card is rendered as the stage will see it and printed; every conversation a stage
  trains on turn by turn is split into trained and untrained tokens (a template whose prefix rendering is
  inconsistent is refused, naming the row and turn);
- over-long examples are counted by each trained stage's length rule (align/data/lengths.py) and refused above
  its max_truncated_fraction;
- and, when asked, the model shapes (align/modeling/shapes.py), returned for the orchestrator's LoRA-target check.

A refusal is a ValueError (PipelineError, ConfigError) whose message the orchestrator shows as its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align import templates
from align.core.errors import TOKENIZER_SAVE_FIX, ModelError
from align.core.schema import ConfigError
from align.data.chat import (TemplateError, as_text, last_reply_only, same_after_template_problem, sft_example,
                             trained_text)
from align.data.formats import FormatError
from align.data.lengths import RULES, LengthError, enforce
from align.data.special_text import without_special_text
from align.modeling import shapes as model_shapes

class CheckError(ValueError):
    """A refusal found here; its message names the pipeline file, the field or row, and the fix."""


def run(source: str, verbose: bool = True, tokenizer: dict[str, Any] | None = None,
        template: dict[str, Any] | None = None, install_template: bool = False,
        examples: list[dict[str, Any]] = (), lengths: list[dict[str, Any]] = (),
        shapes: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The helper's entry point (`align.modeling.checks:run`); the keyword arguments are `model_job`'s."""
    from align.config import stage_types

    stage_types()  # every stage type's module: the length rules and data forms they declare are registered
    if model is not None and (problem := model_class_problem(**model)):
        raise CheckError(f"{source}: base_model: {problem}")
    out: dict[str, Any] = {}
    if shapes is not None:
        out["shapes"] = model_shapes.shapes(**shapes)
    tok = load_tokenizer_checked(source, verbose, **tokenizer) if tokenizer else None
    if tok is None:
        return out
    planned = templates.ChatTemplate.from_dict(template) if template else None
    try:
        if install_template and planned is not None:
            before = len(tok)
            try:
                templates.install(tok, planned)
            except ModelError as exc:  # names the template itself
                raise CheckError(f"{source}: chat_template: {exc}") from None
            except FormatError as exc:  # the template renders no prompt then reply
                raise CheckError(f"{source}: chat_template ({planned.source}): {exc}") from None
            problem = templates.prompt_boundary_problem(tok)
            if problem and verbose:
                print(f"  warning: chat template: {problem}")
            check_trl_agrees(tok, planned, source)
            out["tokens_added"] = len(tok) - before  # rows LoRA must train (lora.py new_token_rows); refused where
            # a stage that installs the template trains nothing (validate.py _check_new_token_rows)
            if verbose:
                print(f"  chat template: {planned.describe()}")
        for ex in examples:
            show_example(tok, planned, source, verbose, **ex)
        for job in lengths:
            check_length(tok, source, verbose, **job)
    except TEMPLATE_FAULTS as exc:  # a template that parses but fails on a conversation (m.content / 0, a
        if not _raised_in_template(exc):  # missing attribute); raised anywhere else, it is not the template's
            raise
        where = planned.source if planned is not None else "the tokenizer's own"
        raise CheckError(f"{source}: chat_template ({where}): rendering a conversation failed "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); fix the "
                         "template so it renders messages of role system/user/assistant with string content") from None
    return out


def _template_faults() -> tuple[type[BaseException], ...]:
    from jinja2 import TemplateError  # the helper process: transformers renders chat templates with jinja2

    return TemplateError, TypeError, ZeroDivisionError, AttributeError


TEMPLATE_FAULTS = _template_faults()


def _raised_in_template(exc: BaseException) -> bool:
    """Whether `exc` came from a chat template's own code: jinja2's errors, or a frame of compiled template code
    (jinja2 names its file "<template>")."""
    import traceback

    from jinja2 import TemplateError

    return isinstance(exc, TemplateError) or any(f.filename == "<template>"
                                                 for f in traceback.extract_tb(exc.__traceback__))


def model_class_problem(name: str, model_type: str, scalar: bool) -> str | None:
    """Why transformers here has no class to load the base model `name` (config.json `model_type`) as a causal LM,
    or, when a stage trains a reward model from it (`scalar`), as a sequence classifier (None: it has both). Found
    at validate, not by the first stage's from_pretrained."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as SCALAR)

    if model_type not in CONFIG_MAPPING_NAMES:
        return (f"{name} is a {model_type!r} model (config.json model_type), which transformers "
                f"{transformers.__version__} installed here does not know: upgrade it (`pip install -U "
                "transformers`), or, for a model that ships its own code (config.json auto_map), read that code and "
                "set `trust_remote_code: true`")
    for needed, mapping, auto in ((True, CAUSAL, "AutoModelForCausalLM"),
                                  (scalar, SCALAR, "AutoModelForSequenceClassification")):
        if needed and model_type not in mapping:
            what = "a causal LM" if mapping is CAUSAL else "a sequence classifier (the reward stage's model)"
            return (f"{name} is a {model_type!r} model, which transformers {transformers.__version__} cannot load "
                    f"as {what} ({auto} has no class for it): align trains decoder-only text models; for a "
                    "vision-language or encoder-decoder checkpoint use a text-only decoder (its text variant), or "
                    "another base_model")
    return None


def load_tokenizer_checked(source: str, verbose: bool, name: str, field: str, trust_remote_code: bool,
                           vocab: int | None):
    """The pipeline's tokenizer, loaded as a stage will load it; its ids must fit the base model's embeddings
    (`vocab`, from config.json). None when a hub tokenizer cannot be fetched from here."""
    from align.modeling.models import load_tokenizer  # heavy (torch): this is the helper process

    local = Path(name).exists()
    try:
        tok = load_tokenizer(name, trust_remote_code)
    except ModelError as exc:
        raise ConfigError(f"{source}: {field}: {exc}") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        if not local and isinstance(exc, OSError):  # partly cached hub tokenizer, hub unreachable from here
            if verbose:
                print(f"  warning: tokenizer '{name}' cannot be loaded from here ({type(exc).__name__}: {first}); "
                      "it is checked, and lengths are counted, when the first stage starts")
            return None
        raise ConfigError(f"{source}: {field}: the tokenizer in '{name}' does not load ({type(exc).__name__}: "
                          f"{first}); {TOKENIZER_SAVE_FIX}") from None
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ConfigError(f"{source}: {field}: the tokenizer in '{name}' has {len(tok)} tokens but the base model's "
                          f"embeddings hold {vocab} (config.json vocab_size); ids past {vocab - 1} would index out "
                          "of range. Use the tokenizer the model was trained with (or resize the embeddings and "
                          "save the model again)")
    return tok


def check_trl_agrees(tokenizer, template, source: str) -> None:
    """The plan chose TRL's patched template by reading TRL's files; TRL's own function must agree (a TRL
    upgrade that changed its table would otherwise go unnoticed)."""
    if template.masking not in ("trl", "prefix"):
        return
    from trl.chat_template_utils import get_training_chat_template  # heavy: the helper process only

    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:
        patched = None
    if (patched or None) != (template.training_text if template.masking == "trl" else None):
        raise CheckError(f"{source}: chat_template: align planned masking '{template.masking}' for "
                         f"{template.source}, but trl.chat_template_utils.get_training_chat_template "
                         f"{'returns a patched template' if patched else 'has no patched template'} for it: "
                         "the installed TRL is not the one align was written against; reinstall align's pinned "
                         "TRL range")


def show_example(tokenizer, template, source: str, verbose: bool, where: str, label: str, rows: list[dict[str, Any]],
                 assistant_turns: bool | str, replies: bool) -> None:
    """Render a card's rows as the stage will, refusing what cannot be rendered; print the first one: for a stage
    that trains on the assistant turns of conversations (`assistant_turns`: "all", or "last" for the final reply
    alone; every row is split, so one that cannot be is found now), the trained spans; for pairs or unpaired rows (`replies`), the prompt's end and the first
    reply; for prompts, the prompt's end, where sampling starts."""
    row = rows[0]
    shown = ""
    if "messages" in row and assistant_turns:
        i = 0
        try:
            for i, r in enumerate(rows):
                example = sft_example(tokenizer, template, r["messages"])
                if assistant_turns == "last":  # the final reply alone, as the stage trains it (stages/sft.py)
                    example["assistant_masks"] = last_reply_only(example["assistant_masks"])
                if 1 not in example["assistant_masks"]:  # a marker under a branch no row takes, or in a comment
                    raise TemplateError(f"chat template {template.source if template else 'of the tokenizer'}: no "
                                        "token of this conversation is trained: its {% generation %} markers never "
                                        "enclose a reply here; fix the markers, or remove them for prefix masking")
                if i == 0:
                    spans = trained_text(tokenizer, example)
                    shown = (f"trains on {len(spans)} span(s), {sum(example['assistant_masks'])} of "
                             f"{len(example['input_ids'])} tokens: " + " | ".join(repr(s) for s in spans))
        except TemplateError as exc:
            raise CheckError(f"{source}: {where}: row {i}: {exc}") from None
    elif isinstance(row.get("prompt"), list):
        try:
            rendered = as_text([row], tokenizer)[0]
        except ValueError as exc:  # FormatError, or a tokenizer without a chat template
            raise CheckError(f"{source}: {where}: row 0: {exc}") from None
        shown = f"prompt ends {rendered['prompt'][-40:]!r}"
        reply = next((c for c in ("chosen", "completion") if c in rendered), None) if replies else None
        if reply:
            shown += f"; {reply} reply {rendered[reply][:80]!r} + EOS {tokenizer.eos_token!r}"
        else:
            shown += f"; responses are sampled up to EOS {tokenizer.eos_token!r}"
    if shown and verbose:
        print(f"  {label} example 0: {shown}")


def check_length(tokenizer, source: str, verbose: bool, where: str, stage: str, rule: str,
                 rows: list[dict[str, Any]], max_length: int, max_fraction: float) -> None:
    """Count a trained stage's over-long examples by its trainer's rule, rendered as the stage will render them
    (conversational prompts and replies with the chat template; `messages` rows as they are), after the rows that
    hold a special token's text, which the stage drops (or refuses: align/runtime/rows.py `drop_special_text`)."""
    try:
        kept, found = without_special_text(rows, tokenizer, f"{source}: {where}")
    except FormatError as exc:
        raise CheckError(str(exc)) from None
    if found and verbose:
        print(f"  {where}: {len(found)} of {len(rows)} rows hold a special token's text ({found[0][1]!r}): "
              "dropped and counted when the stage starts")
    rows = kept
    try:
        rows = as_text(rows, tokenizer)
    except FormatError as exc:
        raise CheckError(f"{source}: {where}: {exc}") from None
    same = same_after_template_problem(rows, f"{source}: {where}")  # what the stage would refuse when it starts
    if same:
        raise CheckError(same)
    report = RULES[rule].measure(stage, rows, tokenizer, max_length)
    if verbose:
        print(f"  length check {report.summary()}")
    try:
        enforce(report, max_fraction)
    except LengthError as exc:
        raise CheckError(f"{source}: {exc}") from None
