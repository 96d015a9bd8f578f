"""One realistic pipeline on a GPU, stage by stage: throughput, MFU, peak memory against `align estimate`, PPO's
generation share, and generation with and without `generation.fast`, side by side.

On a CUDA machine: a Pythia-160m architecture (pipelines/model_configs/pythia-160m/config.json, 162.3M
parameters, random init: nothing is downloaded) with the vendored GPT-2 tokenizer, float32 weights and bfloat16
autocast (`precision: auto`), runs sft -> preferences -> reward -> ppo -> dpo -> evaluate on the movie-review
task through `align run`. Without CUDA it runs the same pipeline on a tiny version of that architecture on the
CPU (so the test suite exercises this script); MFU and memory are then not reported.

    python benchmarks/gpu.py                       # GPU if present, else the tiny CPU version
    python benchmarks/gpu.py --cpu --out /tmp/b    # force the tiny CPU version
    python benchmarks/gpu.py --model-config pipelines/model_configs/llama-3.1-8b-instruct \
        --num-processes 8 --accelerate zero3     # your own model's shape (random init), on 8 GPUs, ZeRO-3

`--model-config DIR` takes any causal LM's config.json (its family's architecture; the vocabulary becomes the
vendored GPT-2 tokenizer's 50,257 tokens, and on the CPU the model is shrunk to a tiny one of the same family);
`--num-processes` and `--accelerate` (a name under pipelines/accelerate/ or a path) go to every stage. The table
gives, per stage, tokens/s in all and per GPU, seconds per optimiser step (PPO: per iteration) and MFU over all
the GPUs used, as NeMo-RL reports RL throughput; PPO's iteration split (generation / scoring and update / weight
sync) beside it.

How the figures are computed (N = the parameters a token is multiplied by: the input embedding left out unless the
LM head is tied to it, a scalar model's never counted; attention FLOPs are left out, so MFU is a slight underestimate):
  tokens/s  training stages: non-padding tokens trained (TRL's count) / the optimiser steps' time, taken as the mean
            step after the first times the steps (`perf/step_seconds`: checkpoint saves, evaluations and the first
            step's kernel compilation are not in it, nor fetching and collating batches, which transformers does
            before a step begins; the stage's whole time is the table's "stage s"); preferences
            and evaluate: response tokens sampled / sampling time; PPO: response tokens / iteration time, the first
            (warm-up) iteration left out.
  MFU       FLOPs / time / the GPU's dense bf16 peak (spec sheet: H100/H200 SXM 989 TFLOP/s, NVL 836, H100 PCIe 756).
            FLOPs: SFT and reward 6N per trained token; DPO 8N (policy forward and backward, reference forward);
            preferences and evaluate 2N per sampled token (decoding only); PPO per iteration 2N_policy per sampled
            token + 2(N_policy + N_reference + N_value + N_reward) per sequence token (scoring pass) +
            6(N_policy + N_value) per sequence token and PPO epoch, over the iteration less its held-out KL pass;
            the first PPO iteration is a warm-up and not counted.
  memory    torch.cuda.max_memory_allocated over the stage (all processes), next to `align estimate`'s figure for
            the stage's chosen mode without its fixed 1 GiB CUDA-context allowance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "pipelines" / "model_configs" / "pythia-160m" / "config.json"
# Dense bf16 tensor-core peaks from the vendors' spec sheets (TFLOP/s): SXM parts by their plain names, the PCIe and
# NVL cards by theirs (the longest name a device's contains wins: "NVIDIA H200 NVL" is not an SXM H200).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.5, "H200": 989.4, "H200 NVL": 835.5,
                    "A100": 312.0, "L40S": 362.1, "A10G": 125.0, "L4": 121.0}
STAGES = ("sft", "preferences", "reward", "ppo", "dpo", "evaluate")

GPU_SIZES = {"shrink": {}, "sft_steps": 400, "sft_batch": 64, "max_length": 128, "pair_length": 128, "prompts": 2048, "samples": 4,
             "new_tokens": 48, "gen_batch": 256, "rm_epochs": 1, "ppo_iterations": 8, "rollout": 256, "mini": 64,
             "dpo_epochs": 1, "pair_batch": 32, "eval_prompts": 512, "ab_prompts": 1024}
# benchmarks/gpu_proof.sh on one lent GPU (a 1B model, SFT packed into rows of 2,048 tokens): every stage in a few
# minutes, so that the whole proof fits one 9-minute call. Not yet calibrated on a GPU.
PROOF_SIZES = {"shrink": {}, "sft_steps": 40, "sft_batch": 8, "max_length": 2048, "pair_length": 256, "prompts": 512, "samples": 2,
               "new_tokens": 48, "gen_batch": 256, "rm_epochs": 1, "ppo_iterations": 4, "rollout": 128, "mini": 32,
               "dpo_epochs": 1, "pair_batch": 32, "eval_prompts": 256, "ab_prompts": 256}
CPU_SIZES = {"shrink": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128},
             "sft_steps": 12, "sft_batch": 8, "max_length": 64, "pair_length": 64, "prompts": 48, "samples": 2, "new_tokens": 8,
             "gen_batch": 32, "rm_epochs": 1, "ppo_iterations": 3, "rollout": 8, "mini": 4, "dpo_epochs": 1,
             "pair_batch": 8, "eval_prompts": 16, "ab_prompts": 16}


def peak_tflops(device: str) -> float | None:
    """The dense bf16 peak of the GPU named `device` (torch.cuda.get_device_name), by the longest name it contains."""
    names = [k for k in PEAK_BF16_TFLOPS if k in device]
    return PEAK_BF16_TFLOPS[max(names, key=len)] if names else None


def build_base(out: Path, shrink: dict[str, int], seed: int, config_dir: Path | None = None) -> Path:
    """A randomly initialised causal LM of `config_dir`'s architecture (default Pythia-160m's; shrunk on CPU) saved
    with the GPT-2 tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = (config_dir / "config.json") if config_dir else CONFIG
    raw = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("architectures", "torch_dtype", "dtype")}
    if shrink:  # the same family, tiny: heads that divide, no fixed head size
        raw.update(shrink)
        kv = raw.get("num_key_value_heads")
        if kv is not None:
            raw["num_key_value_heads"] = 1 if raw["num_attention_heads"] % min(kv, raw["num_attention_heads"]) else \
                min(kv, raw["num_attention_heads"])
        raw.pop("head_dim", None)
        for key in ("layer_types",):
            if isinstance(raw.get(key), list):
                raw[key] = raw[key][:raw["num_hidden_layers"]]
    base = out / "base"
    shutil.rmtree(base, ignore_errors=True)
    shutil.copytree(REPO / "tokenizers" / "gpt2", base, ignore=shutil.ignore_patterns("LICENSE", "SOURCE.md"))
    eos = 50256  # GPT-2's <|endoftext|>
    raw.update(vocab_size=50257, bos_token_id=eos, eos_token_id=eos, pad_token_id=None)
    torch.manual_seed(seed)
    # initialised on the GPU where there is one: a 1B random init on the host takes longer than a stage's training
    with torch.device("cuda" if torch.cuda.is_available() and not shrink else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    model.save_pretrained(base)
    del model
    if torch.cuda.is_available():  # the stages run in processes of their own: give them this process's GPU memory
        torch.cuda.empty_cache()
    return base


def pipeline_yaml(out: Path, base: Path, s: dict, precision: str = "auto", attn: str = "auto",
                  packed: bool = False) -> Path:
    """The benchmark pipeline. No stage writes a checkpoint before its last step (at 1B each is ~13 GB: a lent GPU's
    lease spent writing it), and none is kept once its stage completes; transformers still saves one at a TRL
    stage's last step whatever save_steps says (outside the step timing, inside the lease's time), which align keeps
    so that a kill during the evaluation that follows resumes with nothing to retrain. SFT takes as many examples as its steps' rows need, all of
    them when packed (a row of 2,048 tokens holds ~80 reviews). DPO comes third in the file, so third in the run (ties
    keep file order): a benchmark stopped at its deadline has SFT's and DPO's figures, the two the 35% MFU goal
    names, before reward's, PPO's and evaluate's."""
    card = REPO / "data_cards" / "movie_review_snippets.yaml"
    gen = f"{{max_new_tokens: {s['new_tokens']}, batch_size: {s['gen_batch']}}}"
    cap = "" if packed else f"max_train_examples: {s['sft_steps'] * s['sft_batch']},"
    prompt_cap = min(64, s["pair_length"] - s["new_tokens"])  # PPO's prompts + replies within the reward model's
    text = f"""name: gpu-benchmark
base_model: {base}
precision: {precision}
attn_implementation: {attn}
runs_dir: {out / 'runs'}
tracking: {{wandb: disabled}}
keep_checkpoints: false
seed: 5
stages:
  sft: {{data: {card}, max_steps: {s['sft_steps']}, per_device_batch_size: {s['sft_batch']}, learning_rate: 6.0e-4,
        {cap}
        max_length: {s['max_length']}, logging_steps: {s['sft_steps'] // 4}, save_steps: {s['sft_steps'] * 100},
        eval_max_examples: 64}}
  preferences: {{policy: sft, prompts: {card}, max_prompts: {s['prompts']}, samples_per_prompt: {s['samples']},
                judge: vader, min_margin: 0.05, generation: {gen},
                drop_unfinished: false}}  # review continuations, as pipelines/default.yaml: every sample pairs
  dpo: {{policy: sft, data: preferences, epochs: {s['dpo_epochs']}, per_device_batch_size: {s['pair_batch']},
        max_length: {s['pair_length']}, logging_steps: 1, save_steps: 1000, max_truncated_fraction: 0.5}}
  reward: {{init: sft, data: preferences, epochs: {s['rm_epochs']}, per_device_batch_size: {s['pair_batch']},
           max_length: {s['pair_length']}, logging_steps: 1, save_steps: 1000, max_truncated_fraction: 0.5}}
  ppo: {{policy: sft, reward: reward, prompts: {card}, iterations: {s['ppo_iterations']},
        rollout_batch_size: {s['rollout']}, mini_batch_size: {s['mini']}, ppo_epochs: 2, max_prompt_length: {prompt_cap},
        reward_normalization_samples: {s['rollout']}, save_every: 1000, generation: {gen}}}
  evaluate: {{policies: [sft, ppo, dpo], baseline: sft, reference: sft, reward: reward, judges: [vader],
             prompts: {card}, split: test, max_prompts: {s['eval_prompts']}, bootstrap_samples: 200,
             generation: {gen}}}
"""
    path = out / "pipeline.yaml"
    path.write_text(text)
    return path


def generation_ab(model_dir: Path, prompts: list[str], new_tokens: int, batch: int) -> dict[str, float]:
    """Response tokens per second sampling `prompts` (length-sorted batches) three ways: as the stages do with the
    pipeline's default dtype (float32 weights, bf16 autocast on a GPU, dynamic KV cache); bf16 weights with a
    dynamic cache; bf16 weights with generation.fast (static cache, compiled by transformers on a GPU). Each after
    a warm-up pass over the same prompts (compilation is not timed)."""
    import torch

    from align.modeling.compute import resolve
    from align.config import Generation
    from align.engines.hf import HFEngine
    from align.modeling.generation import sample_texts
    from align.modeling.models import load_causal_lm, load_tokenizer

    compute = resolve()
    tok = load_tokenizer(str(model_dir))
    gen = Generation(max_new_tokens=new_tokens, batch_size=batch)
    out = {}
    variants = {"float32 weights, autocast": ("float32", False), "bf16 weights": ("bfloat16", False),
                "bf16 weights, fast": ("bfloat16", True)}
    for label, (dtype, fast) in variants.items():
        model = load_causal_lm(str(model_dir), dtype).to(compute.device).eval()
        with compute.autocast():
            sample_texts(HFEngine(model, tok, fast=fast), tok, prompts, gen, seed=1)  # warm-up (and compilation)
            if compute.device.type == "cuda":
                torch.cuda.synchronize()
            counts: dict[str, int] = {}
            t0 = time.perf_counter()
            sample_texts(HFEngine(model, tok, fast=fast), tok, prompts, gen, seed=2, counts=counts)
            if compute.device.type == "cuda":
                torch.cuda.synchronize()
        out[label] = counts["generated_tokens"] / (time.perf_counter() - t0)
        del model
    return out


def run_pipeline(pipeline: Path, run_dir: Path, env: dict[str, str], launch: list[str] = ()) -> dict[str, str]:
    """`align run` (with `launch`: --num-processes, each stage's accelerate config); when a stage fails, the stages
    that do not need it still run (evaluate without the failed policy), so one failure does not hide the other
    stages' figures. Returns failed stage -> its error."""
    def align_run(*extra: str) -> int:
        return subprocess.run([sys.executable, "-m", "align.cli", "run", str(pipeline), "--run-id", "bench", *launch,
                               *extra], cwd=REPO, env=env).returncode

    if align_run() == 0:
        return {}
    failed = {}
    for name in STAGES:
        path = run_dir / name / "manifest.json"
        manifest = json.loads(path.read_text()) if path.is_file() else {}
        if manifest.get("status") == "failed":
            failed[name] = manifest.get("error", "failed")
    if set(failed) - {"ppo", "dpo"}:  # an upstream stage failed (sft, preferences or PPO's reward model): no more
        return failed
    for name in ("reward", "ppo", "dpo"):  # after a failed DPO (third in the file) reward and PPO have not run yet
        if name not in failed:
            align_run("--only", name)  # skipped when already complete with this config
    policies = [p for p in ("sft", "ppo", "dpo") if p not in failed]
    align_run("--only", "evaluate", f"evaluate.policies=[{','.join(policies)}]")
    return failed


def stage_rows(run_dir: Path, pipeline: Path, peak_flops: float | None, failed: dict[str, str],
               gpus: int = 1) -> list[dict]:
    from align.config import load_pipeline
    from align.orchestrator.estimate import OVERHEAD_BYTES, estimate_pipeline, model_shapes
    from align.orchestrator.hardware import hardware

    cfg = load_pipeline(pipeline)
    shapes = model_shapes(cfg, pipeline)
    n_lm, n_rm = matmul_params(shapes["lm"], tied(cfg.base_model)), matmul_params(shapes["scalar"], False)
    estimates = {e.name: e for e in estimate_pipeline(cfg, pipeline, hardware(cfg))}
    rows = []
    for name in STAGES:
        path = run_dir / name / "manifest.json"
        manifest = json.loads(path.read_text()) if path.is_file() else {"status": "not run"}
        if name in failed or manifest.get("status") != "completed":
            rows.append({"stage": name, "failed": failed.get(name) or manifest.get("error") or manifest.get("status")})
            continue
        m = manifest["final_metrics"]
        row = {"stage": name, "kernels": kernels(manifest.get("kernels") or {}), "seconds": m["perf/stage_seconds"],
               "tokens_per_s": m.get("perf/tokens_per_s"),
               "peak_gb": m.get("perf/peak_memory_gb"), "padding_fraction": m.get("perf/padding_fraction"),
               "padding_fraction_unpacked": m.get("perf/padding_fraction_unpacked"),
               "estimate_gb": (estimates[name].chosen_bytes - OVERHEAD_BYTES) / 1e9, "flops_per_s": None,
               "step_seconds": None}
        if name in ("sft", "reward", "dpo"):
            row.update(training_rates(m, {"sft": 6 * n_lm, "reward": 6 * n_rm, "dpo": 8 * n_lm}[name]))
        elif name in ("preferences", "evaluate"):
            row["flops_per_s"] = 2 * n_lm * m["perf/generated_tokens"] / m["perf/generation_seconds"]
        else:
            its = [json.loads(x) for x in (run_dir / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
            its = [r for r in its if "perf/episodes_per_s" in r][1:]  # the first iteration is a warm-up
            stage_cfg = cfg.stages[name]
            flops = secs = counted = tokens = 0.0
            for r in its:
                t = stage_cfg.rollout_batch_size * gpus / r["perf/episodes_per_s"]  # the iteration's seconds
                seq = r["perf/sequence_tokens"]
                flops += (2 * n_lm * r["perf/tokens_per_s"] * t + 2 * (2 * n_lm + 2 * n_rm) * seq
                          + 6 * (n_lm + n_rm) * seq * stage_cfg.ppo_epochs)
                secs += t
                counted += t - r.get("perf/heldout_seconds", 0.0)  # the held-out KL's FLOPs are not counted above
                tokens += r["perf/tokens_per_s"] * t
            row["flops_per_s"] = flops / counted if counted else None
            row["tokens_per_s"] = tokens / secs if secs else row["tokens_per_s"]  # the warm-up iteration left out
            row["generation_share"] = m.get("perf/generation_fraction")
            # NeMo-RL's split of an iteration, seconds per process (the stage's averages over iterations)
            row["split"] = {p: m.get(f"perf/{p}_seconds") for p in ("generation", "scoring", "training",
                                                                    "weight_sync", "heldout")}
            row["step_seconds"] = secs / len(its) if its else None
            sync = sum(r.get("perf/sync_seconds", 0.0) for r in its)
            row["sync_share"] = sync / secs if secs else None
        row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / gpus if row["tokens_per_s"] else None
        row["mfu"] = row["flops_per_s"] / (peak_flops * gpus) if peak_flops and row["flops_per_s"] else None
        rows.append(row)
    return rows


def training_rates(m: dict, flops_per_token: float) -> dict:
    """A training stage's rates from its final metrics: over its optimiser steps after the first (perf/step_seconds,
    align/runtime/trl.py: no checkpoint save, evaluation or first-step compilation in it) where it was timed, else over
    the trainer's whole runtime (perf/train_seconds). tokens/s, FLOPs/s (`flops_per_token` per trained token) and the
    seconds per step, with which time they are over."""
    steps, tokens = m.get("train/global_step"), m.get("perf/train_tokens")
    if m.get("perf/step_seconds") and steps:
        seconds, timed = m["perf/step_seconds"] * steps, "steps after the first"
    else:
        seconds, timed = m.get("perf/train_seconds"), "train runtime"
    if not seconds or not steps:
        return {}
    over_runtime = m.get("perf/tokens_per_s") if timed == "train runtime" else None  # (no count: not over the steps)
    return {"step_seconds": seconds / steps, "timed": timed, "train_seconds": m.get("perf/train_seconds"),
            "tokens_per_s": tokens / seconds if tokens else over_runtime,
            "flops_per_s": flops_per_token * tokens / seconds if tokens else None}


def matmul_params(shape, tied_head: bool) -> int:
    """The parameters a token's forward multiplies by (the 2N of 6N): all but the input embedding, which is a lookup,
    unless the LM head is tied to it (then it is the head's matmul). A scalar model's head is its `score`."""
    return shape.params if tied_head else shape.params - shape.vocab * shape.hidden


def tied(model_dir) -> bool:
    """Whether the model's LM head is its input embedding (transformers' resolved config)."""
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(str(model_dir)), "tie_word_embeddings", True))


def kernels(k: dict) -> str:
    """A stage manifest's `kernels`, as resolved on the machine: Liger for the TRL stages; PPO's fused head (policy),
    attention kernel and autocast."""
    parts = [f"Liger {'on' if k['liger'] else 'off'}"] if "liger" in k else []
    if isinstance(k.get("fused_head"), dict):
        parts.append(f"fused head {'on' if k['fused_head'].get('policy') else 'off'}")
    if "attention" in k:
        parts.append(str(k["attention"]))
    if k.get("autocast") not in (None, "no"):
        parts.append(f"{k['autocast']} autocast")
    return ", ".join(parts)


def render(rows: list[dict], ab: dict[str, float], device: str, on_gpu: bool, gpus: int = 1) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"device: {device}; {gpus} process(es)", "",
             "| stage | stage s | tokens/s | tokens/s/GPU | s/step | MFU | padding | peak GB (measured) | estimate GB "
             "| kernels | PPO split, s: generation / scoring / training / sync / held-out |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['stage']} | failed: {str(r['failed'])[:160]} | | | | | | | | | |")
            continue
        split = "-"
        if r.get("split"):
            split = " / ".join(f(v, ".2f") for v in r["split"].values())
        lines.append(f"| {r['stage']} | {r['seconds']:.1f} | {f(r['tokens_per_s'], ',.0f')} | "
                     f"{f(r.get('tokens_per_s_per_gpu'), ',.0f')} | {f(r.get('step_seconds'), '.2f')} | "
                     f"{f(r['mfu'] and 100 * r['mfu'], '.1f')}{'%' if r['mfu'] else ''} | "
                     f"{f(r.get('padding_fraction'), '.3f')} | {f(r['peak_gb'], '.2f')} | "
                     f"{f(r['estimate_gb'] if on_gpu else None, '.2f')} | {r.get('kernels') or '-'} | {split} |")
    if ab:
        first = next(iter(ab.values()))
        lines += ["", "generation of the sft policy, response tokens/s: "
                  + "; ".join(f"{k} {v:,.0f} ({v / first:.2f}x)" for k, v in ab.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "runs" / "benchmark-gpu"), help="work directory (model, runs)")
    ap.add_argument("--cpu", action="store_true", help="the tiny CPU version even when a GPU is present")
    ap.add_argument("--precision", default="auto", help="the pipeline's precision setting (default auto)")
    ap.add_argument("--attn", default="auto", help="the pipeline's attn_implementation (default auto)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    ap.add_argument("--model-config", type=Path, default=None,
                    help="a directory with a causal LM's config.json: its architecture, random init (default Pythia-160m)")
    ap.add_argument("--num-processes", type=int, default=None, help="processes per stage (one per GPU)")
    ap.add_argument("--accelerate", default=None, help="every stage's accelerate config (a pipelines/accelerate/ name or a path)")
    ap.add_argument("--sizes", choices=("auto", "gpu", "proof", "cpu"), default="auto",
                    help="step counts and batch sizes: auto = gpu on a GPU, cpu (tiny model) without one")
    ap.add_argument("--ignore-memory-check", action="store_true",
                    help="launch stages that `align estimate` says do not fit (to compare its figure with the peak)")
    ap.add_argument("--no-generation-ab", action="store_true",
                    help="skip the generation A/B after the pipeline (its compiled variant costs a minute on a GPU)")
    ap.add_argument("overrides", nargs="*", help="align run overrides for the benchmark pipeline, e.g. sft.packing=true")
    args = ap.parse_args(argv)
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    env = dict(os.environ, **({} if on_gpu else {"CUDA_VISIBLE_DEVICES": ""}))
    if not on_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sizes = {"gpu": GPU_SIZES, "proof": PROOF_SIZES, "cpu": CPU_SIZES}[
        args.sizes if args.sizes != "auto" else ("gpu" if on_gpu else "cpu")]
    if not on_gpu:  # the tiny model whatever the step counts
        sizes = {**sizes, "shrink": CPU_SIZES["shrink"]}
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu (tiny model: MFU and memory not reported)"
    peak = args.peak_tflops or (peak_tflops(device) if on_gpu else None)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = build_base(out, sizes["shrink"], seed=5, config_dir=args.model_config)
    pipeline = pipeline_yaml(out, base, sizes, args.precision, args.attn)
    from align.config import load_pipeline

    if load_pipeline(pipeline, args.overrides).stages["sft"].packing:  # the overrides as `align run` reads them
        pipeline = pipeline_yaml(out, base, sizes, args.precision, args.attn, packed=True)
    launch = ([f"--num-processes={args.num_processes}"] if args.num_processes else []) + \
        (["--ignore-memory-check"] if args.ignore_memory_check else []) + \
        ([f"{stage}.accelerate={args.accelerate}" for stage in STAGES] if args.accelerate else []) + args.overrides
    gpus = args.num_processes or 1
    t0 = time.perf_counter()
    run_dir = out / "runs" / "gpu-benchmark" / "bench"
    failed = run_pipeline(pipeline, run_dir, env, launch)
    wall = time.perf_counter() - t0
    rows = stage_rows(run_dir, pipeline, peak * 1e12 if peak else None, failed, gpus)
    from align.data.cards import load_split
    from align.runtime.rows import unique_prompts

    card = REPO / "data_cards" / "movie_review_snippets.yaml"
    prompts = unique_prompts(load_split(str(card), "test").rows, sizes["ab_prompts"])
    skip_ab = args.no_generation_ab or "sft" in failed or not (run_dir / "sft" / "model").is_dir()
    ab = {} if skip_ab else generation_ab(run_dir / "sft" / "model", prompts, sizes["new_tokens"], sizes["gen_batch"])
    table = render(rows, ab, device, on_gpu, gpus)
    print(table + f"\n\npipeline wall time {wall:.0f} s (stage processes started and models loaded included)")
    (out / "benchmark.json").write_text(json.dumps({"device": device, "stages": rows, "generation": ab,
                                                    "wall_seconds": wall, "peak_tflops": peak, "processes": gpus,
                                                    "model_config": str(args.model_config or CONFIG.parent)},
                                                   indent=1))
    bad = [r["stage"] for r in rows if "failed" in r]
    if bad:
        print(f"gpu.py: stages that did not complete: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
