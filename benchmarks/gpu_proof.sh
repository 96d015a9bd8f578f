#!/usr/bin/env bash
# The GPU proof of issue 41 in one short lease: one script, one call, about 9 minutes on one H100 after start-up
# (not yet calibrated on a GPU: the sizes are benchmarks/gpu.py's PROOF_SIZES).
#
#   bash benchmarks/gpu_proof.sh --print-downloads   # here, with the package index: the wheels to carry
#   PYTHON=.venv/bin/python bash benchmarks/gpu_proof.sh --dry-run OUT   # CPU, tiny sizes (the suite runs it)
#   bash benchmarks/gpu_proof.sh OUT                 # on the GPU: installs .whl/*.whl when present, then runs
#
# What it runs, each through what ships (`benchmarks/gpu.py`, `align run`):
#   (a, b, d) a Llama-3-shaped 1B model (pipelines/model_configs/llama-3.2-1b, random init) through every stage of
#         the benchmark pipeline, SFT packed into rows of 2,048 tokens, every stage padding-free: per-stage
#         tokens/s, MFU, padding fraction, peak memory beside `align estimate`, PPO's iteration split;
#   (c)   the default pipeline (pipelines/default.yaml, shortened) end to end on the device, its DPO stage under
#         DeepSpeed ZeRO-3 with one process, so every stage's device handling runs there.
#   (e)   where liger-kernel is installed (the carried wheel): (a) again with Liger off in SFT, reward and DPO
#         (`liger: auto` turns it on on CUDA), for the on/off comparison. torch.compile is not in it (off by default).
#   (f)   PPO's training pass on the same 1B shape in bf16 with its fused LM head off and on (benchmarks/fused_head.py:
#         seconds per pass and peak memory, 4 x (256 + 1,024) tokens, a 128k vocabulary).
# It writes OUT/proof.json and OUT/proof.md (the tables for README), and each run's own files under OUT.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS="transformers==5.23.0 trl==1.16.0 peft==0.21.2 datasets==5.2.0 wandb==0.31.0 vaderSentiment==3.3.2 dill multiprocess liger-kernel==0.8.5"
if [[ "${1:-}" == "--print-downloads" ]]; then
  echo "echo /.whl/ >> .git/info/exclude"
  echo "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp" \
       "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64" \
       "-d .whl $WHEELS"
  echo "python3 -m pip wheel --no-deps -w .whl deepspeed==0.19.8   # a source archive on PyPI: its ops JIT there"
  exit 0
fi

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
OUT="${1:?usage: gpu_proof.sh [--dry-run] OUT | --print-downloads}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [[ $DRY == 0 && -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

start=$(date +%s)
if [[ $DRY == 1 ]]; then
  SIZE=(--cpu --sizes cpu)
  DEFAULT=(builtin.vocab_size=512 builtin.hidden_size=32 builtin.num_layers=2 builtin.num_heads=2
           builtin.intermediate_size=64 builtin.max_position_embeddings=96 sft.max_steps=6 sft.save_steps=6
           sft.logging_steps=3 sft.per_device_batch_size=8 sft.max_truncated_fraction=0.1 sft.max_train_examples=500
           sft.eval_max_examples=16 preferences.max_prompts=16 preferences.samples_per_prompt=2
           preferences.min_margin=0.0 preferences.generation.max_new_tokens=8 reward.max_steps=2
           reward.save_steps=2 reward.logging_steps=1 reward.max_length=96 reward.per_device_batch_size=4
           ppo.iterations=1 ppo.rollout_batch_size=8 ppo.mini_batch_size=4 ppo.save_every=1
           ppo.generation.max_new_tokens=8 ppo.max_prompt_length=48 dpo.max_steps=2 dpo.save_steps=2
           dpo.logging_steps=1 dpo.max_length=96 dpo.per_device_batch_size=4 evaluate.max_prompts=8
           evaluate.generation.max_new_tokens=8 evaluate.bootstrap_samples=100)
else
  SIZE=(--sizes proof)
  DEFAULT=(sft.max_steps=100 preferences.max_prompts=512 reward.max_steps=40 ppo.iterations=4 dpo.max_steps=40
           evaluate.max_prompts=128)
fi

echo "[proof] (a, b, d) 1B Llama-3 shape, every stage, SFT packed into rows of 2,048 tokens"
"$PY" benchmarks/gpu.py "${SIZE[@]}" --model-config pipelines/model_configs/llama-3.2-1b --out "$OUT/a" \
  sft.packing=true | tee "$OUT/a.log"

