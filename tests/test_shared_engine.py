"""One rollout engine shared by the processes of a group (align/engines/group.py, placement.py): on a CPU,
generation.tensor_parallel_size 2 puts both processes of a node on one engine that the first starts and syncs.

Stand-ins first (two gloo processes, no vLLM): the second process reaches the first's engine by its contact, both
sample through it, a sync is the starter's while the other joins its gathers, and a failure of either side (the
engine's start, the sync, the other's part of it) ends both processes with an error naming it instead of leaving one
waiting for the other. Then the real thing, vLLM on the packaged SmolLM2 with both processes on one engine: PPO
under 2-process ZeRO-3 (~200 s) and GRPO under ZeRO-2 (~80 s alone), both in the long tier: one engine process, and every iteration's engine
log-probs equal the trained policy's on both processes (the second samples through the first's engine after the
first's syncs).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

PROBE = REPO / "tests" / "probes" / "shared_engine_probe.py"


def two_processes(tmp_path, scenario: str) -> list[dict]:
    store = tmp_path / f"store-{scenario}"
    outs = [tmp_path / f"{scenario}-{r}.json" for r in (0, 1)]
    procs = [subprocess.Popen([sys.executable, str(PROBE), str(r), str(store), scenario, str(outs[r])],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    for p in procs:
        try:
            log = p.communicate(timeout=120)[0].decode()
        except subprocess.TimeoutExpired:  # one waits for the other forever: the failure this file is about
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a process did not finish within 120 s")
        assert p.returncode == 0, log[-3000:]
    return [json.loads(o.read_text()) for o in outs]


def _server(monkeypatch):
    """The engine's server module (vllm_side/align_vllm_server.py), loaded by path as the engine's process runs it,
    with its directory on sys.path (it imports align_vllm_worker from there, as the engine's process does)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "align/engines/vllm_side"))
    spec = importlib.util.spec_from_file_location("server", REPO / "align/engines/vllm_side/align_vllm_server.py")
    server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(server)
    return server


def test_the_second_process_samples_through_the_engine_the_first_starts_and_syncs(tmp_path):
    first, second = two_processes(tmp_path, "ok")
    assert first["owner"] and not second["owner"] and first["serves"] == second["serves"] == [0, 1]
    assert first["clients"] == 2 and "clients" not in second  # one start, for both
    assert second["attached_to"]["address"] == "engine-of-process-0"
    assert first["sampled"] == ["owner:p0"] and second["sampled"] == ["client:p1"]
    # the starter alone puts it to sleep; before the sync wakes its weights and again before sampling wakes the rest,
    # every process gives back its cached GPU memory, and the starter syncs only once the other has (it came late)
    # and both let the policy go (base.release): the other forgets its last sync too, so its next join takes every
    # weight's gathers as the starter's next sync sends every weight (under ZeRO-3 the collectives line up)
    assert first["calls"] == ["generate 1", "sleep", "free", "sync", "free", "generate 1", "release", "close"]
    assert second["calls"] == ["generate 1", "free", "join", "free", "generate 1", "release", "close"]
    assert first["sync_at"] >= second["free_at"][0] >= first["free_at"][0] + 0.8
    assert first["syncs"] == second["syncs"] == 1
    assert second["described"] == {"name": "stand_in", "started_by_process": 0, "shared_by_local_ranks": [0, 1]}
    assert first["described"]["pid"] == second["attached_to"]["pid"]


@pytest.mark.parametrize("scenario, first_error, second_error", [
    ("start_fails", "RuntimeError: engine ran out of memory", "EngineError: process 0's rollout engine did not start "
                                                               "(RuntimeError: engine ran out of memory)"),
    ("sync_fails", "RuntimeError: bucket mapping failed", "EngineError: the weight sync of process 0's engine failed "
                                                          "(RuntimeError: bucket mapping failed)"),
    ("join_fails", "EngineError: the weight sync of process 1's engine failed (RuntimeError: gather failed)",
     "RuntimeError: gather failed"),
    ("attach_fails", "EngineError: process 1 could not reach its rollout engine (ConnectionRefusedError: engine "
                     "socket refused", "ConnectionRefusedError: engine socket refused the connection"),
    ("sleep_fails", "RuntimeError: cuMemUnmap failed", "EngineError: process 0's engine failed to sleep (RuntimeError: "
                                                       "cuMemUnmap failed); every process stops with it"),
    ("release_fails", "RuntimeError: engine lost the mapping", "EngineError: process 0's engine failed to let the "
                                                               "policy go (RuntimeError: engine lost the mapping)"),
])
def test_a_failure_on_either_side_stops_both_processes_with_its_cause(tmp_path, scenario, first_error, second_error):
    first, second = two_processes(tmp_path, scenario)
    assert first["error"].startswith(first_error), first
    assert second["error"].startswith(second_error), second
    if scenario == "attach_fails":  # the engine nobody else can reach is stopped by its starter, at once
        assert first["started_calls"] == ["kill"], first
    if scenario == "sync_fails":  # closed while the error is raised: the starter stops the engine at once
        assert first["calls"] == ["generate 1", "sleep", "free", "sync", "kill"], first
    if scenario == "release_fails":  # the other learnt of it at once, not at the next sync's gathers
        assert second["calls"][-2:] == ["release", "close"], second
    if scenario == "sleep_fails":  # the other process waited for the sleep and learnt it failed: nobody syncs
        assert first["calls"] == ["generate 1", "sleep", "kill"] and second["calls"] == ["generate 1", "close"]


def test_an_engine_of_its_own_that_fails_to_start_stops_every_process(tmp_path):
    """Every process with an engine of its own (colocated, tensor_parallel_size 1): one that fails to start (its GPU
    out of memory) used to raise on that process alone, the others going on into ZeRO-3's collectives until the
    launcher stopped them as interrupted. Now every process learns of it at once and raises: its own error, or an
    EngineError naming the process; the engine started on the other is stopped. When all start, all sample."""
    ok, failed = two_processes(tmp_path, "own_ok"), two_processes(tmp_path, "own_start_fails")
    assert [r["sampled"] for r in ok] == [["owner:p0"], ["owner:p1"]] and all("error" not in r for r in ok)
    assert failed[1]["error"] == "RuntimeError: CUDA out of memory on GPU 1" and failed[1]["started_calls"] is None
    assert failed[0]["error"] == ("EngineError: process 1's rollout engine did not start (RuntimeError: CUDA out of "
                                  "memory on GPU 1); every process stops with it")
    assert failed[0]["started_calls"] == ["kill"] and "sampled" not in failed[0]


def test_the_engine_serves_what_arrives_together_in_one_batch_and_only_its_starter_syncs(monkeypatch):
    """The engine's server (vllm_side/align_vllm_server.py serve_received), with a stand-in for vLLM: generate
    requests that arrive together with the same settings become one batch, each process's reply holding its own rows
    in order; other settings get their own batch; a bad request fails only its own process (unless the failed batch
    left its requests in vLLM: then every process of it); a process other than the starter may not sync or close the
    engine, and the starter's close is noted (answered once the others have gone)."""
    server = _server(monkeypatch)
    batches = []

    def stand_in(llm, msg):  # one reply row per prompt: its ids reversed, tagged with the settings
        batches.append([p[0] for p in msg["prompts"]])
        if [99] in msg["prompts"]:
            raise ValueError("prompt 99 is longer than max_model_len")
        return {"outputs": [{"token_ids": p[::-1], "logprobs": [msg["temperature"]] * len(p)} for p in msg["prompts"]]}

    monkeypatch.setattr(server, "generate", stand_in)
    parent, second, third = "parent", "second", "third"
    settings = {"op": "generate", "temperature": 1.0, "max_tokens": 4}
    class Engine:  # vLLM's LLMEngine: whether a failed batch left requests in it
        unfinished = False

        def has_unfinished_requests(self):
            return self.unfinished

    class LLM:
        llm_engine = Engine()

    state = {"llm": LLM(), "closing": False, "expected": 2}
    replies = dict(server.serve_received(state, parent, [
        (parent, {**settings, "prompts": [[1, 2], [3]]}),
        (second, {**settings, "prompts": [[4, 5, 6]]}),
        (third, {**settings, "temperature": 0.5, "prompts": [[7]]}),
    ]))
    assert batches == [[1, 3, 4], [7]]  # parent's and second's together; third's settings apart
    assert replies[parent]["outputs"] == [{"token_ids": [2, 1], "logprobs": [1.0, 1.0]},
                                          {"token_ids": [3], "logprobs": [1.0]}]
    assert replies[second]["outputs"] == [{"token_ids": [6, 5, 4], "logprobs": [1.0] * 3}]
    assert replies[third]["outputs"] == [{"token_ids": [7], "logprobs": [0.5]}]
    refused = server.serve_received(state, parent, [(second, {"op": "stream"}), (third, {"op": "close"})])
    assert [c for c, _ in refused] == [second, third] and not any(r["ok"] for _, r in refused)
    assert "engine starter's to ask" in refused[0][1]["error"] and not state["closing"]
    # a bad request in a batch: the batch fails, then each is served alone, so only its own process gets the error
    batches.clear()
    mixed = dict(server.serve_received(state, parent, [(parent, {**settings, "prompts": [[1]]}),
                                                       (second, {**settings, "prompts": [[99]]}),
                                                       (third, "not a request")]))
    assert batches == [[1, 99], [1], [99]] and mixed[parent]["ok"] and mixed[parent]["outputs"][0]["token_ids"] == [1]
    assert not mixed[second]["ok"] and "longer than max_model_len" in mixed[second]["error"]
    assert not mixed[third]["ok"] and "not a request" in mixed[third]["error"]
    # a batch that failed while decoding leaves its requests in vLLM, which the next batch would return as its own:
    # no request is served alone then; every process of the batch gets the error
    batches.clear()
    LLM.llm_engine.unfinished = True
    stuck = dict(server.serve_received(state, parent, [(parent, {**settings, "prompts": [[1]]}),
                                                       (second, {**settings, "prompts": [[99]]})]))
    assert batches == [[1, 99]] and not stuck[parent]["ok"] and not stuck[second]["ok"]
    assert "longer than max_model_len" in stuck[parent]["error"]
    assert server.serve_received(state, parent, [(parent, {"op": "close"})]) == [] and state["closing"]


def test_a_sleeping_engine_is_woken_by_whatever_comes_next(monkeypatch):
    """generation.sleep on the engine's server: `sleep` puts vLLM to sleep once (level 1; asked again, nothing); the
    next request wakes what it needs: a generate from any process all of it, a sync its weights alone (the KV cache
    comes back at the next generate); a sleep after a sync alone puts the weights back to sleep without waking the
    cache (vLLM sleeps an engine whose weights are awake). A stand-in for vLLM's LLM records it."""
    server = _server(monkeypatch)
    calls = []

    class LLM:
        def sleep(self, level):
            calls.append(f"sleep {level}")

        def wake_up(self, tags=None):
            calls.append(f"wake {','.join(tags)}")

    monkeypatch.setattr(server, "generate", lambda llm, msg: calls.append("generate") or {"outputs": [{}]})
    state = {"llm": LLM(), "closing": False, "expected": 1}
    gen = {"op": "generate", "temperature": 1.0, "prompts": [[1]]}
    for _ in range(2):
        assert server.serve_received(state, "parent", [("parent", {"op": "sleep"})]) == [("parent", {"ok": True})]
    server.serve_received(state, "parent", [("other", gen)])
    server.serve_received(state, "parent", [("other", gen)])
    assert calls == ["sleep 1", "wake weights,kv_cache", "generate", "generate"]
    calls.clear()
    server.serve_received(state, "parent", [("parent", {"op": "sleep"})])
    server.serve_received(state, "parent", [("parent", {"op": "lora", "path": "/nonexistent", "id": 1})])
    server.serve_received(state, "parent", [("other", gen)])
    # a sync (here an adapter's, which then fails) wakes the weights alone; the generate after it the KV cache
    assert calls == ["sleep 1", "wake weights", "wake kv_cache", "generate"]
    calls.clear()
    for op in ("sleep", "lora", "sleep"):
        server.serve_received(state, "parent", [("parent", {"op": op, "path": "/nonexistent", "id": 1})])
    assert calls == ["sleep 1", "wake weights", "sleep 1"]  # the weights back to sleep; the cache was never woken
    calls.clear()
    server.serve_received(state, "parent", [("other", gen)])
    assert calls == ["wake weights,kv_cache", "generate"]  # asleep in full again


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_ppo_with_both_processes_on_one_vllm_engine(tmp_path):
    """Full-weight PPO under 2-process ZeRO-3, generation.tensor_parallel_size 2 on a CPU: process 0 starts one vLLM
    engine for both and syncs it (process 1 writes its partitions into the node's bucket), process 1 samples through it. One
    engine process and one engine log; on both processes, every iteration's engine log-probs equal the trained
    policy's within 1e-3 (the gap is the max over processes), so process 1 never sampled before a sync was done."""
    from test_vllm_ppo import PIPELINE, gaps_per_iteration

    from conftest import run_align

    (tmp_path / "p.yaml").write_text(PIPELINE.format(repo=REPO))
    ppo = tmp_path / "runs" / "vllm_ppo" / "main" / "ppo"
    first = run_align("run", "p.yaml", "--only", "sft", cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    out = run_align("run", "p.yaml", "--only", "ppo", "ppo.accelerate=zero3", "ppo.num_processes=2",
                    "ppo.lora.enabled=false", "ppo.learning_rate=1.0e-5", "ppo.kl.heldout_prompts=0",
                    "ppo.iterations=3", "ppo.generation.tensor_parallel_size=2", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    m = json.loads((ppo / "manifest.json").read_text())
    assert m["status"] == "completed" and m["world_size"] == 2 and m["zero_stage"] == 3
    assert m["engine"]["started_by_process"] == 0 and m["engine"]["shared_by_local_ranks"] == [0, 1]
    assert m["engine"]["weight_sync"] == "shared" and m["engine"]["devices"] == []
    assert m["engine"]["sync_transport"] == "node_shared_memory", m["engine"]
    assert sorted(p.name for p in ppo.glob("engine*.log")) == ["engine.rank0.log"]  # one engine, not one per process
    gaps = gaps_per_iteration(ppo)
    assert sorted(gaps) == [1, 2, 3] and max(gaps.values()) < 1e-3, gaps


@pytest.mark.slow
@pytest.mark.distributed
def test_grpo_under_zero2_with_both_processes_on_one_vllm_engine(tmp_path):
    """GRPO (TRL's rollout_func) under 2-process ZeRO-2, both processes on one vLLM engine (tensor_parallel_size 2 on
    a CPU): process 0 syncs it after each optimiser step, process 1 samples through it; 3 steps complete and every
    round's engine log-probs equal the trained policy's within 1e-3 on both processes (~80 s)."""
    import yaml
    from test_vllm_online_rl import PIPELINE

    from conftest import run_align

    pipeline = {**PIPELINE, "stages": {"sft": PIPELINE["stages"]["sft"], "grpo": {
        **PIPELINE["stages"]["grpo"], "lora": {"enabled": False}, "learning_rate": 1.0e-5, "accelerate": "zero2",
        "num_processes": 2, "per_device_batch_size": 4,
        "generation": {**PIPELINE["stages"]["grpo"]["generation"], "tensor_parallel_size": 2}}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(pipeline))
    proc = run_align("run", "p.yaml", cwd=tmp_path, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stage = tmp_path / "runs" / "vllm_online" / "main" / "grpo"
    m = json.loads((stage / "manifest.json").read_text())
    assert m["status"] == "completed" and m["global_step"] == 3 and m["world_size"] == 2
    assert m["engine"]["shared_by_local_ranks"] == [0, 1]
    assert sorted(p.name for p in stage.glob("engine*.log")) == ["engine.rank0.log"]
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines() if x.strip()]
    gaps = [r["rollout/logprob_gap_max"] for r in rows if "rollout/logprob_gap_max" in r]
    print("log-prob gap per logged step:", gaps)
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps


def test_the_engine_keeps_accepting_after_a_garbled_handshake_and_a_silent_one_is_an_error(tmp_path, monkeypatch):
    """The engine's accepting thread (align_vllm_server.accept_others) survives a connection whose handshake is
    garbage (an OSError "bad message length", which once ended the thread, leaving the processes still to come
    hanging), and a process whose engine never accepts gets an EngineError by its deadline (vllm_client._dial:
    multiprocessing's handshake itself has none)."""
    import socket
    import threading
    import time
    from multiprocessing.connection import Listener

    from align.engines import EngineError
    from align.engines.vllm_client import _dial

    server = _server(monkeypatch)
    key, address = b"k" * 16, str(tmp_path / "sock")
    with Listener(address, authkey=key) as listener:
        others, accepted = [], []
        server.accept_others(listener, others, accepted, 1, threading)
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(address)
            raw.sendall(b"\xff" * 12)  # a length of -1, then an 8-byte one far past the challenge's 256 bytes
            time.sleep(0.5)
        with _dial(address, key, time.monotonic() + 10) as ours:  # on the old thread: no accept, an EngineError
            deadline = time.monotonic() + 10
            while not accepted and time.monotonic() < deadline:
                time.sleep(0.05)
            assert accepted == [True] and len(others) == 1
            others[0].send("hello")
            assert ours.recv() == "hello"
            others[0].close()
    silent = str(tmp_path / "silent")
    with Listener(silent, authkey=key):  # listening, never accepting
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="did not accept a connection by its deadline"):
            _dial(silent, key, time.monotonic() + 2)
        assert time.monotonic() - t0 < 10


def test_after_a_release_the_other_process_joins_every_weights_gathers(monkeypatch):
    """The starter's engine sends every weight at its first sync after base.release (it no longer maps the last
    policy); the other process must then join every weight's ZeRO-3 gathers too, not only the trained ones', or the
    two processes' collectives no longer line up and both wait until the group's timeout."""
    import torch

    from align.engines import vllm_client

    joined = []
    monkeypatch.setattr(vllm_client, "join_gathers", lambda model, how: joined.append(how))
    client = object.__new__(vllm_client.SharedClient)  # its sync bookkeeping only: no engine to reach
    client.adapters, client.weight_sync, client._synced, client.timeout_s = False, "host", None, 60
    model = torch.nn.Linear(2, 2)
    client.join_sync(model)
    client.join_sync(model)
    client.release()
    client.join_sync(model)
    assert joined == ["whole", "changed", "whole"]
