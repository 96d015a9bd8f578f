"""Chat models end to end: the shipped templates (align/templates/), SFT's assistant-only loss mask, PPO responses
cut at the end-of-turn token, one rendering of a conversation for reward training, PPO and evaluation, and
pipelines/chat.yaml run through every stage."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from align import templates
from align.data.chat import as_text, has_generation_markers, render_prompt
from align.core.schema import ConfigError
from conftest import REPO, run_align

SEED = 1234
CORPUS = ["How do I bake bread at home?", "Mix flour, water, salt and yeast, then let it rise.",
          "What temperature should the oven be?", "Bake it hot, around two hundred and thirty degrees."] * 20
CHAT = [{"role": "user", "content": "How do I bake bread at home?"},
        {"role": "assistant", "content": "Mix flour, water, salt and yeast."},
        {"role": "user", "content": "What temperature should the oven be?"},
        {"role": "assistant", "content": "Around two hundred and thirty degrees."}]
EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "default": "<|endoftext|>"}
LEAD = {"default": " "}  # align's default template writes "assistant: reply": the space belongs to the reply


def chat_tokenizer(name: str):
    """A BPE tokenizer trained as the builtin model's is, with a shipped template installed (`default`: the
    tokenizer's own, align's role-tagged template, as with `chat_template: null`)."""
    from align.modeling.models import train_tokenizer

    planned = shipped(name)
    tok = train_tokenizer(CORPUS, 400, 256, planned.special_tokens)
    templates.install(tok, planned)
    return tok


def shipped(name: str) -> templates.ChatTemplate:
    return templates.resolve(name, REPO / "pipelines" / "chat.yaml", None)


def tiny_model(tok, scalar: bool = False):
    from transformers import LlamaForSequenceClassification

    from align.modeling.models import llama_config
    from align.config import BuiltinModel
    from align.modeling.models import build_builtin

    size = BuiltinModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=256)
    if not scalar:
        return build_builtin(size, tok, seed=SEED).eval()
    torch.manual_seed(SEED)
    cfg = llama_config(size, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    cfg.num_labels = 1
    return LlamaForSequenceClassification(cfg).eval()


def test_shipped_templates_write_their_formats_and_eot_becomes_eos():
    """The formats written out by hand: Llama-3 headers and <|eot_id|>; ChatML's <|im_start|> ... <|im_end|>\\n."""
    expected = {
        "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "chatml": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
                  "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n",
    }
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    for name, text in expected.items():
        tok = chat_tokenizer(name)
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
        assert tok.eos_token == EOT[name]
        for special in shipped(name).special_tokens:  # one id each, not pieces
            assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
        assert has_generation_markers(tok.chat_template)


