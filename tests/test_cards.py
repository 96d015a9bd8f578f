"""Data cards: shipped cards validate; bad inputs fail early with the file, line/row or field named."""

import gzip
import json
from pathlib import Path

import pytest
import yaml

from align.data.cards import DataCardError, load_card, load_split
from align.data.formats import hh_transcript, parse_hh_turns

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("card", sorted((REPO / "data_cards").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_cards_validate(card):
    c = load_card(card)
    assert c.license and (c.file is None or c.file.is_file())
    if c.format == "hub":  # tests run offline (HF_HUB_OFFLINE=1): the card parses, the rows are out of reach
        from align.data.cards import DataUnavailableError

        assert c.source["hub"] and c.source.get("revision")
        with pytest.raises(DataUnavailableError, match=c.source["hub"]):
            load_split(c, "train")
        return
    for split in (k for k in c.splits if k != "seed"):
        assert load_split(c, split).rows


def test_movie_splits_are_disjoint_by_prompt_and_deterministic():
    card = REPO / "data_cards" / "movie_review_snippets.yaml"
    train, test = load_split(card, "train"), load_split(card, "test")
    assert not {r["prompt"] for r in train.rows} & {r["prompt"] for r in test.rows}
    assert 0.85 < len(train.rows) / (len(train.rows) + len(test.rows)) < 0.95
    assert load_split(card, "test").rows == test.rows
    for r in test.rows[:50]:
        assert 2 <= len(r["prompt"].split()) <= 8 and r["completion"].startswith(" ")


def _card(tmp: Path, data: bytes | str | None, name="d.jsonl", **fields) -> Path:
    if data is not None:
        (tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)
    body = {"name": "t", "license": "MIT", "format": "jsonl", "produces": "preference",
            "source": {"path": name}, "splits": {"train": 1.0, "seed": 0}, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    (tmp / "card.yaml").write_text(yaml.safe_dump(body))
    return tmp / "card.yaml"


PAIR = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})

# (id, data, card fields, split, expected message fragments)
BAD = [
    ("missing-file", None, {}, "train", ["d.jsonl", "does not exist"]),
    ("invalid-json-line-3", f"{PAIR}\n{PAIR}\n{{oops\n", {}, "train", ["d.jsonl", "line 3", "invalid JSON"]),
    ("missing-column", json.dumps({"prompt": "p", "chosen": "a"}) + "\n", {}, "train",
     ["row 0", "missing field 'rejected'"]),
    ("mapped-column-missing", json.dumps({"q": "p"}) + "\n", {"columns": {"prompt": "question"}}, "train",
     ["line 1", "column 'question'", "missing"]),
    ("tsv-column-index", "1\tonly two\n", {"format": "tsv", "columns": {"id": 0, "score": 1, "text": 2},
                                           "produces": "prompt", "name": "t"}, "train", ["line 1", "column 2"]),
    ("empty-dataset", "\n\n", {}, "train", ["d.jsonl", "empty"]),
    ("empty-split", PAIR + "\n", {"splits": {"train": 1.0, "test": 0.0, "seed": 0}}, "test",
     ["split 'test' is empty"]),
    ("chosen-equals-rejected", json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}) + "\n", {},
     "train", ["1 row (0)", "differ at most in whitespace"]),
    ("non-utf8", PAIR.encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n', {}, "train", ["line 2", "not UTF-8"]),
    ("unknown-format", PAIR, {"format": "xlsx"}, "train", ["field 'format'", "xlsx"]),
    ("unknown-produces", PAIR, {"produces": "triples"}, "train", ["field 'produces'", "triples"]),
    ("unknown-transform", PAIR, {"transform": {"shout": True}}, "train", ["unknown transform 'shout'"]),
    ("unknown-card-field", PAIR, {"licence": "MIT"}, "train", ["unknown field", "licence"]),
    ("splits-do-not-sum", PAIR, {"splits": {"train": 0.5, "test": 0.2}}, "train", ["splits", "sum to 1"]),
    ("missing-license", PAIR, {"license": None}, "train", ["field 'license' is required"]),
    ("non-text-field", json.dumps({"prompt": 3, "chosen": "a", "rejected": "b"}) + "\n", {}, "train",
     ["row 0", "'prompt' must be text"]),
    ("undefined-split", PAIR + "\n", {}, "validation", ["no split 'validation'"]),
    ("json-not-a-list", json.dumps({"a": 1}), {"format": "json"}, "train", ["list of rows"]),
    ("bad-prefix-args", json.dumps({"text": "a b c"}) + "\n", {"produces": "prompt_completion",
                                                               "transform": {"prefix_words": [5, 2]}}, "train",
     ["prefix_words", "min <= max"]),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_fail_with_location(tmp_path, case):
    _, data, fields, split, fragments = case
    card = _card(tmp_path, data, **fields)
    with pytest.raises(DataCardError) as err:
        load_split(card, split)
    for frag in fragments:
        assert frag in str(err.value), f"{frag!r} not in {err.value}"


def test_missing_card_file(tmp_path):
    with pytest.raises(DataCardError, match="data card not found"):
        load_card(tmp_path / "nope.yaml")


def test_gzip_jsonl_and_card_hash_changes_with_data(tmp_path):
    card = _card(tmp_path, gzip.compress((PAIR + "\n").encode()), name="d.jsonl.gz")
    h1 = load_card(card).content_hash()
    assert load_split(card, "train").rows[0]["chosen"] == "a"
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress((PAIR + "\n" + PAIR + "\n").encode()))
    assert load_card(card).content_hash() != h1


