"""Data cards: a YAML file that says where a dataset lives, its licence, how to read it, and how to split it.

A card is validated before anything trains: the card's fields, the file's existence and encoding, each
row's parse (errors name the file and line), the column mapping, the transform, and non-empty splits.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from align.data.hub import hub_mirror, mirror_digest, resolved_revision
from align.data.formats import FORMS, FormatError, check_canonical, drop_unusable, row_prompt_key
from align.data.sources import DataCardError, DataUnavailableError, read_jsonl, read_rows
from align.data.transforms import TRANSFORMS, transform_source_digest, user_transform

FORMATS = ("jsonl", "json", "tsv", "csv", "parquet", "hub")

__all__ = ["DataCard", "DataCardError", "DataUnavailableError", "LoadedSplit", "load_card", "load_split", "read_jsonl",
           "read_rows"]  # the errors and readers live in align/data/sources.py; callers import them from here too


@dataclass
class DataCard:
    """A validated data card (docs/ARCHITECTURE.md, "Data cards", describes every field)."""

    path: Path
    name: str
    source: dict[str, Any]
    format: str
    produces: str
    columns: dict[str, Any] = field(default_factory=dict)
    transform: dict[str, Any] = field(default_factory=dict)
    splits: dict[str, Any] = field(default_factory=lambda: {"train": 1.0, "seed": 0})
    license: str = ""
    description: str = ""
    citation: str = ""
    max_unusable_fraction: float = 0.01
    """Rows that cannot teach (an empty reply, equal replies, no assistant turn) are dropped and counted up to this
    fraction of a split's rows; above it the card is refused, naming them."""

    @property
    def file(self) -> Path | None:
        """The local data file, resolved relative to the card's directory."""
        if "path" not in self.source:
            return None
        return (self.path.parent / self.source["path"]).resolve()

    @property
    def source_splits(self) -> dict[str, str] | None:
        """A hub source that names its own splits (`source.splits`: align split -> the dataset's split, e.g.
        {train: train_prefs, test: test_prefs}): each align split reads that split whole, nothing is re-split."""
        return self.source.get("splits") if self.format == "hub" else None

    @property
    def split_names(self) -> list[str]:
        return list(self.source_splits or {k for k in self.splits if k != "seed"})

    def content_hash(self) -> str:
        """sha256 of the card text, of its transforms' code, and of the local data file; for a hub source the hub
        id and the revision resolved to its commit (or, read from a local mirror, the mirrored files)."""
        h = hashlib.sha256(self.path.read_bytes())
        for name in self.transform:
            if ":" in name:  # a user's transform: its source file's content
                h.update(name.encode() + transform_source_digest(name, self.path).encode())
        if self.file is not None:
            with open(self.file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            return h.hexdigest()
        h.update(json.dumps(self.source, sort_keys=True).encode())
        mirror = hub_mirror(self.source["hub"])
        if mirror is not None:
            h.update(mirror_digest(mirror).encode())
        else:
            h.update(str(resolved_revision(self.source["hub"], self.source.get("revision"))).encode())
        return h.hexdigest()


_CARD_FIELDS = {"name", "description", "source", "license", "citation", "format", "columns", "produces",
                "transform", "splits", "max_unusable_fraction"}


def _check_mappings(path: Path, raw: dict[str, Any]) -> None:
    """The card fields that are mappings are mappings, and the split's seed a whole number."""
    for key, example in (("columns", "{prompt: question, completion: answer}"), ("transform", "{alpaca: {}}"),
                         ("splits", "{train: 0.9, test: 0.1, seed: 0}")):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise DataCardError(f"{path}: field '{key}': a mapping, e.g. `{key}: {example}`, got a "
                                f"{type(raw[key]).__name__}: {str(raw[key])[:80]}")
    seed = (raw.get("splits") or {}).get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise DataCardError(f"{path}: field 'splits.seed': a whole number (it seeds the split), got {seed!r}")


def load_card(path: str | Path) -> DataCard:
    """Parse and check a card's fields (not its data: see `load_split`)."""
    path = Path(path)
    if not path.is_file():
        raise DataCardError(f"{path}: data card not found (check the path in the pipeline YAML)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise DataCardError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise DataCardError(f"{path}: a data card is a mapping of fields ({', '.join(sorted(_CARD_FIELDS))})")
    unknown = set(raw) - _CARD_FIELDS
    if unknown:
        raise DataCardError(f"{path}: unknown field(s) {sorted(unknown)}; valid: {sorted(_CARD_FIELDS)}")
    for key in ("name", "source", "format", "produces", "license"):
        if not raw.get(key):
            raise DataCardError(f"{path}: field '{key}' is required")
    if raw["format"] not in FORMATS:
        raise DataCardError(f"{path}: field 'format': '{raw['format']}' is not one of {FORMATS}")
    if raw["produces"] not in FORMS:
        raise DataCardError(f"{path}: field 'produces': '{raw['produces']}' is not one of {list(FORMS)}")
    source = raw["source"]
    if not isinstance(source, dict) or not ({"path"} <= source.keys() or {"hub"} <= source.keys()):
        raise DataCardError(f"{path}: field 'source' needs `path: <file>` or `hub: <org/name>` (+ revision)")
    _check_source(path, raw["format"], source)
    _check_mappings(path, raw)
    for name in (raw.get("transform") or {}):
        if ":" in name:  # a user's own transform, `module:function` (like judges): resolved now, not at the stage
            try:
                user_transform(name, path)
            except FormatError as exc:
                raise DataCardError(f"{path}: field 'transform': {exc}") from None
        elif name not in TRANSFORMS:
            raise DataCardError(f"{path}: field 'transform': unknown transform '{name}'; known: {sorted(TRANSFORMS)}, "
                                "or your own as module:function (a module importable from the card's directory)")
    card = DataCard(path=path, name=raw["name"], source=source, format=raw["format"], produces=raw["produces"],
                    columns=raw.get("columns") or {}, transform=raw.get("transform") or {},
                    splits=raw.get("splits") or {"train": 1.0, "seed": 0}, license=raw["license"],
                    description=raw.get("description", ""), citation=raw.get("citation", ""),
                    max_unusable_fraction=_fraction(path, raw.get("max_unusable_fraction", 0.01)))
    _check_file(card)
    if "splits" in source:
        named = source["splits"]
        if card.format != "hub":
            raise DataCardError(f"{path}: field 'source.splits': only a hub source names its own splits; split a local "
                                "file with `splits:` fractions")
        if not isinstance(named, dict) or not named or not all(isinstance(k, str) and isinstance(v, str) and v
                                                                for k, v in named.items()):
            raise DataCardError(f"{path}: field 'source.splits': a mapping of align split -> the dataset's split, e.g. "
                                "{train: train_prefs, test: test_prefs}")
        if raw.get("splits") or "split" in source:
            raise DataCardError(f"{path}: field 'source.splits' names the dataset's own splits; remove "
                                f"{'`splits:`' if raw.get('splits') else '`source.split`'} (nothing is re-split)")
        return card
    _check_fractions(path, {k: v for k, v in card.splits.items() if k != "seed"})
    return card


def _check_source(path: Path, format: str, source: dict[str, Any]) -> None:
    """A hub card names `source.hub`, a local one `source.path`, each a non-empty string, not both."""
    key, other = ("hub", "path") if format == "hub" else ("path", "hub")
    if other in source:
        fix = "a local file takes its own format (jsonl, json, csv, tsv, parquet)" if format == "hub" else \
            "a hub dataset is `format: hub`"
        raise DataCardError(f"{path}: field 'source.{other}' with `format: {format}`, which reads `source.{key}`: "
                            f"{fix}")
    if not isinstance(source.get(key), str) or not source[key].strip():
        what = "the dataset id, e.g. org/name" if key == "hub" else "the data file, relative to the card"
        raise DataCardError(f"{path}: field 'source.{key}': {what}, as text; got {source.get(key)!r}")
    for field_ in ("revision", "config", "data_dir"):
        if field_ in source and source[field_] is not None and not isinstance(source[field_], str):
            raise DataCardError(f"{path}: field 'source.{field_}': text, got {source[field_]!r} "
                                f"({type(source[field_]).__name__}); quote it (YAML reads 0123456 or 20240101 as a "
                                f"number), e.g. {field_}: '{source[field_]}'")


def _check_file(card: DataCard) -> None:
    if "path" not in card.source:
        return
    try:
        file = card.file
    except (RuntimeError, OSError) as exc:  # Path.resolve: a symlink loop
        raise DataCardError(f"{card.path}: field 'source.path': {card.source['path']!r} cannot be resolved ({exc}); "
                            "point it at the data file") from None
    if file.is_dir():
        raise DataCardError(f"{card.path}: field 'source.path': {file} is a directory; name the data file in it")
    if file.exists() and not file.is_file():
        raise DataCardError(f"{card.path}: field 'source.path': {file} is not a regular file (a device, a pipe or "
                            "a socket), which cannot be read twice as the card's hash and rows need; copy the data "
                            "to a file")
    if not file.is_file():
        raise DataCardError(f"{card.path}: field 'source.path': file {file} does not exist")


def _check_fractions(path: Path, fractions: dict[str, Any]) -> None:
    wrong = {k: v for k, v in fractions.items() if isinstance(v, bool) or not isinstance(v, (int, float))
             or not math.isfinite(v)}
    if wrong:
        raise DataCardError(f"{path}: field 'splits': each fraction must be a number, got "
                            + ", ".join(f"{k}: {v!r} ({type(v).__name__})" for k, v in wrong.items())
                            + "; write e.g. {train: 0.9, test: 0.1} (unquoted)")
    if not fractions or any(v < 0 for v in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
        raise DataCardError(f"{path}: field 'splits': fractions must be >= 0 and sum to 1, got {fractions}")


def _fraction(path: Path, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise DataCardError(f"{path}: field 'max_unusable_fraction': {value!r} is not a fraction between 0 and 1")
    return float(value)


# --------------------------------------------------------------------------------------------- splits
@dataclass
class LoadedSplit:
    """Rows of one split in canonical form, plus counts of what the transform dropped."""

    card: DataCard
    split: str
    rows: list[dict[str, Any]]
    dropped: Counter
    total_rows: int
    available: bool = True  # False: a hub dataset not reachable from here (rows not checked)
    read: int = 0  # rows the source held, before the card's transforms (which may drop, split or join rows)


def load_split(card: DataCard | str | Path, split: str) -> LoadedSplit:
    """Read, transform, validate and split a card; return one split (an empty split is an error)."""
    if not isinstance(card, DataCard):
        card = load_card(card)
    named = card.source_splits
    if named is not None and split not in named:
        raise DataCardError(f"{card.path}: no split '{split}'; the card defines {sorted(named)} (source.splits)")
    rows = read_rows(card, named[split] if named else None)
    if not rows:
        raise DataCardError(f"{card.file or card.path}: the dataset is empty")
    seed = int(card.splits.get("seed", 0))
    read = len(rows)
    dropped: Counter = Counter()
    try:
        for name, args in card.transform.items():
            rows, d = (user_transform(name, card.path) if ":" in name else TRANSFORMS[name])(rows, args, seed)
            dropped.update(d)
        if not rows:
            reasons = ", ".join(f"{n} {why}" for why, n in dropped.most_common())
            raise FormatError(f"transform {', '.join(card.transform)} dropped every one of the {read} rows "
                              f"({reasons or 'no reason counted'}); fix the data, or the transform's settings")
        check_canonical(rows, card.produces, str(card.file or card.path))
        rows, unusable = drop_unusable(rows, card.produces, str(card.file or card.path), card.max_unusable_fraction)
        dropped.update(unusable)
    except FormatError as exc:
        raise DataCardError(f"{card.path}: {exc}") from None
    if named is not None:  # the dataset's own split, whole
        return LoadedSplit(card, split, rows, dropped, len(rows), read=read)
    fractions = {k: float(v) for k, v in card.splits.items() if k != "seed"}
    if split not in fractions:
        raise DataCardError(f"{card.path}: no split '{split}'; the card defines {sorted(fractions)}")
    # Whole prompt groups go to splits, so rows sharing a prompt never straddle train and test; each group by its own
    # seeded hash, so a prompt's split does not depend on which other rows the card kept (a messages card and a
    # preference card over the same prompts, one dropping a pair, split alike). Sizes follow the fractions on average.
    lo = sum(f for name, f in list(fractions.items())[:list(fractions).index(split)])
    hi = lo + fractions[split]
    last = [name for name, f in fractions.items() if f > 0][-1] == split  # takes what rounding leaves above 1 - eps
    chosen = [i for i, row in enumerate(rows) if lo <= (u := _unit(seed, _split_key(row))) < hi or (last and u >= hi)]
    if not chosen:
        raise DataCardError(f"{card.path}: split '{split}' is empty ({len(rows)} rows after transforms, "
                            f"fraction {fractions[split]}); give it a larger fraction or more data")
    return LoadedSplit(card, split, [rows[i] for i in chosen], dropped, len(rows), read=read)


def _unit(seed: int, key: str) -> float:
    """A prompt's place in [0, 1) for the split: sha256 of the seed and the prompt (the same on every machine)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big") / 2 ** 64


def seeded_rank(seed: int, key: str) -> float:
    """A prompt's place in a seeded random order (sha256, salted apart from the split's hash, so the order within a
    split is not its place in the split): a prefix of rows sorted by it is a uniform sample of them, the same on
    every machine and rerun."""
    return _unit(seed, f"order\x00{key}")


def held_out_prompts(prompts: list[str], fraction: float, seed: int) -> set[str]:
    """The prompts a stage holds out: each whose seeded hash (salted apart from the split's and the order's) falls
    under `fraction`, so whether a prompt is held out is the prompt's own property, whatever else was sampled with
    it. A later round of iterated DPO with more prompts, or other drops, never tests on prompts an earlier round
    trained on (chosen by position, 15 of 30 test prompts had been). The one exception, for tiny sets: with two or
    more prompts at least one is held out and one kept (the lowest and the highest hash)."""
    rank = {p: _unit(seed, f"held-out\x00{p}") for p in dict.fromkeys(prompts)}
    held = {p for p, u in rank.items() if u < fraction}
    if len(rank) >= 2 and not held:
        held = {min(rank, key=rank.__getitem__)}
    elif len(rank) >= 2 and len(held) == len(rank):
        held.discard(max(rank, key=rank.__getitem__))
    return held


def _split_key(row: dict[str, Any]) -> str:
    key = row_prompt_key(row)
    return json.dumps(row, sort_keys=True) if key is None else key
