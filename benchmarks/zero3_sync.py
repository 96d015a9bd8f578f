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
from rollout_engines import TRANSPORTS, machine, sync_summary  # noqa: E402  (benchmarks/ is not a package)

SEED = 4242


class StandIn:
    """Process 1's engine, and the gather alone on process 0: builds what an engine would be sent (the same per-layer
    gathers as process 0's engines, each weight copied out contiguous) and loads it nowhere."""

    holds_own_weights = True

    def sync_weights(self, model) -> float:
        import time

        from align.engines.weight_sync import policy_state_for_engine

        t0 = time.perf_counter()
        policy_state_for_engine(model)
        return time.perf_counter() - t0


def worker(out: str, rounds: int) -> None:
    """One process of the 2-process launch (see the module doc); process 0 writes `out`."""
    import statistics

    import torch
    from accelerate import Accelerator, PartialState
    from transformers import AutoModelForCausalLM

    from align.config import Generation
    from align.engines.base import logprob_gap
    from align.engines.vllm import VLLMEngine
    from align.modeling.generation import response_logprobs
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

    def gap(engine) -> float | None:
        with policy_for_generation(model, acc) as whole, torch.no_grad():  # a gather every process joins
            if engine is None:
                return None
            r = engine.generate(prompts, gen, seed=0)
            return logprob_gap(r.engine_logprobs, response_logprobs(whole, r), r.response_mask)["max"]

    main = state.is_main_process
    now = VLLMEngine(model_dir, tok, seed=SEED) if main else StandIn()
    before = VLLMEngine(model_dir, tok, seed=SEED, weight_sync="file", keep_weights=False) if main else StandIn()
    engines = {"before": before, "file": now, "host": now, "shared": now}
    try:
        for e in (now, before):  # the first, full sync of the policy into each engine: not timed
            sync_engine(e, model, acc)
        runs: dict[str, list] = {how: [] for how in TRANSPORTS}
        gathers: list[float] = []
        for i in range(rounds):
            for how in TRANSPORTS[i % len(TRANSPORTS):] + TRANSPORTS[:i % len(TRANSPORTS)]:
                step()
                if main and how != "before":
                    now.weight_sync = how
                seconds = sync_engine(engines[how], model, acc)
                g = gap(engines[how] if main else None)
                if main:
                    runs[how].append((seconds, engines[how].sync_bytes[-1], g))
            gathers.append(sync_engine(StandIn(), model, acc))  # what every transport pays first, alone
        if main:
            result = {how: sync_summary(rs) for how, rs in runs.items()}
            result["speedup"] = result["before"]["seconds"] / result["shared"]["seconds"]
            result["speedup_same_engine"] = result["file"]["seconds"] / result["shared"]["seconds"]
            result["shared_host_tensors"] = now.last_sync.get("host_tensors")
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
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launch below: this process's output file
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "zero3.json"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "pipelines" / "accelerate" / "zero3.yaml"), "--num_processes", "2", __file__,
               "--worker", str(out), "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, cwd=tmp)
        if proc.returncode != 0 or not out.exists():
            sys.exit(f"zero3_sync: the 2-process launch failed (exit {proc.returncode})")
        sync = json.loads(out.read_text())
    results = {"machine": machine(), "rounds": args.rounds, "sync": sync}
    print(f"\nweight sync under 2-process ZeRO-3 (gloo), packaged SmolLM2-135M fp32, {args.rounds} syncs per transport "
          f"(median, the gather included); {results['machine']}")
    print("| transport | s per sync | MB loaded per sync | max log-prob gap | before / this |")
    print("|---|---|---|---|---|")
    for how in TRANSPORTS:
        x = sync[how]
        print(f"| {how} | {x['seconds']:.3f} | {x['bytes'] / 1e6:.0f} | {x['max_logprob_gap']:.1e} | "
              f"{sync['before']['seconds'] / x['seconds']:.2f}x |")
    print(f"file / shared in the same engine: {sync['speedup_same_engine']:.2f}x; {sync['shared_host_tensors']} tensors "
          f"read where they lie; the gather alone (policy_state_for_engine, no engine): {sync['gather_seconds']:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
