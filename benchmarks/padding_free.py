"""SFT padded, padding-free and packed, and DPO padded and padding-free, side by side in one run, on the HH-RLHF chat
data (pipelines/chat.yaml: whole harmless-base conversations, ChatML; SFT's loss on the assistant turns, DPO on the
chat pairs).

Three runs of the SFT stage, same seed, same steps:

  padded        `sft.padding_free=false`: TRL's collator, every batch padded to its longest example
  padding-free  the default: each batch's examples packed into rows of the batch's width (the same examples per
                step, so the loss and gradients equal the padded run's: tests/test_packing.py)
  packed        `sft.packing=true`: TRL's best-fit-decreasing packing into rows of max_length (more examples per
                step), each row with its own block-diagonal mask

then DPO, padded (`dpo.padding_free=false`, from the padded SFT run's model) and padding-free (inside the
backbone's forward, from the padding-free SFT run's model: equal to the padded one up to float rounding). Prints per run:
train seconds, trained (non-padding) tokens, tokens/s, `perf/padding_fraction` (of the tokens computed, padding)
and, for SFT's padding-free runs, the same batches' fraction had they been padded.

    python benchmarks/padding_free.py                 # max_length 512, a 4-layer width-256 model, 30 steps of 8
    python benchmarks/padding_free.py --tiny runs_dir=/tmp/b   # the tests' version (seconds; figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIPELINE = REPO / "pipelines" / "chat.yaml"
RUNS = {"padded": ["sft.padding_free=false"], "padding-free": [], "packed": ["sft.packing=true"]}
DPO_RUNS = {"padded": ["sft.padding_free=false", "dpo.padding_free=false"], "padding-free": []}
FULL = ["builtin.hidden_size=256", "builtin.num_layers=4", "builtin.num_heads=4", "builtin.intermediate_size=768",
        "builtin.max_position_embeddings=512", "sft.max_length=512", "sft.max_steps=30", "sft.per_device_batch_size=8",
        "sft.logging_steps=10", "sft.save_steps=30", "sft.eval_split=null", "tracking.wandb=disabled",
        "dpo.max_length=512", "dpo.max_steps=10", "dpo.per_device_batch_size=4", "dpo.logging_steps=5",
        "dpo.save_steps=10"]
TINY = ["builtin.hidden_size=32", "builtin.num_layers=1", "builtin.num_heads=2", "builtin.intermediate_size=64",
        "builtin.max_position_embeddings=512", "sft.max_length=512", "sft.max_steps=3", "sft.per_device_batch_size=4",
        "sft.logging_steps=1", "sft.save_steps=3", "sft.eval_split=null", "tracking.wandb=disabled",
        "dpo.max_length=512", "dpo.max_steps=2", "dpo.per_device_batch_size=2", "dpo.logging_steps=1",
        "dpo.save_steps=2"]


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
        flags = next((ln for ln in lscpu.splitlines() if ln.startswith("Flags")), "")
        vec = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags)
    except OSError:
        model, vec = platform.processor() or "?", "?"
    return f"{model} ({vec}), {__import__('os').cpu_count()} cores"


def run(name: str, extra: list[str], overrides: list[str], stage: str = "sft") -> dict:
    run_id = "bench-" + name
    cmd = [sys.executable, "-m", "align.cli", "run", str(PIPELINE), "--only", stage, "--run-id", run_id, "--force",
           *overrides, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: align run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    runs_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("runs_dir=")), "runs")
    stage_dir = (REPO / runs_dir if not Path(runs_dir).is_absolute() else Path(runs_dir)) / "chat" / run_id / stage
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    final = manifest["final_metrics"]
    return {"seconds": final["perf/train_seconds"], "tokens": final.get("perf/train_tokens"),
            "padding": final.get("perf/padding_fraction"), "unpacked": final.get("perf/padding_fraction_unpacked"),
            "steps": final["train/global_step"], "loss": final["train/loss_final_avg"],
            "mode": manifest.get("padding_free", "-")}


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and 3 steps (the tests' version)")
    args, overrides = parser.parse_known_args(argv)
    overrides = [*(TINY if args.tiny else FULL), *overrides]
    print(f"machine: {machine()}; pipeline {PIPELINE.name}, overrides: {' '.join(overrides)}", flush=True)
    results = {f"sft {name}": run(name, extra, overrides) for name, extra in RUNS.items()}
    results.update({f"dpo {name}": run(name, extra, overrides, "dpo") for name, extra in DPO_RUNS.items()})
    print("\n| run | steps | train s | tokens trained | tokens/s | padding fraction | same batches padded | mode |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"] if r["tokens"] else float("nan")
        pad = "-" if r["padding"] is None else f"{r['padding']:.3f}"
        unp = "-" if r["unpacked"] is None else f"{r['unpacked']:.3f}"
        print(f"| {name} | {r['steps']} | {r['seconds']:.1f} | {r['tokens'] or 0:,.0f} | {rate:,.0f} | {pad} | {unp} | "
              f"{r['mode']} |")
    return results


if __name__ == "__main__":
    main()
