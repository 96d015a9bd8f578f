"""Chat templates: the pipeline's `chat_template` setting resolved once, at planning, into a `ChatTemplate`
that every stage reads from its spec; installing it on a tokenizer in the stage that starts from the base model.

Shipped (every `*.jinja` file beside this module): `chatml` (Qwen-style <|im_start|>role\\ncontent<|im_end|>\\n),
`llama3` (<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>) and `default` (align's role-tagged
template, for tokenizers that ship none). All three mark the assistant's content and end-of-turn token with
`{% generation %}`.

`chat_template: null` means the tokenizer's own template (read from its files, a GGUF file's metadata, or the
Hugging Face cache), as stock chat models ship it: without generation markers. Which tokens SFT trains on
(`masking`; align/data/chat.py `sft_example`) is then decided here, once:
- `markers`: the template has `{% generation %}` markers (transformers' assistant-token mask);
- `trl`: TRL ships a marker-patched copy of this exact template (`trl/chat_templates/<name>_training.jinja`, as
  `trl.chat_template_utils.get_training_chat_template` says; `align validate` checks that TRL agrees): SFT's masks
  come from that copy where each reply's context renders as the stock template's; the tokenizer keeps the stock one;
- `prefix`: `messages[:i]` rendered with the generation prompt, then `messages[:i+1]`: the new text up to and
  including the end-of-turn token is turn i's reply. A template that rewrites earlier turns is refused.

Installing a template (the SFT stage that starts from the base model; every later stage loads the tokenizer
that stage saved) does three things, each logged:
1. the `<|...|>` tokens and the end-of-turn token the template writes that the tokenizer lacks are added as
   special tokens (the model's embeddings grow to match: align/modeling/models.py `fit_model_to_tokenizer`); other
   tag-shaped text it lacks (`[INST]`, `<think>`) stays ordinary text;
2. the template becomes the tokenizer's chat template (unless it is the tokenizer's own);
3. the template's end-of-turn token (the special token right after an assistant's content) becomes the
   tokenizer's EOS, as Qwen and Llama-3 instruct models ship it: generation stops there, and the EOS that TRL's
   reward and DPO trainers append is that token. Reward models score there when the pad token is another one;
   where pad is EOS (SmolLM2, Llama-2, Mistral, GPT-2), transformers' classifier rule (the rightmost token that is
   not pad) reads the token before it, in training and scoring alike.

No torch here: the runner resolves the setting when it plans.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.data.chat import GENERATION_TAG, as_text, encoding_problem, has_generation_markers
from align.core.errors import ModelError
from align.core.schema import ConfigError

log = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).parent
SHIPPED = tuple(sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja")))
MASKINGS = ("markers", "trl", "prefix")
# Token-shaped literals a template writes: <|im_start|>, <start_of_turn>, </think>, [INST], [/INST].
_SPECIAL = re.compile(r"<\|[^|<>\s]+\|>|</?[A-Za-z][\w-]*>|\[/?[A-Z][A-Z_]*\]")
_STRING = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")
_TAG = re.compile(r"(\{\{.*?\}\}|\{%.*?%\})", re.S)
_COMMENT = re.compile(r"\{#.*?#\}", re.S)
# A two-turn probe: what the template writes right after the assistant's content is its end-of-turn token.
PROBE = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]


@dataclass(frozen=True)
class ChatTemplate:
    """The pipeline's chat template, resolved once (`resolve`) and carried in every stage's spec."""

    source: str
    """Where the text came from: `shipped:<name>`, `file:<path>`, `tokenizer:<name>` (the tokenizer's own), or
    `deferred:<name>` (a hub tokenizer not cached here: the first stage reads it)."""
    text: str | None
    """The Jinja source (None only when deferred)."""
    digest: str | None
    """sha256 of `text` (16 hex digits): part of the fingerprint of the stage that installs it."""
    masking: str | None
    """How SFT finds the assistant tokens: markers | trl | prefix (see the module docstring)."""
    special_tokens: tuple[str, ...] = ()
    """Token-shaped literals the template writes (added to a tokenizer that lacks them)."""
    end_of_turn: str | None = None
    """The special token written right after an assistant's reply, when known without loading the tokenizer."""
    training_text: str | None = None
    """masking `trl`: TRL's marker-patched copy of `text`, used for SFT's masks only."""
    trl_name: str | None = None
    """masking `trl`: the name of TRL's template (trl/chat_templates/<name>.jinja)."""

    @property
    def own(self) -> bool:
        """The tokenizer's own template (nothing to install but the end-of-turn EOS)."""
        return self.source.startswith(("tokenizer:", "deferred:"))

    @property
    def name(self) -> str:
        return self.source.split(":", 1)[1] if ":" in self.source else self.source

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ChatTemplate:
        raw = dict(raw)
        raw["special_tokens"] = tuple(raw.get("special_tokens") or ())
        return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw})

    def describe(self) -> str:
        how = {"markers": "its {% generation %} markers", "trl": f"TRL's patched copy ({self.trl_name})",
               "prefix": "prefix-by-prefix rendering", None: "decided when the first stage loads the tokenizer"}
        return f"{self.source} (digest {self.digest}); assistant tokens from {how[self.masking]}"


