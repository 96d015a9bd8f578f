"""tests/test_node_bucket.py's probe, run by `accelerate launch` under 2-process ZeRO-3 (gloo): a small model with
weights whose sizes do not split evenly (DeepSpeed pads their last part), synced through the node's bucket
(align/engines/node_bucket.py) as VLLMEngine._sync_shared streams it, each process's "engine" the engine's own reader
(vllm_side: the server's mapping of the bucket, the worker's bucket_tensors) in a thread over a pipe. After each
optimiser step the tensors read equal the gathered weights (weight_sync.policy_state_for_engine) bit for bit.

    accelerate launch --config_file pipelines/accelerate/zero3.yaml --num_processes 2 node_bucket_probe.py DIR OUT
"""

from __future__ import annotations

import json
import os
import sys
import threading
from multiprocessing import Pipe
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "align" / "engines" / "vllm_side"))
import align_vllm_buckets  # noqa: E402  (the engine's side: maps the bucket its message names)
import align_vllm_worker  # noqa: E402  (the engine's reader)

from align.engines import node_bucket  # noqa: E402
from align.engines.buckets import chunk_messages  # noqa: E402
from align.engines.weight_sync import policy_state_for_engine  # noqa: E402

SEED = 31
BUCKET = 1000  # bytes, asked by process 0; the node's is twice that, in halves of 1000: most weights span several
# chunks, and a chunk several weights and both processes' parts


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(101, 7)  # 707 elements: odd, padded under 2 processes
        self.layers = torch.nn.ModuleList([torch.nn.Linear(7, 33), torch.nn.Linear(33, 7)])
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.norm(h).pow(2).sum()


def engine_reads(path: str, conn, got: dict, errors: list) -> None:
    try:
        view = align_vllm_buckets.bucket({"path": path, "size": 2 * BUCKET})
        for name, t in align_vllm_worker.bucket_tensors(conn, view):
            got[name] = t.clone()
    except Exception as exc:  # reported in the output
        errors.append(repr(exc))


def sync(bucket, model, changed_only: bool, reads: bool, stop_after: int | None = None,
         refuse_after: int | None = None, closes: bool = False) -> dict | None:
    """One sync through the node's bucket as VLLMEngine._sync_shared makes it; `reads`: this process's engine loads
    it (else it only joins); `stop_after`: this process fails after sending that many chunks and drains the rest (as
    _sync_shared does on an error); `refuse_after`: the engine's acknowledgement of that chunk is an error, and with
    `closes` a timeout, where the engine is closed first (its close forgets the node's bucket, as VLLMEngine.close)."""
    if not reads:
        node_bucket.join(bucket, model, changed_only)
        return None
    trainer, engine = Pipe()
    got, errors, acks = {}, [], [0]
    reader = threading.Thread(target=engine_reads, args=(bucket.path, engine, got, errors))
    reader.start()

    def loaded():  # the engine's acknowledgement of the chunk sent before
        assert trainer.recv() == {"ok": True, "op": "chunk"}
        acks[0] += 1
        if acks[0] == refuse_after and closes:
            node_bucket.forget()
            raise RuntimeError("the engine did not finish in time and was stopped (the probe says so)")
        if acks[0] == refuse_after:
            raise RuntimeError("the engine failed to load a chunk (the probe says so)")

    bucket.loaded = loaded
    chunks = chunk_messages(bucket, model, node_bucket.shares(model, changed_only), None)
    try:
        for i, (msg, _, _) in enumerate(chunks):
            if i == stop_after:
                bucket.loaded = None
                node_bucket.drain(chunks)
                break
            trainer.send(msg)
    except RuntimeError as exc:
        errors.append(f"raised: {exc}")
    if stop_after is not None or refuse_after is not None:
        trainer.send({"op": "close"})  # the reader stops with an error: the stream ended mid-way
    reader.join(60)
    return {"got": got, "errors": errors}


def compare(read: dict | None, want: dict) -> dict | None:
    if read is None:
        return None
    got = read["got"]
    return {"names": list(got) == list(want), "equal": all(torch.equal(got[k], v) for k, v in want.items() if k in got),
            "errors": read["errors"]}


def main(directory: str, out: str) -> None:
    from accelerate import Accelerator, PartialState

    from align.runtime.process import no_cpu_shm_op

    no_cpu_shm_op()  # as a stage process does: DeepSpeed on CPU compiles no shared-memory op
    PartialState(cpu=not torch.cuda.is_available())  # gloo on a CPU, before the accelerator
    acc = Accelerator()
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2  # as the ids below
    torch.manual_seed(SEED)
    net = Net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    inner, rank = acc.unwrap_model(model), acc.process_index
    ids = torch.arange(12).reshape(2, 6) * 7 + rank

    def step():
        acc.backward(model(ids))
        opt.step()
        opt.zero_grad()

    node_bucket.NODE_MIN_BYTES = 0  # the bucket as asked, so that a sync takes many chunks (tested apart)
    result = {"rank": rank, "seed": SEED, "problem": node_bucket.problem(inner),
              "plain_problem": node_bucket.problem(torch.nn.Linear(3, 3))}
    bucket = node_bucket.for_model(inner, BUCKET if rank == 0 else 0, 60.0, directory)
    result["bucket"] = bucket is not None and bucket.size
    result["path"] = bucket.path if bucket else None
    last = None
    for i, (changed, reads) in enumerate([(False, True), (True, True), (True, rank == 0)]):
        step()
        want = policy_state_for_engine(inner)  # the gathered weights (a collective)
        result[f"sync{i}_moved"] = last is None or all(not torch.equal(last[k], v) for k, v in want.items())
        last = want
        before = bucket.copied_bytes, bucket.sent_bytes
        result[f"sync{i}"] = compare(sync(bucket, inner, changed, reads), want)
        result[f"sync{i}_copied"] = [bucket.copied_bytes - before[0], bucket.sent_bytes - before[1]]
    step()
    failed = sync(bucket, inner, True, True, stop_after=2 if rank == 0 else None)  # process 0 fails part-way
    result["failed_errors"] = failed["errors"] if failed else None
    step()
    refused = sync(bucket, inner, True, True, refuse_after=3 if rank == 0 else None)  # 0's engine fails part-way
    result["refused_errors"] = refused["errors"]
    want = policy_state_for_engine(inner)
    result["after_failure"] = compare(sync(bucket, inner, True, True), want)
    step()
    timed_out = sync(bucket, inner, True, True, refuse_after=2 if rank == 0 else None, closes=rank == 0)
    result["timed_out_errors"] = timed_out["errors"]
    result["closed_after_timeout"] = bucket.buffer is None  # 0's closed once its stream ended, 1's still open
    node_bucket.forget()  # as at an engine's close: decided again, with process 1 unable to map the new bucket
    if rank == 1:
        def refuse(*args, **kwargs):
            raise OSError("process 1 cannot map it (the probe says so)")

        node_bucket.NodeBucket.__init__ = refuse
    result["one_unable"] = node_bucket.for_model(inner, BUCKET, 60.0, directory) is not None
    result["left_after_refusal"] = sorted(os.listdir(directory))
    Path(f"{out}.{rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from align.runtime.process import leave_process_group

    leave_process_group(0)  # as a stage process leaves: together, then without interpreter teardown (a gloo thread
    # aborted a rank at exit once in 15 runs of this probe without it)
