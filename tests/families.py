"""Tiny randomly initialised models of real families, each with its family's tokenizer conventions.

Each model is built from the family's own transformers config class, shrunk (2 layers, width 32), and saved
with a tokenizer to a local directory that a pipeline's `base_model:` can name. What is kept from the real
families is what align's code paths depend on:

| family   | config             | tokenizer (here)                  | BOS added | pad token      | embeddings |
|----------|--------------------|-----------------------------------|-----------|----------------|------------|
| llama    | LlamaConfig        | SentencePiece tokenizer.model     | <s>       | none (= EOS)   | untied     |
| mistral  | MistralConfig      | the same + tokenizer.json (hub)   | <s>       | none (= EOS)   | untied     |
| qwen2    | Qwen2Config        | byte-level BPE, ChatML specials   | no        | <|endoftext|>  | tied       |
|          |                    | (EOS <|im_end|>, as Instruct)     |           | (not EOS)      |            |
| gemma3   | Gemma3TextConfig   | BPE, <bos>/<eos>/<pad>            | <bos>     | <pad>, id 0    | tied       |
| gpt2     | GPT2Config         | byte-level BPE, <|endoftext|> last| no        | none (= EOS)   | tied       |
| gpt_neox | GPTNeoXConfig      | byte-level BPE, <|endoftext|>     | no        | none (= EOS)   | untied     |
| opt      | OPTConfig          | BPE, </s> is BOS and EOS          | </s>      | <pad>, id 1    | tied       |

No network: tokenizers are trained here (seeded, deterministic). The real GPT-2 tokenizer (tokenizers/gpt2/,
50,257 tokens) is run end to end by pipelines/hh_rlhf_tiny.yaml; a 512-token one keeps this matrix fast.
"""

from __future__ import annotations

import io
from functools import lru_cache, partial
import json
from pathlib import Path

from conftest import REPO

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "gpt2", "gpt_neox", "opt"]
POSITIONS = 128
SEED = 17


@lru_cache(maxsize=None)
def corpus(n: int = 3000) -> tuple[str, ...]:
    """Movie-review sentences (the default pipeline's corpus) to train tokenizers on (read once per process)."""
    from align.data.cards import load_card, load_split

    rows = load_split(load_card(REPO / "data_cards" / "movie_review_snippets.yaml"), "train").rows
    return tuple(r["prompt"] + r["completion"] for r in rows[:n])


def sentencepiece_tokenizer(out: Path, vocab_size: int = 512, seed: int = SEED) -> Path:
    """A Llama-2-style tokenizer directory holding only a SentencePiece `tokenizer.model` (BPE with byte
    fallback, <unk>=0 <s>=1 </s>=2, no pad) and the tokenizer_config.json that names its class."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
                                   character_coverage=1.0, num_threads=1, minloglevel=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "model_max_length": POSITIONS}))
    return out


def _bpe(specials: list[str], bos: str | None = None, last: list[str] = (), vocab_size: int = 512, **tokens: str):
    """A byte-level BPE tokenizer trained on the corpus, with `specials` first (ids 0, 1, ...) and `last` after
    the learned vocabulary (GPT-2's <|endoftext|> is its last id); when `bos` is given, a post-processor puts it
    in front of every sequence (as OPT's and Gemma's tokenizers do)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True) for t in last])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=POSITIONS, **tokens)


