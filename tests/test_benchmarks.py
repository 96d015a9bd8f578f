"""benchmarks/gpu.py in its CPU mode: the script the GPU table of docs/benchmarks.md comes from runs end to end here, so it
cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_gpu_benchmark_runs_in_cpu_mode_and_reports_every_stage(tmp_path):
    """benchmarks/gpu.py on the CPU with a user's model config (Llama-3.1-8B's architecture, shrunk), a process
    count and an accelerate config: every stage's row, per-GPU throughput and seconds per step."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--cpu", "--out", str(tmp_path),
                           "--model-config", str(REPO / "pipelines" / "model_configs" / "llama-3.1-8b-instruct"),
                           "--num-processes", "1", "--accelerate", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert json.loads((tmp_path / "base" / "config.json").read_text())["model_type"] == "llama"
    assert result["processes"] == 1
    rows = {r["stage"]: r for r in result["stages"]}
    assert list(rows) == ["sft", "preferences", "reward", "ppo", "dpo", "evaluate"]
    for name, row in rows.items():
        assert "failed" not in row, (name, row)
        assert row["tokens_per_s"] > 0 and row["seconds"] > 0, (name, row)
        assert row["tokens_per_s_per_gpu"] == row["tokens_per_s"]  # one process
        if name in ("sft", "reward", "dpo", "ppo"):
            assert row["step_seconds"] > 0, (name, row)
        assert row["mfu"] is None and row["peak_gb"] is None  # no GPU: neither is measured, neither is invented
    assert 0 < rows["ppo"]["generation_share"] < 1
    split = rows["ppo"]["split"]  # NeMo-RL's split, seconds: the hf engine has nothing to sync
    assert split["weight_sync"] == 0 and all(split[p] > 0 for p in ("generation", "scoring", "training")), split
    assert rows["sft"]["kernels"] == "Liger off"  # auto: off without CUDA
    assert rows["ppo"]["kernels"] == "fused head off, sdpa"  # auto: off on a CPU; fp32, no autocast
    # the three generation variants were each timed (positive throughput), and the table prints them
    assert set(result["generation"]) == {"float32 weights, autocast", "bf16 weights", "bf16 weights, fast"}
    assert all(v > 0 for v in result["generation"].values())
    assert "| ppo |" in proc.stdout and "generation of the sft policy" in proc.stdout


def test_online_rl_benchmark_runs_in_its_tiny_mode(tmp_path):
    """benchmarks/online_rl.py --tiny: pipelines/online_rl.yaml shrunk (sft, preferences, reward, then PPO, GRPO
    and RLOO on the same reward model, and one evaluation), and its table of throughput and win rates."""
    out = tmp_path / "online.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "online_rl.py"), "--tiny", "--json", str(out),
                           f"runs_dir={tmp_path / 'runs'}"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())["algorithms"]
    assert list(figures) == ["ppo", "grpo", "rloo"]
    for kind, f in figures.items():
        assert f["episodes"] > 0 and f["episodes_per_s"] > 0 and f["tokens_per_s"] > 0, (kind, f)
        assert 0 <= f["vader_win_rate"] <= 1, (kind, f)
    assert "| ppo |" in proc.stdout and "| rloo |" in proc.stdout


