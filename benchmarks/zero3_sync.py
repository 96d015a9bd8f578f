"""The vLLM weight sync under 2-process DeepSpeed ZeRO-3, the transports side by side in one run (issue 40's ZeRO-3
case of benchmarks/rollout_engines.py --sync).

The packaged SmolLM2 (135M, fp32) is PPO's policy, partitioned over 2 CPU processes (gloo) by `accelerate.prepare`;
before each sync an optimiser step (SGD on a next-token loss, both processes) changes every weight. Each sync is
PPO's own (`align.stages.ppo.rollouts.sync_engine`): every process gathers the policy a layer at a time (a collective)
and pushes it to its engine. Process 0 holds two vLLM engines, as `rollout_engines.py --sync` does: one as align
starts it now (transports file, host and shared in turn) and one as it was before in-place loads (`before`: the
file path as it was, vLLM's reload_weights); process 1 holds none (two more engines would not fit in this machine's
24 GB) and builds what its own engine would be sent (`policy_state_for_engine`, the same gathers). After every sync
process 0 compares the engine's log-probs with the whole policy's (gathered: must be < 1e-3 in fp32). Under ZeRO-3
no weight lies in the trainer's own storage (each is a gathered copy), so `shared` sends everything through the
bucket too, and the gather is a cost every transport pays.

    python benchmarks/zero3_sync.py --rounds 3 --json benchmarks/results/weight-sync-zero3-cpu-DATE.json

Needs vLLM's environment (ALIGN_VLLM_PYTHON; ./launch.sh --vllm). Peak memory on this machine: about 20 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_engines import checked, machine, shown, sync_summary, times_faster  # noqa: E402  (not a package)

SEED = 4242
ZERO3_TRANSPORTS = ("before", "file", "gather", "node")
"""before: the file path as it was (a gathered state dict written to /dev/shm, vLLM's reload_weights); file: the same
file through this engine; gather: every process gathers the policy a layer at a time and streams it through its
bucket in /dev/shm (weight_sync: host; how every ZeRO-3 sync went until 2026-11-28); node: every process writes its
own partitions into the node's bucket (align/engines/node_bucket.py), no gather."""


class StandIn:
    """Process 1's engine, and the gather alone on process 0: builds what an engine would be sent and loads it
    nowhere: with `how` "node" its shares written into the node's bucket (node_bucket.join: process 0's sync through
    it waits for them), else the same per-layer gathers as process 0's engines, each weight copied out contiguous."""

    holds_own_weights = True

    def __init__(self, how: str = "gather"):
        self.how, self.synced = how, False

    def sync_weights(self, model) -> float:
        import time

        from align.engines import node_bucket
        from align.engines.vllm_env import shm_dir
        from align.engines.weight_sync import policy_state_for_engine

        t0 = time.perf_counter()
        node = node_bucket.for_model(model, 0, 600.0, shm_dir()) if self.how == "node" else None
        if node:
            node_bucket.join(node, model, changed_only=self.synced)
            self.synced = True
        else:
            policy_state_for_engine(model)
        return time.perf_counter() - t0


def worker(out: str, rounds: int, bucket_mib: float) -> None:
    """One process of the 2-process launch (see the module doc); process 0 writes `out`."""
    import statistics

    import torch
    from accelerate import Accelerator, PartialState
    from transformers import AutoModelForCausalLM

    from align.config import Generation
    from align.engines.vllm import VLLMEngine
    from align.modeling.models import load_tokenizer
    from align.orchestrator import packaged
    from align.stages.ppo.models import PolicyAndValue, policy_for_generation
    from align.stages.ppo.rollouts import sync_engine

    state = PartialState(cpu=not torch.cuda.is_available())
    model_dir = str(packaged.fetch("smollm2", log=lambda *_: None))
    tok = load_tokenizer(model_dir)
    torch.manual_seed(SEED)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # partitioned by prepare() below
    acc = Accelerator()
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    pair = PolicyAndValue(policy, torch.nn.Linear(4, 1))
    model, opt = acc.prepare(pair, torch.optim.SGD(pair.parameters(), lr=1e-3))
    ids = tok(["The movie was a delight", "I think this film fails"], return_tensors="pt", padding=True).input_ids

    def step() -> None:  # every weight changes, on both processes' partitions
        loss = acc.unwrap_model(model).policy(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()

    prompts = ["The movie was", "I think this film", "Honestly, the acting", "What a"]
    gen = Generation(max_new_tokens=8, temperature=1.0)

    def gap(engine) -> tuple[float, bool] | None:  # the log-prob gap, and the greedy output against the trainer's
        with policy_for_generation(model, acc) as whole:  # a gather every process joins
            return None if engine is None else checked(engine, whole, tok, prompts, gen)

    main = state.is_main_process
    now = VLLMEngine(model_dir, tok, seed=SEED, bucket_mib=bucket_mib) if main else StandIn()
    before = VLLMEngine(model_dir, tok, seed=SEED, weight_sync="file", keep_weights=False) if main else StandIn()
    engines = {"before": before, "file": now, "gather": now, "node": now}
    try:
        # the first, full sync into each engine, and one through the file into this engine (as `before` had one):
        for e, how in ((now, "node"), (before, "before"), (now, "file")):  # not timed
            e.how = how
            if main and how == "file":
                now.weight_sync = "file"
            sync_engine(e, model, acc)
        runs: dict[str, list] = {how: [] for how in ZERO3_TRANSPORTS}
        node_used = None  # whether the "node" syncs did go through the node's bucket
        gathers: list[float] = []
        for i in range(rounds):
            for how in ZERO3_TRANSPORTS[i % len(ZERO3_TRANSPORTS):] + ZERO3_TRANSPORTS[:i % len(ZERO3_TRANSPORTS)]:
                step()
                engines[how].how = how  # process 1's stand-in does what process 0's engine does
                if main and how != "before":
                    now.weight_sync, now.node_sync = {"file": "file"}.get(how, "host"), how == "node"
                seconds = sync_engine(engines[how], model, acc)
                g = gap(engines[how] if main else None)
                if main:
                    runs[how].append((seconds, engines[how].sync_bytes[-1], *g))
                    node_used = now.last_sync.get("node_bucket") if how == "node" else node_used
            gathers.append(sync_engine(StandIn(), model, acc))  # what the gathering transports pay first, alone
        if main:
            result = {how: sync_summary(rs) for how, rs in runs.items()}
            result["speedup"] = times_faster(result, "before", "node")
            result["speedup_same_engine"] = times_faster(result, "file", "node")
            result["node_bucket"] = node_used
            result["world"] = state.num_processes
            result["gather_seconds"] = statistics.median(gathers)
            Path(out).write_text(json.dumps(result, indent=2, default=str))
    finally:
        for e in (now, before):
            if hasattr(e, "close"):
                e.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="syncs per transport (median reported)")
    p.add_argument("--bucket-mib", type=float, default=32.0, help="generation.sync_bucket_mib of process 0's engine")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launch below: this process's output file
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds, args.bucket_mib)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zero3.json"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "pipelines" / "accelerate" / "zero3.yaml"), "--num_processes", "2", __file__,
               "--worker", str(out), "--rounds", str(args.rounds), "--bucket-mib", str(args.bucket_mib)]
        proc = subprocess.run(cmd, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"zero3_sync: the 2-process launch failed (exit {proc.returncode})")
        sync = json.loads(out.read_text())
    results = {"machine": machine(), "rounds": args.rounds, "bucket_mib": args.bucket_mib, "sync": sync}
    print(f"\nweight sync under 2-process ZeRO-3 (gloo), packaged SmolLM2-135M fp32, {args.rounds} syncs per transport "
          f"(median, the gather included); {results['machine']}")
    print("| transport | s per sync | MB loaded per sync | max log-prob gap | greedy = trainer's | before / this |")
    print("|---|---|---|---|---|---|")
    for how in ZERO3_TRANSPORTS:
        x = sync[how]
        print(f"| {how} | {x['seconds']:.3f} | {x['bytes'] / 1e6:.0f} | {x['max_logprob_gap']:.1e} | "
              f"{'yes' if x['greedy_equal'] else 'NO'} | {shown(times_faster(sync, 'before', how))} |")
    print(f"file / node in the same engine: {shown(sync['speedup_same_engine'])}; the last sync through the node's "
          f"bucket: {sync['node_bucket']}; the gather alone (policy_state_for_engine, no engine): "
          f"{sync['gather_seconds']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