# --------------------------------------------------------------------------------------------- resolution
def resolve(value: str | None, source: str | Path, tokenizer: str | None) -> ChatTemplate:
    """The pipeline's `chat_template` as a ChatTemplate. `value`: None (the tokenizer's own; align's `default`
    when it has none), a shipped name, or a .jinja file (relative to the pipeline file). `tokenizer`: the
    resolved tokenizer path or hub id (None: the builtin model's, trained by the first stage). Missing or
    unparseable files are ConfigErrors naming them. Call it once per plan (align/orchestrator/plan.py)."""
    where = f"{source}: chat_template"
    if value is None:
        if tokenizer is None:
            return _make("shipped:default", _shipped_text("default"), where)
        own, special = tokenizer_template(tokenizer)
        if own is False:
            return ChatTemplate(f"deferred:{tokenizer}", None, None, None)
        if own is None:
            log.warning("tokenizer %s ships no chat template: align's default role-tagged template is used",
                        tokenizer)
            return _make("shipped:default", _shipped_text("default"), where)
        return _make(f"tokenizer:{tokenizer}", own, where, special)
    if value in SHIPPED:
        return _make(f"shipped:{value}", _shipped_text(value), where)
    path = (Path(source).resolve().parent / Path(value).expanduser()).resolve()
    if not value.endswith((".jinja", ".j2")):
        raise ConfigError(f"{where}: '{value}' is neither a shipped template ({', '.join(SHIPPED)}) nor a .jinja "
                          "file; name one of those, or null for the tokenizer's own template")
    if not path.is_file():
        raise ConfigError(f"{where}: file '{value}' not found (looked for {path}); the path is relative to the "
                          "pipeline file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # an editor's byte-order mark is no text of every prompt
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {path} cannot be read as UTF-8 text ({type(exc).__name__})") from None
    return _make(f"file:{path}", text, f"{where}: {path}")


def _shipped_text(name: str) -> str:
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _make(source: str, text: str, where: str, tokenizer_specials: dict[str, str] | None = None) -> ChatTemplate:
    check_syntax(text, where)
    specials = special_literals(text)
    masking, trl_name, training = "prefix", None, None
    if has_generation_markers(text):
        masking = "markers"
    else:
        found = trl_training_template(text)
        if found:
            masking, (trl_name, training) = "trl", found
    return ChatTemplate(source, text, text_digest(text), masking, tuple(specials),
                        probe_end_of_turn(text, specials, tokenizer_specials or {}), training, trl_name)


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_syntax(text: str, where: str) -> None:
    """The template parses as Jinja (with transformers' `{% generation %}` tags) and names `messages`."""
    import jinja2  # light, but only needed when a template is checked

    try:
        jinja2.Environment().parse(GENERATION_TAG.sub(  # as a block, so an unclosed or crossed marker is found
            lambda m: "{% endif %}" if m.group(1) else "{% if true %}", text))
    except jinja2.TemplateSyntaxError as exc:
        hint = (" (each {% generation %} is read as a block, here as an `if`: close it with {% endgeneration %} "
                "inside the block that opens it)") if GENERATION_TAG.search(text) else ""
        raise ConfigError(f"{where}: not a valid Jinja template (line {exc.lineno}: {exc.message}){hint}") from None
    if "messages" not in text:
        raise ConfigError(f"{where}: the template never reads `messages`; a chat template renders the "
                          "conversation in `messages` (see align/templates/chatml.jinja)")


def special_literals(text: str) -> list[str]:
    """Token-shaped literals the template writes (<|im_end|>, <end_of_turn>, [INST], ...): in its string literals
    and in its plain text between tags, in order of first appearance."""
    found: list[str] = []
    for k, part in enumerate(_TAG.split(_COMMENT.sub("", text))):
        if k % 2 == 0:  # plain text, written as it is
            found += _SPECIAL.findall(part)
        else:
            for m in _STRING.finditer(part):
                found += _SPECIAL.findall(m.group(1) if m.group(1) is not None else m.group(2))
    return list(dict.fromkeys(found))


def trl_training_template(text: str) -> tuple[str, str] | None:
    """(name, text) of TRL's marker-patched copy of this exact template, read from TRL's package data without
    importing TRL (it imports torch); None when TRL ships none. `align validate` cross-checks the answer with
    `trl.chat_template_utils.get_training_chat_template`."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "chat_templates"
    for training in sorted(folder.glob("*_training.jinja")):
        original = training.with_name(training.name.replace("_training.jinja", ".jinja"))
        if original.is_file() and original.read_text(encoding="utf-8") == text:
            return original.stem, training.read_text(encoding="utf-8")
    return None


def probe_end_of_turn(text: str, specials: list[str], tokenizer_specials: dict[str, str]) -> str | None:
    """The special token the template writes right after an assistant's reply, found by rendering `PROBE`. None
    when it cannot be told without the tokenizer (e.g. the template writes the tokenizer's `eos_token` and the
    tokenizer is not known here). `install` checks the answer against the tokenizer's own rendering."""
    kwargs = {k: v for k, v in tokenizer_specials.items() if k in ("bos_token", "eos_token")}
    try:
        rendered = _render(text, PROBE, **kwargs)
    except Exception:  # noqa: BLE001 - a template that needs the tokenizer's context: decided at install
        return None
    if "PONG" not in rendered:
        return None
    after = rendered[rendered.rindex("PONG") + 4:]
    candidates = sorted({*specials, *tokenizer_specials.values()}, key=len, reverse=True)
    return next((t for t in candidates if t and after.startswith(t)), None)


def _render(text: str, messages: list[dict[str, str]], **context: Any) -> str:
    """Render a chat template in a Jinja sandbox set up as transformers sets up its own (trim_blocks,
    lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`), for the planning probe only:
    importing transformers here would cost the runner a second per plan. Generation markers are dropped."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env.from_string(GENERATION_TAG.sub("", text)).render(messages=messages, add_generation_prompt=False,
                                                                  **context)


# --------------------------------------------------------------------------------------------- the tokenizer's own
def tokenizer_template(name: str) -> tuple[str | None | bool, dict[str, str]]:
    """(template text, special tokens by role) of a tokenizer without loading it: a local directory's
    chat_template.jinja or tokenizer_config.json, a GGUF file's metadata, or the same files in the Hugging Face
    cache. Text None: the tokenizer has no template; False: it cannot be read here (a hub tokenizer not cached)."""
    path = Path(name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_template(path)
    if path.is_dir():
        files = {f: path / f for f in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json")}
        files = {f: p for f, p in files.items() if p.is_file()}
    else:
        files = {}
        for f in ("chat_template.jinja", "tokenizer_config.json", "tokenizer.json"):
            cached = hub_file(name, f)
            if cached:
                files[f] = Path(cached)
        if "tokenizer_config.json" not in files:
            return False, {}
    config = _json(files.get("tokenizer_config.json"))
    specials = {k: _content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
    specials = {k: v for k, v in specials.items() if v}
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].read_text(encoding="utf-8"), specials
    text = config.get("chat_template")
    if isinstance(text, list):  # named variants: the default one
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    return (text if isinstance(text, str) and text else None), specials


def _content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # a damaged tokenizer file is reported by align/orchestrator/inputs.py, which names it
    return raw if isinstance(raw, dict) else {}


def hub_file(repo: str, filename: str) -> str | None:
    """A file of a hub repo from the local Hugging Face cache (no network); None when not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache  # optional: absent means no cache to read
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo, filename)
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None