def tokenizer(family: str, out: Path):
    """The family's tokenizer, saved to `out` (and returned, loaded back as a user would)."""
    from transformers import AutoTokenizer

    if family == "llama":
        sentencepiece_tokenizer(out)
    elif family == "mistral":  # the hub's Mistral repos ship tokenizer.json beside tokenizer.model; without it,
        # transformers 5 reads a mistral model's tokenizer.model with a generic converter (no "▁" prefix space)
        AutoTokenizer.from_pretrained(sentencepiece_tokenizer(out)).save_pretrained(out)
    elif family == "qwen2":
        _bpe([], last=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>",
             pad_token="<|endoftext|>").save_pretrained(out)
    elif family == "gemma3":
        _bpe(["<pad>", "<eos>", "<bos>", "<unk>"], "<bos>", pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
             unk_token="<unk>").save_pretrained(out)
    elif family == "gpt2":
        _bpe([], last=["<|endoftext|>"], bos_token="<|endoftext|>", eos_token="<|endoftext|>",
             unk_token="<|endoftext|>").save_pretrained(out)
    elif family == "gpt_neox":  # Pythia: <|padding|> is in the vocabulary, but the tokenizer names no pad token
        _bpe(["<|endoftext|>", "<|padding|>"], bos_token="<|endoftext|>", eos_token="<|endoftext|>",
             unk_token="<|endoftext|>").save_pretrained(out)
    elif family == "opt":
        _bpe(["<s>", "<pad>", "</s>", "<unk>"], "</s>", bos_token="</s>", eos_token="</s>", pad_token="<pad>",
             unk_token="<unk>").save_pretrained(out)
    else:
        raise ValueError(family)
    return AutoTokenizer.from_pretrained(out)


def config(family: str, tok):
    """The family's transformers config, shrunk: 2 layers, width 32, 128 positions; token ids from `tok`."""
    import transformers as t

    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    vocab = len(tok)
    decoder = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=POSITIONS, **ids)
    if family == "llama":
        return t.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **decoder)
    if family == "mistral":
        return t.MistralConfig(num_key_value_heads=2, sliding_window=24, tie_word_embeddings=False, **decoder)
    if family == "qwen2":
        return t.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **decoder)
    if family == "gemma3":
        return t.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=24,
                                  layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                                  **decoder)
    if family == "gpt2":
        return t.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=POSITIONS, **ids)
    if family == "gpt_neox":
        return t.GPTNeoXConfig(rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False, **decoder)
    if family == "opt":
        return t.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                           word_embed_proj_dim=32, max_position_embeddings=POSITIONS, **ids)
    raise ValueError(family)


def build(family: str, root: Path, seed: int = SEED) -> tuple[Path, Path]:
    """A randomly initialised causal LM of `family` and its tokenizer, saved under `root`: (base_model dir,
    tokenizer dir). Llama's tokenizer is a directory of its own holding only tokenizer.model (what a
    pipeline's `tokenizer:` names); the other families keep theirs beside the weights, as hub repos do."""
    import torch
    from transformers import AutoModelForCausalLM

    base = root / "base"
    tok_dir = root / "sentencepiece" if family == "llama" else base
    tok = tokenizer(family, tok_dir)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config(family, tok)).save_pretrained(base)
    return base, tok_dir


PAIRS = 24  # preference pairs for reward and DPO: 18 train, 6 held out


