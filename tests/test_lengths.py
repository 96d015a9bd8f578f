"""Over-long examples are counted before training (align/data/lengths.py), at `align validate` when the tokenizer is
loadable and at every trained stage's start otherwise; SFT on chat `messages` data end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, run_align

GPT2 = REPO / "tokenizers" / "gpt2"


@pytest.fixture(scope="module")
def gpt2():
    from align.modeling.models import load_tokenizer

    from align import templates

    tok = load_tokenizer(str(GPT2))
    templates.install(tok, templates.resolve("default", GPT2 / "p.yaml", None))
    return tok


def _n(tok, text: str) -> int:
    return len(tok(text)["input_ids"])


def test_sft_counts_truncated_and_prompt_filling_examples(gpt2):
    from align.config import stage_types
    from align.data.lengths import TRUNCATES_COMPLETIONS

    assert stage_types()["sft"].LENGTH_RULE is TRUNCATES_COMPLETIONS
    rows = [{"prompt": " ".join("a" * 3), "completion": " ".join("b" * 3)},  # 3 + 3 + EOS = 7 tokens: fits in 10
            {"prompt": " ".join("a" * 5), "completion": " ".join("b" * 8)},  # 5 + 8 + 1 = 14 > 10: truncated
            {"prompt": " ".join("a" * 12), "completion": "b"}]  # the prompt alone fills 10: teaches nothing -> dropped
    assert [_n(gpt2, r["prompt"]) for r in rows] == [3, 5, 12]
    rep = TRUNCATES_COMPLETIONS.measure("sft", rows, gpt2, max_length=10)
    assert (rep.examples, rep.truncated, rep.dropped, rep.longest) == (3, 1, 1, 14)
    assert rep.fraction == pytest.approx(2 / 3)


def test_reward_drops_and_dpo_truncates(gpt2):
    from align.config import stage_types
    from align.data.lengths import DROPS_LONG_PAIRS, TRUNCATES_PAIRS

    assert (stage_types()["reward"].LENGTH_RULE, stage_types()["dpo"].LENGTH_RULE) == (DROPS_LONG_PAIRS, TRUNCATES_PAIRS)
    rows = [{"prompt": " ".join("q" * 4), "chosen": " ".join("c" * 2), "rejected": " ".join("r" * 9)},  # 4 + 9 + 1 = 14 > 10
            {"prompt": " ".join("q" * 4), "chosen": " ".join("c" * 2), "rejected": " ".join("r" * 3)},  # 4 + 3 + 1 = 8
            {"prompt": " ".join("q" * 10), "chosen": "c", "rejected": "r"}]  # prompt fills the window
    rew = DROPS_LONG_PAIRS.measure("reward", rows, gpt2, max_length=10)
    assert (rew.truncated, rew.dropped, rew.longest) == (0, 2, 14)  # RewardTrainer filters both out
    dpo = TRUNCATES_PAIRS.measure("dpo", rows, gpt2, max_length=10)
    assert (dpo.truncated, dpo.dropped) == (1, 1)  # DPOTrainer truncates one, drops the prompt-filling one


def test_messages_are_measured_after_the_chat_template(gpt2):
    from align.data.lengths import TRUNCATES_COMPLETIONS

    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi " * 20}]
    templated = gpt2.apply_chat_template(msgs, tokenize=False)
    n = _n(gpt2, templated)
    assert n > 20  # the role tags and EOS of the template count too
    rep = TRUNCATES_COMPLETIONS.measure("sft", [{"messages": msgs}], gpt2, max_length=n)
    assert (rep.truncated, rep.dropped, rep.longest) == (0, 0, n)
    rep = TRUNCATES_COMPLETIONS.measure("sft", [{"messages": msgs}], gpt2, max_length=n - 1)
    assert (rep.truncated, rep.dropped) == (1, 0)


def test_a_conversation_whose_first_reply_fits_is_truncated_not_dropped(gpt2):
    """A probe of SFT (2026-11-30): a conversation counted as dropped when its turns before the last filled the
    window, though its first reply trains there (SFTTrainer drops only an example left without a trained token):
    on HH at max_length 128, 241 reported dropped where TRL drops 1. A conversation is dropped when the turns before
    its first reply, with the generation prompt, fill the window."""
    from align.data.lengths import TRUNCATES_COMPLETIONS

    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "tell me more " * 30}, {"role": "assistant", "content": "no"}]
    first = _n(gpt2, gpt2.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))
    before_last = _n(gpt2, gpt2.apply_chat_template(msgs[:3], tokenize=False))
    assert first + 2 < before_last
    rep = TRUNCATES_COMPLETIONS.measure("sft", [{"messages": msgs}], gpt2, max_length=first + 2)
    assert (rep.truncated, rep.dropped) == (1, 0)  # the first reply's tokens lie inside the window
    rep = TRUNCATES_COMPLETIONS.measure("sft", [{"messages": msgs}], gpt2, max_length=first)
    assert (rep.truncated, rep.dropped) == (0, 1)  # the window ends where the first reply would begin


def test_enforce_names_field_counts_and_fix(gpt2):
    from align.data.lengths import LengthError, LengthReport, enforce

    enforce(LengthReport("dpo", "dpo", 100, 3, 2, 300, 256), max_fraction=0.05)  # 5% is allowed
    with pytest.raises(LengthError) as err:
        enforce(LengthReport("dpo", "dpo", 100, 4, 2, 300, 256), max_fraction=0.05)
    msg = str(err.value)
    for part in ("stages.dpo.max_length=256", "6 of 100", "4 would be truncated, 2 dropped", "longest 300",
                 "max_truncated_fraction=0.05", "Raise max_length"):
        assert part in msg


def test_validate_refuses_when_too_many_hh_pairs_would_be_dropped(workdir):
    ok = run_align("validate", "pipelines/hh_rlhf_tiny.yaml", cwd=workdir)
    assert ok.returncode == 0, ok.stderr
    from align.data.cards import load_split

    pairs = len(load_split(REPO / "data_cards" / "hh_rlhf_harmless_pairs.yaml", "train").rows)
    assert f"length check reward: {pairs} examples" in ok.stdout  # every training pair measured
    # PPO's prompts + replies kept within the reward model's 96 (a longer sequence is refused on its own, first)
    bad = run_align("validate", "pipelines/hh_rlhf_tiny.yaml", "reward.max_length=96", "ppo.max_prompt_length=80",
                    cwd=workdir)
    assert bad.returncode == 2
    assert "stages.reward.max_length=96" in bad.stderr and "dropped" in bad.stderr
    assert not (workdir / "runs").exists()


CHAT_PIPELINE = """
name: chat
base_model: builtin:tiny-llama
builtin: {vocab_size: 320, hidden_size: 32, num_layers: 2, num_heads: 2, intermediate_size: 64,
          max_position_embeddings: 96}