def test_rollout_engines_benchmark_runs_in_its_tiny_mode(tmp_path):
    """benchmarks/rollout_engines.py --tiny: PPO on the packaged SmolLM2 with the hf and the vllm engine (2 iterations
    of 4 episodes, VADER reward), then sampling with each; every figure measured, the vllm one with its log-prob gap."""
    out = tmp_path / "engines.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rollout_engines.py"), "--tiny", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for engine in ("hf", "vllm"):
        ppo, sampling = r["ppo"][engine], r["sampling"][engine]
        assert ppo["episodes"] == 4 and ppo["seconds"] > 0 and ppo["tokens"] > 0, (engine, ppo)
        assert 0 < ppo["generation_fraction"] < 1
        assert sampling["tokens"] > 0 and sampling["seconds"] > 0
    assert r["ppo"]["hf"]["logprob_gap_max"] is None and r["ppo"]["hf"]["sync_seconds"] == 0
    assert 0 <= r["ppo"]["vllm"]["logprob_gap_max"] < 1e-3 and r["ppo"]["vllm"]["sync_seconds"] > 0
    assert r["ppo"]["vllm"]["startup_seconds"] > 0
    split = r["ppo"]["vllm"]["split"]  # NeMo-RL's split: every phase took time, the vLLM engine's sync too
    assert all(split[p] > 0 for p in ("generation", "scoring", "training", "weight_sync")), split
    for mode in ("full", "lora"):  # the weight sync side by side: every transport correct, LoRA's shared one smaller
        sync = r["sync"][mode]
        assert all(sync[how]["max_logprob_gap"] < 1e-3 and sync[how]["greedy_equal"] and sync[how]["checks_pass"]
                   and sync[how]["seconds"] > 0 for how in ("before", "file", "host", "shared", "broadcast"))
        assert sync["speedup"] is not None  # a figure is reported only when both transports passed their checks
        assert sync["shared_load"] == "in place"  # not vLLM's reload_weights
    # full fine-tuning: the engine read every weight where it lies; LoRA's merged layers are computed: the bucket
    assert r["sync"]["full"]["shared_host_tensors"] > 200 and r["sync"]["lora"]["shared_host_tensors"] == 0
    assert r["sync"]["lora"]["shared"]["bytes"] < r["sync"]["lora"]["file"]["bytes"]
    adapter = r["sync"]["lora"]["adapter"]  # the adapters alone, applied by vLLM's LoRA support
    assert adapter["checks_pass"] and adapter["bytes"] < r["sync"]["lora"]["shared"]["bytes"] / 10
    assert all(r["sync"]["generation_seconds"][how] > 0 for how in ("merged", "adapter"))
    full = r["sync"]["full"]
    assert full["shared"]["bytes"] == full["host"]["bytes"] == full["file"]["bytes"] == full["broadcast"]["bytes"]
    assert "| vllm |" in proc.stdout and "vllm / hf" in proc.stdout


@pytest.mark.distributed
def test_zero3_sync_benchmark_runs_one_round(tmp_path):
    """benchmarks/zero3_sync.py --rounds 1: the packaged SmolLM2 partitioned over 2 processes (ZeRO-3), an optimiser
    step before each sync, every transport (the file, gathered layers, the node's bucket) loaded by a vLLM engine that
    then samples the whole policy (within 1e-3); the node's syncs did go through the node's bucket, and the whole
    policy moves every time (every weight trains)."""
    out = tmp_path / "zero3.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "zero3_sync.py"), "--rounds", "1", "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sync = json.loads(out.read_text())["sync"]
    assert sync["world"] == 2 and sync["node_bucket"] >= 512 * 2 ** 20 and sync["gather_seconds"] > 0
    for how in ("before", "file", "gather", "node"):
        assert sync[how]["max_logprob_gap"] < 1e-3 and sync[how]["greedy_equal"] and sync[how]["seconds"] > 0, \
            (how, sync[how])
        assert sync[how]["bytes"] == sync["before"]["bytes"] > 500e6  # SmolLM2's 538 MB in fp32, all of it
    assert "| node |" in proc.stdout


def test_padding_free_benchmark_runs_in_its_tiny_mode(tmp_path):
    """benchmarks/padding_free.py --tiny: SFT padded, padding-free and packed, DPO padded and padding-free, on the HH
    chat data at max_length 512. The padding-free SFT trains the padded run's tokens (the same batches) computing
    fewer pad tokens; packing leaves under 5% padding; DPO's backbone packs."""
    from importlib import util

    spec = util.spec_from_file_location("padding_free", REPO / "benchmarks" / "padding_free.py")
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--tiny", f"runs_dir={tmp_path / 'runs'}"])
    assert list(r) == ["sft padded", "sft padding-free", "sft packed", "dpo padded", "dpo padding-free"]
    assert r["sft padded"]["tokens"] == r["sft padding-free"]["tokens"] > 0
    assert r["sft padded"]["padding"] is None and r["dpo padded"]["padding"] is None  # nothing packed: no figure
    assert r["sft padding-free"]["padding"] < r["sft padding-free"]["unpacked"]
    assert r["sft packed"]["padding"] <= 0.05 < r["sft packed"]["unpacked"]
    assert r["dpo padding-free"]["padding"] < r["dpo padding-free"]["unpacked"]


def test_fused_head_benchmark_runs_in_its_tiny_mode():
    """benchmarks/fused_head.py --tiny: PPO's training pass with the fused head off and on, each in its own process;
    both time their passes and report memory, and their log-probs agree."""
    from importlib import util

    spec = util.spec_from_file_location("fused_head_bench", REPO / "benchmarks" / "fused_head.py")
    bench = util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.main(["--tiny"])
    assert r["gap"] < 1e-4
    assert all(r[mode]["seconds"] > 0 and r[mode]["peak_mb"] > 0 for mode in ("off", "on"))


