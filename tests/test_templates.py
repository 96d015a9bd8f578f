"""Stock chat templates as real models ship them (tests/chat_templates/, sources in SOURCE.md): SmolLM2's (no
markers: prefix-by-prefix masks), Qwen2.5's (default system prompt), Llama-3.1's (date header; no markers, TRL
has no patch: prefix masks), Gemma-3's (no system role; TRL's patched copy) and Qwen3's (<think> blocks; TRL's
patched copy). SFT's labels must cover exactly each assistant reply and its end-of-turn token (align/data/chat.py
`sft_example`), on one-turn and multi-turn conversations, with and without a system message; a template whose
prefix rendering is inconsistent is refused, naming the turn."""

from __future__ import annotations

import pytest

from align import templates
from align.data.chat import TemplateError, render_prompt, sft_every_token, sft_example, trained_text
from conftest import REPO, run_align

DIR = REPO / "tests" / "chat_templates"
GPT2 = REPO / "tokenizers" / "gpt2"
ONE = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
MULTI = ONE + [{"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the bread rise?"}]
SYSTEM = [{"role": "system", "content": "Answer in one line."}]
CONVERSATIONS = {"one": ONE, "multi": MULTI, "system+one": SYSTEM + ONE, "system+multi": SYSTEM + MULTI}
# name -> (masking align plans, end-of-turn token, what the template writes before a reply's content)
EXPECTED = {
    "smollm2": ("prefix", "<|im_end|>", ""),
    "qwen2_5": ("trl", "<|im_end|>", ""),
    "llama3_1": ("prefix", "<|eot_id|>", ""),
    "gemma3": ("trl", "<end_of_turn>", ""),
    "qwen3": ("trl", "<|im_end|>", "<think>\n\n</think>\n\n"),  # empty reasoning block, as the template writes it
}
# BOS tokens the templates write with {{ bos_token }} (the GPT-2 tokenizer stands in for each model's own).
BOS = {"llama3_1": "<|begin_of_text|>", "gemma3": "<bos>"}