def pairs_card(root: Path) -> Path:
    """A small preference card (made-up review openings that occur in no movie-review split, so evaluation
    prompts never overlap them): chosen responses praise, rejected ones pan."""
    good = [" was a joy to watch.", " is warm and funny.", " shines from start to end."]
    bad = [" was a waste of time.", " is dull and long.", " falls flat."]
    rows = [{"prompt": f"Review {i}: the film", "chosen": good[i % 3], "rejected": bad[(i + 1) % 3]}
            for i in range(PAIRS)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    card = root / "pairs.yaml"
    card.write_text("name: family_pairs\nlicense: MIT\nsource: {path: pairs.jsonl}\nformat: jsonl\n"
                    "produces: preference\nsplits: {train: 0.75, test: 0.25, seed: 17}\n")
    return card


def pipeline(root: Path, family: str, base: Path, tok_dir: Path) -> Path:
    """sft -> reward -> ppo -> dpo -> evaluate on `base`, each a few steps on short sequences."""
    reviews = REPO / "data_cards" / "movie_review_snippets.yaml"
    pairs = pairs_card(root)
    text = f"""\
name: family_{family}
base_model: {base}
tokenizer: {tok_dir if tok_dir != base else "null"}
seed: {SEED}
tracking: {{wandb: disabled}}
stages:
  sft: {{data: {reviews}, max_steps: 3, per_device_batch_size: 4, max_length: 96, max_train_examples: 32,
        max_truncated_fraction: 0.5, eval_split: null, logging_steps: 1, save_steps: 10,
        learning_rate: 3.0e-3}}
  reward: {{init: sft, data: {pairs}, max_steps: 3, per_device_batch_size: 4, max_length: 64, logging_steps: 1,
           save_steps: 10, learning_rate: 3.0e-3}}
  ppo: {{policy: sft, reward: reward, prompts: {reviews}, iterations: 2, rollout_batch_size: 4, mini_batch_size: 2,
        ppo_epochs: 1, max_prompt_length: 48, save_every: 2, learning_rate: 1.0e-3,
        generation: {{max_new_tokens: 6}}}}
  dpo: {{policy: sft, data: {pairs}, max_steps: 3, per_device_batch_size: 4, max_length: 32, logging_steps: 1,
        save_steps: 10, learning_rate: 3.0e-3}}
  evaluate: {{policies: [sft, ppo, dpo], baseline: sft, reference: sft, reward: reward, preferences: null,
             judges: [], prompts: {reviews}, split: test, max_prompts: 4, bootstrap_samples: 100,
             generation: {{max_new_tokens: 6}}}}
"""
    path = root / "pipeline.yaml"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------- checks
TEXTS = ["A fine movie", "The plot is thin, but the acting carries it all the way home", "Dull"]
RESPONSES = [" and warm.", " It never lets go of you, not once", "!"]


def _rollout(tok, prompts: list[str], responses: list[str]):
    """The PPO layout: prompts left-padded (with the family's BOS), responses + EOS right-padded with pad."""
    import torch

    from align.modeling.generation import Rollout, tokenize_prompts

    q_ids, q_mask = tokenize_prompts(tok, prompts)
    resp = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in responses]
    width = max(map(len, resp))
    r_ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in resp])
    r_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in resp])
    return Rollout(q_ids, q_mask, r_ids, r_mask, eos_found=torch.ones(len(resp), dtype=torch.bool))


