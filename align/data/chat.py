"""Conversational rows, and the text every stage after SFT sees of them.

A conversational row holds messages (lists of `{role, content}`), as TRL's conversational formats do:
`prompt` is the conversation so far (ending with a user turn); `chosen` / `rejected` / `completion` are lists of
one assistant message. SFT trains on `messages` tokenised here (`sft_example`: ids and a mask of the assistant
turns, by the template's masking) and handed to TRL. Reward, DPO, PPO, preferences and evaluate work on text rendered once, here, with the
tokenizer's chat template:

- prompt = the template's rendering of the prompt turns with the generation prompt (the opening of an assistant
  turn), e.g. `<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n`;
- a reply = exactly what the template writes for the assistant's content between that opening and its
  end-of-turn token, which is the tokenizer's EOS (align/templates/).

So prompt + reply + EOS is, token for token, the template's rendering of the whole conversation up to the
end-of-turn token: what TRL's reward and DPO trainers train on (they append EOS), what PPO samples (the policy
stops at EOS) and scores, and what the reward-model judge scores at evaluation.
"""

from __future__ import annotations

import re
from typing import Any

from align.data.formats import FormatError, check_conversation

GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def has_generation_markers(text: str) -> bool:
    """Whether the template marks assistant tokens with `{% generation %}` (one of the masking modes); a marker in a
    Jinja comment marks nothing."""
    return GENERATION_TAG.search(re.sub(r"\{#.*?#\}", "", text, flags=re.S)) is not None


def _apply(tokenizer, messages, **kwargs):
    """`tokenizer.apply_chat_template`, with the template's own refusals (`raise_exception(...)` in stock
    templates: a system turn Gemma does not take, roles that do not alternate) as a FormatError that the caller
    names with its row, not a Jinja traceback."""
    import jinja2  # light

    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the chat template refuses this conversation: {exc}") from None


def adds_bos(tokenizer) -> bool:
    """Whether encoding text prepends the BOS token by itself (Llama-style tokenizers do)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return bos is not None and len(ids) > 1 and ids[0] == bos


def encoding_problem(tokenizer) -> str | None:
    """Why this tokenizer cannot take align's rendered text (None: it can): every stage encodes text with
    `tokenizer(text)`, so the EOS (end-of-turn) token's text must encode to its id, and encoding must append nothing
    after the text, or the model would be trained on a spelled-out end of turn it can never emit, or every prompt
    would end in a stop token."""
    eos = tokenizer.eos_token
    eos_ids = tokenizer(eos, add_special_tokens=False)["input_ids"] if eos is not None else None
    if eos_ids is not None and eos_ids != [tokenizer.eos_token_id]:
        return (f"encodes its EOS text {eos!r} as {eos_ids}, not "
                f"as its id {tokenizer.eos_token_id} (split_special_tokens: true in tokenizer_config.json?): "
                "replies would be trained to end in that text, never in the token that stops generation; set "
                "split_special_tokens: false and save the tokenizer again")
    plain, full = (tokenizer("a", add_special_tokens=flag)["input_ids"] for flag in (False, True))
    if plain and len(full) > len(plain) and full[-1] != plain[-1]:
        return (f"appends {tokenizer.convert_ids_to_tokens(full[-1:])} to every text it encodes (add_eos_token: "
                "true in tokenizer_config.json, or a post-processor that adds it): every prompt would end in a "
                "stop token and every SFT example carry one mid-conversation; set add_eos_token: false (or remove "
                "the post-processor's trailing token) and save the tokenizer again")
    return None


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt turns rendered with the generation prompt, as text that encodes (`tokenizer(text)`, the way
    align and TRL encode text) to the template's own token ids: a BOS the template writes is left to the
    tokenizer when it adds one itself."""
    return _bos_stripped(tokenizer, _apply(tokenizer, messages, tokenize=False, add_generation_prompt=True))


def render_reply(tokenizer, messages: list[dict[str, str]], reply: list[dict[str, str]], prompt_text: str) -> str:
    """What the template writes for the assistant reply between the generation prompt and the end-of-turn
    token (EOS). A template that renders the prompt differently once a reply follows is refused: the policy
    would be sampled from a context it was never trained on."""
    full = _apply(tokenizer, messages + reply, tokenize=False)
    bos = tokenizer.bos_token
    if bos and full.startswith(bos) and not prompt_text.startswith(bos):
        full = full[len(bos):]
    eos = tokenizer.eos_token
    if not full.startswith(prompt_text) or eos not in full[len(prompt_text):]:
        raise FormatError("the chat template does not render a prompt followed by the assistant's reply and "
                          f"EOS ({eos!r}) as the prompt rendered with add_generation_prompt=True, then the reply: "
                          "PPO and DPO prompts would differ from what SFT trained on. Use chat_template: chatml "
                          "or llama3, or a template with that property")
    return full[len(prompt_text):full.index(eos, len(prompt_text))]


