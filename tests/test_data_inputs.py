"""Hostile data (a probe of how align reads data cards, 2026-11-29): each case either trained on the wrong rows without
a word, or stopped with a Python traceback; each is now a named error before anything trains, or a counted drop."""

from __future__ import annotations

import gzip
import json
import os
import random
import types
from collections import Counter
from pathlib import Path

import pytest

from align.data.cards import DataCardError, DataUnavailableError, load_card, load_split
from conftest import REPO

SEED = 20261129


def _card(folder: Path, data: str | bytes, name: str = "rows.jsonl", fmt: str = "jsonl",
          produces: str = "preference", extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    card = folder / f"{name}.yaml"
    card.write_text(f"name: probe\nlicense: MIT\nformat: {fmt}\nproduces: {produces}\nsource: {{path: {name}}}\n{extra}")
    return card


def _pairs(n: int = 60) -> str:
    return "".join(json.dumps({"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"}) + "\n"
                   for i in range(n))


def test_two_cards_own_transforms_of_one_module_name_are_refused_not_swapped(tmp_path):
    """Python holds one module per name: the second card's `clash_fix:fix` ran the first card's file, and editing
    its own file left its fingerprint unchanged."""
    cards = []
    for k, src in enumerate(("q", "question")):
        folder = tmp_path / f"t{k}"
        card = _card(folder, "".join(json.dumps({src: f"q{i}", "a": f" a{i}"}) + "\n" for i in range(5)),
                     produces="prompt_completion", extra="transform: {'clash_fix:fix': null}\n")
        (folder / "clash_fix.py").write_text(f"def fix(rows, args, seed):\n    return [{{'prompt': r['{src}'], "
                                             f"'completion': r['a']}} for r in rows]\n")
        cards.append(card)
    assert load_split(cards[0], "train").rows[0]["prompt"] == "q0"
    with pytest.raises(DataCardError, match=r"module 'clash_fix' is .*t0/clash_fix\.py, not .*t1/clash_fix\.py"):
        load_card(cards[1])


def test_every_example_dropped_is_refused_whatever_max_truncated_fraction_allows():
    from align.data.lengths import LengthError, LengthReport, enforce

    report = LengthReport("reward", "drops_long_pairs", examples=102, truncated=0, dropped=102, longest=90,
                          max_length=8)
    with pytest.raises(LengthError, match=r"all 102 examples would be dropped .* train on nothing"):
        enforce(report, 1.0)
    enforce(LengthReport("reward", "drops_long_pairs", 102, 0, 101, 90, 8), 1.0)  # one left: the setting decides


def test_a_mirrored_hub_card_with_a_wrong_data_dir_is_a_card_error_not_unreachable(tmp_path, monkeypatch):
    hh = tmp_path / "hub" / "Anthropic" / "hh-rlhf" / "harmless-base"
    hh.mkdir(parents=True)
    with gzip.open(REPO / "data_cards" / "data" / "hh_rlhf_harmless" / "harmless_base_sample_200.jsonl.gz", "rt") as fh:
        lines = fh.readlines()[:20]
    with gzip.open(hh / "train.jsonl.gz", "wt") as fh:
        fh.writelines(lines)
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    card = tmp_path / "typo.yaml"
    card.write_text("name: hh\nlicense: MIT\nformat: hub\nproduces: preference\nsource: {hub: Anthropic/hh-rlhf, "
                    "data_dir: harmles-base, revision: main}\ntransform: {hh_transcript: true}\n")
    with pytest.raises(DataCardError, match=r"data_dir: harmles-base.*no such split, config or data_dir") as exc:
        load_split(card, "train")
    assert not isinstance(exc.value, DataUnavailableError)  # validate no longer passes it as "not reachable"


def test_a_mirror_downloaded_at_another_commit_than_the_card_pins_is_refused(tmp_path, monkeypatch):
    """A mirror made by `hf download --local-dir` says which commit its files are; a card pinned to another commit
    was read from it silently (and the run called it that commit). Records huggingface_hub itself would ignore (a
    file since removed, one changed after its download) and files outside the card's data_dir say nothing."""
    import time

    hh = tmp_path / "hub" / "Anthropic" / "hh-rlhf"
    (hh / "harmless-base").mkdir(parents=True)
    with gzip.open(REPO / "data_cards" / "data" / "hh_rlhf_harmless" / "harmless_base_sample_200.jsonl.gz", "rt") as fh:
        lines = fh.readlines()[:20]
    with gzip.open(hh / "harmless-base" / "train.jsonl.gz", "wt") as fh:
        fh.writelines(lines)
    (hh / "README.md").write_text("# hh\n")
    have, pinned, older = "a" * 8 + "1" * 32, "b" * 40, "c" * 40
    records = hh / ".cache" / "huggingface" / "download"

    def record(name, commit, stamp=None):
        meta = records / f"{name}.metadata"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(f"{commit}\n\"etag\"\n{time.time() + 5 if stamp is None else stamp}\n")

    record("harmless-base/train.jsonl.gz", have)
    record("harmless-base/test.jsonl.gz", older)  # a file of the older commit, gone from the newer one
    record("README.md", older)  # outside the card's data_dir (`--include harmless-base/*` fetched the newer one)
    monkeypatch.setenv("ALIGN_HUB_MIRROR", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))

    def card(revision):
        path = tmp_path / "pinned.yaml"
        path.write_text("name: hh\nlicense: MIT\nformat: hub\nproduces: preference\nsource: {hub: Anthropic/hh-rlhf, "
                        f"data_dir: harmless-base, revision: {revision}}}\ntransform: {{hh_transcript: true}}\n")
        return path

    with pytest.raises(DataCardError, match=rf"mirror .*hh-rlhf holds files downloaded at commit {have[:12]}, not the "
                                            rf"commit the card pins as its revision, {pinned}.*hf download .*"
                                            rf"--revision {pinned}"):
        load_split(card(f"'{pinned}'"), "train")
    assert load_split(card(f"'{have}'"), "train").rows  # the older commit's records are not the mirror's
    assert load_split(card("main"), "train").rows  # a branch names whatever was downloaded
    with pytest.raises(DataCardError, match=r"field 'source.revision': text, got 20240101 \(int\); quote it"):
        load_split(card("20240101"), "train")
    record("harmless-base/train.jsonl.gz", have, stamp=1700000000.0)  # the file changed after its download
    assert load_split(card(f"'{pinned}'"), "train").rows


