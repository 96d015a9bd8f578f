"""The rollout engine's guards that need no vLLM: the log-prob gap check, a NaN-safe maximum, a read-only or full
/dev/shm found before an engine starts or a sync writes, and a dead engine named (pid, log) instead of a bare EPIPE."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from align.engines import EngineError
from align.engines import vllm as vllm_engine
from align.engines.base import check_gap, nan_max
from conftest import REPO


def test_nan_max_never_hides_a_nan_wherever_it_falls():
    assert nan_max([0.1, 0.3, 0.2]) == 0.3
    # Python's max() answers 0.3 for the first and nan for the second: position decides, which must not.
    assert math.isnan(nan_max([float("nan"), 0.3]))
    assert math.isnan(nan_max([0.3, float("nan")]))


def test_the_gap_check_passes_a_small_gap_and_stops_a_large_or_broken_one(tmp_path):
    log = tmp_path / "engine.log"
    check_gap(0.4, 1.0, "iteration 3", log)
    check_gap(1.0, 1.0, "iteration 3", log)  # the bound itself is allowed
    with pytest.raises(EngineError) as err:
        check_gap(7.5, 1.0, "iteration 3", log)
    msg = str(err.value)
    assert "iteration 3" in msg and "7.5" in msg and "generation.max_logprob_gap=1" in msg and str(log) in msg
    with pytest.raises(EngineError, match="nan"):
        check_gap(float("nan"), 1.0, "iteration 4", log)
    with pytest.raises(EngineError, match="inf"):
        check_gap(float("inf"), 100.0, "iteration 5", log)


def test_a_sync_that_will_not_fit_names_the_space_and_the_fix(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(vllm_engine.shutil, "disk_usage", lambda d: Usage(2 ** 30, 2 ** 30 - 64 * 2 ** 20, 64 * 2 ** 20))
    assert vllm_engine.sync_space_problem(str(tmp_path), 10 * 2 ** 20) is None
    problem = vllm_engine.sync_space_problem("/dev/shm/align-vllm-x", 16 * 2 ** 30)
    assert "16.00 GiB" in problem and "64.0 MiB" in problem and "/dev/shm" in problem
    assert "--shm-size=25g" in problem and "ALIGN_SYNC_DIR" in problem
    problem = vllm_engine.sync_space_problem(str(tmp_path), 100 * 2 ** 20)
    assert str(tmp_path) in problem


def test_the_sync_directory_is_chosen_by_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_SYNC_DIR", str(tmp_path))
    assert vllm_engine.shm_dir() == str(tmp_path)
    monkeypatch.delenv("ALIGN_SYNC_DIR")
    assert vllm_engine.shm_dir() != str(tmp_path)


def test_a_read_only_dev_shm_is_refused_before_any_process_starts(monkeypatch):
    real = os.access
    monkeypatch.setattr(vllm_engine.os.path, "isdir", lambda p: True if p == "/dev/shm" else os.path.isdir(p))
    monkeypatch.setattr(vllm_engine.os, "access", lambda p, mode: False if p == "/dev/shm" else real(p, mode))
    problem = vllm_engine.shm_problem()
    assert "read-only" in problem and "--shm-size" in problem and "engine: hf" in problem
    started = []
    monkeypatch.setattr(vllm_engine.subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(EngineError, match="read-only"):
        vllm_engine.VLLMEngine("model", tokenizer=None, python=sys.executable)
    assert started == []


def test_a_sync_directory_that_cannot_be_written_is_named_before_the_engine_starts(tmp_path, monkeypatch):
    """ALIGN_SYNC_DIR read-only or missing: `align validate` and the engine refuse it naming the variable and the fix
    (before, the first sync failed with a bare 'Read-only file system' from the engine's temporary directory)."""
    monkeypatch.setenv(vllm_engine.SYNC_DIR_ENV, str(tmp_path / "missing"))
    problem = vllm_engine.shm_problem()
    assert problem.startswith(f"ALIGN_SYNC_DIR={tmp_path / 'missing'}: weight syncs are written there, but it is not "
                              "a writable directory"), problem
    from align.engines import kind, vllm_env

    monkeypatch.setattr(vllm_env, "check_vllm_installed", lambda where: None)  # installed or not: this comes next
    problem = kind("vllm").problems("p.yaml: stages.ppo.generation.engine", lambda: 64)  # what `align validate` asks
    assert problem.startswith("p.yaml: stages.ppo.generation.engine: ALIGN_SYNC_DIR="), problem
    real = os.access
    monkeypatch.setattr(vllm_engine.os, "access", lambda p, mode: True if p == "/dev/shm" else real(p, mode))
    monkeypatch.setenv(vllm_engine.SYNC_DIR_ENV, str(tmp_path))  # a writable directory: no problem
    assert vllm_engine.shm_problem() is None
    assert kind("vllm").problems("x", lambda: 64) is None


class _GoneConn:
    def send(self, msg):
        raise BrokenPipeError(32, "Broken pipe")


def test_an_engine_that_died_between_calls_is_named_with_its_pid_and_log(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "print('engine: out of memory')"], stdout=subprocess.DEVNULL)
    proc.wait()
    log = tmp_path / "engine.log"
    log.write_text("starting\nCUDA error: out of memory\n")
    engine = object.__new__(vllm_engine.VLLMEngine)  # its transport only: no process of vLLM's is started
    engine.conn, engine.broken, engine.proc, engine.log_path = _GoneConn(), None, proc, Path(log)
    with pytest.raises(EngineError) as err:
        engine._call({"op": "generate"}, "generate batch 2", 5)
    msg = str(err.value)
    assert f"pid {proc.pid}" in msg and "BrokenPipeError" in msg and "generate batch 2" in msg
    assert str(log) in msg and "CUDA error: out of memory" in msg


