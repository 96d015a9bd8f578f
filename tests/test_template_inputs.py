"""Hostile tokenizers and chat templates (a probe, 2026-11-29): each case trained on the wrong tokens without a word,
or was refused with the wrong fix; each is now refused naming the setting and its fix."""

from __future__ import annotations

import json
import shutil

import pytest

from align import templates
from align.core.errors import ModelError
from align.core.schema import ConfigError
from conftest import REPO

CHAT = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
DEAD_BRANCH = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'bot' %}{% generation %}{{ m.content }}"
               "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _gpt2(tmp_path, **config):
    folder = tmp_path / "tok"
    shutil.copytree(REPO / "tokenizers" / "gpt2", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def test_a_tokenizer_that_spells_out_its_eos_or_appends_a_token_is_refused(tmp_path):
    """split_special_tokens: true encoded '<|im_end|>' as seven ordinary tokens, so SFT trained replies to end in
    that text and never in the id that stops generation; a tokenizer that appends EOS put a stop token at the end of
    every prompt."""
    from align.data.chat import encoding_problem
    from align.modeling.models import load_tokenizer

    load_tokenizer(str(_gpt2(tmp_path / "plain")))  # as shipped: fine
    with pytest.raises(ModelError, match=r"encodes its EOS text '<\|endoftext\|>' as \[.*\], not as its id 50256 "
                                         r"\(split_special_tokens: true"):
        load_tokenizer(str(_gpt2(tmp_path / "split", split_special_tokens=True)))

    class Appending:  # what add_eos_token: true or a `$A </s>` post-processor does
        eos_token, eos_token_id = "</s>", 2

        def __call__(self, text, add_special_tokens=True):
            ids = [2] if text == "</s>" else [7]
            return {"input_ids": ids + ([2] if add_special_tokens else [])}

        def convert_ids_to_tokens(self, ids):
            return ["</s>" if i == 2 else "a" for i in ids]

    assert "appends ['</s>'] to every text it encodes (add_eos_token: true" in encoding_problem(Appending())


def _chatml_gpt2(tmp_path):
    from align.modeling.models import load_tokenizer

    tok = load_tokenizer(str(_gpt2(tmp_path)))
    templates.install(tok, templates.resolve("chatml", REPO / "pipelines" / "chat.yaml", None))
    return tok


def test_an_assistant_turn_first_is_refused_by_prefix_masking_not_trained_as_the_system_prompt(tmp_path):
    """Prefix masking took the template's default system turn for turn 0's reply (SmolLM2's), or the BOS and date
    header (Llama-3.1's), and never trained the reply."""
    from align.data.chat import TemplateError, prefix_segments

    tok = _chatml_gpt2(tmp_path)
    first = [{"role": "assistant", "content": "Welcome"}, *CHAT]
    with pytest.raises(TemplateError, match=r"turn 0 is the assistant's.*start the conversation with a user or system"):
        prefix_segments(tok, None, first)
    assert [t for t, trained in prefix_segments(tok, None, CHAT) if trained] == ["Hello!<|im_end|>"]


def test_markers_that_never_fire_are_refused_at_validate_and_in_a_comment_mark_nothing(tmp_path):
    from align.data.chat import has_generation_markers
    from align.modeling.checks import CheckError, show_example

    assert not has_generation_markers("{# {% generation %}{% endgeneration %} #}{{ messages }}")
    path = tmp_path / "dead.jinja"
    path.write_text(DEAD_BRANCH)
    planned = templates.resolve(str(path), tmp_path / "p.yaml", None)
    assert planned.masking == "markers"
    tok = _chatml_gpt2(tmp_path)
    tok.chat_template = planned.text
    with pytest.raises(CheckError, match=r"row 0: chat template file:.*dead.jinja: no token of this conversation is "
                                         r"trained"):
        show_example(tok, planned, "p.yaml", False, "stages.sft.data", "sft.data", [{"messages": CHAT}],
                     assistant_turns=True, replies=False)


def test_an_unclosed_marker_is_a_syntax_error_and_a_byte_order_mark_no_text(tmp_path):
    path = tmp_path / "unclosed.jinja"
    path.write_text("{% for m in messages %}{% generation %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match=r"not a valid Jinja template .*each \{% generation %\} is read as a block"):
        templates.resolve(str(path), tmp_path / "p.yaml", None)
    bom = tmp_path / "bom.jinja"
    bom.write_text("\ufeff" + (REPO / "align" / "templates" / "chatml.jinja").read_text(), encoding="utf-8")
    text = templates.resolve(str(bom), tmp_path / "p.yaml", None).text
    assert not text.startswith("\ufeff") and text == (REPO / "align" / "templates" / "chatml.jinja").read_text()


def test_a_reply_opening_with_a_newline_keeps_the_prompt_tokens_ppo_samples_after(tmp_path):
    """Under {% generation %} markers the whole conversation was tokenised at once: a reply opening with '\\n' merged
    with the newline that ends ChatML's generation prompt ('ĊĊ' on GPT-2's BPE), so SFT trained tokens after a prompt
    PPO never has ('...assistant' without its 'Ċ'). Such rows are tokenised by prefixes."""
    from align.data.chat import render_prompt, sft_example, trained_text

    tok = _chatml_gpt2(tmp_path)
    planned = templates.resolve("chatml", REPO / "pipelines" / "chat.yaml", None)
    assert planned.masking == "markers"
    for reply in ("\n\nHello there", "\nHello", "Hello"):
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
        example = sft_example(tok, planned, conv)
        prompt = tok(render_prompt(tok, conv[:1]))["input_ids"]
        assert example["input_ids"][:len(prompt)] == prompt, reply
        assert example["assistant_masks"][:len(prompt)] == [0] * len(prompt)
        assert trained_text(tok, example) == [reply + "<|im_end|>"], reply


def test_markers_that_also_hold_the_newline_after_the_end_of_turn_train_the_reply_and_its_end_of_turn(tmp_path):
    """A template whose {% generation %} block holds the '\\n' after <|im_end|> (as TRL's own training copies do) was
    refused with "put {% endgeneration %} after the end-of-turn token", which it already was. That newline is now
    left untrained, as it is under TRL's copies; a reply's own leading newline stays trained."""
    from align.data.chat import render_prompt, sft_example, trained_text

    path = tmp_path / "nl.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
                    "{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}{{ m.content }}<|im_end|>\n{% endif %}"
                    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    planned = templates.resolve(str(path), tmp_path / "p.yaml", None)
    assert planned.masking == "markers"
    tok = _chatml_gpt2(tmp_path)
    tok.chat_template = planned.text
    for reply in ("Hello!", "\nTwo lines\nhere"):
        conv = [*CHAT[:1], {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Done."}]
        example = sft_example(tok, planned, conv)
        assert trained_text(tok, example) == [reply + "<|im_end|>", "Done.<|im_end|>"], reply
        prompt = tok(render_prompt(tok, conv[:3]))["input_ids"]
        assert example["input_ids"][:len(prompt)] == prompt and example["assistant_masks"][len(prompt)] == 1


def test_a_conversation_the_assistant_opens_still_trains_under_markers(tmp_path):
    """A review (2026-11-30) of the context check: a conversation whose first turn is the assistant's (a greeting) was
    refused once markers were checked against every turn's prompt; its opening turn has no prompt (no later stage
    samples there), and both replies train as the markers say."""
    from align.data.chat import sft_example, trained_text

    tok = _chatml_gpt2(tmp_path)
    planned = templates.resolve("chatml", REPO / "pipelines" / "chat.yaml", None)
    conv = [{"role": "assistant", "content": "Hi, how can I help?"}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": " Blue."}]  # (a reply opening with whitespace: its prompt is checked)
    assert trained_text(tok, sft_example(tok, planned, conv)) == ["Hi, how can I help?<|im_end|>", " Blue.<|im_end|>"]