def test_installing_a_template_on_a_tokenizer_adds_its_tokens_and_the_model_grows_to_match():
    """The vendored GPT-2 tokenizer lacks ChatML's tokens: they are added as special tokens, EOS becomes
    <|im_end|>, and the model's embeddings and token ids follow (align/modeling/models.py fit_model_to_tokenizer)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from align.modeling.models import fit_model_to_tokenizer, prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    before = len(tok)
    added = templates.install(tok, shipped("chatml"))
    assert added == ["<|im_start|>", "<|im_end|>"] and len(tok) == before + 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"  # the old EOS stays the pad
    assert templates.prompt_boundary_problem(tok) is None  # ChatML's generation prompt ends in one newline
    torch.manual_seed(SEED)
    model = fit_model_to_tokenizer(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=before)), tok)
    assert model.get_input_embeddings().weight.shape[0] == before + 2
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")


def test_llama3_on_gpt2s_pre_tokenizer_is_flagged():
    """GPT-2's pre-tokenizer keeps a final "\n\n" as one token but splits it before a word: the Llama-3 generation
    prompt tokenises differently alone (PPO, evaluation) than with a reply (SFT). install() says so."""
    from transformers import AutoTokenizer

    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    templates.install(tok, shipped("llama3"))
    problem = templates.prompt_boundary_problem(tok)
    assert problem is not None and "['ĊĊ'] become ['Ċ', 'Ċ']" in problem and "chatml" in problem


def test_llama3_on_gpt2s_pre_tokenizer_trains_the_first_reply_after_the_prompt_later_stages_sample_after():
    """The marker mask was kept unless a reply opened with whitespace: under Llama-3's template on GPT-2's BPE, SFT
    trained "Hello" after "Ċ Ċ" while PPO and evaluation prompt with "ĊĊ". Every turn's prompt is compared now, and
    such a conversation is tokenised by prefixes: its prompt tokens are the later stages' own."""
    from transformers import AutoTokenizer

    from align.data.chat import render_prompt, sft_example
    from align.modeling.models import prepare_tokenizer

    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(REPO / "tokenizers" / "gpt2"))
    planned = shipped("llama3")
    templates.install(tok, planned)
    for messages in (CHAT[:2], CHAT):  # (a later turn's prompt, encoded whole, splits the earlier "ĊĊ" before its
        # reply's word: no tokenisation of the conversation agrees with both; install() flags the pairing for that)
        example = sft_example(tok, planned, messages)
        prompt = tok(render_prompt(tok, messages[:1]))["input_ids"]
        assert example["input_ids"][:len(prompt)] == prompt, tok.convert_ids_to_tokens(prompt[-3:])
        assert example["assistant_masks"].index(1) == len(prompt)