def ppo_loss_and_grads(model, r, temperature: float = 0.7):
    """PPO's training forward of `model` (a PolicyAndValue: response log-probs, entropies, per-token values) over the
    rollout `r` and a loss over every output (masked, as PPO's): [loss, log-probs, entropies, values] (padding zeroed)
    and the gradients by parameter name."""
    from align.modeling.losses import masked_mean

    model.zero_grad()
    logprobs, entropy, values = model(r.input_ids, r.attention_mask, r.query_ids.size(1), temperature=temperature)
    rmask = r.response_mask
    loss = -masked_mean(logprobs, rmask) + masked_mean(values ** 2, rmask) - 0.1 * masked_mean(entropy, rmask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [loss.detach(), logprobs.detach() * rmask, entropy.detach() * rmask, values.detach() * rmask], grads


def _unpadded(r, i: int):
    """Row i of a rollout without its padding: (1, T) ids and the length of its prompt part."""
    q = r.query_ids[i][r.query_mask[i].bool()]
    resp = r.response_ids[i][r.response_mask[i].bool()]
    import torch

    return torch.cat([q, resp])[None], len(q)


def check_reward_padding_invariance(model_dir: Path, tok_dir: Path, tol: float = 1e-4) -> dict[str, list[float]]:
    """Score the same sequences with the family's reward model (AutoModelForSequenceClassification) through the
    one reward-model rule (align/judges/pointwise.py `RewardModelJudge`) on each of its inputs: text (prompt + response
    + EOS, as TRL's RewardTrainer tokenises it), a PPO rollout (left-padded prompts, right-padded responses), TRL's
    completions (prompt ids + completion ids), whatever the tokenizer's padding side; compare each with the sequence
    scored alone, unpadded, by the model's own forward. Returns the scores."""
    import torch

    from align.modeling.generation import scalar_outputs
    from align.modeling.models import load_scalar_model, load_tokenizer
    from align.judges.pointwise import RewardModelJudge, build_judge

    tok = load_tokenizer(str(tok_dir))
    model = load_scalar_model(str(model_dir), tok.pad_token_id).eval()
    judge = RewardModelJudge("rm", partial(scalar_outputs, model), tok, batch_size=2)  # batches of unequal lengths
    texts = [p + r for p, r in zip(TEXTS, RESPONSES)]
    with torch.no_grad():
        alone = [model(**tok(t + tok.eos_token, return_tensors="pt")).logits[0, 0].item() for t in texts]
        out = {}
        for side in ("left", "right"):  # the tokenizer's padding side must not matter
            tok.padding_side = side
            out[f"text/{side}"] = judge(TEXTS, RESPONSES)
        r = _rollout(tok, TEXTS, RESPONSES)
        ids_alone = [model(input_ids=_unpadded(r, i)[0]).logits[0, 0].item() for i in range(len(TEXTS))]
        out["rollout"] = build_judge("rm", lambda n: judge).score_rollout(r, TEXTS, tok).tolist()
        completions = [r.response_ids[i][r.response_mask[i].bool()].tolist() for i in range(len(TEXTS))]
        out["completions"] = judge.score_completions(TEXTS, completions)
        without_eos = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    for key, scores in out.items():
        ref = alone if key.startswith("text") else ids_alone  # text-level / token-level inputs
        assert max(abs(a - b) for a, b in zip(scores, ref)) < tol, (key, scores, ref)
    # Where the pad token is EOS (Llama-2, Mistral, GPT-2), the classifier's rule (rightmost token that
    # is not pad) skips the final EOS, in training and in scoring alike; with a pad token of its own, the score
    # is read at the EOS itself.
    reads_eos = max(abs(a - b) for a, b in zip(alone, without_eos)) > tol
    assert reads_eos == (tok.pad_token_id != tok.eos_token_id), (alone, without_eos)
    return {"alone": alone, "ids_alone": ids_alone, **out}


def check_policy_padding_invariance(model_dir: Path, tok_dir: Path, tol: float = 1e-4) -> None:
    """Sampling, response log-probs and per-token values (PPO's steps 1, 3 and 5) of left-padded prompts equal
    those of each sequence alone: positions come from the attention mask, whatever the family's position scheme
    (rotary: shift-invariant anyway; GPT-2's learned absolute positions: not)."""
    import torch

    from align.modeling.generation import scalar_outputs, sequence_logprobs
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    policy = load_causal_lm(str(model_dir)).eval()
    value = load_scalar_model(str(model_dir), tok.pad_token_id).eval()
    r = _rollout(tok, TEXTS, RESPONSES)
    q = r.query_ids.size(1)
    with torch.no_grad():
        lp = sequence_logprobs(policy, r.input_ids, r.attention_mask, q)
        values = scalar_outputs(value, r.input_ids, r.attention_mask)[:, q - 1:-1]
        for i in range(len(TEXTS)):
            ids, qi = _unpadded(r, i)
            n = int(r.response_mask[i].sum())
            lp_alone = sequence_logprobs(policy, ids, torch.ones_like(ids), qi)[0]
            v_alone = scalar_outputs(value, ids, torch.ones_like(ids))[0, qi - 1:-1]
            assert torch.allclose(lp[i, :n], lp_alone, atol=tol), (i, lp[i, :n], lp_alone)
            assert torch.allclose(values[i, :n], v_alone, atol=tol), (i, values[i, :n], v_alone)
        # step 1: generation from left-padded prompts (as align.modeling.generation.generate calls it) sees each prompt
        # as it would alone: the same next-token logits at every step
        greedy = dict(do_sample=False, max_new_tokens=4, output_scores=True, return_dict_in_generate=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=None)
        batch = policy.generate(input_ids=r.query_ids, attention_mask=r.query_mask, **greedy).scores
        for i in range(len(TEXTS)):
            q = r.query_ids[i][r.query_mask[i].bool()][None]
            alone = policy.generate(input_ids=q, attention_mask=torch.ones_like(q), **greedy).scores
            assert all(torch.allclose(b[i], a[0], atol=tol) for b, a in zip(batch, alone)), i


STAGES = ["sft", "reward", "ppo", "dpo", "evaluate"]
MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3": "gemma3_text", "gpt2": "gpt2",
              "gpt_neox": "gpt_neox", "opt": "opt"}