echo "[proof] (c) the default pipeline end to end, DPO under ZeRO-3 with one process"
mkdir -p "$OUT/c"
c_start=$(date +%s)
"$PY" -m align.cli run pipelines/default.yaml --run-id proof "runs_dir=$OUT/c/runs" tracking.wandb=disabled \
  "${DEFAULT[@]}" dpo.accelerate=zero3 dpo.num_processes=1 2>&1 | tee "$OUT/c.log"
c_seconds=$(( $(date +%s) - c_start ))

if [[ $DRY == 0 ]] && "$PY" -c "import liger_kernel" 2>/dev/null; then
  echo "[proof] (e) (a) with Liger off in SFT, reward and DPO"
  "$PY" benchmarks/gpu.py "${SIZE[@]}" --model-config pipelines/model_configs/llama-3.2-1b --out "$OUT/e" \
    sft.packing=true sft.liger=off reward.liger=off dpo.liger=off | tee "$OUT/e.log"
fi

echo "[proof] (f) PPO's training pass with the fused LM head off and on"
if [[ $DRY == 1 ]]; then FUSED=(--tiny); else
  FUSED=(--model-config pipelines/model_configs/llama-3.2-1b --dtype bfloat16 --batch 4 --prompt 256 --response 1024
         --rounds 1 --steps 3)
fi
"$PY" benchmarks/fused_head.py "${FUSED[@]}" --json "$OUT/f.json" | tee "$OUT/f.log"

"$PY" - "$OUT" "$c_seconds" "$DRY" "$start" <<'PYEOF'
import json, sys, time
from pathlib import Path

out, c_seconds, dry, start = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
a = json.loads((out / "a" / "benchmark.json").read_text())
run = out / "c" / "runs" / "default" / "proof"
stages = {}
for name in ("sft", "preferences", "reward", "ppo", "dpo", "evaluate"):
    m = json.loads((run / name / "manifest.json").read_text())
    stages[name] = {"status": m["status"], "seconds": m.get("final_metrics", {}).get("perf/stage_seconds"),
                    "peak_gb": m.get("final_metrics", {}).get("perf/peak_memory_gb"),
                    "accelerate": m.get("config", {}).get("accelerate")}
proof = {"date": time.strftime("%Y-%m-%d"), "dry_run": dry, "device": a["device"], "a": a,
         "c": {"seconds": c_seconds, "stages": stages}, "wall_seconds": int(time.time()) - start}
(out / "proof.json").write_text(json.dumps(proof, indent=1))
table = (out / "a.log").read_text().split("device:", 1)[1].split("pipeline wall time")[0]
lines = [f"GPU proof, {proof['date']} ({'CPU dry run' if dry else a['device']}): `bash benchmarks/gpu_proof.sh OUT`", "",
         "(a, b, d) Llama-3-shaped 1B, random init, SFT packed into rows of 2,048 tokens; device:" + table.rstrip(), "",
         f"(c) pipelines/default.yaml end to end in {c_seconds} s, DPO under ZeRO-3 (one process):", "",
         "| stage | status | seconds | peak GB | accelerate |", "|---|---|---|---|---|"]
for name, s in stages.items():
    sec = "-" if s["seconds"] is None else f"{s['seconds']:.1f}"
    peak = "-" if s["peak_gb"] is None else f"{s['peak_gb']:.2f}"
    lines.append(f"| {name} | {s['status']} | {sec} | {peak} | {s['accelerate']} |")
if (out / "e.log").is_file():
    lines += ["", "(e) the same as (a) with Liger off in SFT, reward and DPO; device:"
              + (out / "e.log").read_text().split("device:", 1)[1].split("pipeline wall time")[0].rstrip()]
if (out / "f.json").is_file():
    f = json.loads((out / "f.json").read_text())
    proof["f"] = f
    lines += ["", f"(f) PPO's training pass, {f['tokens']} response tokens, vocabulary {f['vocab']}, {f['device']}; "
              f"log-prob gap on vs off {f['gap']:.1e}:", "", "| fused head | s per pass | peak MB |", "|---|---|---|"]
    lines += [f"| {m} | {f[m]['seconds']:.3f} | {f[m]['peak_mb']:,.0f} |" for m in ("off", "on")]
    (out / "proof.json").write_text(json.dumps(proof, indent=1))
lines += ["", f"whole proof: {proof['wall_seconds']} s"]
(out / "proof.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
bad = [n for n, s in stages.items() if s["status"] != "completed"]
sys.exit(f"[proof] stages not completed in (c): {bad}" if bad else 0)
PYEOF