def _gguf_template(path: Path) -> tuple[str | None, dict[str, str]]:
    from align.core.gguf import read_metadata  # needs the optional `gguf` package: checked by align/orchestrator/inputs.py

    meta = read_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    specials = {}
    for role in ("bos", "eos", "padding"):
        idx = meta.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(idx, int) and 0 <= idx < len(tokens):
            specials[f"{'pad' if role == 'padding' else role}_token"] = tokens[idx]
    return meta.get("tokenizer.chat_template"), specials


# --------------------------------------------------------------------------------------------- installing
def end_of_turn(tokenizer) -> str:
    """The special token the tokenizer's chat template writes right after an assistant's content."""

    rendered = tokenizer.apply_chat_template(PROBE, tokenize=False)
    after = rendered[rendered.rindex("PONG") + len("PONG"):] if "PONG" in rendered else ""
    specials = sorted({*tokenizer.get_added_vocab(), *tokenizer.all_special_tokens}, key=len, reverse=True)
    found = next((t for t in specials if t and after.startswith(t)), None)
    if found is None:
        raise ModelError(f"the chat template writes {after[:30]!r} after an assistant's reply, not a special token "
                         "of the tokenizer: responses could never stop at the end of a turn. End assistant turns "
                         "with a special token (e.g. <|im_end|>), or use chat_template: chatml or llama3")
    return found