def test_gpu_proof_script_runs_end_to_end_in_its_cpu_dry_run(tmp_path):
    """benchmarks/gpu_proof.sh --dry-run: the script a lent GPU runs, on the CPU at tiny sizes, every step of it: the
    1B Llama-3 shape (shrunk) through every stage with SFT packed, the default pipeline with DPO under ZeRO-3 on one
    process, and its JSON and markdown for README; --print-downloads names the wheels to carry."""
    lines = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--print-downloads"], cwd=REPO,
                           capture_output=True, text=True, timeout=60).stdout
    assert "pip download" in lines and "trl==1.16.0" in lines and "deepspeed==0.19.8" in lines
    carried = next(line for line in lines.splitlines() if "pip download" in line).split("-d .whl")[1].split()
    assert {"dill==0.4.1", "multiprocess==0.70.19"} <= set(carried)  # what datasets 5.2 allows (--no-deps)
    assert all("==" in wheel for wheel in carried), carried  # none drifts with PyPI before a lease
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--dry-run", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=1200,
                          env={**__import__("os").environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proof = json.loads((tmp_path / "proof.json").read_text())
    assert proof["dry_run"] is True
    rows = {r["stage"]: r for r in proof["a"]["stages"]}
    assert all("failed" not in r and r["tokens_per_s"] > 0 for r in rows.values()), rows
    assert rows["sft"]["padding_fraction"] < rows["sft"]["padding_fraction_unpacked"]  # packed: less padding
    assert all(s["status"] == "completed" for s in proof["c"]["stages"].values())
    assert proof["c"]["stages"]["dpo"]["accelerate"] == "zero3"
    assert "| dpo | completed |" in (tmp_path / "proof.md").read_text()
    assert proof["f"]["gap"] < 1e-4 and all(proof["f"][m]["seconds"] > 0 for m in ("off", "on"))  # the fused head
    assert "(f) PPO's training pass" in (tmp_path / "proof.md").read_text()
    assert set(proof["steps"].values()) == {"0"}, proof["steps"]  # every step's exit code
    import tarfile
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:  # what comes back from a lent GPU: the logs, no models
        names = tar.getnames()
    assert "./steps/a.log" in names and any(n.endswith("dpo/manifest.json") for n in names), names[:20]
    assert any(n.endswith("ppo/stage.log") for n in names) and "./steps/f.json" in names, names[:20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "proof.json", "proof.md", "work"]


def test_gpu_proof_out_of_time_still_writes_its_summary_and_fails(tmp_path):
    """A budget too short for the proof: a step is stopped at its deadline or skipped, the last one always, and the
    summary and archive are still written (what a lent GPU returns), from whatever the stopped step
    left, with a non-zero exit naming the steps that did not complete."""
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--dry-run", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHON": sys.executable, "PROOF_BUDGET_S": "55"})
    assert proc.returncode != 0 and "not every step completed" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    proof = json.loads((tmp_path / "proof.json").read_text())
    # 55 s less the 30 kept back and the version check: the first step stopped at its deadline or skipped, or (on a
    # fast machine: the tiny default pipeline in 17 s on an AMD EPYC with AVX-512) done; the last never has the time
    steps = proof["steps"]
    assert list(steps) == ["c", "f", "a"] and steps["a"] in ("124", "skipped"), steps
    assert all(rc in ("0", "124", "skipped") for rc in steps.values()), steps
    md = (tmp_path / "proof.md").read_text()
    assert f"gpu.py did not finish (rc {proof['steps']['a']})" in md and "| sft |" in md, md
    assert (tmp_path / "logs.tar.gz").is_file()


def test_gpu_proof_runs_only_the_steps_asked_for(tmp_path):
    """PROOF_STEPS: a second call in the same lease runs what the first had no time for, and reports only that;
    a step it does not have is refused before anything runs."""
    env = {**__import__("os").environ, "PYTHON": sys.executable}
    bad = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--dry-run", str(tmp_path / "bad")],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env={**env, "PROOF_STEPS": "f b"})
    assert bad.returncode == 2 and "no step 'b'; the steps are c f a e" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()  # refused before the output folder was made
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), "--dry-run", str(tmp_path / "f")],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={**env, "PROOF_STEPS": "f"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proof = json.loads((tmp_path / "f" / "proof.json").read_text())
    assert proof["steps"] == {"f": "0"} and proof["f"]["gap"] < 1e-4, proof["steps"]
    md = (tmp_path / "f" / "proof.md").read_text()
    assert "(f) PPO's training pass" in md and "(a, b, d)" not in md and "(c)" not in md, md