def test_delimited_rows_never_shift_or_drop_a_field(tmp_path):
    good = "prompt,chosen,rejected\n" + "".join(f"p{i},c{i},r{i}\n" for i in range(30))
    cols = "columns: {prompt: prompt, chosen: chosen, rejected: rejected}\n"
    with pytest.raises(DataCardError, match=r"extra\.csv: line 32: 4 fields where the header has 3"):
        load_split(_card(tmp_path, good + "hello, world,chosen text,rejected text\n", "extra.csv", "csv", extra=cols),
                   "train")
    with pytest.raises(DataCardError, match=r"line 1: the header names 'chosen' twice"):
        load_split(_card(tmp_path, good.replace("rejected\n", "chosen,rejected\n", 1), "dup.csv", "csv", extra=cols),
                   "train")
    tsv = "".join(f"p{i}\tc{i}\tr{i}\n" for i in range(30)) + "p\tc with\ttab\tr\n"
    with pytest.raises(DataCardError, match=r"tab\.tsv: line 31: 4 fields where the first row has 3"):
        load_split(_card(tmp_path, tsv, "tab.tsv", "tsv", extra="columns: {prompt: 0, chosen: 1, rejected: 2}\n"),
                   "train")
    with pytest.raises(DataCardError, match=r"cr\.tsv: line 3: not readable as TSV"):
        load_split(_card(tmp_path, "a\tb\tc\nd\te\tf\ng\th\ri\tj\n", "cr.tsv", "tsv",
                         extra="columns: {prompt: 0, chosen: 1, rejected: 2}\n"), "train")
    long = "x " * 100_000  # 200,000 characters: above Python's csv default field limit (131,072)
    rows = load_split(_card(tmp_path, good + f"p-long,{long},r\n", "long.csv", "csv", extra=cols), "train").rows
    assert any(r["chosen"] == long for r in rows)


