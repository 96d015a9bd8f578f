"""PPO's training pass with and without the fused LM head (align/modeling/fused_head.py), side by side in one run:
seconds per forward + backward, the peak memory it adds, and the log-probs' largest difference.

The pass is PPO's (align/stages/ppo/models.py: response log-probs, entropies and the shared value head's values, and
a loss over all three) on a batch of sampled-looking sequences (random token ids: timing and memory do not depend on
the text). Each mode runs in a fresh process, alternating, `--rounds` times; a process loads the model, builds the
batch, runs one untimed pass and `--steps` timed ones. Peak memory: on a GPU `torch.cuda.max_memory_allocated`, on a
CPU the process's peak resident set (sampled every 2 ms) less what it held before the first pass.

    python benchmarks/fused_head.py                     # SmolLM2-135M (the packaged model: `align model smollm2`)
    python benchmarks/fused_head.py --model DIR --batch 4 --prompt 256 --response 1024
    python benchmarks/fused_head.py --model-config pipelines/model_configs/llama-3.2-1b --dtype bfloat16  # random init
    python benchmarks/fused_head.py --tiny              # the tests' version (seconds; figures mean nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from padding_free import machine  # noqa: E402


def smollm2() -> str:
    from align.orchestrator.packaged import fetch  # the packaged model, fetched and converted once into the cache

    return str(fetch("smollm2"))


class PeakRSS:
    """The largest resident set this process reaches above what it held when started, sampled every 2 ms from
    /proc/self/statm (ru_maxrss would report model loading's peak, which can exceed the pass's)."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self.now()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self.page

    def run(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return max(self.peak, self.now()) - self.base


def worker(args) -> dict:
    """One mode in this process: JSON of seconds per pass, the memory the passes added and the log-probs."""
    import torch

    from align.modeling.fused_head import set_fused_head
    from align.modeling.losses import masked_mean
    from align.stages.ppo.models import PolicyAndValue

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM
        policy = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2))
    elif args.model_config:
        from transformers import AutoConfig, AutoModelForCausalLM
        with device:  # initialised where it runs: a 1B random init on the host takes longer than the passes
            policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_config), dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM
        policy = AutoModelForCausalLM.from_pretrained(args.model or smollm2(), dtype=dtype)
    model = PolicyAndValue(policy.to(device), value_head=torch.nn.Linear(policy.config.hidden_size, 1).to(device,
                                                                                                        dtype))
    b, q, lr = args.batch, args.prompt, args.response
    ids = torch.randint(0, policy.config.vocab_size, (b, q + lr), device=device)
    mask = torch.ones_like(ids)
    for i in range(b):  # responses of different lengths, right-padded, as sampled ones are
        mask[i, q + lr - (i * lr) // (2 * b):] = 0
    set_fused_head(args.worker)

    def step():
        model.zero_grad(set_to_none=True)
        logprobs, entropy, values = model(ids, mask, q, temperature=0.7)
        rmask = mask[:, q:]
        loss = -masked_mean(logprobs, rmask) - 0.01 * masked_mean(entropy, rmask) + masked_mean(values ** 2, rmask)
        loss.backward()
        return logprobs.detach() * rmask

    sampler = PeakRSS() if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    logprobs = step()  # untimed (first-call costs), but its memory counts: gradients are allocated here
    seconds = []
    for _ in range(args.steps):
        if device.type == "cuda":  # the warm-up's (or the last pass's) queued kernels finish outside the timing
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - before if sampler is None else sampler.stop()
    tokens = int(mask[:, q:].sum())
    return {"seconds": seconds, "peak_bytes": peak, "tokens": tokens, "vocab": policy.config.vocab_size,
            "device": str(device), "logprobs": logprobs.cpu().tolist()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a causal LM directory (default: the packaged SmolLM2-135M)")
    parser.add_argument("--model-config", help="a directory with a config.json: that model, randomly initialised")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' dtype")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="processes per mode, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (the tests' version)")
    parser.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.prompt, args.response, args.steps, args.rounds = 2, 8, 16, 1, 1
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    print(f"machine: {machine()}; seed {args.seed}; batch {args.batch} x ({args.prompt} prompt + {args.response} "
          f"response) tokens; {args.steps} timed passes x {args.rounds} processes per mode", flush=True)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    flags = [a for a in (argv if argv is not None else sys.argv[1:])]
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            out = subprocess.run([sys.executable, __file__, *flags, "--worker", mode], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     [str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))})
            if out.returncode != 0:
                sys.exit(f"fused_head {mode}: worker failed:\n{out.stderr[-3000:]}")
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    gap = max(abs(a - b) for ra, rb in zip(runs["off"][0]["logprobs"], runs["on"][0]["logprobs"])
              for a, b in zip(ra, rb))
    result = {}
    print(f"\n{runs['on'][0]['tokens']} response tokens, vocabulary {runs['on'][0]['vocab']}, "
          f"device {runs['on'][0]['device']}; max log-prob gap on vs off {gap:.2e}\n")
    print("| fused head | s per pass (median) | all | peak memory of the passes (MB, max over processes) |")
    print("|---|---|---|---|")
    for mode in ("off", "on"):
        secs = [s for r in runs[mode] for s in r["seconds"]]
        peak = max(r["peak_bytes"] for r in runs[mode]) / 2**20
        result[mode] = {"seconds": statistics.median(secs), "peak_mb": peak}
        print(f"| {mode} | {statistics.median(secs):.3f} | {min(secs):.3f}-{max(secs):.3f} | {peak:,.0f} |")
    result["gap"] = gap
    result["device"], result["tokens"], result["vocab"] = (runs["on"][0][k] for k in ("device", "tokens", "vocab"))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
