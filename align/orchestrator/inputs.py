"""The base model and tokenizer a pipeline names, checked at `align validate` before anything launches.

- A value that looks local (starts with `.`, `/` or `~`, ends with `/`, is not hub-id shaped, or whose first
  component is an existing directory beside the pipeline or here) must exist: it is never sent to the hub,
  where a typo would cost a minute of retries and end in a misleading "repository not found".
- A local model directory must hold a config.json that parses to a JSON object naming its `model_type`.
- A hub id is looked up offline first (the local Hugging Face cache, then `base_model_config:`); when neither
  has it, nothing is asked of the hub: a note, and the stage checks again on the machine that runs it.
- A local tokenizer directory must hold tokenizer files that parse (tokenizer.json, tokenizer_config.json, a
  SentencePiece tokenizer.model with the `sentencepiece` package installed), then load, have an EOS token (a pad
  token is added from EOS when missing) and fit the model's vocabulary. Checked before loading because
  transformers names the wrong cause: a damaged tokenizer.model, or one without `sentencepiece`, falls back to
  a tiktoken reader and ends in "`tiktoken` is required".
- A hub tokenizer that is not cached, or cannot be fetched while offline, is a note: it is checked again when
  the first stage starts (the machine that runs it may have network).
- The longest sequence a stage trains on or generates must fit the model's position embeddings.

No torch at import time: the runner imports this module.
"""

from __future__ import annotations

import importlib.util
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from align.core import gguf

from align.core import packaged as core_packaged
from align.templates import hub_file as _hub_file
from align.core.builtin import is_builtin
from align.core.errors import TOKENIZER_SAVE_FIX
from align.config import PipelineConfig
from align.core.schema import ConfigError
from align.data.lengths import config_positions
from align.orchestrator.model_files import config_problem, model_dir_problem

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


_ONCE: dict[tuple, Any] | None = None


@contextmanager
def resolved_once() -> Iterator[None]:
    """Within it, the model inputs (`resolve_model_paths`, `base_model_config`) are worked out once per pipeline
    file and setting, however many checks ask: the CLI opens it around one command (`align run` asked 5-7 times,
    each a packaged model's cache check, a config.json read or a hub cache lookup). Outside it every call looks
    again, so a long-lived process never reads a stale answer."""
    global _ONCE
    outer, _ONCE = _ONCE, {}
    try:
        yield
    finally:
        _ONCE = outer


def _once(key: tuple, compute: Callable[[], Any]) -> Any:
    if _ONCE is None:
        return compute()
    if key not in _ONCE:
        _ONCE[key] = compute()  # an error is raised again by the next caller, never remembered
    return _ONCE[key]


def resolve_model_paths(cfg: PipelineConfig, source: str | Path) -> dict[str, str | None]:
    """base_model / tokenizer that name local paths, resolved relative to the pipeline file (like data cards);
    hub ids pass through. A local-looking value that does not exist is an error (see the module docstring).
    A local `.gguf` file is a base model (align/core/gguf.py)."""
    key = ("paths", str(Path(source).resolve()), str(source), cfg.base_model, cfg.tokenizer)
    return dict(_once(key, lambda: _resolve_model_paths(cfg, source)))


def _resolve_model_paths(cfg: PipelineConfig, source: str | Path) -> dict[str, str | None]:
    base_dir = Path(source).resolve().parent
    out: dict[str, str | None] = {}
    for key in ("base_model", "tokenizer"):
        value = getattr(cfg, key)
        if value is not None and not value.strip():
            raise ConfigError(f"{source}: {key}: empty; " + (
                "name a model (a hub id, a local directory, a .gguf file, builtin:tiny-llama or packaged:smollm2)"
                if key == "base_model" else "name a tokenizer (a hub id or a local directory), or remove the field "
                                            "to use the base model's own"))
        if not value or is_builtin(value):
            out[key] = value
            continue
        if value.startswith(core_packaged.SCHEME):  # a model shipped in a PyPI package, fetched into the cache
            try:
                out[key] = core_packaged.resolve(value)
            except core_packaged.PackagedError as exc:
                raise ConfigError(f"{source}: {key}: {exc}") from None
            continue
        local = (base_dir / Path(value).expanduser())
        if local.exists():  # a file keeps its own name: a hub cache's snapshots/x/M.gguf links to blobs/<sha>
            out[key] = str(local.resolve() if local.is_dir() else local.parent.resolve() / local.name)
            continue
        if problem := _missing_local(value, base_dir):
            raise ConfigError(f"{source}: {key}: {problem}")
        out[key] = value  # a hub id
    return out