def test_template_setting_errors_name_the_file_and_the_fix(tmp_path):
    source = tmp_path / "p.yaml"
    with pytest.raises(ConfigError, match="not found .*relative to the pipeline file"):
        templates.resolve("missing.jinja", source, None)
    with pytest.raises(ConfigError, match="neither a shipped template"):
        templates.resolve("chatmlx", source, None)
    (tmp_path / "broken.jinja").write_text("{% for message in messages %}{{ message['content'] }}")
    with pytest.raises(ConfigError, match="broken.jinja: not a valid Jinja template"):
        templates.resolve("broken.jinja", source, None)
    (tmp_path / "mine.jinja").write_text(shipped("chatml").text)
    mine = templates.resolve("mine.jinja", source, None)
    assert mine.source == f"file:{tmp_path / 'mine.jinja'}"
    assert mine.digest == shipped("chatml").digest  # content, not name
    # A template whose assistant turns end with plain text could never stop: refused at install.
    from align.core.errors import ModelError

    tok = chat_tokenizer("chatml")
    with pytest.raises(ModelError, match="not a special token"):
        (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
        templates.install(tok, templates.resolve("plain.jinja", source, None))


def test_validate_refuses_a_missing_template_and_warns_of_llama3_on_gpt2(workdir):
    (workdir / "tokenizers").symlink_to(REPO / "tokenizers")
    proc = run_align("validate", "pipelines/chat.yaml", "chat_template=templates/mine.jinja", cwd=workdir)
    assert proc.returncode == 2 and "chat_template: file 'templates/mine.jinja' not found" in proc.stderr
    proc = run_align("validate", "pipelines/chat.yaml", "tokenizer=../tokenizers/gpt2", "chat_template=llama3",
                     cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "warning: chat template: a prompt's last tokens ['ĊĊ']" in proc.stdout
    from align.data.cards import load_split

    pairs = len(load_split(REPO / "data_cards" / "hh_rlhf_harmless_chat_pairs.yaml", "train").rows)
    assert f"length check reward: {pairs} examples" in proc.stdout  # conversational pairs measured as rendered


@pytest.mark.parametrize("name", ["chatml", "llama3", "default"])
def test_sft_loss_mask_covers_assistant_turns_only(name, tmp_path):
    """TRL's SFTTrainer, fed as align's SFT stage feeds it for messages data (ids and assistant masks from
    align/data/chat.py `sft_example`), on a two-turn conversation: the labels it trains on are exactly each
    assistant reply's tokens followed by the end-of-turn token, and nothing of the user turns or the template's
    headers."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from align.data.chat import sft_example

    tok = chat_tokenizer(name)
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=False, completion_only_loss=False,
                     max_length=256, report_to="none", use_cpu=True, bf16=False, packing=False,
                     per_device_train_batch_size=1, activation_checkpointing=False)
    trainer = SFTTrainer(model=tiny_model(tok), args=args, processing_class=tok,
                         train_dataset=Dataset.from_list([sft_example(tok, shipped(name), CHAT)]))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    trained = ids[labels != -100].tolist()
    eot = tok.convert_tokens_to_ids(EOT[name])
    replies = [LEAD.get(name, "") + m["content"] for m in CHAT if m["role"] == "assistant"]
    expected = [t for r in replies for t in tok(r, add_special_tokens=False)["input_ids"] + [eot]]
    assert trained == expected, tok.decode(trained)
    assert tok.decode(trained) == "".join(r + EOT[name] for r in replies)
    assert (labels == -100).sum() > 0 and len(trained) < len(ids)


class ForceTokens:
    """A logits processor that makes row i emit plans[i][t] at its t-th response step."""

    def __init__(self, plans: list[list[int]], prompt_len: int):
        self.plans, self.prompt_len = plans, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        t = input_ids.size(1) - self.prompt_len
        out = torch.full_like(scores, float("-inf"))
        for row, plan in enumerate(self.plans):
            out[row, plan[min(t, len(plan) - 1)]] = 0.0
        return out


@pytest.mark.parametrize("name", ["chatml", "llama3", "default"])
def test_ppo_responses_end_at_the_end_of_turn_token(name):
    """Rollouts as PPO samples them (align.modeling.generation.generate): prompts rendered with the generation prompt;
    a model forced to emit the end-of-turn token after 2 and after 4 tokens, then more tokens. The response
    mask ends right after the end-of-turn token, generation stopped there, the reward model's score reads
    that token (garbage written after it changes nothing), and the decoded text leaves it out."""
    from transformers import LogitsProcessorList

    from align.config import Generation
    from align.modeling.generation import generate, scalar_outputs
    from align.judges.pointwise import RewardModelJudge, build_judge

    print(f"seed {SEED}")
    tok = chat_tokenizer(name)
    eot = tok.eos_token_id
    assert eot == tok.convert_tokens_to_ids(EOT[name])
    prompts = [r["prompt"] for r in as_text([{"prompt": CHAT[:1]}, {"prompt": CHAT[:3]}], tok)]
    opening = {"chatml": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
               "default": "assistant:"}
    assert all(p.endswith(opening[name]) for p in prompts)
    words = tok("bread flour water salt yeast", add_special_tokens=False)["input_ids"]
    plans = [[words[0], words[1], eot, words[2], words[3], words[4], words[0], words[1]],
             [words[2], words[3], words[4], words[0], eot, words[1], words[2], words[3]]]
    policy = tiny_model(tok)
    lq = max(len(tok(p)["input_ids"]) for p in prompts)
    generate_ = policy.generate
    policy.generate = lambda **kw: generate_(logits_processor=LogitsProcessorList([ForceTokens(plans, lq)]), **kw)
    r = generate(policy, tok, prompts, Generation(max_new_tokens=8), seed=SEED)

    assert r.query_ids.size(1) == lq
    assert r.response_mask.sum(1).tolist() == [3, 5]  # up to and including the end-of-turn token
    assert r.eos_found.tolist() == [True, True]
    for row, n in enumerate([3, 5]):
        assert r.response_ids[row, :n].tolist() == plans[row][:n]
        assert (r.response_ids[row, n:] == tok.pad_token_id).all()  # generation stopped; nothing kept after
    assert r.texts(tok) == [tok.decode(plans[0][:2]), tok.decode(plans[1][:4])]

    rm = RewardModelJudge("reward", partial(scalar_outputs, tiny_model(tok, scalar=True)), tok)
    judge = build_judge("reward", lambda n: rm)
    scores = judge.score_rollout(r, prompts, tok)
    # Write tokens after the end of turn (as a model that did not stop would): the masked tail is not scored.
    r.response_ids[:, 5:] = words[0]
    assert torch.allclose(judge.score_rollout(r, prompts, tok), scores)
    # Each score equals the score of the prompt and response up to the end-of-turn token alone, unpadded.
    for row, n in enumerate([3, 5]):
        alone = torch.tensor([tok(prompts[row])["input_ids"] + plans[row][:n]])
        single = type(r)(alone[:, :-n], torch.ones_like(alone[:, :-n]), alone[:, -n:], torch.ones_like(alone[:, -n:]),
                         torch.tensor([True]))
        assert judge.score_rollout(single, prompts[row:row + 1], tok).item() == pytest.approx(scores[row].item(),
                                                                                            abs=1e-5)


def test_a_reward_model_of_another_vocabulary_reads_the_decoded_texts_not_the_sampled_ids():
    """evaluate and preferences score sampled rollouts with a reward stage whose tokenizer is not checked against
    the sampler's (PPO, GRPO and RLOO refuse another one): its head read the sampler's ids as its own tokens. Now
    such a model reads prompt + decoded response in its own tokens, + its EOS where one was sampled; one of the same
    vocabulary still reads the sampled ids as they are."""
    from align.judges.pointwise import RewardModelJudge, build_judge
    from align.modeling.generation import Rollout, tokenize_prompts

    sampler, other = chat_tokenizer("chatml"), chat_tokenizer("llama3")
    assert sampler.get_vocab() != other.get_vocab()
    prompts = ["bread and flour?", "water"]
    q_ids, q_mask = tokenize_prompts(sampler, prompts)
    words = sampler("salt yeast bread", add_special_tokens=False)["input_ids"]
    resp = torch.tensor([words[:2] + [sampler.eos_token_id], words[1:2] + [sampler.pad_token_id] * 2])
    r = Rollout(q_ids, q_mask, resp, torch.tensor([[1, 1, 1], [1, 0, 0]]), torch.tensor([True, False]))
    seen: list = []

    def outputs(ids, mask):
        seen.append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
        return torch.zeros(ids.shape)

    texts = r.texts(sampler)  # the first ended with EOS, the second was cut: read unfinished, as the ids rule does
    for tok, want in ((other, [other(prompts[0] + texts[0] + other.eos_token)["input_ids"],
                               other(prompts[1] + texts[1])["input_ids"]]),
                      (sampler, [row[m.bool()].tolist() for row, m in zip(r.input_ids, r.attention_mask)])):
        rm = RewardModelJudge("reward", outputs, tok)
        build_judge("reward", lambda n, rm=rm: rm).score_rollout(r, prompts, sampler)
        assert seen[-1] == want


@pytest.mark.parametrize("name", ["chatml", "llama3", "default"])
def test_reward_training_ppo_and_evaluate_score_the_same_tokens(name, tmp_path):
    """One conversation, three readers: TRL's RewardTrainer (on the rows align renders), a rollout (rendered prompt
    tokenised as a query, the reply as the policy would emit it, then the end-of-turn token: what PPO, preferences
    and evaluate score) and the one reward-model rule's text input (prompt + response text + EOS, held-out pairs).
    They see the same token ids, which are the template's own rendering of the conversation up to the reply's
    end-of-turn token, and the one rule gives one score for them."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from align.modeling.generation import Rollout, tokenize_prompts
    from align.judges.pointwise import RewardModelJudge, build_judge

    tok = chat_tokenizer(name)
    pair = {"prompt": CHAT[:3], "chosen": CHAT[3:], "rejected": [{"role": "assistant", "content": "Mix it."}]}
    row = as_text([pair], tok)[0]
    assert row["prompt"] == render_prompt(tok, CHAT[:3]) and row["chosen"] == LEAD.get(name, "") + CHAT[3]["content"]
    whole = tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    eot = tok.eos_token_id
    template_ids = whole[:len(whole) - whole[::-1].index(eot)]  # up to the last end-of-turn token

    args = RewardConfig(output_dir=str(tmp_path), max_length=256, report_to="none", use_cpu=True, bf16=False,
                        activation_checkpointing=False)
    rm = tiny_model(tok, scalar=True)
    trainer = RewardTrainer(model=rm, args=args, processing_class=tok, train_dataset=Dataset.from_list([row]))
    assert trainer.train_dataset[0]["chosen_ids"] == template_ids

    q_ids, q_mask = tokenize_prompts(tok, [row["prompt"]])
    reply = tok(row["chosen"], add_special_tokens=False)["input_ids"] + [eot]
    assert q_ids[0].tolist() + reply == template_ids
    rollout = Rollout(q_ids, q_mask, torch.tensor([reply]), torch.ones(1, len(reply), dtype=torch.long),
                      torch.tensor([True]))

    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    judge = RewardModelJudge.load("reward", str(tmp_path / "rm"))
    assert judge.tokenizer.eos_token == EOT[name]  # the saved tokenizer keeps the end-of-turn EOS
    assert judge.encode([row["prompt"]], [row["chosen"]])[0] == template_ids  # the text input: the same ids
    rollout_score = build_judge("reward", lambda n: judge).score_rollout(rollout, [row["prompt"]], tok).item()
    assert judge([row["prompt"]], [row["chosen"]])[0] == pytest.approx(rollout_score, abs=1e-5)


@pytest.mark.slow
def test_chat_pipeline_runs_sft_reward_dpo_ppo_evaluate(workdir):
    """pipelines/chat.yaml, shrunk: every stage completes on conversations with the ChatML template."""
    tiny = ["builtin.hidden_size=32", "builtin.intermediate_size=64",
            "builtin.num_layers=1", "sft.max_steps=10", "sft.save_steps=10", "sft.eval_max_examples=8",
            "reward.max_steps=3", "reward.logging_steps=3", "reward.save_steps=3",
            "dpo.max_steps=3", "dpo.logging_steps=3", "dpo.save_steps=3", "dpo.per_device_batch_size=4",
            "ppo.iterations=2", "ppo.save_every=2", "ppo.reward_normalization_samples=8",
            "ppo.generation.max_new_tokens=8", "evaluate.generation.max_new_tokens=8", "evaluate.max_prompts=4"]
    proc = run_align("run", "pipelines/chat.yaml", "tracking.wandb=disabled", *tiny, cwd=workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = workdir / "runs" / "chat" / "main"
    manifests = {s: json.loads((run / s / "manifest.json").read_text()) for s in ("sft", "reward", "dpo", "ppo",
                                                                                  "evaluate")}
    assert all(m["status"] == "completed" for m in manifests.values())
    assert manifests["sft"]["loss_on"] == "assistant turns"

    from transformers import AutoTokenizer

    for stage in ("sft", "reward", "dpo", "ppo"):
        tok = AutoTokenizer.from_pretrained(run / stage / "model")
        assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template, stage
    config = json.loads((run / "ppo" / "model" / "config.json").read_text())
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    samples = [json.loads(line) for line in (run / "report" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("<|im_start|>user\n") and
                           s["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") for s in samples)
    assert all("<|im_end|>" not in s["ppo"]["response"] for s in samples)
    report = json.loads((run / "report" / "metrics.json").read_text())
    assert report["eval/prompts"] == len(samples) and "eval/ppo/reward_model/win_rate" in report


def test_sampling_ignores_the_checkpoints_own_generation_settings():
    """A checkpoint's generation_config.json (Qwen2.5 ships repetition_penalty 1.05, top_k 20, temperature 0.7) does
    not change what align samples: PPO's log-probs, KL and ratios describe the plain distribution at the stage's own
    temperature, top_k and top_p. Same weights and seed, with and without such settings: the same samples through
    align's generate, and through a GenerationConfig object as TRL's GRPO/RLOO build one (generation_kwargs)."""
    import copy

    from transformers import GenerationConfig

    from align.config import Generation
    from align.modeling.generation import generate, plain_sampling

    print(f"seed {SEED}")
    tok = chat_tokenizer("chatml")
    clean = tiny_model(tok)
    dirty = copy.deepcopy(clean)
    dirty.generation_config.update(repetition_penalty=1.8, top_k=3, min_p=0.3, no_repeat_ngram_size=1, typical_p=0.5,
                                   temperature=0.3, top_p=0.5, do_sample=True)
    prompts = [r["prompt"] for r in as_text([{"prompt": CHAT[:1]}, {"prompt": CHAT[:3]}], tok)]
    gen = Generation(max_new_tokens=12)  # temperature 1, no top-k, no top-p
    want = generate(clean, tok, prompts, gen, seed=SEED)
    got = generate(dirty, tok, prompts, gen, seed=SEED)
    assert torch.equal(got.response_ids, want.response_ids)

    enc = tok(prompts, return_tensors="pt", padding=True)
    trl_like = dict(max_new_tokens=12, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                    repetition_penalty=1.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    undo = {k: v for k, v in plain_sampling(dirty.generation_config).items() if v is not None}
    outs = []
    for model, kwargs in ((clean, {}), (dirty, {}), (dirty, undo)):
        torch.manual_seed(SEED)
        outs.append(model.generate(**enc, generation_config=GenerationConfig(**{**trl_like, **kwargs})))
    assert not torch.equal(outs[1], outs[0])  # left in, the checkpoint's settings change the samples
    assert torch.equal(outs[2], outs[0])


def test_grpo_and_rloo_hand_trl_the_neutral_settings_of_the_loaded_policys_generation_config():
    """TRL's sampling fills what it is not given from the loaded policy's generation config (a LoRA adapter's is
    its base model's: no file in the adapter's directory says so), so GRPO and RLOO read that config from the model
    itself. A setting only None undoes (TRL's GenerationConfig refills None) is named in the manifest."""
    from types import SimpleNamespace

    from align.stages.online_rl import plain_generation_kwargs

    print(f"seed {SEED}")
    notes: dict = {}
    ctx = SimpleNamespace(name="grpo", is_main=False, note=lambda **kw: notes.update(kw))
    model = tiny_model(chat_tokenizer("chatml"))
    assert plain_generation_kwargs(ctx, model) is None and notes == {}  # nothing set: nothing to undo
    model.generation_config.update(repetition_penalty=1.05, top_k=20, temperature=0.7, suppress_tokens=[5])
    assert plain_generation_kwargs(ctx, model) == {"repetition_penalty": 1.0}  # TRL passes temperature, top_k
    assert notes == {"generation_config_kept": ["suppress_tokens"]}


def test_greedy_decoding_undoes_the_checkpoints_repetition_penalty():
    """Greedy decoding (the engine comparisons) reads the checkpoint's repetition penalty too: undone, the argmax is
    the plain model's (the sampling warpers, which argmax never reads, are left out: transformers logs each one set)."""
    import copy

    from align.config import Generation
    from align.modeling.generation import generate

    print(f"seed {SEED}")
    tok = chat_tokenizer("chatml")
    clean = tiny_model(tok)
    dirty = copy.deepcopy(clean)
    dirty.generation_config.update(repetition_penalty=5.0, min_p=0.3, typical_p=0.5)
    prompts = [r["prompt"] for r in as_text([{"prompt": CHAT[:1]}, {"prompt": CHAT[:3]}], tok)]
    gen = Generation(max_new_tokens=12)
    want = generate(clean, tok, prompts, gen, seed=SEED, greedy=True)
    got = generate(dirty, tok, prompts, gen, seed=SEED, greedy=True)
    assert torch.equal(got.response_ids, want.response_ids)