def test_transforms_refuse_values_that_are_not_text_instead_of_writing_their_repr(tmp_path):
    rows = [{"instruction": f"do {i}", "output": f"done {i}"} for i in range(20)]
    alpaca = "transform: {alpaca: {}}\n"
    data = rows + [{"instruction": "empty", "output": None}]
    loaded = load_split(_card(tmp_path, "\n".join(map(json.dumps, data)), "a.jsonl", produces="prompt_completion",
                              extra=alpaca), "train")
    assert loaded.dropped == Counter({"empty output": 1}) and all("None" not in r["completion"] for r in loaded.rows)
    for bad, field in (({"instruction": None, "output": "x"}, "instruction"), ({"instruction": "i", "output": [1, 2]},
                                                                                "output")):
        card = _card(tmp_path, "\n".join(map(json.dumps, rows + [bad])), f"{field}.jsonl", produces="prompt_completion",
                     extra=alpaca)
        with pytest.raises(DataCardError, match=rf"row 20: transform alpaca: field '{field}' must be text, got"):
            load_split(card, "train")
    words = [{"text": "alpha beta gamma delta epsilon"}] * 5 + [{"text": ["alpha beta", "gamma delta"]}]
    card = _card(tmp_path, "\n".join(map(json.dumps, words)), "w.jsonl", produces="prompt_completion",
                 extra="transform: {prefix_words: [1, 2]}\n")
    with pytest.raises(DataCardError, match=r"row 5: transform prefix_words: field 'text' must be text, got list"):
        load_split(card, "train")
    for args in ("[2]", "abc", "null", "[1, true]"):
        bad_card = _card(tmp_path, "\n".join(map(json.dumps, words[:5])), "w2.jsonl", produces="prompt_completion",
                         extra=f"transform: {{prefix_words: {args}}}\n")
        with pytest.raises(DataCardError, match=r"transform prefix_words: expected \[min, max\] whole numbers"):
            load_split(bad_card, "train")


def test_hh_transcripts_that_are_not_text_are_counted_and_bad_settings_named(tmp_path):
    with gzip.open(REPO / "data_cards" / "data" / "hh_rlhf_harmless" / "harmless_base_sample_200.jsonl.gz", "rt") as fh:
        lines = fh.readlines()[:30]
    data = "".join(lines) + json.dumps({"chosen": None, "rejected": "\n\nHuman: a\n\nAssistant: b"}) + "\n"
    card = _card(tmp_path, data, produces="preference", extra="transform: {hh_transcript: true}\n")
    assert load_split(card, "train").dropped["transcript not text (null or another type)"] == 1
    card.write_text(card.read_text().replace("{hh_transcript: true}", "{hh_transcript: {max_prompt_chars: abc}}"))
    with pytest.raises(DataCardError, match=r"max_prompt_chars is a whole number of characters, got 'abc'"):
        load_split(card, "train")


def test_unreadable_rows_paths_and_sources_name_the_line_or_field(tmp_path):
    cols = "columns: {prompt: prompt, chosen: chosen, rejected: rejected}\n"
    with pytest.raises(DataCardError, match=r"int\.jsonl: line 61: a row is a JSON object or a list of column values, "
                                            r"got int 5"):
        load_split(_card(tmp_path, _pairs() + "5\n", "int.jsonl", extra=cols), "train")
    surrogate = json.dumps({"prompt": "cut", "chosen": "a", "rejected": "b"}).replace("cut", "cut \\ud800")
    with pytest.raises(DataCardError, match=r"surr\.jsonl: line 61: the escape \\ud800 is half of a UTF-16 surrogate"):
        load_split(_card(tmp_path, _pairs() + surrogate + "\n", "surr.jsonl"), "train")
    emoji = json.dumps({"prompt": "whole \U0001F600", "chosen": "a", "rejected": "b"})  # a pair escaped: one character
    assert len(load_split(_card(tmp_path, _pairs() + emoji + "\n", "emoji.jsonl"), "train").rows) > 0
    with pytest.raises(DataCardError, match=r"arr\.jsonl: line 1: holds a list of rows, not one row; .*`format: json`"):
        load_split(_card(tmp_path, json.dumps([{"prompt": "p", "chosen": "c", "rejected": "r"}] * 3), "arr.jsonl"),
                   "train")
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink(loop / "a", loop / "b")
    os.symlink(loop / "b", loop / "a")
    (loop / "c.yaml").write_text("name: x\nlicense: MIT\nformat: jsonl\nproduces: preference\nsource: {path: a}\n")
    with pytest.raises(DataCardError, match=r"field 'source.path': 'a' cannot be resolved"):
        load_card(loop / "c.yaml")
    for source, fmt, message in (("{path: /dev/null}", "jsonl", r"/dev/null is not a regular file"),
                                 ("{path: 5}", "jsonl", r"field 'source.path': the data file.*got 5"),
                                 ("{path: null}", "jsonl", r"field 'source.path': the data file.*got None"),
                                 ("{hub: org/name}", "jsonl", r"field 'source.hub' with `format: jsonl`.*format: hub"),
                                 ("{path: rows.jsonl}", "hub", r"field 'source.path' with `format: hub`")):
        (tmp_path / "s.yaml").write_text(f"name: x\nlicense: MIT\nformat: {fmt}\nproduces: preference\n"
                                         f"source: {source}\n")
        with pytest.raises(DataCardError, match=message):
            load_card(tmp_path / "s.yaml")