def stock(name: str, text: str | None = None, tmp_path=None):
    """The GPT-2 tokenizer with a stock template installed as align's SFT stage installs a pipeline's
    `chat_template: <file>` (its special tokens added, end-of-turn made EOS)."""
    from transformers import AutoTokenizer

    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(GPT2))
    if name in BOS:
        tok.add_special_tokens({"bos_token": BOS[name]})
    path = DIR / f"{name}.jinja"
    if text is not None:
        path = tmp_path / f"{name}_variant.jinja"
        path.write_text(text)
    planned = templates.resolve(str(path), REPO / "pipelines" / "x.yaml", None)
    templates.install(tok, planned)
    return tok, planned


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(EXPECTED))
def test_labels_are_exactly_the_replies_and_their_end_of_turn(name, conversation):
    masking, eot, lead = EXPECTED[name]
    tok, planned = stock(name)
    assert (planned.masking, planned.end_of_turn, tok.eos_token) == (masking, eot, eot)
    messages = CONVERSATIONS[conversation]
    if name == "qwen3" and "multi" in conversation:  # the stock template drops turn 1's reasoning once turn 3 follows:
        # TRL's copy keeps it, so SFT would train turn 3 after a history PPO and evaluation never render
        with pytest.raises(TemplateError, match=r"turn \d \(assistant\): rendering the conversation up to it rewrites "
                                                r"an earlier turn.*trl/chat_templates/qwen3_training\.jinja"):
            sft_example(tok, planned, messages)
        return
    example = sft_example(tok, planned, messages)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained_text(tok, example) == [lead + r + eot for r in replies]
    # Every trained token is a reply's; nothing of the user turns, system prompt or headers is.
    untrained = tok.decode([t for t, m in zip(example["input_ids"], example["assistant_masks"]) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in untrained
    # Every reply starts right after its prompt as PPO and evaluation tokenise it (no token spans the seam, and the
    # turns before it read as they render for those stages). Llama-3's '\n\n' after a header is one GPT-2 token alone
    # and two before a reply (the plan warns: the stand-in tokenizer's BPE, not Llama-3's): its first turn only.
    mask = example["assistant_masks"]
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(turns), name
    for start, turn in list(zip(starts, turns))[:1 if name == "llama3_1" else None]:
        assert example["input_ids"][:start] == tok(render_prompt(tok, messages[:turn]))["input_ids"], (name, turn)


def test_what_real_templates_bring_is_kept_and_never_trained():
    """Qwen2.5 injects its default system prompt, Llama-3.1 writes a date header, Gemma-3 folds the system
    message into the first user turn: all rendered, none trained."""
    cases = {"qwen2_5": (ONE, "You are Qwen, created by Alibaba Cloud"), "llama3_1": (ONE, "Cutting Knowledge Date"),
             "gemma3": (SYSTEM + ONE, "<start_of_turn>user\nAnswer in one line.\n\nHi there")}
    for name, (messages, kept) in cases.items():
        tok, planned = stock(name)
        example = sft_example(tok, planned, messages)
        assert kept in tok.decode(example["input_ids"]), name
        assert all(kept not in span for span in trained_text(tok, example)), name


def test_gemma_end_of_turn_is_trained():
    """axolotl #3754: with Gemma's template the model was never trained to emit <end_of_turn>."""
    tok, planned = stock("gemma3")
    example = sft_example(tok, planned, MULTI)
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    trained = [t for t, m in zip(example["input_ids"], example["assistant_masks"]) if m]
    assert trained.count(eot) == 2 and example["input_ids"].count(eot) == 4  # 2 user turns end untrained


def test_trl_agrees_with_the_plan():
    """align reads TRL's patched templates without importing TRL when it plans; TRL's own function agrees."""
    from trl.chat_template_utils import get_training_chat_template

    for name, (masking, _, _) in EXPECTED.items():
        tok, planned = stock(name)
        if masking == "trl":
            assert get_training_chat_template(tok) == planned.training_text, name
        else:
            with pytest.raises(ValueError):
                get_training_chat_template(tok)


def test_a_qwen3_template_trl_does_not_know_is_refused_on_multi_turn(tmp_path):
    """OpenRLHF #1080: Qwen3's template drops earlier turns' reasoning once a later user turn follows, so the
    rendering up to turn 3 rewrites turn 1. A copy TRL does not recognise (one comment added) gets prefix masks:
    one-turn conversations train as they should, multi-turn ones are refused naming the turn and the fix."""
    text = "{#- a fine-tune's copy of Qwen3's template -#}\n" + (DIR / "qwen3.jinja").read_text()
    tok, planned = stock("qwen3", text, tmp_path)
    assert planned.masking == "prefix"
    assert trained_text(tok, sft_example(tok, planned, ONE)) == ["<think>\n\n</think>\n\nHello! How can I help?<|im_end|>"]
    with pytest.raises(TemplateError, match=r"turn 3 \(assistant\): rendering the conversation up to it rewrites an "
                                            r"earlier turn.*\{% generation %\}.*completion_only_loss: false"):
        sft_example(tok, planned, MULTI)


def test_validate_refuses_an_inconsistent_template_before_any_stage(workdir, tmp_path):
    """The same template in a pipeline: `align validate` exits 2 naming the row, the turn and the fix."""
    (workdir / "tokenizers").symlink_to(REPO / "tokenizers")
    variant = tmp_path / "qwen3_copy.jinja"
    variant.write_text("{#- a fine-tune's copy -#}\n" + (DIR / "qwen3.jinja").read_text())
    proc = run_align("validate", "pipelines/chat.yaml", "tokenizer=../tokenizers/gpt2", f"chat_template={variant}",
                     cwd=workdir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "stages.sft.data: row" in proc.stderr and "(assistant): rendering the conversation" in proc.stderr
    assert "completion_only_loss: false" in proc.stderr and "Traceback" not in proc.stderr
    assert not (workdir / "runs").exists()


def test_no_token_spans_the_prompt_reply_seam(tmp_path):
    """A generation prompt ending in a space ('assistant: '): GPT-2's BPE would merge that space into the
    reply's first word when the two are tokenised together. Prefix masks tokenise the prompt and the reply apart,
    so SFT trains after exactly the prompt tokens PPO and evaluation sample after, and the labels decode to the
    reply and its end-of-turn token."""
    text = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot|>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
    tok, planned = stock("seam", text, tmp_path)
    assert planned.masking == "prefix" and tok.eos_token == "<|eot|>"
    example = sft_example(tok, planned, ONE)
    prompt_ids = tok(render_prompt(tok, ONE[:1]))["input_ids"]
    assert example["input_ids"][:len(prompt_ids)] == prompt_ids
    assert trained_text(tok, example) == ["Hello! How can I help?<|eot|>"]
    joined = tok(tok.apply_chat_template(ONE, tokenize=False))["input_ids"]
    assert joined[:len(prompt_ids)] != prompt_ids  # together, the seam's space merges: the case is real


def test_one_resolution_call_site():
    """`chat_template` is resolved in one place outside the tests: the plan."""
    import subprocess

    out = subprocess.run(["grep", "-rn", r"templates\.resolve(", str(REPO / "align")], capture_output=True,
                         text=True).stdout.strip().splitlines()
    assert len(out) == 1 and "align/orchestrator/plan.py" in out[0], out


def test_a_template_that_refuses_a_conversation_is_named_not_a_traceback():
    """Stock templates refuse some conversations themselves (Gemma's: roles must alternate): a TemplateError
    that the SFT stage and `align validate` name with the row."""
    tok, planned = stock("gemma3")
    with pytest.raises(TemplateError, match="the chat template refuses this conversation: Conversation roles must "
                                            "alternate"):
        sft_example(tok, planned, [ONE[0], ONE[0], ONE[1]])


def test_hh_rows_with_two_turns_of_one_role_are_dropped_so_gemmas_template_takes_the_card():
    """3 of 1,791 HH pairs in ../shared hold two Assistant turns in a row; Gemma's (and Mistral's) template refuses
    such a conversation, and one refused row refused the whole chat card at validate, with no setting to pass it.
    The HH transforms drop and count them now, in text and chat cards alike (the same pairs kept)."""
    from align.data.transforms import hh_chosen_messages, hh_transcript

    tok, planned = stock("gemma3")
    ok = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: joke?\n\nAssistant: "
    odd = "\n\nHuman: Hi\n\nAssistant: Hello\n\nAssistant: still there?\n\nHuman: joke?\n\nAssistant: "
    hh = [{"chosen": ok + "ha", "rejected": ok + "no"}, {"chosen": odd + "ha", "rejected": odd + "no"}]
    rows, dropped = hh_chosen_messages(hh, None, 0)
    assert len(rows) == 1 and dropped == {"two turns of one role in a row": 1}
    assert hh_transcript(hh, None, 0)[1] == dropped
    assert sft_example(tok, planned, rows[0]["messages"])  # what is kept renders
    with pytest.raises(TemplateError, match="alternate"):  # what was dropped would not have
        sft_example(tok, planned, [{"role": r, "content": t} for r, t in
                                   [("user", "Hi"), ("assistant", "Hello"), ("assistant", "still there?"),
                                    ("user", "joke?"), ("assistant", "ha")]])


def test_validate_refuses_when_trl_no_longer_patches_the_planned_template(monkeypatch):
    """The plan reads TRL's template files; if the installed TRL's function disagrees, `align validate` says so
    (it used to be swallowed as a tokenizer that cannot load)."""
    import trl.chat_template_utils as ctu

    from align.config import load_pipeline
    from align.modeling import checks
    from align.orchestrator.plan import build_plan
    from align.orchestrator.validate import card_loader, model_job

    def patched_nothing(tokenizer):
        raise ValueError("unrecognised template")

    monkeypatch.setattr(ctu, "get_training_chat_template", patched_nothing)
    source = REPO / "pipelines" / "chat.yaml"
    cfg = load_pipeline(source, ["tokenizer=../tokenizers/gpt2", f"chat_template={DIR / 'qwen2_5.jinja'}"])
    # what `align validate` runs in its helper process (align/orchestrator/helper.py), run here where TRL is patched
    job = model_job(cfg, build_plan(cfg, source), card_loader(), str(source), verbose=False)
    with pytest.raises(checks.CheckError, match="align planned masking 'trl' .*has no patched template"):
        checks.run(**job)


def test_a_marker_template_on_a_tokenizer_that_adds_bos_trains_after_the_bos_later_stages_prompt_with(tmp_path):
    """chatml (generation markers) writes no BOS, and transformers' apply_chat_template adds none, while PPO, DPO,
    the reward model and evaluation encode prompts with `tokenizer(text)`, which for a Llama tokenizer puts BOS first.
    SFT's ids then started at <|im_start|>: a model trained on sequences without the BOS it is later prompted with.
    Now the SFT example starts with that BOS (untrained), and its prompt tokens are exactly the later stages'."""
    from families import SEED, sentencepiece_tokenizer

    from align.modeling.models import load_tokenizer, prepare_tokenizer

    print(f"sentencepiece seed {SEED}")
    tok = prepare_tokenizer(load_tokenizer(str(sentencepiece_tokenizer(tmp_path / "tok"))))
    planned = templates.resolve("chatml", REPO / "pipelines" / "x.yaml", None)
    templates.install(tok, planned)
    assert planned.masking == "markers" and tok("a")["input_ids"][0] == tok.bos_token_id
    for messages in (ONE, SYSTEM + MULTI):
        example = sft_example(tok, planned, messages)
        assert example["input_ids"][0] == tok.bos_token_id and example["assistant_masks"][0] == 0
        assert example["input_ids"].count(tok.bos_token_id) == 1
        start = example["assistant_masks"].index(1)
        assert example["input_ids"][:start] == tok(render_prompt(tok, messages[:1 + (messages[0]["role"] == "system")]))[
            "input_ids"]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [t.strip() for t in trained_text(tok, example)] == [f"{r}<|im_end|>" for r in replies]
        # completion_only_loss: false trains the same tokens (align tokenises them; TRL's own adds no BOS), all of them
        whole = sft_every_token(tok, messages)
        assert whole["input_ids"] == example["input_ids"] and set(whole["assistant_masks"]) == {1}


def test_a_marker_template_that_leaves_the_end_of_turn_untrained_is_refused(tmp_path):
    """A user's copy of chatml with {% endgeneration %} before <|im_end|>: the replies train, their end-of-turn (the
    EOS) does not, and the model never learns to stop. Refused naming the template and the fix (align validate reaches
    it through the helper's example rows, as every TemplateError)."""
    text = (REPO / "align" / "templates" / "chatml.jinja").read_text()
    bad = text.replace("{{- message['content'] + '<|im_end|>' -}}\n        {%- endgeneration -%}",
                       "{{- message['content'] -}}\n        {%- endgeneration -%}{{- '<|im_end|>' -}}", 1)
    assert bad != text
    from transformers import AutoTokenizer

    from align.modeling.models import prepare_tokenizer

    path = tmp_path / "mine.jinja"
    path.write_text(bad)
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(GPT2))
    planned = templates.resolve(str(path), REPO / "pipelines" / "x.yaml", None)
    templates.install(tok, planned)
    assert planned.masking == "markers"
    with pytest.raises(TemplateError, match=r"mine.jinja: a reply's trained tokens end before the end-of-turn token "
                                            r"'<\|im_end\|>'.*put \{% endgeneration %\} after the end-of-turn token"):
        sft_example(tok, planned, ONE)
    good = tmp_path / "good.jinja"
    good.write_text(text)
    planned = templates.resolve(str(good), REPO / "pipelines" / "x.yaml", None)
    assert trained_text(tok, sft_example(tok, planned, MULTI)) == [m["content"] + "<|im_end|>" for m in MULTI
                                                                     if m["role"] == "assistant"]


def test_validate_counts_a_stage_that_samples_its_replies_on_its_cards_prompts_alone():
    """PPO's length check at validate read its prompt card's whole rows, replies too: a card where more than 1% of
    the replies held a special token's text (or two replies rendered alike) was refused at validate for text PPO
    never reads (the stage itself reads the prompts alone). What validate's helper gets for PPO is the prompts;
    the trained stages' examples keep their replies."""
    from align.config import load_pipeline
    from align.orchestrator.plan import build_plan
    from align.orchestrator.validate import card_loader, model_job

    source = REPO / "pipelines" / "chat.yaml"
    cfg = load_pipeline(source, ["tokenizer=../tokenizers/gpt2", f"chat_template={DIR / 'qwen2_5.jinja'}"])
    job = model_job(cfg, build_plan(cfg, source), card_loader(), str(source), verbose=False)
    rows = {entry["stage"]: entry["rows"] for entry in job["lengths"]}
    assert {"ppo", "dpo"} <= set(rows), sorted(rows)
    assert all(set(r) == {"prompt"} for r in rows["ppo"]) and len(rows["ppo"]) > 50
    assert all({"prompt", "chosen", "rejected"} <= set(r) for r in rows["dpo"])


def _trl_templates() -> list[str]:
    import trl

    folder = __import__("pathlib").Path(trl.__file__).parent / "chat_templates"
    return sorted(p.stem.removesuffix("_training") for p in folder.glob("*_training.jinja"))


# On GPT-2's tokenizer (the stand-in for each model's own) align refuses these when it installs them: an end-of-turn
# token GPT-2 lacks as a special token (DeepSeek's, GLM's, the image-text models'), a prompt the reply's rendering
# rewrites (Nemotron 3), an image-text template that reads content as parts (LLaVA-NeXT), a Jinja feature it refuses
INSTALL_REFUSED = {"cohere2", "deepseek_r1_distill", "deepseekv3", "diffusion_gemma", "glm4moe", "idefics3",
                   "llava_next", "nemotron_3_5_lightning", "nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra",
                   "smolvlm"}
# Multi-turn rows SFT refuses, naming the turn: Qwen3's family drops earlier turns' reasoning blocks that TRL's copies
# keep; gpt-oss ends earlier turns in <|end|>, the last in <|return|> (its EOS)
MULTI_REFUSED = {"qwen3", "qwen3_5_think", "qwen3_5_nothink", "qwen3_6", "gptoss"}


@pytest.mark.parametrize("conversation", ["one", "multi"])
@pytest.mark.parametrize("name", _trl_templates())
def test_every_trl_copy_trains_replies_after_the_prompts_later_stages_sample_after(name, conversation, tmp_path):
    """Each stock template TRL patches (its `<name>_training.jinja`), on GPT-2's tokenizer: SFT either refuses the
    conversation naming the turn, or trains each reply after exactly the prompt tokens PPO and evaluation sample
    after (the turns before it as the stock template renders them, tokenised alone), and trains what reward and DPO
    read as the reply, with its end-of-turn token. Before, TRL's Qwen3.5/3.6 copies trained the generation prompt's
    own '<think>' after a context without it, LFM2's cut a reply's own leading newline, and Qwen3's trained turn 3
    after a turn 1 the stock template renders without its reasoning block."""
    import jinja2
    import trl

    from align.core.errors import ModelError
    from align.core.schema import ConfigError
    from align.data.chat import FormatError, render_reply

    stock_file = __import__("pathlib").Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    messages = {"one": ONE, "multi": [*MULTI[:3], {"role": "assistant", "content": "\nTwo lines\nhere"}]}[conversation]
    try:
        tok, planned = stock(name, stock_file.read_text(), tmp_path)
    except (ConfigError, FormatError, ModelError, jinja2.TemplateError) as exc:  # refused when planned or installed
        # (no end-of-turn token; an image-text template reading content as parts: align validate names it)
        print(f"{name}: refused at install: {str(exc)[:120]}")
        assert name in INSTALL_REFUSED, str(exc)
        return
    assert name not in INSTALL_REFUSED
    assert planned.masking == "trl", name
    try:
        example = sft_example(tok, planned, messages)
    except TemplateError as exc:  # named: the turn, or the end-of-turn token a reply lacks (gpt-oss ends earlier
        print(f"{name} {conversation}: refused: {str(exc)[:160]}")  # turns in <|end|>, the last in <|return|>)
        assert conversation == "multi" and name in MULTI_REFUSED, str(exc)
        return
    assert conversation == "one" or name not in MULTI_REFUSED
    mask, ids = example["assistant_masks"], example["input_ids"]
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(turns), (name, trained_text(tok, example))
    first = name.startswith("llama3")  # the GPT-2 stand-in's '\n\n' after a header (see the test above): turn 1 only
    for k, (start, turn) in list(enumerate(zip(starts, turns)))[:1 if first else None]:
        prompt = render_prompt(tok, messages[:turn])
        assert ids[:start] == tok(prompt)["input_ids"], (name, turn, tok.decode(ids[:start])[-40:], prompt[-40:])
        reply = render_reply(tok, messages[:turn], messages[turn:turn + 1], prompt)
        assert trained_text(tok, example)[k] == reply + tok.eos_token, (name, turn)


INST = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
"""A Mistral-style [INST] template (no generation markers: SFT masks by prefixes)."""


def test_a_dummy_prefix_tokenizer_trains_each_segment_as_it_follows_the_last_not_with_a_space(tmp_path):
    """Prefix masking encoded each later segment alone, and a SentencePiece tokenizer with a dummy prefix (Mistral's,
    Llama-2's) starts every text it encodes alone with "▁": every reply was trained to begin with a space the template
    never writes, and from the third turn PPO's prompt (the template's text encoded whole) was no prefix of SFT's ids.
    Later segments are now encoded as they follow earlier text."""
    from families import SEED, tokenizer

    from align.modeling.models import load_tokenizer, prepare_tokenizer

    print(f"tokenizer seed {SEED}")
    tokenizer("mistral", tmp_path / "tok")
    tok = prepare_tokenizer(load_tokenizer(str(tmp_path / "tok")))
    (tmp_path / "inst.jinja").write_text(INST)
    planned = templates.resolve(str(tmp_path / "inst.jinja"), tmp_path / "p.yaml", None)
    templates.install(tok, planned)
    assert planned.masking == "prefix"
    messages = MULTI
    example = sft_example(tok, planned, messages)
    prompt = tok(render_prompt(tok, messages[:3]))["input_ids"]
    assert example["input_ids"][:len(prompt)] == prompt  # the third turn's prompt is what SFT trained after
    trained = [t for t, m in zip(tok.convert_ids_to_tokens(example["input_ids"]), example["assistant_masks"]) if m]
    whole = tok.convert_ids_to_tokens(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert trained[0] != "▁" and not trained[0].startswith("▁") and trained[0] in whole  # "Hello", as written
    assert [t.strip() for t in trained_text(tok, example)] == [f"{m['content']}</s>" for m in messages[1::2]]


def test_the_length_check_names_the_row_a_template_refuses(tmp_path):
    """SFT's length check rendered each conversation with apply_chat_template itself: a conversation the template
    refuses (a system turn under Mistral's) stopped the stage with a Jinja traceback naming no row."""
    from transformers import AutoTokenizer

    from align.data.lengths import _chat_lengths
    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    tok.chat_template = INST
    assert _chat_lengths(tok, [ONE])[0] > 0
    with pytest.raises(TemplateError, match=r"row 1: the chat template refuses this conversation: Conversation "
                                            r"roles must alternate"):
        _chat_lengths(tok, [ONE, SYSTEM + ONE])


def test_a_conversational_prompt_the_template_refuses_is_named_by_row_and_column():
    """as_text named the row of a malformed conversation but not of one the template refuses: "the chat template
    refuses this conversation: ..." for one bad row among thousands, with no row to find it by."""
    from transformers import AutoTokenizer

    from align.data.chat import as_text
    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    tok.chat_template = INST
    good = {"prompt": ONE[:1], "chosen": ONE[1:], "rejected": [{"role": "assistant", "content": "No."}]}
    bad = dict(good, prompt=SYSTEM + ONE[:1])
    assert len(as_text([good], tok)) == 1
    with pytest.raises(TemplateError, match=r"row 2: prompt: the chat template refuses this conversation"):
        as_text([good, good, bad], tok)


def test_the_rows_a_template_adds_are_drawn_by_the_stages_seed():
    """The embedding rows a chat template's new tokens get were drawn from the process's random state, not the stage's
    seed: a seed sweep left them alike. They follow the seed now, and the process's state is left as it was."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from align.stages.sft import seeded_fit

    def rows(seed):
        tok = AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2")
        torch.manual_seed(0)  # the same model each time: only the new rows may differ
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(tok)))
        tok.add_special_tokens({"additional_special_tokens": ["<|turn|>", "<|end|>"]})
        state = torch.random.get_rng_state()
        seeded_fit(model, tok, seed)
        assert torch.equal(torch.random.get_rng_state(), state)
        return model.get_input_embeddings().weight[-2:].detach().clone()

    print("seeds 1, 2")
    assert torch.equal(rows(1), rows(1)) and not torch.equal(rows(1), rows(2))
