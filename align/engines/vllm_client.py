"""Talking to a vLLM engine process (align/engines/vllm_side/align_vllm_server.py): `EngineClient` connects, sends
requests and reads their replies, each within a deadline while watching the process (a dead or silent engine is an
EngineError naming the operation and the engine's log, never a hang), and samples through it. `VLLMEngine`
(align/engines/vllm.py) is the client that starts the engine and syncs it; `SharedClient` is how the other processes
of a shared engine (align/engines/group.py) reach it: they sample, and join the syncs the starter makes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import weakref
from multiprocessing.connection import Client
from multiprocessing.reduction import send_handle
from pathlib import Path

import torch

from align.engines import EngineError, node_bucket
from align.engines.base import free_cached_memory
from align.engines.vllm_env import shm_dir
from align.engines.weight_sync import join_gathers
from align.modeling.generation import Rollout, finish_rollout, tokenize_prompts


def kill_group(proc) -> None:
    """SIGKILL an engine's server and every process of its group (it starts in a session of its own: with
    tensor_parallel_size > 1 its vLLM workers are there, and vLLM's own shutdown, which stops them, never runs after
    a SIGKILL). Only while the server lives, so that its group id cannot be another's."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


class BucketUnopened(EngineError):
    """The engine could not open the bucket a sync announced (a CUDA IPC handle it cannot map): it loaded nothing,
    dropped the chunk sent meanwhile, and can be synced another way."""


