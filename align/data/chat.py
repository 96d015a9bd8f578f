"""Conversational rows, and the text every stage after SFT sees of them.

A conversational row holds messages (lists of `{role, content}`), as TRL's conversational formats do:
`prompt` is the conversation so far (ending with a user turn); `chosen` / `rejected` / `completion` are lists of
one assistant message. SFT trains on `messages` through TRL (the chat template applied by the trainer, loss on
assistant turns only). Reward, DPO, PPO, preferences and evaluate work on text rendered once, here, with the
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

from typing import Any

from align.data.formats import FormatError, check_conversation


def _adds_bos(tokenizer) -> bool:
    """Whether encoding text prepends the BOS token by itself (Llama-style tokenizers do)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return bos is not None and len(ids) > 1 and ids[0] == bos


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt turns rendered with the generation prompt, as text that encodes (`tokenizer(text)`, the way
    align and TRL encode text) to the template's own token ids: a BOS the template writes is left to the
    tokenizer when it adds one itself."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and _adds_bos(tokenizer):
        text = text[len(bos):]
    return text


def render_reply(tokenizer, messages: list[dict[str, str]], reply: list[dict[str, str]], prompt_text: str) -> str:
    """What the template writes for the assistant reply between the generation prompt and the end-of-turn
    token (EOS). A template that renders the prompt differently once a reply follows is refused: the policy
    would be sampled from a context it was never trained on."""
    full = tokenizer.apply_chat_template(messages + reply, tokenize=False)
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
        new = dict(row, prompt=render_prompt(tokenizer, prompt))
        for col in ("chosen", "rejected", "completion"):
            if col in row:
                check_conversation(row[col], f"row {i}: {col}", last_role="assistant")
                new[col] = render_reply(tokenizer, prompt, row[col], new["prompt"])
        out.append(new)
    return out