def test_a_head_size_vllms_cpu_attention_lacks_is_named_before_the_engine_starts(monkeypatch):
    from align.engines import vllm_env as engine_env

    monkeypatch.setattr(engine_env, "has_gpu", lambda: False)
    problem = engine_env.head_size_problem(48, "stages.ppo.generation.engine")
    assert "stages.ppo.generation.engine" in problem and "is 48" in problem and "64, 80" in problem
    assert engine_env.head_size_problem(64, "x") is None and engine_env.head_size_problem(None, "x") is None
    monkeypatch.setattr(engine_env, "has_gpu", lambda: True)  # the GPU backends are not the CPU one
    assert engine_env.head_size_problem(48, "x") is None


def test_validate_reads_the_head_size_from_the_pipelines_model(monkeypatch):
    import yaml

    from align.config import parse_pipeline
    from align.orchestrator.validate import _head_dim

    root = Path(__file__).resolve().parent.parent
    raw = yaml.safe_load((root / "pipelines" / "default.yaml").read_text())
    raw["builtin"] = {**raw.get("builtin", {}), "hidden_size": 96, "num_heads": 2}
    assert _head_dim(parse_pipeline(raw, "pipelines/default.yaml"), "pipelines/default.yaml") == 48


def test_the_engine_process_removes_its_directory_when_its_stage_is_gone(tmp_path):
    """The engine process (run in vLLM's environment) exits on EOF when its stage dies, SIGKILL included, and then
    removes its socket, any sync not yet read and its directory in /dev/shm (empty directories of killed stages
    were left there); a directory that still holds the engine's own log is kept, and nothing outside a directory
    of its own naming is touched."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("align_vllm_server", REPO / "align" / "engines" / "vllm_side" /
                                                  "align_vllm_server.py")
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)  # imports nothing of align, and vLLM only when an engine starts
    folder = tmp_path / "align-vllm-abc"
    folder.mkdir()
    for name in ("sock", "weights.safetensors.tmp"):
        (folder / name).write_bytes(b"x")
    server.clean_up(str(folder / "sock"))
    assert not folder.exists()
    folder.mkdir()
    (folder / "sock").write_bytes(b"x")
    (folder / "engine.log").write_text("log")
    server.clean_up(str(folder / "sock"))
    assert sorted(p.name for p in folder.iterdir()) == ["engine.log"]
    other = tmp_path / "mine"
    other.mkdir()
    (other / "sock").write_bytes(b"x")
    server.clean_up(str(other / "sock"))
    assert (other / "sock").exists()


def test_every_rollout_an_engine_returns_is_on_the_training_device(tmp_path):
    """The seam (engines.kinds.OnDevice, which make_engine puts around every engine): whatever device an engine
    samples on (vLLM's process: the CPU), the rollout arrives on the training device, every tensor of it. Here the
    hf engine samples with a CPU model and the training device is `meta`, which no engine samples on: a tensor left
    on the CPU fails the check (before the seam, PPO fed CPU rollouts of the vLLM engine to GPU models)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from align.config import Generation
    from align.engines import make_engine
    from align.modeling.models import load_tokenizer

    torch.manual_seed(5)
    print("seed 5")
    tok = load_tokenizer(str(REPO / "tokenizers" / "gpt2"))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64)).eval()
    gen = Generation(max_new_tokens=3)
    plain = make_engine(gen, model=model, tokenizer=tok, model_dir=str(tmp_path))
    seamed = make_engine(gen, model=model, tokenizer=tok, model_dir=str(tmp_path), device=torch.device("meta"))
    prompts = ["A fine movie", "Dull"]
    for engine, device in ((plain, "cpu"), (seamed, "meta")):
        r = engine.generate(prompts, gen, seed=1)
        tensors = {k: v for k, v in vars(r).items() if isinstance(v, torch.Tensor)}
        assert len(tensors) >= 5 and {t.device.type for t in tensors.values()} == {device}, tensors
    assert seamed.holds_own_weights is plain.holds_own_weights and seamed.name == plain.name  # the engine's own


def test_collectives_over_new_tensors_name_their_device():
    """NCCL refuses CPU tensors: a metric made with torch.tensor(...) and reduced or gathered across processes must be
    made on the accelerator's device (the log-prob gap's reduce was not). Read from the source (AST) of align/."""
    import ast

    def offenders(source: str) -> list[int]:
        lines = []
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "reduce", "gather", "all_reduce", "gather_for_metrics", "broadcast", "all_gather"):
                for arg in node.args[:1]:
                    if (isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute)
                            and arg.func.attr in ("tensor", "zeros", "ones", "full", "as_tensor")
                            and not any(k.arg == "device" for k in arg.keywords)):
                        lines.append(node.lineno)
        return lines

    assert offenders("acc.reduce(torch.tensor(x), 'mean')") == [1]  # the checker finds the fault
    assert offenders("acc.reduce(torch.tensor(x, device=d), 'mean')") == []
    found = {str(p.relative_to(REPO)): offenders(p.read_text()) for p in (REPO / "align").rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}
