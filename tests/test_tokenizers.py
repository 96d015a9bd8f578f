"""Tokenizers users bring: SentencePiece-only directories load, and a tokenizer or model directory that cannot
be loaded is an `align validate` error (exit 2) naming the file and the fix, never "valid".

A pipeline whose `tokenizer:` holds only a SentencePiece tokenizer.model running every stage is the Llama run
of the family matrix (tests/test_families_a.py). Validation runs in-process (fast), on a tiny Llama and a
SentencePiece model trained here with a fixed seed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from align.cli import main as cli
from families import SEED, build, sentencepiece_tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, Path]:
    """(model dir without tokenizer files, tokenizer dir holding only tokenizer.model + tokenizer_config.json)"""
    print(f"sentencepiece seed {SEED}")
    return build("llama", tmp_path_factory.mktemp("llama"))


def _pipeline(root: Path, base: str, tokenizer: str | None) -> str:
    card = Path(__file__).resolve().parent.parent / "data_cards" / "movie_review_snippets.yaml"
    text = (f"name: tok\nbase_model: {base}\ntokenizer: {tokenizer or 'null'}\ntracking: {{wandb: disabled}}\n"
            f"stages:\n  sft: {{data: {card}, max_length: 128, max_train_examples: 16, max_truncated_fraction: 1.0}}\n")
    (root / "p.yaml").write_text(text)
    return str(root / "p.yaml")


def _validate(capsys, pipeline: str) -> tuple[int, str]:
    rc = cli(["validate", pipeline])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_sentencepiece_only_directory_loads_as_a_llama_tokenizer(llama):
    from align.modeling.models import load_tokenizer

    _, tok_dir = llama
    assert sorted(p.name for p in tok_dir.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    tok = load_tokenizer(str(tok_dir))
    text = "An utterly charming film, with a plot that never drags."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1 and tok.eos_token == "</s>"  # BOS added, as Llama-2's tokenizer does
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.pad_token == tok.eos_token  # none shipped: align pads with EOS and says so
    assert len(ids) < 0.6 * len(text)  # merges learned, not one piece per character


def test_sentencepiece_training_is_seeded(tmp_path, llama):
    again = sentencepiece_tokenizer(tmp_path / "again")
    assert (again / "tokenizer.model").read_bytes() == (llama[1] / "tokenizer.model").read_bytes()


def test_the_good_pipeline_validates(capsys, tmp_path, llama):
    base, tok_dir = llama
    rc, out = _validate(capsys, _pipeline(tmp_path, str(base), str(tok_dir)))
    assert rc == 0 and "valid (1 stage)" in out, out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _case_garbage_tokenizer_model(root, base, tok):
    bad = _copy(tok, root / "tok")
    (bad / "tokenizer.model").write_bytes(bytes(range(256)) * 4)
    return str(base), str(bad), ["tokenizer:", f"{bad}/tokenizer.model", "damaged", "save_pretrained"]


def _case_truncated_tokenizer_model(root, base, tok):
    bad = _copy(tok, root / "tok")
    blob = (tok / "tokenizer.model").read_bytes()
    (bad / "tokenizer.model").write_bytes(blob[: len(blob) // 3])
    return str(base), str(bad), [f"{bad}/tokenizer.model", "damaged or truncated"]


def _case_garbage_tokenizer_json(root, base, tok):
    from transformers import AutoTokenizer

    bad = root / "tok"
    AutoTokenizer.from_pretrained(tok).save_pretrained(bad)  # a fast tokenizer: tokenizer.json beside the rest
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {')
    return str(base), str(bad), [f"{bad}/tokenizer.json", "damaged", "JSONDecodeError", "save_pretrained"]


def _case_garbage_tokenizer_config(root, base, tok):
    bad = _copy(tok, root / "tok")
    (bad / "tokenizer_config.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    return str(base), str(bad), [f"{bad}/tokenizer_config.json", "damaged"]


def _case_missing_tokenizer_dir(root, base, tok):
    return str(base), str(root / "no_such_tok"), ["tokenizer:", "no_such_tok", "not found", "Fix the path"]


def _case_directory_without_tokenizer_files(root, base, tok):
    # no `tokenizer:` and the model directory has none: the fix is to point `tokenizer:` at one
    return str(base), None, ["base_model:", str(base), "holds no tokenizer files", "config.json",
                             "set `tokenizer:`"]


def _case_tokenizer_names_a_file(root, base, tok):
    return str(base), str(tok / "tokenizer.model"), ["tokenizer.model is a file", "name the directory"]


def _case_tokenizer_larger_than_the_embeddings(root, base, tok):
    small = _copy(base, root / "model")
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    return str(small), str(tok), ["has 512 tokens", "hold 300", "vocab_size"]


def _case_model_config_missing(root, base, tok):
    bad = _copy(base, root / "model")
    (bad / "config.json").unlink()
    return str(bad), str(tok), ["base_model:", str(bad), "has no config.json", "save_pretrained"]


def _case_model_config_corrupt(root, base, tok):
    bad = _copy(base, root / "model")
    (bad / "config.json").write_bytes(b"\x00\x01garbage")
    return str(bad), str(tok), ["base_model:", f"{bad}/config.json", "cannot be read as JSON"]


def _case_model_config_without_model_type(root, base, tok):
    bad = _copy(base, root / "model")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "model_type"}))
    return str(bad), str(tok), [f"{bad}/config.json", "no `model_type`", "save_pretrained"]


def _case_tiktoken_file_without_tiktoken(root, base, tok):
    if importlib.util.find_spec("tiktoken"):  # not a dependency of align: the case is its absence
        pytest.skip("tiktoken is installed here")
    bad = root / "tok"
    bad.mkdir()
    (bad / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\n")  # Llama-3's original format
    return str(base), str(bad), [f"{bad}/tokenizer.model", "tiktoken file", "pip install tiktoken"]


CASES = [_case_garbage_tokenizer_model, _case_truncated_tokenizer_model, _case_garbage_tokenizer_json,
         _case_garbage_tokenizer_config, _case_missing_tokenizer_dir, _case_directory_without_tokenizer_files,
         _case_tokenizer_names_a_file, _case_tokenizer_larger_than_the_embeddings, _case_model_config_missing,
         _case_model_config_corrupt, _case_model_config_without_model_type, _case_tiktoken_file_without_tiktoken]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__[6:])
def test_validate_refuses_what_cannot_load(case, capsys, tmp_path, llama):
    base, tokenizer, needles = case(tmp_path, *llama)
    rc, out = _validate(capsys, _pipeline(tmp_path, base, tokenizer))
    assert rc == 2, out
    assert "valid (" not in out and "Traceback" not in out, out
    for needle in needles:
        assert needle in out, (needle, out)


def test_missing_sentencepiece_package_is_named(capsys, tmp_path, llama, monkeypatch):
    import align.orchestrator.inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(align.orchestrator.inputs.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sentencepiece" else real(name, *a))
    rc, out = _validate(capsys, _pipeline(tmp_path, str(llama[0]), str(llama[1])))
    assert rc == 2 and "SentencePiece model" in out and "pip install sentencepiece" in out, out


def test_an_unreachable_hub_id_is_a_note_not_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, out = _validate(capsys, _pipeline(tmp_path, "align-tests/not-a-cached-model", None))
    assert rc == 0, out
    assert "warning: base_model 'align-tests/not-a-cached-model' is not cached here" in out
    assert "warning: tokenizer 'align-tests/not-a-cached-model' is not cached here" in out


def _templated_tokenizer(root: Path) -> tuple[Path, dict]:
    """A GPT-2 family tokenizer directory whose tokenizer_config.json carries a chat template, and that config."""
    files, _ = build("gpt2", root)
    config = json.loads((files / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    (files / "tokenizer_config.json").write_text(json.dumps(config))
    return files, config


def test_a_hub_tokenizers_own_template_fingerprints_alike_deferred_or_cached(tmp_path, monkeypatch):
    """Planned before the hub tokenizer is cached (offline), its own chat template is `deferred:` and the first
    stage reads it; planned again after (any resume), it is `tokenizer:` with its text, or align's default where
    the tokenizer ships none. Every such plan gives every stage the same fingerprint, so a resume does not rerun SFT and all after it. A
    local tokenizer's template still fingerprints by its text: editing it reruns the stage that installs it."""
    import align.templates as templates
    from align.config import load_pipeline
    from align.orchestrator.plan import build_plan

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_id = "align-tests/not-a-cached-model"
    pipeline = _pipeline(tmp_path, hub_id, None)

    def plan():
        return {p.name: p for p in build_plan(load_pipeline(pipeline), pipeline)}

    deferred = plan()
    assert deferred["sft"].chat_template.source == f"deferred:{hub_id}"
    cached, config = _templated_tokenizer(tmp_path / "hub-cache")
    monkeypatch.setattr(templates, "hub_file", lambda repo, f: str(cached / f) if (cached / f).is_file() else None)
    resolved = plan()
    assert resolved["sft"].chat_template.source == f"tokenizer:{hub_id}"
    assert {n: p.fingerprint for n, p in resolved.items()} == {n: p.fingerprint for n, p in deferred.items()}
    own = config.pop("chat_template")  # a hub tokenizer that ships none: align's default, once it is cached
    (cached / "tokenizer_config.json").write_text(json.dumps(config))
    default = plan()
    assert default["sft"].chat_template.source == "shipped:default"
    assert {n: p.fingerprint for n, p in default.items()} == {n: p.fingerprint for n, p in deferred.items()}
    config["chat_template"] = own
    (cached / "tokenizer_config.json").write_text(json.dumps(config))

    pipeline = _pipeline(tmp_path, hub_id, str(cached))  # the same files as a local tokenizer directory
    before = plan()["sft"].fingerprint
    config["chat_template"] = config["chat_template"].replace("<|", "<<|")
    (cached / "tokenizer_config.json").write_text(json.dumps(config))
    assert plan()["sft"].fingerprint != before