def _missing_local(value: str, base_dir: Path) -> str | None:
    """Why a model value that names nothing here is not a hub id either (None: it is one): it looks like a local path
    (a ./ or / start, a trailing /, not a hub id's shape, or a first part that is a local directory)."""
    first = value.split("/")[0]
    if value.startswith((".", "/", "~")) or value.endswith("/") or not HUB_ID.fullmatch(value) or \
            (base_dir / first).is_dir() or Path(first).is_dir():
        return (f"local path '{value}' not found (looked for {base_dir / Path(value).expanduser()}); a value that "
                "names a local directory is never looked up on the hub. Fix the path (it is relative to the pipeline "
                "file)")
    return None


def _read_config(path: Path, what: str) -> dict[str, Any]:
    raw, problem = config_problem(path)
    if problem:
        raise ConfigError(f"{what}: {problem}")
    return raw


def base_model_config(cfg: PipelineConfig, source: str | Path, paths: dict[str, str | None]) -> dict[str, Any] | None:
    """The base model's config.json as a dict: local directory, HF cache, or the declared copy; None for a
    builtin model or a hub model that nothing here describes."""
    key = ("config", str(Path(source).resolve()), str(source), paths["base_model"], cfg.base_model_config)
    return _once(key, lambda: _decoder_fields(_base_model_config(cfg, source, paths)))