def as_text(rows: list[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
    """Conversational rows rendered with the tokenizer's chat template (see the module docstring); text rows
    are returned unchanged."""
    out = []
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not isinstance(prompt, list):
            out.append(row)
            continue
        check_conversation(prompt, f"row {i}: prompt", last_role="user")
        col = "prompt"
        try:  # a template's refusal names its row and column, as check_conversation's errors do
            new = dict(row, prompt=render_prompt(tokenizer, prompt))
            for col in ("chosen", "rejected", "completion"):
                if col in row:
                    check_conversation(row[col], f"row {i}: {col}", last_role="assistant")
                    new[col] = render_reply(tokenizer, prompt, row[col], new["prompt"])
        except TemplateError as exc:
            raise TemplateError(f"row {i}: {col}: {exc}") from None
        out.append(new)
    return out


# --------------------------------------------------------------------------------------------- SFT examples
class TemplateError(FormatError):
    """A conversation the chat template cannot split into trained and untrained tokens; names the turn."""


def _bos_stripped(tokenizer, text: str) -> str:
    bos = tokenizer.bos_token
    return text[len(bos):] if bos and text.startswith(bos) and adds_bos(tokenizer) else text


def _stock_text(tokenizer, template) -> str:
    """The template every stage renders with: the planned one's text, else the tokenizer's own."""
    return template.text if template is not None and template.text else tokenizer.chat_template


def prefix_segments(tokenizer, template, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) segments by prefix-by-prefix rendering: for each assistant turn i,
    `messages[:i]` rendered with the generation prompt, then `messages[:i+1]`; the new text up to and including
    the end-of-turn token (the tokenizer's EOS) is turn i's reply. Concatenated, the segments are the
    template's rendering of the whole conversation.

    A template that renders an earlier turn differently once later turns follow (e.g. one that drops earlier
    turns' reasoning) cannot be split this way: TemplateError naming the turn and the fixes."""
    text = _stock_text(tokenizer, template)
    name = template.source if template is not None else "the tokenizer's chat template"
    eot = tokenizer.eos_token

    def render(msgs: list[dict[str, str]], gen: bool) -> str:
        return _apply(tokenizer, msgs, chat_template=text, tokenize=False, add_generation_prompt=gen)

    fix = ("write a .jinja template with {% generation %} markers around each reply and its end-of-turn token and "
           "set chat_template to it, or set the SFT stage's completion_only_loss: false to train on every token")
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:  # what the template writes before any turn (a default system turn, a BOS, a date header) would be
            # read as the reply: transformers renders no empty conversation to tell it apart
            raise TemplateError(f"chat template {name}: turn 0 is the assistant's, and prefix masking reads a reply as "
                                "what the template adds after the turns before it, of which there are none; start "
                                "the conversation with a user or system turn, or " + fix)
        before = render(messages[:i], True)
        if not before.startswith(done):
            raise TemplateError(f"chat template {name}: turn {i} (assistant): rendering the conversation up to it "
                                "rewrites an earlier turn's text, so no token mask fits every turn; " + fix)
        after = render(messages[:i + 1], False)
        if not after.startswith(before):
            raise TemplateError(f"chat template {name}: turn {i} (assistant): the conversation rendered with this "
                                "reply does not start with the same conversation rendered with the generation "
                                "prompt, so the reply's tokens cannot be told apart; " + fix)
        end = after.find(eot, len(before))
        if end < 0:
            raise TemplateError(f"chat template {name}: turn {i} (assistant): the reply is not followed by the "
                                f"end-of-turn token {eot!r}; " + fix)
        segments += [(before[len(done):], False), (after[len(before):end + len(eot)], True)]
        done = after[:end + len(eot)]
    full = render(messages, False)
    if not full.startswith(done):
        raise TemplateError(f"chat template {name}: the last assistant turn is rendered differently once the turns "
                            "after it follow; " + fix)
    if full[len(done):]:
        segments.append((full[len(done):], False))
    return [(t, trained) for t, trained in segments if t]


def last_reply_only(mask: list[int]) -> list[int]:
    """An assistant mask with only its last run of trained tokens kept (the final reply and its end-of-turn)."""
    end = max((i for i, m in enumerate(mask) if m), default=-1)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [int(start <= i <= end and end >= 0) for i in range(len(mask))]


def sft_example(tokenizer, template, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """Token ids and the assistant mask SFT trains on (1 = the token is trained), by the template's masking:

    - `markers` / `trl`: transformers' assistant-token mask from the template's `{% generation %}` markers (for
      `trl`, TRL's patched copy of the stock template; the tokenizer keeps the stock one);
    - `prefix` (stock templates without markers): `prefix_segments`, each segment tokenised on its own, the
      first as `tokenizer(text)` encodes a prompt (BOS as the tokenizer adds it). No token spans the
      prompt/reply seam, so the prompt's tokens are the ones PPO and evaluation sample after."""
    masking = template.masking if template is not None else None
    if masking is None:  # a template the plan could not read (a hub tokenizer not cached there): as it renders
        masking = "markers" if has_generation_markers(str(tokenizer.chat_template)) else "prefix"
    if masking in ("markers", "trl"):
        stock = _stock_text(tokenizer, template)
        text = (template.training_text if masking == "trl" else stock) or tokenizer.chat_template
        out = _apply(tokenizer, messages, chat_template=text, tokenize=True, return_dict=True,
                     return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        bos = tokenizer.bos_token_id
        if adds_bos(tokenizer) and ids[:1] != [bos]:  # the template writes no BOS (chatml on a Llama tokenizer) and
            ids, mask = [bos, *ids], [0, *mask]  # apply_chat_template adds none: the prompts of every later stage
            # (`tokenizer(text)`) start with it, so the model learns replies after the BOS it will be prompted with
        # markers may hold the newline after a reply's end-of-turn; TRL's copies the newline before it too: cut to
        # the reply (a user's markers keep what they open with: a reply's own leading newline)
        mask = _reply_only(tokenizer, ids, mask, _generation_prompt(tokenizer, text) if masking == "trl" else "")
        ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
        if any(ids[i] != tokenizer.eos_token_id for i in ends):  # a model never taught to stop never stops
            name = template.source if template is not None else "the tokenizer's chat template"
            raise TemplateError(f"chat template {name}: a reply's trained tokens end before the end-of-turn token "
                                f"{tokenizer.eos_token!r} (its {{% generation %}} markers close before it): the model "
                                "would never learn to stop; put {% endgeneration %} after the end-of-turn token")
        if _contexts_match(tokenizer, stock, messages, ids, mask, exact=masking == "trl"):
            return {"input_ids": ids, "assistant_masks": mask}
        try:  # tokenised by prefixes instead, so each reply's context is the prompt PPO and evaluation sample after
            return _by_prefixes(tokenizer, template, messages)
        except TemplateError as exc:  # a stock template that rewrites earlier turns (Qwen3's reasoning)
            if masking != "trl" or "rewrites an earlier turn" not in str(exc):
                raise
            raise TemplateError(f"{exc}; or set chat_template to TRL's copy (trl/chat_templates/{template.trl_name}"
                                "_training.jinja) so that every stage renders earlier turns as SFT trains on them") from None
    return _by_prefixes(tokenizer, template, messages)


def _by_prefixes(tokenizer, template, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for k, (text, trained) in enumerate(prefix_segments(tokenizer, template, messages)):
        piece = tokenizer(_bos_stripped(tokenizer, text))["input_ids"] if k == 0 else _continued(tokenizer, text)
        ids += piece
        mask += [int(trained)] * len(piece)
    return {"input_ids": ids, "assistant_masks": mask}


ANCHOR = "\n"


def _continued(tokenizer, text: str) -> list[int]:
    """`text`'s tokens as they follow earlier text: those of ANCHOR + text after ANCHOR's own. A SentencePiece
    tokenizer with a dummy prefix (Llama-2, Mistral) starts every text it encodes alone with "▁": each later segment
    was trained as " Hello" where the template writes "Hello", and PPO's prompts (the template's text, encoded whole)
    no longer began with SFT's ids from the third turn on. Encoded alone where the anchor merges with the text (a
    byte-level BPE's newline before a newline), which only a dummy prefix would change."""
    anchor = tokenizer(ANCHOR, add_special_tokens=False)["input_ids"]
    full = tokenizer(ANCHOR + text, add_special_tokens=False)["input_ids"]
    if anchor and full[:len(anchor)] == anchor:
        return full[len(anchor):]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _contexts_match(tokenizer, stock: str, messages: list[dict[str, str]], ids: list[int], mask: list[int],
                    exact: bool) -> bool:
    """Whether the assistant turns' trained tokens follow the tokens the later stages prompt with: the turns before
    each rendered with the (stock) template and the generation prompt, tokenised alone. `exact` (TRL's copies, which
    render earlier turns their own way, e.g. Qwen3's with their reasoning blocks that the stock template drops): every
    turn's prompt, and each reply's training starts right at its prompt's end. Else (a template every stage renders
    with, its markers as the user wrote them) every turn's prompt too: a reply opening with whitespace can merge with
    the prompt's last token (a newline after ChatML's header, on GPT-2's BPE), and so can a prompt ending in
    whitespace with the reply's first word (Llama-3's "\n\n" is one token at a text's end, two before a word, on
    GPT-2's pre-tokenizer). A conversation's opening assistant turn has no prompt (no later stage samples there): its
    trained run is not compared."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i]
    ends = []
    for turn in turns:
        prompt = _apply(tokenizer, messages[:turn], chat_template=stock, tokenize=False, add_generation_prompt=True)
        alone = tokenizer(_bos_stripped(tokenizer, prompt))["input_ids"]
        if ids[:len(alone)] != alone:
            return False
        ends.append(len(alone))
    if not exact:
        return True
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    return starts[1:] == ends if messages[:1] and messages[0]["role"] == "assistant" else starts == ends


def sft_every_token(tokenizer, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    """A conversation SFT trains on whole (`completion_only_loss: false`): its rendering encoded as every other stage
    encodes text (`tokenizer(text)`, BOS as the tokenizer adds it; TRL's own tokenising of `messages` adds none),
    every token trained."""
    ids = tokenizer(_bos_stripped(tokenizer, _apply(tokenizer, messages, tokenize=False)))["input_ids"]
    return {"input_ids": ids, "assistant_masks": [1] * len(ids)}


def _generation_prompt(tokenizer, text: str) -> str:
    """What the template's generation prompt adds after a user turn (e.g. '<|im_start|>assistant\\n')."""
    turn = [{"role": "user", "content": "PING"}]
    with_prompt = _apply(tokenizer, turn, chat_template=text, tokenize=False, add_generation_prompt=True)
    without = _apply(tokenizer, turn, chat_template=text, tokenize=False)
    return with_prompt[len(without):] if with_prompt.startswith(without) else ""


def _reply_only(tokenizer, ids: list[int], mask: list[int], generation_prompt: str) -> list[int]:
    """A marker mask cut to what the other stages call a reply (the text after the generation prompt, up to and
    including the end-of-turn token, EOS): in each marked run, leading tokens that end `generation_prompt` (PPO's
    prompt already holds them; '' cuts none) and tokens after the end-of-turn token are left untrained."""
    mask = list(mask)
    eos = tokenizer.eos_token_id
    i = 0
    while i < len(ids):
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < len(ids) and mask[j]:
            j += 1
        lead = 0  # the most leading tokens whose text ends the generation prompt ('<think>\n' is '<', 'think', '>\n')
        for k in range(1, j - i + 1):
            piece = tokenizer.decode(ids[i:i + k])
            if len(piece) > len(generation_prompt):
                break
            if piece and generation_prompt.endswith(piece):
                lead = k
        end = next((k + 1 for k in range(i, j) if ids[k] == eos), j)
        for k in range(i, j):
            mask[k] = int(i + lead <= k < end)
        i = j
    return mask


def trained_text(tokenizer, example: dict[str, list[int]]) -> list[str]:
    """The trained spans of an SFT example as text, one per run of trained tokens (`align validate` prints
    them)."""
    spans, run = [], []
    for token, bit in zip(example["input_ids"], example["assistant_masks"]):
        if bit:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    if run:
        spans.append(tokenizer.decode(run))
    return spans


MAX_SAME_AFTER_TEMPLATE = 0.01
"""The largest fraction of pairs whose replies render identically through the chat template that a stage drops
(and counts in its manifest) instead of refusing the data."""


def same_after_template(rows: list[dict[str, Any]]) -> list[int]:
    """Positions of the (rendered) preference pairs whose chosen and rejected are the same text as the model reads
    them: the chat template trimmed or rewrote what the data card compared, so they teach nothing."""
    if not rows or "chosen" not in rows[0]:
        return []
    return [i for i, r in enumerate(rows) if r["chosen"] == r["rejected"]]


def same_after_template_problem(rows: list[dict[str, Any]], where: str) -> str | None:
    """The refusal when more than MAX_SAME_AFTER_TEMPLATE of the pairs render identically (None: few enough to drop
    and count). Pairs are shown by their prompts: a split's positions are not the file's rows."""
    same = same_after_template(rows)
    if len(same) <= MAX_SAME_AFTER_TEMPLATE * len(rows):
        return None
    def tail(prompt: Any) -> str:  # the prompt's last line with text: what a user can search the data for
        lines = [line for line in str(prompt).splitlines() if line.strip()]
        return repr(lines[-1][-80:] if lines else "")

    more = f" and {len(same) - 3} more" if len(same) > 3 else ""
    return (f"{where}: {len(same)} of {len(rows)} pairs have chosen and rejected replies that render identically "
            f"through the chat template (it trims or rewrites what differs), so they teach nothing: the pairs of the "
            f"prompts {', '.join(tail(rows[i]['prompt']) for i in same[:3])}{more}. Remove them from the data, or fix "
            "the template")
