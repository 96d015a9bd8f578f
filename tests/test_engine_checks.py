"""The rollout engine's guards that need no vLLM: the log-prob gap check, a NaN-safe maximum, a read-only or full
/dev/shm found before an engine starts or a sync writes, and a dead engine named (pid, log) instead of a bare EPIPE."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from align.engines import EngineError
from align.engines import vllm as vllm_engine
from align.engines import placement, vllm_env, vllm_sync
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
    monkeypatch.setenv(vllm_env.SYNC_DIR_ENV, str(tmp_path / "missing"))
    problem = vllm_engine.shm_problem()
    assert problem.startswith(f"ALIGN_SYNC_DIR={tmp_path / 'missing'}: weight syncs are written there, but it is not "
                              "a writable directory"), problem
    from align.engines import kind

    monkeypatch.setattr(vllm_env, "check_vllm_installed", lambda where: None)  # installed or not: this comes next
    problem = kind("vllm").problems("p.yaml: stages.ppo.generation.engine", lambda: 64)  # what `align validate` asks
    assert problem.startswith("p.yaml: stages.ppo.generation.engine: ALIGN_SYNC_DIR="), problem
    real = os.access
    monkeypatch.setattr(vllm_engine.os, "access", lambda p, mode: True if p == "/dev/shm" else real(p, mode))
    monkeypatch.setenv(vllm_env.SYNC_DIR_ENV, str(tmp_path))  # a writable directory: no problem
    assert vllm_engine.shm_problem() is None
    assert kind("vllm").problems("x", lambda: 64) is None


def test_a_sync_directory_too_deep_for_the_engines_socket_is_named_before_the_engine_starts(tmp_path, monkeypatch):
    """The engine's Unix socket is made in ALIGN_SYNC_DIR: past 107 bytes of path (a deep scratch directory, where
    the space check's own advice sends users) the engine exited as it started, its trainer saying only that it
    exited before it listened. Named at validate now, with the fix."""
    import socket

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    sock = deep / ("align-vllm-" + "x" * 8) / "sock"
    assert len(str(sock)) > vllm_env.SOCKET_PATH_MAX
    sock.parent.mkdir()
    with pytest.raises(OSError, match="too long"), socket.socket(socket.AF_UNIX) as s:  # the engine's listener's error
        s.bind(str(sock))
    real = os.access
    monkeypatch.setattr(vllm_engine.os, "access", lambda p, mode: True if p == "/dev/shm" else real(p, mode))
    monkeypatch.setenv(vllm_env.SYNC_DIR_ENV, str(deep))
    problem = vllm_engine.shm_problem()
    assert problem.startswith(f"ALIGN_SYNC_DIR={deep}: the engine's socket is made in it") and "shorter" in problem
    monkeypatch.setenv(vllm_env.SYNC_DIR_ENV, str(tmp_path))
    assert vllm_engine.shm_problem() is None


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


def test_an_engine_that_dies_with_a_request_unread_is_named_with_its_exit_and_log(tmp_path):
    """An engine that exits with a message of ours still unread (OOM-killed mid-sync: the node-bucket sync sends the
    next chunk before the last one's ack) resets the socket: recv() raised a bare ConnectionResetError, with no pid
    and no log (a review, 2026-12-02). It is an EngineError naming the call, the exit and the engine's log."""
    from multiprocessing.connection import Client

    address, key = str(tmp_path / "engine.sock"), b"k" * 16
    script = ("import os, time; from multiprocessing.connection import Listener\n"
              f"l = Listener({address!r}, authkey={key!r}); c = l.accept(); c.recv(); time.sleep(3); os._exit(3)")
    proc = subprocess.Popen([sys.executable, "-c", script])
    log = tmp_path / "engine.log"
    log.write_text("loading\nKilled\n")
    deadline = time.monotonic() + 60
    while not os.path.exists(address) and time.monotonic() < deadline:
        time.sleep(0.05)
    engine = object.__new__(vllm_engine.VLLMEngine)  # its transport only: no process of vLLM's is started
    engine.conn, engine.broken, engine.proc, engine.log_path = Client(address, authkey=key), None, proc, log
    engine.conn.send({"op": "chunk", "n": 1})
    engine.conn.send({"op": "chunk", "n": 2})  # never read: the engine exits with it in its queue
    proc.wait(timeout=60)
    with pytest.raises(EngineError) as err:
        engine._reply("chunk", "weight sync chunk 2", time.monotonic() + 30)
    msg = str(err.value)
    assert f"process {proc.pid} exited 3" in msg and "weight sync chunk 2" in msg, msg
    assert str(log) in msg and "Killed" in msg


def test_a_request_the_engine_never_reads_ends_by_its_deadline_and_stops_the_engine(tmp_path):
    """A shared engine wedged serving another process never reads this one's next request: a request larger than the
    socket's buffer (a generate of a few hundred long prompts) then blocked in send() forever, before the reply's
    deadline was ever watched. Now the send has the call's deadline: an EngineError naming the request, and the
    engine (a process that accepted the connection and reads nothing) is stopped."""
    from multiprocessing.connection import Client

    address, key = str(tmp_path / "engine.sock"), b"k" * 16
    script = ("import sys, time; from multiprocessing.connection import Listener\n"
              f"l = Listener({address!r}, authkey={key!r}); c = l.accept(); print('ready', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(address) and time.monotonic() < deadline:
            time.sleep(0.05)
        engine = object.__new__(vllm_engine.VLLMEngine)  # its transport only: no process of vLLM's is started
        engine.conn, engine.broken, engine.proc, engine.log_path = Client(address, authkey=key), None, proc, tmp_path
        engine.close = lambda kill=False: (proc.kill(), proc.wait()) if kill else None
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not take the request 'generate' by its deadline and was stopped"):
            engine._call({"op": "generate", "prompts": [[70_000] * 1024 for _ in range(1024)]}, "generate", 2)
        assert 1.5 < time.monotonic() - t0 < 30 and proc.poll() is not None
    finally:
        proc.kill()
        proc.wait()


def test_a_shared_engines_client_whose_request_timed_out_hangs_up_for_good(tmp_path):
    """A process of a shared engine does not stop the engine when its request times out (the starter's to stop): it
    hangs up. The write left blocked must fail then, or the engine, once free, would read the whole request and
    serve a process that has already stopped: here the engine reads after the deadline and finds the connection
    ended, not a request."""
    from multiprocessing.connection import Client

    from align.engines.vllm_client import SharedClient, _Started

    address, key = str(tmp_path / "engine.sock"), b"k" * 16
    script = ("import time; from multiprocessing.connection import Listener\n"
              f"l = Listener({address!r}, authkey={key!r}); c = l.accept(); print('ready', flush=True); time.sleep(4)\n"
              "try:\n    c.recv(); print('request', flush=True)\n"
              "except Exception as e:\n    print('ended', type(e).__name__, flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(address) and time.monotonic() < deadline:
            time.sleep(0.05)
        client = object.__new__(SharedClient)  # its transport only: the engine above stands in for vLLM's
        client.conn, client.broken, client.log_path = Client(address, authkey=key), None, tmp_path
        client.proc = _Started(proc.pid)
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(EngineError, match="did not take the request 'generate' by its deadline \\(log"):
            client._call({"op": "generate", "prompts": [[70_000] * 1024 for _ in range(1024)]}, "generate", 2)
        assert proc.poll() is None  # not stopped by this process
        assert proc.stdout.readline().split()[0] == "ended"
    finally:
        proc.kill()
        proc.wait()


def test_a_sync_that_fails_part_way_still_joins_the_remaining_zero3_gathers(monkeypatch):
    """Under ZeRO-3 every process gathers each layer group together as it syncs; a process whose sync fails (here:
    no bucket) must still go through the remaining groups, or the others wait in a gather for it forever. Not
    partitioned, nothing is gathered: nothing more is read."""
    import torch

    read = []

    def entries(model, changed_only=False):
        for i in range(4):  # one gather per layer group
            read.append(i)
            yield f"layers.{i}.weight", torch.zeros(1)

    def no_bucket(model):
        raise EngineError("no room in /dev/shm")

    monkeypatch.setattr(vllm_sync, "engine_entries", entries)
    engine = object.__new__(vllm_engine.VLLMEngine)  # its sync only: no process of vLLM's is started
    engine.broken, engine._held, engine._open_bucket, engine._bucket = None, {}, no_bucket, None
    # one process (no process group here): the node's bucket is not for it (align/engines/node_bucket.py), it gathers
    engine.weight_sync, engine.bucket_bytes, engine.timeout_s, engine._dir = "host", 1 << 20, 60, "/nonexistent"
    model = torch.nn.Linear(2, 2)
    with pytest.raises(EngineError, match="no room"):
        engine._sync_shared(model, changed_only=False)
    assert read == [] and engine.broken  # nothing partitioned: nothing to join
    model.weight.ds_id = 0  # as DeepSpeed marks a partitioned parameter
    with pytest.raises(EngineError, match="no room"):
        engine._sync_shared(model, changed_only=False)
    assert read == [0, 1, 2, 3]


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


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_engine_placement_on_nodes_of_one_two_and_eight_gpus(gpus):
    """align/engines/placement.py: colocated (each process's engine on its own GPU, or one engine per group of
    tensor_parallel processes over their GPUs) and separate (the GPUs training leaves, in groups), for every
    process of a node; every GPU an engine takes is one the node has, no two engines share a GPU, and every process
    is served by exactly one engine that exactly one process starts."""
    from align.engines.placement import place

    shapes = [(gpus, tp, True) for tp in (1, 2, 4, 8) if gpus % tp == 0]  # all processes train, engines colocated
    shapes += [(p, tp, False) for p in range(1, gpus) for tp in (1, 2) if gpus - p >= tp]  # engines apart
    assert shapes
    for world, tp, colocate in shapes:
        ps = [place(r, world, gpus, tp, colocate) for r in range(world)]
        engines = {p.engine: p.devices for p in ps}
        owners = [p.engine for p in ps if p.owner]
        assert sorted(owners) == sorted(engines), (world, tp, colocate)  # one starter per engine
        for r, p in enumerate(ps):  # the processes an engine serves: every one placed on it, its starter first
            assert p.serves == tuple(q for q in range(world) if ps[q].engine == p.engine), (world, tp, colocate, r)
            assert ps[p.serves[0]].owner
        # shared is the node's: every process goes through the group's collectives when any engine serves several
        assert {p.shared for p in ps} == {any(len(p.serves) > 1 for p in ps)}, (world, tp, colocate)
        used = [d for devs in engines.values() for d in devs]
        assert len(used) == len(set(used)) and all(0 <= d < gpus for d in used), (world, tp, colocate, engines)
        assert all(len(devs) == tp for devs in engines.values())
        if colocate:
            assert all(r in ps[r].devices for r in range(world))  # a process's engine includes its own GPU
        else:
            assert all(d >= world for d in used)  # never a training GPU
            assert len(engines) == min(world, (gpus - world) // tp)
    if gpus == 8:  # by hand: 8 processes, tensor_parallel 2 -> engines on (0,1) (2,3) (4,5) (6,7); rank 5 in the 3rd
        assert place(5, 8, 8, 2).devices == place(4, 8, 8, 2).devices == (4, 5)
        assert place(4, 8, 8, 2).owner and not place(5, 8, 8, 2).owner
        # 6 training processes, 2 spare GPUs as two engines of one GPU each: rank 3 is served by engine 1 (GPU 7)
        assert place(3, 6, 8, 1, colocate=False).devices == (7,) and not place(3, 6, 8, 1, colocate=False).owner
        # 3 processes, 2 engines of 2 GPUs: engine 0 serves processes 0 and 2, engine 1 process 1 alone, which still
        # joins the group's collectives (before, it took the unshared path and the others waited for it forever)
        assert place(2, 3, 8, 2, colocate=False).serves == (0, 2) and place(1, 3, 8, 2, colocate=False).serves == (1,)
        assert place(1, 3, 8, 2, colocate=False).shared and not place(1, 2, 8, 2, colocate=False).shared


def test_engine_placement_refuses_shapes_it_cannot_hold_and_maps_through_visible_devices():
    from align.engines.placement import place, visible_devices

    with pytest.raises(ValueError, match="does not divide"):
        place(0, 6, 8, tensor_parallel=4)
    with pytest.raises(ValueError, match="GPUs training does not use"):
        place(0, 8, 8, colocate=False)
    with pytest.raises(ValueError, match="at most the node's GPUs"):
        place(0, 4, 2)
    assert place(1, 2, 0).devices == () and place(1, 2, 0).owner  # a CPU: every process its own engine, no device
    # a CPU with tensor_parallel 2: processes 2 and 3 of 4 share engine 1, started by process 2 (no device either)
    assert place(3, 4, 0, 2) == placement.Placement((), False, 1, 0.3, (2, 3), True)
    assert place(2, 4, 0, 2).owner and not place(1, 2, 0).shared
    with pytest.raises(ValueError, match="does not divide the 3 processes"):
        place(0, 3, 0, tensor_parallel=2)
    assert visible_devices((1,), "4,5,6,7") == "5" and visible_devices((0, 1), None) == "0,1"
    with pytest.raises(ValueError, match="outside CUDA_VISIBLE_DEVICES"):
        visible_devices((3,), "4,5")


def test_the_engine_environment_keeps_aligns_path_out_and_lets_idle_threads_sleep(monkeypatch):
    """engine_environment: no PYTHONPATH of align's, none of the launcher's variables, the connection key, OpenMP threads that sleep when idle unless
    the user chose otherwise, and on GPUs only the engine's own GPUs (through the launcher's CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setenv("PYTHONPATH", "/somewhere/align")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for name, value in {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)  # torchrun's: the engine is no training process (pytorch#192113)
    env = vllm_env.engine_environment(b"\x01\x02", (2,))
    assert "PYTHONPATH" not in env and env["ALIGN_VLLM_AUTHKEY"] == "0102"
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} & set(env)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = vllm_env.engine_environment(b"\x01", ())
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # a CPU engine: as it was


def test_each_process_vllm_engine_is_pinned_to_its_own_gpu(monkeypatch, tmp_path):
    """The vLLM engine of process 3 of 8 on an 8-GPU node gets CUDA_VISIBLE_DEVICES of that process's GPU (through
    the launcher's own CUDA_VISIBLE_DEVICES): before, every engine saw every GPU and started on GPU 0."""
    import torch

    from align.config import Generation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert placement.node_placement(Generation(engine="vllm")).devices == (3,)
    seen = {}

    class Started(Exception):
        pass

    def popen(cmd, env, **kwargs):
        seen.update(env)
        raise Started

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    monkeypatch.setattr(vllm_engine, "shm_problem", lambda: None)
    monkeypatch.setattr(vllm_engine.tempfile, "mkdtemp", lambda **kw: str(tmp_path))  # nothing left in /dev/shm
    monkeypatch.setattr(vllm_engine.subprocess, "Popen", popen)
    with pytest.raises(Started):
        vllm_engine.VLLMEngine("model", None, python=sys.executable, devices=(3,))
    assert seen["CUDA_VISIBLE_DEVICES"] == "11"


@pytest.mark.parametrize("overrides, message", [
    (["ppo.generation.lora_sync=adapter"], "(generation.engine: vllm); generation.engine is 'hf'"),
    (["ppo.generation.lora_sync=adapter", "ppo.generation.engine=vllm"], "needs lora.enabled: true"),
    (["ppo.generation.lora_sync=adapter", "ppo.generation.engine=vllm", "ppo.lora.enabled=true", "ppo.lora.r=1024"],
     "vLLM serves LoRA ranks up to 512, lora.r is 1024"),
])
def test_an_adapter_sync_that_cannot_work_is_refused_by_validate(workdir, overrides, message):
    """generation.lora_sync: adapter where there is no vLLM engine, no adapter or a rank vLLM does not serve: refused
    before anything starts, naming the fields and the fix (lora_sync: merged)."""
    from conftest import run_align

    p = run_align("validate", "pipelines/default.yaml", *overrides, cwd=workdir, env={"ALIGN_VLLM_PYTHON": sys.executable})
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert message in out and "lora_sync: merged" in out and "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_a_4bit_base_with_an_engine_of_its_own_is_refused_by_validate(workdir, sync):
    """QLoRA (lora.quantize: 4bit) with the vLLM engine: its full-precision copy cannot be synced from a 4-bit base
    (merged would add the delta to packed uint8 weights), whichever lora_sync: refused, naming both fixes."""
    from conftest import run_align

    p = run_align("validate", "pipelines/default.yaml", "ppo.generation.engine=vllm", "ppo.lora.enabled=true",
                  "ppo.lora.quantize=4bit", f"ppo.generation.lora_sync={sync}", cwd=workdir,
                  env={"ALIGN_VLLM_PYTHON": sys.executable})
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "lora.quantize: 4bit with generation.engine: 'vllm'" in out, out[-2000:]
    assert "use generation.engine: hf, or lora.quantize: none" in out, out[-2000:]


@pytest.mark.parametrize("override", ["ppo.generation.tensor_parallel_size=2", "ppo.generation.placement=separate"])
def test_placing_an_engine_the_stage_does_not_start_is_refused_by_validate(workdir, override):
    """tensor_parallel_size and placement place an engine with its own copy of the policy; with the hf engine (which
    samples with each process's own model) they would do nothing: refused, naming the setting and both fixes."""
    from conftest import run_align

    p = run_align("validate", "pipelines/default.yaml", override, cwd=workdir)
    out = p.stdout + p.stderr
    key, value = override.split(".")[-1].split("=")
    assert p.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert f"stages.ppo.generation.{key}: " in out and value in out, out[-2000:]
    assert "'hf' samples with each process's own model" in out and "generation.engine: vllm" in out, out[-2000:]


def test_engines_that_cannot_be_placed_on_the_node_are_refused_before_launch():
    """`align run` asks the stage's own placement function before launching anything: tensor_parallel_size not
    dividing the processes per node (on a CPU too), separate engines on a node whose GPUs training takes; and more
    processes per node than GPUs visible."""
    from align.config import load_pipeline
    from align.orchestrator.launch import placement_problem
    from align.orchestrator.plan import build_plan

    source = REPO / "pipelines" / "default.yaml"

    def ppo(*overrides):
        cfg = load_pipeline(source, ["ppo.generation.engine=vllm", "ppo.accelerate=zero2", *overrides])
        return next(p for p in build_plan(cfg, source) if p.name == "ppo")

    shared = ppo("ppo.generation.tensor_parallel_size=2", "ppo.num_processes=3")
    problem = placement_problem(shared, source, None, gpus=0)
    assert problem.startswith("stages.ppo.generation: generation.tensor_parallel_size: 2 does not divide the 3")
    assert "(3 processes per node, 0 GPUs on this machine)" in problem
    assert placement_problem(shared, source, 4, gpus=0) == problem  # the stage's own count wins over --num-processes
    assert placement_problem(ppo("ppo.generation.tensor_parallel_size=2", "ppo.num_processes=4"), source, None, 0) is None
    launched = ppo("ppo.generation.tensor_parallel_size=2")  # processes from --num-processes
    assert "does not divide the 3" in placement_problem(launched, source, 3, 0)
    assert placement_problem(launched, source, 4, 0) is None
    apart = ppo("ppo.generation.placement=separate", "ppo.num_processes=8")
    assert "GPUs training does not use" in placement_problem(apart, source, None, gpus=8)
    assert placement_problem(apart, source, None, gpus=0) is None  # ignored on a CPU
    assert placement_problem(ppo("ppo.generation.engine=hf", "ppo.num_processes=3",
                                 "ppo.generation.tensor_parallel_size=1"), source, None, 0) is None
    # generation.sleep: vLLM's sleep mode is CUDA-only, and separate engines have nothing to give back
    asleep = ppo("ppo.generation.sleep=true", "ppo.num_processes=2")
    assert "sleeps on a GPU only" in placement_problem(asleep, source, None, gpus=0)
    assert placement_problem(asleep, source, None, gpus=2) is None
    assert "separate engines have GPUs of their own" in placement_problem(
        ppo("ppo.generation.sleep=true", "ppo.generation.placement=separate", "ppo.num_processes=2"), source, None, 4)
    # more processes per node than GPUs visible (an 8-process config under CUDA_VISIBLE_DEVICES=0,1,2,3), whatever
    # the engine: two processes would share a GPU and NCCL's first collective fail
    crowded = placement_problem(ppo("ppo.generation.engine=hf", "ppo.num_processes=8"), source, None, gpus=4)
    assert crowded.startswith("stages.ppo: 8 processes per node") and "--num-processes 4" in crowded, crowded
    assert placement_problem(ppo("ppo.generation.engine=hf", "ppo.num_processes=4"), source, None, gpus=4) is None


def test_an_engine_that_fails_before_its_broadcast_is_not_waited_for(tmp_path):
    """weight_sync: broadcast: the trainer broadcasts a chunk only once the engine says it waits in the broadcast; an
    engine whose part of the sync failed before (it answers with its error) ends the sync at once with that error and
    the group is dropped; before, the trainer sat in a broadcast nobody would join until the timeout (gloo cannot drop
    one: destroying its group waits for it)."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from align.engines.buckets import BroadcastBucket

    path = str(tmp_path / "group")
    peer = {}

    def engine_side():  # joins the group, then never takes part in a broadcast
        store = dist.FileStore(path, 2)
        store.set_timeout(datetime.timedelta(seconds=60))
        peer["group"] = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=60))

    joining = threading.Thread(target=engine_side, daemon=True)
    joining.start()
    bucket = BroadcastBucket(1 << 16, torch.device("cpu"), path, timeout_s=60)
    joining.join(60)

    class Answers:  # the engine's connection: its stream failed ("in place" set-up), so it answers with the error
        sent: list = []

        def send(self, msg):
            self.sent.append(msg["op"])

        def poll(self, timeout):
            return True

        def recv(self):
            return {"ok": False, "error": "RuntimeError: model.layers.0 keeps no weight (packed)"}

    engine = object.__new__(vllm_engine.VLLMEngine)  # its sync only: no process of vLLM's is started
    engine.conn, engine.broken, engine._held, engine.weight_sync = Answers(), None, {}, "broadcast"
    engine.proc, engine.log_path, engine.timeout_s, engine.bucket_bytes = None, tmp_path / "engine.log", 600, 1 << 16
    engine._bucket = bucket
    engine._open_bucket = lambda model: bucket
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="keeps no weight"):
        engine._sync_shared(torch.nn.Linear(64, 64), changed_only=False)
    assert time.monotonic() - t0 < 30 and engine.broken and engine._bucket is None
    assert Answers.sent == ["stream", "chunk"]


def test_sleep_with_an_engine_that_cannot_is_refused_by_validate(workdir):
    """generation.sleep with the hf engine (the stage's own model: nothing apart to free) is refused before anything
    runs, naming the setting and the engines that can."""
    from conftest import run_align

    p = run_align("validate", "pipelines/default.yaml", "ppo.generation.sleep=true", cwd=workdir)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "stages.ppo.generation.sleep: true, but 'hf' cannot free its memory" in out, out[-2000:]
    assert "generation.engine: vllm" in out, out[-2000:]


def test_sleep_on_a_stage_that_trains_nothing_is_refused_by_validate(workdir):
    """generation.sleep on evaluate (it samples every policy and scores, but trains nothing between rounds: its engine
    would never be put to sleep) is refused before anything runs, naming the stage and the setting."""
    from conftest import run_align

    p = run_align("validate", "pipelines/default.yaml", "evaluate.generation.engine=vllm",
                  "evaluate.generation.sleep=true", cwd=workdir)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "stages.evaluate.generation.sleep: true, but stage type 'evaluate' trains nothing" in out, out[-2000:]


def test_the_hf_engine_lets_go_of_the_policy_it_samples_from(tmp_path):
    """evaluate samples several policies in turn through the hf engine, which samples from the policy it is given:
    synced with None it holds none, so the stage's last reference frees each policy before the next loads (two 8B
    policies on one GPU otherwise)."""
    import gc
    import weakref

    import torch

    from align.config import Generation
    from align.engines import make_engine

    policy = torch.nn.Linear(2, 2)
    engine = make_engine(Generation(), model=None, tokenizer=None, model_dir=str(tmp_path))
    assert not engine.holds_own_weights
    engine.sync_weights(policy)
    held = weakref.ref(policy)
    del policy
    gc.collect()
    assert held() is not None  # the engine samples from it
    engine.sync_weights(None)
    gc.collect()
    assert held() is None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie no init reaps, as in a container, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_a_killed_engine_takes_its_worker_processes_with_it(tmp_path):
    """With tensor_parallel_size > 1 vLLM's workers are children of the engine's server, in its process group: killing
    the server alone (an engine past its deadline) left them holding their share of the GPUs, since vLLM's own
    shutdown, which stops them, never runs after a SIGKILL. The engine is killed as a group."""
    pidfile = tmp_path / "worker.pid"
    script = ("import subprocess, sys, time\n"
              "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pidfile)!r}, 'w').write(str(w.pid)); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)  # as VLLMEngine starts it
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int(pidfile.read_text())
        assert _alive(worker)
        vllm_engine.kill_group(proc)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker)
        vllm_engine.kill_group(proc)  # an engine already gone: nothing to do, no error (its group id may be reused)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_broadcast_between_two_torch_versions_goes_through_dev_shm_and_says_why():
    """weight_sync: broadcast joins the trainer and the engine's own venv in one NCCL group: two torch minor versions
    bring two NCCL libraries, which refuse to mix (the sync hung until its deadline). It goes through /dev/shm, as
    CUDA IPC already did across torch versions."""
    from align.engines.buckets import sync_transport

    separate = torch.device("cuda", 3)  # the trainer's GPU, not one of the engine's (0, 1): a broadcast
    assert sync_transport(separate, (0, 1), "broadcast", "2.13.0+cu128", "2.13.1", None) == ("broadcast", None)
    kind, why = sync_transport(separate, (0, 1), "broadcast", "2.13.0+cu128", "2.11.0", None)
    assert kind == "shared_memory" and "engine's torch (2.11.0)" in why and "NCCL" in why
    assert sync_transport(torch.device("cpu"), (), "broadcast", "2.13.0", "2.11.0", None) == ("broadcast", None)  # gloo
    assert sync_transport(torch.device("cuda", 0), (0,), "shared", "2.13.0", "2.13.0", "no IPC") == ("shared_memory",
                                                                                                     "no IPC")


def test_a_cuda_ipc_handle_the_engine_cannot_open_falls_back_to_dev_shm(tmp_path, monkeypatch):
    """The engine opens the trainer's CUDA IPC handle only at the first sync; where it cannot (a container without
    --ipc=host, another GPU numbering) the stage stopped with a hint to set weight_sync: host. Nothing was loaded
    then, so the sync now goes through /dev/shm and says why; the engine is not marked broken. The CPU stand-in: a
    bucket that calls itself cuda_ipc and an engine that answers as the server does when a bucket will not open."""
    from align.engines.buckets import Bucket, SharedBucket

    class IpcBucket(Bucket):  # CudaBucket's protocol on a CPU buffer (CudaBucket needs a GPU)
        kind, closed = "cuda_ipc", False

        def __init__(self, size):
            self.size, self.buffer = size, torch.zeros(size, dtype=torch.uint8)

        def where(self):
            return {"cuda": {"uuid": "GPU-0", "args": []}}

        def close(self):
            IpcBucket.closed = True

    class Answers:  # the engine's connection: the stream's bucket will not open; then a sync through /dev/shm
        sent: list = []
        replies = [{"ok": False, "unopened": True, "error": "RuntimeError: CUDA error: invalid resource handle"},
                   {"ok": True}, {"ok": True, "tensors": 2, "in_place": ""}]

        news: list = []
        sock = None

        def send(self, msg):
            self.sent.append((msg["op"], "cuda" in msg, "path" in msg))
            if "new" in msg:
                self.news.append(msg["new"])

        def fileno(self):  # where the descriptors of storages read where they lie are passed (weight_sync: shared)
            return self.sock.fileno()

        def poll(self, timeout):
            return True

        def recv(self):
            return self.replies.pop(0)

    engine = object.__new__(vllm_engine.VLLMEngine)  # its sync only: no process of vLLM's is started
    engine.conn, engine.broken, engine._held, engine.weight_sync, engine.ipc_problem = Answers(), None, {}, "host", None
    engine.proc, engine.log_path, engine.timeout_s, engine.bucket_bytes = None, tmp_path / "log", 60, 1 << 16
    engine._bucket, engine._synced, engine.lora_rank, engine.sync_seconds, engine.sync_bytes = None, None, 0, [], []
    engine.last_sync, engine.node_sync, engine._dir = {}, False, str(tmp_path)

    def open_bucket(model):  # as _open_bucket decides on a GPU: CUDA IPC until a problem is known, then /dev/shm
        if engine._bucket is None:
            engine._bucket = (IpcBucket(engine.bucket_bytes) if not engine.ipc_problem else
                              SharedBucket(str(tmp_path / "bucket"), engine.bucket_bytes))
        return engine._bucket

    engine._open_bucket = open_bucket
    model = torch.nn.Linear(64, 64)
    passes = []

    def entries(model, changed_only=False):  # engine_entries without DeepSpeed's gathers (partitioned below)
        passes.append(changed_only)
        yield from (("weight", model.weight.detach()), ("bias", model.bias.detach()))

    monkeypatch.setattr(vllm_sync, "engine_entries", entries)
    engine.sync_weights(model)
    assert Answers.sent == [("stream", True, False), ("chunk", False, False), ("stream", False, True),
                            ("chunk", False, False)]
    assert IpcBucket.closed and engine._bucket.kind == "shared_memory" and not engine.broken
    assert "invalid resource handle" in engine.ipc_problem and engine.sync_bytes == [64 * 64 * 4 + 64 * 4]
    assert passes == [False, False]  # every weight again through /dev/shm
    engine._bucket.close()

    # under ZeRO-3 the other processes would gather again with this one: the stage stops, naming the fix, as before
    Answers.sent, Answers.replies = [], [{"ok": False, "unopened": True, "error": "RuntimeError: invalid handle"}]
    engine.ipc_problem, engine._bucket, engine._synced = None, None, None
    model.weight.ds_id = 0  # as DeepSpeed marks a partitioned parameter
    with pytest.raises(EngineError, match="weight_sync: host"):
        engine.sync_weights(model)
    assert Answers.sent == [("stream", True, False), ("chunk", False, False)] and engine._bucket is None

    # weight_sync: shared: the storages the failed attempt shared went with the chunk the engine dropped; the
    # attempt through /dev/shm hands them over again (else the engine is named storages it never mapped)
    import socket
    from types import SimpleNamespace

    del model.weight.ds_id
    here, there = socket.socketpair()
    Answers.sock, Answers.news = here, []
    Answers.replies = [{"ok": False, "unopened": True, "error": "RuntimeError: invalid handle"}, {"ok": True},
                       {"ok": True, "tensors": 2, "in_place": ""}]
    engine.weight_sync, engine.proc = "shared", SimpleNamespace(pid=os.getpid(), poll=lambda: None)
    engine.ipc_problem, engine._bucket, engine._synced = None, None, None
    try:
        engine.sync_weights(model)
        assert len(Answers.news) == 2 and len(Answers.news[0]) == len(Answers.news[1]) == 2, Answers.news
        assert len(engine._held) == 2 and not engine.broken and engine.last_sync["host_tensors"] == 2
    finally:
        engine._bucket.close()
        here.close()
        there.close()


def test_a_file_sync_counts_every_process_of_the_node_writing_its_copy_at_once(monkeypatch, tmp_path):
    """With weight_sync: file every process's engine writes a whole copy of the policy into /dev/shm at the same
    point; each checked its own copy alone, and the fourth of four ran out of room mid-write (ENOSPC, not the fix)."""
    from types import SimpleNamespace

    from align.engines import vllm as engine

    gib = 2 ** 30
    monkeypatch.setattr(vllm_env.shutil, "disk_usage", lambda where: SimpleNamespace(free=3 * gib))
    assert vllm_env.sync_space_problem(str(tmp_path), gib) is None  # one copy fits
    problem = vllm_env.sync_space_problem(str(tmp_path), gib, 4)
    assert "writes the policy (4.00 GiB, 4 processes' copies at once)" in problem and "--shm-size=7g" in problem
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert engine.local_processes() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert engine.local_processes() == 1