# --------------------------------------------------------------------------------------------- HH-RLHF
def test_hh_multi_turn_prompt_is_all_turns_before_final_reply():
    chosen = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: Why did the chicken..."
    rejected = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant: No."
    rows, dropped = hh_transcript([{"chosen": chosen, "rejected": rejected}], None, 0)
    assert rows == [{"prompt": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke\n\nAssistant:",
                     "chosen": " Why did the chicken...", "rejected": " No."}]
    assert not dropped


def test_hh_pairs_diverging_before_last_turn_are_skipped_and_counted():
    a = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: joke\n\nAssistant: ha"
    b = "\n\nHuman: Hi\n\nAssistant: Go away.\n\nHuman: joke\n\nAssistant: no"
    same = "\n\nHuman: Hi\n\nAssistant: ok"
    two, spaced = "\n\nHuman: Hi\n\nAssistant: ok, go", "\n\nHuman: Hi\n\nAssistant: ok,\n  go"
    empty = "\n\nHuman: Hi\n\nAssistant: "
    rows, dropped = hh_transcript([{"chosen": a, "rejected": b}, {"chosen": same, "rejected": same},
                                   {"chosen": two, "rejected": spaced}, {"chosen": empty, "rejected": same},
                                   {"chosen": "no markers", "rejected": a}], None, 0)
    assert rows == []
    assert dropped == {"chosen and rejected diverge before the final reply": 1,
                       "chosen identical to rejected (up to whitespace)": 2, "empty final reply": 1,
                       "unparseable transcript": 1}


def test_hh_turn_parser():
    assert parse_hh_turns("\n\nHuman: a\n\nAssistant: b") == [("user", "a"), ("assistant", "b")]


def test_vendored_hh_sample_parses():
    card = REPO / "data_cards" / "hh_rlhf_harmless_pairs.yaml"
    train = load_split(card, "train")
    assert len(train.rows) + len(load_split(card, "test").rows) + sum(train.dropped.values()) == 200
    assert len(train.rows) > 80 and set(train.dropped) <= {"prompt longer than 400 characters",
                                                            "chosen and rejected diverge before the final reply"}
    assert all(p["prompt"].endswith("\n\nAssistant:") and p["chosen"] != p["rejected"] for p in train.rows)


def test_alpaca_rows_become_prompt_completion_and_empty_outputs_are_counted(tmp_path):
    rows = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Translate", "input": "chat", "output": "cat"},
            {"instruction": "Say nothing", "input": "", "output": "  "}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    card = _card(tmp_path, None, name="a.json", format="json", produces="prompt_completion",
                 transform={"alpaca": True})
    data = load_split(card, "train")
    assert data.rows == [{"prompt": "Name a colour.", "completion": " Blue."},
                         {"prompt": "Translate\n\nchat", "completion": " cat"}]
    assert data.dropped == {"empty output": 1}


def test_messages_form_validates_and_rejects_bad_turns(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    card = _card(tmp_path, json.dumps(good) + "\n", produces="messages")
    assert load_split(card, "train").rows == [good]
    bad = {"messages": [{"role": "user"}]}
    card = _card(tmp_path, json.dumps(bad) + "\n", produces="messages")
    with pytest.raises(DataCardError, match="row 0: field 'messages' must be a list of"):
        load_split(card, "train")