tracking: {wandb: disabled}
stages:
  sft:
    data: chat.card.yaml
    max_steps: 12
    per_device_batch_size: 8
    learning_rate: 3.0e-3
    logging_steps: 4
    save_steps: 4
    max_length: 64
    eval_split: null
"""
CHAT_CARD = """
name: chat_numbers
description: synthetic two-turn chats for the messages path
source: {path: chat.jsonl}
license: CC0-1.0
format: jsonl
produces: messages
splits: {train: 0.9, test: 0.1, seed: 1}
"""
WORDS = "zero one two three four five six seven eight nine".split()


def _chat_project(root: Path) -> Path:
    rows = []
    for i in range(300):
        digits = str(i)
        rows.append({"messages": [{"role": "user", "content": f"spell {digits}"},
                                  {"role": "assistant", "content": " ".join(WORDS[int(d)] for d in digits)}]})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "chat.card.yaml").write_text(CHAT_CARD)
    (root / "chat.yaml").write_text(CHAT_PIPELINE)
    return root / "chat.yaml"


def test_sft_on_messages_trains_and_too_short_max_length_stops_before_training(tmp_path):
    pipeline = _chat_project(tmp_path)
    proc = run_align("run", str(pipeline), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stage = tmp_path / "runs" / "chat" / "main" / "sft"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "completed"
    from align.data.cards import load_split

    train = len(load_split(tmp_path / "chat.card.yaml", "train").rows)  # ~270 of the 300 (0.9, by each prompt's hash)
    assert 240 <= train <= 295 and manifest["length_check"]["examples"] == train
    assert manifest["length_check"]["truncated"] == 0
    losses = [json.loads(x)["train/loss"] for x in (stage / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert len(losses) == 3 and losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(stage / "model")
    tok = AutoTokenizer.from_pretrained(stage / "model")
    assert tok.chat_template  # installed by align for the builtin tokenizer and saved with the model

    short = run_align("run", str(pipeline), "--run-id", "short", "sft.max_length=8", cwd=tmp_path)
    assert short.returncode == 2
    assert "stages.sft.max_length=8" in short.stderr and "LengthError" in short.stderr
    stage = tmp_path / "runs" / "chat" / "short" / "sft"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["length_check"]["dropped"] > 0
    assert not (stage / "model").exists()
    assert not list(stage.glob("checkpoints/checkpoint-*"))
    metrics = stage / "metrics.jsonl"
    assert not metrics.exists() or "train/loss" not in metrics.read_text()


@pytest.mark.parametrize("extra", [[], ["sft.packing=true"], ["sft.packing=true", "sft.train_turns=last"]])
def test_sft_reports_the_examples_it_trained_on_not_those_trl_dropped(tmp_path, extra):
    """Every 8th conversation's question alone fills max_length: the length check counts it as dropped, TRL drops it
    after truncating, and `train/examples` counts what trained (it counted the rows given to TRL before). Packed,
    TRL kept such a conversation untrained in its rows (it drops them only when it does not pack): align drops it."""
    pipeline = _chat_project(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    for i in range(0, len(rows), 8):
        rows[i]["messages"][0]["content"] = "spell " + "nine " * 80
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_align("run", str(pipeline), "sft.max_truncated_fraction=0.5", "sft.max_steps=4", *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "runs" / "chat" / "main" / "sft" / "manifest.json").read_text())
    check = manifest["length_check"]
    assert check["dropped"] >= 25, check  # 38 of the 267 training rows (the card splits by hash, seed 1)
    assert manifest["final_metrics"]["train/examples"] == check["examples"] - check["dropped"], check


def test_a_reply_is_counted_without_a_bos_of_its_own_and_with_one_eos(tmp_path):
    """A probe of the preference stages (2026-11-30): with a tokenizer that puts BOS first (Llama's), each reply was
    counted with a BOS of its own, one token more than TRL's sequence (refusing `train on nothing` at a max_length
    where TRL keeps the pair); a reply that already ends with the EOS text got a second EOS counted, and the reward
    model's held-out scoring read it at a second EOS it was never trained at."""
    import families
    from align.data.lengths import DROPS_LONG_PAIRS, TRUNCATES_COMPLETIONS, pairs_within
    from align.judges.pointwise import RewardModelJudge
    from align.modeling.models import load_tokenizer

    families.tokenizer("llama", tmp_path)
    tok = load_tokenizer(str(tmp_path))
    prompt, reply = "The movie was", " warm and funny."
    plain = tok(prompt)["input_ids"]
    assert plain[0] == tok.bos_token_id  # the tokenizer puts BOS first
    whole = len(plain) + len(tok(reply, add_special_tokens=False)["input_ids"]) + 1  # + the EOS TRL appends
    rows = [{"prompt": prompt, "chosen": reply, "rejected": reply + tok.eos_token}]
    assert DROPS_LONG_PAIRS.measure("reward", rows, tok, max_length=whole).dropped == 0
    assert DROPS_LONG_PAIRS.measure("reward", rows, tok, max_length=whole - 1).dropped == 1
    assert TRUNCATES_COMPLETIONS.measure("sft", [{"prompt": prompt, "completion": reply}], tok, whole).longest == whole
    assert pairs_within(rows, tok, whole) == rows and pairs_within(rows, tok, whole - 1) == []
    judge = RewardModelJudge("rm", lambda ids, mask: ids.float(), tok)
    ended, unended = judge.encode([prompt] * 2, [reply + tok.eos_token, reply])
    assert ended == unended and ended.count(tok.eos_token_id) == 1