def install(tokenizer, template: ChatTemplate) -> list[str]:
    """Give the tokenizer the resolved template (its own: kept) and make the end-of-turn token its EOS.

    Returns the special tokens that were added (the model's embeddings must grow by that many)."""
    from tokenizers import AddedToken  # heavy: stage processes and validation only

    added: list[str] = []
    if not template.own:
        vocab = tokenizer.get_vocab()
        missing = [t for t in template.special_tokens if t not in vocab]
        # <|...|> tokens and the end-of-turn token become special tokens; other tag-shaped text ([INST], <think>)
        # that the tokenizer lacks stays ordinary text, as its pretrained subwords (a new token would start
        # from a random embedding).
        added = [t for t in missing if t.startswith("<|") or t == template.end_of_turn]
        if added:
            tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True)
            log.warning("chat template: added special tokens %s to the tokenizer", added)
        kept = [t for t in missing if t not in added]
        if kept:
            log.warning("chat template: %s are not tokens of this tokenizer: written as ordinary text", kept)
        tokenizer.chat_template = template.text
    elif template.text is None and not tokenizer.chat_template:  # deferred, and the tokenizer has none
        tokenizer.chat_template = _shipped_text("default")
        log.warning("tokenizer ships no chat template: align's default role-tagged template is used")
    elif template.text is not None and _default_variant(tokenizer.chat_template) != template.text:

        raise ModelError(f"the tokenizer's chat template changed since the pipeline was planned ({template.source}, "
                         f"digest {template.digest}); run `align run` again to plan with the current files")
    eot = end_of_turn(tokenizer)
    if template.end_of_turn and eot != template.end_of_turn:

        raise ModelError(f"chat template {template.source}: the tokenizer renders {eot!r} after a reply, but the "
                         f"template was planned with end-of-turn {template.end_of_turn!r}")
    if eot != tokenizer.eos_token:
        log.warning("chat template: EOS is now the end-of-turn token %r (was %r): generation stops there and "
                    "reward models score there unless pad is EOS too", eot, tokenizer.eos_token)
        tokenizer.eos_token = eot
    problem = encoding_problem(tokenizer)  # the end-of-turn token, now EOS, encodes to its id
    if problem:
        raise ModelError(f"chat template {template.source}: the tokenizer {problem}")
    problem = prompt_boundary_problem(tokenizer)
    if problem:
        log.warning("chat template: %s", problem)
    return added


def _default_variant(chat_template: Any) -> Any:
    """A tokenizer's chat template as text: the `default` one of named variants (loaded as a dict)."""
    return chat_template.get("default") if isinstance(chat_template, dict) else chat_template


def prompt_boundary_problem(tokenizer) -> str | None:
    """Whether a prompt rendered with the generation prompt tokenises alone as it does with a reply after it.

    Byte-level BPE with GPT-2's pre-tokenizer splits "\n\n" into two tokens before a word but keeps it as one
    at the end of a text: with the llama3 format, PPO and evaluation would sample from a prompt whose last token
    a reply-joined tokenisation never has there (TRL's DPO trainer warns of the same). ChatML's single newline
    has no such boundary. (SFT with prefix masking tokenises prompt and reply apart, as PPO does.)"""

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
