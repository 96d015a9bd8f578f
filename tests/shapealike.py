"""Tiny stand-ins for what the shipped 8B pipelines load from the hub, so the suite runs those very pipeline files.

- Models: randomly initialised models of the same family and configuration class as Llama-3.1-8B-Instruct and
  Qwen2.5-7B-Instruct, shrunk (2 layers, width 64) but keeping what align's code paths depend on: grouped-query
  attention (2 key/value heads for 4 query heads), an untied output head, the family's rope settings (Llama 3.1's
  `llama3` rope scaling with rope_theta 500000; Qwen2.5's rope_theta 1e6) and its tokenizer conventions:

  | model | tokenizer (trained here) | BOS added | EOS | pad | chat template |
  |---|---|---|---|---|---|
  | llama3.1 | byte-level BPE, Llama 3's special tokens | <|begin_of_text|> (by the template) | <|eot_id|> | none | Meta's, verbatim |
  | qwen2.5 | byte-level BPE, ChatML special tokens | no | <|im_end|> | <|endoftext|> | Qwen's, verbatim |

  The templates are the stock ones (tests/chat_templates/, sources in SOURCE.md), so the pipelines' `chat_template:
  null` meets what a user of the real model meets (Llama 3.1's system header with its knowledge-date lines; Qwen's
  default system prompt).
- Data: the hub datasets the 8B pipelines' cards name, as local copies in the hub's layout and schemas under one
  mirror directory (`ALIGN_HUB_MIRROR`, align/data/cards.py): HuggingFaceH4/ultrafeedback_binarized (parquet
  files per split with the dataset card's `configs:` naming them; columns prompt, prompt_id, chosen, rejected,
  messages, score_chosen, score_rejected; chosen / rejected whole user + assistant conversations) and
  Anthropic/hh-rlhf (harmless-base/{train,test}.jsonl.gz of {chosen, rejected} transcripts). Texts come from the
  vendored HH-RLHF sample (data_cards/data/hh_rlhf_harmless/, MIT).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache
from pathlib import Path

from conftest import REPO

SEED = 17
TEMPLATES = REPO / "tests" / "chat_templates"
HH_SAMPLE = REPO / "data_cards" / "data" / "hh_rlhf_harmless" / "harmless_base_sample_200.jsonl.gz"


# --------------------------------------------------------------------------------------------- data
@lru_cache(maxsize=None)
def hh_pairs() -> tuple[dict[str, str], ...]:
    """The vendored HH-RLHF harmless-base pairs (200 whole transcripts, chosen and rejected)."""
    with gzip.open(HH_SAMPLE, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def _turns(transcript: str) -> list[tuple[str, str]]:
    from align.data.transforms import parse_hh_turns

    return parse_hh_turns(transcript)


def ultrafeedback_rows() -> list[dict]:
    """Rows in HuggingFaceH4/ultrafeedback_binarized's schema: single-turn conversations (its prompts are single
    turns) built from each HH pair's first user turn and the two final replies; the scores make chosen the better."""
    rows = []
    for pair in hh_pairs():
        chosen, rejected = _turns(pair["chosen"]), _turns(pair["rejected"])
        user = chosen[0][1]
        if not user or chosen[-1][1].strip() == rejected[-1][1].strip() or not chosen[-1][1] or not rejected[-1][1]:
            continue
        conv = lambda reply: [{"content": user, "role": "user"}, {"content": reply, "role": "assistant"}]  # noqa: E731, B023
        rows.append({"prompt": user, "prompt_id": hashlib.sha256(user.encode()).hexdigest(),
                     "chosen": conv(chosen[-1][1]), "rejected": conv(rejected[-1][1]), "messages": conv(chosen[-1][1]),
                     "score_chosen": 8.0, "score_rejected": 4.5})
    return rows


UF_SPLITS = ("train_prefs", "train_sft", "test_prefs", "test_sft", "train_gen", "test_gen")


def hub_mirror(root: Path) -> Path:
    """A directory holding local copies of both hub datasets in their published layout; returns it (what
    ALIGN_HUB_MIRROR names)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ultrafeedback_rows()
    cut = int(len(rows) * 0.8)
    by_split = {"train_prefs": rows[:cut], "train_sft": rows[:cut], "train_gen": rows[:cut],
                "test_prefs": rows[cut:], "test_sft": rows[cut:], "test_gen": rows[cut:]}
    uf = root / "HuggingFaceH4" / "ultrafeedback_binarized"
    (uf / "data").mkdir(parents=True, exist_ok=True)
    for split, part in by_split.items():
        pq.write_table(pa.Table.from_pylist(part), uf / "data" / f"{split}-00000-of-00001.parquet")
    (uf / "README.md").write_text("---\nlicense: mit\nconfigs:\n- config_name: default\n  data_files:\n" + "".join(
        f"  - split: {s}\n    path: data/{s}-*\n" for s in UF_SPLITS) + "---\n# UltraFeedback binarized (fixture)\n")
    hh = root / "Anthropic" / "hh-rlhf" / "harmless-base"
    hh.mkdir(parents=True, exist_ok=True)
    pairs = hh_pairs()
    for split, part in (("train", pairs[:160]), ("test", pairs[160:])):
        with gzip.open(hh / f"{split}.jsonl.gz", "wt", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"chosen": p["chosen"], "rejected": p["rejected"]}) + "\n" for p in part)
    return root


# --------------------------------------------------------------------------------------------- models
def _corpus() -> list[str]:
    return [text for p in hh_pairs() for _, text in _turns(p["chosen"])]


def _bpe(specials: list[str], vocab_size: int = 640, **tokens: str):
    """A byte-level BPE tokenizer trained on the HH sample, its special tokens after the learned vocabulary (as
    Llama 3's and Qwen's are: ids above the BPE merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build(kind: str, out: Path, seed: int = SEED) -> Path:
    """A tiny `kind` (llama3.1 | qwen2.5) chat model with its tokenizer, saved to `out` like a hub repository."""
    import torch
    import transformers as t

    if kind == "llama3.1":
        # Llama 3's tokenizer_config: BOS <|begin_of_text|> (the chat template writes it), EOS <|eot_id|> in the
        # Instruct repo, no pad token; the template is Meta's own.
        tok = _bpe(LLAMA3_SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        tok.chat_template = (TEMPLATES / "llama3_1.jinja").read_text(encoding="utf-8")
        ids = {"bos_token_id": tok.convert_tokens_to_ids("<|begin_of_text|>"),
               "eos_token_id": [tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]}
        config = t.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=131072,
                               rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 8192},
                               rms_norm_eps=1e-5, tie_word_embeddings=False, **ids)
    elif kind == "qwen2.5":
        # Qwen2.5-Instruct: no BOS, EOS <|im_end|>, pad <|endoftext|> (not EOS); untied head at 7B.
        tok = _bpe(QWEN_SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.chat_template = (TEMPLATES / "qwen2_5.jinja").read_text(encoding="utf-8")
        config = t.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                               rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               use_sliding_window=False, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                               eos_token_id=tok.eos_token_id)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = t.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