def test_a_dpo_pair_whose_sides_are_the_same_once_cut_is_counted_as_dropped(gpt2):
    """DPOTrainer keeps a pair whose prompt fits and cuts both sides at max_length: when they differ only after the
    cut the two sequences are the same (no gradient, and a wrong pair in its accuracy); it was counted as truncated,
    so a refusal's advice to raise max_truncated_fraction kept it silently."""
    from align.data.lengths import TRUNCATES_PAIRS

    shared = " ".join("s" * 8)
    rows = [{"prompt": "q q q", "chosen": shared + " good", "rejected": shared + " bad"},  # differ at token 12
            {"prompt": "q q q", "chosen": " c c c c c c c c", "rejected": " r r r r r r r r"}]  # differ at once
    rep = TRUNCATES_PAIRS.measure("dpo", rows, gpt2, max_length=10)
    assert (rep.truncated, rep.dropped) == (1, 1)
    rep = TRUNCATES_PAIRS.measure("dpo", rows, gpt2, max_length=12)  # the first differing token fits: it trains
    assert (rep.truncated, rep.dropped) == (1, 0)  # (the other, 3 + 8 + EOS, fits whole)


def _chatml_llama_conversation(tmp_path):
    """A Llama tokenizer (it adds BOS) with the chatml template installed, and a two-reply conversation."""
    import families
    from align import templates
    from align.modeling.models import load_tokenizer

    families.tokenizer("llama", tmp_path)
    tok = load_tokenizer(str(tmp_path))
    planned = templates.resolve("chatml", REPO / "pipelines" / "chat.yaml", None)
    templates.install(tok, planned)
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how are you?"},
            {"role": "user", "content": "fine"}, {"role": "assistant", "content": "good to hear"}]
    return tok, planned, msgs