class EngineClient:
    """The requests every user of an engine process makes. Subclasses set tokenizer, timeout_s, clients (processes the
    engine serves), address, conn, proc (poll(), pid, returncode), log_path and broken (why it may not be used, or
    None)."""

    name = "vllm"
    holds_own_weights = True

    # -- transport -----------------------------------------------------------------------------------------------
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-15:])

    def _connect(self, key: bytes, deadline: float):
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"the vLLM engine process exited ({self.proc.returncode}) before it listened; its "
                                  f"log ({self.log_path}) ends:\n{self._tail()}")
            if os.path.exists(self.address):
                try:
                    return _dial(self.address, key, deadline)
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            if time.monotonic() > deadline:
                raise EngineError(f"the vLLM engine process did not accept a connection within 120 s (log: "
                                  f"{self.log_path})")
            time.sleep(0.2)

    def _call(self, msg: dict, what: str, timeout_s: float) -> dict:
        """Send one request and wait for its reply, both by one deadline `timeout_s` away, watching the process: a
        dead or silent engine is an EngineError (and the engine is stopped), never a hang."""
        deadline = time.monotonic() + timeout_s
        self._send(msg, what, deadline=deadline)
        return self._reply(msg["op"], what, deadline, seconds=timeout_s)

    def _send(self, msg: dict, what: str, fds=(), deadline: float | None = None) -> None:
        """`msg`, then the file descriptors `fds` (passed over the Unix socket, in order, after the message), by
        `deadline` (time.monotonic; default timeout_s from now): a message larger than the socket's buffer waits
        until the engine reads it, and an engine that never does (wedged serving another process) is an EngineError
        like a reply that never comes, not a send that blocks forever."""
        if self.conn is None:
            raise EngineError(f"vLLM engine: '{what}' after close()")
        if self.broken:
            raise EngineError(f"vLLM engine: '{what}' after a failed weight sync ({self.broken}); its weights are "
                              "partly loaded and it samples nothing trustworthy")

        def write():
            self.conn.send(msg)
            for fd in fds:
                send_handle(self.conn, fd, self.proc.pid)

        # at least a second: a sync's deadline may pass while the trainer gathers, and a request the engine takes at
        # once must still go (the reply's wait gives the same grace)
        deadline = max(time.monotonic() + 1.0, time.monotonic() + self.timeout_s if deadline is None else deadline)
        try:
            if _by_deadline(write, deadline, alive=lambda: self.proc.poll() is None):
                return
        except OSError as exc:  # the engine died between calls: a broken pipe here, never an unnamed EPIPE upstream
            raise EngineError(f"the vLLM engine process (pid {self.proc.pid}) is gone ({type(exc).__name__}) at "
                              f"'{what}'; its log ({self.log_path}) ends:\n{self._tail()}") from None
        if self.proc.poll() is not None:
            raise EngineError(f"the vLLM engine process (pid {self.proc.pid}) died ({self.proc.returncode}) during "
                              f"'{what}'; its log ({self.log_path}) ends:\n{self._tail()}")
        with contextlib.suppress(OSError):  # the write left blocked fails now (a shared engine, not killed here, then
            with socket.socket(fileno=os.dup(self.conn.fileno())) as s:  # sees this process gone, not its request)
                s.shutdown(socket.SHUT_RDWR)
        self.close(kill=True)
        raise EngineError(f"the vLLM engine did not take the request '{what}' by its deadline"
                          f"{' and was stopped' if self.stops_engine else ''} (log: {self.log_path}); raise "
                          "generation.engine_timeout_s if the work before it is that long")

    stops_engine = True  # a timed-out call stops the engine (a SharedClient only disconnects from it)
    asleep = ""  # generation.sleep: "all" once this process put the engine to sleep, "cache" when a sync woke its weights

    def _make_room(self, waking: str) -> None:
        """Before a request of this process that wakes an engine it put to sleep, a sync its weights (`waking`
        "weights") and sampling the rest ("all"): what the process's caching allocator holds unused goes back to the
        GPU (free_cached_memory: training's, then the sync's temporaries)."""
        if self.asleep:
            free_cached_memory()
            self.asleep = "cache" if waking == "weights" else ""

    def _reply(self, op: str, what: str, deadline: float, failed=None, seconds: float | None = None) -> dict:
        """The engine's answer to the request `op` sent last, by `deadline` (time.monotonic; `seconds` from the request,
        when not timeout_s); `failed`, when given, is asked while waiting for an error of this side's own part of the
        request (raised at once when there is one)."""
        while not self.conn.poll(0.2 if failed else 1.0):
            if failed is not None and failed() is not None:
                raise failed()
            if self.proc.poll() is not None:
                raise EngineError(f"the vLLM engine process (pid {self.proc.pid}) died ({self.proc.returncode}) during "
                                  f"'{what}'; its log ({self.log_path}) ends:\n{self._tail()}")
            if time.monotonic() > deadline:
                self.close(kill=True)
                raise EngineError(f"the vLLM engine did not finish '{what}' within {seconds or self.timeout_s:.0f} s"
                                  f"{' and was stopped' if self.stops_engine else ''} (log: {self.log_path}); raise "
                                  "generation.engine_timeout_s if the work is that long")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError) as exc:  # a peer that exits with our message unread resets the socket
            for _ in range(25):  # the engine is exiting: up to 5 s for its exit status
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
            died = (f" (process {self.proc.pid} exited {self.proc.returncode})" if self.proc.poll() is not None
                    else f" ({type(exc).__name__})")
            raise EngineError(f"the vLLM engine closed the connection during '{what}'{died} (log: {self.log_path}):\n"
                              f"{self._tail()}") from None
        if not reply.get("ok"):
            if reply.get("unopened"):  # the engine could not open the sync's bucket: it loaded nothing
                raise BucketUnopened(f"the vLLM engine could not open the weight bucket: {reply.get('error')}")
            if op in ("load", "stream", "chunk", "ready", "lora", "join"):
                self.broken = reply.get("error")
            hint = ("; the bucket is on the GPU, shared by CUDA IPC: generation.weight_sync: host syncs through "
                    "/dev/shm instead" if op in ("stream", "chunk") and getattr(getattr(self, "_bucket", None), "kind",
                                                                                "") == "cuda_ipc" else "")
            raise EngineError(f"the vLLM engine failed '{what}': {reply.get('error')} (traceback in "
                              f"{self.log_path}){hint}")
        return reply

    # -- the engine interface ----------------------------------------------------------------------------------
    def generate(self, prompts: list[str], gen, seed: int, max_prompt_length: int | None = None,
                 greedy: bool = False) -> Rollout:
        """One response per prompt, as the HF engine's Rollout: prompts left-padded, responses right-padded, every
        token after the first EOS masked; `engine_logprobs` (B, Lr) holds the engine's log-probs of them. `seed`
        is not used per request (a per-request seed crashes vLLM's CPU sampler): the engine is seeded once."""
        q_ids, q_mask = tokenize_prompts(self.tokenizer, prompts, max_prompt_length)
        return self.generate_ids(q_ids, q_mask, gen, seed, greedy)

    def generate_ids(self, q_ids: torch.Tensor, q_mask: torch.Tensor, gen, seed: int, greedy: bool = False) -> Rollout:
        """`generate` for prompts already tokenised (left-padded ids and mask), as TRL's trainers hold them."""
        tok = self.tokenizer
        ids = [row[m.bool()].tolist() for row, m in zip(q_ids, q_mask)]
        self._make_room("all")
        # a shared engine may serve a batch of every process it serves before (and with) this one
        reply = self._call({"op": "generate", "prompts": ids, "temperature": gen.temperature, "top_k": gen.top_k,
                            "top_p": gen.top_p, "max_tokens": gen.max_new_tokens, "greedy": greedy,
                            "stop_token_ids": [tok.eos_token_id]}, "generate", self.timeout_s * self.clients)
        outs = reply["outputs"]
        if len(outs) != len(ids):
            raise EngineError(f"the vLLM engine answered {len(ids)} prompts with {len(outs)} responses (log: "
                              f"{self.log_path}): a failed batch left requests in it; the stage stops")
        lengths = torch.tensor([len(o["token_ids"]) for o in outs], dtype=torch.long)
        width = max(1, int(lengths.max()))
        resp = torch.full((len(outs), width), tok.pad_token_id, dtype=torch.long)
        lps = torch.zeros((len(outs), width), dtype=torch.float32)
        for i, (o, n) in enumerate(zip(outs, lengths.tolist())):
            resp[i, :n] = torch.tensor(o["token_ids"], dtype=torch.long)
            lps[i, :n] = torch.tensor(o["logprobs"], dtype=torch.float32)
        r = finish_rollout(q_ids, q_mask, resp, tok.eos_token_id, tok.pad_token_id, lengths)
        r.engine_logprobs = lps * r.response_mask
        return r