def test_validate_fetches_an_uncached_hub_tokenizers_small_files_so_the_plan_and_checks_read_it(tmp_path, monkeypatch):
    """With the hub reachable, validation fetches a hub tokenizer that is not cached (its small files only, never
    weights) before it plans: the chat template is read at plan time (`tokenizer:`, not `deferred:`) and the
    tokenizer is one validation loads to measure lengths, so PPO's prompt-length refusal no longer waits for SFT and
    the reward model to train. Offline (the suite), or when the hub refuses, nothing changes but a note."""
    import fnmatch

    import huggingface_hub

    import align.data.hub as hub
    from align.config import load_pipeline
    from align.orchestrator.inputs import fetch_tokenizer, tokenizer_to_check
    from align.orchestrator.plan import build_plan

    hub_id = "align-tests/uncached-chat-model"
    source = _pipeline(tmp_path, hub_id, None)
    cfg = load_pipeline(source)
    files, _ = _templated_tokenizer(tmp_path / "gpt2")
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, **kw):  # what the hub does: the HF cache's layout
        asked.append((repo_id, allow_patterns))
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        shutil.copytree(files, repo / "snapshots" / ("0" * 40),
                        ignore=lambda d, names: [n for n in names if not any(fnmatch.fnmatch(n, p) for p in allow_patterns)])
        return str(repo / "snapshots" / ("0" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    assert fetch_tokenizer(cfg, source) is None and asked == []  # offline: as before
    assert build_plan(cfg, source)[0].chat_template.source == f"deferred:{hub_id}"
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    assert fetch_tokenizer(cfg, source) is None and [a[0] for a in asked] == [hub_id]
    patterns = asked[0][1]
    assert not any(fnmatch.fnmatch(w, p) for w in ("model.safetensors", "pytorch_model.bin", "model.gguf")
                   for p in patterns)
    assert all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                     "tokenizer.model", "config.json", "merges.txt"))
    assert build_plan(cfg, source)[0].chat_template.source == f"tokenizer:{hub_id}"
    assert tokenizer_to_check(cfg, source) == hub_id
    assert fetch_tokenizer(cfg, source) is None and len(asked) == 1  # cached now: not asked again

    def refused(repo_id, **kw):
        raise OSError("401 Client Error: gated repo")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    other = _pipeline(tmp_path, "align-tests/gated-model", None)
    note = fetch_tokenizer(load_pipeline(other), other)
    assert "align-tests/gated-model" in note and "gated repo" in note and "HF_TOKEN" in note