def _decoder_fields(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """A vision-language model's config (Gemma 3 4B+, Mistral-Small-3.1, Llama 4) keeps its decoder's vocabulary
    and positions under `text_config`: read there (as transformers' get_text_config reads them), so the tokenizer
    and length checks see them; what names the model and its code (model_type, architectures, auto_map) stays the
    top level's."""
    text = (config or {}).get("text_config")
    if not isinstance(text, dict):
        return config
    return {**config, **text, **{k: config[k] for k in ("model_type", "architectures", "auto_map") if k in config}}


def _base_model_config(cfg: PipelineConfig, source: str | Path, paths: dict[str, str | None]) -> dict[str, Any] | None:
    value = paths["base_model"]
    if not value or is_builtin(value):
        return None
    if Path(value).is_dir():
        read, problem = model_dir_problem(Path(value))
        if problem:
            raise ConfigError(f"{source}: base_model: {problem}")
        return read
    if Path(value).is_file():
        if not gguf.is_gguf(value):
            raise ConfigError(f"{source}: base_model: {value} is a file; name the model's directory, or a .gguf "
                              "checkpoint file")
        try:
            return gguf.config_of(value)
        except gguf.GGUFError as exc:
            raise ConfigError(f"{source}: base_model: {exc}") from None
    if _hub_file(value, "adapter_config.json"):  # as align/modeling/models.py `published_adapter` refuses it
        raise ConfigError(f"{source}: base_model: {value} is a PEFT adapter (adapter_config.json), not a whole model; "
                          "merge it into its base and name the merged model, or name its base")
    cached = _hub_file(value, "config.json")
    if cached:
        return _read_config(Path(cached), f"{source}: base_model (cached hub model {value})")
    if cfg.base_model_config:
        local = Path(source).resolve().parent / cfg.base_model_config
        local = local / "config.json" if local.is_dir() else local
        if not local.is_file():
            raise ConfigError(f"{source}: base_model_config: '{cfg.base_model_config}' not found (looked for {local})")
        return _read_config(local, f"{source}: base_model_config")
    return None


def local_model_problem(value: str, base_dir: Path, trust_remote_code: bool) -> str | None:
    """What keeps a model a setting names (a pairwise judge's `model`) from loading, found as the base model's is,
    before anything trains (None: a hub id, a packaged model, or a whole model directory)."""
    if value.startswith(core_packaged.SCHEME):  # fetched into align's cache (`align model`), checked there
        return None
    local = base_dir / Path(value).expanduser()
    if not local.exists():
        return _missing_local(value, base_dir)
    if local.is_file():
        return None if gguf.is_gguf(str(local)) else f"{local} is a file; name the model's directory"
    config, problem = model_dir_problem(local)
    if problem:
        return problem
    if config.get("auto_map") and not trust_remote_code:
        return (f"{local} ships its own Python code (config.json auto_map), which align does not run by default. Read "
                "that code, then set `trust_remote_code: true` in the pipeline to allow it")
    return tokenizer_files_problem(local)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tekken.json")
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+")


def tokenizer_files_problem(directory: Path) -> str | None:
    """What is wrong with a local tokenizer directory's files, found without loading it (None: nothing)."""
    if directory.is_file():
        return f"{directory} is a file; name the directory that holds it (tokenizer files and tokenizer_config.json)"
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing"
        return (f"{directory} holds no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...; found: "
                f"{found}); {TOKENIZER_SAVE_FIX}, or set `tokenizer:` to the directory that holds it")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                return f"{path} is damaged ({type(exc).__name__}: {exc}); {TOKENIZER_SAVE_FIX}"
    model = directory / "tokenizer.model"
    if model.is_file() and not (directory / "tokenizer.json").is_file():
        return _tokenizer_model_problem(model)
    return None


def _tokenizer_model_problem(path: Path) -> str | None:
    """A tokenizer.model that transformers must convert: a SentencePiece model (Llama-2, Mistral, Gemma) needs
    `sentencepiece` and `protobuf`; a tiktoken file (Llama-3's original format) needs `tiktoken`."""
    blob = path.read_bytes()
    if TIKTOKEN_LINE.fullmatch(blob.split(b"\n", 1)[0].strip()):
        if importlib.util.find_spec("tiktoken") is None:
            return f"{path} is a tiktoken file and the `tiktoken` package is not installed: pip install tiktoken"
        return None
    missing = [pkg for pkg, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
               if importlib.util.find_spec(module.split(".")[0]) is None]
    if missing:
        return (f"{path} is a SentencePiece model and transformers needs the {' and '.join(missing)} package to "
                f"read it: pip install {' '.join(missing)}")
    import sentencepiece  # light (no torch); installed, as checked above

    try:
        sentencepiece.SentencePieceProcessor(model_proto=blob)
    except (RuntimeError, OSError):
        return (f"{path} is neither a SentencePiece model (sentencepiece cannot parse it) nor a tiktoken file; "
                f"it is damaged or truncated: {TOKENIZER_SAVE_FIX}")
    return None


def tokenizer_name(cfg: PipelineConfig, paths: dict[str, str | None]) -> tuple[str | None, str]:
    """The tokenizer the pipeline loads (None: the builtin model's, trained by the first stage) and the field that
    names it."""
    name = paths["tokenizer"] or (None if is_builtin(str(paths["base_model"])) else paths["base_model"])
    return name, "tokenizer" if paths["tokenizer"] else "base_model"


def check_tokenizer_files(cfg: PipelineConfig, source: str | Path, paths: dict[str, str | None]) -> str | None:
    """A local tokenizer's files must be readable (checked here without loading it); a hub tokenizer that is not
    cached is a note: it is checked when the first stage starts. Loading it, and what only the loaded tokenizer
    can tell, is align/modeling/checks.py's (a helper process)."""
    name, key = tokenizer_name(cfg, paths)
    if name is None:
        return None
    if Path(name).exists():
        # a GGUF file holds its tokenizer in its metadata (its readability: base_model_config)
        problem = None if gguf.is_gguf(name) else tokenizer_files_problem(Path(name))
        if problem:
            raise ConfigError(f"{source}: {key}: {problem}")
        return None
    if not _hub_file(name, "tokenizer_config.json"):
        return f"tokenizer '{name}' is not cached here; it is checked when the first stage starts"
    return None


HUB_TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What `fetch_tokenizer` takes of a hub model repository: the tokenizer's files, its chat template, config.json and
generation_config.json; never weights."""


def fetch_tokenizer(cfg: PipelineConfig, source: str | Path) -> str | None:
    """A hub tokenizer not cached here, fetched into the Hugging Face cache when the hub answers (its small files
    alone, HUB_TOKENIZER_PATTERNS), so that validation measures lengths and renders the chat template before any
    stage runs (PPO's prompt-length refusal came only after SFT and the reward model had trained), and the plan
    reads the template instead of leaving it to the first stage. Returns a note when the hub did not give it (a gated model
    without a token, an unknown id), else None."""
    from align.data.hub import hub_reachable

    name, key = tokenizer_name(cfg, resolve_model_paths(cfg, source))
    if name is None or Path(name).exists() or _hub_file(name, "tokenizer_config.json") or not hub_reachable():
        return None
    try:
        from huggingface_hub import snapshot_download  # light (no torch); only when the hub answers

        snapshot_download(name, allow_patterns=HUB_TOKENIZER_PATTERNS)
    except Exception as exc:  # gated, unknown, rate-limited: the first stage loads it (and says why) as before
        return (f"{key} '{name}': its tokenizer could not be fetched from the hub ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); for a gated model log in "
                "(`hf auth login` or HF_TOKEN)")
    return None


def tokenizer_to_check(cfg: PipelineConfig, source: str | Path) -> str | None:
    """The tokenizer validation can load on this machine (local, or cached from the hub), else None."""
    name, _ = tokenizer_name(cfg, resolve_model_paths(cfg, source))
    if name is None or not (Path(name).exists() or _hub_file(name, "tokenizer_config.json")):
        return None
    return name


def positions(cfg: PipelineConfig, config: dict[str, Any] | None) -> int | None:
    """The longest sequence the base model accepts, when known."""
    if is_builtin(cfg.base_model):
        return cfg.builtin.max_position_embeddings
    return config_positions(config)


def check_lengths_fit(cfg: PipelineConfig, source: str | Path, limit: int | None) -> None:
    """Trained sequences and PPO's prompt + response must fit the model's position embeddings."""
    if limit is None:
        return
    fix = f"the model has {limit} positions (builtin.max_position_embeddings or its config.json)"
    for name, st in cfg.stages.items():
        try:
            st.check_positions(limit, fix)
        except ValueError as exc:
            raise ConfigError(f"{source}: stages.{name}.{exc}") from None


def check_model_inputs(cfg: PipelineConfig, source: str | Path) -> list[str]:
    """Everything above; returns notes for what could not be checked from this machine."""
    paths = resolve_model_paths(cfg, source)
    config = base_model_config(cfg, source, paths)
    notes = []
    if config is None and not is_builtin(cfg.base_model):
        notes.append(f"base_model '{cfg.base_model}' is not cached here and has no base_model_config copy; its "
                     "config is checked when the first stage starts")
    if cfg.base_model_config and is_builtin(cfg.base_model):
        notes.append(f"base_model_config '{cfg.base_model_config}' is not read: base_model '{cfg.base_model}' is "
                     "built from `builtin:` (remove the field, or name the model it describes in base_model)")
    auto_map = (config or {}).get("auto_map")
    if auto_map and not cfg.trust_remote_code:  # the stage refuses it too (models.check_remote_code): say it now
        named = sorted(map(str, auto_map)) if isinstance(auto_map, (dict, list)) else repr(auto_map)
        raise ConfigError(f"{source}: base_model: '{cfg.base_model}' ships its own Python code (config.json "
                          f"auto_map: {named}), which align does not run by default. Read that code, then set "
                          "`trust_remote_code: true` in the pipeline to allow it")
    note = check_tokenizer_files(cfg, source, paths)
    if note:
        notes.append(note)
    b = cfg.builtin
    if is_builtin(cfg.base_model) and b.hidden_size % b.num_heads:
        raise ConfigError(f"{source}: builtin.hidden_size: {b.hidden_size} is not divisible by builtin.num_heads "
                          f"({b.num_heads})")
    check_lengths_fit(cfg, source, positions(cfg, config))
    return notes
