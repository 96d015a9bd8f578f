"""Chat templates: the shipped formats, the pipeline's `chat_template` setting, and installing a template on a
tokenizer.

Shipped (jinja files beside this module): `llama3` (<|begin_of_text|><|start_header_id|>role<|end_header_id|>
\\n\\ncontent<|eot_id|>) and `chatml` (Qwen-style <|im_start|>role\\ncontent<|im_end|>\\n). Both mark the
assistant's content and end-of-turn token with `{% generation %}`, which TRL's assistant-only loss needs
(transformers' `return_assistant_tokens_mask`).

Installing a template (at the SFT stage that starts from the base model; every later stage loads the tokenizer
that stage saved) does three things, each logged:
1. every `<|...|>` literal of the template that the tokenizer lacks is added as a special token (the model's
   embeddings are resized to match: align/models.py `fit_model_to_tokenizer`);
2. the template becomes the tokenizer's chat template;
3. the template's end-of-turn token (the special token right after an assistant's content) becomes the
   tokenizer's EOS, as Qwen and Llama-3 instruct models ship it. Everything that stops or scores at EOS then
   stops and scores at the end of the turn: generation (align/generation.py), the response mask, the
   missing-EOS penalty, and the EOS that TRL's reward and DPO trainers and the reward-model judge append.

No torch here: the runner resolves and checks the setting at `align validate`.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from align.schema import ConfigError

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).parent
SHIPPED = ("llama3", "chatml")
_SPECIAL = re.compile(r"<\|[^|<>\s]+\|>")
_GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
# A two-turn probe: what the template writes right after the assistant's content is its end-of-turn token.
PROBE = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]


def resolve(value: str | None, source: str | Path) -> str | None:
    """The pipeline's `chat_template`, checked: None (the tokenizer's own), a shipped name, or the absolute path
    of a jinja file (relative paths are relative to the pipeline file). A missing or unparseable file is a
    ConfigError naming it."""
    if value is None or value in SHIPPED:
        return value
    path = (Path(source).resolve().parent / Path(value).expanduser()).resolve()
    where = f"{source}: chat_template"
    if not value.endswith((".jinja", ".j2")):
        raise ConfigError(f"{where}: '{value}' is neither a shipped template ({', '.join(SHIPPED)}) nor a .jinja "
                          "file; name one of those, or null for the tokenizer's own template")
    if not path.is_file():
        raise ConfigError(f"{where}: file '{value}' not found (looked for {path}); the path is relative to the "
                          "pipeline file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} cannot be read as UTF-8 text ({type(exc).__name__})") from None
    check_syntax(text, f"{where}: {path}")
    return str(path)


def check_syntax(text: str, where: str) -> None:
    """The template parses as Jinja (with transformers' `{% generation %}` tags) and names `messages`."""
    import jinja2  # light, but only needed when a template file is checked

    try:
        jinja2.Environment().parse(_GENERATION_TAG.sub("", text))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    if "messages" not in text:
        raise ConfigError(f"{where}: the template never reads `messages`; a chat template renders the "
                          "conversation in `messages` (see align/templates/chatml.jinja)")


def template_text(resolved: str) -> str:
    """The jinja source of a resolved setting (a shipped name or a file path)."""
    path = TEMPLATE_DIR / f"{resolved}.jinja" if resolved in SHIPPED else Path(resolved)
    return path.read_text(encoding="utf-8")


def digest(value: str | None, source: str | Path) -> str | None:
    """Content hash of the chosen template (for the SFT stage's fingerprint: editing the file reruns it)."""
    resolved = resolve(value, source)
    return None if resolved is None else hashlib.sha256(template_text(resolved).encode()).hexdigest()[:16]


def has_generation_markers(text: str) -> bool:
    """Whether the template marks assistant tokens with `{% generation %}` (assistant-only loss needs it)."""
    return _GENERATION_TAG.search(text) is not None


def special_literals(text: str) -> list[str]:
    """The `<|...|>` tokens a template writes, in order of first appearance."""
    return list(dict.fromkeys(_SPECIAL.findall(text)))


def end_of_turn(tokenizer) -> str:
    """The special token the tokenizer's chat template writes right after an assistant's content."""
    from align.models import ModelError  # heavy (torch): a stage or validation already loaded a tokenizer

    rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)
    after = rendered[rendered.rindex("PONG") + len("PONG"):] if "PONG" in rendered else ""
    specials = sorted({*tokenizer.get_added_vocab(), *tokenizer.all_special_tokens}, key=len, reverse=True)
    found = next((t for t in specials if t and after.startswith(t)), None)
    if found is None:
        raise ModelError(f"the chat template writes {after[:30]!r} after an assistant's reply, not a special token "
                         "of the tokenizer: responses could never stop at the end of a turn. End assistant turns "
                         "with a special token (e.g. <|im_end|>), or use chat_template: chatml or llama3")
    return found


def install(tokenizer, text: str | None) -> list[str]:
    """Give the tokenizer a chat template (None: keep its own) and make the end-of-turn token its EOS.

    Returns the special tokens that were added (the model's embeddings must grow by that many)."""
    from tokenizers import AddedToken  # heavy: stage processes and validation only

    added: list[str] = []
    if text is not None:
        vocab = tokenizer.get_vocab()
        added = [t for t in special_literals(text) if t not in vocab]
        if added:
            tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True)
            log.warning("chat template: added special tokens %s to the tokenizer", added)
        tokenizer.chat_template = text
    eot = end_of_turn(tokenizer)
    if eot != tokenizer.eos_token:
        log.warning("chat template: EOS is now the end-of-turn token %r (was %r): generation stops there and "
                    "reward models score there", eot, tokenizer.eos_token)
        tokenizer.eos_token = eot
    problem = prompt_boundary_problem(tokenizer)
    if problem:
        log.warning("chat template: %s", problem)
    return added


def prompt_boundary_problem(tokenizer) -> str | None:
    """Whether a prompt rendered with the generation prompt tokenises alone as it does with a reply after it.

    Byte-level BPE with GPT-2's pre-tokenizer splits "\n\n" into two tokens before a word but keeps it as one
    at the end of a text: with the llama3 format, PPO and evaluation would sample from a prompt whose last token
    SFT never saw there (TRL's DPO trainer warns of the same). ChatML's single newline has no such boundary."""
    from align.data.chat import as_text  # the rendering every stage after SFT uses

    row = as_text([{"prompt": PROBE[:1], "completion": PROBE[1:]}], tokenizer)[0]
    alone = tokenizer(row["prompt"])["input_ids"]
    joined = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
    if joined[:len(alone)] == alone:
        return None
    n = next((i for i, (a, b) in enumerate(zip(alone, joined)) if a != b), len(alone))
    return (f"a prompt's last tokens {tokenizer.convert_ids_to_tokens(alone[n:])} become "
            f"{tokenizer.convert_ids_to_tokens(joined[n:len(alone) + 1])} once a reply follows, so PPO and "
            "evaluation sample after tokens SFT never trained there. Prefer chat_template: chatml with this "
            "tokenizer (its generation prompt ends in a single newline)")