def test_a_conversation_is_counted_as_sft_tokenises_it_bos_and_all(tmp_path):
    """SFT's length count rendered conversations with apply_chat_template, which writes no BOS for a template that has
    none (chatml) on a tokenizer that adds one (Llama's), while SFT's ids start with it (align/data/chat.py
    `sft_example`, as every later stage's prompts do): one token short, so an example one token too long passed
    uncounted, and a first reply starting at the window's edge was counted as training."""
    from align.data.chat import sft_example
    from align.data.lengths import TRUNCATES_COMPLETIONS

    tok, planned, msgs = _chatml_llama_conversation(tmp_path)
    example = sft_example(tok, planned, msgs)
    assert example["input_ids"][0] == tok.bos_token_id
    n, first = len(example["input_ids"]), example["assistant_masks"].index(1)
    rows = [{"messages": msgs}]
    assert TRUNCATES_COMPLETIONS.measure("sft", rows, tok, n).longest == n
    assert (TRUNCATES_COMPLETIONS.measure("sft", rows, tok, n - 1).truncated, ) == (1, )
    assert TRUNCATES_COMPLETIONS.measure("sft", rows, tok, first).dropped == 1  # the window ends before the reply
    rep = TRUNCATES_COMPLETIONS.measure("sft", rows, tok, first + 1)
    assert (rep.truncated, rep.dropped) == (1, 0)  # its first token trains


def test_train_turns_last_trains_the_final_reply_alone_and_counts_what_the_window_leaves_it(tmp_path):
    """HH-RLHF's harmless transcripts continued along the reply the red-teamer rated more harmful; only the final
    reply was compared. `train_turns: last` trains that reply alone (its tokens and end-of-turn), the earlier replies
    context, and the length count drops a conversation whose turns before the final reply fill the window (with
    `all` its first reply still trains there)."""
    from types import SimpleNamespace

    from align.config.sft import SFTStage
    from align.data.chat import sft_example
    from align.data.lengths import TRUNCATES_COMPLETIONS
    from align.stages.sft import tokenized

    tok, planned, msgs = _chatml_llama_conversation(tmp_path)
    every = sft_example(tok, planned, msgs)
    ctx = SimpleNamespace(name="sft", chat_template=planned, cfg=SFTStage(train_turns="last"))
    last = tokenized(ctx, [{"messages": msgs}], tok, "train")[0]
    assert last["input_ids"] == every["input_ids"]
    runs = lambda mask: [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]  # noqa: E731
    assert len(runs(every["assistant_masks"])) == 2 and len(runs(last["assistant_masks"])) == 1
    trained = tok.decode([t for t, m in zip(last["input_ids"], last["assistant_masks"]) if m])
    assert trained.startswith("good to hear") and "how are you" not in trained and trained.endswith(tok.eos_token)
    final_at = runs(last["assistant_masks"])[0]  # the window ends just before the final reply: nothing trains
    rows = [{"messages": msgs}]
    assert TRUNCATES_COMPLETIONS.measure("sft", SFTStage(train_turns="last").length_rows(rows), tok,
                                         final_at).dropped == 1
    assert TRUNCATES_COMPLETIONS.measure("sft", SFTStage().length_rows(rows), tok, final_at).dropped == 0
    assert TRUNCATES_COMPLETIONS.measure("sft", SFTStage(train_turns="last").length_rows(rows), tok,
                                         final_at + 1).dropped == 0
    # `align validate` shows the spans the stage trains (it showed both replies)
    import contextlib
    import io

    from align.modeling.checks import show_example

    shown = {}
    for turns in ("all", "last"):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            show_example(tok, planned, "p.yaml", True, "stages.sft.data", "sft.data", rows, turns, False)
        shown[turns] = out.getvalue()
    assert "trains on 2 span(s)" in shown["all"] and "how are you" in shown["all"]
    assert "trains on 1 span(s)" in shown["last"] and "how are you" not in shown["last"]