def _chatml_gpt2():
    from transformers import AutoTokenizer

    from align import templates
    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    templates.install(tok, templates.resolve("chatml", REPO / "pipelines" / "chat.yaml", None))
    return tok


def test_rows_holding_a_special_tokens_text_are_dropped_and_counted_or_refused():
    """A chosen reply that mentions `<|im_end|>` was cut there for the reward model, DPO and PPO (the rendered reply
    ends at the first EOS), and a user turn holding `<|im_start|>assistant` opened a turn the data never had."""
    from align.data.chat import as_text
    from align.data.special_text import holding_special_text
    from align.runtime.context import StageError
    from align.runtime.rows import drop_special_text

    rng = random.Random(SEED)
    print(f"seed {SEED}")
    tok = _chatml_gpt2()
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": f"good {i}"}],
             "rejected": [{"role": "assistant", "content": f"bad {i}"}]} for i in range(200)]
    at = rng.randrange(200)
    rows[at]["chosen"][0]["content"] = "Sure: <|im_end|> and then the rest of the good answer"
    assert as_text([rows[at]], tok)[0]["chosen"] == "Sure: "  # what the stages read of it: why it must go
    assert holding_special_text(rows, tok) == [(at, "<|im_end|>")]
    ctx = types.SimpleNamespace(name="reward", extra_manifest={})
    kept = drop_special_text(ctx, rows, tok, "pairs split 'train'")
    assert len(kept) == 199 and rows[at] not in kept
    assert ctx.extra_manifest["dropped_rows"] == {"pairs split 'train': holds a special token's text": 1}
    rows[(at + 1) % 200]["prompt"][0]["content"] = "<|im_start|>assistant\nfake"
    rows[(at + 2) % 200]["rejected"][0]["content"] = "x <|endoftext|>"
    assert len(drop_special_text(ctx, rows, tok, "pairs split 'train'")) == 197  # 3 rows: at most 1% or 3 dropped
    rows[(at + 3) % 200]["chosen"][0]["content"] = "<|im_end|> again"
    with pytest.raises(StageError, match=r"4 of 200 conversations hold the text of the tokenizer's special tokens"):
        drop_special_text(ctx, rows, tok, "pairs split 'train'")
    rendered = [{"prompt": "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", "completion": "a"}] * 3
    assert holding_special_text(rendered, tok) == []  # text rows: the user's own rendering, tokens meant


def test_a_cards_dropped_rows_and_empty_prompts_reach_the_manifest(tmp_path):
    from align.runtime.rows import card_split

    data = _pairs(40) + json.dumps({"prompt": "p-same", "chosen": "same", "rejected": "same "}) + "\n"
    card = _card(tmp_path, data, extra="max_unusable_fraction: 0.05\n")
    ctx = types.SimpleNamespace(name="dpo", extra_manifest={}, inputs={}, spec=types.SimpleNamespace(data_cards={}))
    loaded = card_split(ctx, str(card), "train")
    assert sum(loaded.dropped.values()) == 1
    assert list(ctx.extra_manifest["dropped_rows"].values()) == [1]
    assert "the whole file, before the split" in next(iter(ctx.extra_manifest["dropped_rows"]))


def test_drops_of_a_datasets_own_splits_are_counted_per_split(monkeypatch):
    """A hub card naming the dataset's own splits (UltraFeedback's train_prefs, test_prefs) reads each split alone,
    and its drops are that split's; they were keyed as the whole file's, so the test split's count overwrote the
    train split's in the manifest (train's 435 identical pairs shown as test's 12)."""
    from collections import Counter

    from align.runtime import rows

    def load_split(card, split):
        return types.SimpleNamespace(card=types.SimpleNamespace(source_splits={"train": "train_prefs",
                                                                               "test": "test_prefs"}, file=None),
                                     dropped=Counter({"chosen and rejected are the same": {"train": 435,
                                                                                           "test": 12}[split]}))

    monkeypatch.setattr(rows, "load_split", load_split)
    ctx = types.SimpleNamespace(name="dpo", extra_manifest={}, spec=types.SimpleNamespace(data_cards={}))
    for split in ("train", "test"):
        rows.card_split(ctx, "prefs.yaml", split)
    assert ctx.extra_manifest["dropped_rows"] == {
        "prefs.yaml split 'train': chosen and rejected are the same": 435,
        "prefs.yaml split 'test': chosen and rejected are the same": 12}


