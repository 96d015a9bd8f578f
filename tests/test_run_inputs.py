"""The run's own inputs (a probe of the run lifecycle, 2026-11-29): command-line flags, the machine's GPUs as CUDA
reads CUDA_VISIBLE_DEVICES, a stage's process count, files of a run directory, and a stage whose runner is gone.
Each was taken wrong (an abbreviated --from kept in the printed resume command, which then restarted finished work)
or failed late; each is now refused up front naming the flag or file and the fix, or recorded as what it was."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from conftest import REPO, TINY, refused, run_align, validate

DEFAULT = str(REPO / "pipelines" / "default.yaml")


def test_abbreviated_flags_are_refused_so_the_printed_resume_command_is_what_resumes(capsys, monkeypatch):
    from align import cli

    monkeypatch.setattr(cli, "_command", lambda args: 0)  # nothing runs, whatever the parser makes of the line
    for flag in ("--fr", "--forc", "--on"):  # --from, --force, --only: the resume command drops the first two by name
        with pytest.raises(SystemExit) as exit_:
            cli.main(["run", DEFAULT, flag, "sft"])
        assert exit_.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
    for port in ("99999", "-5", "http"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["run", DEFAULT, "--master-port", port])
        assert exit_.value.code == 2
        assert f"argument --master-port: '{port}' is not a TCP port (give 1 to 65535)" in capsys.readouterr().err


def test_a_master_address_that_does_not_resolve_is_refused_before_any_stage_runs():
    from align.core.errors import PipelineError
    from align.orchestrator.launch import MultiNode

    MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1").check()
    with pytest.raises(PipelineError, match=r"--master-addr no-such-host.invalid: cannot be resolved from this "
                                            r"machine .*give node 0's hostname or IP address"):
        MultiNode(nodes=2, node_rank=1, master_addr="no-such-host.invalid").check()


def test_a_stage_count_its_accelerate_config_cannot_start_is_refused(capsys):
    rc, out = validate(capsys, DEFAULT, "sft.num_processes=2")
    refused(out, rc, "stages.sft: num_processes: 2 with accelerate: cpu (cpu.yaml), which runs one process",
            "use accelerate: ddp, zero2 or zero3")
    rc, out = validate(capsys, DEFAULT, "sft.num_processes=2", "sft.accelerate=ddp")
    assert rc == 0, out[-2000:]


@pytest.mark.parametrize("visible, expected", [
    (None, 4), ("1,3", 2), ("-1", 0), ("", 0), ("0,-1,2", 1), ("7", 0), ("2,2", 1),
    # UUIDs (SLURM and Kubernetes hand GPUs out so): every GPU of the node was counted; a unique prefix names one
    ("GPU-bbbb-0001,GPU-dddd-0003", 2), ("GPU-bb", 1), ("GPU-aaaa-0000,GPU-99", 1), ("GPU-", 0),
    ("MIG-bbbb-0001/1/0", 0),  # a MIG slice: not sized from the whole GPU's memory
])
def test_the_gpus_counted_are_those_cuda_would_use(visible, expected, monkeypatch, tmp_path):
    """CUDA reads CUDA_VISIBLE_DEVICES up to its first entry that names no GPU: "-1" hides every GPU."""
    from align.orchestrator import hardware

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '" + "".join(f"{i}, GPU-{c * 3}{c}-000{i}, 81559\\n"
                                                    for i, c in enumerate("abcd")) + "'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert len(hardware.gpu_memory_in_use()) == expected


@pytest.mark.parametrize("after", ["sigterm", "disk"])
def test_a_stage_stopped_or_failing_after_it_completed_stays_completed(tmp_path, monkeypatch, capsys, after):
    """A SIGTERM (a scheduler, the launcher stopping the workers) or an I/O error while a completed stage dropped its
    checkpoints or left the process group rewrote its manifest as interrupted or failed, without outputs: the next
    run resumed it from checkpoints half removed (keep_checkpoints: false), or retrained it from step 0."""
    from align.core.errors import Terminated
    from align.runtime import process

    recorded = []
    ctx = type("Ctx", (), {"tracker": None, "dir": tmp_path, "is_main": True, "completed": False,
                           "write_manifest": lambda self, status, **kw: recorded.append(status)})()
    monkeypatch.setattr(process, "StageContext", lambda spec: ctx)
    monkeypatch.setattr(process.StageSpec, "parse", staticmethod(lambda raw, path: raw))
    for name in ("die_with_parent", "pin_to_run", "long_group_timeouts", "quiet_libraries", "terminate_as_interrupt"):
        monkeypatch.setattr(process, name, lambda: None)

    def completing(ctx):
        ctx.write_manifest("completed")
        ctx.completed = True  # as _run marks it right after that write
        raise Terminated("SIGTERM") if after == "sigterm" else OSError(28, "No space left on device")

    monkeypatch.setattr(process, "_run", completing)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # the interrupt path ignores SIGINT and SIGTERM
    # while it records: not in the test process
    spec = tmp_path / "spec.json"
    spec.write_text('{"stage_name": "sft"}')
    try:
        code = process.main(str(spec))
    finally:
        __import__("gc").enable()
    assert code == (143 if after == "sigterm" else 2)
    assert recorded == ["completed"]  # nothing after it
    assert "its manifest stays completed, and the next run skips it" in capsys.readouterr().err
    ctx.completed, recorded[:] = False, []  # the same stop before completion: recorded, resumable
    monkeypatch.setattr(process, "_run", lambda ctx: (_ for _ in ()).throw(Terminated("SIGTERM")))
    try:
        assert process.main(str(spec)) == 143
    finally:
        __import__("gc").enable()
    assert recorded == ["interrupted"]


def test_a_stage_whose_runner_is_gone_is_recorded_interrupted_not_failed(tmp_path, monkeypatch):
    """A warm-started stage's next print after its runner was SIGKILLed fails with EPIPE, before the death signal
    arrives: that is the runner gone (resumable, as a SIGTERM is), not the stage failing."""
    import gc

    from align.runtime import process

    recorded = []
    ctx = type("Ctx", (), {"tracker": None, "dir": tmp_path, "is_main": True,
                           "write_manifest": lambda self, status, **kw: recorded.append((status, kw["error"]))})()
    monkeypatch.setattr(process, "StageContext", lambda spec: ctx)
    monkeypatch.setattr(process.StageSpec, "parse", staticmethod(lambda raw, path: raw))
    for name in ("die_with_parent", "pin_to_run", "long_group_timeouts", "quiet_libraries"):
        monkeypatch.setattr(process, name, lambda: None)

    def printing(ctx):
        print("step 7", flush=True)

    monkeypatch.setattr(process, "_run", printing)
    spec = tmp_path / "spec.json"
    spec.write_text('{"stage_name": "sft"}')
    read, write = os.pipe()
    err_read, err_write = os.pipe()
    out, err = os.fdopen(write, "w"), os.fdopen(err_write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    os.close(read)  # the runner, reading the stage's output, is gone
    try:
        assert process.main(str(spec)) == 143
    finally:
        gc.enable()
        out.close()
        err.close()
        os.close(err_read)
    assert recorded == [("interrupted", "the run's runner is gone (its output pipe closed)")]
    # the same error while someone still reads the stage's output is the stage's own failure
    assert not process.output_gone(open(os.devnull, "w"))


@pytest.mark.parametrize("pid", ['"abc"', "[1]", "99999999999999999999", "true", "-4", "0"])
def test_a_damaged_lock_record_is_no_holder_and_no_traceback(pid, tmp_path):
    import socket

    from align.orchestrator.runlock import LOCK_FILE, RunLock, runner_state

    (tmp_path / LOCK_FILE).write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}", "since": "x"}}')
    assert runner_state(tmp_path) == "has exited"
    with RunLock(tmp_path) as lock:  # taken: nobody alive holds it
        assert lock.note == ""
    assert runner_state(tmp_path) == "has exited"


@pytest.mark.parametrize("outputs", ["5", "[null]", '["model", 3]', '""'])
def test_a_manifest_whose_outputs_are_not_names_is_refused_naming_the_field(outputs, tmp_path):
    from align.core.rundir import ManifestError, outputs_problem, read_manifest

    (tmp_path / "manifest.json").write_text(f'{{"status": "completed", "fingerprint": "f", "outputs": {outputs}}}')
    for reader in (read_manifest, outputs_problem):  # `align verify` read them as names: TypeError
        with pytest.raises(ManifestError, match=r"field 'outputs' is .*, not a list of output names"):
            reader(tmp_path)


def test_a_data_file_edited_after_the_run_planned_its_stage_is_refused_not_trained_on(tmp_path):
    """The stage's fingerprint holds the card's digest (its data file's too): data edited while earlier stages ran
    was trained on under the planned digest, and the next run called the stage up to date."""
    import json
    from types import SimpleNamespace

    from align.data.cards import load_card
    from align.runtime.context import StageError
    from align.runtime.rows import card_split

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f" c{i}"}) + "\n" for i in range(20)))
    card = tmp_path / "card.yaml"
    card.write_text("name: t\nsource: {path: rows.jsonl}\nlicense: MIT\nformat: jsonl\nproduces: prompt_completion\n"
                    "splits: {train: 0.8, test: 0.2, seed: 1}\n")
    planned = load_card(card).content_hash()
    ctx = SimpleNamespace(name="sft", extra_manifest={},
                          spec=SimpleNamespace(data_cards={"data": {"path": str(card), "sha256": planned}}))
    assert card_split(ctx, str(card), "train").rows
    data.write_text(data.read_text().replace("c3", "terrible"))
    with pytest.raises(StageError, match=r"stage 'sft': data card .*card.yaml \(or its data file\) changed since"):
        card_split(ctx, str(card), "test")


def test_status_compares_a_run_with_its_pipeline_file_as_it_is_now_with_the_runs_own_overrides(workdir):
    """`align status` planned from the config pipeline.json recorded, so a stage whose setting was edited in the file
    since read "current" while `align run` would retrain it."""
    import shutil

    from align.config import load_pipeline, to_dict
    from align.orchestrator.plan import build_plan
    from align.orchestrator.status import current_fingerprints, recorded_overrides

    source = workdir / "mine.yaml"
    shutil.copy(REPO / "pipelines" / "default.yaml", source)
    source.write_text(source.read_text().replace("../data_cards/", "data_cards/"))
    typed = ["sft.max_steps=3", "dpo.beta=0.3"]
    assert recorded_overrides(f"align run --run-id x {source} --only dpo {typed[0]} --force {typed[1]}") == typed
    cfg = load_pipeline(source, typed)
    planned = {p.name: p.fingerprint for p in build_plan(cfg, source)}
    info = {"source": str(source), "config": to_dict(cfg), "resume": f"align run {source} --run-id x {' '.join(typed)}"}
    assert current_fingerprints(info) == planned
    source.write_text(source.read_text().replace("learning_rate: 2.0e-4", "learning_rate: 1.0e-4"))  # dpo's
    now = current_fingerprints(info)
    assert {n for n in planned if now[n] != planned[n]} == {"dpo", "evaluate"}
    source.write_text(source.read_text().replace("data_cards/movie_review_snippets.yaml", "data_cards/gone.yaml"))
    assert current_fingerprints(info).startswith("mine.yaml no longer plans: ")
    source.unlink()
    assert current_fingerprints(info) == "pipeline file gone"


def test_a_run_directory_last_run_from_another_pipeline_file_is_named_before_it_is_taken_over(tmp_path):
    import json

    from align.orchestrator.commands import other_source

    run = tmp_path / "runs" / "default" / "main"
    run.mkdir(parents=True)
    mine = tmp_path / "mine.yaml"
    assert other_source(run, mine) is None  # a new run directory
    (run / "pipeline.json").write_text(json.dumps({"source": str(REPO / "pipelines" / "default.yaml")}))
    note = other_source(run, mine)
    assert f"was last run from {REPO / 'pipelines' / 'default.yaml'}; this run is from {mine}" in note
    assert "give this pipeline its own `name:` or a --run-id" in note
    assert other_source(run, REPO / "pipelines" / "default.yaml") is None


def _judge_dir(root, name, **change):
    import json
    import shutil

    path = root / name
    shutil.copytree(REPO / "tokenizers" / "gpt2", path)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", **change.get("config", {})}))
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    for gone in change.get("remove", ()):
        (path / gone).unlink()
    for file, text in change.get("write", {}).items():
        (path / file).write_text(text)
    return path


@pytest.mark.parametrize("change, needle", [
    ({"remove": ["model.safetensors"]}, "has a config.json but no weights"),
    ({"write": {"model.safetensors": "x"}}, "model.safetensors is not a readable safetensors file"),
    ({"config": {"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}}, "ships its own Python code"),
    ({"remove": [p.name for p in (REPO / "tokenizers" / "gpt2").iterdir()]}, "holds no tokenizer files"),
    ({"write": {"tokenizer_config.json": "{not json"}}, "tokenizer_config.json is damaged"),
    ({"write": {"config.json": "{}"}}, "has no `model_type`"),
])
def test_a_pairwise_judge_model_directory_is_checked_as_the_base_model_is(change, needle, tmp_path, capsys):
    """It passed validate and failed after every policy was trained and sampled."""
    judge = _judge_dir(tmp_path, "judge", **change)
    rc, out = validate(capsys, DEFAULT, f"evaluate.pairwise=[{{name: j, model: {judge}}}]")
    refused(out, rc, "stages.evaluate.pairwise.0.model:", needle)


@pytest.mark.parametrize("model_type, needle", [
    ("qwen9", "is a 'qwen9' model (config.json model_type), which transformers"),  # newer than transformers here
    ("t5", "cannot load as a causal LM (AutoModelForCausalLM has no class for it)"),  # an encoder-decoder
    ("llama4", "cannot load as a sequence classifier (the reward stage's model)"),  # causal, but no scalar class
])
def test_a_base_model_transformers_has_no_class_for_is_refused_at_validate(model_type, needle, tmp_path, capsys):
    """A base model whose model_type transformers does not know, or has no causal-LM (or, for the reward stage, no
    sequence-classification) class for, passed validate and every stage's data checks, then failed in the first
    stage's from_pretrained after the launch."""
    model = _judge_dir(tmp_path, "model", config={"model_type": model_type, "vocab_size": 50257})
    rc, out = validate(capsys, DEFAULT, f"base_model={model}")
    refused(out, rc, "base_model:", needle)
    rc, out = validate(capsys, DEFAULT, f"base_model={_judge_dir(tmp_path, 'gpt2', config={'vocab_size': 50257})}")
    assert rc == 0, out[-2000:]


def test_a_mistyped_local_judge_path_is_not_taken_for_a_hub_id(tmp_path, capsys):
    rc, out = validate(capsys, DEFAULT, "evaluate.pairwise=[{name: j, model: accelerate/judge}]")  # pipelines/accelerate
    refused(out, rc, "stages.evaluate.pairwise.0.model: local path 'accelerate/judge' not found")
    judge = _judge_dir(tmp_path, "judge")
    rc, out = validate(capsys, DEFAULT, f"evaluate.pairwise=[{{name: j, model: {judge}}}]")
    assert rc == 0, out[-2000:]


def test_a_base_model_whose_weights_were_cut_short_or_that_is_a_gguf_folder_is_refused_at_validate(tmp_path, capsys):
    """A truncated safetensors passed validate and failed at the first stage's load with safetensors' own error,
    naming no file; a directory holding only a .gguf was called "not a transformers model" without the way out."""
    model = _judge_dir(tmp_path, "model")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # a copy cut short
    rc, out = validate(capsys, DEFAULT, f"base_model={model}")
    refused(out, rc, "base_model:", f"{weights} is ", "its header describes", "the copy was cut short")
    folder = tmp_path / "gguf_only"
    folder.mkdir()
    (folder / "M.Q4.gguf").write_bytes(b"GGUF")
    rc, out = validate(capsys, DEFAULT, f"base_model={folder}")
    refused(out, rc, f"{folder} has no config.json", f"to use its GGUF checkpoint, name the file: {folder / 'M.Q4.gguf'}")


@pytest.mark.parametrize("where", ["run", "stage"])
def test_a_file_where_a_directory_belongs_is_named_before_anything_runs(workdir, where):
    """A regular file at the run directory's or a stage directory's path was named only by the OS's "File exists"
    (a traceback for the run directory), and for a stage only at its turn, after the stages before it trained."""
    run_dir = workdir / "runs" / "default" / "main"
    path = run_dir if where == "run" else run_dir / "reward"
    path.parent.mkdir(parents=True)
    path.write_text("notes")
    proc = run_align("run", "pipelines/default.yaml", "--run-id", "main", "tracking.wandb=disabled", *TINY, cwd=workdir)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{path.relative_to(workdir)} is a file where align keeps the {where}'s directory: move it away" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "sft").exists() and path.read_text() == "notes"


def test_weights_a_copy_left_incomplete_or_mixed_and_a_tokenizer_without_its_vocabulary_are_refused_at_validate(
        tmp_path, capsys):
    """A probe of model loading (2026-11-30): each passed validate. A shard an index names but the copy has not
    brought failed at the first stage's load; a stale model.safetensors beside a newer sharded checkpoint was loaded
    instead of it (transformers prefers the single file), silently; a zip-format .bin cut short failed naming no
    file; a tokenizer folder without tokenizer.json / vocab.json loaded as a tokenizer of a few special tokens and
    would have trained on empty sequences; custom code named by tokenizer_config.json's auto_map was replaced by a
    generic tokenizer without a word."""
    import json
    import shutil

    model = _judge_dir(tmp_path, "sharded")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors",
                                            "v": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, out = validate(capsys, DEFAULT, f"base_model={model}")
    refused(out, rc, "base_model:", "names 2 shards, 1 of them missing (model-00002-of-00002.safetensors)",
            "the copy is incomplete")
    stale = _judge_dir(tmp_path, "stale")  # its model.safetensors, and a checkpoint of shards copied over it
    shutil.copy(stale / "model.safetensors", stale / "model-00001-of-00001.safetensors")
    (stale / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00001.safetensors"}}))
    rc, out = validate(capsys, DEFAULT, f"base_model={stale}")
    refused(out, rc, "holds both model.safetensors and model.safetensors.index.json",
            "transformers loads model.safetensors, and the shards are ignored; remove whichever is stale")
    downloaded = _judge_dir(tmp_path, "downloaded")  # `--exclude "*.bin"`: the .bin index without its shards
    (downloaded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    rc, out = validate(capsys, DEFAULT, f"base_model={downloaded}")
    assert rc == 0, out[-2000:]  # transformers loads model.safetensors and never reads the .bin index
    binary = _judge_dir(tmp_path, "binary", remove=["model.safetensors"])
    (binary / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 200)  # a zip's first entry, no directory
    rc, out = validate(capsys, DEFAULT, f"base_model={binary}")
    refused(out, rc, f"{binary / 'pytorch_model.bin'} is a zip archive without its end")
    bare = _judge_dir(tmp_path, "bare", remove=["vocab.json", "merges.txt"])
    rc, out = validate(capsys, DEFAULT, f"base_model={bare}", f"tokenizer={bare}")
    refused(out, rc, "the tokenizer encodes ordinary text ('The movie was great.') as []", "no vocabulary to speak of",
            "missing or damaged: copy the tokenizer again")
    custom = _judge_dir(tmp_path, "custom")
    config = json.loads((custom / "tokenizer_config.json").read_text())
    (custom / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoTokenizer": [None, "tokenization_x.XTokenizer"]}}))
    rc, out = validate(capsys, DEFAULT, f"base_model={custom}", f"tokenizer={custom}")
    refused(out, rc, "ships its own Python code (tokenizer_config.json auto_map)", "trust_remote_code: true")


def test_a_vision_language_model_is_checked_by_its_decoders_config(tmp_path, capsys):
    """Gemma 3 4B+ (and Mistral-Small-3.1, Llama 4) keep the decoder's vocabulary, positions and heads under
    `text_config`: validate read none of them (a tokenizer 40 tokens past the embeddings passed), and `align
    estimate` ended in a traceback (no attribute 'num_attention_heads'). A probe of model loading, 2026-11-30."""
    import json

    import torch
    import transformers as t

    import families
    from align.cli import main as cli

    print(f"seed {families.SEED}")
    tok = families.tokenizer("gemma3", tmp_path / "vlm")
    vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14)
    config = t.Gemma3Config(text_config=families.config("gemma3", tok).to_dict(), vision_config=vision.to_dict(),
                            mm_tokens_per_image=4, boi_token_index=2, eoi_token_index=3, image_token_index=1)
    torch.manual_seed(families.SEED)
    t.AutoModelForImageTextToText.from_config(config).save_pretrained(tmp_path / "vlm")
    assert "vocab_size" not in json.loads((tmp_path / "vlm" / "config.json").read_text())  # under text_config only
    tok.add_special_tokens({"additional_special_tokens": [f"<x{i}>" for i in range(40)]})
    tok.save_pretrained(tmp_path / "big")
    rc, out = validate(capsys, DEFAULT, f"base_model={tmp_path / 'vlm'}", f"tokenizer={tmp_path / 'big'}")
    refused(out, rc, f"has {len(tok)} tokens but the base model's embeddings hold {len(tok) - 40}")
    rc, out = validate(capsys, DEFAULT, f"base_model={tmp_path / 'vlm'}", "sft.max_length=4096")
    refused(out, rc, "sft", "4096", str(families.POSITIONS))
    assert cli(["estimate", DEFAULT, f"base_model={tmp_path / 'vlm'}"]) == 0
    out = capsys.readouterr().out
    assert "| sft |" in out and "Traceback" not in out


def test_align_help_lists_the_users_commands_and_not_the_stage_entry_point(capsys, monkeypatch):
    """`align --help` listed `stage ==SUPPRESS==` (argparse cannot hide a subcommand by its help), and a mistyped
    command's error still offered `stage`; the stage process's entry point still runs a spec."""
    from align import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "SUPPRESS" not in out and "{run,estimate,validate,report,status,verify,model}" in out
    with pytest.raises(SystemExit):
        cli.main(["stagee"])
    err = capsys.readouterr().err
    assert "invalid choice: 'stagee'" in err and "'model')" in err and "'stage'" not in err
    called = []
    monkeypatch.setattr("align.runtime.process.main", lambda spec: called.append(spec) or 0)
    assert cli.main(["stage", "spec.json"]) == 0 and called == ["spec.json"]


def test_the_runner_goes_on_after_a_stage_that_completed_then_exited_non_zero_in_its_teardown(tmp_path, capsys):
    """The stage process keeps its manifest completed when a SIGTERM or an I/O error hits its teardown, but exits 143
    or 2: the runner marked the run failed and stopped before the next stage. Now it warns and goes on; a manifest
    that says completed from before this attempt (a forced rerun killed before it started) is still a failure."""
    import time

    from align.core.rundir import read_manifest, write_manifest
    from align.orchestrator import runner

    stage = tmp_path / "dpo"
    (stage / "model").mkdir(parents=True)
    plan = type("Plan", (), {"fingerprint": "f", "name": "dpo"})()
    t_stage = time.time()
    write_manifest(stage, {"stage": "dpo", "status": "completed", "fingerprint": "f", "outputs": ["model"],
                           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    assert runner._completed(143, plan, stage, "[align] stage 4/6 dpo (dpo)", None, t_stage)
    assert "exited with code 143 after the stage completed" in capsys.readouterr().out
    assert runner._completed(0, plan, stage, "h", None, t_stage)
    assert not runner._completed(-9, plan, stage, "h", None, t_stage + 3600)  # completed an hour before it started
    assert read_manifest(stage)["status"] == "completed"  # the earlier run's record is left as it was
    write_manifest(stage, {"stage": "dpo", "status": "running", "fingerprint": "f"})
    assert not runner._completed(0, plan, stage, "h", None, t_stage)
    assert read_manifest(stage)["status"] == "failed"


def test_the_preflight_compares_with_what_other_processes_leave_on_a_gpu(monkeypatch, tmp_path):
    """The preflight compared a stage with each GPU's whole memory: a leftover process of an earlier run (or another
    tenant's job) holding 30 GiB let a stage through that then ran out of memory. Over 1 GiB in use, what is left
    counts, and the table says so; the driver's own few MiB do not."""
    from align.config import load_pipeline
    from align.orchestrator import hardware

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, GPU-a, 81559, 30720\\n1, GPU-b, 81559, 4\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert hardware.gpu_memory_in_use() == [(81559 * 2 ** 20, 30720 * 2 ** 20), (81559 * 2 ** 20, 0)]  # 4 MiB: the
    # driver's own
    hw = hardware.hardware(load_pipeline(DEFAULT, []))
    # a stage is compared with what is left; a vLLM engine's gpu_memory_utilization share is of the whole memory
    assert (hw.gpu_memory, hw.capacity, hw.detected) == (81559 * 2 ** 20, (81559 - 30720) * 2 ** 20, True)
    assert "other processes hold memory on a GPU here: 49.6 GiB is left on the fullest" in hw.describe()
    smi.write_text("#!/bin/sh\nprintf '0, GPU-a, 40960, 0\\n1, GPU-b, 81920, 51200\\n'\n")  # mixed GPUs: the least
    hw = hardware.hardware(load_pipeline(DEFAULT, []))  # any has left (30 GiB), not the smallest less the most held
    assert (hw.gpu_memory, hw.capacity) == (40960 * 2 ** 20, 30720 * 2 ** 20)
    assert hardware.hardware(load_pipeline(DEFAULT, []), gpu_memory_gb=80).capacity == int(80e9)  # a flag: as given