class Runs:
    """Each family's base model and pipeline run, built once per test module whatever the test order."""

    def __init__(self, root: Path):
        self.root, self.built, self.done = root, {}, {}

    def base(self, family: str) -> tuple[Path, Path]:
        if family not in self.built:
            (self.root / family).mkdir(parents=True, exist_ok=True)
            self.built[family] = build(family, self.root / family)
        return self.built[family]

    def run(self, family: str) -> dict:
        if family not in self.done:
            import subprocess
            import sys
            import time

            base, tok_dir = self.base(family)
            path = pipeline(self.root / family, family, base, tok_dir)
            t0 = time.time()
            proc = subprocess.run([sys.executable, "-m", "align.cli", "run", str(path), "--run-id", "r"],
                                  cwd=self.root / family, capture_output=True, text=True, timeout=600)
            print(f"{family}: align run took {time.time() - t0:.1f}s")
            self.done[family] = {"proc": proc, "run": self.root / family / "runs" / f"family_{family}" / "r",
                                 "base": base, "tokenizer": tok_dir}
        return self.done[family]


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_run(family: str, r: dict) -> None:
    """Every stage completed; every model/ reloads with the Auto classes as the family's own class, with the
    tokenizer conventions of its family kept, and its weights moved from where the stage started."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from align.modeling.models import load_tokenizer

    proc, run = r["proc"], r["run"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in STAGES:
        manifest = json.loads((run / stage / "manifest.json").read_text())
        assert manifest["status"] == "completed", (stage, manifest.get("error"))
    report = json.loads((run / "report" / "metrics.json").read_text())
    assert all(f"eval/{p}/reward_model/mean" in report for p in ("sft", "ppo", "dpo")), sorted(report)

    start = AutoTokenizer.from_pretrained(r["tokenizer"])
    sample = "A fine movie"
    models = {"base": AutoModelForCausalLM.from_pretrained(r["base"])}
    for stage in ("sft", "ppo", "dpo", "reward"):
        d = run / stage / "model"
        auto = AutoModelForSequenceClassification if stage == "reward" else AutoModelForCausalLM
        models[stage] = model = auto.from_pretrained(d)
        assert model.config.model_type == MODEL_TYPE[family], (stage, model.config.model_type)
        tok = AutoTokenizer.from_pretrained(d)
        # the family's conventions survive the stage: same ids (BOS added or not), same EOS, a pad token
        assert tok(sample)["input_ids"] == start(sample)["input_ids"], stage
        # a pad token: the family's own, else one its vocabulary holds for padding (Pythia's <|padding|>), else EOS
        assert tok.eos_token == start.eos_token and tok.pad_token == load_tokenizer(r["tokenizer"]).pad_token, stage
        if stage == "reward":
            assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
        elif model.config.tie_word_embeddings:  # tied families (Gemma, Qwen2, GPT-2, OPT) stay tied
            assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight), stage
    states = {k: _state(m) for k, m in models.items()}
    for stage, start_stage in (("sft", "base"), ("ppo", "sft"), ("dpo", "sft"), ("reward", "sft")):
        after, before = states[stage], states[start_stage]
        shared = [k for k in after if k in before and after[k].shape == before[k].shape]
        assert len(shared) >= len(after) - 1, (stage, set(after) - set(before))  # the reward head is new
        backbone = models[stage].base_model_prefix + "."  # the transformer, not only a head
        moved = [k for k in shared if k.startswith(backbone) and not torch.equal(after[k], before[k])]
        assert moved, f"{stage}: no parameter of the transformer moved from {start_stage}"