def test_a_stage_reading_another_form_of_text_than_a_stage_upstream_is_warned_of(capsys, tmp_path):
    """A policy SFT-trained on conversations rendered with the chat template, then DPO-trained on the same transcripts
    as HH text ("\\n\\nHuman: ..."), learned from text in a form it never saw, and nothing said so (a data review,
    2026-12-02). `align validate` names the stage, both cards and both forms; the shipped pipelines keep one form."""
    from conftest import validate

    rc, out = validate(capsys, str(REPO / "pipelines" / "chat.yaml"))
    assert rc == 0 and "upstream of it" not in out
    cards = REPO / "data_cards"
    body = ("name: mixed\nbase_model: builtin:tiny-llama\nchat_template: chatml\nseed: 5\n"
            "builtin: {vocab_size: 1024, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64, "
            "max_position_embeddings: 320}\nstages:\n"
            f"  sft: {{data: {cards / 'hh_rlhf_harmless_chat_sft.yaml'}, max_steps: 2, max_length: 320}}\n"
            f"  reward: {{init: sft, data: {cards / '%s'}, max_steps: 2, max_length: 320}}\n"
            f"  dpo: {{policy: sft, data: {cards / '%s'}, max_steps: 2, max_length: 320}}\n")
    (tmp_path / "p.yaml").write_text(body % ("hh_rlhf_harmless_chat_pairs.yaml", "hh_rlhf_harmless_chat_pairs.yaml"))
    rc, out = validate(capsys, str(tmp_path / "p.yaml"))
    assert rc == 0 and "upstream of it" not in out, out
    (tmp_path / "p.yaml").write_text(body % ("hh_rlhf_harmless_chat_pairs.yaml", "hh_rlhf_harmless_pairs.yaml"))
    rc, out = validate(capsys, str(tmp_path / "p.yaml"))
    assert rc == 0, out
    assert ("stages.dpo: hh_rlhf_harmless_pairs.yaml gives plain text (no chat template), but stage 'sft' upstream "
            "of it trained on or sampled from hh_rlhf_harmless_chat_sft.yaml, which gives conversations") in out, out
    assert out.count("upstream of it") == 1  # reward reads the form sft trained on: no warning of its own


@pytest.mark.parametrize("case", ["hh", "hh_as_messages", "null_content", "trl_prompt_completion"])
def test_rows_in_another_known_form_are_refused_with_the_fix_that_reads_them(tmp_path, case):
    """Three forms were refused with a fix that could not help (a data review, 2026-12-02): raw HH transcripts
    under `produces: preference` ("map a field to 'prompt'": there is none), a message whose content is null (a
    tool call: the same hint), and TRL's conversational prompt-completion form ("must be text, got list", no fix).
    Each error names the fix now; the last has a built-in transform, and the card then loads."""
    user, reply = [{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Hello"}]
    row, produces, hint = {
        "hh": ({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Hi\n\nAssistant: Go"},
               "preference", r"Anthropic HH transcripts: add `transform: \{hh_transcript: true\}`"),
        "hh_as_messages": ({"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Hi\n\nAssistant: Go"},
                           "messages", r"Anthropic HH transcripts: add `transform: \{hh_chosen_messages: true\}`"),
        "null_content": ({"chosen": user + [{"role": "assistant", "content": None}], "rejected": user + reply},
                         "preference", r"field 'chosen': message 1 \(role 'assistant'\) has content 'None', not text"),
        "trl_prompt_completion": ({"prompt": user, "completion": reply}, "prompt_completion",
                                  r"declare `produces: messages` and add `transform: \{prompt_completion_messages"),
    }[case]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(4)))
    card = tmp_path / "c.yaml"
    card.write_text(f"name: c\nsource: {{path: d.jsonl}}\nlicense: MIT\nformat: jsonl\nproduces: {produces}\n"
                    "splits: {train: 1.0, seed: 1}\n")
    with pytest.raises(DataCardError, match=r"d.jsonl: row 0: .*" + hint):
        load_split(str(card), "train")
    if case == "trl_prompt_completion":
        card.write_text("name: c\nsource: {path: d.jsonl}\nlicense: MIT\nformat: jsonl\nproduces: messages\n"
                        "transform: {prompt_completion_messages: true}\nsplits: {train: 1.0, seed: 1}\n")
        assert load_split(str(card), "train").rows[0]["messages"] == user + reply