def _by_deadline(work, deadline: float, alive=lambda: True) -> bool:
    """Run `work()` in a thread this one stops waiting for at `deadline` (time.monotonic) or once `alive()` is false
    (the peer died): True when it finished, False when it did not (the thread is left, a daemon, blocked on a
    connection the caller shuts down); its exception is raised here."""
    import threading

    out: dict = {}

    def run():
        try:
            work()
            out["done"] = True
        except BaseException as exc:  # raised below, in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    while True:
        t.join(max(0.0, min(0.2, deadline - time.monotonic())))
        if not t.is_alive() or time.monotonic() >= deadline or not alive():
            break
    if "error" in out:
        raise out["error"]
    return "done" in out


def _dial(address: str, key: bytes, deadline: float):
    """multiprocessing's Client by `deadline` (time.monotonic, at least a second away): its authentication handshake
    waits without one when the listener never accepts (an engine whose accepting stopped)."""
    out: dict = {}
    if not _by_deadline(lambda: out.update(conn=Client(address, authkey=key)), max(deadline, time.monotonic() + 1)):
        raise EngineError(f"the vLLM engine at {address} did not accept a connection by its deadline")
    return out["conn"]


class _Started:
    """Another process's engine process, watched by its pid (what `subprocess.Popen` gives its starter)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.returncode = -1
        except PermissionError:  # alive, another user's
            pass
        return self.returncode


class SharedClient(EngineClient):
    """A process's connection to the engine another process started for both (align/engines/group.py): it samples
    through it; at a sync it joins the gathers the starter's sync takes part in (weight_sync.join_gathers, which
    mirrors VLLMEngine.sync_weights: the adapter, every weight the first time or with the file transport, else the
    weights that train). Closing it disconnects; the engine is the starter's to stop."""

    stops_engine = False

    def __init__(self, contact: dict, tokenizer, timeout_s: float):
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.address, self.proc, self.log_path = contact["address"], _Started(contact["pid"]), Path(contact["log"])
        self.weight_sync, self.adapters, self.sleeps = contact["weight_sync"], contact["adapters"], contact["sleeps"]
        self.clients = contact["clients"]
        self.broken: str | None = None
        self.conn = None
        self.conn = self._connect(bytes.fromhex(contact["key"]), deadline=time.monotonic() + 120)
        self._synced = None

    def join_sync(self, model) -> None:
        changed_only = self._synced is not None and self._synced() is model
        how = ("adapter" if self.adapters and hasattr(model, "peft_config") else
               "changed" if changed_only and self.weight_sync != "file" else "whole")
        node = None
        if how != "adapter" and self.weight_sync in node_bucket.SYNCS:  # as VLLMEngine._sync_shared decides
            node = node_bucket.for_model(model, 0, self.timeout_s, shm_dir())
        if node:
            node_bucket.join(node, model, changed_only=how == "changed")
        else:
            join_gathers(model, how)
        self._synced = weakref.ref(model)

    def release(self) -> None:
        """base.release, as the starter's engine does it (group.py): the next sync of any model joins every weight's
        gathers."""
        self._synced = None

    def close(self, kill: bool = False) -> None:
        node_bucket.forget()  # as VLLMEngine.close: at the same point on every process
        if self.conn is not None:
            self.conn.close()
            self.conn = None
